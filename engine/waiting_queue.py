"""The admission order of sequences not yet running: preempted ones first (most recently preempted at
the head), then new ones by `sampling.priority` (lower first, FIFO within one priority). Strict: a
stream of high-priority work can hold lower work back."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from engine.sequence import Sequence, SequenceStatus


class WaitingQueue:
    """WAITING and PREEMPTED sequences in the order the batcher admits them. Not thread-safe."""

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)

    def push_new(self, seq: Sequence) -> None:
        """Behind every preempted sequence and every new one of the same or a lower priority value."""
        i = len(self._queue)
        while i and self._queue[i - 1].status is SequenceStatus.WAITING \
                and self._queue[i - 1].sampling.priority > seq.sampling.priority:
            i -= 1
        self._queue.insert(i, seq)

    def push_preempted(self, seq: Sequence) -> None:
        """At the head: a preempted sequence resumes before anything queued after it was admitted."""
        self._queue.appendleft(seq)

    def head(self) -> Sequence:
        return self._queue[0]

    def pop_head(self) -> Sequence:
        return self._queue.popleft()

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)
