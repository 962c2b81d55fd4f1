"""Prefill-decode disaggregation, the scheduler's side (torch-free, no sockets).

vLLM's NIXL connector protocol, as vllm-router's `--vllm-pd-disaggregation` drives it: the
router sends a request first to a prefill instance with `kv_transfer_params`
`{"do_remote_decode": true}` and `max_tokens` 1; that instance (the producer) computes the
prompt, samples one token, keeps the request's KV blocks instead of freeing them, and answers
with the `kv_transfer_params` a decode instance needs (`do_remote_prefill`, `remote_engine_id`,
`remote_block_ids`, `remote_host`, `remote_port`, `remote_request_id`). The router sends the
original request with those to a decode instance (the consumer), which allocates blocks, pulls
the remote blocks into them while the request waits (vLLM's WAITING_FOR_REMOTE_KVS), and then
computes only the last prompt token before decoding.

The scheduler talks to a `KVConnector` (the transport, `tokenmill.kv_transfer`, is injected by
the builder): `hold` / `released` on the producer, `start_pull` / `take_pulled` on the consumer.
A connector that `writes_in_place` (the ZMQ transport with the runner's writer) copies the
pulled bytes into the allocated pool blocks on its own thread, while the engine's steps go on;
otherwise they reach the runner in the step's `KVTransfers.remote_load`, copied into the pool
before the forward, as the tiers' loads are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class KVTransferParamsError(ValueError):
    """A request's kv_transfer_params cannot be used (a server answers 400)."""

    param = "kv_transfer_params"


@dataclass(frozen=True)
class RemotePrefill:
    """Where a consumer pulls a request's KV from: the producer's `kv_transfer_params`."""

    engine_id: str
    host: str
    port: int
    request_id: str  # the producer's name for the held blocks
    block_ids: tuple[int, ...]

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RemotePrefill | None:
        """The remote prefill of a request's kv_transfer_params; None when it asks for none.
        Raises KVTransferParamsError naming the field when one is missing or malformed."""
        if not params or not params.get("do_remote_prefill"):
            return None
        missing = [k for k in ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids",
                               "remote_request_id") if params.get(k) is None]
        if missing:
            raise KVTransferParamsError(f"kv_transfer_params: do_remote_prefill needs {', '.join(missing)} (the "
                                        "kv_transfer_params a prefill instance returned)")
        port, blocks = params["remote_port"], params["remote_block_ids"]
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise KVTransferParamsError(f"kv_transfer_params: remote_port must be a TCP port, got {port!r}")
        if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                                                   for b in blocks):
            raise KVTransferParamsError("kv_transfer_params: remote_block_ids must be a list of block ids")
        return cls(str(params["remote_engine_id"]), str(params["remote_host"]), port,
                   str(params["remote_request_id"]), tuple(blocks))


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params) and bool(params.get("do_remote_decode"))


@dataclass
class PullResult:
    request_id: str
    payloads: list[bytes] | None  # one per pulled block, the pool's bytes; None when it failed
    error: str | None = None
    written: bool = False  # the connector wrote the blocks into the pool itself (payloads empty)


@dataclass
class KVTransferStats:
    held_blocks: int = 0  # producer: blocks kept for consumers now
    held_requests: int = 0
    sent_blocks: int = 0  # producer: blocks served, cumulative
    expired_requests: int = 0  # producer: holds freed by the timeout, unpulled
    pulled_blocks: int = 0  # consumer: blocks received, cumulative
    pulling_requests: int = 0  # consumer: requests waiting for their KV now
    failed_pulls: int = 0  # consumer: pulls that failed (recomputed or failed per policy)
    shared_memory_blocks: int = 0  # consumer: of pulled_blocks, those copied from a producer's shared memory


class KVConnector(Protocol):
    """The transport a scheduler drives (implementation: `tokenmill.kv_transfer`)."""

    is_producer: bool
    is_consumer: bool
    # The consumer writes pulled blocks into the pool itself, off the engine thread: the
    # scheduler then keeps an aborted pull's blocks until its result is reported.
    writes_in_place: bool

    def hold(self, key: str, block_ids: list[int]) -> dict[str, Any]:
        """Serve these blocks under `key` until pulled or timed out; returns the response's
        kv_transfer_params. The scheduler frees them when `released` names `key`."""

    def released(self) -> list[str]:
        """Holds pulled, aborted by the consumer or timed out since the last call."""

    def start_pull(self, request_id: str, remote: RemotePrefill, remote_block_ids: list[int],
                   local_block_ids: list[int]) -> None:
        """Fetch these remote blocks' bytes in the background, for these local pool blocks
        (written there when `writes_in_place`, else handed back in the PullResult)."""

    def take_pulled(self) -> list[PullResult]:
        """Pulls finished since the last call."""

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` s or until a pull finishes (an engine with nothing else to do)."""

    def stats(self) -> KVTransferStats: ...
