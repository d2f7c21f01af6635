"""How long a text the safety service judges, how long a caller waits for it, and the size buckets
its latency is reported by. Shared by the service, its client and the gateway, so all three agree.

`MAX_INPUT_CHARS` (64,000 characters, ~10,000 English words, ~13,000 encoder tokens) is above the
context window of the default model (SmolLM2-135M, 8,192 tokens), so a chat prompt the model can
read is never refused for its length by safety; a longer text (a `/v1/moderations` input, or a
model with a longer window) is a 400 before any GPU work, never a time-out. The bound exists because
judging costs CPU in proportion to length (~0.1-0.7 ms a token on one core: docs/benchmarks.md).

The client's deadline scales with the text (`SafetyClientConfig.deadline_s`: a base plus a second per
1,000 characters). A service that is down fails at once (UNAVAILABLE), whatever the deadline; the deadline only bounds
how long a slow service is waited for, and it must cover the worst CPU contention a healthy service
sees (a 5,000-word prompt took 18 s on the loaded 2-core CI machine), or a healthy but busy service
reads as an outage.
"""

from __future__ import annotations

MAX_INPUT_CHARS = 64_000
# A text longer than this is judged on the service's bulk thread, so short checks never queue behind it.
LONG_TEXT_CHARS = 2_000
# Upper bounds (in characters) of the size buckets of the latency metrics: English prose averages
# 6.4 characters a word, spaces included (5,000 ShareGPT words are 32,381 characters).
SIZE_BUCKETS: tuple[tuple[int, str], ...] = (
    (720, "le_100_words"), (7_200, "le_1k_words"), (36_000, "le_5k_words"), (MAX_INPUT_CHARS, "le_max"))
# Latency histogram buckets: milliseconds (short texts) to a minute (the longest text on a busy machine).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class InputTooLongError(ValueError):
    """A text longer than `MAX_INPUT_CHARS`: refused before any work, as bad input (400)."""

    def __init__(self, chars: int, limit: int = MAX_INPUT_CHARS) -> None:
        super().__init__(f"the text has {chars} characters; the safety check judges at most {limit} "
                         "(about 10,000 words): shorten it")
        self.chars = chars
        self.limit = limit


def check_length(text: str, limit: int = MAX_INPUT_CHARS) -> None:
    """Raise InputTooLongError when `text` is too long to judge."""
    if len(text) > limit:
        raise InputTooLongError(len(text), limit)


def size_bucket(chars: int) -> str:
    """The metrics label of a text of `chars` characters."""
    return next((label for bound, label in SIZE_BUCKETS if chars <= bound), "over_max")
