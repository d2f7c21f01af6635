"""Refit a profile's prefill cost (with its floor) from the table `baton profile` printed.

    python -m lab.experiments.refit_profile PROFILE.json REPORT.txt --out NEW.json

A profile written before the prefill floor (scheduler/core/cost_model.py) holds only the line; the
report `baton profile` printed beside it holds every timed prefill point (new, cached, measured_ms).
This refits those points with today's fit (scheduler/calibration/profile_fit.py: a floor, then the line) and
writes the profile back with the new prefill terms; the decode and transfer terms are kept.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict
from pathlib import Path

from scheduler.adapters.profiles import ProfileBook
from scheduler.calibration.points import PrefillPoint
from scheduler.calibration.profile_fit import fit_prefill, with_prefill

_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+[\d.]+\s+[+-][\d.]+%\s*$")


def prefill_table(report: str) -> list[tuple[PrefillPoint, float]]:
    """The (point, seconds) rows of the report's prefill table (the lines after "prefill:" up to a blank)."""
    rows: list[tuple[PrefillPoint, float]] = []
    inside = False
    for line in report.splitlines():
        if line.startswith("prefill:"):
            inside = True
        elif inside and not line.strip():
            break
        elif inside and (m := _ROW.match(line)):
            rows.append((PrefillPoint(int(m[1]), int(m[2])), float(m[3]) / 1e3))
    if not rows:
        raise ValueError("no prefill table in the report (the `prefill: one prompt per step` block)")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.experiments.refit_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", type=Path, help="the `baton profile` JSON")
    p.add_argument("report", type=Path, help="what `baton profile` printed when it wrote it")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        rows = prefill_table(args.report.read_text())
        book = ProfileBook.load(args.profile)
    except (OSError, ValueError) as e:
        print(f"refit_profile: {e}", file=sys.stderr)
        return 2
    fit = fit_prefill([pt for pt, _ in rows], [s for _, s in rows])
    a, b, c = fit.coefficients
    refit = {name: asdict(with_prefill(profile, fit)) for name, profile in book.by_model.items()}
    args.out.write_text(json.dumps(refit, indent=2, sort_keys=True) + "\n")
    worst = max(abs(e) for e in fit.relative_errors)
    print(f"prefill step = max({fit.floor_s * 1e3:.2f} ms, {a * 1e3:.2f} ms + {b * 1e6:.1f} us/token "
          f"+ {c * 1e9:.2f} ns * new*(new+2*cached))   (worst error {worst:.1%}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
