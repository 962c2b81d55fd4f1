"""Rank 0's executor for a tensor/pipeline-parallel engine.

The engine's scheduler lives once, here. Each step, `execute` sends the plain step
message to every other rank (`StepServer.broadcast`), runs rank 0's part with the same
runner code, and returns the sampled tokens: its own when rank 0 is the last pipeline
stage, else the ones the last stage's first TP rank sends back.

Failures end the engine, never a step with a wrong answer: a dead rank fails the
collective or the wait for its result within milliseconds (peers on this host are
watched by pid, ranks elsewhere drop their gloo connections), a silent one after
`distributed_timeout` seconds; `execute` then raises `DistributedError` naming the rank,
its exit code and the error it reported, which the server turns into 503s and a
non-zero exit.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

from tokenmill.config import EngineConfig
from tokenmill.engine.batch import RunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")


class DistributedError(RuntimeError):
    """A rank of the split failed; the engine cannot go on."""


def with_rendezvous_port(config: EngineConfig) -> EngineConfig:
    """A free port for a one-host split without one; 29500 (torchrun's) across hosts."""
    if config.parallel.master_port is not None:
        return config
    if config.parallel.nnodes > 1:
        return config.replace(master_port=29500)
    with socket.socket() as sock:
        sock.bind((config.parallel.master_addr, 0))
        return config.replace(master_port=sock.getsockname()[1])


class ParallelExecutor:
    """Closed by `close()`, or when it is garbage-collected (an `LLM` deleted) or the
    interpreter exits: the ranks are stopped and the process group destroyed, so another
    parallel engine can be made in the same process."""

    def __init__(self, config: EngineConfig) -> None:
        from tokenmill.distributed.worker import spawn_ranks, threads_per_rank
        from tokenmill.parallel.group import check_no_group

        if config.parallel.node_rank != 0:
            raise ValueError("the engine runs on node 0; other hosts run `tokenmill serve --headless --node-rank N`")
        check_no_group()
        self.config = config = with_rendezvous_port(config)
        parallel = config.parallel
        self.workers = spawn_ranks(config, list(range(1, parallel.ranks_per_node)))
        self.ctx = self.server = None
        self._parts = _Parts(self.workers)
        self._finalizer = weakref.finalize(self, self._parts.close)  # holds the parts, not the executor
        self._step_thread: int | None = None
        try:
            self._start(config, threads_per_rank(config))
        except BaseException as exc:
            self.close()
            if isinstance(exc, (DistributedError, ValueError, FileNotFoundError)):
                raise  # bad settings or paths: the same plain error as without the split
            raise DistributedError(self._describe_failure(exc)) from exc

    def _start(self, config: EngineConfig, threads: int) -> None:
        from tokenmill.parallel.channel import StepServer
        from tokenmill.parallel.group import DistributedContext
        from tokenmill.runner.worker import build_rank, rank_setup

        parallel = config.parallel
        logger.info("starting %d ranks (tensor parallel %d x pipeline parallel %d) on %d host(s), rendezvous %s:%d, "
                    "%d thread(s) per rank", parallel.world_size, parallel.tensor_parallel_size,
                    parallel.pipeline_parallel_size, parallel.nnodes, parallel.master_addr, parallel.master_port,
                    threads)
        self.ctx = self._parts.ctx = self._watching(lambda: DistributedContext(config, 0))
        built = build_rank(config, rank_setup(self.ctx, config, threads))  # in this thread: torch's thread count
        self.runner = built.runner
        self.tokenizer = built.tokenizer
        self.facts = dataclasses.replace(built.facts, execution_plan=built.facts.execution_plan + self._describe())
        self.server = self._parts.server = StepServer(self.ctx.store, parallel.master_addr, parallel.world_size - 1)
        self._watching(self.server.accept)
        self.output_rank = self.ctx.place.output_rank
        logger.info("all %d ranks ready%s", parallel.world_size, self._describe())

    def _describe(self) -> str:
        parallel = self.config.parallel
        return (f"; tensor parallel {parallel.tensor_parallel_size} (all-reduce {self.ctx.all_reduce_kind}), "
                f"pipeline parallel {parallel.pipeline_parallel_size}")

    # ----- the step ---------------------------------------------------------------------

    def execute(self, batch: SchedulerOutput) -> RunnerOutput:
        if not self._finalizer.alive:
            raise DistributedError("the parallel executor is closed")
        if self._step_thread != threading.get_ident():  # the timer slack is per thread
            from tokenmill.parallel.shm import lower_timer_slack

            lower_timer_slack()
            self._step_thread = threading.get_ident()
        try:
            self._check_workers()
            self.server.broadcast(batch)
            output = self.runner.execute(batch)
            if self.output_rank != 0:
                output = self.server.recv_from(self.output_rank, self.config.parallel.distributed_timeout,
                                               self._check_all)
            return output
        except DistributedError:
            raise
        except Exception as exc:
            raise DistributedError(self._describe_failure(exc)) from exc

    # ----- liveness ---------------------------------------------------------------------

    def check_health(self) -> None:
        """Raise DistributedError when a rank's process on this host has exited (vLLM's
        `check_health`): the server's engine thread asks while idle, so a rank that dies
        between requests fails the engine at once, not at the next request. Call it from
        the thread that runs the steps (it reads the step channel for the rank's report)."""
        if self._finalizer.alive:  # closed on purpose: nothing to report
            self._check_workers()

    def _check_workers(self) -> None:
        dead = [p for p in self.workers if p.exitcode is not None]
        if dead:
            raise DistributedError(self._describe_failure(None))

    def _check_all(self) -> None:
        self._check_workers()
        if self.ctx is not None:
            self.ctx.check_peers()

    def _watching(self, work: Callable[[], T]) -> T:
        """Run start-up work that waits on other ranks in a thread, failing as soon as
        a local worker dies instead of when a rendezvous times out."""
        result: list = []
        error: list[BaseException] = []

        def target() -> None:
            try:
                result.append(work())
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                error.append(exc)

        thread = threading.Thread(target=target, name="tokenmill-rank0-start", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            self._check_workers()
        if error:
            raise error[0]
        return result[0]

    def _describe_failure(self, exc: BaseException | None) -> str:
        parts = []
        reported = self.server.errors() if self.server is not None else {}
        for process in self.workers:
            rank = int(process.name.removeprefix("tokenmill-rank"))
            if process.exitcode is not None:
                parts.append(f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}")
        for rank, text in sorted(reported.items()):
            parts.append(f"rank {rank} reported: {text}")
        if exc is not None:
            parts.append(f"rank 0 saw {type(exc).__name__}: {exc}")
        return "tensor/pipeline-parallel engine failed: " + "; ".join(parts or ["unknown failure"])

    # ----- shutdown ---------------------------------------------------------------------

    def close(self) -> None:
        self._finalizer()  # once: later calls do nothing


class _Parts:
    """What closing a ParallelExecutor stops: its step channel, worker processes and
    process group (apart from the executor, so a finalizer can hold them)."""

    def __init__(self, workers: list) -> None:
        self.workers = workers
        self.server = None
        self.ctx = None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()  # tells the ranks to stop
        for process in self.workers:
            process.join(5.0)
            if process.is_alive():
                process.terminate()
                process.join(2.0)
        if self.ctx is not None:
            self.ctx.close()
