"""`baton plan`: candidate layouts, workloads, and a recommendation that follows the workload's shape."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from scheduler import planner
from scheduler.adapters.plan_main import register_plan_command
from scheduler.core.cost_model import WorkerProfile
from scheduler.plan_workload import SyntheticLengths, synthetic_trace, trace_from_rows
from scheduler.planner import Layout, PlanConfig, WorkerShape, candidate_layouts, plan
from scheduler.types import SLO

# An H100-class 8B-model shape: ~31k prefill tokens/s, ~8 ms decode steps.
CARD = WorkerProfile(prefill_fixed_s=0.005, prefill_per_token_s=3.2e-5, prefill_per_token_sq_s=1e-9,
                     decode_fixed_s=0.008, decode_per_seq_s=5e-5, decode_per_context_token_s=2e-8,
                     transfer_per_token_s=1e-6)


def main(argv: list[str]) -> int:
    """`baton` with only its `plan` subcommand (services/cli.py registers the same function)."""
    parser = argparse.ArgumentParser(prog="baton")
    register_plan_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_the_candidates_are_every_layout_using_all_gpus() -> None:
    assert [layout.name for layout in candidate_layouts(4, [1])] == ["co-located x4", "1P3D", "2P2D", "3P1D"]
    with_tp2 = candidate_layouts(4, [1, 2])
    assert {layout.gpus for layout in with_tp2} == {4}
    names = {layout.name for layout in with_tp2}
    assert {"co-located x2 (TP2)", "1P1D (TP2/TP2)", "2P1D (TP1/TP2)"} <= names
    assert "1P2D (TP2/TP1)" not in names  # a TP gather: the hand-off refuses it (kvtransfer/nixl/sliced.py)



def test_pipeline_shapes_count_tensor_times_pipeline_gpus() -> None:
    """A TP2 x PP2 worker holds 4 GPUs: on 4 GPUs it is one co-located worker, or none of a pair."""
    layouts = candidate_layouts(4, [1, WorkerShape(2, 2), WorkerShape(1, 2)])
    names = {layout.name for layout in layouts}
    assert {"co-located x1 (TP2xPP2)", "co-located x2 (TP1xPP2)", "1P1D (TP1xPP2/TP1xPP2)",
            "1P2D (TP1xPP2/TP1)"} <= names
    assert "2P1D (TP1/TP1xPP2)" not in names  # one prefill stage over two decode stages: refused
    assert {layout.gpus for layout in layouts} == {4}
    assert not any(layout.prefill_shape == WorkerShape(2, 2) and not layout.colocated for layout in layouts)


@pytest.mark.parametrize(("prefill", "decode", "feeds"), [
    (WorkerShape(1), WorkerShape(1), True), (WorkerShape(1), WorkerShape(2), True),
    (WorkerShape(2), WorkerShape(4), False),  # a split from a multi-rank prefill worker: refused by its sender
    (WorkerShape(1), WorkerShape(4), True), (WorkerShape(2), WorkerShape(1), False),  # a gather
    (WorkerShape(2), WorkerShape(3), False), (WorkerShape(1, 2), WorkerShape(1), True),
    (WorkerShape(1, 4), WorkerShape(1, 2), True), (WorkerShape(1), WorkerShape(1, 2), False),
    (WorkerShape(1, 2), WorkerShape(2), False),  # PP with another TP
])
def test_a_shape_pair_is_a_candidate_only_where_the_hand_off_builds_it(
        prefill: WorkerShape, decode: WorkerShape, feeds: bool) -> None:
    assert prefill.feeds(decode) is feeds


def test_a_pipeline_workers_kv_pool_is_that_of_all_its_gpus() -> None:
    config = PlanConfig(gpus=2, slo=SLO(ttft_ms=500, tpot_ms=50), kv_blocks_per_gpu=100)
    (worker,) = planner.workers_for(Layout(0, 1, decode_pp=2), {WorkerShape(1, 2): CARD}, config)
    assert worker.total_blocks == 200


@pytest.mark.parametrize(("text", "shape"),
                         [("2", WorkerShape(2)), ("2x4", WorkerShape(2, 4)), ("1X2", WorkerShape(1, 2))])
def test_worker_shapes_parse(text: str, shape: WorkerShape) -> None:
    assert WorkerShape.parse(text) == shape


@pytest.mark.parametrize("text", ["", "x2", "2x", "0x2", "2y2"])
def test_a_bad_worker_shape_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="worker shape|tp >= 1"):
        WorkerShape.parse(text)

@pytest.mark.parametrize(
    ("text", "samples"),
    [("64", {64}), ("fixed:7", {7}), ("uniform:10:12", {10, 11, 12})],
)
def test_length_distributions_parse_and_sample(text: str, samples: set[int]) -> None:
    import random

    rng = random.Random(0)
    assert {SyntheticLengths.parse(text).sample(rng) for _ in range(50)} <= samples


@pytest.mark.parametrize("text", ["", "gauss:1:2", "uniform:5", "lognormal:a:1"])
def test_a_bad_length_distribution_is_refused_with_the_valid_forms(text: str) -> None:
    with pytest.raises(ValueError, match="uniform:A:B"):
        SyntheticLengths.parse(text)


def test_a_trace_needs_times_and_lengths() -> None:
    trace = trace_from_rows([{"time_s": 1.0, "prompt_tokens": 64, "output_tokens": 8},
                             {"time_s": 0.5, "prompt_tokens": 32, "output_tokens": 4}])
    assert [a.prompt_tokens for a in trace] == [32, 64]  # sorted by time
    with pytest.raises(ValueError, match="row 0"):
        trace_from_rows([{"time_s": 1.0, "prompt_tokens": 64}])


PLAN_REQUESTS = 30  # the layouts rank alike on traces of 20, 30 and 60 requests; 60 doubled the long-prompt plan's time


def _plan(prompt: str, output: str, rate: float, slo: SLO) -> list[str]:
    trace = synthetic_trace(SyntheticLengths.parse(prompt), SyntheticLengths.parse(output), rate, PLAN_REQUESTS)
    config = PlanConfig(gpus=4, slo=slo, search_tolerance=0.25, seeds=1)
    return [r.layout.name for r in plan(trace, {1: CARD}, config).results]


def test_long_prompts_with_a_tight_tpot_get_more_prefill_than_decode_gpus() -> None:
    ranked = _plan("8100", "32", 3.0, SLO(ttft_ms=1000, tpot_ms=20))
    assert ranked.index("3P1D") < ranked.index("1P3D")


def test_a_decode_heavy_workload_does_not_get_one_decode_gpu() -> None:
    ranked = _plan("64", "512", 40.0, SLO(ttft_ms=500, tpot_ms=50))
    assert ranked[-1] == "3P1D"


def test_baton_plan_prints_a_recommendation_and_writes_every_layout(tmp_path: Path, capsys) -> None:
    profile = tmp_path / "card.json"
    profile.write_text(CARD.to_json())
    out = tmp_path / "plan.json"
    code = main(["plan", "--gpus", "2", "--profile", str(profile), "--prompt-tokens", "512", "--output-tokens",
                 "64", "--rate", "5", "--requests", "40", "--no-search", "--json", str(out)])
    assert code == 0
    written = json.loads(out.read_text())
    assert {row["layout"] for row in written["layouts"]} == {"co-located x2", "1P1D"}
    assert f"recommended: {written['recommended']}" in capsys.readouterr().out


def test_baton_plan_refuses_a_bad_tp_profile_argument(tmp_path: Path, capsys) -> None:
    profile = tmp_path / "card.json"
    profile.write_text(CARD.to_json())
    assert main(["plan", "--gpus", "2", "--profile", str(profile), "--profile-tp", "two=x.json"]) == 2
    assert "expected N=FILE" in capsys.readouterr().err


@pytest.mark.parametrize("knee_rps", [7.3, 30.9, 0.5])
def test_the_capacity_search_bisects_to_the_tolerance(monkeypatch, knee_rps: float) -> None:
    """The rate found is within the tolerance below the knee, not on a coarse grid of the workload's rate."""
    trace = synthetic_trace(SyntheticLengths.parse("64"), SyntheticLengths.parse("8"), 4.0, 40)
    rate = planner._rate(trace)
    monkeypatch.setattr(planner, "scaled_trace", lambda _, factor: factor)  # the replay sees only the factor
    monkeypatch.setattr(planner, "mean_attainment", lambda factor, *_: 1.0 if factor * rate <= knee_rps else 0.5)
    config = PlanConfig(gpus=1, slo=SLO(ttft_ms=500, tpot_ms=50), search_tolerance=0.01)
    found = planner._capacity(trace, Layout(0, 1), {1: CARD}, config)
    assert knee_rps * 0.98 <= found <= knee_rps * 1.001


def test_attainment_is_averaged_over_the_noise_seeds() -> None:
    trace = synthetic_trace(SyntheticLengths.parse("2048"), SyntheticLengths.parse("64"), 60.0, 80)
    config = PlanConfig(gpus=1, slo=SLO(ttft_ms=300, tpot_ms=30), seeds=1)
    layout = Layout(0, 1)
    each = [planner.replay_layout(trace, layout, {1: CARD}, PlanConfig(gpus=1, slo=config.slo, seed=s)).goodput
            for s in range(3)]
    averaged = planner.mean_attainment(trace, layout, {1: CARD}, PlanConfig(gpus=1, slo=config.slo, seeds=3))
    assert averaged == pytest.approx(sum(each) / 3)


def _scored(prefill: int, decode: int, capacity: float) -> planner.LayoutResult:
    return planner.LayoutResult(Layout(prefill, decode), 1.0, 1.0, None, None, capacity_rps=capacity)


def test_layouts_within_the_tie_margin_rank_by_fewer_prefill_gpus() -> None:
    results = [_scored(2, 2, 31.4), _scored(0, 4, 30.6), _scored(3, 1, 31.0), _scored(1, 3, 28.4)]
    assert [r.layout.name for r in planner.rank(results, 0.05)] == ["co-located x4", "2P2D", "3P1D", "1P3D"]
    assert [r.layout.name for r in planner.rank(results, 0.0)] == ["2P2D", "3P1D", "co-located x4", "1P3D"]


def test_a_tie_margin_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="tie_margin"):
        PlanConfig(gpus=1, slo=SLO(ttft_ms=500, tpot_ms=50), tie_margin=1.0)


@pytest.mark.parametrize("bad", [{"search_tolerance": 0.0}, {"seeds": 0}])
def test_a_search_without_tolerance_or_seeds_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="search_tolerance"):
        PlanConfig(gpus=1, slo=SLO(ttft_ms=500, tpot_ms=50), **bad)  # type: ignore[arg-type]


def test_the_host_kv_tier_reaches_every_simulated_worker_scaled_by_tp() -> None:
    config = PlanConfig(gpus=4, slo=SLO(500, 50), host_kv_blocks_per_gpu=1000, host_load_s_per_block=2e-5)
    workers = planner.workers_for(Layout(1, 1, 2, 2), {2: WorkerProfile()}, config)
    assert [(w.host_cache_blocks, w.host_load_s_per_block) for w in workers] == [(2000, 2e-5)] * 2
    assert all(w.host_cache_blocks == 0 for w in planner.workers_for(Layout(0, 4, decode_tp=1), {1: WorkerProfile()},
                                                                     PlanConfig(gpus=4, slo=SLO(500, 50))))
