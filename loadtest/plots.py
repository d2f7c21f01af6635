"""PNG charts of one or more result files (matplotlib, Agg backend: no display needed).

One figure, four panels: goodput vs offered request rate (one line per result file, so runs of
different servers or configs share the axes), and the empirical CDFs of TTFT, TPOT and ITL (one line
per file and rate) with the SLO thresholds drawn in. A rate of inf is placed one doubling to the right
of the largest finite rate and labelled "inf".
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first
import numpy as np  # noqa: E402

from loadtest.metrics import latency_samples  # noqa: E402
from loadtest.report import BenchResult  # noqa: E402


def _x_positions(rates: list[float]) -> dict[float, float]:
    finite = sorted({r for r in rates if not math.isinf(r)})
    pos = {r: r for r in finite}
    if any(math.isinf(r) for r in rates):
        pos[math.inf] = finite[-1] * 2 if finite else 1.0
    return pos


def _plot_goodput(ax, results: list[BenchResult]) -> None:  # noqa: ANN001 - matplotlib Axes
    pos = _x_positions([run.request_rate for res in results for run in res.runs])
    for res in results:
        pairs = sorted((pos[run.request_rate], s["goodput"], s["request_throughput"])
                       for run, s in zip(res.runs, res.summaries(), strict=True))
        line, = ax.plot([p[0] for p in pairs], [p[1] for p in pairs], marker="o", label=f"{res.label} goodput")
        ax.plot([p[0] for p in pairs], [p[2] for p in pairs], ls=":", color=line.get_color(), alpha=0.6,
                label=f"{res.label} throughput")
    if len(pos) > 1 and min(pos.values()) > 0:
        ax.set_xscale("log", base=2)
    ax.set_xticks(list(pos.values()), ["inf" if math.isinf(r) else f"{r:g}" for r in pos])
    ax.minorticks_off()
    slo = results[0].slo
    ax.set_title(f"Goodput (TTFT<={slo.ttft_ms or '-'}ms, TPOT<={slo.tpot_ms or '-'}ms)")
    ax.set_xlabel("offered rate (sessions/s: requests/s, or conversations/s for multiturn)")
    ax.set_ylabel("req/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _plot_cdf(ax, results: list[BenchResult], metric: str, slo_ms: float | None) -> None:  # noqa: ANN001
    for res in results:
        for run in res.runs:
            values = np.sort(np.asarray(latency_samples(run.records)[metric]) * 1000.0)
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                        label=f"{res.label} @ {run.request_rate:g}")
    if slo_ms is not None:
        ax.axvline(slo_ms, color="red", ls="--", lw=1, label=f"SLO {slo_ms:g} ms")
    ax.set_title(f"{metric.upper()} CDF")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_results(results: list[BenchResult], path: str | Path) -> Path:
    """Write the four-panel PNG for `results` (all judged by the first one's SLO) and return its path."""
    if not results:
        raise ValueError("nothing to plot")
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    slo = results[0].slo
    _plot_goodput(axes[0][0], results)
    _plot_cdf(axes[0][1], results, "ttft", slo.ttft_ms)
    _plot_cdf(axes[1][0], results, "tpot", slo.tpot_ms)
    _plot_cdf(axes[1][1], results, "itl", None)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
