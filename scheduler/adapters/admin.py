"""`baton scheduler workers | set-role`: operator commands against a running scheduler (gRPC).

    baton scheduler workers [--scheduler HOST:PORT]
    baton scheduler set-role WORKER_ID {prefill,decode,both} [--wait S]

`set-role` asks the scheduler to drain the worker (no new placements; its work in flight finishes)
and then to tell it its new role in its next heartbeat answer; with `--wait` it polls ListWorkers
until the worker reports the role (exit 0) or the time runs out (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import grpc

from rpcgen.baton.v1 import scheduler_pb2 as pb
from rpcgen.baton.v1 import scheduler_pb2_grpc as pb_grpc
from scheduler.adapters.server import DEFAULT_PORT
from scheduler.types import WorkerRole
from services.common.cluster_auth import TOKEN_ENV, ClusterToken, sync_internal_channel

_STATES = {
    pb.RoleSwitch.STATE_DRAINING: "draining",
    pb.RoleSwitch.STATE_SWITCHING: "switching",
    pb.RoleSwitch.STATE_DONE: "done",
}
_POLL_S = 0.2
_RPC_TIMEOUT_S = 5.0


def add_admin_commands(parser: argparse.ArgumentParser) -> None:
    """Subcommands of `baton scheduler` (without one, `baton scheduler` runs the service)."""
    sub = parser.add_subparsers(dest="scheduler_command", metavar="{workers,set-role}")
    p = sub.add_parser("workers", help="list the live workers, their roles and any role switch")
    _client_args(p)
    p.set_defaults(func=cmd_workers)
    p = sub.add_parser("set-role", help="drain a worker and switch it to prefill, decode or both")
    p.add_argument("worker_id")
    p.add_argument("role", choices=[r.value for r in WorkerRole])
    p.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for the worker to report its new role")
    _client_args(p)
    p.set_defaults(func=cmd_set_role)


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scheduler", default=f"127.0.0.1:{DEFAULT_PORT}", help="the scheduler's host:port")
    p.add_argument("--json", action="store_true", help="print JSON")


def _channel(args: argparse.Namespace) -> grpc.Channel:
    """To the scheduler, with the cluster token of the environment (`BATON_CLUSTER_TOKEN`)."""
    return sync_internal_channel(args.scheduler, ClusterToken.from_environ(os.environ))


def switch_json(switch: pb.RoleSwitch) -> dict[str, str]:
    return {"worker_id": switch.worker_id, "from_role": switch.from_role, "to_role": switch.to_role,
            "state": _STATES.get(switch.state, "")}


def cmd_workers(args: argparse.Namespace) -> int:
    try:
        with _channel(args) as channel:
            listed = pb_grpc.SchedulerStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=_RPC_TIMEOUT_S)
    except grpc.RpcError as e:
        return _failed(e)
    rows = [{"worker_id": w.status.worker_id, "role": w.status.role, "address": w.address,
             "running": w.status.running_seqs, "queued": w.status.queue_depth,
             "switch": switch_json(w.role_switch) if w.HasField("role_switch") else None}
            for w in listed.workers]
    if args.json:
        print(json.dumps(rows))
        return 0
    for row in rows:
        switch = row["switch"]
        pending = f"  -> {switch['to_role']} ({switch['state']})" if switch else ""
        print(f"{row['worker_id']:<24} {row['role']:<8} {row['address']:<24} running={row['running']} "
              f"queued={row['queued']}{pending}")
    return 0


def cmd_set_role(args: argparse.Namespace) -> int:
    request = pb.SetRoleRequest(worker_id=args.worker_id, role=args.role)
    try:
        with _channel(args) as channel:
            stub = pb_grpc.SchedulerStub(channel)
            switch = stub.SetRole(request, timeout=_RPC_TIMEOUT_S).role_switch
            give_up = time.monotonic() + args.wait
            while switch.state != pb.RoleSwitch.STATE_DONE and time.monotonic() < give_up:
                time.sleep(_POLL_S)
                switch = _current(stub, args.worker_id, args.role) or switch
    except grpc.RpcError as e:
        return _failed(e)
    print(json.dumps(switch_json(switch)) if args.json else
          f"{switch.worker_id}: {switch.from_role} -> {switch.to_role}: {_STATES.get(switch.state, '')}")
    return 0 if switch.state == pb.RoleSwitch.STATE_DONE or not args.wait else 1


def _current(stub: pb_grpc.SchedulerStub, worker_id: str, role: str) -> pb.RoleSwitch | None:
    """The worker's switch as ListWorkers shows it; DONE once it lists with the new role."""
    for worker in stub.ListWorkers(pb.ListWorkersRequest(), timeout=_RPC_TIMEOUT_S).workers:
        if worker.status.worker_id != worker_id:
            continue
        if worker.HasField("role_switch"):
            return worker.role_switch
        if worker.status.role == role:
            return pb.RoleSwitch(worker_id=worker_id, to_role=role, state=pb.RoleSwitch.STATE_DONE)
    return None


def _failed(e: grpc.RpcError) -> int:
    code = e.code() if isinstance(e, grpc.Call) else None
    details = e.details() if isinstance(e, grpc.Call) else str(e)
    print(f"baton scheduler: error: {code.name if code else 'RPC'}: {details}", file=sys.stderr)
    if code is grpc.StatusCode.UNAUTHENTICATED:
        print(f"baton scheduler: set {TOKEN_ENV} to the cluster's token (`baton serve`: run.json's cluster_token)",
              file=sys.stderr)
    return 2
