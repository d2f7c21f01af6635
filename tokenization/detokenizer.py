"""Incremental detokenization with stop strings: token ids in, safe-to-show text deltas out.

Two things make "decode the new token" wrong:

1. A token is not a unit of text. Byte-level BPE splits one emoji or CJK character over several
   tokens, and decoding a prefix of its bytes yields U+FFFD. SentencePiece decodes a token
   differently depending on its left neighbour (the leading-space rule). So, like vLLM and TGI, we
   decode a small window: `prefix_offset..read_offset` is text already emitted (context), and
   `prefix_offset..end` is that plus the new tokens. The delta is the difference, emitted only once
   it no longer ends in U+FFFD (an incomplete character); until then the tokens wait.

2. A stop string may arrive split across deltas ("<|" then "end|>"). Emitted text can't be taken
   back, so the longest suffix of the text that could still grow into a stop string is held back.
   When a stop string completes, `stopped` turns True, the text is cut before the match and
   nothing of the stop string is ever emitted. `flush()` at finish releases what was held back.

Decoding cost per token is bounded by the window and the stop strings, not by the output length.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenization.tokenizer import Tokenizer

INCOMPLETE_CHAR = "\ufffd"
# How many prompt tokens seed the decode window; enough context for SentencePiece's space rule.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas. One per request; not thread-safe."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])  # only the window's context is needed
        self._prefix_offset = 0  # start of the decode window (already-emitted context)
        self._read_offset = len(self._ids)  # tokens before this are part of `_text`
        self._text = ""  # all decoded output text (stop-truncated once stopped)
        self._emitted = 0  # characters of `_text` already returned
        self.output_token_ids: list[int] = []
        self.stopped = False  # a stop string was found; later tokens are ignored
        self.stop_reason: str | None = None  # the stop string that matched

    @property
    def text(self) -> str:
        """All output text so far, held-back part included; cut before the stop string once stopped."""
        return self._text

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the new text that is safe to show (often "")."""
        if self.stopped:
            return ""
        self.output_token_ids.append(token_id)
        self._ids.append(token_id)
        return self._accept(self._decode_delta(final=False))

    def flush(self) -> str:
        """At finish: return everything not yet emitted (an incomplete character decodes as U+FFFD)."""
        out = "" if self.stopped else self._accept(self._decode_delta(final=True))
        out += self._text[self._emitted:]  # the held-back partial stop string, now known not to complete
        self._emitted = len(self._text)
        return out

    def _decode_delta(self, final: bool) -> str:
        def decode(ids: list[int]) -> str:
            return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

        prefix = decode(self._ids[self._prefix_offset:self._read_offset])
        full = decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith(INCOMPLETE_CHAR) and not final):
            return ""  # nothing new, or a character still incomplete: wait for more tokens
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix):]

    def _accept(self, delta: str) -> str:
        """Append `delta`, apply stop strings, and return what may be emitted now."""
        if not delta:
            return ""
        start = len(self._text)
        self._text += delta
        if self._stop:
            match = self._find_stop(start)
            if match is not None:
                self._text = self._text[:match]
                self.stopped = True
            safe_end = len(self._text) if self.stopped else len(self._text) - self._partial_stop_len()
        else:
            safe_end = len(self._text)
        out = self._text[self._emitted:safe_end]
        self._emitted = max(self._emitted, safe_end)
        return out

    def _find_stop(self, new_start: int) -> int | None:
        """Earliest index where a stop string occurs in text that includes new characters."""
        best: int | None = None
        for s in self._stop:
            idx = self._text.find(s, max(0, new_start - len(s) + 1))
            if idx != -1 and (best is None or idx < best):
                best, self.stop_reason = idx, s
        return best

    def _partial_stop_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._text)), longest, -1):
                if self._text.endswith(s[:k]):
                    longest = k
                    break
        return longest
