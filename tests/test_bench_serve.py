"""`tokenmill bench serve` / `sweep`: the metric arithmetic on synthetic timestamps,
runs against a fake server that fails in known ways, and short runs against a real
`tokenmill serve` on loopback."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.server_utils import ServerProcess
from tokenmill.bench import serve_cli
from tokenmill.workloads.metrics import (
    RequestRecord,
    arrival_times,
    calculate_metrics,
    meets_slos,
    output_timeline,
    parse_goodput,
    peaks,
)

# Keys of vLLM's result file (vllm/benchmarks/serve.py) that every result must carry.
VLLM_KEYS = [
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "errors",
    "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")),
    *(f"p90_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")),
]


def ok(ttft: float, itl: list[float], output_tokens: int | None = None, start: float = 0.0,
       prompt_len: int = 10) -> RequestRecord:
    tokens = len(itl) + 1 if output_tokens is None else output_tokens
    return RequestRecord(prompt_len=prompt_len, success=True, start_time=start, ttft=ttft, itl=itl,
                         latency=ttft + sum(itl), output_tokens=tokens)


# ----- metric arithmetic -------------------------------------------------------------------


def test_latency_statistics_on_known_timestamps():
    records = [
        ok(0.1, [0.1] * 10),  # TPOT (1.1 - 0.1) / 10 = 100 ms
        ok(0.2, [0.05, 0.15]),  # TPOT 100 ms, E2EL 400 ms
        ok(0.3, [0.2] * 4),  # TPOT 200 ms
        ok(0.4, [], output_tokens=1),  # one token: no TPOT, no ITL
        RequestRecord(prompt_len=99, error="HTTP 500: boom"),
    ]
    m = calculate_metrics(records, duration=2.0)
    assert (m["completed"], m["failed"]) == (4, 1)
    assert m["total_input_tokens"] == 40 and m["total_output_tokens"] == 11 + 3 + 5 + 1
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_throughput"] == pytest.approx(20 / 2)
    assert m["total_token_throughput"] == pytest.approx(60 / 2)
    assert m["request_goodput"] is None  # no SLOs given

    # TTFT over completed requests [100, 200, 300, 400] ms; numpy's linear percentiles.
    assert m["mean_ttft_ms"] == pytest.approx(250)
    assert m["median_ttft_ms"] == pytest.approx(250)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(0.0125) * 1000)  # population std
    assert m["p90_ttft_ms"] == pytest.approx(370)  # 300 + 0.7 * 100
    assert m["p99_ttft_ms"] == pytest.approx(397)
    # TPOT over requests with > 1 token: [100, 100, 200].
    assert m["mean_tpot_ms"] == pytest.approx(400 / 3)
    assert m["median_tpot_ms"] == pytest.approx(100)
    assert m["p90_tpot_ms"] == pytest.approx(180)
    # ITL pools every gap: ten of 100, 50, 150, four of 200.
    gaps = [100] * 10 + [50, 150] + [200] * 4
    assert m["mean_itl_ms"] == pytest.approx(np.mean(gaps))
    assert m["median_itl_ms"] == pytest.approx(100)
    assert m["p99_itl_ms"] == pytest.approx(np.percentile(gaps, 99))
    # E2EL: [1100, 400, 1100, 400].
    assert m["mean_e2el_ms"] == pytest.approx(750)
    assert m["p90_e2el_ms"] == pytest.approx(1100)

    # Per-request lists keep every request, failed ones as vLLM writes them.
    assert m["input_lens"] == [10, 10, 10, 10, 99]
    assert m["output_lens"] == [11, 3, 5, 1, 0]
    assert m["errors"] == ["", "", "", "", "HTTP 500: boom"]
    assert m["itls"][1] == [0.05, 0.15]
    assert m["failed_reasons"] == {"HTTP 500: boom": 1}


def test_goodput_counts_requests_meeting_every_slo_inclusively():
    records = [
        ok(0.1, [0.1] * 10),  # ttft 100, tpot 100, e2el 1100
        ok(0.2, [0.05, 0.15]),  # ttft 200, tpot 100, e2el 400
        ok(0.3, [0.2] * 4),  # ttft 300, tpot 200, e2el 1100
        ok(0.4, [], output_tokens=1),  # ttft 400, tpot counts as 0, e2el 400
        RequestRecord(error="dropped"),
    ]
    def goodput(*slos):
        return calculate_metrics(records, 4.0, parse_goodput(slos))["request_goodput"]

    assert goodput("ttft:200") == pytest.approx(2 / 4)  # 200 <= 200 counts
    assert goodput("tpot:100") == pytest.approx(3 / 4)  # the one-token request meets any TPOT SLO
    assert goodput("e2el:400") == pytest.approx(2 / 4)
    assert goodput("ttft:300", "tpot:150") == pytest.approx(2 / 4)
    assert goodput("ttft:1000", "tpot:1000", "e2el:2000") == pytest.approx(4 / 4)
    assert meets_slos(records[0], {"ttft": 100.0}) and not meets_slos(records[0], {"ttft": 99.9})


def test_goodput_parsing_rejects_bad_slos():
    assert parse_goodput(["ttft:500", "TPOT:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["e2el:-1"], ["ttft:inf"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_all_failed_run_still_reports_zeros():
    m = calculate_metrics([RequestRecord(error="HTTP 503: loading")] * 3, duration=1.0, goodput={"ttft": 1.0})
    assert (m["completed"], m["failed"], m["request_goodput"]) == (0, 3, 0.0)
    assert m["mean_ttft_ms"] == 0 and m["p99_itl_ms"] == 0
    assert m["failed_reasons"] == {"HTTP 503: loading": 3}


def test_arrival_times_follow_rate_and_burstiness():
    assert arrival_times(5, math.inf) == [0.0] * 5
    even = arrival_times(4, 2.0, burstiness=math.inf)
    assert even == pytest.approx([0.5, 1.0, 1.5, 2.0])
    for burstiness, cv in ((1.0, 1.0), (0.25, 2.0), (4.0, 0.5)):  # gamma: CV = 1/sqrt(shape)
        times = arrival_times(20_000, 10.0, burstiness, np.random.default_rng(1))
        gaps = np.diff([0.0, *times])
        assert times[-1] == pytest.approx(2000.0)  # rescaled: N / rate exactly
        assert np.all(gaps >= 0)
        assert gaps.mean() == pytest.approx(0.1, rel=1e-9)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    same = arrival_times(10, 3.0, 1.0, np.random.default_rng(7))
    assert same == arrival_times(10, 3.0, 1.0, np.random.default_rng(7))
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


def test_timeline_and_peaks():
    records = [ok(0.5, [0.5, 0.5], start=0.0), ok(0.2, [0.1] * 4, output_tokens=10, start=1.0),
               RequestRecord(error="x", start_time=0.5, latency=0.0)]
    starts, tokens, in_flight = output_timeline(records)
    assert starts == [0.0, 1.0]
    assert sum(tokens) == pytest.approx(3 + 10)  # five chunks carry the second request's 10 tokens
    assert tokens == pytest.approx([1.0, 12.0])  # chunks at 0.5 | 1.0, 1.5 and 1.2..1.6
    assert in_flight == pytest.approx([1.0, 0.5 + 0.6])
    peak_tokens, peak_concurrency = peaks(records)
    assert peak_tokens == 7  # content chunks (not tokens) in the busiest second, as vLLM counts
    assert peak_concurrency == 2


# ----- a fake server that fails on purpose ------------------------------------------------


class FakeServer:
    """A raw-asyncio HTTP/1.1 server in a thread. /v1/completions answers, in turn: a
    good stream, HTTP 500, a stream cut mid-way, a stream with an error event ("mixed"),
    or only good streams ("ok"). /v1/chat/completions sends the role chunk at once and
    the first token after `role_delay` s. It has no /tokenize."""

    def __init__(self, mode: str = "mixed", role_delay: float = 0.3) -> None:
        self.mode = mode
        self.role_delay = role_delay
        self.count = 0
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _shutdown(self) -> None:
        """Close the listener and end the handlers of kept-alive connections."""
        self.server.close()
        handlers = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _one(self, reader, writer) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        method, path, _ = head.split(b"\r\n")[0].decode().split(" ")
        headers = dict(line.decode().lower().split(": ", 1) for line in head.split(b"\r\n")[1:] if line)
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        if method == "GET" and path == "/v1/models":
            self._json(writer, 200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
            return True
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self._json(writer, 404, {"error": {"message": "not found"}})
            return True
        request = json.loads(body)
        assert request["stream"] and request["stream_options"] == {"include_usage": True}
        kind = "ok"
        if self.mode == "mixed" and path == "/v1/completions":
            kind = ("ok", "http500", "drop", "sse_error")[self.count % 4]
        self.count += 1
        if kind == "http500":
            self._json(writer, 500, {"error": {"message": "boom", "type": "internal_error", "code": 500}})
            return True
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        chat = path.endswith("chat/completions")
        tokens = request.get("max_completion_tokens") or request["max_tokens"]
        if chat:
            self._event(writer, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await writer.drain()
            await asyncio.sleep(self.role_delay)
        for i in range(tokens):
            if kind == "drop" and i == 2:
                writer.transport.abort()  # mid-stream, without the chunked terminator
                return False
            if kind == "sse_error" and i == 1:
                self._event(writer, {"error": {"message": "engine died", "type": "service_unavailable"}})
                break
            finish = "length" if i == tokens - 1 else None
            choice = ({"index": 0, "delta": {"content": "t"}, "finish_reason": finish} if chat
                      else {"index": 0, "text": "t", "finish_reason": finish})
            self._event(writer, {"choices": [choice]})
            await writer.drain()
            await asyncio.sleep(0.01)
        if kind == "ok":
            self._event(writer, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": tokens,
                                                          "total_tokens": 7 + tokens}})
        self._chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")  # the chunked body's end
        await writer.drain()
        return True

    @classmethod
    def _event(cls, writer, payload: dict) -> None:
        cls._chunk(writer, f"data: {json.dumps(payload)}\n\n".encode())

    @staticmethod
    def _chunk(writer, data: bytes) -> None:
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))

    @staticmethod
    def _json(writer, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
        writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (status, reason.encode(), len(data), data))


def test_failures_are_counted_with_reasons_and_the_run_still_reports(tmp_path, capsys):
    result_path, plot_path = tmp_path / "mixed.json", tmp_path / "mixed.png"
    with FakeServer("mixed") as fake:
        status = serve_cli.main([
            "serve", "--base-url", fake.url, "--num-prompts", "8", "--input-len", "16", "--output-len", "5",
            "--max-concurrency", "2", "--save-result", str(result_path), "--plot", str(plot_path),
            "--disable-tqdm",
        ])
    assert status == 0  # some requests completed
    result = json.loads(result_path.read_text())
    assert (result["completed"], result["failed"]) == (2, 6)
    assert result["model_id"] == "fake-model"  # the first id of /v1/models
    assert result["token_source"].startswith("token ids 1000..4999")  # no /tokenize: id range
    reasons = result["failed_reasons"]
    assert reasons.pop("HTTP 500: boom") == 2
    assert reasons.pop("stream error: engine died") == 2
    (dropped, count), = reasons.items()
    assert count == 2 and dropped.startswith("connection dropped: RemoteProtocolError")
    assert sorted(result["output_lens"]) == [0] * 6 + [5, 5]  # from the usage chunk
    good = [i for i, error in enumerate(result["errors"]) if not error]
    assert all(result["input_lens"][i] == 7 for i in good)  # the server's prompt_tokens wins
    assert all(len(result["itls"][i]) == 4 for i in good)
    assert result["max_concurrent_requests"] <= 2
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "Failed requests:" in out and "2 x HTTP 500: boom" in out


def test_chat_ttft_counts_from_the_first_content_not_the_role_chunk(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"messages": [{"role": "user", "content": "hi"}], "output_len": 3}\n')
    with FakeServer("ok", role_delay=0.3) as fake:
        status = serve_cli.main([
            "serve", "--base-url", fake.url, "--endpoint", "/v1/chat/completions", "--dataset", "jsonl",
            "--dataset-path", str(prompts), "--num-prompts", "5", "--output-len", "4",
            "--save-result", str(tmp_path / "chat.json"), "--disable-tqdm",
        ])
    assert status == 0
    result = json.loads((tmp_path / "chat.json").read_text())
    assert (result["num_prompts"], result["completed"], result["failed"]) == (2, 2, 0)  # the file's 2 lines
    assert result["output_lens"] == [4, 3]
    assert result["ignore_eos"] is False  # jsonl: the model may stop on its own
    assert all(ttft >= 0.29 for ttft in result["ttfts"])  # the role chunk came at once
    assert all(len(itl) == n - 1 for itl, n in zip(result["itls"], result["output_lens"]))
    # TPOT = (E2EL - TTFT) / (n - 1) = mean ITL of a request.
    tpots = [(lat - ttft) / (n - 1)
             for lat, ttft, n in zip(result["latencies"], result["ttfts"], result["output_lens"])]
    assert result["mean_tpot_ms"] == pytest.approx(np.mean(tpots) * 1000)


def test_sweep_writes_one_result_per_point_and_a_plot(tmp_path):
    out = tmp_path / "sweep"
    with FakeServer("ok") as fake:
        status = serve_cli.main([
            "sweep", "--base-url", fake.url, "--request-rates", "20,inf", "--num-prompts", "4",
            "--input-len", "8", "--output-len", "3", "--output-dir", str(out), "--goodput", "ttft:1000",
            "--disable-tqdm",
        ])
    assert status == 0
    assert sorted(p.name for p in out.iterdir()) == ["rate-20.json", "rate-inf.json", "sweep.json", "sweep.png"]
    points = json.loads((out / "sweep.json").read_text())
    assert points["axis"] == "request_rate"
    assert [p["request_rate"] for p in points["points"]] == [20.0, "inf"]
    assert all(p["completed"] == 4 and p["request_goodput"] > 0 for p in points["points"])
    for name in ("rate-20.json", "rate-inf.json"):
        assert all(key in json.loads((out / name).read_text()) for key in VLLM_KEYS)


def test_cli_rejects_bad_arguments(capsys):
    assert serve_cli.main(["serve", "--dataset", "jsonl", "--disable-tqdm"]) == 2
    assert "--dataset-path" in capsys.readouterr().err
    assert serve_cli.main(["serve", "--goodput", "ttft=5"]) == 2
    with pytest.raises(SystemExit):
        serve_cli.main(["serve", "--request-rate", "0"])
    with pytest.raises(SystemExit):
        serve_cli.main(["sweep", "--output-dir", "x"])  # neither --request-rates nor --concurrencies


# ----- a real tokenmill server -------------------------------------------------------------


def run_real(server, tmp_path: Path, name: str, *flags: str) -> dict:
    path = tmp_path / f"{name}.json"
    status = serve_cli.main(["serve", "--base-url", server.url, "--save-result", str(path), "--disable-tqdm", *flags])
    assert status == 0
    return json.loads(path.read_text())


def test_fixed_rate_run_against_tokenmill(server, tmp_path):
    plot = tmp_path / "run.png"
    result = run_real(server, tmp_path, "rate", "--num-prompts", "8", "--input-len", "32", "--output-len", "16",
                      "--request-rate", "4", "--goodput", "ttft:60000", "--plot", str(plot))
    missing = [key for key in VLLM_KEYS if key not in result]
    assert not missing, missing
    assert (result["completed"], result["failed"], result["errors"]) == (8, 0, [""] * 8)
    assert result["model_id"] == server.model and result["request_rate"] == 4.0
    assert result["output_lens"] == [16] * 8 and result["total_output_tokens"] == 128  # ignore_eos: exact
    assert result["input_lens"] == [32] * 8  # token-id prompts, as the server counted them
    assert result["token_source"] == f"{server.url}/tokenize"
    assert all(len(itl) == 15 for itl in result["itls"])  # one chunk per token
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert 0 < result["median_ttft_ms"] < result["median_e2el_ms"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_max_concurrency_run_against_tokenmill(server, tmp_path):
    result = run_real(server, tmp_path, "concurrency", "--num-prompts", "8", "--input-len", "32",
                      "--output-len", "16", "--max-concurrency", "4", "--seed", "1")
    assert (result["completed"], result["failed"]) == (8, 0)
    assert result["output_lens"] == [16] * 8
    assert result["max_concurrency"] == 4 and result["request_rate"] == "inf"
    assert result["max_concurrent_requests"] <= 4
    assert max(result["queue_times"]) > 0  # the last four waited for a slot
    metrics = server.wait_idle()
    assert metrics["tokenmill:num_requests_running"] == 0


def test_chat_run_against_tokenmill(server, tmp_path):
    result = run_real(server, tmp_path, "chat", "--endpoint", "/v1/chat/completions", "--num-prompts", "3",
                      "--input-len", "24", "--output-len", "6", "--max-concurrency", "3")
    assert (result["completed"], result["failed"]) == (3, 0)
    assert result["output_lens"] == [6] * 3
    assert all(n > 24 for n in result["input_lens"])  # the chat template's tokens come on top
    assert all(len(itl) == 5 for itl in result["itls"])  # the role chunk is not a token


# ----- speculative decoding ------------------------------------------------------------------


def test_spec_decode_counters_parse_and_difference():
    from tokenmill.workloads.load_client import parse_spec_decode, spec_decode_metrics

    def exposition(drafts, tokens, accepted, per_pos, prefix="tokenmill"):
        lines = ["# HELP x", f'{prefix}:spec_decode_num_drafts_total{{model_name="m"}} {drafts}',
                 f'{prefix}:spec_decode_num_draft_tokens_total{{model_name="m"}} {tokens}',
                 f'{prefix}:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}',
                 f'{prefix}:spec_decode_num_drafts_created{{model_name="m"}} 1.7e9',
                 f'{prefix}:generation_tokens_total{{model_name="m"}} 99.0']
        lines += [f'{prefix}:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {n}'
                  for i, n in enumerate(per_pos)]
        return "\n".join(lines)

    assert parse_spec_decode('tokenmill:generation_tokens_total{model_name="m"} 3.0') is None
    before = parse_spec_decode(exposition(10, 40, 20, [8, 6, 4, 2]))
    after = parse_spec_decode(exposition(30, 120, 80, [28, 22, 18, 12]))
    assert (after.drafts, after.draft_tokens, after.accepted_tokens) == (30, 120, 80)
    m = spec_decode_metrics(before, after)
    assert (m["spec_decode_num_drafts"], m["spec_decode_draft_tokens"], m["spec_decode_accepted_tokens"]) == \
        (20, 80, 60)
    assert m["spec_decode_acceptance_rate"] == pytest.approx(75.0)
    assert m["spec_decode_acceptance_length"] == pytest.approx(4.0)
    assert m["spec_decode_per_position_acceptance_rates"] == pytest.approx([1.0, 0.8, 0.7, 0.5])
    assert parse_spec_decode(exposition(1, 2, 3, [3], prefix="vllm")).accepted_tokens == 3  # vLLM's names too
    assert spec_decode_metrics(before, None) == {}
    assert spec_decode_metrics(None, after)["spec_decode_num_drafts"] == 30  # no sample yet before the run


@pytest.fixture(scope="module")
def ngram_server():
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    process = ServerProcess("--speculative-config", spec).start()
    yield process
    assert process.stop() == 0, process.log_tail()


def test_grounded_run_against_tokenmill_with_ngram_speculation(ngram_server, tmp_path, capsys):
    """`tokenmill serve --speculative-config` end to end: /metrics counts the drafts, and
    `bench serve` reports the run's acceptance from them."""
    result = run_real(ngram_server, tmp_path, "spec", "--endpoint", "/v1/chat/completions", "--dataset",
                      "grounded", "--num-prompts", "4", "--output-len", "48", "--max-concurrency", "2",
                      "--temperature", "0")
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["ignore_eos"] is False and result["dataset_name"] == "grounded"
    assert result["spec_decode_num_drafts"] > 0
    assert 0 < result["spec_decode_accepted_tokens"] <= result["spec_decode_draft_tokens"]
    assert result["spec_decode_acceptance_length"] == pytest.approx(
        1 + result["spec_decode_accepted_tokens"] / result["spec_decode_num_drafts"])
    rates = result["spec_decode_per_position_acceptance_rates"]
    assert len(rates) == 4 and rates == sorted(rates, reverse=True) and rates[0] > 0
    assert "Speculative Decoding" in capsys.readouterr().out
    metrics = ngram_server.metrics()
    assert metrics["tokenmill:spec_decode_num_draft_tokens_total"] >= result["spec_decode_draft_tokens"]


# ----- agent workloads: structured output and tool calling --------------------------------------


@pytest.fixture(scope="module")
def agent_server():
    process = ServerProcess("--enable-auto-tool-choice", "--tool-call-parser", "hermes").start()
    yield process
    assert process.stop() == 0, process.log_tail()


def test_structured_workload_against_tokenmill(agent_server, tmp_path):
    """Every rung of the schema ladder once; each answer validates against its schema."""
    import random

    import jsonschema

    from tokenmill.workloads.agent import schema_ladder, structured_requests

    count = len(schema_ladder())
    result = run_real(agent_server, tmp_path, "structured", "--endpoint", "/v1/chat/completions", "--dataset",
                      "structured", "--num-prompts", str(count), "--output-len", "400", "--max-concurrency",
                      str(count), "--temperature", "0", "--seed", "3", "--save-detailed")
    assert (result["completed"], result["failed"]) == (count, 0), result["errors"]
    assert result["dataset_name"] == "structured" and result["ignore_eos"] is False
    sent = structured_requests(count, random.Random(3))
    assert len({extra["response_format"]["json_schema"]["name"] for _, extra in sent}) == count
    for (_, extra), text, n in zip(sent, result["generated_texts"], result["output_lens"]):
        assert n < 400, text  # the grammar ended it, not the length cap
        jsonschema.validate(json.loads(text), extra["response_format"]["json_schema"]["schema"])


def test_tool_calling_trace_against_tokenmill(agent_server, tmp_path):
    """One agent conversation, turn by turn: each turn's prompt holds the earlier ones."""
    result = run_real(agent_server, tmp_path, "tools", "--endpoint", "/v1/chat/completions", "--dataset",
                      "tool-calls", "--num-prompts", "4", "--output-len", "80", "--max-concurrency", "1",
                      "--temperature", "0", "--save-detailed")
    assert (result["completed"], result["failed"]) == (4, 0), result["errors"]
    lens = result["input_lens"]  # turn 2 (tool_choice none) is shown no tools, the others are
    assert lens[0] < lens[2] < lens[3] and lens[1] < lens[3]
    # Turns 1 and 3 must call a tool: streamed as tool_calls deltas, no content text.
    assert result["generated_texts"][0] == "" and result["generated_texts"][2] == ""
    assert result["generated_texts"][1]  # tool_choice none: a text answer
    assert all(n > 0 for n in result["output_lens"])


def test_tool_calling_trace_needs_chat(capsys):
    assert serve_cli.main(["serve", "--base-url", "http://127.0.0.1:9", "--dataset", "tool-calls",
                           "--disable-tqdm"]) != 0
