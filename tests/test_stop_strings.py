"""StopStringMatcher (Aho-Corasick) against the plain definition, on random texts."""

from __future__ import annotations

import random

from tokenmill.engine.stop_strings import StopMatch, StopStringMatcher


def reference_match(text: str, new_from: int, stops: list[str]) -> StopMatch | None:
    """The earliest-starting stop string that ends inside text[new_from:]; of two
    starting together, the shorter (it ends first)."""
    found = []
    for stop in stops:
        start = text.find(stop, max(0, new_from - len(stop) + 1))
        if start != -1:
            found.append((start, len(stop), stop))
    return StopMatch(min(found)[0], min(found)[2]) if found else None


def reference_held(text: str, stops: list[str]) -> int:
    """The longest suffix of text that is a prefix (proper or not) of a stop string."""
    return max((k for stop in stops for k in range(1, min(len(stop), len(text)) + 1)
                if text.endswith(stop[:k])), default=0)


def test_matches_the_definition_on_random_texts():
    rng = random.Random(0)
    for _ in range(400):
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6))]
        matcher = StopStringMatcher(stops)
        text = ""
        while len(text) < 40:
            chunk = "".join(rng.choice("abc d") for _ in range(rng.randint(1, 4)))
            new_from = len(text)
            text += chunk
            expected = reference_match(text, new_from, stops)
            assert matcher.feed(chunk) == expected, (stops, text, new_from)
            if expected is not None:
                break
            assert matcher.held_length == reference_held(text, stops), (stops, text)


def test_a_match_may_begin_in_earlier_text_and_the_earliest_start_wins():
    matcher = StopStringMatcher(["bc", "abcd"])
    assert matcher.feed("xa") is None and matcher.held_length == 1
    assert matcher.feed("bcd") == StopMatch(1, "abcd")  # both end in this chunk; "abcd" starts first
    matcher = StopStringMatcher(["bc", "abcd"])
    assert matcher.feed("xab") is None and matcher.held_length == 2
    assert matcher.feed("c") == StopMatch(2, "bc")  # "abcd" could still come, but "bc" ended first


def test_many_stop_strings_are_one_automaton():
    stops = [f"stop-{i:05d}!" for i in range(10_000)]
    matcher = StopStringMatcher(stops)
    assert matcher.feed("nothing to see " * 10) is None
    assert matcher.feed("... stop-0") is None and matcher.held_length == len("stop-0")
    assert matcher.feed("9999!") == StopMatch(len("nothing to see " * 10) + 4, "stop-09999!")
