"""`TierLoadQueue`: admitted sequences waiting in LOADING_KV while a lower KV tier copies their prefix
blocks up (engine/kv_tiers). The batcher's side of the `KVLoader` protocol: a sequence enters right
after its blocks were allocated, is polled once per step, and leaves when its load is done (or is
cancelled by an abort, which returns only once no copy writes into its blocks)."""

from __future__ import annotations

from engine.kv_tiers.types import KVLoader, LoadState
from engine.sequence import Sequence, SequenceStatus


class TierLoadQueue:
    """Not thread-safe. Without a loader (the GPU pool is the only tier) no sequence ever waits here."""

    def __init__(self, loader: KVLoader | None) -> None:
        self._loader = loader
        self._waiting: dict[str, Sequence] = {}  # request_id -> LOADING_KV sequence, holding its blocks

    def __len__(self) -> int:
        return len(self._waiting)

    def start(self, seq: Sequence) -> bool:
        """Start promoting seq's prefix blocks found in a lower tier; True when seq now waits for them."""
        if self._loader is None:
            return False
        if not self._loader.start_load(seq.request_id, seq.all_token_ids, seq.block_ids, seq.num_computed_tokens):
            return False
        seq.status = SequenceStatus.LOADING_KV
        self._waiting[seq.request_id] = seq
        return True

    def cancel(self, request_id: str) -> None:
        """Stop a waiting sequence's load; returns once no copy writes into its blocks any more."""
        assert self._loader is not None
        self._loader.cancel(request_id)
        del self._waiting[request_id]

    def finished(self) -> list[tuple[Sequence, int]]:
        """The sequences whose load ended since the last call, each with the tokens that landed."""
        done: list[tuple[Sequence, int]] = []
        for request_id, seq in list(self._waiting.items()):
            assert self._loader is not None
            result = self._loader.poll(request_id)
            if result.state is LoadState.PENDING:
                continue
            del self._waiting[request_id]
            done.append((seq, result.num_loaded_tokens))
        return done
