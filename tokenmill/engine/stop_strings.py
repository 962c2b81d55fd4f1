"""Stop-string matching whose cost does not grow with the number of stop strings.

An Aho-Corasick automaton over the request's stop strings is fed the output text one
character at a time. Its state is the longest suffix of the text that is a prefix of
some stop string, which answers both questions the detokenizer asks after each token:
did a stop string just end here, and how much of the text's tail could still become
one (and must be held back from a stream). Feeding a character costs amortized O(1)
whatever the number or length of the stop strings; building the automaton costs
O(total length of the stop strings), once per request.

The simple alternative, `text.find(stop)` for every stop string on every token and an
`endswith` loop for the held-back tail, made 10,000 stop strings slow the whole batch
five-fold (issue 18): the engine thread pays for every request's checks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    start: int  # index in the text where the stop string begins
    stop: str


class StopStringMatcher:
    """Incremental matcher over one growing text. Torch-free."""

    def __init__(self, stop_strings: list[str]) -> None:
        # Node 0 is the root. For each node: its children, its failure link, its depth,
        # and the longest stop string that ends at this node or along its failure chain.
        self._children: list[dict[str, int]] = [{}]
        self._fail: list[int] = [0]
        self._depth: list[int] = [0]
        self._output: list[str | None] = [None]
        for stop in dict.fromkeys(stop_strings):
            self._insert(stop)
        self._link()
        self._state = 0
        self._position = 0  # characters fed so far

    @property
    def held_length(self) -> int:
        """Length of the longest tail of the text that is a prefix of a stop string."""
        return self._depth[self._state]

    def feed(self, text: str) -> StopMatch | None:
        """Feed the text's next characters; the match that starts earliest among the stop
        strings ending inside them (a match may begin in earlier text), or None."""
        best: StopMatch | None = None
        children, fail, output = self._children, self._fail, self._output
        state = self._state
        for char in text:
            while state and char not in children[state]:
                state = fail[state]
            state = children[state].get(char, 0)
            self._position += 1
            stop = output[state]
            if stop is not None:
                start = self._position - len(stop)
                if best is None or start < best.start:
                    best = StopMatch(start, stop)
        self._state = state
        return best

    # ----- construction ------------------------------------------------------------------

    def _insert(self, stop: str) -> None:
        node = 0
        for char in stop:
            nxt = self._children[node].get(char)
            if nxt is None:
                nxt = len(self._children)
                self._children[node][char] = nxt
                self._children.append({})
                self._fail.append(0)
                self._depth.append(self._depth[node] + 1)
                self._output.append(None)
            node = nxt
        self._output[node] = stop

    def _link(self) -> None:
        """Failure links breadth first; each node's output becomes the longest stop string
        ending there, its own or one reached through its failure link."""
        queue = list(self._children[0].values())
        for node in queue:  # the list grows as it is walked: breadth-first order
            for char, child in self._children[node].items():
                link = self._fail[node]
                while link and char not in self._children[link]:
                    link = self._fail[link]
                target = self._children[link].get(char, 0)
                self._fail[child] = target if target != child else 0
                if self._output[child] is None:
                    self._output[child] = self._output[self._fail[child]]
                queue.append(child)
