"""Prompts for `tokenmill bench serve`: random, shared-prefix, JSONL and input-grounded
datasets (`grounded`: chat messages asking to repeat, correct, rewrite or summarize a
passage given in the prompt, `tokenmill.workloads.grounded`; the answers end at EOS),
and the agent workloads (`structured`: JSON-schema answers over schemas of increasing
size; `tool-calls`: a multi-turn tool-calling trace; `tokenmill.workloads.agent`).

Random prompts are random token ids. Which ids are ordinary tokens comes from one of
three token sources, in this order:

1. `--tokenizer PATH` (a GGUF file or a Hugging Face directory, or `default` for
   tokenmill's default model): every id but special and added tokens;
2. the server's `/tokenize` (tokenmill, vLLM, llama.cpp's server): the ids of a
   fixed text of random letter strings, a pool of ~1,600 ordinary tokens (SmolLM2);
3. neither: ids 1000..4999, which every vocabulary of a modern LLM has.

/v1/completions takes the token ids as they are, so a completion prompt has exactly
the length asked for. /v1/chat/completions needs text: the ids are detokenized
(locally or through the server's `/detokenize`), re-tokenized, and cut back to the
asked length when the round trip made them longer; the server then adds its chat
template. The lengths reported are the server's own count (usage.prompt_tokens).
"""

from __future__ import annotations

import json
import logging
import math
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np

logger = logging.getLogger(__name__)

DATASETS = ("random", "shared-prefix", "jsonl", "grounded", "structured", "tool-calls")
CHAT_ONLY = ("tool-calls",)  # tools need /v1/chat/completions
NEEDS_TOKEN_SOURCE = ("random", "shared-prefix")  # prompts made of token ids
FALLBACK_ID_RANGE = (1000, 5000)
# Keys of a JSONL line that give its output length, first match wins.
OUTPUT_LEN_KEYS = ("output_len", "output_tokens", "max_tokens")


@dataclass
class SampleRequest:
    """One request to send: a completion prompt (text or token ids) or chat messages."""

    prompt: str | list[int] | None
    output_len: int
    prompt_len: int | None = None  # client-side length when known; the server's count wins
    messages: list[dict[str, Any]] | None = None
    extra: dict[str, Any] | None = None  # request fields of its own (response_format, tools, ...)


@dataclass
class DatasetConfig:
    name: str = "random"
    num_prompts: int = 100
    input_len: int = 512
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0  # random: shared prefix (0: none); shared-prefix: default 512 when 0
    num_prefixes: int = 1  # shared-prefix: distinct prefixes, assigned round-robin
    path: str | None = None
    seed: int = 0

    def check(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r}; choose from {', '.join(DATASETS)}")
        if self.name == "jsonl" and not self.path:
            raise ValueError("--dataset jsonl needs --dataset-path FILE")
        if self.name != "jsonl" and self.path:
            raise ValueError(f"--dataset-path is for --dataset jsonl, not {self.name}")
        if self.num_prompts <= 0:
            raise ValueError(f"--num-prompts must be > 0, got {self.num_prompts}")
        if self.name != "jsonl" and self.input_len <= 0:
            raise ValueError(f"--input-len must be > 0, got {self.input_len}")
        if self.output_len <= 0:
            raise ValueError(f"--output-len must be > 0, got {self.output_len}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.prefix_len < 0 or self.num_prefixes <= 0:
            raise ValueError("--prefix-len must be >= 0 and --num-prefixes > 0")

    @property
    def effective_prefix_len(self) -> int:
        if self.name == "shared-prefix" and self.prefix_len == 0:
            return 512
        return self.prefix_len


# ----- token sources ---------------------------------------------------------------------


class TokenSource(Protocol):
    description: str
    pool: list[int]
    can_detokenize: bool

    async def tokenize(self, text: str) -> list[int]: ...

    async def detokenize(self, ids: list[int]) -> str: ...


class LocalTokenSource:
    """A tokenmill Tokenizer loaded from a GGUF file or a Hugging Face directory."""

    can_detokenize = True

    def __init__(self, spec: str) -> None:
        from tokenmill.tokenizer import Tokenizer

        path = spec
        if spec == "default":
            from tokenmill.config import default_model_path

            path = default_model_path()
        try:
            self.tokenizer = Tokenizer.from_model_path(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"--tokenizer {spec!r}: no such GGUF file or Hugging Face directory") from None
        from tokenmill.workloads.offline import ordinary_token_ids

        self.pool = ordinary_token_ids(self.tokenizer, self.tokenizer.vocab_size)
        self.description = f"local tokenizer {path}"

    async def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


class ServerTokenSource:
    """The server's /tokenize and /detokenize, in vLLM's and tokenmill's shape
    ({"prompt": ...} -> {"tokens": [...]}, {"tokens": [...]} -> {"prompt": ...}) or
    llama.cpp's ({"content": ...} -> {"tokens": [...]}, -> {"content": ...})."""

    can_detokenize = True

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str, headers: dict[str, str]) -> None:
        self.client = client
        self.base_url = base_url
        self.model = model
        self.headers = headers
        self.pool: list[int] = []
        self.description = f"{base_url}/tokenize"

    async def load(self) -> None:
        """Fill the pool from a fixed text of random letter strings (independent of --seed)."""
        words = pool_text().split(" ")
        pool: set[int] = set()
        for start in range(0, len(words), 200):  # ~600 tokens a request: below any max_model_len
            pool.update(await self.tokenize(" ".join(words[start:start + 200])))
        self.pool = sorted(pool)
        if len(self.pool) < 100:
            raise ValueError(f"/tokenize gave only {len(self.pool)} distinct tokens")

    async def _post(self, path: str, bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
        error = ""
        for body in bodies:
            response = await self.client.post(self.base_url + path, json=body, headers=self.headers)
            if response.status_code == 200:
                return response.json()
            error = f"HTTP {response.status_code}: {response.text[:200]}"
        raise ValueError(f"{self.base_url}{path} failed: {error}")

    async def tokenize(self, text: str) -> list[int]:
        data = await self._post("/tokenize", [
            {"model": self.model, "prompt": text, "add_special_tokens": False},
            {"content": text, "add_special": False},
        ])
        return [t if isinstance(t, int) else t["id"] for t in data["tokens"]]

    async def detokenize(self, ids: list[int]) -> str:
        data = await self._post("/detokenize", [{"model": self.model, "tokens": ids}, {"tokens": ids}])
        text = data.get("prompt", data.get("content"))
        if not isinstance(text, str):
            raise ValueError(f"{self.base_url}/detokenize answered without text: {str(data)[:200]}")
        return text


class IdRangeSource:
    """No tokenizer anywhere: ids from a range every modern vocabulary has (completions only)."""

    can_detokenize = False

    def __init__(self, low: int = FALLBACK_ID_RANGE[0], high: int = FALLBACK_ID_RANGE[1]) -> None:
        self.pool = list(range(low, high))
        self.description = f"token ids {low}..{high - 1} (no tokenizer: the server has no /tokenize)"

    async def tokenize(self, text: str) -> list[int]:
        raise ValueError("no tokenizer: pass --tokenizer")

    async def detokenize(self, ids: list[int]) -> str:
        raise ValueError("no tokenizer to turn random token ids into chat text: pass --tokenizer")


def pool_text(words: int = 4000) -> str:
    """A fixed text of random letter strings (mixed case, some digits and punctuation),
    whose tokenization touches a few thousand distinct ordinary tokens."""
    rng = np.random.default_rng(12345)
    letters = np.array(list(string.ascii_lowercase))
    parts = []
    for _ in range(words):
        word = "".join(rng.choice(letters, size=int(rng.integers(2, 10))))
        roll = rng.random()
        if roll < 0.15:
            word = word.capitalize()
        elif roll < 0.2:
            word = str(int(rng.integers(0, 10_000)))
        elif roll < 0.25:
            word += str(rng.choice(list(",.;:!?")))
        parts.append(word)
    return " ".join(parts)


# ----- datasets --------------------------------------------------------------------------


def lengths(rng: np.random.Generator, mean: int, range_ratio: float, count: int, minimum: int = 1) -> list[int]:
    """`count` integers uniform in [floor(mean * (1 - r)), ceil(mean * (1 + r))], as vLLM draws them."""
    low = max(minimum, int(math.floor(mean * (1 - range_ratio))))
    high = max(low, int(math.ceil(mean * (1 + range_ratio))))
    return [int(n) for n in rng.integers(low, high + 1, size=count)]


def random_token_prompts(config: DatasetConfig, pool: Sequence[int], count: int,
                         rng: np.random.Generator) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs: a shared prefix (one of num_prefixes, round-robin;
    none when prefix_len is 0) followed by a random suffix of --input-len tokens."""
    pool_array = np.asarray(pool)
    prefix_len = config.effective_prefix_len
    prefixes = [rng.choice(pool_array, size=prefix_len).tolist() for _ in range(config.num_prefixes)]
    input_lens = lengths(rng, config.input_len, config.range_ratio, count)
    output_lens = lengths(rng, config.output_len, config.range_ratio, count)
    prompts = []
    for i, (n_in, n_out) in enumerate(zip(input_lens, output_lens)):
        suffix = rng.choice(pool_array, size=n_in).tolist()
        prompts.append((prefixes[i % config.num_prefixes] + suffix, n_out))
    return prompts


async def chat_text(ids: list[int], source: TokenSource) -> str:
    """Text of about len(ids) tokens: the ids' text, cut back if the round trip grew it."""
    text = await source.detokenize(ids)
    again = await source.tokenize(text)
    if len(again) > len(ids):
        text = await source.detokenize(again[: len(ids)])
    return text


async def build_requests(config: DatasetConfig, source: TokenSource | None, chat: bool,
                         count: int | None = None, seed_offset: int = 0) -> list[SampleRequest]:
    """`count` (default --num-prompts) requests of the dataset, drawn from --seed + seed_offset."""
    config.check()
    count = config.num_prompts if count is None else count
    if config.name == "jsonl":
        return load_jsonl(config.path or "", count, config.output_len, chat)
    if config.name == "grounded":
        return grounded_requests(count, config.output_len, chat, config.seed + seed_offset)
    if config.name in ("structured", "tool-calls"):
        return agent_requests(config.name, count, config.output_len, chat, config.seed + seed_offset)
    if source is None:
        raise ValueError(f"the {config.name} dataset needs a token source")
    rng = np.random.default_rng(config.seed + seed_offset)
    requests = []
    for ids, output_len in random_token_prompts(config, source.pool, count, rng):
        if chat:
            if not source.can_detokenize:
                raise ValueError(
                    "chat prompts need text: the server has no /detokenize, so pass --tokenizer "
                    "(a GGUF file or Hugging Face directory of the served model)"
                )
            text = await chat_text(ids, source)
            requests.append(SampleRequest(None, output_len, None, [{"role": "user", "content": text}]))
        else:
            requests.append(SampleRequest(ids, output_len, len(ids)))
    return requests


def grounded_requests(count: int, output_len: int, chat: bool, seed: int) -> list[SampleRequest]:
    """Chat messages, or for /v1/completions the same text as a plain prompt."""
    import random

    from tokenmill.workloads.grounded import grounded_messages

    return [SampleRequest(None, output_len, None, messages) if chat
            else SampleRequest(messages[0]["content"], output_len)
            for messages in grounded_messages(count, random.Random(seed))]


def agent_requests(name: str, count: int, output_len: int, chat: bool, seed: int) -> list[SampleRequest]:
    """The structured-output or tool-calling workload; a completion prompt is the user's
    text (structured only: tools need chat)."""
    import random

    from tokenmill.workloads.agent import structured_requests, tool_call_requests

    if name in CHAT_ONLY and not chat:
        raise ValueError(f"the {name} dataset needs --endpoint /v1/chat/completions")
    make = structured_requests if name == "structured" else tool_call_requests
    return [SampleRequest(None, output_len, None, messages, extra) if chat
            else SampleRequest(messages[-1]["content"], output_len, None, None, extra)
            for messages, extra in make(count, random.Random(seed))]


def load_jsonl(path: str, count: int, default_output_len: int, chat: bool) -> list[SampleRequest]:
    """One request per line: {"prompt": TEXT or [TOKEN IDS]} or {"messages": [...]}, with an
    optional output length under one of OUTPUT_LEN_KEYS (else --output-len). The first
    `count` lines are used; fewer lines give fewer requests."""
    requests: list[SampleRequest] = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if len(requests) >= count:
                break
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{path}:{number}: expected an object with 'prompt' or 'messages'")
            output_len = next((item[k] for k in OUTPUT_LEN_KEYS if item.get(k) is not None), default_output_len)
            if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len <= 0:
                raise ValueError(f"{path}:{number}: the output length must be a positive integer")
            prompt, messages = item.get("prompt"), item.get("messages")
            if messages is not None:
                if not chat:
                    raise ValueError(f"{path}:{number}: 'messages' needs --endpoint /v1/chat/completions")
                requests.append(SampleRequest(None, output_len, None, messages))
            elif isinstance(prompt, str):
                if chat:
                    requests.append(SampleRequest(None, output_len, None, [{"role": "user", "content": prompt}]))
                else:
                    requests.append(SampleRequest(prompt, output_len, None))
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                if chat:
                    raise ValueError(f"{path}:{number}: token-id prompts need --endpoint /v1/completions")
                requests.append(SampleRequest(prompt, output_len, len(prompt)))
            else:
                raise ValueError(f"{path}:{number}: 'prompt' must be text or a list of token ids")
    if not requests:
        raise ValueError(f"{path}: no requests")
    if len(requests) < count:
        logger.warning("%s has %d requests, fewer than --num-prompts %d", path, len(requests), count)
    return requests
