"""Long benign English text for safety tests: every sentence differs (numbers in it), so no piece of
one text is in the safety service's segment cache from another, and each test judges all of its text."""

from __future__ import annotations

import itertools

_TEMPLATES = ("The committee met on day {i} to go over budget line {j} for the new library wing.",
              "Member {i} asked for a breakdown of the costs of item {j} by quarter.",
              "The chair promised draft {i} of the plan before the end of month {j}.")
_counter = itertools.count()


def prose(words: int) -> str:
    """About `words` words of sentences no other call of this process returns."""
    out: list[str] = []
    while len(out) < words:
        n = next(_counter)
        out.extend(_TEMPLATES[n % 3].format(i=n, j=n * 7 + 3).split())
    return " ".join(out[:words])
