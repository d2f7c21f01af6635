"""policy_repeats: the spread table and the policy-quality verdicts over repeats of policy_compare."""

from __future__ import annotations

from lab.experiments.analysis import engine_step_ms
from lab.experiments.policy_repeats import host_speed_context, load, per_configuration_context, table, verdicts


def _run(good: float, sim_good: float, ttft: float, sim_ttft: float, enterprise_ttft: float,
         engine_ms: float | None = None) -> dict:
    return {"real": {"goodput_fraction": good, "ttft_p90_ms": ttft, "engine_step_ms": engine_ms,
                     "by_tier": {"enterprise": {"ttft_p90_ms": enterprise_ttft}}},
            "sim": {"goodput_fraction": sim_good, "ttft_p90_ms": sim_ttft}}


def _summary(goodput_good: float, ll_good: float, enterprise_ttft: float) -> dict:
    return {
        "exp1_random": {"runs": {"least_loaded": _run(ll_good, ll_good + 0.02, 1000, 1100, 1000),
                                 "round_robin": _run(0.5, 0.52, 3000, 3100, 3000),
                                 "goodput": _run(goodput_good, goodput_good - 0.03, 900, 950, 900)}},
        "exp3_overload": {"runs": {"round_robin": _run(0.4, 0.41, 9000, 9500, 9000),
                                   "goodput": _run(0.8, 0.78, 2000, 2100, enterprise_ttft)}},
    }


def test_a_repeat_where_goodput_loses_or_misses_the_slo_fails_its_verdicts() -> None:
    repeats = [load(_summary(1.0, 0.9, 2000)), load(_summary(0.85, 0.9, 2600))]
    by_name = {v.name.split()[0]: v for v in verdicts(repeats)}
    assert not by_name["goodput"].passed and "repeat 2 exp1_random" in by_name["goodput"].detail
    assert not by_name["enterprise"].passed and by_name["enterprise"].detail.startswith("1/2")
    assert by_name["simulator"].passed  # errors of 1-3 pp
    assert by_name["simulated"].passed  # TTFT ratios within 10%


def test_when_every_repeat_holds_every_verdict_passes_and_the_table_has_mean_and_spread() -> None:
    repeats = [load(_summary(1.0, 0.9, 2000)), load(_summary(0.95, 0.95, 2400))]
    assert all(v.passed for v in verdicts(repeats))
    row = next(line for line in table(repeats) if line.startswith("| exp1_random | goodput"))
    assert "| 2 | 97.5 [95.0-100.0] | 900 [900-900] | -3.0 [-3.0--3.0] |" in row


def test_a_simulator_far_off_fails_the_error_verdicts() -> None:
    summary = _summary(1.0, 0.9, 2000)
    summary["exp3_overload"]["runs"]["goodput"]["sim"] = {"goodput_fraction": 0.5, "ttft_p90_ms": 6000}
    checks = {v.name.split()[0]: v for v in verdicts([load(summary)])}
    assert not checks["simulated"].passed and "exp3_overload/goodput x3.00" in checks["simulated"].detail
    assert checks["simulator"].detail.startswith("7.6 pp")  # (2+2+3+1+30)/5


def test_a_loss_names_how_fast_the_host_ran_the_engines_against_the_baselines_run() -> None:
    summary = _summary(0.85, 0.9, 2000)
    runs = summary["exp1_random"]["runs"]
    runs["goodput"]["real"]["engine_step_ms"] = 104.0
    runs["least_loaded"]["real"]["engine_step_ms"] = 80.0
    loss = next(v for v in verdicts([load(summary)]) if v.name.startswith("goodput"))
    assert not loss.passed
    assert loss.detail.endswith("goodput 85.0% < least_loaded 90.0% (engine step 1.30x the least_loaded run's)")
    row = next(line for line in table([load(summary)]) if line.startswith("| exp1_random | goodput"))
    assert row.endswith("| 104 [104-104] |")


def test_the_engine_step_is_the_median_single_sequence_decode_step_of_every_worker() -> None:
    tap = {"samples": {
        "worker-a": [["decode", 1.0, 1, 80, 0.070], ["decode", 1.2, 3, 240, 0.150], ["prefill", 1.3, 64, 4096, 0.4]],
        "worker-b": [["decode", 1.1, 1, 70, 0.080], ["decode", 1.4, 1, 71, 0.090],
                     ["mixed", 1.5, 64, 4096, 1, 80, 0.5]],
    }}
    assert engine_step_ms(tap) == 80.0
    assert engine_step_ms({"samples": {"worker-a": [["prefill", 1.0, 64, 4096, 0.4]]}}) is None


def test_the_replays_at_each_runs_host_speed_are_reported_beside_the_verdicts_when_the_summaries_have_them() -> None:
    summary = _summary(1.0, 0.9, 2000)
    assert host_speed_context([load(summary)]) is None  # older summaries
    for experiment in summary.values():
        for run in experiment["runs"].values():
            run["sim_host_replayed_error_pp"] = -4.0
            run["sim_host_replayed"] = {"goodput_fraction": 0.5, "ttft_p90_ms": run["real"]["ttft_p90_ms"] * 1.1}
    goodput = summary["exp1_random"]["runs"]["goodput"]
    goodput["sim_host_replayed_error_pp"] = 1.0
    goodput["sim_host_replayed"]["ttft_p90_ms"] = 0.5 * goodput["real"]["ttft_p90_ms"]
    context = host_speed_context([load(summary)])
    assert context is not None
    assert context.endswith("mean |error| is 3.4 pp over 5 runs, its TTFT p90 within 20% in 4/5")  # (4*4+1)/5


def test_the_ttft_p90_read_per_configuration_compares_means_and_names_the_real_spread() -> None:
    first, second = _summary(1.0, 0.9, 2000), _summary(1.0, 0.9, 2000)
    # exp1 least_loaded: real 1000 / 1000, simulated 1100 / 1100 (as built): within, no spread
    # exp1 round_robin: real 2000 / 4000 (+-33% around 3000), simulated 3300 both: its mean within 10%
    first["exp1_random"]["runs"]["round_robin"]["real"]["ttft_p90_ms"] = 2000
    second["exp1_random"]["runs"]["round_robin"]["real"]["ttft_p90_ms"] = 4000
    for summary in (first, second):
        summary["exp1_random"]["runs"]["round_robin"]["sim"]["ttft_p90_ms"] = 3300
        summary["exp3_overload"]["runs"]["goodput"]["sim"]["ttft_p90_ms"] = 3000  # real 2000: 1.5x
    assert per_configuration_context([load(first)]) is None  # one repeat: nothing to spread
    context = per_configuration_context([load(first), load(second)])
    assert context == ("per configuration, the simulated TTFT p90's mean over the repeats is within 20% of the "
                       "real one's in 4/5; the real p90 itself moves more than 20% from its mean between repeats "
                       "in 1/5 (exp1_random/round_robin 2000-4000 ms)")
