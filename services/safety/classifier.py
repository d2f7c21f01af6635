"""`EmbeddingClassifier`: the learned tier, a softmax head over all-MiniLM-L6-v2 sentence embeddings.

It replaced a hashed word/character n-gram model that refused "Hi", "Tell me a joke" and
"def fibonacci(n):": with ~700 hand-written rows, n-grams of short texts carried no meaning, so
short meant harmful. Embeddings of a maintained sentence encoder (`encoder.SentenceEncoder`) put
everyday requests near each other whatever their words, and harmful requests near their paraphrases.

The head (`EmbeddingHead`) is an average of three one-hidden-layer MLPs over the embedding, with a
softmax over "safe" + the five learned categories (~300 KB in `data/head.npz`). A linear head was
tried first: at 1% held-out benign FPR it was within a few points of this one, so either would do;
the ensemble was kept because averaging seeds steadies the scores the thresholds are set on.
`python -m services.safety.train_head` rebuilds it from the committed training text (`TRAIN_FILES`):
it holds out a stratified 20% split, trains on the rest, and picks the two thresholds on the held-out
split (see `train_head`); the file records the SHA-256 of the training text so a test can tell when
the head is stale.

Scores: `predict` returns p(category | text) per learned category. `harm_score` sums the
probabilities of the categories a policy enables and attributes them to the likeliest: a text
between two categories (a threat that is also hateful) keeps its mass.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from services.common.lru import BoundedLru
from services.safety.batcher import EncoderBatching
from services.safety.categories import LEARNED_CATEGORIES, SAFE_LABEL, Category
from services.safety.encoder import DIM, EncoderRuntime, SentenceEncoder

DATA_DIR = Path(__file__).resolve().parent / "data"
HEAD_PATH = DATA_DIR / "head.npz"
TRAIN_FILES: tuple[Path, ...] = (DATA_DIR / "train.jsonl", DATA_DIR / "train_benign.jsonl",
                                 DATA_DIR / "train_packaged.jsonl")
LABELS: tuple[str, ...] = (SAFE_LABEL, *LEARNED_CATEGORIES)


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


def load_training_set(paths: Sequence[Path] = TRAIN_FILES) -> list[LabelledText]:
    return [row for path in paths for row in load_labelled(path)]


def training_digest(paths: Sequence[Path] = TRAIN_FILES) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class EmbeddingHead:
    """An ensemble of small MLPs (384 -> hidden -> ReLU -> 6, softmax), averaged, plus the thresholds
    chosen on the held-out split. Stored as float16 (~300 KB), computed in float32.

    refuse_threshold: the harm score at or above which a text is refused (the policy default).
    watch_threshold: the start of the uncertain band [watch, refuse): served, logged, and its output
    checked more often.
    """

    w1: npt.NDArray[np.float32]  # [members, 384, hidden]
    b1: npt.NDArray[np.float32]  # [members, hidden]
    w2: npt.NDArray[np.float32]  # [members, hidden, len(LABELS)]
    b2: npt.NDArray[np.float32]  # [members, len(LABELS)]
    refuse_threshold: float
    watch_threshold: float
    train_digest: str = ""

    def __post_init__(self) -> None:
        assert self.w1.shape[1] == DIM and self.w2.shape[2] == len(LABELS), (self.w1.shape, self.w2.shape)
        if not 0.0 < self.watch_threshold <= self.refuse_threshold <= 1.0:
            raise ValueError(f"thresholds must satisfy 0 < watch <= refuse <= 1: {self.watch_threshold}, "
                             f"{self.refuse_threshold}")

    def probabilities(self, embeddings: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """[n, len(LABELS)]: the members' softmax probabilities, averaged."""
        hidden = np.maximum(np.einsum("nd,mdh->mnh", embeddings, self.w1) + self.b1[:, None, :], 0.0)
        logits = np.einsum("mnh,mhk->mnk", hidden, self.w2) + self.b2[:, None, :]
        logits -= logits.max(axis=2, keepdims=True)
        e = np.exp(logits)
        return (e / e.sum(axis=2, keepdims=True)).mean(axis=0).astype(np.float32)

    def save(self, path: Path = HEAD_PATH) -> None:
        np.savez_compressed(path, w1=self.w1.astype(np.float16), b1=self.b1.astype(np.float16),
                            w2=self.w2.astype(np.float16), b2=self.b2.astype(np.float16),
                            refuse_threshold=self.refuse_threshold, watch_threshold=self.watch_threshold,
                            train_digest=self.train_digest, labels=np.array(LABELS))

    @classmethod
    def load(cls, path: Path = HEAD_PATH) -> EmbeddingHead:
        with np.load(path) as f:
            if tuple(str(x) for x in f["labels"]) != LABELS:
                raise ValueError(f"{path} was trained for labels {list(f['labels'])}, expected {list(LABELS)}")
            w1, b1, w2, b2 = (f[k].astype(np.float32) for k in ("w1", "b1", "w2", "b2"))
            return cls(w1, b1, w2, b2, float(f["refuse_threshold"]), float(f["watch_threshold"]),
                       str(f["train_digest"]))


class SegmentCache:
    """LRU of class probabilities by SHA-256 of a segment's text (~150 bytes an entry); thread-safe.

    Why: the gateway checks a request's new messages one by one and also joined (a harm split across
    messages), and the joined text's segments are those of its messages again, so without this a
    5,000-word prompt sent with a system prompt was judged twice. Probabilities depend on the text
    alone (policies apply after), so entries are shared by every organisation.
    """

    def __init__(self, max_entries: int = 50_000) -> None:
        self._rows: BoundedLru[bytes, npt.NDArray[np.float32]] = BoundedLru(max_entries)

    @staticmethod
    def key(text: str) -> bytes:
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()

    def get(self, key: bytes) -> npt.NDArray[np.float32] | None:
        return self._rows.get(key)

    def put(self, key: bytes, row: npt.NDArray[np.float32]) -> None:
        self._rows.put(key, row)

    def __len__(self) -> int:
        return len(self._rows)


class EmbeddingClassifier:
    """Thread-safe (read-only state, a locked cache); `predict_many` batches texts through one encoder pass."""

    def __init__(self, encoder: SentenceEncoder, head: EmbeddingHead, cache: SegmentCache | None = None,
                 batching: EncoderBatching | None = None) -> None:
        """`batching`: embed through cross-request batchers (the service) rather than one call per text."""
        self.encoder = encoder
        self.head = head
        self.cache = cache if cache is not None else SegmentCache()
        self.batching = batching
        self._embed = batching.embed if batching is not None else encoder.embed

    @classmethod
    def load(cls, head_path: Path = HEAD_PATH, encoder_threads: int = 2,
             runtime: EncoderRuntime = EncoderRuntime.ONNX, device: str = "cuda") -> EmbeddingClassifier:
        return cls(SentenceEncoder(threads=encoder_threads, runtime=runtime, device=device),
                   EmbeddingHead.load(head_path))

    @property
    def refuse_threshold(self) -> float:
        return self.head.refuse_threshold

    @property
    def watch_threshold(self) -> float:
        return self.head.watch_threshold

    def predict_many(self, texts: Sequence[str]) -> list[dict[Category, float]]:
        """p(category | text) for each learned category, one dict per text; texts seen before (in
        `cache`) cost a lookup, the others one batched encoder pass."""
        keys = [SegmentCache.key(t) for t in texts]
        known: dict[bytes, npt.NDArray[np.float32]] = {}
        for key in keys:
            row = self.cache.get(key)
            if row is not None:
                known[key] = row
        missing = {key: text for key, text in zip(keys, texts, strict=True) if key not in known}  # deduplicated
        if missing:
            computed = self.head.probabilities(self._embed(list(missing.values())))
            for key, row in zip(missing, computed, strict=True):
                known[key] = row
                self.cache.put(key, row)
        return [{c: float(p) for c, p in zip(LEARNED_CATEGORIES, known[key][1:], strict=True)} for key in keys]

    def predict(self, text: str) -> dict[Category, float]:
        return self.predict_many([text])[0]


def harm_score(probs: dict[Category, float], enabled: Iterable[Category]) -> tuple[Category | None, float]:
    """(likeliest enabled category, total probability of the enabled categories)."""
    scored = [(probs[c], c) for c in enabled if c in probs]
    if not scored:
        return None, 0.0
    return max(scored)[1], sum(p for p, _ in scored)
