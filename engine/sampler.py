"""Turns one step's logits into one token per sampling chunk, batched across rows on the device.

Order of operations (as vLLM): penalties on the raw logits, then temperature (greedy rows take the
argmax of the penalized logits), then top-k, top-p and min-p filtering, then sampling.

Sampling is the exponential race: `argmax(probs / q)` with `q ~ Exponential(1)` per token picks
token i with probability `probs[i]`, needs no `torch.multinomial` (which syncs on CUDA), and lets
every row draw its noise from its own generator.

Seeds. A seeded row draws its noise from a fresh generator seeded by hash(seed, tokens generated so
far, counting a migrated generation's `prior_output_tokens`). The noise therefore depends only on the
request and its position: not on the other rows, their order, or any generator state. The same
request re-run after preemption (recompute) or moved to another worker draws the same noise at the
same position and so picks the same tokens, given the same logits. Reproducibility holds per device
type, vocab size and torch version (CPU and CUDA generators produce different streams). Unseeded rows
share one engine generator, seeded by the constructor's `seed`.

Logprobs are reported under the model's *raw* distribution, log_softmax of the logits as they come
in (before penalties, temperature and filtering). This is vLLM's default ("raw logprobs"): the number
describes the model, not the sampling settings, and stays comparable across requests.

Constrained rows (structured outputs, tool calls): `begin(chunks)` starts the step's grammar masks on
a host thread before the forward pass; `sample(..., masks)` waits for them once the logits exist and
sets disallowed tokens to -inf before any other stage (engine/structured/masks.py). Logprobs stay raw.

Host syncs: the decisions of which stages to run read only the host-side SamplingParams, never a
tensor, so the only device->host reads are the sampled ids (and logprobs) at the very end.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.batch import SampledToken, ScheduledChunk, TokenLogprobs
from engine.structured.masks import GrammarCompiler, MaskJob, apply_token_bitmask

# Noise is clamped away from 0 so that probs / noise stays finite: 1 / tiny is < float32 max.
_MIN_NOISE = torch.finfo(torch.float32).tiny


class Sampler:
    """Samples one token per row of `logits`; stateless per request (see module docstring).

    Not thread-safe: the engine generator for unseeded rows is shared state.
    """

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        # Set by the engine once it has a tokenizer; without one, constrained requests are refused.
        self.grammar: GrammarCompiler | None = None

    def begin(self, chunks: Sequence[ScheduledChunk]) -> MaskJob | None:
        """Start this step's grammar masks (call before the forward pass); None when no row is constrained."""
        if self.grammar is None or not chunks:
            return None
        return self.grammar.start(chunks)

    def sample(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk],
               masks: MaskJob | None = None) -> list[SampledToken]:
        """logits: [N, V] float32, row i belonging to chunks[i] (every chunk has `needs_sample`).

        `masks`: what `begin(chunks)` returned; computed here if None and some row is constrained.
        Does not modify `logits`. Stop tokens are not handled here: the engine checks them.
        """
        _check_inputs(logits, chunks, self.device)
        if not chunks:
            return []
        params = [c.sampling for c in chunks]
        raw = logits
        if any(p.guided is not None for p in params):
            if self.grammar is None:
                raise ValueError("constrained sampling needs the model's tokenizer (Sampler.grammar is unset)")
            logits = apply_token_bitmask(logits, masks.result() if masks else self.grammar.compute(chunks))
        if all(p.greedy and not p.has_penalties and p.logprobs is None for p in params):
            return [SampledToken(t) for t in logits.argmax(dim=-1).tolist()]
        processed = _apply_penalties(logits, chunks) if any(p.has_penalties for p in params) else logits
        ids = processed.argmax(dim=-1)
        if not all(p.greedy for p in params):
            rows = _RowParams.from_chunks(chunks, processed.shape[1], processed.device)
            ids = torch.where(rows.greedy, ids, self._sample_random(processed, chunks, rows))
        return _to_host(raw, ids, chunks)

    def _sample_random(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk],
                       rows: _RowParams) -> torch.Tensor:
        """[N] ids sampled from every row; greedy rows get a throwaway value the caller replaces."""
        logits = logits / rows.temperature[:, None]
        if rows.any_top_k_top_p:
            logits = _apply_top_k_top_p(logits, rows.top_k, rows.top_p)
        if rows.any_min_p:
            logits = _apply_min_p(logits, rows.min_p)
        probs = logits.softmax(dim=-1)
        return probs.div_(self._noise(probs, chunks)).argmax(dim=-1)

    def _noise(self, probs: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """[N, V] Exponential(1) noise: the engine generator for unseeded rows, per-request for seeded."""
        sampled = [not c.sampling.greedy for c in chunks]
        if any(s and c.sampling.seed is None for s, c in zip(sampled, chunks, strict=True)):
            noise = torch.empty_like(probs).exponential_(generator=self._generator)
        else:
            noise = torch.ones_like(probs)
        # A loop over rows is unavoidable here: each seeded row needs its own generator.
        for i, (s, chunk) in enumerate(zip(sampled, chunks, strict=True)):
            if s and chunk.sampling.seed is not None:
                position = chunk.sampling.prior_output_tokens + len(chunk.output_token_ids)
                step_seed = request_step_seed(chunk.sampling.seed, position)
                generator = torch.Generator(device=probs.device).manual_seed(step_seed)
                noise[i].exponential_(generator=generator)
        return noise.clamp_min_(_MIN_NOISE)


def request_step_seed(seed: int, num_generated: int) -> int:
    """The generator seed for a request's token at position `num_generated` of its output.

    A hash rather than `seed + num_generated`, so that request (s, n + 1) never replays the noise of
    request (s + 1, n).
    """
    digest = hashlib.blake2b(seed.to_bytes(8, "little") + num_generated.to_bytes(8, "little"),
                             digest_size=8, person=b"baton-sampler").digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class _RowParams:
    """Per-row sampling parameters as [N] tensors, built once per call; flags are host-side."""

    greedy: torch.Tensor  # [N] bool
    temperature: torch.Tensor  # [N] float32; 1.0 on greedy rows so their (discarded) math stays finite
    top_k: torch.Tensor  # [N] int64; the vocab size where top-k is disabled
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    any_top_k_top_p: bool
    any_min_p: bool

    @classmethod
    def from_chunks(cls, chunks: Sequence[ScheduledChunk], vocab: int, device: torch.device) -> _RowParams:
        ps = [c.sampling for c in chunks]
        # One host tensor, so one copy; top_k as float32 is exact for any vocab below 2**24.
        host = torch.tensor([[float(p.greedy) for p in ps],
                             [1.0 if p.greedy else p.temperature for p in ps],
                             [min(p.top_k, vocab) if p.top_k else vocab for p in ps],
                             [p.top_p for p in ps],
                             [p.min_p for p in ps]], dtype=torch.float32)
        greedy, temperature, top_k, top_p, min_p = _to_device(host, device).unbind()
        return cls(
            greedy=greedy > 0, temperature=temperature, top_k=top_k.long(), top_p=top_p, min_p=min_p,
            any_top_k_top_p=any(not p.greedy and (0 < p.top_k < vocab or p.top_p < 1.0) for p in ps),
            any_min_p=any(not p.greedy and p.min_p > 0.0 for p in ps),
        )


def _output_ids(chunk: ScheduledChunk) -> Sequence[int]:
    """The request's output so far, including what it generated before a migration (prompt tail)."""
    prior = chunk.sampling.prior_output_tokens
    if not prior:
        return chunk.output_token_ids
    return [*chunk.prompt_token_ids[len(chunk.prompt_token_ids) - prior:], *chunk.output_token_ids]


def _apply_penalties(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
    """Repetition (HF/CTRL, prompt + output), then frequency and presence (OpenAI, output only).

    Rows without a penalty get neutral values (1, 0, 0) and no tokens, which leaves them unchanged
    and spares copying their prompts.
    """
    vocab, device = logits.shape[1], logits.device
    ps = [c.sampling for c in chunks]
    output_counts = _token_counts([_output_ids(c) if c.sampling.has_penalties else () for c in chunks],
                                  vocab, device)
    prompt_counts = _token_counts(
        [c.prompt_token_ids if c.sampling.repetition_penalty != 1.0 else () for c in chunks], vocab, device)
    host = torch.tensor([[p.repetition_penalty for p in ps], [p.frequency_penalty for p in ps],
                         [p.presence_penalty for p in ps]], dtype=torch.float32)
    rep, freq, pres = _to_device(host, device)[:, :, None].unbind()  # each [N, 1]
    seen_in_output = output_counts > 0
    # CTRL: dividing a negative logit would make the token *more* likely, so negatives are multiplied.
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen_in_output | (prompt_counts > 0), repeated, logits)
    return logits - freq * output_counts - pres * seen_in_output


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[N, V] float32 occurrence counts of each token id per row.

    Rebuilt from the token lists every step: O(total tokens) host work, dominated by reading the
    Python ints (an array buffer roughly halves that against torch.tensor(list)).
    """
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    if int(lengths.sum()):  # a host tensor: no device sync
        tokens = torch.frombuffer(array("q", itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:  # would count into a neighbouring row
            raise ValueError(f"penalty token ids must be in [0, {vocab})")
        # Flat offsets row * V + token, built on the host so that one copy moves them all.
        rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
        index = _to_device(rows * vocab + tokens, device)
        counts.view(-1).scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    return counts


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copies a host tensor to the device without waiting on it.

    A plain copy from pageable memory makes the host wait for all queued device work (the model's
    forward pass); from pinned memory the copy is queued like a kernel. The caching host allocator
    keeps the pinned buffer alive until the copy has run.
    """
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top k, then outside its top-p nucleus.

    Top-k counts ranks, so ties never let more than k tokens through. The nucleus is the smallest
    set of best tokens whose mass (renormalized after top-k) reaches top_p: a token is kept while
    the mass strictly before it is below top_p, so the best token always survives.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(logits.shape[1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], -math.inf)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p == 1 keeps everything even where cumsum rounding pushes mass_before to 1.0.
    outside = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(outside, -math.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens with prob < min_p * max prob, compared in log space: no softmax needed."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]  # log(0) = -inf keeps all
    return logits.masked_fill(logits < threshold, -math.inf)


def _to_host(raw_logits: torch.Tensor, ids: torch.Tensor,
             chunks: Sequence[ScheduledChunk]) -> list[SampledToken]:
    """Reads the results back in one copy: the one place this module waits on the device."""
    wanted = [c.sampling.logprobs for c in chunks]
    if all(n is None for n in wanted):
        return [SampledToken(t) for t in ids.tolist()]
    logprobs = raw_logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, ids[:, None])
    top_n = min(max(n for n in wanted if n is not None), logprobs.shape[1])
    top_lp, top_ids = logprobs.topk(top_n, dim=-1)  # sorted, best first
    # Packed as float64, exact for ids below 2**53 and for float32 logprobs: [id, logprob, ids.., lps..]
    packed = torch.cat([ids[:, None].double(), chosen.double(), top_ids.double(), top_lp.double()], dim=1)
    out = []
    for row, n in zip(packed.tolist(), wanted, strict=True):
        token_id = int(row[0])
        if n is None:
            out.append(SampledToken(token_id))
            continue
        top = tuple((int(i), lp) for i, lp in zip(row[2:2 + n], row[2 + top_n:2 + top_n + n], strict=True))
        out.append(SampledToken(token_id, TokenLogprobs(token_id, row[1], top)))
    return out


def _check_inputs(logits: torch.Tensor, chunks: Sequence[ScheduledChunk], device: torch.device) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(chunks):
        raise ValueError(f"logits must be [num_chunks={len(chunks)}, vocab], got {tuple(logits.shape)}")
    if logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32, got {logits.dtype}")
    if logits.device.type != device.type:
        raise ValueError(f"logits are on {logits.device}, the sampler on {device}")
    if not all(c.needs_sample for c in chunks):
        raise ValueError("only chunks with needs_sample may be passed to the sampler")
