"""The experiments' clusters as cluster-builder specs: what each starts, with which flags (no processes)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lab.experiments import distserve_assets
from lab.experiments.cluster import ExperimentInfra, PolicyStack, StackConfig, WorkerFlags
from lab.experiments.distserve import parse_args
from lab.experiments.distserve_cluster import Cluster
from lab.experiments.distserve_plan import make_plan
from scheduler.types import WorkerRole
from services.launcher.infra import InfraEndpoints

INFRA = InfraEndpoints("postgresql://u@127.0.0.1:1/db", "redis://127.0.0.1:2/0", "127.0.0.1:3")


def test_a_policy_stack_is_a_tapped_scheduler_its_own_workers_and_a_gateway(tmp_path: Path) -> None:
    infra = ExperimentInfra(tmp_path)
    infra.endpoints = INFRA  # as if entered: the spec only reads the endpoints
    config = StackConfig("goodput", (WorkerFlags("worker-a", 8), WorkerFlags("worker-b", 1, ("--x",))),
                         {"free": (1000.0, 100.0)})
    spec = PolicyStack(config, infra, tmp_path / "run").cluster_spec()
    assert spec.scheduler is not None and spec.scheduler.module == "lab.experiments.scheduler_tap"
    assert spec.scheduler.args[:4] == ("--policy", "goodput", "--tap-out", str(tmp_path / "run" / "scheduler_tap.json"))
    assert [(w.name, w.role, w.worker_id) for w in spec.workers] == [("worker-a", WorkerRole.BOTH, True),
                                                                      ("worker-b", WorkerRole.BOTH, True)]
    assert spec.workers[1].args[-1] == "--x" and "--max-num-seqs" in spec.workers[1].args
    assert spec.safety is None and spec.billing is None and spec.infra == INFRA
    assert spec.gateway is not None and spec.gateway.port is None  # picked as it starts
    assert json.loads(spec.gateway.env["BATON_SLOS"]) == {"free": {"ttft_ms": 1000.0, "tpot_ms": 100.0}}


def test_a_distserve_gpu_run_pins_each_worker_and_starts_the_workers_together(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distserve_assets, "unpack_sharegpt", lambda dest: dest)
    cpu_spec = make_plan(tmp_path, parse_args(["--smoke"])).spec
    gpu_spec = replace(cpu_spec, cpu=False)
    spec = Cluster("1p2d", gpu_spec, tmp_path / "logs").cluster_spec()
    assert spec.start_workers_together
    assert [(w.name, w.env["CUDA_VISIBLE_DEVICES"], w.prefill_peers) for w in spec.workers] == [
        ("prefill-gpu0", "0", ()), ("decode-gpu1", "1", ("prefill-gpu0",)), ("decode-gpu2", "2", ("prefill-gpu0",))]
    assert all(w.worker_id and "--tensor-parallel-size" in w.args for w in spec.workers)
    on_cpu = Cluster("1p2d", cpu_spec, tmp_path / "logs").cluster_spec()
    assert all("CUDA_VISIBLE_DEVICES" not in w.env for w in on_cpu.workers)


def test_a_product_run_hands_the_products_settings_to_the_gateway(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(distserve_assets, "unpack_sharegpt", lambda dest: dest)
    spec = make_plan(tmp_path, parse_args(["--smoke"])).spec
    product = Cluster("c1+product", spec, tmp_path / "logs", "c1", {"BATON_SAFETY_ADDRESS": "127.0.0.1:1"})
    gateway = product.cluster_spec().gateway
    assert gateway is not None and gateway.env["BATON_SAFETY_ADDRESS"] == "127.0.0.1:1"
    assert "BATON_AUTH_MODE" not in gateway.env
    bare = Cluster("c1", spec, tmp_path / "logs").cluster_spec().gateway
    assert bare is not None and bare.env["BATON_AUTH_MODE"] == "none"
