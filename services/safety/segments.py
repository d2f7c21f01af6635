"""Cutting a long text into the sentence-sized pieces the classifier tier scores one by one.

Why: the classifier is trained on sentence-length texts and the encoder mean-pools over tokens, so a
harmful sentence inside a long benign text is diluted. Scoring each sentence and keeping the worst
restores it; the pieces of one text are embedded in one batch. Sentences shorter than `min_chars`
are joined to the next ("Sure. Here's how: ..."), and a run-on longer than `max_chars` is cut into
overlapping windows at spaces.
"""

from __future__ import annotations

import re

_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\n+")
MIN_CHARS = 40
# A run-on without sentence ends is cut into windows of ~150 tokens (the encoder reads up to 256)
# overlapping by 100 characters: wider windows than a sentence keep the encoder's cost near one pass
# over the text (it is ~0.4 ms a token on one core, the overlap paid twice).
MAX_CHARS = 600
_STEP = 500


def _windows(sentence: str, max_chars: int, step: int) -> list[str]:
    out, start = [], 0
    while True:
        end = start + max_chars
        if end >= len(sentence):
            out.append(sentence[start:])
            return out
        cut = sentence.rfind(" ", start + step, end)
        out.append(sentence[start:end if cut < 0 else cut])
        nxt = sentence.find(" ", start + step, end)
        start = start + step if nxt < 0 else nxt + 1


def segments(text: str, min_chars: int = MIN_CHARS, max_chars: int = MAX_CHARS) -> list[str]:
    """Sentence-sized pieces of `text` covering all of it (one piece when it is short)."""
    if len(text) <= max_chars and "\n" not in text and len(text) < 2 * min_chars:
        return [text]
    pieces: list[str] = []
    pending = ""
    for sentence in _SENTENCE_BREAK.split(text):
        pending = f"{pending} {sentence}" if pending else sentence
        if len(pending) >= min_chars:
            pieces.extend(_windows(pending, max_chars, _STEP) if len(pending) > max_chars else [pending])
            pending = ""
    if pending.strip():
        if pieces and len(pieces[-1]) + len(pending) <= max_chars:
            pieces[-1] = f"{pieces[-1]} {pending}"
        else:
            pieces.append(pending)
    return pieces or [text]
