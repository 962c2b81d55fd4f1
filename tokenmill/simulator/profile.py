"""Calibration: the step cost of the real runner on this machine, fitted and stored.

`calibrate(config)` builds the engine `tokenmill serve` would build with the same
settings, runs a short profile through it (single prompts of 16-512 tokens, and of
1,024-4,096 where max_model_len takes them, suffixes of 16-128 tokens over a cached prefix,
batches of 1-64 requests decoding at contexts of 16-400 tokens, and decodes with prompts
arriving among them, so that prefill tokens, decode rows, their contexts and the prefill
attention vary independently), times every engine step (`StepRecord.duration_s`: scheduling, the
runner, detokenization and outputs), and fits `planner.costmodel`'s step model to the
steps (`StepMeter` gives their features). With `server=True` it then starts `tokenmill
serve` with the same settings and sends the same small workloads (1 and 16 streams) to it
and to the engine in this process, alternately, to measure what the server adds
(`ServerOverheads`: per request, per step, per streamed token). `Calibrator` keeps the
engine loaded for repeated profiles (`simulate validate --calibrate` profiles around
every measured point).

A profile is a JSON file per machine, model, dtype and thread count, under
`~/.cache/tokenmill/simulator/` (or `$XDG_CACHE_HOME/tokenmill/simulator/`).
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.batch import RunnerOutput, SchedulerOutput
from tokenmill.engine.engine import Executor, LLMEngine, StepObserver, StepRecord
from tokenmill.hardware import cpu_info
from tokenmill.outputs import RequestOutput
from tokenmill.planner.costmodel import Fit, StepCostModel, StepFeatures, fit_step_cost_model
from tokenmill.sampling.params import SamplingParams
from tokenmill.simulator.executor import StepMeter
from tokenmill.simulator.simulate import ServerOverheads

SCHEMA = "tokenmill.simulator.profile/1"
Log = Callable[[str], None]


# ----- the profile's workloads -----------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """Requests run to completion: `prompt_lens` added at once (or one every `stagger`
    steps), each generating `max_tokens`; `background` requests (prompt, max_tokens) are
    added first, so that the staggered prompts arrive among their decodes. With
    `prefix_len`, every prompt is one shared prefix of that many tokens and then its own
    `prompt_lens` tokens, and the prefix alone runs first (one token), so that with prefix
    caching on the prompts compute only their suffix, attending over the cached prefix."""

    name: str
    prompt_lens: tuple[int, ...]
    max_tokens: int
    stagger: int = 0
    background: tuple[tuple[int, int], ...] = ()
    prefix_len: int = 0


WARMUP = Workload("warm-up", (64, 64), 4)
# Suffixes over a cached prefix: many attention pairs for few prefill tokens. Without them a
# prompt's pairs grow with its tokens squared along one curve, the fit could not tell the two
# terms apart, and the pair coefficient of one machine came out anywhere in 0.08-0.91 us from
# calibration to calibration (so the simulator priced a 128-token suffix over a 512-token
# prefix at 83-143 ms; measured 92-128 ms).
CACHED_PREFIX = (Workload("suffixes over a cached prefix", (16, 64, 128, 32), 4, stagger=6, prefix_len=384),
                 Workload("4 x 64 over a cached prefix", (64,) * 4, 8, prefix_len=384))
# Pure decode steps of 1, 2, 4, 8, 16, 24, 32 and 64 rows (two contexts for 4 and 16),
# prompts alone and among decodes. About 15,000 tokens: 1-3 minutes per repeat on the
# 2-core box with the default model in float32 on one thread, depending on its load.
DEFAULT_WORKLOADS = (
    Workload("single prompts", (16, 64, 128, 256, 512), 8, stagger=8),
    Workload("2 x 256", (256,) * 2, 12),
    Workload("4 x 64", (64,) * 4, 12),
    Workload("4 x 400", (400,) * 4, 12),
    Workload("8 x 200", (200,) * 8, 12),
    Workload("16 x 32", (32,) * 16, 12),
    Workload("16 x 128", (128,) * 16, 12),
    Workload("24 x 64", (64,) * 24, 12),
    Workload("32 x 32", (32,) * 32, 12),
    Workload("64 x 16", (16,) * 64, 12),
    Workload("prompts among 8 decodes", (32, 128, 256, 64, 192), 2, stagger=4, background=((64, 40),) * 8),
    *CACHED_PREFIX,
)


# A lighter profile (about 9,000 tokens) to calibrate around every point of a validation sweep.
QUICK_WORKLOADS = (
    Workload("single prompts", (16, 64, 128, 256), 8, stagger=8),
    Workload("2 x 128", (128,) * 2, 10),
    Workload("4 x 64", (64,) * 4, 10),
    Workload("8 x 64", (64,) * 8, 10),
    Workload("16 x 48", (48,) * 16, 10),
    Workload("24 x 32", (32,) * 24, 10),
    Workload("32 x 32", (32,) * 32, 10),
    Workload("64 x 16", (16,) * 64, 10),
    Workload("prompts among 8 decodes", (32, 128, 256, 64, 192), 2, stagger=4, background=((64, 40),) * 8),
    *CACHED_PREFIX,
)


# Prompts past the short ones, one at a time, where max_model_len takes them: the prefill
# attention term grows with the square of a prompt, and fitted on prompts of at most 512 tokens
# it put a 4,096-token prefill at 0.78x of its measured time (docs/disaggregation.md). At the
# scheduler's default chunk of 2,048 tokens, 4,096 is two chunks, the second over 2,048 of context.
LONG_PROMPTS = (1024, 2048, 4096)


def with_long_prompts(workloads: Sequence[Workload], max_model_len: int) -> tuple[Workload, ...]:
    """`workloads` and a workload of the LONG_PROMPTS that fit `max_model_len` (none: as given)."""
    lens = tuple(n for n in LONG_PROMPTS if n + 2 <= max_model_len)
    return (*workloads, Workload("long prompts", lens, 2, stagger=4)) if lens else tuple(workloads)


def profile_tokens(workloads: Sequence[Workload]) -> int:
    """Prompt and output tokens the workloads compute (what the profile's duration grows with)."""
    return sum(sum(w.prompt_lens) + len(w.prompt_lens) * w.max_tokens + sum(p + n for p, n in w.background)
               + w.prefix_len for w in workloads)


class MeteredExecutor:
    """The real executor, with each step's features taken on the way in."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.meter = StepMeter()
        self.last = StepFeatures(0, 0, 0)

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        self.last = self.meter.measure(batch)
        return self.inner.execute(batch)


@dataclass
class _StepSamples(StepObserver):
    executor: MeteredExecutor
    samples: list[tuple[StepFeatures, float]] = field(default_factory=list)
    recording: bool = True

    def on_step(self, record: StepRecord, outputs: list[RequestOutput]) -> None:
        features = self.executor.last
        if self.recording and features.prefill_tokens + features.decode_tokens > 0:
            self.samples.append((features, record.duration_s))


def run_profile(engine: LLMEngine, executor: MeteredExecutor, workloads: Sequence[Workload] = DEFAULT_WORKLOADS,
                repeats: int = 1, seed: int = 0, log: Log | None = None) -> list[tuple[StepFeatures, float]]:
    """Run the warm-up (not recorded), then the workloads `repeats` times; every engine
    step as (features, seconds). `engine` must run on `executor`."""
    recorder = _StepSamples(executor)
    engine.add_observer(recorder)
    rng = random.Random(seed)
    vocab = engine.vocab_size
    low, high = min(1000, vocab // 4), min(5000, vocab)  # ordinary tokens in any modern vocabulary

    def prompt(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    def run(workload: Workload) -> None:
        prefix = prompt(workload.prefix_len)
        if prefix:
            _add(engine, prefix, 1)
            while engine.has_unfinished_requests():
                engine.step()
        for n, max_tokens in workload.background:
            _add(engine, prompt(n), max_tokens)
        pending = list(workload.prompt_lens)
        steps = 0
        while pending or engine.has_unfinished_requests():
            if pending and (workload.stagger == 0 or steps % workload.stagger == 0):
                for _ in range(len(pending) if workload.stagger == 0 else 1):
                    _add(engine, prefix + prompt(pending.pop(0)), workload.max_tokens)
            engine.step()
            steps += 1

    recorder.recording = False
    run(WARMUP)
    recorder.recording = True
    for repeat in range(repeats):
        for workload in workloads:
            started = time.perf_counter()
            before = len(recorder.samples)
            run(workload)
            if log:
                log(f"profile {repeat + 1}/{repeats}: {workload.name}: {len(recorder.samples) - before} steps "
                    f"in {time.perf_counter() - started:.1f} s")
    return recorder.samples


def _add(engine: LLMEngine, prompt: list[int], max_tokens: int) -> None:
    # Streaming outputs (not final-only), as the server asks for them.
    engine.add_request(engine.new_request_id(), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


# ----- the stored profile ------------------------------------------------------------------------


@dataclass
class Profile:
    """A calibration: where it was measured, the fitted step model, the server's overheads."""

    machine: str
    model_name: str
    model_path: str
    requested_dtype: str  # the --dtype flag calibrated with (auto included)
    compute_dtype: str  # what it resolved to
    weight_format: str
    kv_cache_dtype: str
    num_threads: int
    kv_bytes_per_token: int
    model_max_len: int  # the model's context length (max_model_len's default)
    default_kv_cache_memory: int  # the builder's default KV memory on this machine
    cost_model: StepCostModel
    fit: dict[str, Any]  # samples, errors of the fitted model and of BLIS's 4-term one
    overheads: ServerOverheads | None = None
    overheads_detail: dict[str, Any] | None = None
    created: str = ""
    load_average: list[float] | None = None
    profile_seconds: float = 0.0
    samples: list[list[float]] = field(default_factory=list)  # [prefill, decode, context, pairs, seconds]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["schema"] = SCHEMA
        data["cost_model"] = self.cost_model.to_dict()
        data["overheads"] = self.overheads.to_dict() if self.overheads else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not a tokenmill simulator profile (schema {data.get('schema')!r}, want {SCHEMA!r})")
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        try:
            fields["cost_model"] = StepCostModel.from_dict(data["cost_model"])
            fields["overheads"] = ServerOverheads(**data["overheads"]) if data.get("overheads") else None
            return cls(**fields)
        except (KeyError, TypeError) as error:
            raise ValueError(f"a simulator profile is missing a field: {error}") from None

    def samples_as_pairs(self) -> list[tuple[StepFeatures, float]]:
        return [(StepFeatures(int(p), int(d), int(c), int(a)), s) for p, d, c, a, s in self.samples]

    def describe(self) -> str:
        fit = self.fit
        text = (f"{self.model_name} ({self.weight_format} weights, {self.compute_dtype} compute, "
                f"{self.num_threads} threads) on {self.machine}, calibrated {self.created}: "
                f"{fit['samples']} steps, median error {fit['median_relative_error']:.1%}")
        return text


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tokenmill" / "simulator"


def machine_name() -> str:
    return f"{cpu_info().model_name} x{cpu_info().num_cores}"


def profile_path(profile: Profile) -> Path:
    parts = (profile.machine, profile.model_name, profile.requested_dtype, f"t{profile.num_threads}")
    slug = "-".join(re.sub(r"[^A-Za-z0-9.]+", "_", part).strip("_") for part in parts)
    return cache_dir() / f"{slug}.json"


def save_profile(profile: Profile, path: str | Path | None = None) -> Path:
    target = Path(path) if path else profile_path(profile)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    return target


def load_profile(path: str | Path) -> Profile:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read a simulator profile: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a simulator profile")
    return Profile.from_dict(data)


def find_profile(model_path: str, dtype: str, num_threads: int, directory: Path | None = None) -> Path | None:
    """The newest stored profile of this machine for the model, the dtype (as given, or as
    it resolved) and the thread count; None when there is none."""
    directory = directory or cache_dir()
    machine = machine_name()
    found: list[tuple[str, Path]] = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            profile = load_profile(path)
        except ValueError:
            continue
        if (profile.machine == machine and os.path.realpath(profile.model_path) == os.path.realpath(model_path)
                and dtype in (profile.requested_dtype, profile.compute_dtype) and profile.num_threads == num_threads):
            found.append((profile.created, path))
    return max(found)[1] if found else None


# ----- calibration ------------------------------------------------------------------------------------


def fit_profile_samples(samples: Sequence[tuple[StepFeatures, float]]) -> tuple[Fit, dict[str, Any]]:
    """The fit with Vidur's terms (prefill attention, a decode curve per batch size), and
    its errors beside those of BLIS's four linear terms alone."""
    full = fit_step_cost_model(samples, prefill_attention=True, decode_curve=True)
    blis = fit_step_cost_model(samples)
    return full, {
        "samples": full.samples,
        "median_relative_error": full.median_relative_error,
        "max_relative_error": full.max_relative_error,
        "four_term_median_relative_error": blis.median_relative_error,
        "four_term_max_relative_error": blis.max_relative_error,
    }


class Calibrator:
    """The engine `tokenmill serve` would build from `config`, loaded once in this process
    (and torch with it), to profile: `profile()` runs workloads and returns the steps,
    `make_profile(samples)` fits them into a `Profile`."""

    def __init__(self, config: EngineConfig) -> None:
        from tokenmill.builder import build_executor
        from tokenmill.planner.model_spec import read_model
        from tokenmill.runner.worker import default_kv_cache_memory, resolve_device

        self.config = config
        built = build_executor(config)
        self.facts = built.facts
        self.executor = MeteredExecutor(built.executor)
        self.engine = LLMEngine(config, self.executor, built.tokenizer, self.facts)
        self.model_max_len = read_model(self.facts.model_path).shape.max_position_embeddings
        self.default_kv_cache_memory = default_kv_cache_memory(resolve_device(config.device.device))
        self._seed = 0

    def profile(self, workloads: Sequence[Workload] = DEFAULT_WORKLOADS, repeats: int = 1,
                log: Log | None = None) -> list[tuple[StepFeatures, float]]:
        if log:
            facts = self.facts
            log(f"calibrating {facts.model_name} ({facts.weight_format} weights, {facts.compute_dtype} compute, "
                f"{facts.num_threads} threads): about {profile_tokens(workloads) * repeats:,} tokens")
        self._seed += 1  # fresh prompts: none is in the prefix cache
        return run_profile(self.engine, self.executor, workloads, repeats, seed=self._seed, log=log)

    def make_profile(self, samples: Sequence[tuple[StepFeatures, float]], seconds: float = 0.0) -> Profile:
        facts, config = self.facts, self.config
        fit, fit_info = fit_profile_samples(samples)
        return Profile(
            machine=machine_name(), model_name=facts.model_name, model_path=facts.model_path,
            requested_dtype=config.model.dtype, compute_dtype=facts.compute_dtype,
            weight_format=facts.weight_format, kv_cache_dtype=facts.kv_cache_dtype, num_threads=facts.num_threads,
            kv_bytes_per_token=facts.kv_bytes_per_token, model_max_len=self.model_max_len,
            default_kv_cache_memory=self.default_kv_cache_memory, cost_model=fit.model, fit=fit_info,
            created=datetime.now().isoformat(timespec="seconds"), load_average=list(os.getloadavg()),
            profile_seconds=seconds,
            samples=[[s.prefill_tokens, s.decode_tokens, s.decode_context, s.prefill_attention, t]
                     for s, t in samples],
        )


def calibrate(config: EngineConfig, workloads: Sequence[Workload] = DEFAULT_WORKLOADS, repeats: int = 2,
              server: bool = True, log: Log | None = None) -> Profile:
    """Profile the real runner built from `config`, fit the step model, and (with `server`)
    measure the server's overheads. Loads the model (and torch)."""
    started = time.perf_counter()
    calibrator = Calibrator(config)
    if workloads is DEFAULT_WORKLOADS:
        workloads = with_long_prompts(workloads, calibrator.facts.max_model_len)
    samples = calibrator.profile(workloads, repeats, log)
    profile = calibrator.make_profile(samples, time.perf_counter() - started)
    if server:
        profile.overheads, profile.overheads_detail = measure_server_overheads(config, calibrator.engine, log=log)
        profile.profile_seconds = time.perf_counter() - started
    return profile


# ----- the server's overheads ------------------------------------------------------------------------


OVERHEAD_PROMPT_LEN = 64
OVERHEAD_OUTPUT_LEN = 16
OVERHEAD_STREAMS = (1, 16)  # lone requests (per request, per step); a batch (per streamed token)
OVERHEAD_ROUNDS = 3


@dataclass
class _Steps(StepObserver):
    records: list[StepRecord] = field(default_factory=list)

    def on_step(self, record: StepRecord, outputs: list[RequestOutput]) -> None:
        self.records.append(record)


def measure_server_overheads(config: EngineConfig, engine: LLMEngine, rounds: int = OVERHEAD_ROUNDS,
                             log: Log | None = None, url: str | None = None) -> tuple[ServerOverheads, dict[str, Any]]:
    """What `tokenmill serve` adds to the engine's steps, measured side by side: the same
    requests (64 prompt tokens, 16 output tokens; 1 and then 16 at once) through `engine`
    in this process and through a server started with `config`'s flags (`bench serve`'s
    client; or the one at `url`), alternately, `rounds` times. From the medians of each pair:
    - per step: a lone request's inter-token gap - the engine's decode step;
    - per streamed token: (16 streams' gap - the engine's 16-row decode step - per step) / 16;
    - per request: a lone request's TTFT - the engine's prefill step - per step.
    Alternating keeps a machine whose load drifts from reading as an overhead."""
    import asyncio
    from contextlib import AsyncExitStack

    from tokenmill.config import engine_args
    from tokenmill.workloads.datasets import DatasetConfig
    from tokenmill.workloads.load_client import ServeConfig, open_session, run_point
    from tokenmill.workloads.local_server import LocalServer

    steps = _Steps()
    engine.add_observer(steps)
    rng = random.Random(4321)

    def in_process(streams: int) -> tuple[float, float]:
        """(the prefill step, the median decode step) of `streams` requests run at once."""
        steps.records.clear()
        for _ in range(streams):
            _add(engine, [rng.randrange(1000, 5000) for _ in range(OVERHEAD_PROMPT_LEN)], OVERHEAD_OUTPUT_LEN)
        while engine.has_unfinished_requests():
            engine.step()
        prefill = [r.duration_s for r in steps.records if r.num_prefill_tokens]
        decode = [r.duration_s for r in steps.records if not r.num_prefill_tokens and r.num_decode_tokens == streams]
        return sum(prefill), statistics.median(decode)

    async def through_server(url: str, streams: int, seed: int) -> dict[str, Any]:
        dataset = DatasetConfig(num_prompts=streams, input_len=OVERHEAD_PROMPT_LEN, output_len=OVERHEAD_OUTPUT_LEN,
                                seed=seed)
        serve_config = ServeConfig(base_url=url, dataset=dataset, max_concurrency=streams, disable_tqdm=True)
        async with AsyncExitStack() as stack:
            return await run_point(await open_session(serve_config, stack))

    if log:
        log(f"measuring the server's overheads: {rounds} rounds of 1 and {OVERHEAD_STREAMS[-1]} streams "
            f"({OVERHEAD_PROMPT_LEN} prompt tokens, {OVERHEAD_OUTPUT_LEN} output tokens), in this process and "
            "through tokenmill serve")
    pairs: dict[int, list[tuple[float, float, dict[str, Any]]]] = {n: [] for n in OVERHEAD_STREAMS}

    def measure(server_url: str) -> None:
        asyncio.run(through_server(server_url, 1, 999))  # warm-up
        for round_index in range(rounds):
            for streams in OVERHEAD_STREAMS:
                prefill, decode = in_process(streams)
                result = asyncio.run(through_server(server_url, streams, 1000 + 10 * round_index + streams))
                if result["failed"]:
                    raise RuntimeError(f"measuring the server's overheads: {result['failed']} requests failed: "
                                       f"{next(iter(result['failed_reasons']), '')}")
                pairs[streams].append((prefill, decode, result))

    try:
        if url is not None:
            measure(url)
        else:
            with LocalServer([*engine_args(config), "--disable-access-log"]) as server:
                measure(server.url)
    finally:
        engine.observers.remove(steps)
    return overheads_from_pairs(pairs)


def overheads_from_pairs(pairs: dict[int, list[tuple[float, float, dict[str, Any]]]]) -> tuple[ServerOverheads, dict]:
    """The overheads from (in-process prefill step, in-process decode step, server result)
    per round and number of streams: see `measure_server_overheads`. Negative excesses
    count as 0."""
    def median_gap(result: dict[str, Any]) -> float:
        return statistics.median(g for itl in result["itls"] for g in itl)

    lone, many = min(pairs), max(pairs)
    step = statistics.median(median_gap(r) - decode for _, decode, r in pairs[lone])
    step_s = max(step, 0.0)
    request = statistics.median(statistics.median(r["ttfts"]) - prefill - step_s for prefill, _, r in pairs[lone])
    chunk = statistics.median((median_gap(r) - decode - step_s) / many for _, decode, r in pairs[many]) \
        if many > lone else 0.0
    detail = {
        "rounds": len(pairs[lone]), "streams": sorted(pairs),
        "step_excess_s": step, "request_excess_s": request, "chunk_excess_s": chunk,
        "in_process_decode_s": {n: [d for _, d, _ in v] for n, v in pairs.items()},
        "server_median_itl_s": {n: [median_gap(r) for _, _, r in v] for n, v in pairs.items()},
        "load_average": list(os.getloadavg()),
    }
    return ServerOverheads(request_s=max(request, 0.0), step_s=step_s, chunk_s=max(chunk, 0.0)), detail
