"""What happened to the prefix cache, as vLLM's KV events say it (`BlockStored`,
`BlockRemoved`, `AllBlocksCleared`, each block in a medium: "GPU" for the hot pool, as
vLLM names its device pool whatever the device, "CPU" for the host tier, "DISK" for the
disk tier). Plain records,
torch-free; the block manager appends them when events are on, the engine hands each
step's to a sink, and `tokenmill.kv_events` encodes and publishes them (msgspec over ZMQ,
vLLM's wire format)."""

from __future__ import annotations

from dataclasses import dataclass, field

BlockHash = bytes

MEDIUM_POOL = "GPU"  # vLLM's MEDIUM_GPU: the pool the model reads
MEDIUM_HOST = "CPU"  # the host tier
MEDIUM_DISK = "DISK"  # the disk tier (vLLM has no name of its own for it; LMCache's is a backend, not a medium)


@dataclass
class BlockStored:
    block_hashes: list[BlockHash]  # a chain: each block's parent is the one before it
    parent_block_hash: BlockHash | None  # the first block's parent
    token_ids: list[int]  # every block's tokens, in order
    block_size: int
    medium: str
    extra_key: str | None = None  # the first block's extra key (a cache salt), if any


@dataclass
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str


@dataclass
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class BlockMeta:
    """What a stored event says of a block, kept while any tier holds it."""

    parent: BlockHash | None
    token_ids: list[int]
    extra_key: str | None = None


@dataclass
class KVEventLog:
    """The events since the last `take`, and each held block's meta (a demotion's
    BlockStored on the host medium repeats the block's parent and tokens)."""

    block_size: int
    events: list[KVEvent] = field(default_factory=list)
    meta: dict[BlockHash, BlockMeta] = field(default_factory=dict)

    def stored(self, hashes: list[BlockHash], metas: list[BlockMeta], medium: str) -> None:
        """Blocks stored in `medium`; consecutive blocks of one chain make one event."""
        run: list[BlockHash] = []
        for block_hash, meta in zip(hashes, metas, strict=True):
            self.meta.setdefault(block_hash, meta)
            if run and meta.parent != run[-1]:
                self._flush(run, medium)
                run = []
            run.append(block_hash)
        if run:
            self._flush(run, medium)

    def removed(self, hashes: list[BlockHash], medium: str) -> None:
        if hashes:
            self.events.append(BlockRemoved(list(hashes), medium))

    def forget(self, block_hash: BlockHash) -> None:
        """No tier holds the block any more."""
        self.meta.pop(block_hash, None)

    def cleared(self) -> None:
        self.meta.clear()
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def _flush(self, run: list[BlockHash], medium: str) -> None:
        first = self.meta[run[0]]
        tokens = [t for h in run for t in self.meta[h].token_ids]
        self.events.append(BlockStored(list(run), first.parent, tokens, self.block_size, medium, first.extra_key))
