"""Prefill-decode disaggregation behind the real vllm-router (`--vllm-pd-disaggregation`):
one prefill (kv_producer) and one decode (kv_consumer) `tokenmill serve` per KV dtype, the
official openai client, greedy outputs compared with one instance's, blocks freed on both
sides, and the faults: a decode instance that never pulls, a prefill instance that is gone,
a mismatched KV layout (docs/disaggregation.md). The instances share this host, so the
decode instance copies from the prefill instance's shared memory; the second prefill
instance of 2P1D has it off, so its blocks come over TCP."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import httpx
import openai
import pytest

from tests.server_utils import ServerProcess, free_port, vllm_router
from tests.tiny_checkpoint import write_tiny_llama

ABORT_TIMEOUT_S = 8  # the producers' abort_request_timeout: a hold nobody pulls is freed after it
PULL_TIMEOUT_S = 3  # the consumers' pull_timeout
TINY_PROMPTS = [" ".join(f"w{i % 97}" for i in range(n)) for n in (11, 45)]  # 3 and 12 blocks of 4
DEFAULT_PROMPTS = [
    "The history of the Roman empire is long and complicated. It began when",
    "Write a short story about a lighthouse keeper who finds a message in a bottle. The keeper had lived alone "
    "on the island for twenty years, and every morning he climbed the one hundred and twelve steps of the tower "
    "to polish the great lens. One morning, after a storm,",
]


def kv_config(role: str, **extra: object) -> str:
    config = {"kv_connector": "TokenmillConnector", "kv_role": role}
    if role == "kv_producer":
        config["kv_port"] = free_port()
        extra.setdefault("abort_request_timeout", ABORT_TIMEOUT_S)
    else:
        extra.setdefault("pull_timeout", PULL_TIMEOUT_S)
    config["kv_connector_extra_config"] = extra
    return json.dumps(config)


class Router:
    def __init__(self, prefill: ServerProcess | list[ServerProcess], decode: ServerProcess, *args: str) -> None:
        prefills = prefill if isinstance(prefill, list) else [prefill]
        prefill = prefills[0]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(prefill.log.name + f".router{self.port}", "w")
        self.proc = subprocess.Popen(
            vllm_router("--host", "127.0.0.1", "--port", str(self.port), "--vllm-pd-disaggregation",
                        *(a for p in prefills for a in ("--prefill", p.url)), "--decode", decode.url,
                        "--health-check-interval-secs", "1", *args),
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        else:
            self.stop()
            raise RuntimeError("vllm-router did not become healthy")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


def start_all(servers: list[ServerProcess]) -> list[ServerProcess]:
    errors: list[BaseException] = []

    def start(server: ServerProcess) -> None:
        try:
            server.start()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for server in servers:
            server.stop()
        raise errors[0]
    return servers


PROMPTS: list[str] = []


@pytest.fixture(scope="module", params=["tiny", pytest.param("default", marks=pytest.mark.slow)])
def instances(request, tmp_path_factory):
    """{kv dtype: (prefill, decode)}: bfloat16, int8 and fp8 KV (float32 compute, as the suite's
    servers), on the tiny random checkpoint with 4-token blocks (CI) or the default model;
    "bfloat16-2": a second bfloat16 prefill instance (2P1D)."""
    if request.param == "tiny":
        model = ["--model", str(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tied")), "--block-size", "4"]
        PROMPTS[:] = TINY_PROMPTS
    else:
        model = []
        PROMPTS[:] = DEFAULT_PROMPTS
    servers = {}
    for kv in ("bfloat16", "int8", "fp8_e4m3"):
        servers[kv] = tuple(ServerProcess(*model, "--kv-cache-dtype", kv, "--kv-transfer-config", kv_config(role))
                            for role in ("kv_producer", "kv_consumer"))
    servers["bfloat16-2"] = (ServerProcess(*model, "--kv-cache-dtype", "bfloat16", "--kv-transfer-config",
                                           kv_config("kv_producer", shared_memory=False)),)
    start_all([s for pair in servers.values() for s in pair])
    yield servers
    for pair in servers.values():
        for server in pair:
            server.stop()


def wait_freed(server: ServerProcess, timeout: float = 10.0) -> dict[str, float]:
    """Wait until nothing runs, no block is held for a consumer and the KV cache is empty
    (an idle server frees released holds within a second); the last metrics."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.wait_idle(timeout)
        held = sum(v for k, v in metrics.items() if k.startswith("tokenmill:kv_transfer_held_blocks"))
        if (held == 0 and metrics["tokenmill:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)


def metric(server: ServerProcess, name: str) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith(f"tokenmill:{name}"))


@pytest.mark.parametrize("kv", ["bfloat16", "int8", "fp8_e4m3"])
def test_router_pd_equals_one_instance_and_frees_blocks(instances, kv: str) -> None:
    prefill, decode = instances[kv]
    router = Router(prefill, decode)
    try:
        one = openai.OpenAI(base_url=prefill.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        computed_before = metric(decode, "prompt_tokens_computed")
        pulled_before = metric(decode, "kv_transfer_pulled_blocks")
        shared_before = metric(decode, "kv_transfer_shared_memory_blocks")
        for prompt in PROMPTS:
            want = one.completions.create(model=prefill.model, prompt=prompt, max_tokens=16, temperature=0)
            got = router.client.completions.create(model=prefill.model, prompt=prompt, max_tokens=16, temperature=0)
            assert got.choices[0].text == want.choices[0].text
            assert got.usage.completion_tokens == 16
        messages = [{"role": "user", "content": PROMPTS[1]}]
        want = one.chat.completions.create(model=prefill.model, messages=messages, max_tokens=12, temperature=0)
        stream = router.client.chat.completions.create(model=prefill.model, messages=messages, max_tokens=12,
                                                       temperature=0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text == want.choices[0].message.content

        # The decode instance computed only each prompt's last token: the rest was pulled.
        assert metric(decode, "prompt_tokens_computed") - computed_before == 3
        assert metric(decode, "kv_transfer_pulled_blocks") - pulled_before >= 2 + 1 + 1
        assert metric(decode, "kv_transfer_failed_pulls") == 0
        # Same host: every block was copied from the prefill instance's shared memory.
        assert (metric(decode, "kv_transfer_shared_memory_blocks") - shared_before
                == metric(decode, "kv_transfer_pulled_blocks") - pulled_before)

        # Again: the decode instance's own prefix cache holds every block it needs, so it pulls
        # none and releases the prefill instance's hold.
        pulled = metric(decode, "kv_transfer_pulled_blocks")
        want = one.completions.create(model=prefill.model, prompt=PROMPTS[1], max_tokens=16, temperature=0)
        got = router.client.completions.create(model=prefill.model, prompt=PROMPTS[1], max_tokens=16, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        assert metric(decode, "kv_transfer_pulled_blocks") == pulled
        for server in (prefill, decode):
            metrics = wait_freed(server)
            assert metrics["tokenmill:kv_cache_usage_perc"] == 0, server.log_tail()
        assert metric(prefill, "kv_transfer_held_blocks") == 0
        assert metric(prefill, "kv_transfer_expired_requests") == 0
    finally:
        router.stop()


def test_a_decode_instance_that_never_pulls_frees_after_the_timeout(instances) -> None:
    prefill, _ = instances["bfloat16"]
    wait_freed(prefill)
    expired = metric(prefill, "kv_transfer_expired_requests")
    client = openai.OpenAI(base_url=prefill.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    response = client.completions.create(model=prefill.model, prompt=PROMPTS[1], max_tokens=1, temperature=0,
                                         extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    params = response.model_extra["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    assert {"remote_engine_id", "remote_host", "remote_port", "remote_request_id"} <= set(params)
    started = time.monotonic()
    time.sleep(1.5)
    assert metric(prefill, "kv_transfer_held_blocks") == len(params["remote_block_ids"])
    assert metric(prefill, "kv_cache_usage_perc") > 0
    while metric(prefill, "kv_transfer_held_blocks") and time.monotonic() - started < ABORT_TIMEOUT_S + 10:
        time.sleep(0.5)
    assert time.monotonic() - started >= ABORT_TIMEOUT_S - 1
    assert metric(prefill, "kv_transfer_held_blocks") == 0
    assert metric(prefill, "kv_transfer_expired_requests") == expired + 1
    assert wait_freed(prefill)["tokenmill:kv_cache_usage_perc"] == 0


def test_a_mismatched_kv_layout_is_refused_with_a_clear_error(instances) -> None:
    prefill, _ = instances["int8"]
    _, decode = instances["bfloat16"]
    router = Router(prefill, decode)
    try:
        with pytest.raises(openai.BadRequestError) as error:
            router.client.completions.create(model=prefill.model, prompt=PROMPTS[0], max_tokens=8, temperature=0)
        message = str(error.value)
        assert "does not hold the same KV layout" in message and "kv_cache_dtype 'int8' there" in message
        # The decode instance told the prefill instance: its blocks are freed now, not at the timeout.
        assert wait_freed(prefill, timeout=5)["tokenmill:kv_cache_usage_perc"] == 0
        assert metric(prefill, "kv_transfer_expired_requests") == 0
        assert wait_freed(decode)["tokenmill:kv_cache_usage_perc"] == 0
    finally:
        router.stop()


def test_a_prefill_instance_that_is_gone_means_recompute(instances) -> None:
    """The pull fails (nobody listens at remote_port): the decode instance computes the
    prompt itself and answers as one instance would."""
    prefill, decode = instances["bfloat16"]
    client = openai.OpenAI(base_url=decode.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    want = openai.OpenAI(base_url=prefill.url + "/v1", api_key="unused", max_retries=0).completions.create(
        model=prefill.model, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    failed = metric(decode, "kv_transfer_failed_pulls")
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "gone",
              "remote_block_ids": list(range(64)), "remote_host": "127.0.0.1", "remote_port": free_port(),
              "remote_request_id": "gone-kv0"}
    got = client.completions.create(model=prefill.model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                    extra_body={"kv_transfer_params": params})
    assert got.choices[0].text == want.choices[0].text
    assert metric(decode, "kv_transfer_failed_pulls") == failed + 1
    assert wait_freed(decode)["tokenmill:kv_cache_usage_perc"] == 0


def test_kv_transfer_params_without_a_connector_or_malformed_are_400(instances) -> None:
    _, decode = instances["bfloat16"]
    response = decode.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                    "kv_transfer_params": {"do_remote_decode": True}})
    assert response.status_code == 400 and "do_remote_decode needs a prefill instance" in response.text
    response = decode.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                    "kv_transfer_params": {"do_remote_prefill": True}})
    assert response.status_code == 400 and "remote_engine_id" in response.text
    assert response.json()["error"]["param"] == "kv_transfer_params"


def test_two_prefill_instances_one_decode_instance(instances) -> None:
    """2P1D: the router spreads the prefills (round robin) over two producers on their own
    kv_ports; the decode instance pulls from whichever one its request names."""
    prefill, decode = instances["bfloat16"]
    (second,) = instances["bfloat16-2"]
    router = Router([prefill, second], decode, "--prefill-policy", "round_robin")
    try:
        one = openai.OpenAI(base_url=prefill.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        sent = [metric(p, "kv_transfer_sent_blocks") for p in (prefill, second)]
        pulled, shared = (metric(decode, f"kv_transfer_{m}_blocks") for m in ("pulled", "shared_memory"))
        for i in range(4):
            prompt = f"{PROMPTS[0]} {i} {PROMPTS[0]}"
            want = one.completions.create(model=prefill.model, prompt=prompt, max_tokens=8, temperature=0)
            got = router.client.completions.create(model=prefill.model, prompt=prompt, max_tokens=8, temperature=0)
            assert got.choices[0].text == want.choices[0].text
        for server in (prefill, second, decode):
            assert wait_freed(server)["tokenmill:kv_cache_usage_perc"] == 0
        # (read once the instances are idle: a producer's counters are its last step's)
        new_sent = [metric(p, "kv_transfer_sent_blocks") - before for p, before in zip((prefill, second), sent)]
        assert all(new_sent)
        # The first prefill instance's blocks were copied from its shared memory, the second's
        # (shared_memory off) came over TCP.
        assert metric(decode, "kv_transfer_shared_memory_blocks") - shared == new_sent[0]
        assert metric(decode, "kv_transfer_pulled_blocks") - pulled == sum(new_sent)
    finally:
        router.stop()
