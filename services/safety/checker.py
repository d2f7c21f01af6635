"""`SafetyChecker`: runs the tiers an organisation's policy asks for and turns scores into a verdict.

Order: the pattern tier first (microseconds); a hit decides at once with score 1.0. Otherwise the
classifier tier scores the enabled learned categories (`classifier.harm_score`) against the
likeliest category's threshold (the policy's, or by default the classifier's held-out refuse
threshold). The policy's action turns a crossing into a block (allowed=False) or a flag
(allowed=True, category set). A score in the uncertain band [watch, refuse) is served with
`watch=True`: the caller logs it and checks that generation's output more often.

Pure CPU and stateless per call; one instance serves every request of a process (the classifier's
encoder releases the GIL in its matmuls, so callers may run `check` in worker threads). The
streaming filter calls `scan_patterns` and `classify` separately: it runs them on different
schedules.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace

from services.safety.categories import ALLOW_UNCHECKED, LEARNED_CATEGORIES, Category, Detector, Direction, SafetyVerdict
from services.safety.classifier import EmbeddingClassifier, harm_score
from services.safety.metrics import TIER_LATENCY
from services.safety.normalize import NormalizedText, normalize
from services.safety.patterns import PatternTier
from services.safety.policy import Action, PolicyBook, SafetyPolicy
from services.safety.segments import segments

_PATTERN_LATENCY = TIER_LATENCY.labels(Detector.PATTERN.value)
_CLASSIFIER_LATENCY = TIER_LATENCY.labels(Detector.CLASSIFIER.value)


def decide(policy: SafetyPolicy, category: Category, score: float, tier: Detector) -> SafetyVerdict:
    """The verdict for a category that crossed its threshold, under the policy's action."""
    return SafetyVerdict(allowed=policy.action is Action.FLAG, category=category.value, score=score,
                         tier=tier)


class SafetyChecker:
    def __init__(self, policies: PolicyBook, patterns: PatternTier | None = None,
                 classifier: EmbeddingClassifier | None = None) -> None:
        """`classifier=None` runs the pattern tier only (e.g. to measure it alone)."""
        self.policies = policies
        self.patterns = patterns or PatternTier()
        self.classifier = classifier

    def check(self, org_id: str, text: str, direction: Direction) -> SafetyVerdict:
        """Every enabled tier on the whole of `text`."""
        policy = self.policies.for_org(org_id)
        categories = policy.active(direction)
        if not categories:
            return ALLOW_UNCHECKED
        start = time.perf_counter()
        norm = normalize(text)
        hit = self.scan_patterns(policy, norm, categories, start)
        if hit is not None:
            return hit
        return self.classify(policy, text, categories)

    def scan_patterns(self, policy: SafetyPolicy, norm: NormalizedText, categories: Iterable[Category],
                      start: float | None = None) -> SafetyVerdict | None:
        """The pattern tier's verdict, or None when nothing matched. `start`: when normalising began."""
        start = time.perf_counter() if start is None else start
        hit = self.patterns.scan(norm, categories)
        _PATTERN_LATENCY.observe(time.perf_counter() - start)
        return decide(policy, hit.category, 1.0, Detector.PATTERN) if hit is not None else None

    def classify(self, policy: SafetyPolicy, text: str, categories: Iterable[Category]) -> SafetyVerdict:
        """The classifier tier's verdict on `text` (allowed when no classifier is loaded).

        A long text is scored sentence by sentence (`segments`, embedded in one batch) and the worst
        sentence counts. `category_scores` carries every enabled learned category's probability in
        that sentence, for callers that report scores (`/v1/moderations`).
        """
        learned = [c for c in categories if c in LEARNED_CATEGORIES]
        if self.classifier is None or not learned:
            return SafetyVerdict(allowed=True, category=None, score=0.0, tier=Detector.PATTERN)
        start = time.perf_counter()
        scored = [(harm_score(probs, learned), probs) for probs in self.classifier.predict_many(segments(text))]
        (category, score), probs = max(scored, key=lambda s: s[0][1])
        _CLASSIFIER_LATENCY.observe(time.perf_counter() - start)
        scores = tuple((c.value, round(probs[c], 4)) for c in learned)
        threshold = policy.threshold(category) if category is not None else None
        if category is not None and score >= (threshold or self.classifier.refuse_threshold):
            verdict = decide(policy, category, score, Detector.CLASSIFIER)
            return replace(verdict, category_scores=scores)
        return SafetyVerdict(allowed=True, category=None, score=score, tier=Detector.CLASSIFIER,
                             watch=score >= self.classifier.watch_threshold, category_scores=scores)
