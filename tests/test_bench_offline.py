"""`tokenmill bench offline`: workload construction, and the CLI end to end in --quick mode."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from tokenmill.bench import offline
from tokenmill.workloads import offline as workloads
from tokenmill.workloads.offline import FULL, QUICK, WORKLOAD_METRICS, WORKLOADS, build_requests, repetition_rng


def test_full_workloads_have_the_specified_shapes() -> None:
    pool = list(range(100, 1000))
    rng = random.Random(0)
    (w1,) = build_requests("W1", FULL, rng, pool)
    assert (len(w1[0]), w1[1]) == (128, 128)
    (w2,) = build_requests("W2", FULL, rng, pool)
    assert (len(w2[0]), w2[1]) == (1024, 16)
    w3 = build_requests("W3", FULL, rng, pool)
    assert len(w3) == 64
    assert all(64 <= len(p) <= 512 and 32 <= n <= 256 for p, n in w3)
    assert len({len(p) for p, _ in w3}) > 10  # lengths vary
    w4 = build_requests("W4", FULL, rng, pool)
    assert len(w4) == 32
    assert all(len(p) == 512 + 32 and n == 64 for p, n in w4)
    assert len({tuple(p[:512]) for p, _ in w4}) == 1  # one shared prefix
    assert len({tuple(p[512:]) for p, _ in w4}) == 32  # distinct suffixes
    allowed = set(pool)
    assert all(t in allowed for p, _ in [w1, w2, *w3, *w4] for t in p)


def test_every_repetition_draws_fresh_prompts() -> None:
    pool = list(range(50_000))
    draws = {rep: build_requests("W4", FULL, repetition_rng(0, "W4", rep), pool) for rep in ("warmup0", "0", "1")}
    prefixes = {tuple(reqs[0][0][:512]) for reqs in draws.values()}
    assert len(prefixes) == 3  # no repetition can hit an earlier one's prefix cache
    # ... yet a repetition is reproducible
    assert build_requests("W4", FULL, repetition_rng(0, "W4", "1"), pool) == draws["1"]
    assert build_requests("W1", FULL, repetition_rng(0, "W1", "0"), pool) != build_requests(
        "W1", FULL, repetition_rng(0, "W2", "0"), pool
    )


def test_prompt_tokens_exclude_special_and_added_tokens() -> None:
    class Backend:
        def get_added_tokens_decoder(self):
            return {0: "<|endoftext|>", 1: "<|im_start|>", 9: "<tool>"}

    class Tok:
        backend = Backend()
        bos_token_id = 1
        eos_token_ids = [2]

        def is_special(self, token_id: int) -> bool:
            return token_id == 3

    assert workloads.ordinary_token_ids(Tok(), 12) == [4, 5, 6, 7, 8, 10, 11]


def test_speedup_direction() -> None:
    assert workloads.speedup("decode_tok_s", 20.0, 10.0) == 2.0
    assert workloads.speedup("ttft_ms", 50.0, 100.0) == 2.0
    assert workloads.speedup("wall_s", 0.0, 1.0) is None


def test_unknown_workload_is_a_usage_error(capsys) -> None:
    from tokenmill.cli import main

    assert main(["bench", "offline", "--workloads", "W1,W9"]) == 2
    assert "W9" in capsys.readouterr().err


@pytest.fixture
def restore_torch_threads():
    """The engine sets torch's (process-wide) thread count; give other tests theirs back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# One thread: on a small shared machine, two OpenMP threads slow down tenfold as soon as
# another process takes a core, and this test only checks plumbing.
QUICK_ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "64MiB", "--num-threads", "1"]


def test_quick_cli_writes_every_key(tmp_path, capsys, restore_torch_threads) -> None:
    from tokenmill.cli import main

    out = tmp_path / "results.json"
    rc = main(["bench", "offline", "--quick", "--runs", "2", "--warmup", "1", "--output", str(out), *QUICK_ENGINE])
    assert rc == 0
    printed = capsys.readouterr()
    assert "W1:" in printed.out and "W4:" in printed.out  # the table
    assert "W3 run 2/2" in printed.err  # progress

    report = json.loads(out.read_text())
    assert report["schema"] == offline.SCHEMA
    for key in ("cpu_model", "cores", "ram_gib", "torch", "torch_threads", "dtype"):
        assert report["machine"][key] is not None, key
    assert report["machine"]["dtype"] == "float32"
    assert report["settings"]["runs"] == 2 and report["settings"]["quick"] is True
    assert report["settings"]["sizes"] == json.loads(json.dumps(dataclasses.asdict(QUICK)))
    assert set(report["workloads"]) == set(WORKLOADS)
    for name, result in report["workloads"].items():
        systems = result["systems"]
        expected = {"tokenmill_prefix_on", "tokenmill_prefix_off"} if name == "W4" else {"tokenmill"}
        assert set(systems) == expected
        for system in systems.values():
            assert len(system["runs"]) == 2
            for run in system["runs"]:
                for key in (*offline.RUN_KEYS, *WORKLOAD_METRICS[name]):
                    assert key in run, (name, key)
                    assert run[key] == run[key], (name, key)  # not NaN
            assert set(system["median"]) == set(WORKLOAD_METRICS[name])
            assert all(v > 0 or k in workloads.NOT_SPEEDUPS for k, v in system["median"].items())
    w4 = report["workloads"]["W4"]
    # The shared prefix is served from the cache only when caching is on.
    assert w4["systems"]["tokenmill_prefix_on"]["median"]["cached_prompt_tokens"] > 0
    assert w4["systems"]["tokenmill_prefix_off"]["median"]["cached_prompt_tokens"] == 0
    for key in ("speedup", "paired_speedup"):
        assert set(w4[key]["prefix_on_vs_off"]) == set(WORKLOAD_METRICS["W4"]) - {"cached_prompt_tokens"}
        assert all(v > 0 for v in w4[key]["prefix_on_vs_off"].values())
    w1 = report["workloads"]["W1"]["systems"]["tokenmill"]["runs"][0]
    assert w1["output_tokens"] == QUICK.w1_new and w1["prompt_tokens"] == QUICK.w1_prompt


def test_quick_cli_with_speculation_runs_it_on_and_off(tmp_path, restore_torch_threads) -> None:
    """With --speculative-config the input-grounded workloads run with speculation and on a
    sibling engine without it: same greedy tokens, a speedup column, the acceptance."""
    from tokenmill.cli import main

    out = tmp_path / "results.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    rc = main(["bench", "offline", "--quick", "--workloads", "W5,W6", "--runs", "1", "--warmup", "0",
               "--output", str(out), "--speculative-config", spec, *QUICK_ENGINE])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["machine"]["speculative"] == "ngram, 4 tokens, lookup 2-4"
    for name in ("W5", "W6"):
        result = report["workloads"][name]
        assert set(result["systems"]) == {"tokenmill", "tokenmill_spec_off"}
        on, off = (result["systems"][s]["median"] for s in ("tokenmill", "tokenmill_spec_off"))
        assert on["acceptance_rate"] > 0 and on["mean_acceptance_length"] > 1
        assert off["acceptance_rate"] == 0
        assert set(result["speedup"]["spec_on_vs_off"]) == \
            set(WORKLOAD_METRICS[name]) - set(workloads.NOT_SPEEDUPS)
        agreement = result["spec_greedy_agreement"]
        assert agreement["identical_requests"] == agreement["num_requests"] > 0


def test_grounded_workloads_are_chat_prompts_over_given_passages() -> None:
    from tokenmill.workloads.grounded import PAIRS

    seen = []
    requests = build_requests("W6", FULL, random.Random(0), [], encode_chat=lambda m: seen.append(m) or [1, 2])
    assert len(requests) == 32 and all(n == FULL.grounded_new for _, n in requests)
    texts = [m[0]["content"] for m in seen]
    # Every task/passage pair once before any repeats, each behind its own document number.
    assert {next(i for i, (task, passage) in enumerate(PAIRS) if task in t and passage in t)
            for t in texts[: len(PAIRS)]} == set(range(len(PAIRS)))
    assert len(set(texts)) == 32
    with pytest.raises(ValueError, match="chat template"):
        build_requests("W5", FULL, random.Random(0), [])


@pytest.mark.slow
def test_quick_cli_with_hf_baseline(tmp_path, restore_torch_threads) -> None:
    """The transformers baseline on W1 (slow: loads and dequantizes the model a second time)."""
    from tokenmill.cli import main

    out = tmp_path / "results.json"
    rc = main([
        "bench", "offline", "--quick", "--workloads", "W1", "--runs", "1", "--warmup", "0",
        "--baseline", "hf", "--output", str(out), *QUICK_ENGINE,
    ])
    assert rc == 0
    w1 = json.loads(out.read_text())["workloads"]["W1"]
    assert set(w1["systems"]) == {"tokenmill", "hf"}
    assert set(w1["speedup"]["tokenmill_vs_hf"]) == set(WORKLOAD_METRICS["W1"])
    assert set(w1["paired_speedup"]["tokenmill_vs_hf"]) == set(WORKLOAD_METRICS["W1"])
    assert w1["greedy_agreement"]["num_requests"] == 1
