"""Perplexity of a text through the engine's own paged path.

The text's tokens are cut into windows of `context_len` tokens that start every `stride`
tokens (Hugging Face's sliding-window recipe): each window is one request whose prompt
log-probabilities the engine computes (`SamplingParams(prompt_logprobs=0)`), so the real
scheduler, runner, paged attention and KV cache (in its --kv-cache-dtype) produce them.
Each token after the first is scored exactly once, in the first window that holds it after
its predecessor: so with stride < context_len every scored token but those of the first
window sees at least context_len - stride tokens of context.

perplexity = exp(sum of -log p(token | its window's earlier tokens) / tokens scored).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

if TYPE_CHECKING:
    from tokenmill.llm import LLM

DEFAULT_TEXT = "opticks-queries.txt"


def default_text_path() -> Path:
    """The shipped public-domain text (see tokenmill/eval/data/README.md)."""
    return Path(str(resources.files("tokenmill.eval") / "data" / DEFAULT_TEXT))


@dataclass(frozen=True)
class Window:
    start: int  # index of the window's first token in the text
    end: int  # one past its last
    num_scored: int  # its last num_scored tokens are scored

    @property
    def length(self) -> int:
        return self.end - self.start


def sliding_windows(num_tokens: int, context_len: int, stride: int) -> list[Window]:
    """Windows [start, end) every `stride` tokens, up to `context_len` long, until the text
    ends; each scores the tokens the windows before it did not."""
    if context_len < 2:
        raise ValueError(f"context_len must be at least 2 tokens, got {context_len}")
    if not 1 <= stride <= context_len:
        raise ValueError(f"stride must be between 1 and context_len ({context_len}), got {stride}")
    if num_tokens < 2:
        raise ValueError(f"the text must have at least 2 tokens to score one, got {num_tokens}")
    windows, scored_to = [], 1  # token 0 has no context: never scored
    for start in range(0, num_tokens, stride):
        end = min(start + context_len, num_tokens)
        windows.append(Window(start, end, end - scored_to))
        scored_to = end
        if end == num_tokens:
            break
    return windows


@dataclass
class PerplexityResult:
    perplexity: float
    nll_per_token: float  # mean negative log-likelihood, nats
    num_scored: int
    num_text_tokens: int
    num_windows: int
    context_len: int
    stride: int
    seconds: float
    settings: dict[str, Any] = field(default_factory=dict)  # model, dtypes, KV cache, text

    @property
    def tokens_per_second(self) -> float:
        """Tokens the engine computed (every window's prompt) per second."""
        return self.settings.get("tokens_computed", 0) / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


def token_nlls(llm: LLM, token_ids: list[int], windows: list[Window], show_progress: bool = True) -> list[float]:
    """-log p of every scored token, in text order, each from its window's request."""
    from tokenmill.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    config = llm.engine.config.scheduler
    # One step's worth of windows per generate call: the bar moves, the batch stays full.
    group = max(1, min(config.max_num_seqs, config.max_num_batched_tokens // max(w.length for w in windows)))
    nlls: list[float] = []
    bar = tqdm(total=sum(w.num_scored for w in windows), desc="perplexity", unit="tok", disable=not show_progress)
    for first in range(0, len(windows), group):
        chunk = windows[first : first + group]
        outputs = llm.generate([token_ids[w.start : w.end] for w in chunk], params)
        for window, output in zip(chunk, outputs):
            nlls.extend(_window_nlls(token_ids, window, output.prompt_logprobs))
            bar.update(window.num_scored)
    bar.close()
    return nlls


def _window_nlls(token_ids: list[int], window: Window, prompt_logprobs: list) -> list[float]:
    # prompt_logprobs[p] scores the window's token p from tokens 0..p-1 (None at p = 0).
    first = window.length - window.num_scored
    return [-prompt_logprobs[p][token_ids[window.start + p]].logprob for p in range(first, window.length)]


def perplexity(llm: LLM, token_ids: list[int], context_len: int, stride: int,
               show_progress: bool = True) -> PerplexityResult:
    windows = sliding_windows(len(token_ids), context_len, stride)
    start = time.perf_counter()
    nlls = token_nlls(llm, token_ids, windows, show_progress)
    seconds = time.perf_counter() - start
    nll = math.fsum(nlls) / len(nlls)
    facts = llm.engine.facts
    settings = {
        "model": facts.model_name, "weight_format": facts.weight_format, "compute_dtype": facts.compute_dtype,
        "kv_cache_dtype": facts.kv_cache_dtype, "kv_cache_format": facts.kv_cache_format,
        "attention_backend": facts.attention_backend,
        "tokens_computed": sum(w.length for w in windows),
    }
    return PerplexityResult(math.exp(nll), nll, len(nlls), len(token_ids), len(windows), context_len, stride,
                            seconds, settings)


def format_table(results: list[PerplexityResult]) -> str:
    """A markdown table, one row per result."""
    header = ("model", "weights", "KV cache", "context", "stride", "tokens scored", "perplexity", "NLL/token",
              "seconds")
    rows = [
        (r.settings.get("model", ""), r.settings.get("weight_format", ""),
         r.settings.get("kv_cache_format") or r.settings.get("kv_cache_dtype", ""),
         str(r.context_len), str(r.stride), f"{r.num_scored:,}", f"{r.perplexity:.4f}", f"{r.nll_per_token:.5f}",
         f"{r.seconds:.1f}")
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
