"""Which data-parallel replica serves a request: prefix-aware, balanced against load.

The policy of SGLang's router and vllm-router's `cache_aware`, on block hashes instead
of a character radix tree: a request's prompt (text, token ids, or chat messages) is cut
into blocks (64 characters or 16 token ids), each block hashed together with everything
before it, as the engine's prefix cache hashes KV blocks. Each replica remembers the
hashes of what was recently sent to it (an LRU of bounded size); a request's match on a
replica is how many of its leading blocks that replica has seen. This is approximate (a
replica may have evicted them) and cheap (no tokenizer in the router).

    if the loads are out of balance (max - min > balance_abs and max > balance_rel * min):
        the least loaded replica
    elif the best match covers more than cache_threshold of the prompt:
        the replica with the best match (ties: the less loaded)
    else:
        the least loaded replica

Load = requests in flight through the router. Torch-free.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TEXT_BLOCK = 64  # characters per block (about 16 tokens of English)
TOKEN_BLOCK = 16


def prompt_key(path: str, body: dict[str, Any]) -> str | list[int]:
    """What a request's prefix is made of: the completion prompt or embeddings input (its
    first one, for a list), or the chat messages serialized in order (a conversation that
    grows keeps its old serialization as a prefix)."""
    if path.endswith("/chat/completions"):
        parts = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else message
            text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
            role = message.get("role", "") if isinstance(message, dict) else ""
            parts.append(f"<{role}>{text}")
        return "".join(parts)
    prompt = body.get("input", "") if path.endswith("/embeddings") else body.get("prompt", "")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts: route by the first
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    return prompt if isinstance(prompt, str) else str(prompt)


def block_hashes(key: str | list[int]) -> list[bytes]:
    """Chained hashes of the key's whole blocks (a trailing partial block counts too:
    requests sharing it share more than the whole blocks)."""
    size = TEXT_BLOCK if isinstance(key, str) else TOKEN_BLOCK
    hashes, previous = [], b""
    for start in range(0, len(key), size):
        chunk = key[start : start + size]
        data = chunk.encode("utf-8", "surrogatepass") if isinstance(chunk, str) else repr(chunk).encode()
        previous = hashlib.blake2b(previous + data, digest_size=12).digest()
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """The block hashes recently routed to one replica, least recently used first out."""

    def __init__(self, max_blocks: int = 200_000) -> None:
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def match(self, hashes: list[bytes]) -> int:
        matched = 0
        for h in hashes:
            if h not in self._blocks:
                break
            matched += 1
        return matched

    def insert(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._blocks)


@dataclass
class Choice:
    replica: int
    matched_blocks: int
    total_blocks: int
    reason: str  # "prefix", "load", "balance", "round_robin"


class CacheAwarePolicy:
    name = "cache_aware"

    def __init__(self, num_replicas: int, cache_threshold: float = 0.3, balance_abs: int = 16,
                 balance_rel: float = 1.5, max_blocks: int = 200_000) -> None:
        self.indexes = [PrefixIndex(max_blocks) for _ in range(num_replicas)]
        self.cache_threshold = cache_threshold
        self.balance_abs, self.balance_rel = balance_abs, balance_rel

    def choose(self, key: str | list[int], loads: list[int], healthy: list[bool]) -> Choice:
        candidates = healthy_candidates(healthy)
        hashes = block_hashes(key)
        matches = {i: self.indexes[i].match(hashes) for i in candidates}
        choice = decide(candidates, matches, len(hashes), loads, self.cache_threshold, self.balance_abs,
                        self.balance_rel, tie=lambda i: len(self.indexes[i]))
        self.indexes[choice.replica].insert(hashes)
        return choice


def healthy_candidates(healthy: list[bool]) -> list[int]:
    candidates = [i for i, ok in enumerate(healthy) if ok]
    if not candidates:
        raise LookupError("no healthy replica")
    return candidates


def decide(candidates: list[int], matches: dict[int, int], total: int, loads: list[int], cache_threshold: float,
           balance_abs: int, balance_rel: float, tie: Callable[[int], int] = lambda i: 0) -> Choice:
    """The rule of the module docstring, given each candidate's matched blocks out of `total`."""
    least = min(candidates, key=lambda i: (loads[i], tie(i), i))
    low, high = loads[least], max(loads[i] for i in candidates)
    best = max(candidates, key=lambda i: (matches[i], -loads[i], -i))
    if high - low > balance_abs and high > balance_rel * low:
        return Choice(least, matches[least], total, "balance")
    if total and matches[best] / total > cache_threshold:
        return Choice(best, matches[best], total, "prefix")
    return Choice(least, matches[least], total, "load")


@dataclass
class PromptTokens:
    """A request's prompt as the engine will see it (what kv_aware hashes)."""

    token_ids: list[int]
    cache_salt: str | None = None


class KVEventIndex:
    """The blocks one replica holds, as its KV events tell (vLLM's integer block hashes ->
    the mediums holding each: the pool, the host tier, the disk tier). Written by the
    subscriber's thread, read by the router's loop."""

    def __init__(self) -> None:
        self._blocks: dict[int, set[str]] = {}
        self._lock = threading.Lock()

    def apply(self, event: Any) -> None:
        kind = type(event).__name__
        with self._lock:
            if kind == "BlockStored":
                for h in event.block_hashes:
                    self._blocks.setdefault(h, set()).add(event.medium or "GPU")
            elif kind == "BlockRemoved":
                for h in event.block_hashes:
                    mediums = self._blocks.get(h)
                    if mediums is not None:
                        mediums.discard(event.medium or "GPU")
                        if not mediums:
                            del self._blocks[h]
            elif kind == "AllBlocksCleared":
                self._blocks.clear()

    def match(self, hashes: list[int]) -> int:
        matched = 0
        with self._lock:
            for h in hashes:
                if h not in self._blocks:
                    break
                matched += 1
        return matched

    def __len__(self) -> int:
        return len(self._blocks)


class KVAwarePolicy:
    """vllm-router's `kv_aware`: a request's prefix matched against the blocks each replica
    says it holds (its KV events), not against what the router sent it. A prefix computed
    by traffic this router never saw (a replica's own port, a restarted router) is found;
    one a replica evicted is not credited. The hashes are the engine's (its chained SHA-256
    per `block_size` tokens, the cache salt in the first), in vLLM's integer form."""

    name = "kv_aware"
    needs_tokens = True

    def __init__(self, num_replicas: int, block_size: int, cache_threshold: float = 0.3, balance_abs: int = 16,
                 balance_rel: float = 1.5) -> None:
        self.indexes = [KVEventIndex() for _ in range(num_replicas)]
        self.block_size = block_size
        self.cache_threshold = cache_threshold
        self.balance_abs, self.balance_rel = balance_abs, balance_rel

    def on_batch(self, replica: int, batch: Any) -> None:
        for event in batch.events:
            self.indexes[replica].apply(event)

    def hashes(self, prompt: PromptTokens) -> list[int]:
        """The prompt's full blocks the engine could find cached (never the last token's)."""
        from tokenmill.engine.block_manager import hash_block
        from tokenmill.kv_events.publisher import external_hash

        ids, size = prompt.token_ids, self.block_size
        hashes, parent = [], None
        for i in range((len(ids) - 1) // size if ids else 0):
            parent = hash_block(parent, ids[i * size : (i + 1) * size], prompt.cache_salt if i == 0 else None)
            hashes.append(external_hash(parent))
        return hashes

    def choose(self, key: PromptTokens | None, loads: list[int], healthy: list[bool]) -> Choice:
        candidates = healthy_candidates(healthy)
        hashes = self.hashes(key) if isinstance(key, PromptTokens) else []
        matches = {i: self.indexes[i].match(hashes) for i in candidates}
        return decide(candidates, matches, len(hashes), loads, self.cache_threshold, self.balance_abs,
                      self.balance_rel)


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self, num_replicas: int) -> None:
        self._next = itertools.cycle(range(num_replicas))
        self.num_replicas = num_replicas

    def choose(self, key: str | list[int], loads: list[int], healthy: list[bool]) -> Choice:
        if not any(healthy):
            raise LookupError("no healthy replica")
        for _ in range(self.num_replicas):
            replica = next(self._next)
            if healthy[replica]:
                return Choice(replica, 0, 0, "round_robin")
        raise LookupError("no healthy replica")


POLICIES = ("cache_aware", "kv_aware", "round_robin")


def make_policy(name: str, num_replicas: int, block_size: int = 16):
    if name == "cache_aware":
        return CacheAwarePolicy(num_replicas)
    if name == "kv_aware":
        return KVAwarePolicy(num_replicas, block_size)
    if name == "round_robin":
        return RoundRobinPolicy(num_replicas)
    raise ValueError(f"unknown data-parallel policy {name!r}; choose one of {', '.join(POLICIES)}")
