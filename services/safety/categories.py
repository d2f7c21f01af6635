"""What the safety service can say about a text: categories, directions, tiers, and the verdict.

`SafetyVerdict` is the plain frozen dataclass that crosses every internal boundary (checker, stream
filter, gRPC edge, gateway client); protobuf appears only in `services.safety.wire`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Category(StrEnum):
    """Harm categories. The values are the names used in policy files, metrics and the wire."""

    VIOLENCE = "violence"            # weapons, explosives, poisons, plans to hurt a named target
    SELF_HARM = "self_harm"          # suicide or self-injury methods and intent
    SEXUAL_MINORS = "sexual_minors"  # any sexual content involving a minor
    HATE = "hate"                    # dehumanising a protected group, harassment, threats
    MALWARE = "malware"              # writing malware, intrusion, credential theft
    PII = "pii"                      # emails, phone numbers, card numbers (output leakage)

    @classmethod
    def parse(cls, name: str) -> Category:
        try:
            return cls(name)
        except ValueError as e:
            raise ValueError(f"unknown safety category {name!r}; valid: {[c.value for c in cls]}") from e


# The categories the learned tier scores; PII is a pattern-only category (a regex with a checksum
# is the right detector for a card number, a classifier is not).
LEARNED_CATEGORIES: tuple[Category, ...] = (
    Category.VIOLENCE, Category.SELF_HARM, Category.SEXUAL_MINORS, Category.HATE, Category.MALWARE,
)
SAFE_LABEL = "safe"


class Direction(StrEnum):
    INPUT = "input"    # the prompt, checked before routing (no GPU work when refused)
    OUTPUT = "output"  # generated text, checked while it streams


class Detector(StrEnum):
    """Which tier of checks decided a verdict (`SafetyVerdict.tier`); not a customer tier
    (`scheduler.types.Tier`)."""

    NONE = "none"                # the policy switched this direction off: nothing ran
    PATTERN = "pattern"          # normalising regex/keyword tier
    CLASSIFIER = "classifier"    # sentence-embedding classifier (MiniLM + MLP head)
    GUARD = "guard"              # optional guard LLM (services.safety.guard), input only
    UNAVAILABLE = "unavailable"  # client side only: the service did not answer; `allowed` is the fail mode


@dataclass(frozen=True)
class SafetyVerdict:
    """The answer for one text (input) or one delta (output).

    allowed=False: refuse the prompt / halt the generation (finish_reason `content_filter`).
    allowed=True with a category: the policy's action is "flag": serve it, but record it.
    allowed=True with category None: nothing crossed a threshold; `score` is the highest score seen.
    watch: the score fell in the classifier's uncertain band: served, but logged and its generation's
    output is checked more often.
    category_scores: (category, probability) of each learned category the classifier scored (empty
    when it did not run), for `/v1/moderations`.
    """

    allowed: bool
    category: str | None
    score: float
    tier: str
    watch: bool = False
    category_scores: tuple[tuple[str, float], ...] = ()

    @property
    def flagged(self) -> bool:
        return self.allowed and self.category is not None


ALLOW_UNCHECKED = SafetyVerdict(allowed=True, category=None, score=0.0, tier=Detector.NONE)
