"""`OutputStreamFilter`: the streaming post-filter of one generation.

It keeps a sliding window of the most recent output text. On every delta the pattern tier scans the
delta plus the `pattern_overlap_chars` before it, so a phrase split across deltas ("how to bu" +
"ild a bo" + "mb") is matched once its last piece arrives, while the cost per delta stays bounded
however long the generation gets. The classifier tier reads the last `classifier_window_chars`, and
only every `classify_every_chars` new characters (~12 tokens, so a halt it decides lands within 16
tokens of the text that caused it), or at a sentence boundary once `min_chars_at_boundary` new
characters have come, or on the final chunk: one pass costs milliseconds, ~1000x the pattern tier.
A stream whose prompt scored in the uncertain band (`watch=True`) is classified twice as often.
`needs_classifier` tells the caller ahead of `feed` whether this delta will run the classifier, so
the gRPC servicer can run that `feed` in a worker thread and keep its event loop free.

A word still open at the end of the text is left for the next delta (or the final chunk), so
"make a bomb" + "ay gin" never halts on "bomb". Cut points (the start of the overlap, the start of
the classifier window) are moved forward to a space, so a cut never turns "skill myself" into
"kill myself".

Once a verdict halts the stream, every later `feed` returns that verdict again: the caller aborts
the request (freeing its KV blocks) and sends the client the text it already has. Under a "flag"
policy a category is reported once per stream, on its first crossing, then excluded from checks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.safety.categories import Category, Detector, Direction, SafetyVerdict
from services.safety.checker import SafetyChecker
from services.safety.normalize import normalize
from services.safety.policy import SafetyPolicy

_SENTENCE_END = re.compile(r"[.!?\n]")


@dataclass(frozen=True)
class StreamFilterConfig:
    pattern_overlap_chars: int = 160   # > the longest phrase a pattern matches in practice (~10 words)
    classifier_window_chars: int = 240  # about two sentences (~55 tokens: ~10 ms to embed)
    classify_every_chars: int = 48      # ~12 tokens
    min_chars_at_boundary: int = 24

    def __post_init__(self) -> None:
        if min(self.pattern_overlap_chars, self.classifier_window_chars, self.classify_every_chars) <= 0:
            raise ValueError(f"stream filter sizes must be positive: {self}")


def _tail_from_space(text: str, keep: int) -> str:
    """The last `keep` characters of `text`, cut forward to a space so no word is split."""
    if len(text) <= keep:
        return text
    start = len(text) - keep
    space = text.find(" ", start)
    return text[start:] if space < 0 else text[space + 1:]


class OutputStreamFilter:
    """Not thread-safe: one instance per generation, fed in order."""

    def __init__(self, checker: SafetyChecker, policy: SafetyPolicy,
                 config: StreamFilterConfig | None = None, watch: bool = False) -> None:
        self._checker = checker
        self._policy = policy
        self._config = config or StreamFilterConfig()
        self._every = max(1, self._config.classify_every_chars // 2) if watch else self._config.classify_every_chars
        self._categories = list(policy.active(Direction.OUTPUT))
        self._window = ""
        self._since_classify = 0
        self._halt: SafetyVerdict | None = None
        self.flagged: list[str] = []  # categories flagged so far (policy action "flag")

    @property
    def halted(self) -> SafetyVerdict | None:
        return self._halt

    def feed(self, delta: str, final: bool = False) -> SafetyVerdict:
        """The verdict after appending `delta`; allowed=False means halt the generation now."""
        if self._halt is not None:
            return self._halt
        if not self._categories:
            return SafetyVerdict(allowed=True, category=None, score=0.0, tier=Detector.NONE)
        cfg = self._config
        region = _tail_from_space(self._window + delta, len(delta) + cfg.pattern_overlap_chars)
        self._window = _tail_from_space(self._window + delta, max(cfg.classifier_window_chars,
                                                                  cfg.pattern_overlap_chars))
        self._since_classify += len(delta)
        if not final and region[-1:].isalnum():
            # The last word may still be growing ("bomb" -> "bombay"): it is scanned with the next delta.
            region = region[:region.rfind(" ") + 1]
        verdict = self._checker.scan_patterns(self._policy, normalize(region), self._categories)
        if verdict is None and self._classify_now(delta, final):
            self._since_classify = 0
            tail = _tail_from_space(self._window, cfg.classifier_window_chars)
            verdict = self._checker.classify(self._policy, tail, self._categories)
        if verdict is None:
            verdict = SafetyVerdict(allowed=True, category=None, score=0.0, tier=Detector.PATTERN)
        return self._record(verdict)

    def needs_classifier(self, delta: str, final: bool) -> bool:
        """Whether `feed(delta, final)` would run the classifier tier (if no pattern hits first)."""
        if self._halt is not None or not self._categories:
            return False
        pending = self._since_classify + len(delta)
        if pending == 0:
            return False
        if final or pending >= self._every:
            return True
        return pending >= self._config.min_chars_at_boundary and _SENTENCE_END.search(delta) is not None

    def _classify_now(self, delta: str, final: bool) -> bool:
        if self._since_classify == 0:
            return False
        if final or self._since_classify >= self._every:
            return True
        return (self._since_classify >= self._config.min_chars_at_boundary
                and _SENTENCE_END.search(delta) is not None)

    def _record(self, verdict: SafetyVerdict) -> SafetyVerdict:
        if not verdict.allowed:
            self._halt = verdict
        elif verdict.category is not None:
            self.flagged.append(verdict.category)
            self._categories.remove(Category(verdict.category))
        return verdict
