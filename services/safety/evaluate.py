"""`python -m services.safety.evaluate`: precision/recall and latency of each tier on the eval set.

The evaluation set (`data/eval.jsonl`) was written separately from the training set and is never used
to pick anything: thresholds and training settings come from `--cv`, a 5-fold cross-validation of the
classifier on the training set alone. A positive is any text labelled with a harm category; a tier
"detects" a text when, under the default policy for the text's direction, it would refuse or halt it.

Latency is per text, normalisation included, measured on this process's one thread: p50 and p99 over
`--repeat` passes of the whole eval set.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.safety.categories import LEARNED_CATEGORIES, SAFE_LABEL, Direction
from services.safety.checker import SafetyChecker
from services.safety.classifier import DATA_DIR, LinearClassifier, TrainingConfig, harm_score, load_labelled
from services.safety.normalize import normalize
from services.safety.patterns import PatternTier
from services.safety.policy import DEFAULT_THRESHOLD, PolicyBook
from services.safety.stream_filter import OutputStreamFilter

EVAL_PATH = DATA_DIR / "eval.jsonl"
TIERS = ("pattern", "classifier", "combined")


@dataclass(frozen=True)
class EvalExample:
    text: str
    label: str
    direction: Direction

    @property
    def harmful(self) -> bool:
        return self.label != SAFE_LABEL


@dataclass(frozen=True)
class Scores:
    tp: int
    fp: int
    fn: int
    tn: int

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else 1.0

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else 1.0


def load_eval(path: Path = EVAL_PATH) -> list[EvalExample]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [EvalExample(r["text"], r["label"], Direction(r["direction"])) for r in rows]


def tier_detectors(checker: SafetyChecker) -> dict[str, Callable[[EvalExample], bool]]:
    """One function per tier: True when that tier alone (or both, "combined") refuses the text."""
    def policy_and_categories(ex: EvalExample):  # noqa: ANN202
        policy = checker.policies.for_org("")
        return policy, policy.active(ex.direction)

    def pattern(ex: EvalExample) -> bool:
        policy, categories = policy_and_categories(ex)
        verdict = checker.scan_patterns(policy, normalize(ex.text), categories)
        return verdict is not None and not verdict.allowed

    def classifier(ex: EvalExample) -> bool:
        policy, categories = policy_and_categories(ex)
        return not checker.classify(policy, ex.text, categories).allowed

    def combined(ex: EvalExample) -> bool:
        return not checker.check("", ex.text, ex.direction).allowed

    return {"pattern": pattern, "classifier": classifier, "combined": combined}


def score(detect: Callable[[EvalExample], bool], examples: Sequence[EvalExample]) -> Scores:
    return _count([(detect(ex), ex.harmful) for ex in examples])


def latency_us(detect: Callable[[EvalExample], bool], examples: Sequence[EvalExample], repeat: int
               ) -> tuple[float, float]:
    samples = []
    for _ in range(repeat):
        for ex in examples:
            start = time.perf_counter()
            detect(ex)
            samples.append(time.perf_counter() - start)
    p50, p99 = np.percentile(np.array(samples) * 1e6, [50, 99])
    return float(p50), float(p99)


def stream_latency_us(checker: SafetyChecker, examples: Sequence[EvalExample], repeat: int
                      ) -> tuple[float, float]:
    """p50/p99 of one `OutputStreamFilter.feed` over the safe eval outputs streamed in 4-char deltas
    (the pattern tier on every delta, the classifier every ~200 chars or sentence)."""
    text = " ".join(ex.text for ex in examples if ex.direction == Direction.OUTPUT and not ex.harmful)
    samples = []
    for _ in range(max(repeat, 1)):
        stream = OutputStreamFilter(checker, checker.policies.for_org(""))
        for i in range(0, len(text), 4):
            start = time.perf_counter()
            stream.feed(text[i:i + 4])
            samples.append(time.perf_counter() - start)
    p50, p99 = np.percentile(np.array(samples) * 1e6, [50, 99])
    return float(p50), float(p99)


def cross_validate(config: TrainingConfig, folds: int = 5, seed: int = 1) -> dict[str, Scores]:
    """k-fold CV on the training set at the default threshold: the classifier alone, and OR-ed with
    the pattern tier ("combined"). This, never the eval set, is what picked the training settings."""
    rows = load_labelled(DATA_DIR / "train.jsonl")
    patterns = PatternTier()
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    hits: dict[str, list[tuple[bool, bool]]] = {"classifier": [], "combined": []}
    for fold in range(folds):
        held = set(order[fold::folds])
        model = LinearClassifier.train([rows[i] for i in order if i not in held], config)
        for i in held:
            norm = normalize(rows[i].text)
            _, s = harm_score(model.predict(norm.words), LEARNED_CATEGORIES)
            harmful = rows[i].label != SAFE_LABEL
            hits["classifier"].append((s >= DEFAULT_THRESHOLD, harmful))
            pattern_hit = patterns.scan(norm, LEARNED_CATEGORIES) is not None
            hits["combined"].append((s >= DEFAULT_THRESHOLD or pattern_hit, harmful))
    return {tier: _count(h) for tier, h in hits.items()}


def _count(hits: Sequence[tuple[bool, bool]]) -> Scores:
    return Scores(tp=sum(p and y for p, y in hits), fp=sum(p and not y for p, y in hits),
                  fn=sum(y and not p for p, y in hits), tn=sum(not p and not y for p, y in hits))


def evaluate(examples: Sequence[EvalExample], repeat: int = 0) -> dict[str, dict[str, float]]:
    """{tier: {precision, recall, tp, fp, fn, tn[, p50_us, p99_us]}} on `examples`; with `repeat`,
    also {"stream_delta": {p50_us, p99_us}}."""
    checker = SafetyChecker(PolicyBook(), classifier=LinearClassifier.from_training_file())
    results: dict[str, dict[str, float]] = {}
    for tier, detect in tier_detectors(checker).items():
        s = score(detect, examples)
        results[tier] = {"precision": s.precision, "recall": s.recall, "tp": s.tp, "fp": s.fp, "fn": s.fn,
                         "tn": s.tn}
        if repeat:
            results[tier]["p50_us"], results[tier]["p99_us"] = latency_us(detect, examples, repeat)
    if repeat:
        p50, p99 = stream_latency_us(checker, examples, repeat)
        results["stream_delta"] = {"p50_us": p50, "p99_us": p99}
    return results


def _print_report(examples: Sequence[EvalExample], results: dict[str, dict[str, float]]) -> None:
    harmful = sum(ex.harmful for ex in examples)
    print(f"eval set: {len(examples)} texts ({harmful} harmful, {len(examples) - harmful} safe)")
    print(f"{'tier':<11}{'precision':>10}{'recall':>8}{'tp':>5}{'fp':>4}{'fn':>4}{'tn':>5}"
          f"{'p50 us':>9}{'p99 us':>9}")
    for tier in TIERS:
        r = results[tier]
        lat = f"{r['p50_us']:>9.1f}{r['p99_us']:>9.1f}" if "p50_us" in r else ""
        print(f"{tier:<11}{r['precision']:>10.3f}{r['recall']:>8.3f}{r['tp']:>5.0f}{r['fp']:>4.0f}"
              f"{r['fn']:>4.0f}{r['tn']:>5.0f}{lat}")
    if "stream_delta" in results:
        r = results["stream_delta"]
        print(f"output stream, per 4-char delta: p50 {r['p50_us']:.1f} us, p99 {r['p99_us']:.1f} us")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.safety.evaluate", description=__doc__)
    parser.add_argument("--eval", type=Path, default=EVAL_PATH, help="labelled JSONL eval set")
    parser.add_argument("--repeat", type=int, default=20, help="passes over the eval set for latency")
    parser.add_argument("--cv", action="store_true", help="also cross-validate the classifier on train")
    args = parser.parse_args(argv)
    examples = load_eval(args.eval)
    _print_report(examples, evaluate(examples, args.repeat))
    if args.cv:
        for tier, s in cross_validate(TrainingConfig()).items():
            print(f"5-fold CV on train, {tier:<10} (threshold {DEFAULT_THRESHOLD}): precision {s.precision:.3f} "
                  f"recall {s.recall:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
