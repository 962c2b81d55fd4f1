"""What every proposer shares. The interface itself is the engine's seam,
`tokenmill.engine.engine.Proposer` (torch-free): `propose(requests)` sets each request's
`spec_token_ids` after a step, `release(request_ids)` frees what is held for requests that
finished, were aborted or preempted."""

from __future__ import annotations

from tokenmill.engine.engine import Proposer
from tokenmill.engine.request import Request

__all__ = ["Proposer", "proposal_room"]


def proposal_room(request: Request, k: int) -> int:
    """How many proposals could still become output: the request's final token needs no
    verification (nor KV slot), so no more than max_tokens - 1 past the known tokens."""
    room = request.num_prompt_tokens + request.max_tokens - 1 - request.num_tokens
    return max(0, min(k, room))
