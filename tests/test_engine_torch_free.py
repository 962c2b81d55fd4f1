"""The engine core (scheduler, block manager, step loop, output processing) must not
import torch: it can then drive a simulator, and a front end can import it cheaply.
Checked in fresh interpreters, since this test session may have imported torch already.
The engine's request bookkeeping is also exercised here on a fake executor and tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from fakes import FakeTokenizer, make_engine, reference_outputs

from tokenmill.sampling.params import SamplingParams

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

TORCH_FREE_MODULES = [
    "tokenmill.engine.scheduler",
    "tokenmill.engine.step_cost",
    "tokenmill.engine.block_manager",
    "tokenmill.engine.engine",
    "tokenmill.engine.output_processor",
    "tokenmill.engine.detokenizer",
]


def run_python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=TESTS_DIR,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def test_engine_modules_do_not_import_torch() -> None:
    out = run_python(
        f"""
        import importlib, json, sys
        for name in {TORCH_FREE_MODULES!r}:
            importlib.import_module(name)
        print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
        """
    )
    assert json.loads(out.strip().splitlines()[-1]) == []


def test_engine_steps_with_a_fake_executor_without_importing_torch() -> None:
    """The whole step loop -- admission checks, chunked prefill, n > 1, abort,
    detokenization -- runs on a fake executor and tokenizer, and torch stays out."""
    out = run_python(
        f"""
        import json, sys
        sys.path.insert(0, {TESTS_DIR!r})
        from fakes import VOCAB_SIZE, make_engine, reference_outputs
        from tokenmill.sampling.params import SamplingParams

        engine = make_engine(num_blocks=12, block_size=4, max_model_len=64, max_num_seqs=4,
                             max_num_batched_tokens=16)
        kv = engine.scheduler.kv
        result = {{"errors": []}}
        for bad in (
            lambda: engine.add_request("big", list(range(3, 30)), SamplingParams(max_tokens=30)),
            lambda: engine.add_request("empty", [], SamplingParams()),
            lambda: engine.add_request("oov", [VOCAB_SIZE], SamplingParams()),
        ):
            try:
                bad()
            except ValueError as e:
                result["errors"].append(str(e))
        result["idle_after_rejects"] = (not engine.has_unfinished_requests(), kv.num_free_blocks)
        prompt_a = list(range(10, 30))
        engine.add_request("a", prompt_a, SamplingParams(max_tokens=5, ignore_eos=True))
        engine.add_request("b", "hello", SamplingParams(max_tokens=3, n=2, seed=1))
        engine.add_request("c", list(range(50, 60)), SamplingParams(max_tokens=20))
        finals, steps = {{}}, 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finals[output.request_id] = output
            kv.check_integrity()
            steps += 1
            if steps == 3:
                result["c_held"] = len(kv.get_block_ids("c"))
                aborted = engine.abort_request("c")
                finals["c"] = aborted
                held = {{b for r in engine.scheduler.running for b in kv.get_block_ids(r.request_id)}}
                result["free_after_abort"] = [kv.get_block_ids("c"), kv.num_free_blocks == kv.num_blocks - len(held)]
            assert steps < 100
        result["a"] = [finals["a"].outputs[0].token_ids == reference_outputs(prompt_a, 5),
                       finals["a"].outputs[0].finish_reason, len(finals["a"].outputs[0].text)]
        result["b"] = [len(finals["b"].outputs), [o.finish_reason for o in finals["b"].outputs],
                       [len(o.token_ids) for o in finals["b"].outputs]]
        result["c"] = [finals["c"].finished, finals["c"].outputs[0].finish_reason]
        result["idle"] = [kv.num_free_blocks == kv.num_blocks, not kv.req_blocks, engine.stats().num_steps == steps]
        result["torch"] = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print(json.dumps(result))
        """
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert len(result["errors"]) == 3
    assert "can never fit in the KV cache (48 tokens)" in result["errors"][0]
    assert "empty" in result["errors"][1]
    assert "out of the vocabulary" in result["errors"][2]
    assert result["idle_after_rejects"] == [True, 12]
    assert result["c_held"] > 0  # c was running when aborted
    assert result["free_after_abort"] == [[], True]
    assert result["a"] == [True, "length", 5]
    assert result["b"] == [2, ["length", "length"], [3, 3]]
    assert result["c"] == [True, "abort"]
    assert result["idle"] == [True, True, True]
    assert result["torch"] == []


def drain(engine) -> dict:
    finals = {}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.scheduler.kv.check_integrity()
        steps += 1
        assert steps < 1000
    return finals


def assert_engine_idle(engine) -> None:
    kv = engine.scheduler.kv
    kv.check_integrity()
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks
    assert not kv.req_blocks and not kv.req_hashes
    assert not engine.output_processor.user_requests and not engine.output_processor.sample_owner


def test_engine_n_samples_share_the_prompt_and_abort_frees_every_sample() -> None:
    engine = make_engine(num_blocks=16)
    kv = engine.scheduler.kv
    engine.add_request("r", list(range(10, 19)), SamplingParams(n=3, max_tokens=30, ignore_eos=True))
    engine.step()
    held = {rid: kv.get_block_ids(rid) for rid in ("r#0", "r#1", "r#2")}
    assert all(len(blocks) == 3 for blocks in held.values())
    assert held["r#0"][:2] == held["r#1"][:2] == held["r#2"][:2]  # the prompt's full blocks are shared
    output = engine.abort_request("r")
    assert output is not None and output.finished
    assert [o.finish_reason for o in output.outputs] == ["abort"] * 3
    assert kv.num_free_blocks == kv.num_blocks  # at once, not at the next step
    assert engine.abort_request("r") is None
    assert engine.step() == []  # the next step only reports the finished ids
    assert_engine_idle(engine)


def test_engine_rejects_before_adding_any_sample() -> None:
    engine = make_engine(num_blocks=4)
    with pytest.raises(ValueError, match="can never fit"):
        engine.add_request("r", list(range(10, 20)), SamplingParams(n=2, max_tokens=20))
    with pytest.raises(ValueError, match="max_model_len is 64"):
        engine.add_request("long", list(range(3, 70)), SamplingParams(n=2))
    assert not engine.scheduler.requests and not engine.output_processor.user_requests
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=2))
    assert list(engine.scheduler.requests) == ["ok"]
    finals = drain(engine)
    assert finals["ok"].outputs[0].token_ids == reference_outputs([5, 6, 7], 2)
    assert_engine_idle(engine)


def test_engine_rejects_a_sample_id_collision_without_leaving_a_sample_behind() -> None:
    """Sample ids are derived ("x#0", "x#1"); a user request id may equal one of them.
    When one sample of a new request collides, the request must be rejected as a
    whole: no other sample may stay queued in the scheduler without an owner in the
    output processor (the next step would crash on it)."""
    engine = make_engine(num_blocks=16)
    engine.add_request("x#1", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [5, 6, 7], SamplingParams(n=2, max_tokens=2, ignore_eos=True))
    assert list(engine.scheduler.requests) == ["x#1"]
    assert list(engine.output_processor.user_requests) == ["x#1"]
    finals = drain(engine)
    assert list(finals) == ["x#1"]
    assert_engine_idle(engine)


def test_engine_stop_token_and_stats() -> None:
    engine = make_engine(num_blocks=16, policy=lambda rid, i, ctx: 777 if i == 2 else None)
    engine.add_request("s", [5, 6, 7, 8, 9], SamplingParams(max_tokens=10, stop_token_ids=[777]))
    finals = drain(engine)
    out = finals["s"].outputs[0]
    assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == ("stop", 777, 3)
    stats = engine.stats()
    assert (stats.num_prompt_tokens, stats.num_generation_tokens, stats.num_steps) == (5, 3, 3)
    assert engine.scheduler.requests == {}
    assert_engine_idle(engine)


@pytest.mark.parametrize("stop_at", [1, 4, 7])
def test_a_stop_string_inside_an_accepted_run_truncates_tokens_and_text(stop_at: int) -> None:
    """With proposals verified several tokens a step, a stop string completed in the
    middle of the accepted run ends the output exactly where one-token steps end it."""
    prompt = list(range(10, 20))
    expected_ids = reference_outputs(prompt, 12)
    text = FakeTokenizer().decode(expected_ids)
    stop = text[stop_at : stop_at + 2]  # completed by output token stop_at + 1

    def run(speculate: bool):
        engine = make_engine(num_blocks=16)
        engine.add_request("s", prompt, SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True))
        finals, steps = {}, 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finals[output.request_id] = output
            request = engine.scheduler.requests.get("s")
            if speculate and request is not None:
                request.spec_token_ids = reference_outputs(request.all_token_ids, 5)
            steps += 1
        assert_engine_idle(engine)
        out = finals["s"].outputs[0]
        return (out.token_ids, out.text, out.finish_reason, out.stop_reason), steps, engine.stats()

    plain, plain_steps, plain_stats = run(False)
    spec, spec_steps, spec_stats = run(True)
    assert plain == (expected_ids[: text.index(stop) + 2], text[: text.index(stop)], "stop", stop)
    assert spec == plain
    assert spec_steps < plain_steps or plain_steps <= 2
    assert spec_stats.num_generation_tokens == plain_stats.num_generation_tokens == len(plain[0])


def test_every_step_is_reported_to_every_observer_on_the_injected_clock() -> None:
    from tokenmill.engine.engine import StepObserver

    class Recorder(StepObserver):
        def __init__(self) -> None:
            self.records, self.outputs, self.aborted = [], [], []

        def on_step(self, record, outputs) -> None:
            self.records.append(record)
            self.outputs.append([o.request_id for o in outputs])

        def on_aborted(self, output) -> None:
            self.aborted.append(output.request_id)

    ticks = iter(range(10_000))
    engine = make_engine(num_blocks=16, max_num_batched_tokens=8)
    engine.clock = engine.scheduler.clock = engine.output_processor.clock = lambda: float(next(ticks))
    first, second = Recorder(), Recorder()
    engine.add_observer(first)
    engine.add_observer(second)
    engine.add_request("a", list(range(10, 22)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("b", list(range(30, 34)), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort_request("b")
    drain(engine)
    records = first.records
    assert records == second.records and first.aborted == second.aborted == ["b"]
    assert [r.index for r in records] == list(range(len(records)))
    # Step 0: a's first 8 prompt tokens (chunked); step 1: a's last 4 and b's 4; then decodes.
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in records[:3]] == [(8, 0), (8, 0), (0, 2)]
    assert [r.num_generated for r in records[:4]] == [0, 2, 2, 2]
    assert records[3].finished_ids == ["a"] and records[3].num_running == 1
    assert all(r.schedule_s > 0 and r.execute_s > 0 and r.process_s > 0 for r in records)  # the fake clock ticks
    assert sum(r.num_generated for r in records) == engine.stats().num_generation_tokens
    assert first.outputs[3] == ["a", "b"]


# ----- priority scheduling --------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_high_priority_requests_finish_first_under_overload(policy: str) -> None:
    """Six long low-priority requests fill the two sequence slots and queue; two
    high-priority ones arrive later. Under priority they take the slots from the running
    low-priority requests (preempted, recomputed later) and finish first; under fcfs they
    finish last. Every output is the model's either way."""
    engine = make_engine(num_blocks=64, max_num_seqs=2, scheduling_policy=policy)
    by_priority = policy == "priority"
    prompts = {f"low{i}": list(range(10 + 10 * i, 16 + 10 * i)) for i in range(6)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=8, ignore_eos=True), priority=int(by_priority))
    engine.step()
    engine.step()
    for rid, prompt in {"high0": [200, 201, 202], "high1": [300, 301, 302]}.items():
        prompts[rid] = prompt
        engine.add_request(rid, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    finals = drain(engine)
    order = list(finals)
    if by_priority:
        assert order == ["high0", "high1", "low0", "low1", "low2", "low3", "low4", "low5"]
        assert engine.stats().num_preemptions == 2
    else:
        assert order == ["low0", "low1", "low2", "low3", "low4", "low5", "high0", "high1"]
        assert engine.stats().num_preemptions == 0
    for rid, prompt in prompts.items():
        assert finals[rid].outputs[0].token_ids == reference_outputs(prompt, 8), rid
    assert_engine_idle(engine)


def test_priority_is_refused_under_fcfs_before_anything_is_queued() -> None:
    engine = make_engine(num_blocks=16)
    with pytest.raises(ValueError, match=r"priority must be 0 unless priority scheduling is enabled \(got -2"):
        engine.add_request("r", [5, 6, 7], SamplingParams(n=2, max_tokens=2), priority=-2)
    with pytest.raises(ValueError, match="priority must be an integer"):
        make_engine(scheduling_policy="priority").add_request("r", [5, 6, 7], priority="1")  # type: ignore[arg-type]
    assert not engine.scheduler.requests and not engine.output_processor.user_requests
    with pytest.raises(ValueError, match="priority_aging applies to --scheduling-policy priority only"):
        make_engine(priority_aging=10.0)


def test_llm_generate_takes_one_priority_per_prompt() -> None:
    from tokenmill.engine.engine import StepObserver
    from tokenmill.llm import LLM

    class Finishes(StepObserver):
        def __init__(self) -> None:
            self.order: list[str] = []

        def on_step(self, record, outputs) -> None:
            self.order += record.finished_ids

    engine = make_engine(num_blocks=32, max_num_seqs=1, scheduling_policy="priority")
    finishes = Finishes()
    engine.add_observer(finishes)
    llm = LLM.from_engine(engine)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    outputs = llm.generate(["abc", "def", "ghi"], params, priority=[2, 0, 1])
    assert [o.prompt for o in outputs] == ["abc", "def", "ghi"]  # in prompt order
    assert finishes.order == ["1", "2", "0"]  # run in priority order
    with pytest.raises(ValueError, match="got 2 priorities for 3 prompts"):
        llm.generate(["abc", "def", "ghi"], params, priority=[0, 1])
    fcfs = LLM.from_engine(make_engine(num_blocks=32))
    with pytest.raises(ValueError, match="priority must be 0 unless"):
        fcfs.generate(["abc", "def"], params, priority=[0, 1])
    assert not fcfs.engine.scheduler.requests  # validated before anything was queued
    assert [o.outputs[0].text for o in fcfs.generate(["abc"], params, priority=[0])] == [outputs[0].outputs[0].text]


def test_llm_generate_takes_per_prompt_slo_targets() -> None:
    """`LLM.generate(..., slo_ttft_ms=, slo_tpot_ms=)`: one value for all prompts or one per
    prompt, set on each request as SLO mode aims at it (95%); a bad one queues nothing."""
    from tokenmill.llm import LLM

    engine = make_engine(num_blocks=32)
    seen: dict[str, tuple[float | None, float | None]] = {}
    add = engine.scheduler.add_request

    def record(request) -> None:
        seen[request.request_id] = (request.slo_ttft, request.slo_tpot)
        add(request)

    engine.scheduler.add_request = record
    llm = LLM.from_engine(engine)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate(["abc", "def"], params, slo_ttft_ms=[1000, None], slo_tpot_ms=100)
    assert seen == {"0": (pytest.approx(0.95), pytest.approx(0.095)), "1": (None, pytest.approx(0.095))}
    with pytest.raises(ValueError, match="got 1 values of slo_ttft_ms for 2 prompts"):
        llm.generate(["abc", "def"], params, slo_ttft_ms=[1000])
    with pytest.raises(ValueError, match="slo_tpot_ms must be a positive number of milliseconds"):
        llm.generate(["abc", "def"], params, slo_tpot_ms=[100, 0])
    assert not engine.scheduler.requests
