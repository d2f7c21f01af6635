"""A layout's workers (fleet.py): names, roles, prefill peers, GPUs; and `baton serve`'s cluster spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.planner import Layout
from scheduler.types import WorkerRole
from services.common.errors import ConfigError
from services.launcher.builder import ClusterSpec
from services.launcher.cluster import ServeOptions, serve_cluster_spec
from services.launcher.fleet import RoleArgs, WorkerFleet, WorkerNaming
from services.launcher.infra import InfraEndpoints
from services.launcher.models import ModelSpec
from services.launcher.supervisor import RestartPolicy

INFRA = InfraEndpoints("postgresql://u@127.0.0.1:1/db", "redis://127.0.0.1:2/0", "127.0.0.1:3")


def test_each_decode_worker_hands_off_from_every_prefill_worker_of_its_fleet() -> None:
    plans = WorkerFleet(Layout(2, 2)).plans()
    assert [(p.name, p.role) for p in plans] == [
        ("worker-prefill", WorkerRole.PREFILL), ("worker-prefill-1", WorkerRole.PREFILL),
        ("worker-decode", WorkerRole.DECODE), ("worker-decode-1", WorkerRole.DECODE)]
    both = ("worker-prefill", "worker-prefill-1")
    assert [p.prefill_peers for p in plans] == [(), (), both, both]


def test_a_colocated_layout_is_both_workers_without_peers() -> None:
    plans = WorkerFleet(Layout(0, 2), RoleArgs(common=("--x",), both=("--y",))).plans()
    assert [(p.role, p.args, p.prefill_peers) for p in plans] == [(WorkerRole.BOTH, ("--x", "--y"), ())] * 2


def test_gpu_naming_places_each_shape_on_consecutive_gpus_and_pins_them() -> None:
    fleet = WorkerFleet(Layout(1, 2, prefill_tp=2, decode_tp=1), naming=WorkerNaming.GPUS, pin_gpus=True,
                        worker_ids=True)
    plans = fleet.plans()
    assert [(p.name, p.gpus, p.env["CUDA_VISIBLE_DEVICES"]) for p in plans] == [
        ("prefill-gpu0-1", (0, 1), "0,1"), ("decode-gpu2", (2,), "2"), ("decode-gpu3", (3,), "3")]
    assert all(p.worker_id for p in plans)


def test_unpinned_workers_inherit_the_devices() -> None:
    assert all(p.env == {} for p in WorkerFleet(Layout(1, 1)).plans())


def test_role_args_go_to_their_role_after_the_common_ones() -> None:
    args = RoleArgs(common=("--a",), prefill=("--p",), decode=("--d",))
    plans = WorkerFleet(Layout(1, 1), args).plans()
    assert [p.args for p in plans] == [("--a", "--p"), ("--a", "--d")]


def test_serve_names_the_default_models_workers_plainly_and_others_by_model(tmp_path: Path) -> None:
    options = ServeOptions(models=(ModelSpec("SmolLM2-135M-Instruct"), ModelSpec("baton-tiny-random", "tiny")),
                           disk_kv_dir=tmp_path, disk_kv_gib=1.0)
    spec = serve_cluster_spec(options, INFRA, RestartPolicy())
    assert [(w.name, w.model) for w in spec.workers] == [
        ("worker-prefill", "SmolLM2-135M-Instruct"), ("worker-decode", "SmolLM2-135M-Instruct"),
        ("worker-tiny-prefill", "tiny"), ("worker-tiny-decode", "tiny")]
    assert spec.workers[3].prefill_peers == ("worker-tiny-prefill",)
    tiny_decode = spec.workers[3].args
    assert tiny_decode[tiny_decode.index("--model-id") + 1] == "tiny"
    assert tiny_decode[tiny_decode.index("--disk-kv-dir") + 1] == str(tmp_path / "worker-tiny-decode")
    assert spec.gateway is not None and spec.gateway.env["BATON_EXTRA_MODELS"] == '{"tiny": "baton-tiny-random"}'


def test_serve_without_scheduler_or_safety_starts_neither() -> None:
    spec = serve_cluster_spec(ServeOptions(workers_role="both", scheduler=False, safety=False), INFRA, RestartPolicy())
    assert spec.scheduler is None and spec.safety is None and spec.billing is not None
    assert [w.name for w in spec.workers] == ["worker-both"]
    assert spec.restart == RestartPolicy()


def test_a_cluster_spec_refuses_a_decode_peer_that_is_no_earlier_prefill_worker() -> None:
    prefill, decode = WorkerFleet(Layout(1, 1)).plans()
    with pytest.raises(ConfigError, match="prefill peers \\['worker-prefill'\\]"):
        ClusterSpec((decode, prefill))  # the decode worker needs its peer's address when it starts
    with pytest.raises(ConfigError, match="two workers are named 'worker-prefill'"):
        ClusterSpec((prefill, prefill))
    assert ClusterSpec((prefill, decode)).workers[1].prefill_peers == ("worker-prefill",)
