"""Token bitmasks for constrained rows, computed on the host while the forward pass runs.

`GrammarCompiler` wraps the model's tokenizer for llguidance (built once per engine, ~1 s).
`GrammarCompiler.start(chunks)` returns a `MaskJob`: on a single background thread it brings each
constrained sequence's matcher up to date with its output tokens (so the grammar advances with every
accepted token) and writes the next-token mask into one int32 bitmask row per sampled row
(`[N, ceil(V / 32)]`, bit j of word w allows token 32 * w + j). llguidance releases the GIL while it
computes, so the model's forward pass (on the engine thread) and the mask run at the same time; the
sampler waits for the job only after the logits exist.

`apply_token_bitmask` moves the mask to the logits' device (pinned, non-blocking on CUDA) and sets the
disallowed logits to -inf there, as plain tensor ops (no compile step, the same code on CPU and CUDA).

A matcher that has finished its grammar, or that failed (it never should: the mask only lets grammar
tokens through), allows only the end-of-sequence tokens, so the request stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.structured.constraint import GuidedDecoding

if TYPE_CHECKING:
    from engine.batch import ScheduledChunk
    from tokenization.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class SequenceGrammar:
    """One sequence's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.consumed = 0

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Consume the tokens accepted since the last step (or roll back if the sequence shrank)."""
        if len(output_token_ids) < self.consumed:
            self.matcher.rollback(self.consumed - len(output_token_ids))
            self.consumed = len(output_token_ids)
        new = list(output_token_ids[self.consumed:])
        if new:
            self.matcher.consume_tokens(new)
            self.consumed = len(output_token_ids)


class GrammarCompiler:
    """The tokenizer side of llguidance for one model, and the thread masks are computed on."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._source = tokenizer
        self._tokenizer: Any = None  # built on first use: ~1 s, and most engines never see a constraint
        self.words = (tokenizer.vocab_size + 31) // 32  # int32 words per mask row
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                src = self._source
                self._tokenizer = llguidance.LLTokenizer(src.backend_json(), n_vocab=src.vocab_size,
                                                         eos_token=list(src.eos_token_ids) or None)
            return self._tokenizer

    def state_for(self, guided: GuidedDecoding, request_id: str) -> SequenceGrammar:
        with guided.lock:
            state = guided.states.get(request_id)
            if state is None:
                import llguidance

                matcher = llguidance.LLMatcher(self.tokenizer, guided.grammar, log_level=0)
                state = guided.states[request_id] = SequenceGrammar(matcher)
            return state  # type: ignore[no-any-return]

    def start(self, chunks: Sequence[ScheduledChunk]) -> MaskJob | None:
        """The masks of `chunks` (the step's sampling rows), computing in the background; None if no
        row is constrained."""
        if not any(c.sampling.guided is not None for c in chunks):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        return MaskJob(self._pool.submit(self.compute, list(chunks)))

    def compute(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """[N, words] int32 on the host; -1 (every token allowed) on unconstrained rows."""
        mask = torch.full((len(chunks), self.words), -1, dtype=torch.int32)
        row_bytes = self.words * 4
        for i, chunk in enumerate(chunks):
            guided = chunk.sampling.guided
            if guided is None:
                continue
            state = self.state_for(guided, chunk.request_id)
            state.sync(chunk.output_token_ids)
            if state.matcher.is_error():
                log.warning("grammar of %s failed: %s", chunk.request_id, state.matcher.get_error())
            state.matcher.unsafe_compute_mask_ptr(mask[i].data_ptr(), row_bytes)
        return mask


@dataclass(frozen=True)
class MaskJob:
    future: Future[torch.Tensor]

    def result(self) -> torch.Tensor:
        return self.future.result()


def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A copy of logits [N, V] with the tokens `mask` [N, W] (int32 bits, host) disallows set to -inf.

    Tokens past 32 * W (model vocab padding beyond the tokenizer's) are disallowed.
    """
    n, vocab = logits.shape
    if mask.shape[0] != n or mask.dtype != torch.int32:
        raise ValueError(f"mask must be int32 [{n}, W], got {mask.dtype} {tuple(mask.shape)}")
    device_mask = mask if logits.device.type == "cpu" else mask.pin_memory().to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((device_mask[:, :, None] >> shifts) & 1).bool().reshape(n, -1)  # [N, 32 * W]
    width = min(vocab, allowed.shape[1])
    keep = torch.zeros(n, vocab, dtype=torch.bool, device=logits.device)
    keep[:, :width] = allowed[:, :width]
    return logits.masked_fill(~keep, float("-inf"))
