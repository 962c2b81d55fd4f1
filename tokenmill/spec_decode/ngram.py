"""N-gram proposer (prompt lookup decoding), vLLM's semantics.

Find the longest suffix of the request's tokens (prompt + output), of length between
`prompt_lookup_min` and `prompt_lookup_max`, that also occurs earlier in them, and
propose the (up to k) tokens that followed its latest earlier occurrence. No model:
copying from the input is what rewrite, edit, summarize and code tasks do a lot of.

Vectorized with numpy: the candidates are the earlier positions of the last token, and
each is extended backwards one comparison per suffix length for all of them at once, so
a step costs O(context) per request with a small constant.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from tokenmill.engine.request import Request
from tokenmill.spec_decode.proposer import proposal_room


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The up to k tokens after the latest earlier occurrence of the longest suffix of
    `tokens` with length in [min_n, max_n]; [] when no such suffix re-occurs."""
    length = tokens.shape[0]
    if k < 1 or length <= min_n:
        return []
    last = length - 1
    # An earlier occurrence ends at position j < last (something follows it).
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    matched = np.ones(ends.shape[0], dtype=np.int64)  # suffix length matched at each candidate
    alive = np.ones(ends.shape[0], dtype=bool)
    for n in range(1, min(max_n, last)):
        # Extend the candidates still matching by one more token backwards.
        pos = ends - n
        ok = alive & (pos >= 0)
        ok[ok] = tokens[pos[ok]] == tokens[last - n]
        matched += ok
        alive = ok
        if not alive.any():
            break
    best = matched.max(initial=0)
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(matched == best)[-1]])  # the latest of the longest matches
    return tokens[end + 1 : end + 1 + k].tolist()


class NgramProposer:
    """Prompt lookup: proposals copied from the request's own tokens."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: Sequence[Request]) -> None:
        for request in requests:
            k = proposal_room(request, self.num_speculative_tokens)
            tokens = np.asarray(request.all_token_ids, dtype=np.int64)
            request.spec_token_ids = ngram_lookup(tokens, self.min_n, self.max_n, k)

    def release(self, request_ids: Iterable[str]) -> None:
        pass  # holds nothing per request
