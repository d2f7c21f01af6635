"""The human-readable side of a profile: measured vs fitted time per point, and the coefficients."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from scheduler.calibration.points import DecodePoint, Measurements, PrefillPoint
from scheduler.calibration.profile_fit import OUTLIER, LinearFit
from scheduler.core.cost_model import WorkerProfile


def format_report(measured: Measurements, prefill: LinearFit, decode: LinearFit, profile: WorkerProfile) -> str:
    lines = ["prefill: one prompt per step",
             f"{'new':>8} {'cached':>8} {'measured_ms':>12} {'fitted_ms':>10} {'error':>8}"]
    for (p, s), err in zip(measured.prefill, prefill.relative_errors, strict=True):
        lines.append(f"{p.new_tokens:>8} {p.cached_tokens:>8} {s * 1e3:>12.2f} {s * (1 + err) * 1e3:>10.2f} "
                     f"{err:>+8.1%}")
    lines += ["", "decode: one token per sequence",
              f"{'batch':>8} {'ctx/seq':>8} {'measured_ms':>12} {'fitted_ms':>10} {'error':>8}"]
    for (d, s), err in zip(measured.decode, decode.relative_errors, strict=True):
        lines.append(f"{d.batch:>8} {d.context_per_seq:>8} {s * 1e3:>12.2f} {s * (1 + err) * 1e3:>10.2f} "
                     f"{err:>+8.1%}")
    lines += ["", *_skipped_lines(measured.skipped), *_coefficient_lines(profile, prefill, decode),
              *_outlier_lines(prefill, decode)]
    return "\n".join(lines)


def _skipped_lines(skipped: Sequence[PrefillPoint | DecodePoint]) -> list[str]:
    if not skipped:
        return []
    names = ", ".join(describe(p) for p in skipped)
    return [f"skipped (KV pool too small; raise --num-blocks): {names}", ""]


def describe(point: PrefillPoint | DecodePoint) -> str:
    if isinstance(point, PrefillPoint):
        return f"prefill {point.new_tokens} tokens over {point.cached_tokens} cached"
    return f"decode batch {point.batch} x {point.context_per_seq} context"


def _coefficient_lines(p: WorkerProfile, prefill: LinearFit, decode: LinearFit) -> list[str]:
    return [
        f"prefill step = {_floor(p)}{_time(p.prefill_fixed_s)} + {_time(p.prefill_per_token_s)}/token"
        f" + {_time(p.prefill_per_token_sq_s)} * new*(new+2*cached){')' if p.prefill_floor_s else ''}"
        f"   (worst error {_worst(prefill):.1%})",
        f"decode step  = {_time(p.decode_fixed_s)} + {_time(p.decode_per_seq_s)}/seq"
        f" + {_time(p.decode_per_context_token_s)}/context token   (worst error {_worst(decode):.1%})",
        f"kv transfer  = {_time(p.transfer_fixed_s)} + {_time(p.transfer_per_token_s)}/token"
        "   (not measured here: lab/micro/bench_kv_transfer.py)",
    ]


def measurements_json(measured: Measurements, prefill: LinearFit, decode: LinearFit) -> dict:
    """Every timed point with its fitted time, for `--measurements-out` (plots, docs/benchmarks.md)."""
    return {
        "prefill": [{**asdict(p), "measured_s": s, "fitted_s": s * (1 + e)}
                    for (p, s), e in zip(measured.prefill, prefill.relative_errors, strict=True)],
        "decode": [{**asdict(d), "measured_s": s, "fitted_s": s * (1 + e)}
                   for (d, s), e in zip(measured.decode, decode.relative_errors, strict=True)],
        "skipped": [describe(p) for p in measured.skipped],
    }


def _floor(p: WorkerProfile) -> str:
    return f"max({_time(p.prefill_floor_s)}, " if p.prefill_floor_s else ""


def _time(seconds: float) -> str:
    if seconds == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _outlier_lines(prefill: LinearFit, decode: LinearFit) -> list[str]:
    """The cost model is smooth in every feature, so a point far off the fit was most likely slowed
    by something else on the host (an idle dedicated machine gives errors of a few percent)."""
    far = sum(abs(e) > OUTLIER for e in (*prefill.relative_errors, *decode.relative_errors))
    if not far:
        return []
    return [f"warning: {far} point(s) off the fit by more than {OUTLIER:.0%} even when timed again: the host "
            "was probably busy; re-run on an idle machine or raise --repeats"]


def _worst(fit: LinearFit) -> float:
    return max((abs(e) for e in fit.relative_errors), default=0.0)
