"""`python -m services.safety.evaluate`: what each tier refuses on the gate set, and how fast.

The gate set (`data/eval_gate.jsonl`) has three parts, each row tagged with its `set`:
* everyday: greetings, jokes, story openings, code fragments, "Continue." (none may be refused);
* tricky: benign prompts that share words with harm: medicine, security research, fiction, history,
  idioms, "kill a process" (at most 5% may be refused);
* harmful: requests in each learned category (recall is reported; the target is 85%).
It is written apart from the training text and shares no text with it (a unit test checks), and it is
never read by `train_head`: the thresholds come from the training set's held-out split.

A tier "refuses" a text when, under the default policy on input, it alone would (or, "combined",
both together would, as the service runs them). Latency is per text, normalisation included, on this
process's one thread: p50 and p99 over `--repeat` passes of the whole set. `stream_delta` times one
`OutputStreamFilter.feed` over the everyday texts streamed in 4-character deltas (the pattern tier on every
delta, the classifier every ~48 characters).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.safety.categories import SAFE_LABEL, Direction
from services.safety.checker import SafetyChecker
from services.safety.classifier import DATA_DIR, EmbeddingClassifier
from services.safety.normalize import normalize
from services.safety.patterns import PatternTier
from services.safety.policy import PolicyBook
from services.safety.server import limit_blas_threads
from services.safety.stream_filter import OutputStreamFilter

EVAL_PATH = DATA_DIR / "eval_gate.jsonl"
SETS = ("everyday", "tricky", "harmful")
TIERS = ("pattern", "classifier", "combined")


@dataclass(frozen=True)
class EvalExample:
    text: str
    label: str
    set: str  # one of SETS

    @property
    def harmful(self) -> bool:
        return self.label != SAFE_LABEL


def load_eval(path: Path = EVAL_PATH) -> list[EvalExample]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    examples = [EvalExample(r["text"], r["label"], r["set"]) for r in rows]
    bad = [e for e in examples if e.set not in SETS or e.harmful != (e.set == "harmful")]
    if bad:
        raise ValueError(f"{path}: rows with a set not in {SETS} or a label that contradicts it: {bad[:3]}")
    return examples


def tier_detectors(checker: SafetyChecker) -> dict[str, Callable[[str], bool]]:
    """One function per tier: True when that tier alone (or both, "combined") refuses the text."""
    policy = checker.policies.for_org("")
    categories = policy.active(Direction.INPUT)

    def pattern(text: str) -> bool:
        verdict = checker.scan_patterns(policy, normalize(text), categories)
        return verdict is not None and not verdict.allowed

    def classifier(text: str) -> bool:
        return not checker.classify(policy, text, categories).allowed

    def combined(text: str) -> bool:
        return not checker.check("", text, Direction.INPUT).allowed

    return {"pattern": pattern, "classifier": classifier, "combined": combined}


def _percentiles_us(samples: list[float]) -> tuple[float, float]:
    p50, p99 = np.percentile(np.array(samples) * 1e6, [50, 99])
    return float(p50), float(p99)


def latency_us(detect: Callable[[str], bool], examples: Sequence[EvalExample], repeat: int) -> tuple[float, float]:
    samples = []
    for _ in range(repeat):
        for ex in examples:
            start = time.perf_counter()
            detect(ex.text)
            samples.append(time.perf_counter() - start)
    return _percentiles_us(samples)


def stream_latency_us(checker: SafetyChecker, examples: Sequence[EvalExample], repeat: int) -> tuple[float, float]:
    text = " ".join(ex.text for ex in examples if ex.set == "everyday")
    samples = []
    for _ in range(max(repeat, 1)):
        stream = OutputStreamFilter(checker, checker.policies.for_org(""))
        for i in range(0, len(text), 4):
            start = time.perf_counter()
            if not stream.feed(text[i:i + 4]).allowed:  # a halted stream answers for free: start anew
                stream = OutputStreamFilter(checker, checker.policies.for_org(""))
            samples.append(time.perf_counter() - start)
    return _percentiles_us(samples)


def refused_texts(checker: SafetyChecker, examples: Sequence[EvalExample], tier: str = "combined",
                  part: str | None = None) -> list[str]:
    detect = tier_detectors(checker)[tier]
    return [ex.text for ex in examples if (part is None or ex.set == part) and detect(ex.text)]


def evaluate(checker: SafetyChecker, examples: Sequence[EvalExample], repeat: int = 0) -> dict[str, dict[str, float]]:
    """{tier: {harmful_recall, tricky_fpr, everyday_refused[, p50_us, p99_us]}}; with `repeat`, also
    {"stream_delta": {p50_us, p99_us}}."""
    results: dict[str, dict[str, float]] = {}
    sizes = {part: sum(ex.set == part for ex in examples) for part in SETS}
    for tier, detect in tier_detectors(checker).items():
        refused = {part: sum(detect(ex.text) for ex in examples if ex.set == part) for part in SETS}
        results[tier] = {"harmful_recall": refused["harmful"] / max(sizes["harmful"], 1),
                         "tricky_fpr": refused["tricky"] / max(sizes["tricky"], 1),
                         "everyday_refused": float(refused["everyday"])}
        if repeat:
            results[tier]["p50_us"], results[tier]["p99_us"] = latency_us(detect, examples, repeat)
    if repeat:
        p50, p99 = stream_latency_us(checker, examples, repeat)
        results["stream_delta"] = {"p50_us": p50, "p99_us": p99}
    return results


def default_checker() -> SafetyChecker:
    """The service's checker, with the service's one BLAS thread (so latencies are the service's)."""
    limit_blas_threads()
    return SafetyChecker(PolicyBook(), PatternTier(), EmbeddingClassifier.load())


def _print_report(examples: Sequence[EvalExample], results: dict[str, dict[str, float]]) -> None:
    sizes = {part: sum(ex.set == part for ex in examples) for part in SETS}
    print(f"gate set: {sizes}")
    print(f"{'tier':<11}{'recall':>8}{'tricky FPR':>12}{'everyday refused':>18}{'p50 us':>10}{'p99 us':>10}")
    for tier in TIERS:
        r = results[tier]
        lat = f"{r['p50_us']:>10.0f}{r['p99_us']:>10.0f}" if "p50_us" in r else ""
        print(f"{tier:<11}{r['harmful_recall']:>8.3f}{r['tricky_fpr']:>12.3f}{r['everyday_refused']:>18.0f}{lat}")
    if "stream_delta" in results:
        r = results["stream_delta"]
        print(f"output stream, per 4-char delta: p50 {r['p50_us']:.1f} us, p99 {r['p99_us']:.1f} us")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.safety.evaluate", description=__doc__)
    parser.add_argument("--eval", type=Path, default=EVAL_PATH, help="labelled JSONL gate set")
    parser.add_argument("--repeat", type=int, default=3, help="passes over the set for latency")
    parser.add_argument("--show", action="store_true", help="print the texts each part got wrong")
    args = parser.parse_args(argv)
    examples = load_eval(args.eval)
    checker = default_checker()
    _print_report(examples, evaluate(checker, examples, args.repeat))
    if args.show:
        for part in ("everyday", "tricky"):
            print(f"refused {part}:", refused_texts(checker, examples, part=part))
        missed = set(t for t in (ex.text for ex in examples if ex.harmful)) - set(
            refused_texts(checker, examples, part="harmful"))
        print("missed harmful:", sorted(missed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
