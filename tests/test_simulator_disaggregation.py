"""tokenmill simulate with several instances: aggregated replicas and prefill-decode
disaggregation (simulator/disaggregation.py) on hand-computed timelines, and the CLI's
comparison. The engines are the real ones (scheduler, block manager, the scheduler's
disaggregation side); only the model and the transport are priced."""

from __future__ import annotations

import json

import pytest

from tests.test_simulator import profile_file, run_cli, setup, timeline, trace  # noqa: F401 (fixture)
from tokenmill.planner.costmodel import KVTransferCost
from tokenmill.simulator.disaggregation import Layout
from tokenmill.simulator.executor import StepMeter
from tokenmill.simulator.simulate import simulate

# setup(): step = 100 ms + 10 ms per prefill token + 20 ms per decode row; 4-token blocks of
# 8 bytes per token = 32 bytes a block. At 320 bytes/s a block takes 0.1 s to pull.
LINK = KVTransferCost(bandwidth=320.0)
PD = Layout.parse("1P1D")


def test_one_request_through_prefill_pull_and_decode():
    # A: 9-token prompt, 3 tokens. Prefill instance: [0, 0.19] computes the 9 tokens (0.1 + 0.09),
    # samples its one token and holds A's blocks. Decode instance: A arrives at 0.19, allocates
    # blocks for 8 tokens (2 blocks) and pulls them: 0.2 s, done at 0.39. Then its last prompt
    # token is one decode row, [0.39, 0.51], the first token; two decode steps of 0.12 follow.
    run = simulate(trace((0.0, 9, 3)), setup(), layout=PD, transfer=LINK)
    [(ttft, itl, e2e, _)] = timeline(run)
    assert ttft == pytest.approx(0.51) and itl == pytest.approx([0.12, 0.12]) and e2e == pytest.approx(0.75)
    [pull] = run.pulls
    assert (pull.blocks, pull.nbytes) == (2, 64)
    assert (pull.started, pull.done) == pytest.approx((0.19, 0.39))
    prefill, decode = run.instances
    assert (prefill.role, prefill.num_steps, prefill.busy_s) == ("prefill", 1, pytest.approx(0.19))
    assert (decode.role, decode.num_steps, decode.busy_s) == ("decode", 3, pytest.approx(0.36))
    assert [(s.num_prefill_tokens, s.num_decode_tokens) for s in run.steps] == [(9, 0), (1, 0), (0, 1), (0, 1)]
    # the prefill instance's token is not the client's: three tokens, all from the decode instance
    assert run.records[0].output_tokens == 3


def test_one_instance_is_the_single_engine_run():
    requests = trace((0.0, 4, 3), (0.05, 2, 2), (0.3, 9, 4))
    assert timeline(simulate(requests, setup(), layout=Layout())) == timeline(simulate(requests, setup()))


def stream_and_long_prompts() -> tuple:
    # A stream (2-token prompt, 12 tokens) and three 40-token prompts (1 token each) arriving while it decodes.
    return trace((0.0, 2, 12), (0.15, 40, 1), (1.05, 40, 1), (1.85, 40, 1))


def test_long_prefills_stall_the_aggregated_streams_not_the_disaggregated_ones():
    requests = stream_and_long_prompts()
    stall = 0.1 + 40 * 0.01 + 0.02  # a step with a 40-token prefill and the stream's decode row
    one = simulate(requests, setup(), layout=Layout())
    two = simulate(requests, setup(), layout=Layout(replicas=2))  # round-robin: prompt 2 lands on the stream's
    pd = simulate(requests, setup(), layout=PD, transfer=KVTransferCost(bandwidth=32e3))
    assert max(one.records[0].itl) == pytest.approx(stall)
    assert max(two.records[0].itl) == pytest.approx(stall)
    assert sorted(one.records[0].itl)[-3] == pytest.approx(stall)  # three prefills, three stalls
    assert sorted(two.records[0].itl)[-2] < stall  # one of them on its replica
    # Disaggregated, the decode instance only ever computes the prompts' last tokens (decode rows):
    # the stream's gaps are one-row (0.12) or two-row (0.14) decode steps.
    assert max(pd.records[0].itl) == pytest.approx(0.14)
    assert min(pd.records[0].itl) == pytest.approx(0.12)
    # ... and the prompts pay for it in TTFT: the pull, and the prefill instance computing them alone
    assert pd.records[1].ttft > one.records[1].ttft - stall


def test_transfer_time_grows_with_the_prompt():
    link = KVTransferCost(bandwidth=320.0, latency_s=0.05)
    requests = trace((0.0, 16, 2), (5.0, 32, 2), (10.0, 64, 2))  # far apart: no pull waits for another
    run = simulate(requests, setup(max_model_len=128), layout=PD, transfer=link)
    # all but the last prompt token is pulled: 15, 31 and 63 tokens -> 4, 8 and 16 blocks
    assert [p.blocks for p in run.pulls] == [4, 8, 16]
    assert [p.done - p.started for p in run.pulls] == pytest.approx([0.05 + 0.1 * b for b in (4, 8, 16)])
    # TTFT = prefill (0.1 + 0.01 n) + pull + the last prompt token's step (0.12)
    assert [r.ttft for r in run.records] == pytest.approx(
        [0.1 + 0.01 * n + 0.05 + 0.1 * b + 0.12 for n, b in ((16, 4), (32, 8), (64, 16))])


def test_pulls_queue_on_the_decode_instances_link_and_copy_in_is_priced():
    # Two 9-token prompts at once: prefilled in one step [0, 0.28], both pulled from 0.28; the
    # second pull waits for the first (one puller): done at 0.48 and 0.68.
    link = KVTransferCost(bandwidth=320.0, copy_in_bandwidth=3200.0)  # 10 ms per copied block
    run = simulate(trace((0.0, 9, 2), (0.0, 9, 2)), setup(), layout=PD, transfer=link)
    assert [t for p in run.pulls for t in (p.started, p.done)] == pytest.approx([0.28, 0.48, 0.28, 0.68])
    # each request's step copies its 2 blocks first: 0.12 + 0.02
    first_steps = [s for s in run.steps if s.num_prefill_tokens == 1]
    assert [s.duration_s for s in first_steps] == pytest.approx([0.14, 0.14])
    # the first: [0.48, 0.62], then its last token [0.62, 0.74]; the second landed at 0.68, mid-step
    assert [r.ttft for r in run.records] == pytest.approx([0.48 + 0.14, 0.74 + 0.14])


def test_two_prefill_instances_share_the_prompts():
    run = simulate(trace((0.0, 9, 2), (0.0, 9, 2)), setup(), layout=Layout.parse("2P1D"), transfer=LINK)
    assert [i.role for i in run.instances] == ["prefill", "prefill", "decode"]
    assert [i.num_steps for i in run.instances[:2]] == [1, 1]
    assert [t for p in run.pulls for t in (p.started, p.done)] == pytest.approx([0.19, 0.39, 0.19, 0.59])


def test_a_one_token_chunk_is_a_decode_row():
    from tokenmill.engine.batch import NewRequestData, ScheduledRequest, SchedulerOutput
    from tokenmill.sampling.params import SamplingParams

    new = NewRequestData(prompt_token_ids=list(range(9)), params=SamplingParams())
    step = StepMeter().measure(SchedulerOutput(scheduled=[
        ScheduledRequest("a", start_pos=8, num_new_tokens=1, appended_token_ids=[], new_block_ids=[0, 1, 2],
                         sample=True, new=new)]))
    assert (step.prefill_tokens, step.decode_tokens, step.decode_context) == (0, 1, 9)


def test_layouts_parse_and_refuse():
    assert Layout.parse("2p1d") == Layout(replicas=0, prefill=2, decode=1)
    assert Layout.parse("1P1D").aggregated_peer() == Layout(replicas=2)
    assert Layout.parse("3P2D").name == "3P2D" and Layout(replicas=4).name == "4 replicas"
    for bad in ("1P", "P1D", "0P1D", "1P0D", "x"):
        with pytest.raises(ValueError):
            Layout.parse(bad)
    with pytest.raises(ValueError, match="KV transfer cost"):
        simulate(trace((0.0, 9, 2)), setup(), layout=PD)
    with pytest.raises(ValueError, match="bandwidth"):
        KVTransferCost(bandwidth=0)


def test_cli_compares_aggregated_and_disaggregated(capsys, tmp_path, profile_file):  # noqa: F811
    args = ("--profile", profile_file, "--request-rate", "2", "--num-prompts", "30", "--input-len", "256",
            "--output-len", "16", "--goodput", "ttft:2000", "tpot:200", "--pd", "1P1D",
            "--kv-transfer-bandwidth", "0.01", "--kv-transfer-latency-ms", "2")
    code, out, _ = run_cli(capsys, *args, "--json", "--save-result", str(tmp_path / "pd.json"))
    assert code == 0
    results = json.loads(out)
    assert results == json.loads((tmp_path / "pd.json").read_text())
    aggregated, disaggregated = results["aggregated"], results["disaggregated"]
    assert (aggregated["layout"], disaggregated["layout"]) == ("2 replicas", "1P1D")
    assert [i["role"] for i in disaggregated["instances"]] == ["prefill", "decode"]
    assert aggregated["completed"] == disaggregated["completed"] == 30
    assert "p99_itl_ms" in aggregated and "request_goodput" in disaggregated
    pulls = disaggregated["kv_transfer"]
    # 255 tokens pulled = 16 blocks of 16 tokens x 1,024 bytes, at 10 MB/s + 2 ms
    assert pulls["num_pulls"] == 30 and pulls["median_pull_bytes"] == 16 * 16 * 1024
    assert pulls["cost"]["bandwidth_bytes_per_s"] == 1e7 and pulls["cost"]["latency_s"] == 0.002
    assert pulls["median_pull_ms"] >= 2 + 16 * 16 * 1024 / 1e7 * 1e3 - 1e-6
    assert "kv_transfer" not in aggregated
    code, out, _ = run_cli(capsys, *args)
    assert code == 0
    assert "Aggregated vs disaggregated" in out and "2 replicas" in out and "1P1D" in out and "KV pulls: 30" in out
    code, out, _ = run_cli(capsys, "--profile", profile_file, "--request-rate", "2", "--num-prompts", "10",
                           "--input-len", "64", "--output-len", "8", "-dp", "2")
    assert code == 0 and "Instances (2 replicas), busy (%):" in out


def test_cli_sweep_runs_every_point_for_both_layouts(capsys, tmp_path, profile_file):  # noqa: F811
    code, out, _ = run_cli(capsys, "sweep", "--profile", profile_file, "--request-rates", "1,2", "--num-prompts", "12",
                           "--input-len", "128", "--output-len", "8", "--pd", "1P1D", "--output-dir", str(tmp_path))
    assert code == 0
    assert "[2-replicas]" in out and "[1P1D]" in out
    for label, roles in (("2-replicas", ["both", "both"]), ("1P1D", ["prefill", "decode"])):
        points = json.loads((tmp_path / label / "sweep.json").read_text())["points"]
        assert [p["request_rate"] for p in points] == [1.0, 2.0]
        result = json.loads((tmp_path / label / "rate-2.json").read_text())
        assert [i["role"] for i in result["instances"]] == roles and result["completed"] == 12
        assert ("kv_transfer" in result) == (label == "1P1D")
