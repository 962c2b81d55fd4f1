"""The KV block copies of disaggregation, alone (docs/disaggregation.md, "word copies"): 128
blocks of the default model's bfloat16 layout (30 layers, 3 KV heads, head_dim 64, 16-token
blocks: 47.2 MB) read by a producer for TCP (`read_blocks`), copied into a pool from those
bytes (`copy_in_blocks`), and copied from a producer's shared-memory pool (`copy_from_peer`,
first through a fresh mapping, then again); and the host KV tier's store and load of 50 blocks
(`HostKVBuffer.apply`, docs/kv-tiers.md). Run it pinned: `taskset -c 1 python
benchmarks/kv_block_copies.py`. Not in CI."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenmill.attention.kv_cache import KVCacheSpec, PagedKVCache  # noqa: E402
from tokenmill.engine.batch import KVTransfers  # noqa: E402
from tokenmill.hardware import cpu_info  # noqa: E402
from tokenmill.kv_transfer.shared_memory import SharedRegion, open_peer_region  # noqa: E402
from tokenmill.runner.kv_offload import HostKVBuffer, block_tensors, copy_in_blocks, read_blocks  # noqa: E402
from tokenmill.runner.shared_kv_pool import copy_from_peer, pool_layout, shared_allocator  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    print(cpu_info())
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
    n = 1024
    region = SharedRegion(spec.bytes_per_block * n + 2 * spec.num_layers * 4096)
    source = PagedKVCache(spec, n, torch.device("cpu"), empty=shared_allocator(region))
    target = PagedKVCache(spec, n, torch.device("cpu"), huge_pages=True)
    description = region.describe(pool_layout(region, source))
    pool = block_tensors(target)
    for trial in range(6):
        remote = list(range(128 * (trial % 4), 128 * (trial % 4) + 128))
        local = list(range(500, 628))
        peer, _ = open_peer_region(description)  # a fresh mapping: its first touches fault
        started = time.perf_counter()
        copy_from_peer(pool, peer, remote, local)
        fresh = time.perf_counter() - started
        started = time.perf_counter()
        copy_from_peer(pool, peer, remote, local)
        warm = time.perf_counter() - started
        started = time.perf_counter()
        payloads = read_blocks(block_tensors(source), remote)
        read = time.perf_counter() - started
        started = time.perf_counter()
        copy_in_blocks(pool, payloads, local)
        copy_in = time.perf_counter() - started
        print(f"shared memory: {1e3 * fresh:.1f} ms (fresh mapping), {1e3 * warm:.1f} ms (again) | "
              f"TCP path: producer read {1e3 * read:.1f} ms, copy-in {1e3 * copy_in:.1f} ms")
    host = HostKVBuffer(target)
    stores, loads = [], []
    for trial in range(30):
        started = time.perf_counter()
        host.apply(KVTransfers(1024, store=[(b, 100 + b + trial) for b in range(50)]))
        stores.append(time.perf_counter() - started)
        started = time.perf_counter()
        host.apply(KVTransfers(1024, load=[(100 + b + trial, 200 - b) for b in range(50)]))
        loads.append(time.perf_counter() - started)
    print(f"host tier, 50 blocks (18.4 MB), medians of 29 after the first: store "
          f"{1e3 * statistics.median(stores[1:]):.1f} ms, load {1e3 * statistics.median(loads[1:]):.1f} ms")


if __name__ == "__main__":
    main()
