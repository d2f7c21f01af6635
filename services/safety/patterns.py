"""`PatternTier`: the fast tier. One compiled alternation per harm category over the normalised
`words` view, plus validated PII detectors over the `raw` view.

A hit scores 1.0: a pattern states intent in so many words, so it crosses any threshold a policy can
set. Cost is microseconds (one `re.search` per enabled category on text that is already normalised),
which is why this tier runs on every prompt and on every streamed delta.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from services.safety.categories import Category
from services.safety.normalize import NormalizedText
from services.safety.pattern_rules import RULES, compile_rules
from services.safety.pii import find_pii


@dataclass(frozen=True)
class PatternHit:
    category: Category
    evidence: str  # the matched words (normalised) or the PII kind; for logs, never sent to clients


class PatternTier:
    """Stateless and thread-safe once built; build one per process (compiling takes a few ms)."""

    def __init__(self) -> None:
        self._compiled: dict[Category, re.Pattern[str]] = {c: compile_rules(s) for c, s in RULES.items()}

    def scan(self, text: NormalizedText, categories: Iterable[Category]) -> PatternHit | None:
        """The first hit among `categories` (in the order given), or None."""
        for category in categories:
            hit = self._scan_one(text, category)
            if hit is not None:
                return hit
        return None

    def _scan_one(self, text: NormalizedText, category: Category) -> PatternHit | None:
        if category == Category.PII:
            kind = find_pii(text.raw)
            return PatternHit(category, kind) if kind else None
        match = self._compiled[category].search(text.words)
        return PatternHit(category, match.group(0)) if match else None
