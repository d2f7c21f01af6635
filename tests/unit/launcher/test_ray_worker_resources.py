"""What a Ray-placed worker asks Ray for and runs with: one GPU per process of its group (EP x TP), no Ray."""

from __future__ import annotations

import argparse

import pytest

from services.launcher.ray_cluster import RayClusterConfig, RayEndpoints, worker_argv
from services.launcher.ray_main import config_from_args, register_ray_command

ENDPOINTS = RayEndpoints(scheduler="10.0.0.1:7000", prefill=["10.0.0.2:7001"])


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (1, 4), (2, 4)])
def test_a_cuda_worker_reserves_one_gpu_per_rank_of_its_group(tp: int, ep: int) -> None:
    config = RayClusterConfig(address="auto", prefill_workers=0, tensor_parallel_size=tp, expert_parallel_size=ep,
                              device="cuda")
    assert config.gpus_per_worker == tp * ep
    argv = worker_argv(config, "decode-0", "decode", RayEndpoints(scheduler="10.0.0.1:7000"))
    assert _flag(argv, "--tensor-parallel-size") == str(tp) and _flag(argv, "--expert-parallel-size") == str(ep)


def test_a_cpu_worker_reserves_no_gpu() -> None:
    assert RayClusterConfig(address="auto", prefill_workers=0, expert_parallel_size=2).gpus_per_worker == 0


def test_an_expert_parallel_worker_serves_role_both() -> None:
    """The worker refuses `--expert-parallel-size` with role prefill or decode (no per-replica hand-off)."""
    config = RayClusterConfig(address="auto", prefill_workers=0, expert_parallel_size=2, device="cuda")
    argv = worker_argv(config, "decode-0", "decode", RayEndpoints(scheduler="10.0.0.1:7000"))
    assert _flag(argv, "--role") == "both" and "--prefill-peers" not in argv


def test_a_plain_decode_worker_keeps_its_role_and_prefill_peers() -> None:
    argv = worker_argv(RayClusterConfig(address="auto"), "decode-0", "decode", ENDPOINTS)
    assert _flag(argv, "--role") == "decode" and _flag(argv, "--prefill-peers") == "10.0.0.2:7001"


def test_expert_parallelism_with_prefill_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill_workers 0"):
        RayClusterConfig(address="auto", prefill_workers=1, expert_parallel_size=2)


def test_the_cli_flag_reaches_the_config() -> None:
    parser = argparse.ArgumentParser()
    register_ray_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["ray", "up", "--prefill", "0", "--device", "cuda", "--tensor-parallel-size", "2",
                              "--expert-parallel-size", "4"])
    assert config_from_args(args, {}).gpus_per_worker == 8
