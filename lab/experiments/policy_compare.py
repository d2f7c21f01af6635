"""Scheduler policies on a real CPU cluster and in the replay simulator, on the same workload.

    .venv/bin/python -m lab.experiments.policy_compare [--out results/policy_compare]
    .venv/bin/python -m lab.experiments.policy_compare --analyze results/policy_compare   # no rerun

README
------
What it answers (the "goodput-aware global scheduler" issue's "must be true" list), on this machine:
1. goodput of `goodput` vs `round_robin` and `least_loaded` at the same request rate (same seed,
   same prompts, same arrival times);
2. `prefix_aware` raises the prefix-cache hit rate over `round_robin` on a multi-turn workload;
3. under overload, enterprise TTFT p90 stays within its SLO while free-tier requests queue or are
   rejected (`goodput`, with `round_robin` as the control).
For every run it also replays the same trace in `scheduler.replay` and prints real vs simulated.

How. Infrastructure (embedded Postgres/Redis/broker) starts once, with one organisation + API key
per tier. Each run then starts a fresh stack (cluster.py): the real scheduler service with a tap
that records what it saw (scheduler_tap.py), two `both` workers with `--torch-threads 1` (they
share the 2 cores) made heterogeneous by their batch limit (`worker-a --max-num-seqs 8`,
`worker-b --max-num-seqs 1`: worker-b runs one sequence at a time and queues the rest inside),
and the gateway. No safety service, no billing consumer: on 2 cores they would only steal CPU.
Tier rate limits are raised so that admission is the scheduler's decision; the scheduler's
heartbeat timeout is 10 s instead of 3 s (cluster.py says why). `baton bench` then drives the
gateway (`--ignore-eos`: every request produces exactly max_tokens tokens).

Runs. `goodput` starts its cost models from the core's default profile, as `baton scheduler`
does without `--profile`; `goodput+profile` is the same policy seeded with the profile `baton
profile --quick` measured once on this machine with the workers' engine flags (`baton_profile.json`).

Workloads (fixed, seeded; the constants below):
- exp1 `random`: 60 single-turn requests, prompt uniform 32-96 tokens, output uniform 16-24,
  Poisson at 1.3 req/s, one tier (enterprise key), SLO TTFT <= 2500 ms, TPOT <= 250 ms;
- exp1_high_rate: exp1's 60 requests (same seed) at 2.0 req/s, RR / LL / goodput only;
- exp2 `multiturn`: 12 conversations x 4 turns, 2 shared system prompts of 256 tokens, 32-token
  user turns, 16 output tokens, conversations start at 0.4/s, SLO as exp1;
- exp3 overload (runs: RR, LL, goodput, goodput+profile): enterprise 24 requests at 0.3 req/s and
  free 240 requests at 3.0 req/s at the same time (two `baton bench` processes, seeds 1 and 2;
  lengths as exp1), SLOs enterprise TTFT 2500 / TPOT 250 ms, free TTFT 6000 / TPOT 500 ms.
The rates were chosen on a quiet machine (capacity ~1.5 req/s for exp1's lengths, so exp1 runs at
~85% load; exp3 offers about twice what the goodput policy serves within SLO); background load
on the shared machine shifts all of this.

Simulator. Per experiment, one profile per worker is fitted to the step samples both workers
reported during that experiment's real runs (all policies pooled; simulate.py explains the fit:
prefill from every worker's pure prefills, decode steps from a per-batch table, and mixed steps,
which workers do not report, priced with a decode share timed from the client's token gaps,
mixed_steps.py); each run's trace is the request stream the real scheduler received (arrival times,
prompt lengths, the gateway's prefix hashes, tiers); the simulated workers report like the real ones.
Simulated goodput is averaged over 5 noise seeds. "sim error" = simulated minus real goodput
fraction, in percentage points. A second replay ("own-fit") uses profiles fitted to that run's
samples alone; it carries that run's background load, so the gap between the two errors is how
much the shared machine's load drifted between runs. Simulated TTFT starts at the scheduler, the
client's at the send: the simulator adds the client's first-token overhead (gateway, the token's way
out), the median excess over the prefill of requests that found their worker idle (~40-60 ms here).
TTFT and TPOT p90, real and simulated, are over every bench's requests together, completed ones only.
The simulated clients give up as the benches' do (`CLIENTS`: after 120 s a request is a timeout, not
served), and the simulated gateway then aborts the generation after its detach grace, as the real one
does; without that, an overloaded worker's queue only grew in the replays (round-robin's exp3 TTFT
p90 came out at ~3x the real one).

Output: `<out>/<run>/bench*.json` (baton bench results), `<out>/<run>/scheduler_tap.json`,
`<out>/<run>/logs/`, and `<out>/summary.json` + the tables on stdout. Took 13 minutes with
little background load and 18 with a CI test run alongside (the overloaded runs drain longer).
Not part of `make test`.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from lab.experiments.cluster import ExperimentInfra, PolicyStack, StackConfig, WorkerFlags
from scheduler.replay import Clients
from services.gateway.config import StreamConfig

log = logging.getLogger("lab.experiments.policy_compare")

WORKERS = (WorkerFlags("worker-a", 8), WorkerFlags("worker-b", 1))
MAX_NUM_SEQS = {w.name: w.max_num_seqs for w in WORKERS}
SLO_ENTERPRISE = (2500.0, 250.0)
SLO_FREE = (6000.0, 500.0)
SLOS = {"enterprise": SLO_ENTERPRISE, "plus": SLO_ENTERPRISE, "free": SLO_FREE}


@dataclass(frozen=True)
class BenchSpec:
    tier: str  # whose API key
    args: tuple[str, ...]  # dataset, load and SLO flags of `baton bench`
    label: str = "bench"

    @property
    def chat(self) -> bool:
        """Sent as chat messages (`baton bench`'s default for the multi-turn dataset): the gateway's chat
        template adds tokens to each prompt that the bench does not count."""
        return "multiturn" in self.args


@dataclass(frozen=True)
class RunSpec:
    label: str  # the run's directory suffix and table row
    policy: str
    # Seed the scheduler's cost models (`baton scheduler --profile`) with the profile `baton profile`
    # measured on this machine at the start of the whole experiment (see `measure_profile`).
    seeded: bool = False


@dataclass(frozen=True)
class Experiment:
    name: str
    runs: tuple[RunSpec, ...]  # in this order
    benches: tuple[BenchSpec, ...]  # run concurrently

    def run_dir(self, out: Path, run: RunSpec) -> Path:
        return out / f"{self.name}__{run.label}"


def _slo_args(slo: tuple[float, float]) -> tuple[str, ...]:
    return ("--slo-ttft-ms", f"{slo[0]:g}", "--slo-tpot-ms", f"{slo[1]:g}")


LENGTHS = ("--random-input-len", "uniform:32:96", "--random-output-len", "uniform:16:24")
RANDOM = ("--dataset", "random", "--num-prompts", "60", *LENGTHS, "--request-rate", "1.3", "--seed", "0")
# exp1's prompts at a higher rate (same seed, so the same prompts): the baselines still met every SLO at 1.3.
RANDOM_HIGH = ("--dataset", "random", "--num-prompts", "60", *LENGTHS, "--request-rate", "2.0", "--seed", "0")
MULTITURN = ("--dataset", "multiturn", "--num-prompts", "12", "--num-turns", "4", "--system-prompt-len", "256",
             "--num-system-prompts", "2", "--random-input-len", "32", "--random-output-len", "16",
             "--request-rate", "0.4", "--seed", "0")
OVERLOAD_ENTERPRISE = ("--dataset", "random", "--num-prompts", "24", *LENGTHS, "--request-rate", "0.3", "--seed", "1")
# 3 req/s of free traffic on top of enterprise: about twice what the cluster serves within SLO (the
# goodput policy served 1.6 req/s, all within SLO, at 1.5 req/s of free traffic).
OVERLOAD_FREE = ("--dataset", "random", "--num-prompts", "240", *LENGTHS, "--request-rate", "3.0", "--seed", "2")

RR, LL, PA = RunSpec("round_robin", "round_robin"), RunSpec("least_loaded", "least_loaded"), \
    RunSpec("prefix_aware", "prefix_aware")
GOODPUT, GOODPUT_PROFILED = RunSpec("goodput", "goodput"), RunSpec("goodput+profile", "goodput", seeded=True)
PLAN = (
    Experiment("exp1_random", (RR, LL, GOODPUT, GOODPUT_PROFILED),
               (BenchSpec("enterprise", RANDOM + _slo_args(SLO_ENTERPRISE)),)),
    Experiment("exp1_high_rate", (RR, LL, GOODPUT),
               (BenchSpec("enterprise", RANDOM_HIGH + _slo_args(SLO_ENTERPRISE)),)),
    Experiment("exp2_multiturn", (RR, PA),
               (BenchSpec("enterprise", MULTITURN + _slo_args(SLO_ENTERPRISE)),)),
    Experiment("exp3_overload", (RR, LL, GOODPUT, GOODPUT_PROFILED),
               (BenchSpec("enterprise", OVERLOAD_ENTERPRISE + _slo_args(SLO_ENTERPRISE), "bench_enterprise"),
                BenchSpec("free", OVERLOAD_FREE + _slo_args(SLO_FREE), "bench_free"))),
)


class LoadSampler:
    """Appends /proc/loadavg every few seconds while entered: how busy the shared machine was."""

    def __init__(self, path: Path, every_s: float = 5.0) -> None:
        self.path, self.every_s = path, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with open(self.path, "a") as out:
            while not self._stop.wait(self.every_s):
                out.write(Path("/proc/loadavg").read_text())
                out.flush()


# The benches' clients give up after 120 s; the stack's gateway keeps a gone client's stream generating for
# its default detach grace, then aborts it. The replays model both (lab/experiments/simulate.py).
CLIENTS = Clients(timeout_s=120.0, detach_grace_s=StreamConfig().detach_grace_s)


def _baton() -> list[str]:
    script = Path(sys.executable).with_name("baton")
    return [str(script)] if script.exists() else [sys.executable, "-m", "loadtest"]


def run_benches(url: str, keys: dict[str, str], run_dir: Path, benches: tuple[BenchSpec, ...]) -> None:
    """`baton bench` once per spec, all at the same time; waits for every one."""
    procs = []
    for spec in benches:
        out = run_dir / f"{spec.label}.json"
        argv = [*_baton(), "bench", "--base-url", url, "--api-key", keys[spec.tier], "--ignore-eos",
                "--tokenizer", "default", "--request-timeout", str(CLIENTS.timeout_s), "--no-progress",
                "--label", spec.label,
                "--result-json", str(out), *spec.args]
        log_file = open(run_dir / f"{spec.label}.out", "w")  # noqa: SIM115 - closed below
        procs.append((spec, subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT), log_file))
    for spec, proc, log_file in procs:
        code = proc.wait()
        log_file.close()
        if code != 0:
            raise RuntimeError(f"baton bench ({spec.label}) exited {code}; see {run_dir / (spec.label + '.out')}")


def measure_profile(out: Path) -> Path:
    """`baton profile` once, with the workers' engine flags (`--torch-threads 1`, the KV pool, the
    larger batch limit), on this machine: the profile every seeded run starts from."""
    path = out / "baton_profile.json"
    if not path.exists():
        argv = [*_baton(), "profile", "--quick", "--torch-threads", "1", "--num-blocks", "384",
                "--max-num-seqs", str(max(MAX_NUM_SEQS.values())), "--out", str(path)]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, timeout=600)
    return path


def run_real(out: Path, plan: tuple[Experiment, ...]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    profile = measure_profile(out) if any(r.seeded for e in plan for r in e.runs) else None
    with ExperimentInfra(out) as infra:
        for experiment in plan:
            for run in experiment.runs:
                run_dir, policy = experiment.run_dir(out, run), run.label
                started = time.monotonic()
                config = StackConfig(run.policy, WORKERS, SLOS, profile_path=profile if run.seeded else None)
                with PolicyStack(config, infra, run_dir) as stack, LoadSampler(run_dir / "loadavg.txt"):
                    run_benches(stack.url, infra.keys, run_dir, experiment.benches)
                    fallbacks = stack.log_text("gateway").count("scheduler unreachable")
                drops = stack.log_text("scheduler").count("missed its heartbeat deadline")
                (run_dir / "gateway_fallbacks.txt").write_text(f"{fallbacks}\n")
                (run_dir / "worker_drops.txt").write_text(f"{drops}\n")
                log.warning("%s / %s done in %.0f s (gateway fell back to its last view %d times, "
                            "scheduler dropped a worker %d times)",
                            experiment.name, policy, time.monotonic() - started, fallbacks, drops)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.experiments.policy_compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/policy_compare"))
    parser.add_argument("--analyze", type=Path, default=None, help="only analyse an earlier run's directory")
    parser.add_argument("--only", nargs="+", default=None, help="experiment names to run (default: all)")
    parser.add_argument("--policies", nargs="+", default=None, help="run only these run labels (default: all)")
    parser.add_argument("--reverse", action="store_true",
                        help="run each experiment's runs last to first: alternate it between repeats, so that "
                             "a drift of the shared host's speed does not always land on the same policy")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from lab.experiments.analysis import analyse

    plan = tuple(replace(e, runs=tuple(r for r in e.runs if args.policies is None or r.label in args.policies))
                 for e in PLAN if args.only is None or e.name in args.only)
    if args.analyze is None:
        started = time.monotonic()
        run_real(args.out, tuple(replace(e, runs=e.runs[::-1]) for e in plan) if args.reverse else plan)
        print(f"real runs took {time.monotonic() - started:.0f} s", flush=True)
    analyse(args.analyze or args.out, plan, MAX_NUM_SEQS, CLIENTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
