"""The live dashboard (/dashboard) of a real `tokenmill serve`, with --api-key, read over
HTTP and in a real browser: Debian's headless Chromium driven by selenium.

The browser tests skip, naming the install command, only where Chromium and its driver
are not installed (`make setup` installs them as root on Debian). One server for the
module; the load is a few short requests sharing a prompt prefix (so the block map has
shared and cached blocks to show).
"""

from __future__ import annotations

import json
import re
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from tests.server_utils import ServerProcess

API_KEY = "dashboard-test-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
INSTALL = "apt-get update && apt-get install -y chromium chromium-driver (or `make setup` as root on Debian)"
PREFIX = "You are a patient assistant who explains how flour mills work, step by step. " * 8
# Set to a path to keep the browser's screenshot of the loaded page (docs/images/dashboard.png is made so).
SCREENSHOT = os.environ.get("TOKENMILL_DASHBOARD_SCREENSHOT")


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(api_key=API_KEY).start()
    yield process
    # A page still watching does not hold up the SIGTERM drain: its stream ends, the server exits 0.
    with httpx.stream("GET", process.url + "/dashboard/events", headers=process.headers, timeout=60) as events:
        assert events.status_code == 200
        ended = threading.Event()
        reader = threading.Thread(target=lambda: (list(events.iter_lines()), ended.set()), daemon=True)
        reader.start()
        assert process.stop() == 0, process.log_tail()
        reader.join(30)
    assert ended.is_set(), "the event stream did not end at shutdown"


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def run_load(client: OpenAI, model: str, num_requests: int = 8, max_tokens: int = 24) -> None:
    """Concurrent completions sharing a prompt prefix, each running to its max_tokens (so the
    batch stays full for a while); returns when all have finished."""
    def one(i: int) -> None:
        client.completions.create(model=model, prompt=f"{PREFIX}Question {i}: what does the millstone do?",
                                  max_tokens=max_tokens + 2 * i, temperature=0, extra_body={"ignore_eos": True})

    run_concurrently([lambda i=i: one(i) for i in range(num_requests)])


def run_concurrently(calls) -> None:
    """Run the calls at once, each in a thread; re-raises the first failure."""
    with ThreadPoolExecutor(len(calls)) as pool:
        for future in [pool.submit(call) for call in calls]:
            future.result()


# ----- over HTTP ---------------------------------------------------------------------------------


def test_the_page_is_public_and_its_data_needs_the_key(server):
    page = httpx.get(server.url + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/dashboard/dashboard.js" in page.text
    for asset in ("/dashboard/dashboard.js", "/dashboard/dashboard.css"):
        assert httpx.get(server.url + asset).status_code == 200, asset
    # No external network: the page and its assets name no other host.
    for text in (page.text, httpx.get(server.url + "/dashboard/dashboard.js").text):
        assert "http://" not in text and "https://" not in text
    for path in ("/dashboard/state", "/dashboard/events"):
        assert httpx.get(server.url + path).status_code == 401, path
        wrong = httpx.get(server.url + path, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401, path


def test_state_and_events_agree_with_metrics_when_idle(server, client):
    run_load(client, server.model, num_requests=4, max_tokens=8)
    metrics = server.wait_idle()
    state = wait_for_state(server, lambda s: s["counters"]["generation_tokens"]
                           == metrics["tokenmill:generation_tokens_total"])
    assert_agrees_with_metrics(state, metrics)
    assert state["kv"]["num_cached"] > 0  # the finished requests' full blocks stay cached
    assert state["kv"]["states"].count("C") == state["kv"]["num_cached_free"] == state["kv"]["num_cached"]
    assert state["finished"] and {row["finish_reason"] for row in state["finished"]} <= {"length", "stop"}

    # The event stream starts with the newest snapshot, then ticks while nothing happens.
    with httpx.stream("GET", server.url + "/dashboard/events", headers=server.headers, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = read_events(response, count=2)
    (kind, first), (second_kind, tick) = events
    assert kind == "snapshot" and first["seq"] == state["seq"]
    assert second_kind == "tick" and tick["now"] >= first["now"]


def test_disabled_dashboard_is_not_served():
    from tokenmill.serve.api_server import ServerSettings, create_server

    def no_engine():
        raise AssertionError("the engine is not started in this test")

    for enabled, status in ((False, 404), (True, 200)):
        app = create_server(no_engine, ServerSettings(enable_dashboard=enabled, api_key="k")).app
        test_client = TestClient(app)  # not entered: no lifespan, the engine thread never starts
        assert test_client.get("/dashboard", headers={"Authorization": "Bearer k"}).status_code == status
        # Disabled, the page is no longer public either: without the key it is a 401 like any path.
        assert test_client.get("/dashboard").status_code == (401 if not enabled else 200)


# ----- in Chromium -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip(f"Chromium or chromedriver is not installed: {INSTALL}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1500,1250"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def test_browser_page_shows_the_load_and_matches_metrics(server, client, browser):
    from selenium.webdriver.common.by import By

    started = time.monotonic()
    browser.get(server.url + f"/dashboard#key={API_KEY}")
    wait_until(lambda: text(browser, "connection") == "live", "the page to connect")
    wait_until(lambda: value(browser, "kv-num-blocks") is not None, "the first snapshot")
    first_paint_s = time.monotonic() - started
    assert "key=" not in browser.current_url  # the key left the address bar

    # Under load the page shows requests running and blocks in use.
    seen = {"running": 0, "used": 0, "shared": 0}
    steps_before = value(browser, "ctr-steps")
    load = threading.Thread(target=run_load, args=(client, server.model, 10, 40))
    load.start()
    while load.is_alive():
        for key, element in (("running", "num-running"), ("used", "kv-used"), ("shared", "kv-shared")):
            seen[key] = max(seen[key], value(browser, element) or 0)
        if (SCREENSHOT and value(browser, "num-running") >= 6 and value(browser, "ctr-steps") >= steps_before + 25
                and not Path(SCREENSHOT).exists()):  # mid-run: a few steps of history on the page
            browser.save_screenshot(SCREENSHOT)
        time.sleep(0.1)
    load.join()
    assert seen["running"] >= 2 and seen["used"] > 0 and seen["shared"] > 0, seen

    # Idle: every number on the page equals /metrics scraped at the same (quiet) instant.
    metrics = server.wait_idle()
    wait_until(lambda: value(browser, "ctr-generation-tokens") == metrics["tokenmill:generation_tokens_total"],
               "the page to show the final snapshot")
    assert value(browser, "num-running") == metrics["tokenmill:num_requests_running"] == 0
    assert value(browser, "num-waiting") == metrics["tokenmill:num_requests_waiting"] == 0
    assert value(browser, "kv-num-blocks") == num_gpu_blocks(server)
    assert value(browser, "kv-used") == metrics["tokenmill:kv_cache_usage_perc"] * num_gpu_blocks(server)
    assert value(browser, "kv-usage") == metrics["tokenmill:kv_cache_usage_perc"]
    for element, name in PAGE_COUNTERS.items():
        assert value(browser, element) == metrics[name], (element, name)
    blocks = sum(value(browser, e) for e in ("kv-free", "kv-cached-free", "kv-private", "kv-used-cached",
                                             "kv-shared"))
    assert blocks == value(browser, "kv-num-blocks")
    assert value(browser, "kv-cached-free") > 0

    # Hovering a cached block names its hash.
    index = browser.execute_script("return window.tokenmillDashboard.latest.kv.states.indexOf('C')")
    hover_block(browser, index)
    tooltip = browser.find_element(By.ID, "tooltip")
    assert tooltip.is_displayed() and f"block {index}: cached, free" in tooltip.text and "hash" in tooltip.text
    print(f"dashboard first snapshot painted {first_paint_s:.2f} s after navigation")


def test_browser_chat_request_appears_and_completes(server, browser):
    from selenium.webdriver.common.by import By

    if "/dashboard" not in browser.current_url:
        browser.get(server.url + f"/dashboard#key={API_KEY}")
        wait_until(lambda: text(browser, "connection") == "live", "the page to connect")
    box = browser.find_element(By.ID, "chat-input")
    box.clear()
    box.send_keys("Name three things a windmill needs.")
    limit = browser.find_element(By.ID, "chat-max-tokens")
    limit.clear()
    limit.send_keys("48")
    browser.find_element(By.ID, "chat-send").click()

    wait_until(lambda: text(browser, "chat-id").startswith("chatcmpl-"), "the chat request's id")
    request_id = text(browser, "chat-id")
    # It shows in the request table while it runs (polled: a 48-token request takes seconds on a CPU)
    # and then in the finished table, with its finish reason. The tables are rebuilt on each
    # snapshot, so rows are read in one script each time, never held.
    seen_states: set[str] = set()
    reason = None
    deadline = time.monotonic() + 120
    while reason is None and time.monotonic() < deadline:
        seen_states.update(row_attributes(browser, "requests", request_id, "state"))
        reason = next(iter(row_attributes(browser, "finished", request_id, "reason")), None)
        time.sleep(0.05)
    assert reason in ("length", "stop"), reason
    assert "running" in seen_states, f"the chat request never showed as running: {seen_states}"
    wait_until(lambda: text(browser, "chat-status").startswith("done"), "the chat stream to end")
    assert text(browser, "chat-output").strip()
    assert browser.find_element(By.ID, "chat-status").get_attribute("data-finish") == reason




@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory):
    """A tiny random Gemma 3 (sliding-window layers: a hybrid KV cache of two pools) with
    blocks of 4 tokens: over a thousand blocks in the full-attention pool."""
    from tests.tiny_checkpoint import write_tiny_gemma3

    checkpoint = write_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), window=16)
    process = ServerProcess(str(checkpoint), base_args=[
        "--dtype", "float32", "--max-model-len", "512", "--block-size", "4", "--kv-cache-memory", "4MiB",
        "--num-threads", "1", "--disable-access-log"]).start()
    yield process
    assert process.stop() == 0, process.log_tail()


def test_browser_hybrid_cache_with_a_thousand_blocks(hybrid_server, browser):
    from selenium.webdriver.common.by import By

    server = hybrid_server
    browser.get(server.url + "/dashboard")
    wait_until(lambda: value(browser, "kv-num-blocks") is not None, "the first snapshot")
    num_blocks = num_gpu_blocks(server)
    assert num_blocks >= 1000 and value(browser, "kv-num-blocks") == num_blocks
    assert browser.execute_script("return window.tokenmillDashboard.layouts['kv-map'].n") == num_blocks
    assert browser.find_element(By.ID, "sliding-pool").is_displayed()

    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    prompts = [[3 + (7 * i + j) % 500 for j in range(40 + 10 * i)] for i in range(8)]
    run_concurrently([lambda p=p: client.completions.create(model=server.model, prompt=p, max_tokens=120,
                                                             extra_body={"ignore_eos": True}) for p in prompts])
    metrics = server.wait_idle()
    wait_until(lambda: value(browser, "ctr-generation-tokens") == metrics["tokenmill:generation_tokens_total"],
               "the page to show the final snapshot")
    assert value(browser, "kv-usage") == metrics["tokenmill:kv_cache_usage_perc"] == 0
    sliding = browser.execute_script("return window.tokenmillDashboard.latest.kv_sliding")
    assert sliding["num_reserved"] == 1 and sliding["states"][0] == "N" and sliding["num_cached_free"] > 0
    hover_block(browser, 0, canvas_id="kv-sliding-map")
    tooltip = browser.find_element(By.ID, "tooltip-sliding")
    assert tooltip.is_displayed() and "block 0: reserved" in tooltip.text
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors

# ----- helpers ---------------------------------------------------------------------------------

PAGE_COUNTERS = {
    "ctr-prefix-queries": "tokenmill:prefix_cache_queries_total",
    "ctr-prefix-hits": "tokenmill:prefix_cache_hits_total",
    "ctr-prompt-tokens": "tokenmill:prompt_tokens_computed_total",
    "ctr-generation-tokens": "tokenmill:generation_tokens_total",
    "ctr-preemptions": "tokenmill:num_preemptions_total",
    "ttft-count": "tokenmill:time_to_first_token_seconds_count",
    "itl-count": "tokenmill:inter_token_latency_seconds_count",
}


def assert_agrees_with_metrics(state: dict, metrics: dict[str, float]) -> None:
    kv, counters = state["kv"], state["counters"]
    assert state["requests"]["num_running"] == metrics["tokenmill:num_requests_running"]
    assert state["requests"]["num_waiting"] == metrics["tokenmill:num_requests_waiting"]
    assert kv["usage"] == metrics["tokenmill:kv_cache_usage_perc"]
    assert kv["num_used"] == kv["num_blocks"] - kv["num_free"] == kv["usage"] * kv["num_blocks"]
    assert kv["prefix_cache_queries"] == metrics["tokenmill:prefix_cache_queries_total"]
    assert kv["prefix_cache_hits"] == metrics["tokenmill:prefix_cache_hits_total"]
    assert counters["prompt_tokens_computed"] == metrics["tokenmill:prompt_tokens_computed_total"]
    assert counters["generation_tokens"] == metrics["tokenmill:generation_tokens_total"]
    assert counters["num_preemptions"] == metrics["tokenmill:num_preemptions_total"]
    assert state["ttft"]["count"] == metrics["tokenmill:time_to_first_token_seconds_count"]
    assert state["itl"]["count"] == metrics["tokenmill:inter_token_latency_seconds_count"]
    assert len(kv["states"]) == kv["num_blocks"]


def wait_for_state(server: ServerProcess, ready, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = server.get("/dashboard/state").json()
        if ("kv" in state and ready(state)) or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def read_events(response: httpx.Response, count: int) -> list[tuple[str, dict]]:
    events, kind, data = [], None, []
    for line in response.iter_lines():
        if line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif line == "" and data:
            events.append((kind, json.loads("\n".join(data))))
            kind, data = None, []
            if len(events) == count:
                return events
    raise AssertionError(f"the stream ended after {len(events)} events")


def num_gpu_blocks(server: ServerProcess) -> int:
    text_ = httpx.get(server.url + "/metrics", timeout=30).text
    line = next(line for line in text_.splitlines() if line.startswith("tokenmill:cache_config_info{"))
    return int(line.split('num_gpu_blocks="')[1].split('"')[0])


def text(browser, element_id: str) -> str:
    return browser.execute_script(f"return document.getElementById('{element_id}').textContent")


def value(browser, element_id: str) -> float | None:
    raw = browser.execute_script(f"return document.getElementById('{element_id}').dataset.value")
    return float(raw) if raw not in (None, "") else None


def row_attributes(browser, table_id: str, request_id: str, attribute: str) -> list[str]:
    return browser.execute_script(
        "return [...document.querySelectorAll(`#${arguments[0]} tbody tr`)]"
        ".filter(tr => tr.dataset.id === arguments[1]).map(tr => tr.dataset[arguments[2]])",
        table_id, request_id, attribute)


def hover_block(browser, index: int, canvas_id: str = "kv-map") -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    cell, cols = browser.execute_script(
        "const l = window.tokenmillDashboard.layouts[arguments[0]]; return [l.cell, l.cols]", canvas_id)
    canvas = browser.find_element(By.ID, canvas_id)
    x = (index % cols) * cell + cell // 2
    y = (index // cols) * cell + cell // 2
    size = canvas.size
    # move_to_element_with_offset measures from the element's centre.
    ActionChains(browser).move_to_element_with_offset(canvas, x - size["width"] // 2,
                                                      y - size["height"] // 2).perform()


def wait_until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# ----- the shipped Grafana dashboard ---------------------------------------------------------------

GRAFANA = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "tokenmill-dashboard.json"
METRIC_NAME = re.compile(r"\b(?:tokenmill:[A-Za-z0-9_:]+|process_[a-z_]+)")
# Grafana's variables, as the queries would see them once chosen.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$job": ".*", "$model_name": ".*"}


def test_grafana_dashboard_queries_parse_and_name_only_exported_metrics(server, client):
    import promql_parser

    client.completions.create(model=server.model, prompt="Hello", max_tokens=2)  # every labelled family has data
    exported = exported_sample_names(httpx.get(server.url + "/metrics", timeout=30).text)
    dashboard = json.loads(GRAFANA.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 12
    referenced = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            promql_parser.parse(expr)  # raises ValueError on a syntax error
            names = set(METRIC_NAME.findall(expr))
            assert names, (panel["title"], expr)
            referenced |= names
    for variable in dashboard["templating"]["list"]:
        referenced |= set(METRIC_NAME.findall(variable.get("definition", "")))
    missing = sorted(referenced - exported)
    assert not missing, f"the Grafana dashboard queries metrics /metrics does not export: {missing}"
    # The dashboard covers the headline metrics.
    for name in ("tokenmill:kv_cache_usage_perc", "tokenmill:time_to_first_token_seconds_bucket",
                 "tokenmill:inter_token_latency_seconds_bucket", "tokenmill:generation_tokens_total",
                 "tokenmill:num_requests_waiting", "tokenmill:prefix_cache_hits_total"):
        assert name in referenced, name


def exported_sample_names(exposition: str) -> set[str]:
    """Every sample name an exposition can carry, from its `# TYPE` lines (a labelled family
    with no child yet has no sample lines, but is declared)."""
    suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_count", "_sum", "_created"],
                "summary": ["", "_count", "_sum", "_created"], "gauge": [""], "info": ["_info"], "untyped": [""]}
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if kind == "counter":  # declared with or without its _total, by client version
                name = name.removesuffix("_total")
            names |= {name + suffix for suffix in suffixes[kind]}
    return names
