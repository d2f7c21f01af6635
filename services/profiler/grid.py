"""Which step shapes a profile measures: prompt lengths for prefill, (batch, context) for decode.

Both grids are log-spaced because the cost model's terms separate across scales: the fixed cost
shows at the short end, the per-token (per-sequence) cost in the middle and the quadratic attention
(per-context-token) cost only at the long end. A couple of prefill points carry a cached prefix so
the fit sees `new * 2 * cached` vary apart from `new**2`. Pure data (points, grids and their
measured times), no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.calibration.points import DecodePoint, PrefillPoint

_SHORTEST_PROMPT = 16
_SHORTEST_CONTEXT = 64
_QUICK_LONGEST_PROMPT = 256  # --quick: seconds on a laptop CPU with the 135M default model
_QUICK_BATCHES = (1, 4, 16)
_QUICK_CONTEXTS = (32, 256)


@dataclass(frozen=True)
class ProfileGrid:
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]


def build_grid(max_model_len: int, max_num_seqs: int, quick: bool = False) -> ProfileGrid:
    """Prompts of 16 .. max_model_len/2 tokens (x2 steps; at most 256 with `quick`) plus two cached-prefix
    points (one with `quick`); decode batches 1 .. max_num_seqs (x2) by contexts 64 .. max_model_len/2
    (x4), or batches 1/4/16 by contexts 32/256 with `quick`.
    """
    if max_model_len < 2 * _SHORTEST_PROMPT or max_num_seqs < 1:
        raise ValueError(f"need max_model_len >= {2 * _SHORTEST_PROMPT} and max_num_seqs >= 1, "
                         f"got {max_model_len} and {max_num_seqs}")
    longest = max_model_len // 2
    if quick:
        longest = min(longest, _QUICK_LONGEST_PROMPT)
    prompts = _log_spaced(_SHORTEST_PROMPT, longest, 2)
    cached = _cached_points(longest, quick)
    if quick:
        batches = tuple(sorted({min(b, max_num_seqs) for b in _QUICK_BATCHES}))
        contexts = tuple(sorted({min(c, longest) for c in _QUICK_CONTEXTS}))
    else:
        batches = _with_end(_log_spaced(1, max_num_seqs, 2), max_num_seqs)
        contexts = _log_spaced(min(_SHORTEST_CONTEXT, longest), longest, 4)
    return ProfileGrid(
        prefill=tuple(PrefillPoint(n) for n in prompts) + cached,
        decode=tuple(DecodePoint(b, c) for c in contexts for b in batches),
    )


def _cached_points(longest: int, quick: bool) -> tuple[PrefillPoint, ...]:
    """A quarter of `longest` over a half, and an eighth over three quarters (the quick grid keeps
    only the first): both fit inside `longest`, and their `cached` varies apart from `new`."""
    points = [PrefillPoint(longest // 4, longest // 2)]
    if not quick:
        points.append(PrefillPoint(longest // 8, longest // 8 * 6))
    return tuple(p for p in points if p.new_tokens >= 1)


def _log_spaced(first: int, last: int, factor: int) -> tuple[int, ...]:
    values = []
    v = first
    while v <= last:
        values.append(v)
        v *= factor
    return tuple(values)


def _with_end(values: tuple[int, ...], end: int) -> tuple[int, ...]:
    """Add `end` when the ladder stops short of it: the largest batch the worker runs matters most."""
    return values if values and values[-1] == end else (*values, end)
