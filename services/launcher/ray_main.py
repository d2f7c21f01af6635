"""`baton ray up --address ADDR`: run Baton on an existing Ray cluster until Ctrl-C / SIGTERM.

The only place the Ray launcher reads the environment: every `BATON_*` variable of this shell is
handed to the gateway (e.g. BATON_AUTH_MODE, BATON_DATABASE_URL, BATON_REDIS_URL,
BATON_KAFKA_BOOTSTRAP). See ray_cluster.py for what runs where.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from types import FrameType

from services.common.cluster_auth import ClusterToken
from services.launcher.ray_cluster import RayCluster, RayClusterConfig


def register_ray_command(subparsers: argparse._SubParsersAction) -> None:
    """Add `ray up` to the `baton` console script (services/cli.py)."""
    ray = subparsers.add_parser("ray", help="run Baton on an existing Ray cluster (multi-node, no Kubernetes)")
    actions = ray.add_subparsers(dest="ray_command", required=True)
    p = actions.add_parser("up", help="place the scheduler, workers, safety and gateway as Ray actors")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto, as `ray start` left it)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0: decode workers prefill locally)")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per worker (with --device cuda)")
    p.add_argument("--expert-parallel-size", type=int, default=1,
                   help="MoE models: expert ranks per worker, one GPU each (x --tensor-parallel-size; needs "
                        "--prefill 0: such a worker serves role both)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--model", default=None, help="HF model dir, the same path on every node (default: SmolLM2)")
    p.add_argument("--worker-arg", action="append", default=[], metavar="FLAG",
                   help="an extra `baton worker` flag, e.g. --worker-arg=--num-blocks=512 (repeatable)")
    p.add_argument("--scheduler-arg", action="append", default=[], metavar="FLAG",
                   help="an extra `baton scheduler` flag, e.g. --scheduler-arg=--policy=round_robin (repeatable)")
    p.add_argument("--safety", action="store_true", help="also run the safety service")
    p.add_argument("--no-gateway", action="store_true", help="do not start a gateway (workers and scheduler only)")
    p.set_defaults(func=run_ray_command)


def config_from_args(args: argparse.Namespace, environ: dict[str, str]) -> RayClusterConfig:
    return RayClusterConfig(
        address=args.address, prefill_workers=args.prefill, decode_workers=args.decode,
        tensor_parallel_size=args.tensor_parallel_size, expert_parallel_size=args.expert_parallel_size,
        device=args.device, model=args.model,
        worker_args=tuple(args.worker_arg), scheduler_args=tuple(args.scheduler_arg), safety=args.safety,
        gateway=not args.no_gateway,
        gateway_env={k: v for k, v in environ.items() if k.startswith("BATON_")},
        cluster_token=ClusterToken.from_environ(environ) or ClusterToken.generate())


def run_ray_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    try:
        cluster = RayCluster(config_from_args(args, dict(os.environ)))
    except ValueError as e:
        print(f"baton ray: error: {e}", file=sys.stderr)
        return 2
    stop = {"now": False}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        ep = cluster.up()
        print(f"Baton on Ray: gateway http://{ep.gateway}  scheduler {ep.scheduler}  prefill {ep.prefill}  "
              f"decode {ep.decode}" + (f"  safety {ep.safety}" if ep.safety else ""), flush=True)
        dead = cluster.watch(lambda: stop["now"])
        if dead is not None:
            print(f"baton ray: {dead} exited; stopping. Its log:\n{cluster.log_tail(dead)}", file=sys.stderr)
            return 1
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"baton ray: error: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.down()
