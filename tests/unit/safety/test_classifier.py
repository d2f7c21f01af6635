"""The learned tier trains deterministically from the committed data, kept apart from the eval set."""

from __future__ import annotations

import numpy as np

from services.safety.categories import LEARNED_CATEGORIES, SAFE_LABEL, Category
from services.safety.classifier import DATA_DIR, LinearClassifier, TrainingConfig, harm_score, load_labelled
from services.safety.evaluate import load_eval
from services.safety.normalize import normalize


def test_training_is_deterministic() -> None:
    rows = load_labelled(DATA_DIR / "train.jsonl")[::4]
    a = LinearClassifier.train(rows, TrainingConfig(epochs=20))
    b = LinearClassifier.train(rows, TrainingConfig(epochs=20))
    assert np.array_equal(a._weights, b._weights)


def test_train_and_eval_share_no_text() -> None:
    train = {normalize(r.text).words for r in load_labelled(DATA_DIR / "train.jsonl")}
    assert not [e.text for e in load_eval() if normalize(e.text).words in train]


def test_training_set_covers_every_learned_category_with_hundreds_of_examples() -> None:
    labels = [r.label for r in load_labelled(DATA_DIR / "train.jsonl")]
    assert len(labels) >= 300 and {SAFE_LABEL, *LEARNED_CATEGORIES} == set(labels)


def test_harm_score_sums_the_enabled_categories_only() -> None:
    probs = {Category.VIOLENCE: 0.3, Category.HATE: 0.25, Category.MALWARE: 0.05}
    assert harm_score(probs, [Category.VIOLENCE, Category.HATE]) == (Category.VIOLENCE, 0.55)
    assert harm_score(probs, [Category.MALWARE])[1] == 0.05
    assert harm_score(probs, []) == (None, 0.0)


def test_predictions_are_probabilities(classifier: LinearClassifier) -> None:
    probs = classifier.predict(normalize("what's a good recipe for banana bread").words)
    assert set(probs) == set(LEARNED_CATEGORIES) and 0.0 <= sum(probs.values()) <= 1.0
