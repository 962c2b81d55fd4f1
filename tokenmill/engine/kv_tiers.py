"""The host tier's bookkeeping: the scheduler side of tokenmill's KV connector. Knows no
tensors (vLLM's offloading connector has the same split: the scheduler decides, the
worker copies).

The tier is `num_blocks` slots of host memory, each holding one pool block's KV (every
layer, scales included), keyed by the block's chained hash. The block manager stores a
hashed block here when it evicts it from the pool (a demotion) and loads one back when a
prefix lookup runs past the pool's hits into this tier (a promotion); the copies travel to
the runner as `batch.KVTransfers` in the step's `SchedulerOutput`. Least recently used out
first; a slot read by this step's loads is pinned until the step's transfers are taken, so
no store of the same step can reuse it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenmill.engine.batch import KVTransfers

BlockHash = bytes


@dataclass
class TierStats:
    """Cumulative counts of one tier (vLLM's offloading metrics count the same things)."""

    hit_tokens: int = 0  # prompt tokens a prefix hit served from this tier
    stored_blocks: int = 0  # demotions: pool blocks copied in
    loaded_blocks: int = 0  # promotions: blocks copied back into the pool
    evicted_blocks: int = 0  # entries dropped to make room
    rejected_blocks: int = 0  # demotions refused (every slot pinned by this step's loads)


@dataclass
class HostTier:
    """LRU map of block hash -> host slot, and the transfers decided since the last step."""

    num_blocks: int
    bytes_per_block: int
    medium: str = "CPU"  # vLLM's name of the host medium in KV events
    entries: OrderedDict[BlockHash, int] = field(default_factory=OrderedDict)  # head: evicted first
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"the host KV tier needs room for at least one block ({self.bytes_per_block} bytes)")
        self._free_slots = list(range(self.num_blocks - 1, -1, -1))
        self._pinned: set[BlockHash] = set()
        self._store: dict[int, int] = {}  # host slot -> pool block (a reused slot keeps the last store)
        self._load: list[tuple[int, int]] = []
        self.removed: list[BlockHash] = []  # evicted since the events were last taken

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes_used(self) -> int:
        return len(self.entries) * self.bytes_per_block

    def store(self, block_hash: BlockHash, block_id: int) -> bool:
        """Demote pool block `block_id` (holding `block_hash`), evicted now. True when it
        is (or already was) in the tier."""
        if block_hash in self.entries:  # promoted earlier and unchanged since: nothing to copy
            self.entries.move_to_end(block_hash)
            return True
        slot = self._free_slots.pop() if self._free_slots else self._evict()
        if slot is None:
            self.stats.rejected_blocks += 1
            return False
        self.entries[block_hash] = slot
        self._store[slot] = block_id
        self.stats.stored_blocks += 1
        return True

    def load(self, hashes: Iterable[BlockHash], block_ids: Iterable[int]) -> None:
        """Promote: copy each hash's slot into the pool block given for it."""
        for block_hash, block_id in zip(hashes, block_ids, strict=True):
            self.entries.move_to_end(block_hash)
            self._load.append((self.entries[block_hash], block_id))
            self.stats.loaded_blocks += 1

    def pin(self, hashes: Iterable[BlockHash]) -> None:
        """Keep these entries (about to be loaded) in place until the step's transfers are taken."""
        self._pinned.update(hashes)

    def take_transfers(self) -> KVTransfers | None:
        """The copies decided since the last call (None: none); unpins everything."""
        self._pinned.clear()
        if not self._store and not self._load:
            return None
        transfers = KVTransfers(self.num_blocks, [(b, s) for s, b in self._store.items()], self._load)
        self._store, self._load = {}, []
        return transfers

    def clear(self) -> None:
        self.removed.extend(self.entries)
        self.entries.clear()
        self._free_slots = list(range(self.num_blocks - 1, -1, -1))
        self._store.clear()

    def _evict(self) -> int | None:
        for block_hash in self.entries:
            if block_hash not in self._pinned:
                slot = self.entries.pop(block_hash)
                self._store.pop(slot, None)  # stored earlier in this step and already gone
                self.removed.append(block_hash)
                self.stats.evicted_blocks += 1
                return slot
        return None

    def check_integrity(self) -> None:
        slots = list(self.entries.values())
        assert len(set(slots)) == len(slots), "two host entries share a slot"
        assert not set(slots) & set(self._free_slots), "a host slot is both used and free"
        assert len(slots) + len(self._free_slots) == self.num_blocks, "host slots lost"
