"""The committed eval set is large and balanced enough, and both tiers together clear 0.8/0.8 on it."""

from __future__ import annotations

from collections import Counter

from services.safety.classifier import DATA_DIR
from services.safety.evaluate import evaluate, load_eval


def test_eval_set_is_balanced_and_covers_every_category() -> None:
    examples = load_eval()
    labels = Counter(e.label for e in examples)
    harmful = sum(e.harmful for e in examples)
    assert len(examples) >= 150 and abs(harmful - (len(examples) - harmful)) <= len(examples) // 10
    assert {"violence", "self_harm", "sexual_minors", "hate", "malware", "pii"} <= set(labels)


def test_combined_tiers_reach_precision_and_recall_of_0_8() -> None:
    combined = evaluate(load_eval())["combined"]
    assert combined["precision"] >= 0.8 and combined["recall"] >= 0.8, combined


def test_committed_data_stays_under_a_megabyte() -> None:
    assert sum(p.stat().st_size for p in DATA_DIR.iterdir()) < 1_000_000
