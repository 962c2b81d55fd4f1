"""The composition root: an EngineConfig in, a running engine out.

`build_executor` resolves the device and dtypes, loads the model (and a draft model for
speculative decoding), chooses the execution plan and the attention backend, allocates the
KV cache and builds the runner and the proposer; it returns them with the tokenizer and
the `EngineFacts` found on the way. `build_engine` wraps that in an `LLMEngine`. `LLM`,
`tokenmill serve` and the bench all start here.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.kv_cache import KVCacheSpec, PagedKVCache
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.config import EngineConfig, EngineFacts, SpeculativeConfig
from tokenmill.engine.engine import LLMEngine, Proposer
from tokenmill.hardware import cpu_info
from tokenmill.model.loader import LoadedModel, load_model
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.runner.plan import ExecutionPlan, apply_plan, cpu_native_plan, reference_plan
from tokenmill.spec_decode.draft import DraftModelProposer, check_draft
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BuiltExecutor:
    executor: ModelRunner
    tokenizer: Tokenizer
    facts: EngineFacts
    proposer: Proposer | None = None  # speculative decoding's


def build_engine(config: EngineConfig) -> LLMEngine:
    built = build_executor(config)
    return LLMEngine(config, built.executor, built.tokenizer, built.facts, proposer=built.proposer)


def build_executor(config: EngineConfig) -> BuiltExecutor:
    start = time.perf_counter()
    device = resolve_device(config.device.device)
    threads = set_compute_threads(config, device)
    dtype = resolve_dtype(config.model.dtype, device)
    loaded = load_model(config.model.model, dtype.compute, device, max_positions=config.model.max_model_len)
    max_model_len = resolve_max_model_len(config, loaded)
    speculative = config.speculative.speculative_config
    kernels_ok = device.type == "cpu" and config.device.native_kernels and _cpu_kernels_build()
    draft = load_draft(config, device, loaded, max_model_len, dtype, kernels_ok) if _has_draft(speculative) else None
    backend = select_attention_backend(config.device.attention_backend, device, kernels_ok)
    plan = apply_plan(loaded.model, choose_plan(config, device, dtype, kernels_ok, backend))
    spec = KVCacheSpec(loaded.arch.num_layers, loaded.arch.num_kv_heads, loaded.arch.head_dim,
                       config.cache.block_size, _DTYPES[dtype.kv_cache])
    memory = config.cache.kv_cache_memory or default_kv_cache_memory(device)
    # A draft keeps the KV of the same tokens: the memory is split so both hold as many.
    bytes_per_block = spec.bytes_per_block + (draft.kv_spec.bytes_per_block if draft else 0)
    num_blocks = memory // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory {memory} bytes is less than one KV block ({bytes_per_block} bytes)")
    kv_cache = PagedKVCache(spec, num_blocks, device)
    runner = ModelRunner(loaded.model, kv_cache, backend, plan, device, seed=config.model.seed)
    proposer = build_proposer(config, runner, draft, kernels_ok) if speculative else None
    facts = EngineFacts(
        model_name=loaded.name, model_path=loaded.path, architecture=loaded.arch.architecture,
        vocab_size=loaded.arch.vocab_size, max_model_len=max_model_len, device=str(device),
        compute_dtype=dtype.compute, weight_format=plan.weight_format.name, kv_cache_dtype=dtype.kv_cache,
        num_blocks=num_blocks, block_size=config.cache.block_size, kv_bytes_per_token=spec.bytes_per_token,
        attention_backend=backend.name, execution_plan=plan.describe(), num_threads=threads,
        load_seconds=time.perf_counter() - start, speculative=describe_speculation(speculative, proposer),
    )
    logger.info(
        "loaded %s (%s) on %s in %.1f s: %d KV blocks of %d tokens (%.2f GiB, %d bytes per token), "
        "max_model_len %d, attention %s", loaded.name, dtype, device, facts.load_seconds, num_blocks,
        spec.block_size, kv_cache.nbytes / 2**30, spec.bytes_per_token, max_model_len, backend.name,
    )
    logger.info("execution plan (%s): %s", plan.tier, plan.describe())
    if proposer is not None:
        logger.info("speculative decoding: %s", facts.speculative)
    return BuiltExecutor(runner, loaded.tokenizer, facts, proposer)


# ----- speculative decoding ------------------------------------------------------------------


@dataclass
class LoadedDraft:
    loaded: LoadedModel
    dtype: DtypePlan
    kv_spec: KVCacheSpec


def _has_draft(speculative: SpeculativeConfig | None) -> bool:
    return speculative is not None and speculative.method == "draft_model"


def load_draft(config: EngineConfig, device: torch.device, target: LoadedModel, max_model_len: int,
               target_dtype: DtypePlan, kernels_ok: bool) -> LoadedDraft:
    """Load the draft model and check it can propose for the target (same tokenizer,
    context for max_model_len) before anything is allocated."""
    speculative = config.speculative.speculative_config
    dtype = resolve_draft_dtype(speculative.dtype or config.model.dtype, device, target_dtype, kernels_ok)
    draft = load_model(speculative.model, dtype.compute, device, max_positions=max_model_len)
    check_draft(draft.arch.vocab_size, target.arch.vocab_size, _token_table(draft.tokenizer),
                _token_table(target.tokenizer), draft.context_len, draft.arch.sliding_window, max_model_len)
    kv_spec = KVCacheSpec(draft.arch.num_layers, draft.arch.num_kv_heads, draft.arch.head_dim,
                          config.cache.block_size, _DTYPES[dtype.kv_cache])
    return LoadedDraft(draft, dtype, kv_spec)


def resolve_draft_dtype(dtype: str, device: torch.device, target: DtypePlan, kernels_ok: bool) -> DtypePlan:
    """As the target's, except a bfloat16 draft beside a float32 target on a CPU with the
    native kernels: bfloat16 weights with float32 compute even where the CPU computes
    bf16 natively. A draft only runs decode steps of a few rows, where the tiled bf16
    weights and the fused decode layer are fastest (measured 0.67x a float32 decode step
    on a Xeon with AMX, against 1.02x for bf16 compute by PyTorch ops)."""
    if dtype == "bfloat16" and device.type == "cpu" and kernels_ok and target.compute == "float32":
        return DtypePlan(compute="float32", weights="bfloat16", kv="bfloat16")
    return resolve_dtype(dtype, device)


def build_proposer(config: EngineConfig, runner: ModelRunner, draft: LoadedDraft | None,
                   kernels_ok: bool) -> Proposer:
    """n-gram: model-free. Draft model: its own plan, runner and KV cache (as many
    tokens as the target's, plus room for every running request's proposals); the target
    runner asks it for the distributions its proposals were drawn from."""
    speculative = config.speculative.speculative_config
    k = speculative.num_speculative_tokens
    if speculative.method == "ngram":
        return NgramProposer(k, speculative.prompt_lookup_min, speculative.prompt_lookup_max)
    device = runner.device
    plan = apply_plan(draft.loaded.model, choose_plan(config, device, draft.dtype, kernels_ok, runner.backend))
    block_size = config.cache.block_size
    lookahead = config.scheduler.max_num_seqs * -(-(k - 1) // block_size)
    cache = PagedKVCache(draft.kv_spec, runner.kv_cache.num_blocks + lookahead, device)
    draft_runner = ModelRunner(draft.loaded.model, cache, runner.backend, plan, device, seed=config.model.seed)
    proposer = DraftModelProposer(draft_runner, k, config.scheduler.max_num_batched_tokens,
                                  config.cache.enable_prefix_caching, seed=config.model.seed)
    runner.draft_probs = proposer.draft_probs
    return proposer


def describe_speculation(speculative: SpeculativeConfig | None, proposer: Proposer | None) -> str:
    if speculative is None:
        return ""
    text = f"{speculative.method}, {speculative.num_speculative_tokens} tokens"
    if speculative.method == "ngram":
        return text + f", lookup {speculative.prompt_lookup_min}-{speculative.prompt_lookup_max}"
    runner = proposer.runner
    return (f"{text}, draft {speculative.model} ({runner.plan.describe()}; {runner.kv_cache.num_blocks} KV blocks, "
            f"{runner.kv_cache.nbytes / 2**30:.2f} GiB)")


def _token_table(tokenizer: Tokenizer) -> dict[str, int]:
    return tokenizer.backend.get_vocab(with_added_tokens=True)


# ----- what the config leaves to the machine ----------------------------------------------


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def set_compute_threads(config: EngineConfig, device: torch.device) -> int:
    if device.type == "cpu":
        torch.set_num_threads(config.device.num_threads or cpu_info().num_cores)
    return torch.get_num_threads()


def cpu_has_native_bf16() -> bool:
    return cpu_info().native_bf16


@dataclass(frozen=True)
class DtypePlan:
    compute: str  # activations
    weights: str  # how linear and embedding weights are stored
    kv: str = ""  # the KV cache; "" = compute

    @property
    def kv_cache(self) -> str:
        return self.kv or self.compute

    def __str__(self) -> str:
        if self.compute == self.weights == self.kv_cache:
            return self.compute
        stored = "weights and KV cache" if self.weights == self.kv_cache else f"weights, {self.kv_cache} KV cache"
        return f"{self.weights} {stored}, {self.compute} compute"


def resolve_dtype(dtype: str, device: torch.device) -> DtypePlan:
    """`auto`: bfloat16 on GPUs and on CPUs with bf16 arithmetic, float32 elsewhere.
    `bfloat16` on a CPU without bf16 arithmetic stores the weights in bfloat16 (half the
    bytes each decode step streams) and computes in float32, as llama.cpp does with a
    BF16 file there: bf16 matmuls would be emulated, several times slower. The KV cache is
    then bfloat16 too (as vLLM keeps it): batched decode attention streams half the bytes."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" or cpu_has_native_bf16() else "float32"
    if dtype == "bfloat16" and device.type == "cpu" and not cpu_has_native_bf16():
        return DtypePlan(compute="float32", weights="bfloat16", kv="bfloat16")
    return DtypePlan(compute=dtype, weights=dtype)


def choose_plan(config: EngineConfig, device: torch.device, dtype: DtypePlan, kernels_ok: bool,
                backend: AttentionBackend) -> ExecutionPlan:
    """On a float32-computing CPU with the native kernels: weights tiled for the decode
    kernels (plus oneDNN copies for many rows unless `pack_weights` is off), the native
    element-wise ops, and the fused decode layer when attention reads the cache natively.
    Elsewhere plain weights and PyTorch ops."""
    weights = _DTYPES[dtype.weights]
    if device.type == "cpu" and dtype.compute == "float32" and kernels_ok:
        return cpu_native_plan(weights, onednn=config.device.pack_weights, fused_decode=backend.name == "cpu_native")
    return reference_plan(weights)


def select_attention_backend(name: str, device: torch.device, kernels_ok: bool) -> AttentionBackend:
    if name == "torch_sdpa" or (name == "auto" and device.type != "cpu"):
        return TorchSDPABackend()
    if device.type != "cpu":
        raise ValueError(f"attention_backend {name!r} runs on the CPU only; use torch_sdpa on {device.type}")
    if kernels_ok:
        from tokenmill.attention.cpu_native import CPUNativeBackend

        return CPUNativeBackend()
    if name == "cpu_native":
        raise ValueError("attention_backend 'cpu_native' needs the native CPU kernels, which are turned off or failed "
                         "to build (see the warning above; `python -m tokenmill.kernels -v` shows the compiler output)")
    return TorchSDPABackend()


def default_kv_cache_memory(device: torch.device) -> int:
    """2 GiB on CPU, capped at a fifth of RAM; on a GPU half of its free memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(2 * 2**30, total // 5)


def resolve_max_model_len(config: EngineConfig, loaded: LoadedModel) -> int:
    requested = config.model.max_model_len
    max_model_len = requested or loaded.context_len
    window = loaded.arch.sliding_window
    if window is not None and max_model_len > window:
        if requested is not None:
            raise ValueError(
                f"this model uses sliding-window attention ({window} tokens), which tokenmill does not "
                f"implement; max_model_len {max_model_len} must be at most {window}"
            )
        max_model_len = window  # within the window, full attention is exact
    if requested and requested > loaded.context_len:
        logger.warning("max_model_len %d exceeds the model's context length %d", requested, loaded.context_len)
    return max_model_len


def _cpu_kernels_build() -> bool:
    from tokenmill.kernels import cpu_kernels_available

    return cpu_kernels_available()
