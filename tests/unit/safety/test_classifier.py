"""The learned tier: the numpy encoder reproduces MiniLM, the head is current, and training text
stays apart from the gate set."""

from __future__ import annotations

import numpy as np
import pytest

from services.safety.categories import LEARNED_CATEGORIES, SAFE_LABEL, Category
from services.safety.classifier import (
    EmbeddingClassifier,
    EmbeddingHead,
    harm_score,
    load_training_set,
    training_digest,
)
from services.safety.evaluate import load_eval
from services.safety.normalize import normalize
from services.safety.train_head import thresholds

# First 4 dims of the sentence embedding of "Hello world", from the reference (transformers BertModel +
# mean pooling + L2 normalisation) on the same safetensors file.
HELLO_WORLD_PREFIX = np.array([-0.03448, 0.03102, 0.00673, 0.02611], dtype=np.float32)


def test_numpy_encoder_matches_the_reference_embedding(classifier: EmbeddingClassifier) -> None:
    e = classifier.encoder.embed(["Hello world"])[0]
    assert np.allclose(e[:4], HELLO_WORLD_PREFIX, atol=1e-4) and abs(float(np.linalg.norm(e)) - 1) < 1e-5


def test_paraphrases_embed_closer_than_unrelated_text(classifier: EmbeddingClassifier) -> None:
    a, b, c = classifier.encoder.embed(["A man is eating food.", "A man is eating a piece of bread.",
                                        "The stock market fell sharply today."])
    assert float(a @ b) > 0.6 > float(a @ c)


def test_batching_does_not_change_an_embedding(classifier: EmbeddingClassifier) -> None:
    alone = classifier.encoder.embed(["Tell me a joke"])[0]
    batched = classifier.encoder.embed(["Tell me a joke", "a much longer text " * 20])[0]
    assert np.allclose(alone, batched, atol=1e-5)


def test_committed_head_was_trained_on_the_committed_text(classifier: EmbeddingClassifier) -> None:
    assert classifier.head.train_digest == training_digest(), \
        "training text changed: run `python -m services.safety.train_head`"


def test_train_and_gate_set_share_no_text() -> None:
    train = {normalize(r.text).words for r in load_training_set()}
    assert not [e.text for e in load_eval() if normalize(e.text).words in train]


def test_training_set_covers_every_learned_category() -> None:
    labels = [r.label for r in load_training_set()]
    assert len(labels) >= 1500 and {SAFE_LABEL, *LEARNED_CATEGORIES} == set(labels)


def test_harm_score_sums_the_enabled_categories_only() -> None:
    probs = {Category.VIOLENCE: 0.3, Category.HATE: 0.25, Category.MALWARE: 0.05}
    assert harm_score(probs, [Category.VIOLENCE, Category.HATE]) == (Category.VIOLENCE, 0.55)
    assert harm_score(probs, [Category.MALWARE])[1] == 0.05
    assert harm_score(probs, []) == (None, 0.0)


def test_predictions_are_probabilities(classifier: EmbeddingClassifier) -> None:
    probs = classifier.predict("what's a good recipe for banana bread")
    assert set(probs) == set(LEARNED_CATEGORIES) and 0.0 <= sum(probs.values()) <= 1.0


def test_thresholds_keep_held_out_false_positives_at_one_percent() -> None:
    benign = np.linspace(0.0, 0.9, 200, dtype=np.float32)  # two benign texts score >= 0.892
    harm = np.concatenate([benign, np.full(50, 0.95, dtype=np.float32)])
    refuse, watch = thresholds(harm, np.arange(250) >= 200)
    assert (benign >= refuse).mean() <= 0.01 and refuse == pytest.approx(0.9, abs=0.011) and watch <= refuse


def test_head_rejects_inverted_thresholds(classifier: EmbeddingClassifier) -> None:
    h = classifier.head
    with pytest.raises(ValueError, match="watch <= refuse"):
        EmbeddingHead(h.w1, h.b1, h.w2, h.b2, refuse_threshold=0.3, watch_threshold=0.5)
