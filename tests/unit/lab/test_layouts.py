"""The DistServe experiment's layouts (c<N>, <X>p<Y>d), its per-GPU ranking, and the planner's naming."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from lab.experiments import distserve_assets
from lab.experiments.distserve import parse_args, run_label
from lab.experiments.distserve_cluster import Cluster
from lab.experiments.distserve_plan import make_plan
from lab.experiments.distserve_report import ranking
from lab.experiments.layout_check import measured_name
from lab.experiments.layouts import parse_layout
from scheduler.adapters.main import add_scheduler_arguments
from scheduler.planner import Layout
from services.worker.main import add_worker_args


def test_disaggregated_layout_places_prefill_first_on_consecutive_gpus() -> None:
    plans = parse_layout("1p3d").worker_plans(tp=1)
    assert [(p.role, p.gpus) for p in plans] == [("prefill", (0,)), ("decode", (1,)), ("decode", (2,)),
                                                 ("decode", (3,))]
    assert len({p.name for p in plans}) == 4


def test_tensor_parallel_workers_take_tp_gpus_each() -> None:
    plans = parse_layout("2p2d").worker_plans(tp=2)
    assert [p.gpus for p in plans] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert parse_layout("2p2d").gpus(2) == 8


def test_colocated_and_aliases() -> None:
    assert [p.role for p in parse_layout("c4").worker_plans()] == ["both"] * 4
    assert parse_layout("disagg").layout == Layout(1, 1)
    assert parse_layout("colocated").layout == Layout(0, 2)
    assert parse_layout("disagg").name == "disagg"  # run files keep the name they were given


@pytest.mark.parametrize("bad", ["0p2d", "2p0d", "c0", "p1d", "4", "mixed", ""])
def test_bad_layout_names_are_refused_with_the_valid_forms(bad: str) -> None:
    with pytest.raises(ValueError, match=r"c<N>.*<X>p<Y>d"):
        parse_layout(bad)


def test_ranking_orders_by_per_gpu_goodput_and_marks_censored_bounds() -> None:
    goodput = {
        "c4": {"per_gpu": 6.0, "censored_at_top_rate": False},
        "1p3d": {"per_gpu": 5.7, "censored_at_top_rate": True},
        "3p1d": {"per_gpu": None, "censored_at_top_rate": False},  # failed even at the lowest rate
    }
    ranked = ranking(goodput)
    assert [r["config"] for r in ranked] == ["c4", "1p3d"]
    assert ranked[0]["of_best"] == 1.0
    assert ranked[1]["of_best"] == pytest.approx(0.95)
    assert ranked[1]["censored"] is True


def test_planner_layouts_map_onto_the_experiments_names() -> None:
    assert measured_name(Layout(0, 4)) == "c4"
    assert measured_name(Layout(1, 3)) == "1p3d"
    assert parse_layout(measured_name(Layout(3, 1))).gpus(1) == Layout(3, 1).gpus


def test_worker_args_reach_every_worker_as_valid_worker_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distserve_assets, "unpack_sharegpt", lambda dest: dest)
    args = parse_args(["--smoke", "--worker-args=--gil-switch-interval-ms 0.2 --no-kv-checksums"])
    engine_args = make_plan(tmp_path, args).spec.engine_args
    assert engine_args[-3:] == ("--gil-switch-interval-ms", "0.2", "--no-kv-checksums")
    worker = argparse.ArgumentParser()
    add_worker_args(worker)
    parsed = worker.parse_args(["--role", "decode", *engine_args])
    assert parsed.gil_switch_interval_ms == 0.2 and parsed.kv_checksums is False


def test_a_tapped_run_starts_the_scheduler_tap_with_the_schedulers_flags(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distserve_assets, "unpack_sharegpt", lambda dest: dest)
    spec = make_plan(tmp_path, parse_args(["--smoke", "--policy", "goodput", "--tap-scheduler"])).spec
    scheduler = Cluster("c1", spec, tmp_path / "logs").scheduler_spec()
    assert scheduler.module == "lab.experiments.scheduler_tap"
    tap = argparse.ArgumentParser()
    add_scheduler_arguments(tap)
    tap.add_argument("--tap-out")
    parsed = tap.parse_args(["--host", "127.0.0.1", "--port", "5000", "--metrics-port", "5001", *scheduler.args])
    assert parsed.policy == "goodput" and parsed.tap_out == str(tmp_path / "logs" / "c1-scheduler_tap.json")
    untapped = Cluster("c1", make_plan(tmp_path, parse_args(["--smoke"])).spec, tmp_path / "logs")
    assert untapped.scheduler_spec().module == "scheduler.adapters"


def test_each_layout_runs_under_each_stack_with_its_own_label() -> None:
    args = parse_args(["--smoke", "--configs", "c1", "--stacks", "bare", "product"])
    labels = [run_label(c, s, args.stacks) for c in args.configs for s in args.stacks]
    assert labels == ["c1+bare", "c1+product"]
    assert run_label("c1", "bare", ["bare"]) == "c1"  # a bare-only run keeps the layout's own name


def test_a_product_run_names_its_workers_by_layout_and_its_logs_by_label(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distserve_assets, "unpack_sharegpt", lambda dest: dest)
    spec = make_plan(tmp_path, parse_args(["--smoke"])).spec
    cluster = Cluster("c1+product", spec, tmp_path / "logs", "c1", {"BATON_SAFETY_ADDRESS": "127.0.0.1:1"})
    assert [p.role for p in cluster.plans] == ["both"]
    assert cluster.tap_path.name == "c1+product-scheduler_tap.json"
