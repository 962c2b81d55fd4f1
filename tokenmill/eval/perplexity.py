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


def cached_prefix_nlls(llm: LLM, token_ids: list[int], windows: list[Window], show_progress: bool = True
                       ) -> tuple[list[float], dict[str, int]]:
    """-log p of every scored token, each window's earlier tokens read from the prefix cache.

    First every window's context up to its scored tokens (whole blocks; never the position
    whose logits score the first of them) is prefilled once, then, with a host tier
    (--kv-offloading-size), pushed out of the pool by prompts of other tokens, and finally
    each window is scored with those blocks read back: from the host tier (or the disk
    under it), so what a tier stores them as (e.g. --kv-offloading-cache-dtype int8) is
    what is measured; without a tier, from the pool. Returns the NLLs and where the cached
    tokens came from (raises if a window's context was not read back whole)."""
    from tokenmill.sampling.params import SamplingParams

    engine = llm.engine
    block_size = engine.facts.block_size
    kv = engine.scheduler.kv
    host = getattr(kv, "host_tier", None)
    contexts = [((w.length - w.num_scored - 1) // block_size) * block_size for w in windows]
    primes = [token_ids[w.start : w.start + n + 1] if n > 0 else [] for w, n in zip(windows, contexts)]
    greedy_one = SamplingParams(max_tokens=1, temperature=0.0)
    bar = tqdm(total=2 * len(windows), desc="cached-prefix perplexity", unit="request", disable=not show_progress)
    if host is not None:  # every context first, then all of them out of the pool
        for prime in primes:
            if prime:
                llm.generate([prime], greedy_one)
            bar.update(1)
        _push_out_of_pool(llm, engine.facts.num_blocks, block_size)
    before = _tier_hit_tokens(host)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    nlls: list[float] = []
    cached = 0
    for window, context, prime in zip(windows, contexts, primes):
        if host is None:  # each context just before its window: the pool holds one at a time
            if prime:
                llm.generate([prime], greedy_one)
            bar.update(1)
        request = engine.input_processor.process(engine.new_request_id(), token_ids[window.start : window.end], params,
                                                 arrival_time=engine.clock())
        for sample in request.samples:
            sample.prompt_logprobs_from_cache = True
        output = llm._add_and_run([request], use_tqdm=False)[0]
        if output.num_cached_tokens != context:
            raise RuntimeError(f"window at token {window.start}: {output.num_cached_tokens} of its {context} context "
                               "tokens came from the cache (the host tier must hold every window's context and "
                               "the pool one window: raise --kv-offloading-size or --kv-cache-memory)")
        cached += context
        nlls.extend(_window_nlls(token_ids, window, output.prompt_logprobs))
        bar.update(1)
    bar.close()
    after = _tier_hit_tokens(host)
    from_tiers = {name: after[name] - before[name] for name in after}
    return nlls, {"cached_tokens": cached, "from_pool": cached - sum(from_tiers.values()), **from_tiers}


def _push_out_of_pool(llm: LLM, num_blocks: int, block_size: int) -> None:
    """Prefill prompts of other tokens until every block in the pool has been reused, so
    what was cached before lives only in the tiers below it."""
    from tokenmill.sampling.params import SamplingParams

    max_len = llm.engine.facts.max_model_len - 1
    filler_blocks = max(1, min(max_len, num_blocks * block_size) // block_size - 1)
    rounds = -(-num_blocks // filler_blocks) + 1
    vocab = llm.engine.facts.vocab_size
    for i in range(rounds):  # distinct token runs: nothing here hits what came before
        prompt = [(17 + 7919 * (i * filler_blocks * block_size + j)) % vocab for j in range(filler_blocks * block_size)]
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))


def _tier_hit_tokens(host: Any) -> dict[str, int]:
    if host is None:
        return {}
    disk = getattr(host, "disk", None)
    return {"from_host_tier": host.stats.hit_tokens, "from_disk_tier": disk.stats.hit_tokens if disk else 0}


def _window_nlls(token_ids: list[int], window: Window, prompt_logprobs: list) -> list[float]:
    # prompt_logprobs[p] scores the window's token p from tokens 0..p-1 (None at p = 0).
    first = window.length - window.num_scored
    return [-prompt_logprobs[p][token_ids[window.start + p]].logprob for p in range(first, window.length)]


def perplexity(llm: LLM, token_ids: list[int], context_len: int, stride: int,
               show_progress: bool = True, cached_prefix: bool = False) -> PerplexityResult:
    """`cached_prefix`: each window's context is read back from the prefix cache (and its
    tiers) instead of computed with the window (`cached_prefix_nlls`)."""
    windows = sliding_windows(len(token_ids), context_len, stride)
    start = time.perf_counter()
    cache_use: dict[str, int] = {}
    if cached_prefix:
        nlls, cache_use = cached_prefix_nlls(llm, token_ids, windows, show_progress)
    else:
        nlls = token_nlls(llm, token_ids, windows, show_progress)
    seconds = time.perf_counter() - start
    nll = math.fsum(nlls) / len(nlls)
    facts = llm.engine.facts
    settings = {
        "model": facts.model_name, "weight_format": facts.weight_format, "compute_dtype": facts.compute_dtype,
        "kv_cache_dtype": facts.kv_cache_dtype, "kv_cache_format": facts.kv_cache_format,
        "attention_backend": facts.attention_backend,
        "tokens_computed": sum(w.length for w in windows) - cache_use.get("cached_tokens", 0),
        "kv_offloading_cache_dtype": llm.engine.config.cache.kv_offloading_cache_dtype,
        **({"cached_prefix": cache_use} if cached_prefix else {}),
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
