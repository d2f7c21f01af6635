"""`python -m services.safety.train_head`: train the learned tier's head and pick its thresholds.

Deterministic: a fixed seed splits the training text (`classifier.TRAIN_FILES`) 80/20, stratified
by label; full-batch Adam on the 80% fits three small MLPs (seeds 0-2) over the (frozen) sentence
embeddings, "safe" weighted to carry half the total example weight so generic words never lean
harmful. On the held-out 20%, with harm score = 1 - p(safe):
* refuse_threshold: the lowest score (on a 0.01 grid, never under 0.5) at which at most
  `MAX_HELD_FPR` of held-out benign texts score as high (precision first: a benign prompt refused is
  a user failed);
* watch_threshold: the score that keeps `WATCH_RECALL` of held-out harmful texts at or above it
  (the uncertain band [watch, refuse) is served and logged, and its output is checked more often).
The evaluation set (`data/eval_gate.jsonl`) is never read here.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from services.safety.classifier import (
    HEAD_PATH,
    LABELS,
    EmbeddingHead,
    LabelledText,
    load_training_set,
    training_digest,
)
from services.safety.encoder import DIM, SentenceEncoder

SEED = 7
HELD_OUT = 0.2
MAX_HELD_FPR = 0.01
MIN_REFUSE = 0.5
WATCH_RECALL = 0.97


@dataclass(frozen=True)
class HeadConfig:
    members: int = 3      # MLPs averaged (seeds 0..members-1)
    hidden: int = 128
    steps: int = 800
    learning_rate: float = 0.01
    l2: float = 1e-3
    safe_weight_share: float = 0.5


def split(rows: Sequence[LabelledText], seed: int = SEED) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices), stratified by label."""
    rng = random.Random(seed)
    train, held = [], []
    for label in LABELS:
        idx = [i for i, r in enumerate(rows) if r.label == label]
        rng.shuffle(idx)
        cut = max(1, round(len(idx) * HELD_OUT))
        held += idx[:cut]
        train += idx[cut:]
    return sorted(train), sorted(held)


def _adam(params: dict[str, npt.NDArray[np.float64]], grads: dict[str, npt.NDArray[np.float64]],
          moments: dict[str, list[npt.NDArray[np.float64]]], step: int, lr: float) -> None:
    for name, grad in grads.items():
        m, v = moments.setdefault(name, [np.zeros_like(grad), np.zeros_like(grad)])
        m[:] = 0.9 * m + 0.1 * grad
        v[:] = 0.999 * v + 0.001 * grad**2
        params[name] -= lr * (m / (1 - 0.9**step)) / (np.sqrt(v / (1 - 0.999**step)) + 1e-8)


def fit_member(x: npt.NDArray[np.float32], y: npt.NDArray[np.int64], config: HeadConfig, seed: int
               ) -> dict[str, npt.NDArray[np.float64]]:
    """One MLP by full-batch Adam on a class-weighted cross-entropy; returns {w1, b1, w2, b2}."""
    k = len(LABELS)
    counts = np.bincount(y, minlength=k).astype(np.float64)
    class_weight = np.where(np.arange(k) == 0, config.safe_weight_share / counts[0],
                            (1 - config.safe_weight_share) / (k - 1) / np.maximum(counts, 1))
    sample_w = class_weight[y][:, None]
    onehot = np.eye(k)[y]
    rng = np.random.default_rng(seed)
    p = {"w1": rng.normal(0, DIM**-0.5, (DIM, config.hidden)), "b1": np.zeros(config.hidden),
         "w2": rng.normal(0, config.hidden**-0.5, (config.hidden, k)), "b2": np.zeros(k)}
    moments: dict[str, list[npt.NDArray[np.float64]]] = {}
    for step in range(1, config.steps + 1):
        hidden = np.maximum(x @ p["w1"] + p["b1"], 0.0)
        logits = hidden @ p["w2"] + p["b2"]
        logits -= logits.max(axis=1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=1, keepdims=True)
        d_logits = (probs - onehot) * sample_w
        d_hidden = (d_logits @ p["w2"].T) * (hidden > 0)
        grads = {"w2": hidden.T @ d_logits + config.l2 * p["w2"], "b2": d_logits.sum(0),
                 "w1": x.T @ d_hidden + config.l2 * p["w1"], "b1": d_hidden.sum(0)}
        _adam(p, grads, moments, step, config.learning_rate)
    return p


def fit(x: npt.NDArray[np.float32], y: npt.NDArray[np.int64], config: HeadConfig) -> EmbeddingHead:
    """The ensemble, with placeholder thresholds (1.0) until `thresholds` has run on held-out data."""
    members = [fit_member(x, y, config, seed) for seed in range(config.members)]
    stack = {k: np.stack([m[k] for m in members]).astype(np.float32) for k in ("w1", "b1", "w2", "b2")}
    return EmbeddingHead(stack["w1"], stack["b1"], stack["w2"], stack["b2"], 1.0, 1.0)


def thresholds(harm: npt.NDArray[np.float32], harmful: npt.NDArray[np.bool_]) -> tuple[float, float]:
    """(refuse, watch) from held-out harm scores; see the module docstring."""
    grid = np.round(np.arange(MIN_REFUSE, 1.0, 0.01), 2)
    refuse = next((float(t) for t in grid if (harm[~harmful] >= t).mean() <= MAX_HELD_FPR), 0.99)
    watch = float(np.quantile(harm[harmful], 1 - WATCH_RECALL))
    return refuse, min(max(round(watch, 2), 0.05), refuse)


def train(encoder: SentenceEncoder, config: HeadConfig | None = None) -> tuple[EmbeddingHead, dict[str, float]]:
    rows = load_training_set()
    x = encoder.embed([r.text for r in rows])
    y = np.array([LABELS.index(r.label) for r in rows])
    tr, held = split(rows)
    probe = fit(x[tr], y[tr], config or HeadConfig())
    harm = 1.0 - probe.probabilities(x[held])[:, 0]
    harmful = y[held] != 0
    refuse, watch = thresholds(harm, harmful)
    head = replace(probe, refuse_threshold=refuse, watch_threshold=watch, train_digest=training_digest())
    report = {"rows": len(rows), "held_out": len(held), "refuse": refuse, "watch": watch,
              "held_recall_at_refuse": float((harm[harmful] >= refuse).mean()),
              "held_fpr_at_refuse": float((harm[~harmful] >= refuse).mean()),
              "held_fpr_at_watch": float((harm[~harmful] >= watch).mean())}
    return head, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.safety.train_head", description=__doc__)
    parser.add_argument("--out", default=str(HEAD_PATH))
    args = parser.parse_args(argv)
    head, report = train(SentenceEncoder())
    head.save(args.out)
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in report.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
