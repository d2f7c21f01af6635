"""`baton status`: what the `baton serve` of this machine runs, and whether each part of it answers.

The run file (rundir.py) is found by `--data-dir D` (D/run.json) or else by the gateway's `--port`
(default 8000), through the link `baton serve` leaves in the run index. Every component is probed by
what it serves on each port (`Endpoint`): gRPC health (grpc.health.v1, the overall service ""), the
gateway's /healthz and /readyz, Prometheus /metrics, a TCP connect for the embedded infrastructure;
each worker is asked which model it serves (Worker.GetStatus, with the run file's cluster token).
Prints a table, or one JSON object with `--json`. Exit status: 0 the cluster is ready and every probe
passed, 1 something is down or still starting (`StatusExit`), 3 no running cluster there.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import socket
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from services.launcher.rundir import RUN_FILE, Endpoint, RunState, indexed_run_file

PROBE_TIMEOUT_S = 2.0


class StatusExit(enum.IntEnum):
    HEALTHY = 0
    UNHEALTHY = 1  # a component down, a probe failing, or the cluster still starting / stopping
    NOT_RUNNING = 3  # no run file there, or its `baton serve` is gone (as `systemctl status` says)


@dataclass(frozen=True)
class Probe:
    check: str  # grpc-health | healthz | readyz | metrics | tcp
    port: int
    ok: bool
    detail: str = ""  # why it failed


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    pid: int | None  # None: not running now (not started yet, or dead and waiting for its restart)
    restarts: int
    ports: dict[str, int]  # Endpoint value -> port
    probes: tuple[Probe, ...]
    model: str | None = None  # workers: the model they serve
    kv_tiers: tuple[str, ...] = ()  # workers with KV tiers: one gauge line per tier (host, disk)

    @property
    def healthy(self) -> bool:
        return self.pid is not None and all(p.ok for p in self.probes)


@dataclass(frozen=True)
class ClusterStatus:
    run_file: str
    serve_pid: int
    state: str  # RunState value
    gateway: str
    grpc: str | None
    components: tuple[ComponentStatus, ...]
    metrics: dict[str, str]  # component -> its Prometheus URL

    @property
    def healthy(self) -> bool:
        return self.state == RunState.READY and all(c.healthy for c in self.components)


class NoClusterError(LookupError):
    """No run file where we looked, or the `baton serve` that wrote it is gone."""


def find_run_file(port: int, data_dir: Path | None) -> Path:
    run_file = data_dir / RUN_FILE if data_dir is not None else indexed_run_file(port)
    where = f"--data-dir {data_dir}" if data_dir is not None else f"--port {port}"
    if not run_file.is_file():
        raise NoClusterError(f"no `baton serve` with {where} is running ({run_file} does not exist)")
    return run_file.resolve()  # the run dir's own file, not the index's link to it


def cluster_status(run_file: Path) -> ClusterStatus:
    try:
        run = json.loads(run_file.read_text())
    except (OSError, ValueError) as e:
        raise NoClusterError(f"cannot read {run_file}: {e}") from e
    if not _alive(int(run["serve_pid"])):
        raise NoClusterError(f"the `baton serve` of {run_file} (pid {run['serve_pid']}) is gone")
    pids, restarts = run.get("pids", {}), run.get("restarts", {})
    components = tuple(
        _component(name, {Endpoint(k): int(v) for k, v in ports.items()}, pids.get(name), restarts.get(name, 0), run)
        for name, ports in run.get("endpoints", {}).items())
    return ClusterStatus(str(run_file), int(run["serve_pid"]), run.get("state", RunState.STARTING.value),
                         run["gateway"], run.get("grpc"), components, run.get("metrics", {}))


def _component(name: str, ports: dict[Endpoint, int], pid: int | None, restarts: int,
               run: dict[str, object]) -> ComponentStatus:
    pid = pid if pid is not None and _alive(pid) else None
    probes: list[Probe] = []
    for endpoint, port in ports.items():
        probes += _probe(endpoint, port, str(run["gateway"]), str(run.get("grpc") or ""))
    is_worker = name.startswith("worker-") and Endpoint.GRPC in ports
    model, tiers = _worker_info(ports[Endpoint.GRPC], run.get("cluster_token")) if is_worker else (None, ())
    return ComponentStatus(name, pid, restarts, {e.value: p for e, p in ports.items()}, tuple(probes), model, tiers)


def _probe(endpoint: Endpoint, port: int, gateway_url: str, grpc_target: str) -> list[Probe]:
    if endpoint is Endpoint.HTTP:
        return [_http(check, port, f"{gateway_url}/{check}") for check in ("healthz", "readyz", "metrics")]
    if endpoint is Endpoint.METRICS:
        return [_http("metrics", port, f"http://127.0.0.1:{port}/metrics")]
    if endpoint is Endpoint.GRPC:
        return [_grpc_health(port, grpc_target if grpc_target.endswith(f":{port}") else f"127.0.0.1:{port}")]
    return [_tcp(port)]


def _http(check: str, port: int, url: str) -> Probe:
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as response:  # noqa: S310 - a local URL
            return Probe(check, port, int(response.status) == 200)
    except urllib.error.HTTPError as e:  # e.g. /readyz 503 with the failing checks in its body
        return Probe(check, port, False, f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}")
    except OSError as e:
        return Probe(check, port, False, str(e))


def _grpc_health(port: int, target: str) -> Probe:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                              timeout=PROBE_TIMEOUT_S)
    except grpc.RpcError as e:
        return Probe("grpc-health", port, False, f"{e.code().name}: {e.details()}")
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    return Probe("grpc-health", port, serving,
                 "" if serving else health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def _tcp(port: int) -> Probe:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT_S):
            return Probe("tcp", port, True)
    except OSError as e:
        return Probe("tcp", port, False, str(e))


def _worker_info(port: int, cluster_token: object) -> tuple[str | None, tuple[str, ...]]:
    """The worker's served model and its KV tier gauges; GetStatus asks for the cluster token (the run
    file's)."""
    import grpc

    from rpcgen.baton.v1 import worker_pb2 as wpb
    from rpcgen.baton.v1 import worker_pb2_grpc as wpb_grpc
    from services.common.cluster_auth import ClusterToken, sync_internal_channel

    token = ClusterToken(cluster_token) if isinstance(cluster_token, str) else None
    try:
        with sync_internal_channel(f"127.0.0.1:{port}", token) as channel:
            s = wpb_grpc.WorkerStub(channel).GetStatus(wpb.StatusRequest(), timeout=PROBE_TIMEOUT_S)
    except grpc.RpcError:
        return None, ()  # its health probe says why
    return str(s.model), tuple(kv_tier_line(t.tier, t.occupied_blocks, t.capacity_blocks, t.pinned_blocks,
                                            t.hit_blocks, t.spills_dropped) for t in s.kv_tiers)


def kv_tier_line(tier: str, occupied: int, capacity: int, pinned: int, hits: int, spills_dropped: int = 0) -> str:
    """One KV tier's gauges as `baton status` prints them under its worker; the disk tier's also counts the
    host evictions it missed (dropped: the disk writer was behind)."""
    line = f"kv {tier}: {occupied}/{capacity} blocks, {pinned} pinned, {hits} hits"
    return line + f", {spills_dropped} spills dropped" if tier == "disk" else line


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, but alive
    return True


def render(status: ClusterStatus) -> str:
    """The table `baton status` prints."""
    verdict = "healthy" if status.healthy else "NOT healthy"
    lines = [f"baton serve (pid {status.serve_pid}): {status.state}, {verdict}",
             f"gateway: {status.gateway}" + (f"   gRPC API: {status.grpc}" if status.grpc else ""),
             f"run file: {status.run_file}", "",
             f"{'COMPONENT':<22} {'PID':>7} {'RESTARTS':>8}  {'STATUS':<6} {'MODEL':<24} PORTS / PROBES"]
    for c in status.components:
        probes = "  ".join(f"{p.check}:{p.port}={'ok' if p.ok else 'FAIL'}" for p in c.probes)
        lines.append(f"{c.name:<22} {c.pid or '-':>7} {c.restarts:>8}  {'up' if c.healthy else 'DOWN':<6} "
                     f"{c.model or '-':<24} {probes}")
        lines += [f"{'':<22} {p.check}:{p.port}: {p.detail}" for p in c.probes if not p.ok and p.detail]
        lines += [f"{'':<22} {tier}" for tier in c.kv_tiers]
    return "\n".join(lines)


def to_json(status: ClusterStatus) -> dict[str, object]:
    """What `baton status --json` prints: the status, with each verdict spelled out."""
    components = [{**dataclasses.asdict(c), "healthy": c.healthy} for c in status.components]
    return {"running": True, "healthy": status.healthy, **dataclasses.asdict(status), "components": components}


def register_status_command(subparsers: argparse._SubParsersAction) -> None:
    """Add `status` to the `baton` console script (services/cli.py)."""
    p = subparsers.add_parser("status", help="show the local `baton serve` cluster: pids, ports, health, models")
    p.add_argument("--port", type=int, default=8000, help="the gateway port of the `baton serve` to show")
    p.add_argument("--data-dir", type=Path, default=None, help="the --data-dir of the `baton serve` to show")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run_status_command)


def run_status_command(args: argparse.Namespace) -> int:
    try:
        status = cluster_status(find_run_file(args.port, args.data_dir))
    except NoClusterError as e:
        if args.json:
            print(json.dumps({"running": False, "error": str(e)}))
        else:
            print(f"baton status: {e}", file=sys.stderr)
        return StatusExit.NOT_RUNNING
    if args.json:
        print(json.dumps(to_json(status), indent=1))
    else:
        print(render(status))
    return StatusExit.HEALTHY if status.healthy else StatusExit.UNHEALTHY
