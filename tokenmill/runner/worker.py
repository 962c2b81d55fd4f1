"""Building one rank: an EngineConfig in, a model ready to run steps out.

`build_rank` resolves the device, threads and dtypes, opens the checkpoint, chooses the
execution plan and the attention backend, loads the model (this rank's part of it under
tensor/pipeline parallelism), loads a draft model when speculative decoding asks for
one, sizes and allocates the KV cache, and builds the runner; it returns them with the
tokenizer and the `EngineFacts` found on the way. The one-process engine (builder.py)
and every rank of a split (distributed/: rank 0's executor and the worker processes)
build through this same function, as vLLM's workers build themselves and its executor
only drives them.

Runner layer: imports model/, attention/, quantization/, parallel/, kernels/, engine's
plain step types and the ground floor; never spec_decode/, distributed/ or builder.py.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill import kernels
from tokenmill.attention import kv_quant
from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.kv_cache import KVCacheSpec, PagedKVCache, can_pack
from tokenmill.attention.torch_sdpa import TorchSDPABackend
from tokenmill.config import EngineConfig, EngineFacts, PoolingFacts, SpeculativeConfig
from tokenmill.config import default_kv_cache_memory as default_kv_cache_memory_bytes
from tokenmill.dtypes import dtype_name, kv_cache_dtype_name, torch_dtype
from tokenmill.hardware import cpu_info
from tokenmill.kv_transfer.shared_memory import ALIGN as SHARED_ALIGN
from tokenmill.kv_transfer.shared_memory import SharedRegion
from tokenmill.model.loader import LoadedModel, load_model, open_checkpoint
from tokenmill.model_arch import ModelArchConfig
from tokenmill.parallel.layout import REFERENCE_TP_SIZE, reference_split
from tokenmill.parallel.model_parallel import ModelParallel
from tokenmill.pooling import Pooler, model_pooling
from tokenmill.quantization.dense import PANELS, CPUMatmulChoice, bound_onednn_caches
from tokenmill.runner import tune
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.runner.pipeline import PipelineRunner
from tokenmill.runner.shared_kv_pool import shared_allocator
from tokenmill.runner.plan import (ROWS, ExecutionPlan, apply_plan, batch_invariant_plan, cpu_native_plan,
                                  invariant_dense_choice,
                                  quantized_plan, reference_plan)
from tokenmill.runner.threads import ThreadGovernor
from tokenmill.structured_output.compiler import compiler_for
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

@dataclass
class BuiltRank:
    runner: ModelRunner
    tokenizer: Tokenizer
    facts: EngineFacts
    draft_runner: ModelRunner | None = None  # a draft model's, for speculative decoding


# A rank of a tensor/pipeline-parallel split: its ModelParallel from the model's shape and
# the checkpoint's block width, and the KV bytes per token of the rank that needs most
# (every rank allocates as many blocks: the scheduler's block ids are global).
@dataclass
class RankSetup:
    parallel: Callable[[object, int], object]  # (ModelArchConfig, column unit) -> ModelParallel
    max_kv_bytes_per_token: Callable[[int], int]  # element size -> bytes
    num_threads: int | None = None
    runner_class: type = ModelRunner
    microbatches: int | None = None  # pipeline micro-batches per step (a PipelineRunner's)


def model_parallel_factory(rank: RankSetup | None, alignment: int,
                           deterministic: bool) -> Callable[[ModelArchConfig, int], ModelParallel] | None:
    """What `load_model` builds this process's ModelParallel with: one rank's of a split
    (row-parallel cuts on multiples of the format's alignment), or None for the whole model.
    Deterministic inference at one process or at the reference degree (2) sums the
    row-parallel linears as the reference split does (ModelParallel.reduce_as), so either
    degree gives the same bits; other degrees keep their own sums (logged)."""
    if rank is None and not deterministic:
        return None

    def build(arch: ModelArchConfig, unit: int) -> ModelParallel:
        unit = math.lcm(unit, alignment)
        parallel = rank.parallel(arch, unit) if rank is not None else ModelParallel.single(arch)
        if deterministic:
            if parallel.tp_size <= REFERENCE_TP_SIZE:
                parallel.reduce_as = reference_split(arch, unit)
                if parallel.reduce_as and parallel.tp_size == 1:
                    logger.info("deterministic inference: o_proj and down_proj add the products of the column parts "
                                "of a tensor-parallel split of %d, in its order (sizes 1 and %d give the same bits)",
                                REFERENCE_TP_SIZE, REFERENCE_TP_SIZE)
            else:
                logger.info("deterministic inference at tensor parallel size %d: its sums differ from sizes 1 and %d "
                            "(which give the same bits)", parallel.tp_size, REFERENCE_TP_SIZE)
        return parallel

    return build


def rank_setup(ctx, config: EngineConfig, num_threads: int) -> RankSetup:
    """This rank's setup from its membership of the split (`parallel.group.DistributedContext`)."""
    parallel = config.parallel
    if parallel.pipeline_parallel_size > 1:
        microbatches = parallel.pipeline_microbatches or parallel.pipeline_parallel_size
        return RankSetup(ctx.model_parallel, ctx.max_kv_bytes_per_token, num_threads, PipelineRunner, microbatches)
    return RankSetup(ctx.model_parallel, ctx.max_kv_bytes_per_token, num_threads)


def freeze_startup_heap(context: str) -> int:
    """Move every object alive after start-up (the model's modules and parameters, the
    tokenizer's tables, the imported libraries) into the garbage collector's permanent
    generation, which no collection walks again; returns how many. vLLM does the same after
    its warm-up (`freeze_gc_heap`), SGLang offers it (`freeze_gc`). With the default model
    loaded a full collection took ~90 ms (0.0 ms frozen), a stall in whichever step it lands:
    a tail of the served TTFT. Only for a process that keeps one engine for its life (the
    server, a tensor-parallel worker): a frozen cycle is never collected, so a process that
    builds and drops engines (tests, `LLM` in a notebook) would keep them."""
    gc.collect()
    before = gc.get_freeze_count()
    gc.freeze()
    frozen = gc.get_freeze_count() - before
    logger.info("garbage collector: froze %d objects alive after start-up (%s)", frozen, context)
    return frozen


def return_freed_memory() -> None:
    """Give the C allocator's free pages back to the system (glibc's malloc_trim; nothing
    elsewhere). Loading frees as much as it keeps (a checkpoint's tensors copied into their
    formats, onto huge pages, into panels), and glibc keeps freed heap pages resident: with
    the default model ~20 MiB of RSS that no tensor holds."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def build_rank(config: EngineConfig, rank: RankSetup | None = None) -> BuiltRank:
    """Load the model (one rank's part of it, given `rank`), its plan, KV cache and runner."""
    start = time.perf_counter()
    bound_onednn_caches()  # before the first oneDNN primitive (the tuning, the weights' copies)
    device = resolve_device(config.device.device)
    governor = compute_threads(config, device, rank.num_threads if rank else None)
    kernels_ok = device.type == "cpu" and config.device.native_kernels and _cpu_kernels_build()
    dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, resolve_dtype(config.model.dtype, device, kernels_ok),
                                   device)
    checkpoint = open_checkpoint(config.model.model)
    runner_type = resolve_runner(config, checkpoint.path)
    backend = select_attention_backend(config.device.attention_backend, device, kernels_ok)
    keep_quantized = quantized_as_stored(config, checkpoint.quantized, kernels_ok)
    chosen = choose_plan(config, device, dtype, kernels_ok, backend, checkpoint.arch, keep_quantized)
    parallel = model_parallel_factory(rank, chosen.weight_format.shard_alignment, chosen.batch_invariant)
    loaded = load_model(checkpoint, dtype.compute, device, config.model.max_model_len, chosen.weight_format, parallel,
                        keep_quantized=keep_quantized, lm_head=runner_type != "pooling")
    max_model_len = resolve_max_model_len(config, loaded)
    plan = apply_plan(loaded.model, chosen, dtype.kv_cache)
    backend = backend.for_plan(plan.prefill_attention_dtype)
    speculative = config.speculative.speculative_config
    draft = load_draft(config, device, loaded, max_model_len, kernels_ok, backend) if _has_draft(speculative) else None
    layout = loaded.model.parallel.layout
    chunk_invariant = not loaded.arch.sliding_window and backend.chunk_invariant(loaded.arch.head_dim)
    # Where prompts attend through the prefill kernel, a bf16 cache keeps its blocks in that
    # kernel's layout: no packing per step, and decodes attend by the same arithmetic.
    spec = kv_cache_spec(config, layout.layers.size, layout.kv_heads.size, loaded.arch.head_dim, dtype,
                         packed=chunk_invariant)
    # Deterministic inference lets prompts attend as chunks only where decodes then compute
    # what prompt tokens compute (a packed cache); elsewhere every token stays a paged-kernel
    # row, so that a generated prefix read from the cache is what a cold prompt computes.
    if chunk_invariant and (spec.packed or not plan.batch_invariant):
        plan = dataclasses.replace(plan, prompts_as_chunks=True)
    elif prompts_as_rows_here(plan, backend, loaded.arch):
        plan = dataclasses.replace(plan, prompts_as_rows=True)
    # Prompt chunks through the prefill kernel, decodes through the paged kernel (an unpacked
    # cache: 8-bit, float16/float32, or a block size not a multiple of 16): a decoded token's KV
    # is not what the same token computes in a prompt. Where the linears would give a prompt
    # its cold bits (row-invariant), the prefix cache then keeps prompt tokens only, and a
    # conversation's next turn computes the previous answer again, as a prompt does cold.
    cache_generated_kv = not (plan.prompts_as_chunks and not spec.packed and plan.weight_format.row_invariant)
    if not cache_generated_kv and config.cache.enable_prefix_caching and runner_type == "generate":
        logger.info("prefix cache: blocks of prompt tokens only (decodes attend through the paged kernel, prompts "
                    "through the prefill kernel: a generated token's KV would not be what a prompt computes)")
    memory = config.cache.kv_cache_memory or default_kv_cache_memory(device)
    # A draft keeps the KV of the same tokens: the memory is split so both hold as many.
    bytes_per_block = spec.bytes_per_block + (draft.kv_spec.bytes_per_block if draft else 0)
    if rank is not None:  # as many blocks as the rank holding most KV per token can have
        bytes_per_block = rank.max_kv_bytes_per_token(spec.element_size) * spec.block_size
    sliding_layers = hybrid_sliding_layers(config, loaded, rank is None and draft is None)
    num_sliding_blocks = window = 0
    if sliding_layers:
        window = loaded.arch.sliding_window
        num_blocks, num_sliding_blocks = hybrid_pool_sizes(config, spec, len(sliding_layers), window, memory)
    else:
        num_blocks = memory // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory {memory} bytes is less than one KV block ({bytes_per_block} bytes)")
    shared = shared_kv_region(config, spec, num_blocks, device) if rank is None and not sliding_layers else None
    kv_cache = PagedKVCache(spec, num_blocks, device, sliding_layers, num_sliding_blocks,
                            huge_pages=config.device.huge_pages and shared is None,
                            empty=shared_allocator(shared) if shared is not None else None)
    runner_class = rank.runner_class if rank is not None else ModelRunner
    runner = runner_class(loaded.model, kv_cache, backend, plan, device, seed=config.model.seed, threads=governor)
    runner.shared_kv_region = shared
    return_freed_memory()
    host_spec = offload_cache_spec(config, spec, device)
    runner.host_kv_spec = host_spec
    runner.structured_output = StructuredOutputManager(
        compiler_for(loaded.tokenizer, loaded.arch.vocab_size, config.model.structured_outputs_backend))
    if rank is not None and rank.microbatches is not None:
        runner.microbatches = rank.microbatches
    draft_runner = build_draft_runner(config, runner, draft) if draft is not None else None
    pooling = resolve_pooling(config, loaded) if runner_type == "pooling" else None
    if pooling is not None:
        runner.pooler = Pooler(pooling.pooling_type, pooling.normalize)
        logger.info("pooling runner: %s pooling%s, %d dimensions%s", pooling.pooling_type,
                    ", normalized" if pooling.normalize else "", pooling.hidden_size,
                    "" if pooling.uses_prefix_cache else " (prefix caching off: every position is pooled)")
    facts = EngineFacts(
        model_name=loaded.name, model_path=loaded.path, architecture=loaded.arch.architecture,
        vocab_size=loaded.arch.vocab_size, max_model_len=max_model_len, device=str(device),
        compute_dtype=dtype.compute, weight_format=weight_format_name(loaded.model, plan), kv_cache_dtype=dtype.kv_cache,
        num_blocks=num_blocks, block_size=config.cache.block_size, kv_bytes_per_token=spec.bytes_per_token,
        attention_backend=backend.name, execution_plan=plan.describe(), num_threads=torch.get_num_threads(),
        load_seconds=time.perf_counter() - start, speculative=describe_speculation(speculative, draft_runner),
        kv_cache_format=spec.describe(), cache_generated_kv=cache_generated_kv,
        num_sliding_blocks=num_sliding_blocks, sliding_window=window,
        runner=runner_type, pooling=pooling,
        kv_offload_cache_dtype=host_spec.describe() if host_spec is not None else "",
        kv_offload_bytes_per_token=host_spec.bytes_per_token if host_spec is not None else 0,
    )
    logger.info(
        "loaded %s (%s) on %s in %.1f s: %d KV blocks of %d tokens = %d tokens (%.2f GiB, %d bytes per token, "
        "KV cache %s), max_model_len %d, attention %s", loaded.name, dtype.describe(facts.weight_format), device,
        facts.load_seconds, num_blocks,
        spec.block_size, facts.kv_capacity_tokens, kv_cache.nbytes / 2**30, spec.bytes_per_token, facts.kv_cache_format,
        max_model_len, backend.name,
    )
    if sliding_layers:
        logger.info("hybrid KV cache: %d sliding-window layers (window %d) keep %d blocks of their own, the other %d "
                    "layers %d", len(sliding_layers), window, num_sliding_blocks, spec.num_layers - len(sliding_layers),
                    num_blocks)
    logger.info("execution plan (%s): %s", plan.tier, plan.describe())
    if speculative is not None:
        logger.info("speculative decoding: %s", facts.speculative)
    return BuiltRank(runner, loaded.tokenizer, facts, draft_runner)


# ----- the pooling runner ---------------------------------------------------------------------


def resolve_runner(config: EngineConfig, path: str) -> str:
    """generate or pooling. `auto`, as vLLM's: pooling for an embedding checkpoint (a
    sentence-transformers pooling config, or a bare decoder such as Qwen3Model), else
    generate. The pooling runner prefills and pools, nothing is sampled: no speculation.
    Under tensor/pipeline parallelism every rank builds its pooler; the rank whose output
    the executor returns (rank 0, or the last stage) has the hidden states it pools."""
    runner = config.model.runner
    if runner == "auto":
        runner = "pooling" if model_pooling(path).is_embedding_model else "generate"
    if runner != "pooling":
        if config.model.pooler_config is not None:
            raise ValueError("pooler_config applies to the pooling runner: add --runner pooling")
        return runner
    if config.speculative.speculative_config is not None:
        raise ValueError("the pooling runner samples nothing: speculative_config does not apply to it")
    return runner


def resolve_pooling(config: EngineConfig, loaded: LoadedModel) -> PoolingFacts:
    """The pooler config's fields, else what the checkpoint says (sentence-transformers'
    pooling and Normalize modules), else LAST normalized: vLLM's default for a decoder
    served as an embedder (Qwen3-Embedding and e5-mistral pool the last token)."""
    own = model_pooling(loaded.path)
    asked = config.model.pooler_config
    pooling_type = (asked and asked.pooling_type) or own.pooling_type or "LAST"
    normalize = asked.normalize if asked is not None and asked.normalize is not None else own.normalize
    return PoolingFacts(pooling_type, True if normalize is None else normalize, loaded.arch.hidden_size,
                        own.matryoshka_dimensions)


# ----- speculative decoding ------------------------------------------------------------------


@dataclass
class LoadedDraft:
    loaded: LoadedModel
    dtype: DtypePlan
    kv_spec: KVCacheSpec
    plan: ExecutionPlan


def _has_draft(speculative: SpeculativeConfig | None) -> bool:
    return speculative is not None and speculative.method == "draft_model"


def load_draft(config: EngineConfig, device: torch.device, target: LoadedModel, max_model_len: int,
               kernels_ok: bool, backend: AttentionBackend) -> LoadedDraft:
    """Load the draft model (its own dtype and weight format: a GGUF's quantized blocks are
    served as stored under dtype auto, as for a target) and check it can propose for the
    target (same tokenizer, context for max_model_len) before anything is allocated."""
    speculative = config.speculative.speculative_config
    draft_config = config.replace(model=speculative.model, dtype=speculative.dtype or config.model.dtype,
                                  quantization=None)
    dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, resolve_dtype(draft_config.model.dtype, device,
                                                                               kernels_ok), device)
    checkpoint = open_checkpoint(speculative.model)
    keep_quantized = quantized_as_stored(draft_config, checkpoint.quantized, kernels_ok)
    chosen = choose_plan(draft_config, device, dtype, kernels_ok, backend, checkpoint.arch, keep_quantized)
    draft = load_model(checkpoint, dtype.compute, device, max_model_len, chosen.weight_format,
                       keep_quantized=keep_quantized)
    check_draft(draft.arch.vocab_size, target.arch.vocab_size, _token_table(draft.tokenizer),
                _token_table(target.tokenizer), draft.context_len, draft.arch.sliding_window, max_model_len)
    plan = apply_plan(draft.model, chosen, dtype.kv_cache)
    kv_spec = kv_cache_spec(config, draft.arch.num_layers, draft.arch.num_kv_heads, draft.arch.head_dim, dtype)
    return LoadedDraft(draft, dtype, kv_spec, plan)



def build_draft_runner(config: EngineConfig, runner: ModelRunner, draft: LoadedDraft) -> ModelRunner:
    """The draft's own runner and KV cache: as many tokens as the target's, plus room for
    every running request's proposals (the builder wraps it in a DraftModelProposer)."""
    k = config.speculative.speculative_config.num_speculative_tokens
    lookahead = config.scheduler.max_num_seqs * -(-(k - 1) // config.cache.block_size)
    cache = PagedKVCache(draft.kv_spec, runner.kv_cache.num_blocks + lookahead, runner.device)
    backend = runner.backend.for_plan(draft.plan.prefill_attention_dtype)
    return ModelRunner(draft.loaded.model, cache, backend, draft.plan, runner.device, seed=config.model.seed)


def check_draft(draft_vocab: int, target_vocab: int, draft_tokens: dict[str, int] | None,
                target_tokens: dict[str, int] | None, draft_context_len: int, draft_window: int | None,
                max_model_len: int) -> None:
    """Raise ValueError when a draft cannot propose for the target: another vocabulary or
    tokenizer, or too short a context for max_model_len."""
    if draft_vocab != target_vocab:
        raise ValueError(f"the draft model's vocabulary has {draft_vocab} tokens, the target's {target_vocab}: "
                         "a draft must share the target's tokenizer")
    if draft_tokens is not None and target_tokens is not None and draft_tokens != target_tokens:
        differ = sorted(t for t in set(draft_tokens) ^ set(target_tokens))[:3] or \
            sorted(t for t in draft_tokens if draft_tokens[t] != target_tokens[t])[:3]
        raise ValueError(f"the draft model's tokenizer differs from the target's (e.g. {differ}): "
                         "a draft must share the target's tokenizer")
    if draft_context_len < max_model_len:
        raise ValueError(f"the draft model's context is {draft_context_len} tokens, less than max_model_len "
                         f"{max_model_len}: lower max_model_len or choose another draft")
    if draft_window is not None and draft_window < max_model_len:
        raise ValueError(f"the draft model uses sliding-window attention ({draft_window} tokens), which tokenmill "
                         f"does not implement; max_model_len {max_model_len} must be at most {draft_window}")


def describe_speculation(speculative: SpeculativeConfig | None, draft_runner: ModelRunner | None) -> str:
    if speculative is None:
        return ""
    text = f"{speculative.method}, {speculative.num_speculative_tokens} tokens"
    if speculative.method == "ngram":
        return text + f", lookup {speculative.prompt_lookup_min}-{speculative.prompt_lookup_max}"
    runner = draft_runner
    return (f"{text}, draft {speculative.model} ({runner.plan.describe()}; {runner.kv_cache.num_blocks} KV blocks, "
            f"{runner.kv_cache.nbytes / 2**30:.2f} GiB)")


def _token_table(tokenizer: Tokenizer) -> dict[str, int]:
    return tokenizer.backend.get_vocab(with_added_tokens=True)


def weight_format_name(model: torch.nn.Module, plan: ExecutionPlan) -> str:
    """How the linear weights are stored, e.g. 'bfloat16', or 'q4-g32 (q8-g32 head)'."""
    names = [m.weights.format_name for m in model.modules() if getattr(m, "weights", None) is not None]
    if not names:
        return plan.weight_format.name
    common = max(set(names), key=names.count)
    head = getattr(getattr(model, "lm_head", None), "weights", None)
    if head is not None and head.format_name != common:
        return f"{common} ({head.format_name} head)"
    return common

# ----- what the config leaves to the machine ----------------------------------------------


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def compute_threads(config: EngineConfig, device: torch.device, num_threads: int | None = None) -> ThreadGovernor | None:
    """On the CPU: a fixed count (`num_threads`, a rank's share, over the config's), or (the
    default) a governor that uses the cores other work leaves free (runner/threads.py)."""
    if device.type != "cpu":
        return None
    fixed = num_threads or config.device.num_threads
    if fixed is not None:
        torch.set_num_threads(fixed)
        return None
    return ThreadGovernor(cpu_info().num_cores, torch.set_num_threads)


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
        return self.describe()

    def describe(self, weights: str | None = None) -> str:
        """`weights`: what the loaded linear weights really are, when not `self.weights`
        (a GGUF's Q4_1 blocks served as stored are not bfloat16 weights)."""
        weights = weights or self.weights
        if self.compute == weights == self.kv_cache:
            return self.compute
        stored = "weights and KV cache" if weights == self.kv_cache else f"weights, {self.kv_cache} KV cache"
        return f"{weights} {stored}, {self.compute} compute"


def resolve_dtype(dtype: str, device: torch.device, native_kernels: bool = False) -> DtypePlan:
    """On a CPU with tokenmill's kernels, activations stay float32 and `dtype` is how the
    weights and the KV cache are stored: `auto` and `bfloat16` store them in bfloat16 (half
    the bytes a decode step streams; matmuls then take whichever kernels measure fastest
    here, bf16 GEMMs included where the CPU has them), `float32` keeps the checkpoint exact.
    Elsewhere `dtype` is the compute dtype: `auto` is bfloat16 on GPUs and on CPUs with
    bf16 arithmetic, float32 on other CPUs, where bf16 matmuls would be emulated (10-20x
    slower) and `bfloat16` then stores bf16 weights and KV computing in float32."""
    if device.type == "cpu" and native_kernels:
        if dtype == "float16":
            raise ValueError("float16 is for GPUs; on the CPU use bfloat16 or float32")
        stored = "float32" if dtype == "float32" else "bfloat16"
        return DtypePlan(compute="float32", weights=stored, kv=stored)
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" or cpu_has_native_bf16() else "float32"
    if dtype == "bfloat16" and device.type == "cpu" and not cpu_has_native_bf16():
        return DtypePlan(compute="float32", weights="bfloat16", kv="bfloat16")
    return DtypePlan(compute=dtype, weights=dtype)


def resolve_kv_cache_dtype(name: str, dtype: DtypePlan, device: torch.device) -> DtypePlan:
    """`auto` keeps the KV dtype resolve_dtype chose (it follows --dtype); any other name is
    how the cache is stored, whatever the compute dtype ('fp8' is vLLM's spelling of
    fp8_e4m3, which needs float8 tensors in torch and on the device)."""
    if name == "auto":
        return dtype
    name = kv_cache_dtype_name(name)
    if name == "fp8_e4m3":
        check_fp8_kv_cache(device)
    return dataclasses.replace(dtype, kv=name)


def check_fp8_kv_cache(device: torch.device) -> None:
    fp8 = kv_quant.fp8_dtype()
    if fp8 is None:
        raise ValueError(f"kv_cache_dtype fp8_e4m3 needs float8 tensors (torch.float8_e4m3fn), which torch "
                         f"{torch.__version__} lacks; use int8 (same size)")
    try:
        torch.ones(1, device=device).to(fp8).float()
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"kv_cache_dtype fp8_e4m3: {device} cannot store float8 tensors ({exc}); use int8 "
                         "(same size)") from exc


def offload_cache_spec(config: EngineConfig, pool: KVCacheSpec, device: torch.device) -> KVCacheSpec | None:
    """The host tier's block format under --kv-offloading-cache-dtype (None: the pool's own
    bytes): the pool's shape in an 8-bit dtype, rotated where head_dim allows, in the token
    layout (a packed bf16 pool's blocks are converted on the way: kv_offload.py)."""
    name = config.cache.kv_offloading_cache_dtype
    if name == "auto" or config.cache.kv_offloading_size is None:
        return None
    if pool.quantized:
        raise ValueError(f"kv_offloading_cache_dtype {name}: the pool is already 8-bit ({pool.describe()}); "
                         "leave it auto (the host tier then keeps the pool's bytes)")
    name = kv_cache_dtype_name(name)
    if name == "fp8_e4m3":
        check_fp8_kv_cache(device)
    return dataclasses.replace(pool, dtype=torch_dtype(name), rotation=kv_quant.rotation_block(pool.head_dim),
                               packed=False)


def shared_kv_region(config: EngineConfig, spec: KVCacheSpec, num_blocks: int,
                     device: torch.device) -> SharedRegion | None:
    """A disaggregated producer's pool goes in shared memory, which decode instances on this
    host copy from in place (kv_transfer/shared_memory.py); None for every other engine, for
    `"shared_memory": false`, or where no memfd can be made (then consumers pull over TCP)."""
    transfer = config.cache.kv_transfer_config
    if transfer is None or not transfer.is_producer or not transfer.shared_memory or device.type != "cpu":
        return None
    tensors_per_layer = 4 if spec.quantized else 2  # K, V (and their scales): each page-aligned
    nbytes = spec.bytes_per_block * num_blocks + tensors_per_layer * spec.num_layers * SHARED_ALIGN
    try:
        region = SharedRegion(nbytes)
    except (OSError, AttributeError) as e:  # AttributeError: no os.memfd_create (not Linux)
        logger.warning("kv_transfer_config: no shared memory for the KV pool (%s); decode instances pull over TCP", e)
        return None
    logger.info("kv_transfer_config: the KV pool (%.1f MiB) is in shared memory; decode instances on this host "
                "copy from it in place", region.size / 2**20)
    return region


def kv_cache_spec(config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                  dtype: DtypePlan, packed: bool = False) -> KVCacheSpec:
    """The cache's layout: its dtype, for an 8-bit one the Hadamard rotation the config asks
    for (when head_dim has a power-of-two factor of at least 16), and whether a bf16 one is
    packed for the prefill kernel (`packed`: where its prompts attend through that kernel;
    kv_cache.py's packed layout, for block sizes that are multiples of 16)."""
    kv_dtype = torch_dtype(dtype.kv_cache)
    rotate = kv_quant.is_quantized(kv_dtype) and config.cache.kv_cache_rotation
    rotation = kv_quant.rotation_block(head_dim) if rotate else 0
    if rotate and not rotation:
        logger.info("head_dim %d has no power-of-two factor >= 16: the %s KV cache is not rotated", head_dim,
                    dtype.kv_cache)
    packed = packed and can_pack(kv_dtype, config.cache.block_size, head_dim)
    return KVCacheSpec(num_layers, num_kv_heads, head_dim, config.cache.block_size, kv_dtype, rotation, packed)


def choose_plan(config: EngineConfig, device: torch.device, dtype: DtypePlan, kernels_ok: bool,
                backend: AttentionBackend, arch: ModelArchConfig | None = None,
                keep_quantized: bool = False) -> ExecutionPlan:
    """On a float32-computing CPU with the native kernels: weights tiled for the decode
    kernels and packed for oneDNN (unless `pack_weights` is off), the matmul kernels per
    row range measured on this machine (`runner/tune.py`), the native element-wise ops,
    and the fused decode layer where attention reads the cache natively; with weight-only
    quantization (as stored, or int8/int4 at load) the quantized kernels. Elsewhere plain
    weights and PyTorch ops."""
    weights = torch_dtype(dtype.weights)
    method = config.quantization.quantization
    native = device.type == "cpu" and dtype.compute == "float32" and kernels_ok
    deterministic = config.device.enable_deterministic_inference
    if deterministic:
        check_deterministic_inference(config, native, backend, arch)
    if not native:
        if method in ("int8", "int4"):
            raise ValueError(f"quantization {method} runs on tokenmill's native CPU kernels, which are turned off, "
                             "failed to build or are not for this device")
        return reference_plan(weights)
    # Deterministic inference runs one kernel at every row count: nothing to measure.
    choice = invariant_dense_choice(weights) if deterministic else cpu_matmul_choice(config, weights, arch)
    plan = cpu_native_plan(weights, onednn=config.device.pack_weights, choice=choice,
                           fused_decode=backend.name == "cpu_native")
    plan = dataclasses.replace(plan, huge_pages=config.device.huge_pages)
    if keep_quantized or method in ("int8", "int4"):
        # Deterministic inference takes the integer GEMM where the build has it, never by a
        # timing: its bits must not depend on a measurement (nor differ between TP ranks).
        integer_gemm = (kernels.quant_integer_gemm_built() if deterministic and config.device.quant_gemm == "auto"
                        else quant_integer_gemm_choice(config, arch))
        plan = quantized_plan(plan, "stored" if keep_quantized else method, config.quantization.quantization_group_size,
                              native_bf16=cpu_has_native_bf16(), integer_gemm=integer_gemm)
    return batch_invariant_plan(plan) if deterministic else plan


def prompts_as_rows_here(plan: ExecutionPlan, backend: AttentionBackend, arch: ModelArchConfig) -> bool:
    """Whether the default plan lays every prompt token out as a row of the paged kernel
    (ExecutionPlan.prompts_as_rows), where prompt chunks would attend through SDPA (not
    chunk-invariant: its reduction over keys follows the chunk) and every linear is
    row-invariant (`WeightFormat.row_invariant`: dense weights on the panel kernel, quantized
    ones on the integer GEMM). The native paged kernel then takes the rows (each row's
    arithmetic its own, the one decodes get), and attention is the one thing that changed a
    request's bits with its chunking, its prefix-cache hits and its preemptions. Where SDPA
    took them: float32 prompts (the native prefill kernel is bf16), a head_dim that kernel has
    no form for and sliding windows (Gemma 3: head_dim 256, a 512-token window; the rows ran
    its 1,024- and 2,048-token prompts faster than SDPA did). Not on AMX CPUs for bf16 prompts
    (torch's flash kernel multiplies on AMX tiles there; the rows were not measured against
    it), nor for a mixture-of-experts model (panels only when forced there; its invariance is
    not checked). Costs: docs/determinism.md, "Dense float32 weights" and "Gemma 3"."""
    amx_flash = plan.prefill_attention_dtype == torch.bfloat16 and cpu_info().has("amx_bf16")
    return (not plan.batch_invariant and backend.name == "cpu_native" and plan.weight_format.row_invariant
            and not amx_flash and not arch.num_experts)


def check_deterministic_inference(config: EngineConfig, native: bool, backend: AttentionBackend,
                                  arch: ModelArchConfig | None) -> None:
    """Refuse, naming the fix, what deterministic inference does not cover: its kernels are
    tokenmill's native CPU ones (float32 activations) and the cpu_native attention backend."""
    if not native or backend.name != "cpu_native":
        raise ValueError("deterministic inference runs on tokenmill's native CPU kernels and the cpu_native attention "
                         "backend (float32 activations on the CPU): drop --attention-backend torch_sdpa / "
                         "TOKENMILL_KERNELS=0 / a GPU device, or turn --enable-deterministic-inference off")
    if arch is not None and arch.num_experts:
        raise ValueError("deterministic inference does not cover mixture-of-experts models yet (their grouped expert "
                         "kernels switch by row count): turn --enable-deterministic-inference off")


def quantized_as_stored(config: EngineConfig, stored: str | None, kernels_ok: bool) -> bool:
    """Whether the checkpoint's quantized weights are served as stored: by default for a
    quantized GGUF (as llama.cpp and Ollama do) or a GPTQ / AWQ checkpoint unless --dtype
    float32/bfloat16 asks to dequantize; never without the native kernels (they would be
    dequantized every step). `--quantization gguf|gptq|awq` names the checkpoint's own
    (vLLM's spelling), which must be what it stores."""
    method = config.quantization.quantization
    if method in _STORED_QUANTIZATIONS and stored != method:
        found = f"a {stored} checkpoint" if stored else "a float checkpoint"
        model = config.model.model or "the model"
        raise ValueError(f"quantization {method} needs {_STORED_QUANTIZATIONS[method]}; {model} is {found}")
    if method in ("int8", "int4") and stored is not None:
        raise ValueError(f"the checkpoint's weights are quantized already ({stored}); quantization {method} is for "
                         "float checkpoints (leave --quantization unset to serve them as stored, or use none)")
    if stored is None or method == "none":
        return False
    if method == stored or config.model.dtype == "auto":
        if not kernels_ok:
            logger.warning("serving the %s weights dequantized: the native CPU kernels are off or did not build", stored)
            return False
        return True
    return False


_STORED_QUANTIZATIONS = {
    "gguf": "a GGUF file whose linear weights are stored in quantized blocks",
    "gptq": "a GPTQ checkpoint (quantization_config quant_method gptq)",
    "awq": "an AWQ checkpoint (quantization_config quant_method awq)",
}


def cpu_matmul_choice(config: EngineConfig, weights: torch.dtype, arch: ModelArchConfig | None) -> CPUMatmulChoice:
    """The measured (or cached) kernel choice, unless the config fixes both parts of it."""
    fixed_gemm = config.device.cpu_gemm != "auto"
    if config.device.cpu_gemm == "onednn_bf16" and weights != torch.bfloat16:
        raise ValueError("cpu_gemm onednn_bf16 rounds inputs to bf16: it needs bfloat16 weights (--dtype bfloat16)")
    if config.device.cpu_gemm == PANELS:
        if not kernels.panel_linear_built(weights):
            needs = "AVX-512 BF16" if weights == torch.bfloat16 else "AVX-512"
            raise ValueError(f"cpu_gemm panels needs the native kernels built for AVX-512 ({needs} for "
                             f"{dtype_name(weights)} weights) and this CPU lacks them; use auto")
        return CPUMatmulChoice(config.device.skinny_max_rows if config.device.skinny_max_rows is not None
                               else ROWS.skinny_max_rows, PANELS)
    if fixed_gemm and config.device.skinny_max_rows is not None:
        return CPUMatmulChoice(config.device.skinny_max_rows, config.device.cpu_gemm)
    shapes = layer_shapes(arch) if arch is not None else [(576, 576)]
    allowed = [config.device.cpu_gemm] if fixed_gemm else None
    if allowed is None and arch is not None and arch.num_experts:
        # The experts' grouped call (one parallel region per matrix for every active expert)
        # is the skinny kernel's; on panels each expert would run alone.
        allowed = [g for g in tune.candidate_gemms(weights) if g != PANELS]
    choice, timings, source = tune.choose(shapes, weights, allowed=allowed)
    if config.device.skinny_max_rows is not None:
        choice = CPUMatmulChoice(config.device.skinny_max_rows, choice.gemm)
    logger.info("CPU matmul kernels (%s): %s", source, choice.describe())
    return choice


def quant_integer_gemm_choice(config: EngineConfig, arch: ModelArchConfig | None) -> bool:
    """Whether quantized weights' many-row steps run the whole-block integer GEMM: as
    `--quant-gemm` says, or measured (or cached) against the bf16 GEMM on the model's layer
    shapes (`runner/tune.py`)."""
    if config.device.quant_gemm != "auto":
        if config.device.quant_gemm == "integer" and not kernels.quant_integer_gemm_built():
            raise ValueError(f"quant_gemm integer needs a CPU with AVX512-VNNI (this build: {kernels.quant_isa()}); "
                             "use auto or bf16")
        return config.device.quant_gemm == "integer"
    shapes = layer_shapes(arch) if arch is not None else [(576, 576)]
    integer, _, source = tune.choose_quant_gemm(shapes)
    logger.info("quantized GEMM past the integer rows (%s): %s", source, "integer" if integer else "bf16")
    return integer


def layer_shapes(arch: ModelArchConfig) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's linear weights: qkv, o, gate_up, down."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]


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


def hybrid_sliding_layers(config: EngineConfig, loaded: LoadedModel, supported: bool) -> frozenset[int]:
    """The layers whose KV goes to a sliding-window pool of its own: a model with both kinds
    of layer, on one process without a draft model (tensor/pipeline ranks and a draft's
    shared memory split keep every block), unless --disable-hybrid-kv-cache-manager or a
    KV tier (--kv-offloading-size) or connector (--kv-transfer-config) is on: those move
    whole blocks of every layer, so, as vLLM does with a KV connector, the hybrid manager
    steps aside for them (with a log line) rather than refuse to start."""
    arch = loaded.model.cfg
    sliding = frozenset(i for i in range(arch.num_layers) if arch.layer_window(i) is not None)
    if not supported or config.cache.disable_hybrid_kv_cache_manager or len(sliding) in (0, arch.num_layers):
        return frozenset()
    movers = [flag for flag, on in (("--kv-offloading-size", config.cache.kv_offloading_size),
                                    ("--kv-transfer-config", config.cache.kv_transfer_config)) if on]
    if movers:
        logger.info("hybrid KV cache manager off (as --disable-hybrid-kv-cache-manager): %s moves every layer's "
                    "blocks, so the %d sliding-window layers keep all of theirs", " and ".join(movers), len(sliding))
        return frozenset()
    return sliding


def hybrid_pool_sizes(config: EngineConfig, spec: KVCacheSpec, num_sliding: int, window: int,
                      memory: int) -> tuple[int, int]:
    """(full-attention blocks, sliding-window blocks) for `memory` bytes. A running request
    holds at most the blocks of its window plus its step's chunk in the sliding pool; the
    pool gets twice what max_num_seqs such requests and a step's tokens need (the other half
    keeps finished windows for prefix hits), at most half the memory; the full-attention
    layers get the rest."""
    size, per_layer_block = spec.block_size, spec.bytes_per_block // spec.num_layers
    running = config.scheduler.max_num_seqs * (-(-(window - 1) // size) + 1)
    step = -(-config.scheduler.max_num_batched_tokens // size)
    sliding_bytes = per_layer_block * num_sliding
    num_sliding_blocks = max(2, min(2 * (running + step) + 1, memory // 2 // sliding_bytes))
    full_bytes = per_layer_block * (spec.num_layers - num_sliding)
    return (memory - num_sliding_blocks * sliding_bytes) // full_bytes, num_sliding_blocks


def default_kv_cache_memory(device: torch.device) -> int:
    """config.default_kv_cache_memory on this device (its RAM, or the GPU's free memory)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return default_kv_cache_memory_bytes(True, total, free)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return default_kv_cache_memory_bytes(False, total, total)


def resolve_max_model_len(config: EngineConfig, loaded: LoadedModel) -> int:
    requested = config.model.max_model_len
    max_model_len = requested or loaded.context_len  # sliding-window layers attend through their window at any length
    if requested and requested > loaded.context_len:
        logger.warning("max_model_len %d exceeds the model's context length %d", requested, loaded.context_len)
    return max_model_len


def _cpu_kernels_build() -> bool:
    from tokenmill.kernels import cpu_kernels_available

    return cpu_kernels_available()

