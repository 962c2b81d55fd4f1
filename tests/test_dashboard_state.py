"""The dashboard's snapshots (tokenmill/serve/dashboard/state.py) on the model-free engine:
what the block map says, when snapshots are built, and how they reach a subscriber.
The page and the server around them: tests/test_dashboard.py."""

from __future__ import annotations

import asyncio

from fakes import make_engine

from tokenmill.sampling.params import SamplingParams
from tokenmill.serve.dashboard.state import DashboardObserver, block_map


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_block_map_states_follow_reference_counts_and_cache_entries() -> None:
    engine = make_engine(num_blocks=16, block_size=4)
    kv = engine.scheduler.kv
    prompt = list(range(10, 19))  # two full blocks and one token
    engine.add_request("a", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()
    engine.add_request("b", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()  # b takes a's two full blocks from the prefix cache
    view = block_map(kv)
    states = view["states"]
    assert len(states) == 16 and states.count("S") == view["num_shared"] == 2
    for block_id in kv.get_block_ids("a")[:2]:
        assert states[block_id] == "S" and view["hashes"][block_id]
    assert view["owners"] == {rid: kv.get_block_ids(rid) for rid in ("a", "b")}
    assert view["num_used"] == 16 - kv.num_free_blocks == sum(states.count(c) for c in "USH")

    while engine.has_unfinished_requests():
        engine.step()
    view = block_map(kv)
    assert view["num_used"] == 0 and view["owners"] == {}
    assert view["states"].count("C") == view["num_cached_free"] == view["num_cached"] > 0
    assert set(view["states"]) <= {"F", "C"}
    assert set(view["hashes"]) == {i for i, c in enumerate(view["states"]) if c == "C"}


def test_snapshots_are_rate_limited_while_watched_and_built_once_idle_otherwise() -> None:
    clock = Clock()
    engine = make_engine(num_blocks=32, block_size=4, max_num_seqs=4)
    observer = DashboardObserver(lambda: engine, max_rate_hz=4.0, clock=clock)
    engine.add_observer(observer)

    def run(num_requests: int, step_s: float) -> int:
        for i in range(num_requests):
            engine.add_request(f"r{clock.now}-{i}", [5, 6, 7, 8 + i], SamplingParams(max_tokens=12, ignore_eos=True))
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            clock.now += step_s
            steps += 1
        return steps

    # Nobody watching: only the step that leaves the engine idle builds one.
    steps = run(3, step_s=0.01)
    assert steps > 5 and observer.num_builds == 1
    assert observer.latest["requests"]["num_running"] == 0
    assert observer.latest["counters"]["num_steps"] == steps

    async def watched() -> tuple[int, list[dict]]:
        queue = observer.subscribe()
        before = observer.num_builds
        steps = run(3, step_s=0.05)  # 20 steps a second against a limit of 4 snapshots a second
        await asyncio.sleep(0)  # the engine thread's hand-offs (call_soon_threadsafe) run
        received = []
        while not queue.empty():
            received.append(queue.get_nowait())
        observer.unsubscribe(queue)
        return observer.num_builds - before, received, steps

    builds, received, steps = asyncio.run(watched())
    duration = steps * 0.05
    assert 2 <= builds <= duration * 4 + 2, (builds, steps)
    # The queue holds one snapshot (a slow page only gets the newest): the final, idle one.
    assert len(received) == 1 and received[0] is observer.latest
    assert received[0]["requests"]["num_running"] == 0 and received[0]["kv"]["num_used"] == 0
    rows = received[0]["steps"]
    assert [row[0] for row in rows] == list(range(rows[0][0], rows[-1][0] + 1))  # consecutive step indices


def test_finished_and_aborted_requests_are_listed_newest_first() -> None:
    engine = make_engine(num_blocks=16)
    observer = DashboardObserver(lambda: engine)
    engine.add_observer(observer)
    engine.add_request("done", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("gone", [5, 6, 8], SamplingParams(max_tokens=50, ignore_eos=True))
    while not any(o.request_id == "done" and o.finished for o in engine.step()):
        pass  # "done" ends after two tokens; "gone" still runs
    assert engine.has_unfinished_requests()
    engine.abort_request("gone")  # the engine is idle after it: a snapshot is built
    latest = observer.latest
    assert [(row["id"], row["finish_reason"]) for row in latest["finished"]] == [("gone", "abort"),
                                                                                 ("done", "length")]
    assert latest["finished"][1]["output_tokens"] == 2
    assert latest["requests"]["num_running"] == 0 and latest["kv"]["num_used"] == 0


def test_a_hybrid_cache_shows_both_pools_and_the_managers_usage() -> None:
    from fakes import make_request

    from tokenmill.engine.block_manager import NULL_BLOCK, HybridKVBlockManager
    from tokenmill.serve.dashboard.state import kv_maps

    kv = HybridKVBlockManager(num_blocks=10, num_sliding_blocks=6, block_size=4, window=6)
    request = make_request("a", list(range(10, 27)))  # 17 tokens
    assert kv.allocate_slots(request, 17)
    request.num_computed_tokens = 17
    request.append_output_token(100)
    assert kv.allocate_slots(request, 1)  # the query at 17 reads from block 3: blocks 0-2 let go
    maps = kv_maps(kv)
    full, sliding = maps["kv"], maps["kv_sliding"]
    assert full["usage"] == kv.usage and full["num_used"] == 5 and full["owners"] == {"a": kv.get_block_ids("a")}
    assert sliding["states"][NULL_BLOCK] == "N" and sliding["num_reserved"] == 1
    held = [b for b in kv.get_sliding_block_ids("a") if b != NULL_BLOCK]
    assert sliding["owners"] == {"a": held} and sliding["num_used"] == len(held) == 2
    assert sliding["states"].count("C") == 3  # let go, but still cached for a later prefix hit
    assert all(sliding["states"][b] in "UH" for b in held)


def test_request_rows_show_state_progress_and_priority() -> None:
    engine = make_engine(num_blocks=32, block_size=4, max_num_seqs=1, scheduling_policy="priority")
    observer = DashboardObserver(lambda: engine)
    engine.add_request("first", [5, 6, 7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True), priority=1)
    engine.add_request("urgent", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True), priority=0)
    engine.step()  # one seat: the urgent request takes it
    engine.step()
    rows = observer._build(engine)["requests"]
    (running,), (waiting,) = rows["running"], rows["waiting"]
    assert (running["id"], running["state"], running["priority"]) == ("urgent", "running", 0)
    assert running["computed_tokens"] == 4 and running["output_tokens"] == 2 and running["blocks"] == 1
    assert (waiting["id"], waiting["state"], waiting["priority"], waiting["blocks"]) == ("first", "waiting", 1, 0)
