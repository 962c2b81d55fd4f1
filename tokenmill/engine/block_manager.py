"""Paged KV-cache bookkeeping with automatic prefix caching. Knows no tensors.

The KV memory is `num_blocks` blocks of `block_size` token slots. Each request
holds a block table (a list of block ids). A *full* block gets a content hash
chained to its parent block's hash, so equal hashes mean equal whole prefixes,
and a later request with the same prefix reuses those blocks instead of
recomputing them. Blocks are reference-counted; a block whose count drops to 0
joins the free queue but keeps its hash (and KV) until it is evicted, least
recently used first, when a new block is needed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.engine.batch import KVTransfers
from tokenmill.engine.kv_events import MEDIUM_DISK, MEDIUM_HOST, MEDIUM_POOL, BlockMeta, KVEventLog
from tokenmill.engine.kv_tiers import HostTier
from tokenmill.engine.request import Request

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: str | None = None) -> BlockHash:
    """SHA-256 over the parent's hash, the block's token ids and an extra key.

    The extra key carries anything besides token ids that changes the KV (a
    cache salt today; a LoRA id or multimodal hashes later). It only needs to go
    into the first block: the chain carries it to every later one. A cryptographic
    hash makes a collision (which would silently serve wrong KV) implausible.
    """
    digest = hashlib.sha256(parent or b"\0")
    digest.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        digest.update(extra_key.encode())
    return digest.digest()


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


@dataclass(frozen=True)
class KVSnapshot:
    """The block manager's state at one moment, for dashboards and the simulator."""

    num_blocks: int
    block_size: int
    num_free: int  # free blocks, cached or not
    num_cached_free: int  # of those, holding a prefix-cache entry
    num_cached: int  # blocks with a prefix-cache entry (held or free)
    blocks_per_request: dict[str, int]
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of those, tokens served from the cache (the pool or a lower tier)
    # vLLM's external prefix cache (a KV connector's; here the host tier): the prompt
    # tokens looked up past the pool's hit, and those of them it served.
    external_queries: int = 0
    external_hits: int = 0


class PrefixHit(list):
    """A prefix hit: the pool's blocks (the list), then `host`, the hashes of the blocks
    that follow them in the host tier (loaded into new pool blocks when allocated)."""

    def __init__(self, pool_blocks: list[int] = (), host: list[BlockHash] = (),
                 disk: list[tuple[BlockHash, bytes]] = ()) -> None:
        super().__init__(pool_blocks)
        self.host = list(host)
        self.disk = list(disk)  # then (hash, verified KV bytes) read from the disk tier

    @property
    def num_blocks(self) -> int:
        return len(self) + len(self.host) + len(self.disk)


NULL_BLOCK = 0  # in a sliding-window pool: a table entry whose block was let go (never read)


class KVBlockManager:
    # A sliding-window pool keeps block 0 as NULL_BLOCK, never handed out, in the place of
    # blocks no query can see any more (position-aligned tables, as vLLM's null block).
    reserves_null = False

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 host_tier: HostTier | None = None, cache_generated: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # False: only blocks of prompt tokens join the prefix cache (EngineFacts.cache_generated_kv).
        self.cache_generated = cache_generated
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the head is evicted first.
        first = 1 if self.reserves_null else 0
        if num_blocks <= first:
            raise ValueError(f"a sliding-window KV pool needs at least two blocks, got {num_blocks}")
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(first, num_blocks))
        self.cached_blocks: dict[BlockHash, int] = {}
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_num_hashed_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        # A lower tier evicted cached blocks go to instead of being dropped (None: dropped).
        self.host_tier = host_tier if enable_caching else None
        if self.host_tier is not None:
            self.host_tier.meta_of = self._event_meta  # disk files carry what events say of a block
        self.events: KVEventLog | None = None  # vLLM's KV events, when someone publishes them

    # ----- queries -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - int(self.reserves_null)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def snapshot(self) -> KVSnapshot:
        cached_free = sum(1 for b in self.free_queue if self.blocks[b].block_hash is not None)
        return KVSnapshot(
            num_blocks=self.num_blocks, block_size=self.block_size, num_free=self.num_free_blocks,
            num_cached_free=cached_free, num_cached=len(self.cached_blocks),
            blocks_per_request={rid: len(blocks) for rid, blocks in self.req_blocks.items()},
            prefix_cache_queries=self.stats.queries, prefix_cache_hits=self.stats.hits,
        )

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[PrefixHit, int]:
        """The longest run of cached full blocks that prefixes the request's tokens (in
        the pool, then continued in the host tier), and the number of tokens they cover.
        Never covers the last token: that one must be computed so that its logits can be
        sampled."""
        if not self.enable_caching or not request.reads_prefix_cache:
            return PrefixHit(), 0  # (prompt logprobs need every prompt position computed)
        hashes = self._block_hashes(request)[: self._max_hit_blocks(request)]
        hits = PrefixHit()
        for block_hash in hashes:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        if self.host_tier is not None:
            for block_hash in hashes[len(hits):]:
                if block_hash not in self.host_tier:
                    break
                hits.host.append(block_hash)
            disk = self.host_tier.disk
            if disk is not None and len(hits.host) + len(hits) < len(hashes):
                for block_hash in hashes[len(hits) + len(hits.host):]:
                    payload = disk.read(block_hash)
                    if payload is None:
                        break
                    hits.disk.append((block_hash, payload))
        return hits, hits.num_blocks * self.block_size

    def disk_blocks_to_read(self, request: Request) -> list[BlockHash]:
        """The disk-tier blocks `get_computed_blocks` would read for the request now (past
        its pool and host-tier hits; files only checked for presence, not read), less those
        already read ahead: what the scheduler has read in the background before admitting it."""
        disk = self.host_tier.disk if self.host_tier is not None else None
        if disk is None or not disk.enabled or not self.enable_caching or not request.reads_prefix_cache:
            return []
        hashes = self._block_hashes(request)[: self._max_hit_blocks(request)]
        i = 0
        while i < len(hashes) and (hashes[i] in self.cached_blocks or hashes[i] in self.host_tier):
            i += 1
        to_read = []
        for block_hash in hashes[i:]:
            if block_hash not in disk or disk.is_pending(block_hash):  # (its file not written yet)
                break
            if not disk.read_ahead(block_hash):
                to_read.append(block_hash)
        return to_read

    def peek_cached_tokens(self, request: Request) -> int:
        """The tokens `get_computed_blocks` would find cached now, keeping nothing for the
        request (it may never be added: a scheduling prediction asks)."""
        if not self.enable_caching or not request.reads_prefix_cache:
            return 0
        max_blocks = self._max_hit_blocks(request)
        hashes = self.req_hashes.get(request.request_id)
        tokens, size = request.all_token_ids, self.block_size
        parent = None
        for i in range(max_blocks):
            if hashes is not None and i < len(hashes):
                block_hash = hashes[i]
            else:
                block_hash = hash_block(parent, tokens[i * size : (i + 1) * size],
                                        request.cache_salt if i == 0 else None)
            if block_hash not in self.cached_blocks:
                return i * size
            parent = block_hash
        return max_blocks * size

    # ----- allocation ----------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None,
        written_now: bool = True,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `computed_blocks` (at admission) are prefix-cache hits to take over first.
        Returns False, changing nothing, when there are not enough free blocks.
        `written_now=False`: the new tokens' KV arrives later (a disaggregated consumer's
        pull), so their blocks are hashed (offered to other requests) only by `mark_computed`.
        """
        computed_blocks = [] if computed_blocks is None else computed_blocks
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            return False
        held = self.req_blocks.get(request.request_id, [])
        host_hits = getattr(computed_blocks, "host", [])
        disk_hits = getattr(computed_blocks, "disk", [])
        num_hit_blocks = len(computed_blocks) + len(host_hits) + len(disk_hits)
        num_tokens_after = request.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens_after) - len(held) - len(computed_blocks)

        for block_id in computed_blocks:
            self._take(block_id)
        if host_hits:  # no demotion while the new blocks are taken may reuse their slots
            self.host_tier.pin(host_hits)
        new_blocks = [self._pop_free_block() for _ in range(max(num_new_blocks, 0))]
        if host_hits:  # promotions: the first new blocks get the host tier's KV before the forward
            self.host_tier.load(host_hits, new_blocks[: len(host_hits)])
            self.host_tier.stats.hit_tokens += len(host_hits) * self.block_size
        if disk_hits:  # then the disk tier's, from the bytes read (and verified) at the lookup
            disk = self.host_tier.disk
            disk.load([p for _, p in disk_hits], new_blocks[len(host_hits): len(host_hits) + len(disk_hits)])
            disk.stats.hit_tokens += len(disk_hits) * self.block_size
        self.req_blocks[request.request_id] = held + list(computed_blocks) + new_blocks
        if request.request_id not in self.req_num_hashed_blocks:  # admission
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_blocks * self.block_size
            if self.host_tier is not None and self.enable_caching:
                self.stats.external_queries += request.num_tokens - len(computed_blocks) * self.block_size
                self.stats.external_hits += (len(host_hits) + len(disk_hits)) * self.block_size
            self.req_num_hashed_blocks[request.request_id] = 0
        # The KV of these tokens is written in this step, before any later step can
        # read it, so their full blocks can be offered to other requests right away.
        if written_now:
            self._hash_full_blocks(request, min(num_tokens_after, request.num_tokens))
        return True

    def mark_computed(self, request: Request, num_tokens: int) -> None:
        """The KV of the request's first `num_tokens` tokens is in its blocks (pulled from a
        producer, copied in before the next forward): its full blocks join the prefix cache."""
        self._hash_full_blocks(request, num_tokens)

    def uncount_admission(self, request: Request, num_hit_tokens: int) -> None:
        """Take back what admitting `request` (with `num_hit_tokens` served by the pool)
        added to the prefix-cache counters: a cut step's admission is undone, and the
        request is counted when it is admitted again."""
        self.stats.queries -= request.num_tokens
        self.stats.hits -= num_hit_tokens

    def unhash_from(self, request: Request, num_tokens: int) -> None:
        """The step that was to write the request's KV from token `num_tokens` on was cut
        short (engine/interrupt.py): the blocks `allocate_slots` offered to other requests
        for it leave the prefix cache again (their KV is not all there). Earlier blocks
        were computed by earlier steps and stay."""
        rid = request.request_id
        keep = num_tokens // self.block_size
        hashed = self.req_num_hashed_blocks.get(rid, 0)
        removed = []
        for block_id in self.req_blocks.get(rid, [])[keep:hashed]:
            if self._is_null(block_id):
                continue
            block = self.blocks[block_id]
            if block.block_hash is not None and self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
                removed.append(block.block_hash)
            block.block_hash = None
        if rid in self.req_num_hashed_blocks:
            self.req_num_hashed_blocks[rid] = min(hashed, keep)
        if self.events is not None and removed:
            self.events.removed(removed, MEDIUM_POOL)
            for block_hash in removed:
                if not self._held_anywhere(block_hash):
                    self.events.forget(block_hash)

    def can_allocate(self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Whether allocate_slots would succeed (it changes nothing)."""
        computed_blocks = [] if computed_blocks is None else computed_blocks
        held = self.req_blocks.get(request.request_id, [])
        num_hit_blocks = getattr(computed_blocks, "num_blocks", len(computed_blocks))
        num_computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        num_new_blocks = self.blocks_needed(num_computed + num_new_tokens) - len(held) - len(computed_blocks)
        # Hits sitting in the free queue are taken out of it, so they are not free for new blocks.
        num_revived = sum(1 for b in computed_blocks if not self._is_null(b) and self.blocks[b].ref_count == 0)
        return num_new_blocks <= self.num_free_blocks - num_revived

    def free(self, request: Request) -> None:
        """Release a request's blocks (finished, aborted or preempted).

        Hashed blocks go to the tail of the free queue in reverse order, so a
        sequence's end is evicted before its (more shareable) beginning; blocks
        without a hash hold nothing reusable and go to the head.
        """
        self.free_id(request.request_id)

    def hold(self, request: Request, key: str) -> list[int]:
        """Keep a finished request's blocks under `key` (a disaggregated producer serves them
        to a consumer) instead of freeing them; `free_id(key)` frees them. Returns them."""
        rid = request.request_id
        self.req_hashes.pop(rid, None)
        self.req_num_hashed_blocks.pop(rid, None)
        blocks = self.req_blocks.pop(rid, [])
        self.req_blocks[key] = blocks
        return list(blocks)

    def free_id(self, rid: str) -> None:
        """`free` by the id the blocks are held under (a request's, or a hold's key)."""
        self.req_hashes.pop(rid, None)
        self.req_num_hashed_blocks.pop(rid, None)
        for block_id in reversed(self.req_blocks.pop(rid, [])):
            if self._is_null(block_id):
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no request holds blocks."""
        if self.req_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
            self.host_tier.removed.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def take_events(self) -> list:
        """The KV events since the last call (none unless `events` was set)."""
        self._disk_tier_events()
        return self.events.take() if self.events is not None else []

    def take_transfers(self) -> KVTransfers | None:
        """The host-tier copies decided since the last call, for the step's runner."""
        if self.host_tier is None:
            return None
        self._disk_tier_events()
        return self.host_tier.take_transfers()

    # ----- internals -----------------------------------------------------------------

    def _is_null(self, block_id: int) -> bool:
        return self.reserves_null and block_id == NULL_BLOCK

    def _take(self, block_id: int) -> None:
        if self._is_null(block_id):
            return
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]  # a hit on a free cached block revives it
        block.ref_count += 1

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached content (to the host tier, if any)
            if self.cached_blocks.get(block.block_hash) == block_id:
                del self.cached_blocks[block.block_hash]
                self._demote(block.block_hash, block_id)
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _demote(self, block_hash: BlockHash, block_id: int) -> None:
        """An evicted cached block: to the host tier if there is one, and its events."""
        host, events = self.host_tier, self.events
        was_in_host = host is not None and block_hash in host
        kept = host is not None and host.store(block_hash, block_id)
        if host is not None and host.removed:  # the tier's LRU made room
            dropped, host.removed = host.removed, []
            if events is not None:
                events.removed(dropped, MEDIUM_HOST)
                for h in dropped:
                    if not self._held_anywhere(h):
                        events.forget(h)
        if events is None:
            return
        events.removed([block_hash], MEDIUM_POOL)
        if kept and not was_in_host and block_hash in events.meta:
            events.stored([block_hash], [events.meta[block_hash]], MEDIUM_HOST)
        elif not kept and not self._held_anywhere(block_hash):  # (a refused demotion may go to disk)
            events.forget(block_hash)

    def _event_meta(self, block_hash: BlockHash) -> BlockMeta | None:
        return self.events.meta.get(block_hash) if self.events is not None else None

    def _disk_tier_events(self) -> None:
        """The disk tier's files written and dropped since the last call, as events on the
        DISK medium (its own lists emptied either way, so they never grow without events).
        The first call also announces the files an earlier run left, from their records."""
        disk = self.host_tier.disk if self.host_tier is not None else None
        if disk is None or not (disk.added or disk.removed or disk.found):
            return
        added, removed, disk.added, disk.removed = disk.added, disk.removed, [], []
        found, disk.found = disk.found, {}
        events = self.events
        if events is None:
            return
        if found:
            events.stored(list(found), list(found.values()), MEDIUM_DISK)
        known = [h for h in added if h in events.meta]  # a block whose tokens an event told
        events.stored(known, [events.meta[h] for h in known], MEDIUM_DISK)
        events.removed([h for h in removed if h in events.meta], MEDIUM_DISK)
        for h in removed:
            if not self._held_anywhere(h):
                events.forget(h)

    def _held_anywhere(self, block_hash: BlockHash) -> bool:
        """Whether the pool or a lower tier still holds the block (its event meta is kept)."""
        host = self.host_tier
        return (block_hash in self.cached_blocks
                or (host is not None and (block_hash in host or (host.disk is not None and block_hash in host.disk))))

    def _max_hit_blocks(self, request: Request) -> int:
        """Full blocks a hit may cover: never the last token (its logits are sampled), and
        without `cache_generated` none past the prompt (a request resumed after a preemption
        recomputes its generated tokens as it decoded them, not from another's prompt blocks)."""
        last = (request.num_tokens - 1) // self.block_size
        return last if self.cache_generated else min(last, request.num_prompt_tokens // self.block_size)

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended as tokens arrive."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        tokens, size = request.all_token_ids, self.block_size
        for i in range(len(hashes), len(tokens) // size):
            parent = hashes[-1] if hashes else None
            extra = request.cache_salt if i == 0 else None
            hashes.append(hash_block(parent, tokens[i * size : (i + 1) * size], extra))
        return hashes

    def _hash_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        if not self.cache_generated:  # a block with a generated token stays out of the prefix cache
            num_tokens = min(num_tokens, request.num_prompt_tokens)
        rid = request.request_id
        start, end = self.req_num_hashed_blocks[rid], num_tokens // self.block_size
        if end <= start:
            return
        hashes = self._block_hashes(request)
        stored: list[int] = []
        for i in range(start, end):
            if self._is_null(self.req_blocks[rid][i]):
                continue  # a prefix-hit entry before the window: no block of its own
            block = self.blocks[self.req_blocks[rid][i]]
            if block.block_hash is None and hashes[i] not in self.cached_blocks:
                block.block_hash = hashes[i]
                self.cached_blocks[hashes[i]] = block.block_id
                stored.append(i)
            # else: already cached (a hit), or the same content computed twice at
            # once; the duplicate stays unhashed and is freed like any other block.
        self.req_num_hashed_blocks[rid] = end
        if self.events is not None and stored:
            size, tokens = self.block_size, request.all_token_ids
            metas = [BlockMeta(hashes[i - 1] if i else None, tokens[i * size : (i + 1) * size],
                               request.cache_salt if i == 0 else None) for i in stored]
            self.events.stored([hashes[i] for i in stored], metas, MEDIUM_POOL)

    # ----- checks --------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent. Tests call this
        after every operation."""
        refs = [0] * self.num_blocks
        for rid, block_ids in self.req_blocks.items():
            if self.reserves_null:
                block_ids = [b for b in block_ids if b != NULL_BLOCK]
            assert len(set(block_ids)) == len(block_ids), f"{rid} holds a block twice: {block_ids}"
            for block_id in block_ids:
                refs[block_id] += 1
        for block in self.blocks[int(self.reserves_null):]:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, referenced {refs[block.block_id]} times"
            )
            in_free = block.block_id in self.free_queue
            assert in_free == (block.ref_count == 0), f"block {block.block_id} free-queue membership wrong"
            if block.block_hash is not None:
                assert self.cached_blocks.get(block.block_hash) == block.block_id, (
                    f"block {block.block_id} has a hash the cache does not map to it"
                )
        for block_hash, block_id in self.cached_blocks.items():
            assert self.blocks[block_id].block_hash == block_hash, f"cache maps to block {block_id} wrongly"
        if self.host_tier is not None:
            self.host_tier.check_integrity()


class SlidingKVBlockManager(KVBlockManager):
    """The blocks of sliding-window layers: a query at position p sees (p - window, p], so
    a block whose tokens all lie before the window of the request's next query is let go
    (its table entry becomes NULL_BLOCK; it joins the free queue with its hash, so a later
    prefix hit may still take it), and a prefix hit needs only the blocks inside the
    window of the first query computed after it."""

    reserves_null = True

    def __init__(self, num_blocks: int, block_size: int, window: int, enable_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        self.window = window

    def first_needed_block(self, position: int) -> int:
        """The first block a query at `position` (or any later one) reads."""
        return max(0, position - self.window + 1) // self.block_size

    def max_blocks_per_request(self, num_new_tokens: int) -> int:
        """Most blocks a request holds while it computes `num_new_tokens` at once."""
        return self.blocks_needed(self.window + num_new_tokens) + 1

    def window_hit(self, request: Request, num_blocks: int) -> list[int] | None:
        """The table for a prefix hit of `num_blocks` blocks (NULL_BLOCK before the window),
        or None when a block inside the window is not cached."""
        first = self.first_needed_block(num_blocks * self.block_size)
        ids = [self.cached_blocks.get(h) for h in self._block_hashes(request)[first:num_blocks]]
        if len(ids) != num_blocks - first or None in ids:
            return None
        return [NULL_BLOCK] * first + ids

    def release_outside_window(self, request: Request) -> None:
        """Let go of the blocks no future query of the request reads (queries start at
        its num_computed_tokens)."""
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        for i in range(min(self.first_needed_block(request.num_computed_tokens), len(blocks))):
            block_id = blocks[i]
            if block_id == NULL_BLOCK:
                continue
            blocks[i] = NULL_BLOCK
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)


HybridHit = tuple[list[int], list[int]]  # (full-attention blocks, sliding-window blocks) of a prefix hit


class HybridKVBlockManager:
    """Two pools, as vLLM's hybrid KV cache manager keeps a block table per group of layers:
    full-attention layers keep every block (`full`); sliding-window layers keep only the
    blocks inside the window (`sliding`). A request holds a table in each, position-aligned.

    Prefix caching hits per group and the hit is the longest prefix both accept: the full
    group needs every block of the prefix, the sliding group only the blocks inside the
    window of the first query after it (vLLM's rule for sliding-window groups). Blocks of
    both pools carry the same chained hash of their tokens. Capacity (`num_blocks`,
    admission checks) is the full pool's; running out of either pool preempts."""

    def __init__(self, num_blocks: int, num_sliding_blocks: int, block_size: int, window: int,
                 enable_caching: bool = True) -> None:
        self.full = KVBlockManager(num_blocks, block_size, enable_caching)
        self.sliding = SlidingKVBlockManager(num_sliding_blocks, block_size, window, enable_caching)
        self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching

    @property
    def stats(self) -> PrefixCacheStats:
        return self.full.stats

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    # A block map (the dashboard) shows the full-attention pool.
    @property
    def blocks(self) -> list[KVBlock]:
        return self.full.blocks

    @property
    def req_blocks(self) -> dict[str, list[int]]:
        return self.full.req_blocks

    @property
    def usage(self) -> float:
        return max(self.full.usage, self.sliding.usage)

    def snapshot(self) -> KVSnapshot:
        return self.full.snapshot()

    def blocks_needed(self, num_tokens: int) -> int:
        return self.full.blocks_needed(num_tokens)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.full.get_block_ids(request_id)

    def get_sliding_block_ids(self, request_id: str) -> list[int]:
        return self.sliding.get_block_ids(request_id)

    def get_computed_blocks(self, request: Request) -> tuple[HybridHit, int]:
        full, _ = self.full.get_computed_blocks(request)
        for n in range(len(full), 0, -1):
            sliding = self.sliding.window_hit(request, n)
            if sliding is not None:
                return (full[:n], sliding), n * self.block_size
        return ([], []), 0

    def peek_cached_tokens(self, request: Request) -> int:
        """At most what a hit would cover (the full-attention pool's; the window may cut it)."""
        return self.full.peek_cached_tokens(request)

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: HybridHit | None = None) -> bool:
        full_hit, sliding_hit = computed_blocks or ([], [])
        self.sliding.release_outside_window(request)
        if not (self.full.can_allocate(request, num_new_tokens, full_hit)
                and self.sliding.can_allocate(request, num_new_tokens, sliding_hit)):
            return False
        if not (self.full.allocate_slots(request, num_new_tokens, full_hit)
                and self.sliding.allocate_slots(request, num_new_tokens, sliding_hit)):
            raise RuntimeError(f"{request.request_id}: KV allocation failed after can_allocate said it fits")
        return True

    def free(self, request: Request) -> None:
        self.full.free(request)
        self.sliding.free(request)

    def reset_prefix_cache(self) -> bool:
        return self.full.reset_prefix_cache() and self.sliding.reset_prefix_cache()

    def take_transfers(self) -> None:
        return None  # no host tier for a hybrid cache (yet)

    @property
    def events(self) -> KVEventLog | None:
        """KV events of the full-attention pool (vLLM's group 0; the sliding pool's are not published)."""
        return self.full.events

    @events.setter
    def events(self, log: KVEventLog | None) -> None:
        self.full.events = log

    def take_events(self) -> list:
        return self.full.take_events()

    def check_integrity(self) -> None:
        self.full.check_integrity()
        self.sliding.check_integrity()
        for rid, blocks in self.full.req_blocks.items():
            assert len(self.sliding.req_blocks.get(rid, [])) == len(blocks), f"{rid}: the two tables differ in length"
