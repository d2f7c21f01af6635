"""Which candidate launch config the attention sweep recommends, from its measured rows (no torch).

Per shape class (an attention_tiles table key), the recommendation is the config with the best
geometric-mean speed-up over the pre-sweep baseline across the class's cases, among the configs that
were measured on every case of the class, stayed within MAX_REL_ERR of the reference, and are no
more than 3% (noise) slower than the baseline on any case. Kept apart from the timing code so that
the choice is unit-tested on CPU without importing the kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_REL_ERR = 2e-2  # bf16 inputs, fp32 accumulation: the GPU tests pass at 1e-2
PRE_SWEEP_DECODE_ROWS = "DecodeRows.PREFILL_TILES"
NOT_SLOWER = 0.97  # a recommendation may be at most 3% (noise) slower than the baseline on any case


@dataclass
class SweepRow:
    kind: str  # "decode" | "prefill" | "mixed"
    case: str
    shape_class: str  # the attention_tiles table key this case falls under
    variant: str  # "sdpa", or the config's label
    config: str  # repr of the DecodeConfig / PrefillConfig ("" for SDPA): pasteable into the table
    decode_rows: str | None = None  # mixed only: "DecodeRows.<mode>", pasteable
    num_splits: int | None = None  # decode only
    ms: float | None = None  # decode: CUDA-graph replay; prefill and mixed: eager
    eager_ms: float | None = None
    rate: float | None = None  # GB/s (decode) or TFLOP/s
    of_ceiling: float | None = None
    vs_sdpa: float | None = None  # sdpa ms / ms: > 1 is faster than SDPA
    vs_baseline: float | None = None  # baseline ms / ms
    err: float | None = None
    error: str | None = None


def mark_baseline(rows: list[SweepRow], baseline: str) -> None:
    """vs_baseline per row of one case: against the pre-sweep config `baseline` (a repr), run the
    pre-sweep way (for mixed: decode rows in prefill tiles)."""
    base = next((r for r in rows if r.config == baseline and r.decode_rows in (None, PRE_SWEEP_DECODE_ROWS)
                 and r.ms), None)
    for row in rows:
        row.vs_baseline = base.ms / row.ms if base and base.ms and row.ms else None


def recommend(rows: list[SweepRow]) -> list[str]:
    """One table line per shape class (and the MIXED_DECODE_ROWS choice) from the rows measured."""
    lines = []
    for kind, shape in dict.fromkeys((r.kind, r.shape_class) for r in rows):
        cls = [r for r in rows if r.kind == kind and r.shape_class == shape and r.config]
        cases = {r.case for r in cls if r.vs_baseline}  # the cases whose baseline was measured
        best: dict[tuple[str, str | None], dict[str, float]] = {}  # (config, decode rows) -> case -> x base
        for r in cls:
            if r.ms and r.vs_baseline and r.err is not None and r.err <= MAX_REL_ERR and not r.error:
                per_case = best.setdefault((r.config, r.decode_rows), {})
                per_case[r.case] = max(per_case.get(r.case, 0.0), r.vs_baseline)
        scores = {key: math.exp(sum(math.log(v) for v in per_case.values()) / len(per_case))
                  for key, per_case in best.items()
                  if set(per_case) == cases and min(per_case.values()) >= NOT_SLOWER}
        if not scores:
            lines.append(f"# {kind} {shape}: no candidate valid and no slower than the baseline on every case")
            continue
        (config, decode_rows), score = max(scores.items(), key=lambda kv: kv[1])
        where = "DECODE_TABLE" if kind == "decode" else "PREFILL_TABLE"
        lines.append(f"# {kind} {sorted(cases)}: x{score:.2f} over the baseline ({where})")
        lines.append(f"    {shape}: {config}," if kind != "mixed"
                     else f"MIXED_DECODE_ROWS = {decode_rows}  # with {config}")
    return lines
