"""Several instances on one virtual time: aggregated replicas, or prefill-decode disaggregation.

`Layout` says how many instances serve a trace: N aggregated replicas (each prefills and
decodes; requests go round-robin, vllm-router's `round_robin`), or xPyD: x prefill and y
decode instances, driven as vllm-router's `--vllm-pd-disaggregation` drives real ones
(docs/disaggregation.md): a request goes to a prefill instance with `max_tokens` 1 and
`{"do_remote_decode": true}`, its answer's `kv_transfer_params` go with the original request
to a decode instance, and the client's tokens are the decode instance's.

Every instance is the engine's own `LLMEngine` (scheduler, block manager, the scheduler's
disaggregation side: holds on the producer, pulls into allocated blocks on the consumer, the
last prompt token computed there) on a `SimulatedExecutor` and its own `VirtualClock`. The
transport is `SimulatedKVConnector`: a pull of n blocks takes `KVTransferCost.pull_seconds`
of their bytes (block_size x KV bytes per token each), one pull at a time per decode
instance, while the decode instance's steps go on; the producer frees the blocks when the
pull is done. Torch-free.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.kv_transfer import KVTransferStats, PullResult, RemotePrefill
from tokenmill.planner.costmodel import KVTransferCost
from tokenmill.simulator.executor import VirtualClock

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}  # what vllm-router sends


@dataclass(frozen=True)
class Layout:
    """`replicas` aggregated instances, or `prefill` + `decode` disaggregated ones."""

    replicas: int = 1
    prefill: int = 0
    decode: int = 0

    def __post_init__(self) -> None:
        if self.disaggregated:
            if self.prefill < 1 or self.decode < 1:
                raise ValueError(f"a disaggregated layout needs at least one prefill and one decode instance, got "
                                 f"{self.prefill}P{self.decode}D")
        elif self.replicas < 1:
            raise ValueError(f"an aggregated layout needs at least one replica, got {self.replicas}")

    @classmethod
    def parse(cls, text: str) -> Layout:
        """"1P1D", "2P1D", ... (prefill and decode instances, case-insensitive)."""
        match = re.fullmatch(r"\s*(\d+)\s*[pP]\s*(\d+)\s*[dD]\s*", text or "")
        if not match:
            raise ValueError(f"--pd {text!r} is not xPyD (prefill and decode instances), e.g. 1P1D or 2P1D")
        return cls(replicas=0, prefill=int(match[1]), decode=int(match[2]))

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0 or self.decode > 0

    @property
    def num_instances(self) -> int:
        return self.prefill + self.decode if self.disaggregated else self.replicas

    @property
    def name(self) -> str:
        if self.disaggregated:
            return f"{self.prefill}P{self.decode}D"
        return "1 instance" if self.replicas == 1 else f"{self.replicas} replicas"

    def roles(self) -> list[str]:
        """Each instance's role: "prefill", "decode" or "both" (aggregated)."""
        if self.disaggregated:
            return ["prefill"] * self.prefill + ["decode"] * self.decode
        return ["both"] * self.replicas

    def aggregated_peer(self) -> Layout:
        """The aggregated layout with as many instances (the same hardware)."""
        return Layout(replicas=self.num_instances)


@dataclass
class Pull:
    """One simulated pull: what a decode instance fetched, when, and how long it took."""

    request_id: str
    blocks: int
    nbytes: int
    started: float
    done: float


@dataclass
class SimulatedKVConnector:
    """The `KVConnector` a simulated instance's scheduler drives (engine/kv_transfer.py's
    protocol), on virtual time. Producers find each other by engine id in `registry`."""

    engine_id: str
    role: str  # "prefill" or "decode"
    clock: VirtualClock
    cost: KVTransferCost
    block_bytes: int  # bytes of one KV block (block_size x KV bytes per token)
    registry: dict[str, SimulatedKVConnector]
    held: dict[str, int] = field(default_factory=dict)  # producer: key -> blocks
    releases: list[tuple[float, str]] = field(default_factory=list)  # producer: (when, key), a heap
    arriving: list[tuple[float, int, str, int]] = field(default_factory=list)  # consumer: (done, seq, id, blocks)
    pulls: list[Pull] = field(default_factory=list)
    link_free: float = 0.0  # consumer: when its puller thread is free
    counters: KVTransferStats = field(default_factory=KVTransferStats)

    def __post_init__(self) -> None:
        self.registry[self.engine_id] = self

    writes_in_place = False  # the scheduler hands the (empty) payloads to the executor, which prices the copy

    @property
    def is_producer(self) -> bool:
        return self.role == "prefill"

    @property
    def is_consumer(self) -> bool:
        return self.role == "decode"

    # producer
    def hold(self, key: str, block_ids: list[int]) -> dict[str, Any]:
        self.held[key] = len(block_ids)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_block_ids": list(block_ids), "remote_host": "simulated", "remote_port": 1,
                "remote_request_id": key, "tp_size": 1}

    def release_at(self, key: str, moment: float) -> None:
        heapq.heappush(self.releases, (moment, key))

    def released(self) -> list[str]:
        out = []
        while self.releases and self.releases[0][0] <= self.clock.now:
            _, key = heapq.heappop(self.releases)
            self.counters.sent_blocks += self.held.pop(key, 0)
            out.append(key)
        return out

    # consumer
    def start_pull(self, request_id: str, remote: RemotePrefill, remote_block_ids: list[int],
                   local_block_ids: list[int]) -> None:
        nbytes = len(remote_block_ids) * self.block_bytes
        started = max(self.clock.now, self.link_free)
        done = started + self.cost.pull_seconds(nbytes)
        self.link_free = done
        self.pulls.append(Pull(request_id, len(remote_block_ids), nbytes, self.clock.now, done))
        heapq.heappush(self.arriving, (done, len(self.pulls), request_id, len(remote_block_ids)))
        self.registry[remote.engine_id].release_at(remote.request_id, done)

    def take_pulled(self) -> list[PullResult]:
        out = []
        while self.arriving and self.arriving[0][0] <= self.clock.now:
            _, _, request_id, blocks = heapq.heappop(self.arriving)
            self.counters.pulled_blocks += blocks
            out.append(PullResult(request_id, [b""] * blocks))  # the scheduler counts them; no bytes move
        return out

    def wait(self, timeout: float) -> None:
        """Nothing to wait for on virtual time: the run loop jumps to `next_event`."""

    def next_event(self) -> float | None:
        """When the next pull lands (consumer) or hold is freed (producer)."""
        times = [t for t, *_ in self.arriving[:1]] + [t for t, _ in self.releases[:1]]
        return min(times) if times else None

    def stats(self) -> KVTransferStats:
        return KVTransferStats(held_blocks=sum(self.held.values()), held_requests=len(self.held),
                               sent_blocks=self.counters.sent_blocks, pulled_blocks=self.counters.pulled_blocks,
                               pulling_requests=len(self.arriving))
