"""Worker ranks: processes that hold a part of the model and run each step the engine
sends them, and the `serve --headless` body that starts a host's ranks.

A rank's process is a fresh interpreter that runs this module's `main` with its settings
pickled on its stdin (as torchrun starts its workers), not multiprocessing's spawn, which
imports the parent's `__main__` again: a user's script that makes
`LLM(tensor_parallel_size=2)` needs no `if __name__ == "__main__":` guard.

A worker runs the same `ModelRunner` code as rank 0 on its part of the model: it
rebuilds every request's view from the step diffs (`RequestTable`), computes its share
(all-reducing with its TP group, receiving from and sending to its pipeline
neighbours) and, if it is the last stage's first TP rank, sends the sampled tokens back.
It exits 0 when rank 0 says stop, 1 when rank 0 goes away without saying so (its step
channel closes, or, for a process rank 0 spawned, the kernel kills it with its parent),
and reports its own error to rank 0 before dying of one.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from tokenmill.config import EngineConfig

logger = logging.getLogger(__name__)


def threads_per_rank(config: EngineConfig) -> int:
    """The host's compute threads (`num_threads`, else its cores) shared by its ranks."""
    from tokenmill.hardware import cpu_info

    total = config.device.num_threads or cpu_info().num_cores
    return max(1, total // config.parallel.ranks_per_node)


def worker_main(config: EngineConfig, rank: int, num_threads: int, parent_pid: int | None) -> None:
    """The body of worker process `rank` (> 0)."""
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    from tokenmill.parallel.channel import STOP, ChannelClosed, StepClient
    from tokenmill.parallel.group import DistributedContext
    from tokenmill.runner.worker import build_rank, freeze_startup_heap, rank_setup

    ctx = client = None
    try:
        ctx = DistributedContext(config, rank)
        built = build_rank(config, rank_setup(ctx, config, num_threads))
        runner = built.runner
        freeze_startup_heap(f"rank {rank}")
        client = StepClient(ctx.store, rank)
        sends_output = rank == ctx.place.output_rank
        logger.info("rank %d (pid %d) ready: %s", rank, os.getpid(), _describe(ctx))
        while True:
            message = client.recv()
            if message == STOP:
                break
            output = runner.execute(message)
            if sends_output:
                client.send(output)
    except ChannelClosed:  # not told to stop: the engine died
        logger.error("rank 0 went away without stopping rank %d: exiting", rank)
        sys.exit(1)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then the process fails
        text = f"{type(exc).__name__}: {exc}"
        logger.error("rank %d failed: %s\n%s", rank, text, traceback.format_exc())
        if client is not None:
            client.send_error(text)
        sys.exit(1)
    finally:
        if ctx is not None:
            ctx.close()


def _describe(ctx) -> str:
    layout = ctx.layout
    return (f"tp {ctx.place.tp_rank}/{ctx.place.tp_size}, pp {ctx.place.pp_rank}/{ctx.place.pp_size}, "
            f"heads q{layout.q_heads.start}+{layout.q_heads.size} kv{layout.kv_heads.start}+{layout.kv_heads.size}, "
            f"mlp {layout.intermediate.start}+{layout.intermediate.size}, layers {layout.layers.start}+"
            f"{layout.layers.size}, all-reduce {ctx.all_reduce_kind}")


def _die_with_parent(parent_pid: int) -> None:
    """Be killed with the process that spawned us, even if it dies by SIGKILL."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(1)


class RankProcess:
    """A worker rank's process (the parts of `multiprocessing.Process` the executor and
    `run_node` use: name, pid, exitcode, is_alive, join, terminate, kill)."""

    def __init__(self, config: EngineConfig, rank: int, num_threads: int, parent_pid: int | None) -> None:
        self.name = f"tokenmill-rank{rank}"
        # A fresh interpreter that imports the same tokenmill as this process (first on its path).
        root = str(Path(__file__).resolve().parents[2])
        code = f"import sys; sys.path.insert(0, {root!r}); from tokenmill.distributed.worker import main; main()"
        self._popen = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
        self.pid = self._popen.pid
        try:
            with self._popen.stdin as pipe:
                pickle.dump((config, rank, num_threads, parent_pid), pipe, protocol=pickle.HIGHEST_PROTOCOL)
        except BrokenPipeError:  # it died before reading: its exit code tells the executor
            pass

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()


def spawn_ranks(config: EngineConfig, ranks: list[int]) -> list[RankProcess]:
    threads = threads_per_rank(config)
    return [RankProcess(config, rank, threads, os.getpid()) for rank in ranks]


def run_node(config: EngineConfig) -> int:
    """`tokenmill serve --headless`: run this host's ranks (node_rank > 0) until they end;
    0 when rank 0 stopped them, 1 when one of them failed."""
    parallel = config.parallel
    if parallel.node_rank == 0:
        raise ValueError("--headless runs the ranks of a host other than the first: give --node-rank >= 1 "
                         "(node 0 runs the engine and the API)")
    per_node = parallel.ranks_per_node
    ranks = list(range(parallel.node_rank * per_node, (parallel.node_rank + 1) * per_node))
    logger.info("headless node %d of %d: ranks %s, rendezvous %s:%s", parallel.node_rank, parallel.nnodes, ranks,
                parallel.master_addr, parallel.master_port)
    processes = spawn_ranks(config, ranks)
    signalled = False  # told to stop (SIGTERM/SIGINT): a clean exit

    def terminate_all() -> None:
        for process in processes:
            if process.is_alive():
                process.terminate()

    def stop(signum: int, _frame: object) -> None:
        nonlocal signalled
        signalled = True
        terminate_all()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    failed = []
    try:
        while any(p.is_alive() for p in processes):
            if not failed and not signalled:
                failed = [p for p in processes if p.exitcode not in (None, 0)]
                if failed:
                    logger.error("%s exited with %s: stopping this node", failed[0].name, failed[0].exitcode)
                    terminate_all()
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = [p.exitcode for p in processes]
    logger.info("headless node %d: ranks ended with %s", parallel.node_rank, codes)
    if signalled:
        return 0
    return 0 if all(code == 0 for code in codes) else 1


def main() -> None:
    """A rank's process: its settings on stdin (`RankProcess`)."""
    config, rank, num_threads, parent_pid = pickle.load(sys.stdin.buffer)
    worker_main(config, rank, num_threads, parent_pid)
