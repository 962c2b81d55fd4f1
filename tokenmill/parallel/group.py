"""One rank's membership of a tensor/pipeline-parallel split.

Ranks are numbered `pp_rank * tp_size + tp_rank` (as in vLLM); host n runs ranks
[n * per_host, (n + 1) * per_host). Rank 0 runs the engine and hosts the rendezvous, a
`torch.distributed.TCPStore` on `master_addr:master_port`: every rank joins the gloo
process group through it, and the ranks exchange what else they need there (the run's id,
the shared-memory segment of a TP group, pids, the step channel's address).

Each pipeline stage's TP ranks form a group whose all-reduce is, per `all_reduce`:
shared memory when all its ranks are on one host (CPU), NCCL on CUDA, gloo otherwise.
Neighbouring stages exchange hidden states with gloo point-to-point messages.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig, ParallelConfig
from tokenmill.parallel.layout import ShardLayout, build_layout
from tokenmill.parallel.model_parallel import ModelParallel
from tokenmill.parallel.shm import PeerFailure, ShmCommunicator, lower_timer_slack

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankPlace:
    """Where a rank sits in the split."""

    rank: int
    tp_size: int
    pp_size: int
    per_node: int

    @classmethod
    def of(cls, parallel: ParallelConfig, rank: int) -> RankPlace:
        return cls(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.ranks_per_node)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def node(self) -> int:
        return self.rank // self.per_node

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def stage_ranks(self, pp_rank: int) -> list[int]:
        return [pp_rank * self.tp_size + t for t in range(self.tp_size)]

    @property
    def output_rank(self) -> int:
        """The rank whose runner output the engine reads: TP rank 0 of the last stage."""
        return (self.pp_size - 1) * self.tp_size


def max_kv_units(arch, parallel: ParallelConfig, column_unit: int = 1) -> int:
    """Max over ranks of KV heads x layers held: the ranks' caches all have as many blocks."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    layouts = [build_layout(arch, tp, t, pp, p, column_unit) for p in range(pp) for t in range(tp)]
    return max(layout.kv_heads.size * layout.layers.size for layout in layouts)


class GlooCommunicator:
    """A TP group's collectives through torch.distributed (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, group: dist.ProcessGroup, world: int) -> None:
        self.group = group
        self.world = world
        self.calls = 0  # collectives run and the time spent in them
        self.busy_s = 0.0

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.calls += 1
        self.busy_s += time.perf_counter() - started
        return x

    def all_gather(self, x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        started = time.perf_counter()
        width = max(sizes)
        padded = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device)
        padded[:, : x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)
        self.calls += 1
        self.busy_s += time.perf_counter() - started
        return torch.cat([p[:, :s] for p, s in zip(parts, sizes)], dim=1)


class StageLink:
    """Hidden states to or from the same TP rank of a neighbouring stage (gloo
    point-to-point). Sends do not wait for the receiver, so a stage goes on to its next
    micro-batch; `flush` waits for them at the end of the step."""

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, tensors: tuple[torch.Tensor, ...]) -> None:
        packed = torch.stack(tensors)  # one message, and a copy later steps cannot touch
        self._pending.append((dist.isend(packed, self.peer), packed))

    def recv(self, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        packed = torch.empty(len(shapes), *shapes[0], dtype=dtype)
        dist.recv(packed, self.peer)
        return tuple(packed.unbind(0))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()


class DistributedContext:
    """Join the split as `rank`: rendezvous, process group, TP communicator, stage links."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        parallel = config.parallel
        self.config = config
        self.place = place = RankPlace.of(parallel, rank)
        self.timeout = parallel.distributed_timeout
        lower_timer_slack()
        self.store = dist.TCPStore(parallel.master_addr, parallel.master_port, place.world_size, rank == 0,
                                   timeout=timedelta(seconds=max(self.timeout, 300.0)), wait_for_workers=False)
        if rank == 0:
            self.store.set("run_id", uuid.uuid4().hex[:12])
        self.run_id = self.store.get("run_id").decode()
        self.store.set(f"pid/{rank}", str(os.getpid()))
        device = config.device.device
        backend = "cuda:nccl,cpu:gloo" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore("pg", self.store), rank=rank,
                                world_size=place.world_size, timeout=timedelta(seconds=self.timeout))
        stage_groups = [dist.new_group(place.stage_ranks(p)) for p in range(place.pp_size)]
        self._peer_pids = {r: int(self.store.get(f"pid/{r}")) for r in range(place.world_size)
                           if r != rank and place.node_of(r) == place.node}
        self.all_reduce_kind = self._choose_all_reduce(parallel.all_reduce, device)
        self.tp = self._tp_communicator(stage_groups[place.pp_rank])
        self.prev_stage = StageLink(rank - place.tp_size) if place.pp_rank > 0 else None
        self.next_stage = StageLink(rank + place.tp_size) if place.pp_rank < place.pp_size - 1 else None
        self.layout: ShardLayout | None = None

    # ----- what the builder needs ---------------------------------------------------------

    def model_parallel(self, arch, column_unit: int) -> ModelParallel:
        place = self.place
        self.layout = build_layout(arch, place.tp_size, place.tp_rank, place.pp_size, place.pp_rank, column_unit,
                                   self.config.parallel.enable_expert_parallel)
        self._max_kv_units = max_kv_units(arch, self.config.parallel, column_unit)
        return ModelParallel(self.layout, self.tp, self.prev_stage, self.next_stage)

    def max_kv_bytes_per_token(self, element_size: int) -> int:
        assert self.layout is not None, "model_parallel() first"
        return 2 * self._max_kv_units * self.layout.head_dim * element_size

    def flush(self) -> None:
        if self.next_stage is not None:
            self.next_stage.flush()

    # ----- liveness ---------------------------------------------------------------------

    def check_peers(self) -> None:
        """Raise PeerFailure when a rank on this host has died (collectives call this
        while they wait; ranks on other hosts fail gloo's connections instead)."""
        for rank, pid in self._peer_pids.items():
            if not pid_alive(pid):
                raise PeerFailure(f"rank {rank} (pid {pid}) has died")

    # ----- internals ------------------------------------------------------------------

    def _choose_all_reduce(self, wanted: str, device: str) -> str:
        place = self.place
        one_host = len({place.node_of(r) for r in place.stage_ranks(place.pp_rank)}) == 1
        if wanted == "auto":
            return "nccl" if device.startswith("cuda") else "shm" if one_host else "gloo"
        if wanted == "shm" and not one_host:
            raise ValueError("all_reduce 'shm' needs every rank of a tensor-parallel group on one host")
        if wanted == "nccl" and not device.startswith("cuda"):
            raise ValueError("all_reduce 'nccl' needs a CUDA device")
        return wanted

    def _tp_communicator(self, group: dist.ProcessGroup):
        place = self.place
        if place.tp_size == 1:
            return None
        if self.all_reduce_kind != "shm":
            return GlooCommunicator(group, place.tp_size)
        ranks = place.stage_ranks(place.pp_rank)
        path = f"/dev/shm/tokenmill-{self.run_id}-stage{place.pp_rank}"
        leader = place.tp_rank == 0
        if not leader:
            self.store.wait([f"shm/{place.pp_rank}/created"])
        comm = ShmCommunicator(path, place.tp_rank, place.tp_size, create=leader, timeout=self.timeout,
                               check_peers=self.check_peers)
        if leader:
            self.store.set(f"shm/{place.pp_rank}/created", "1")
        self.store.set(f"shm/{place.pp_rank}/attached/{place.tp_rank}", "1")
        self.store.wait([f"shm/{place.pp_rank}/attached/{t}" for t in range(len(ranks))])
        if leader:
            os.unlink(path)  # mapped by every rank now; nothing is left behind after a crash
        return comm

    def close(self) -> None:
        if self.tp is not None and hasattr(self.tp, "close"):
            self.tp.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def check_no_group() -> None:
    """Raise when this process still belongs to a split (a parallel engine is alive):
    torch.distributed allows one default process group per process. A deleted engine
    that only the garbage collector can reach is collected first (its finalizer leaves
    the group)."""
    if dist.is_initialized():
        gc.collect()
    if dist.is_initialized():
        raise RuntimeError("another tensor/pipeline-parallel engine is running in this process (torch.distributed "
                           "has one process group per process): close it (llm.engine.executor.close()) or delete "
                           "it first")


def pid_alive(pid: int) -> bool:
    """A process on this host is alive (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")
