"""Every GPU suite in lab/suites runs in its SMOKE mode on the CPU (`SMOKE=1 PYTHON=<this python>`): the
suites that produce docs/benchmarks.md's figures keep calling their benchmarks and experiments the way the
GPU box will. Each run's outputs are checked for what the suite exists to report (its steps' exit codes,
its rows, its identity and verification verdicts), never for times, which mean nothing on a shared CPU.

The suites run two at a time (tests/support/suite_lanes.py), started once for the module. The offline
experiments that read a layout run (distserve --replot, tpot_forecast, layout_check, layout_replay,
gateway_cost) read the scheduler A/B's "new" side. A suite with no
meaningful CPU run is listed in NO_CPU_SMOKE with the reason; one reached only through another suite's
smoke run is listed in REACHED_THROUGH. These runs stand in for the micro-benchmarks' own smoke tests where
a suite already runs them (bench_decode, bench_prefill, bench_pp70b, bench_tp70b, bench_disagg_gpu,
bench_kv_transfer, bench_multiturn_tiers, bench_moe's default smoke).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.experiments import distserve, gateway_cost, layout_check, layout_replay, tpot_forecast
from lab.micro.bench_moe import SMOKE as MOE_SMOKE
from scheduler.core.cost_model import WorkerProfile
from tests.support.suite_lanes import ROOT, SUITES, SuiteCall, SuiteLanes, SuiteRun

# Longest first, so that the two lanes finish close together.
START_ORDER = ("engine_features_suite.sh", "scheduler_ab.sh", "product_suite.sh", "tp70b_suite.sh",
               "disagg_suite.sh", "pp70b_suite.sh", "gpu_suite.sh", "handoff_overhead.sh")
NEEDS_DISTSERVE_ASSETS = {"scheduler_ab.sh", "product_suite.sh"}
REACHED_THROUGH = {  # suite -> the smoke-tested suite whose run calls it
    "layouts_suite.sh": "scheduler_ab.sh",  # each side is a layouts_suite.sh run, seeded by PROFILE
    "distserve_suite.sh": "scheduler_ab.sh",  # layouts_suite.sh execs it
}
NO_CPU_SMOKE = {
    "tp_probe_suite.sh": "a one-off diagnostic of NCCL all-reduce capture in CUDA graphs and a TP step under "
                         "torch.profiler's CUDA activity; its bench_decode TP=2 step is gpu_suite.sh's",
    "spy_services.sh": "samples other processes with py-spy, which is carried to the GPU box as a wheel and "
                       "is not a dependency of the project",
}
# The tiny model's SLO on a CPU (the 8B shape's 500/50 ms would judge nothing here).
PRODUCT_ARGS = ("--stacks", "product", "--random-rates", "1", "--sharegpt-rates", "--duration-s", "2")
LAYOUT = "c1"


@dataclasses.dataclass(frozen=True)
class SmokeInputs:
    """What some suites need beside the tree: the DistServe assets, an old scheduler/ and a profile."""

    distserve_assets: Path
    old_scheduler: Path
    profile: Path


def smoke_calls(inputs: SmokeInputs) -> dict[str, SuiteCall]:
    assets = {"DISTSERVE_ASSET_DIR": str(inputs.distserve_assets)}
    return {
        "disagg_suite.sh": SuiteCall("disagg_suite.sh"),
        "handoff_overhead.sh": SuiteCall("handoff_overhead.sh", env={"REQUESTS": "6"}),
        "gpu_suite.sh": SuiteCall("gpu_suite.sh"),
        "pp70b_suite.sh": SuiteCall("pp70b_suite.sh"),
        "tp70b_suite.sh": SuiteCall("tp70b_suite.sh"),
        "engine_features_suite.sh": SuiteCall("engine_features_suite.sh"),
        "scheduler_ab.sh": SuiteCall("scheduler_ab.sh", ("newfirst",), {
            **assets, "OLD": str(inputs.old_scheduler), "PROFILE": str(inputs.profile), "CONFIGS": LAYOUT}),
        "product_suite.sh": SuiteCall("product_suite.sh", PRODUCT_ARGS, assets),
    }


def prepare_inputs(base: Path, wanted: set[str]) -> SmokeInputs:
    inputs = SmokeInputs(base / "distserve-assets", base / "old-scheduler", base / "profile.json")
    if wanted & NEEDS_DISTSERVE_ASSETS:
        subprocess.run([sys.executable, "-m", "lab.experiments.distserve_assets", "--out", str(inputs.distserve_assets),
                        "--sharegpt-count", "20"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    if "scheduler_ab.sh" in wanted:  # the "old" side: this tree's scheduler, as `git archive` would lay it out
        shutil.copytree(ROOT / "scheduler", inputs.old_scheduler / "scheduler",
                        ignore=shutil.ignore_patterns("__pycache__"))
        tap = inputs.old_scheduler / "lab" / "experiments" / "scheduler_tap.py"
        tap.parent.mkdir(parents=True)
        shutil.copyfile(ROOT / "lab" / "experiments" / "scheduler_tap.py", tap)
        # A bare profile (every model) near the tiny model's CPU costs: the goodput policy's seed.
        profile = WorkerProfile(prefill_fixed_s=0.05, prefill_per_token_s=2e-3, decode_fixed_s=0.06,
                                decode_per_seq_s=2e-3)
        inputs.profile.write_text(json.dumps(dataclasses.asdict(profile)))
    return inputs


def selected_suites(request: pytest.FixtureRequest) -> set[str]:
    """The suites the selected tests of this module check: only those are started."""
    return {item.callspec.params["script"] for item in request.session.items
            if item.module is request.module and "script" in getattr(getattr(item, "callspec", None), "params", {})}


@pytest.fixture(scope="module")
def suite_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               default_model_dir: Path) -> Iterator[SuiteLanes]:
    wanted = selected_suites(request)
    base = tmp_path_factory.mktemp("suites")
    calls = smoke_calls(prepare_inputs(base, wanted))
    lanes = SuiteLanes()
    try:
        for script in sorted(wanted, key=START_ORDER.index):
            lanes.start(calls[script], base / script.removesuffix(".sh"))
        yield lanes
    finally:
        lanes.close()


def read_json(path: Path) -> dict:
    assert path.is_file(), f"missing {path}"
    return json.loads(path.read_text())


def assert_steps_passed(run: SuiteRun, *lines: str) -> None:
    """Each suite prints one line per step with its exit code (`NAME rc=N ...`)."""
    for line in lines:
        assert re.search(rf"^{re.escape(line)}\b", run.output, re.MULTILINE), f"no '{line}' in:\n{run.tail()}"


# ------------------------------------------------------------------------------------------------ checks


def check_disagg_suite(run: SuiteRun) -> None:
    assert_steps_passed(run, "disagg rc=0", "kv_transfer rc=0")
    disagg = read_json(run.out / "disagg.json")
    assert disagg["ok"] and disagg["errors"] == []
    assert disagg["identity"] and all(r["identical"] and r["path"] == r["expected_path"] for r in disagg["identity"])
    assert "REMOTE" in disagg["ttft"]["disagg_paths"]
    transfer = read_json(run.out / "kv_transfer.json")
    assert transfer["ok"] and transfer["errors"] == []
    assert all(case["verified"] and case["bad_blocks"] == [] for case in transfer["cases"].values())


def check_handoff_overhead(run: SuiteRun) -> None:
    assert_steps_passed(run, "== KV streaming off: exit 0", "== KV streaming on: exit 0")
    for stream in ("off", "on"):
        report = read_json(run.out / f"overhead-stream-{stream}.json")
        assert report["ok"] and report["errors"] == [] and report["kv_stream"] == stream
        assert len(report["identity"]) == 4 and all(r["identical"] for r in report["identity"])
        assert report["ttft"]["disagg_paths"] == ["REMOTE"]
        assert report["kv_during_ttft"]["handoffs"] == 6  # every measured request handed its KV over
        assert {"prefill_compute", "write"} <= set(report["handoff_phases"]["prefill-0"])


def check_gpu_suite(run: SuiteRun) -> None:
    assert_steps_passed(run, "bench_decode rc=0", "bench_prefill rc=0", "bench_hf_peer rc=0")
    assert not (run.out / "tests.log").exists()  # the GPU tests are left out
    decode = read_json(run.out / "bench_decode.json")["rows"]
    assert sorted((r["tp"], r["batch"], r["ctx"]) for r in decode) == [(1, 1, 64), (1, 4, 64), (2, 1, 64), (2, 4, 64)]
    assert all(r["step_ms"] > 0 and r["tok_s"] > 0 for r in decode)
    assert all(r["speedup_vs_tp1"] > 0 for r in decode if r["tp"] == 2)
    prefill = read_json(run.out / "bench_prefill.json")["rows"]
    assert [r["tokens"] for r in prefill] == [64, 256]
    assert prefill[1]["tflop"] > prefill[0]["tflop"] > 0 and all(0 < r["attn_share"] < 1 for r in prefill)
    peer = read_json(run.out / "bench_hf_peer.json")["rows"]
    assert [r["batch"] for r in peer] == [1, 2]  # no error rows
    assert all(r["hf_tok_s"] > 0 and r["baton_tok_s"] > 0 for r in peer)


def check_pp70b_suite(run: SuiteRun) -> None:
    assert_steps_passed(run, "identity rc=0", "decode rc=0")
    identity = {r["layout"]: r["identical_to_pp1"] for r in read_json(run.out / "identity.json")["rows"]}
    assert identity == {"pp1": True, "pp2-mb1": True, "pp2-mb2": True}
    decode = read_json(run.out / "decode.json")["rows"]
    assert {r["layout"] for r in decode} == {"tp2", "tp2-eager", "pp2-mb1", "pp2-mb2"}
    assert all(r["part"] == "decode" and r["step_ms"] > 0 for r in decode)


def check_tp70b_suite(run: SuiteRun) -> None:
    assert_steps_passed(run, "tp70b rc=0")
    assert not (run.out / "split.log").exists()  # the 70B split is distserve_suite.sh's, smoked on its own
    rows = read_json(run.out / "tp70b.json")["rows"]
    steps = [r for r in rows if "step_ms" in r]
    assert {r["batch"] for r in steps} == {1, 4} and all(r["tp"] == 2 and 0 < r["ar_share"] < 1 for r in steps)
    assert any(r.get("kind") == "all_reduce" and r["ar_us"] > 0 for r in rows)


def check_engine_features_suite(run: SuiteRun) -> None:
    assert_steps_passed(run, "multiturn_tiers rc=0", "bench_moe rc=0")
    check_multiturn_tiers(read_json(run.out / "multiturn_tiers.json"))
    assert "TTFT p50 hit" in (run.out / "multiturn_tiers.log").read_text()  # the table
    check_bench_moe_rows(read_json(run.out / "bench_moe.json")["rows"])


def check_multiturn_tiers(report: dict) -> None:
    """Both modes finish every turn, the tiered run loads history from host and disk, greedy output is the
    same turn for turn; the host-only 0%-hit run demotes to host and never to disk."""
    turns = report["workload"]["conversations"] * report["workload"]["turns"]
    for mode in ("off", "on"):
        assert not report["modes"][mode]["conversations_truncated"]
        assert report["modes"][mode]["conversations"]["requests"] == turns
        assert report["modes"][mode]["zero_hit"]["requests"] == report["workload"]["unique_prompts"]
        probe = report["modes"][mode]["probe"]
        assert probe["probes"] == 1 and not report["modes"][mode]["probe_truncated"]
    assert report["modes"]["off"]["tiers"] is None
    hits = report["modes"]["on"]["tiers"]["hit_blocks"]
    assert hits.get("disk", 0) > 0 and sum(hits.values()) > 0
    assert all(differ == 0 for _, differ in report["mismatched_greedy_turns"].values())  # float32 on CPU: exact
    assert report["modes"]["off"]["probe"]["tier_loaded_tokens"] == [0]
    assert report["modes"]["on"]["probe"]["tier_loaded_tokens"][0] >= 32  # the evicted history came back
    host_only = report["modes"]["host_only"]
    assert host_only["zero_hit"]["requests"] == report["workload"]["unique_prompts"]
    demoted = host_only["tiers"]["demoted_blocks"]
    assert demoted.get("host", 0) > 0 and "disk" not in demoted
    assert host_only["engine_thread"]["zero_hit"]["calls_by_hook"].get("offer", 0) > 0  # the hooks were timed


def check_bench_moe_rows(rows: list[dict]) -> None:
    assert [(r["case"], r.get("batch"), r.get("tokens")) for r in rows] == [
        ("decode", 1, None), ("decode", 64, None), ("prefill", None, 64)]
    top_k, experts = MOE_SMOKE["num_experts_per_tok"], MOE_SMOKE["num_experts"]
    assert rows[0]["experts_routed"] == top_k and top_k < rows[1]["experts_routed"] <= experts
    # batch 1: top_k experts hold one slot each, the mean over all experts is top_k / experts
    assert rows[0]["expert_imbalance"] == experts / top_k
    assert 1.0 <= rows[1]["expert_imbalance"] < rows[0]["expert_imbalance"]


def check_scheduler_ab(run: SuiteRun) -> None:
    assert_steps_passed(run, "new rc=0", "old rc=0")
    sides = unpack_ab(run)
    for side in ("new", "old"):
        summary = read_json(sides / side / "summary.json")
        assert summary["errors"] == [] and summary["policy"] == "goodput" and summary["scheduler_profile"]
        check_served_every_request(summary, LAYOUT)
        with tarfile.open(sides / side / "results.tar.gz") as results:
            assert f"logs/{LAYOUT}-scheduler_tap.json" in results.getnames()  # --tap-scheduler reached it


def check_product_suite(run: SuiteRun) -> None:
    summary = read_json(run.out / "summary.json")
    config = f"{LAYOUT}+product"
    assert summary["errors"] == [] and summary["stacks"] == ["product"]
    assert summary["configurations"][config]["stack"] == "product"
    check_served_every_request(summary, config)  # each request went through an API key, limits and safety
    with tarfile.open(run.out / "results.tar.gz") as results:
        names = set(results.getnames())
    assert {f"logs/{config}/product-safety.log", f"logs/{config}/product-billing.log"} <= names


def check_served_every_request(summary: dict, config: str) -> None:
    runs = summary["configurations"][config]["runs"]
    assert runs and all(r["exit_code"] == 0 for r in runs)
    rows = summary["workloads"]["random"]["configs"][config]
    assert rows and all(r["completed"] == r["requests"] > 0 and r["failed"] == 0 for r in rows)


def unpack_ab(run: SuiteRun) -> Path:
    sides = run.out / "ab"
    if not sides.is_dir():
        with tarfile.open(run.out / "ab.tgz") as ab:
            ab.extractall(sides, filter="data")
    return sides


CHECKS = {
    "disagg_suite.sh": check_disagg_suite,
    "handoff_overhead.sh": check_handoff_overhead,
    "gpu_suite.sh": check_gpu_suite,
    "pp70b_suite.sh": check_pp70b_suite,
    "tp70b_suite.sh": check_tp70b_suite,
    "engine_features_suite.sh": check_engine_features_suite,
    "scheduler_ab.sh": check_scheduler_ab,
    "product_suite.sh": check_product_suite,
}


# ------------------------------------------------------------------------------------------------- tests


def test_every_suite_has_a_smoke_run_or_a_stated_reason() -> None:
    suites = {p.name for p in SUITES.glob("*.sh")}
    assert suites == set(CHECKS) | set(REACHED_THROUGH) | set(NO_CPU_SMOKE)
    assert set(CHECKS) == set(START_ORDER) and set(REACHED_THROUGH.values()) <= set(CHECKS)


@pytest.mark.parametrize("script", START_ORDER)
def test_suite_runs_in_its_smoke_mode(script: str, suite_runs: SuiteLanes) -> None:
    run = suite_runs.result(script)
    assert run.returncode == 0, f"{script} exited {run.returncode}:\n{run.tail()}"
    CHECKS[script](run)


def test_a_step_that_failed_or_never_ran_fails_the_check(tmp_path: Path) -> None:
    # The suites exit 0 after a failed step (they report each step and go on), so the step lines decide.
    run = SuiteRun("disagg_suite.sh", tmp_path, 0, "disagg rc=124 200s (limit 200s)\nkv_transfer rc=0 7s\n")
    with pytest.raises(AssertionError, match="no 'disagg rc=0'"):
        assert_steps_passed(run, "disagg rc=0", "kv_transfer rc=0")
    assert_steps_passed(run, "kv_transfer rc=0")
    with pytest.raises(AssertionError, match="no 'kv_transfer rc=0'"):
        assert_steps_passed(SuiteRun("disagg_suite.sh", tmp_path, 0, "kv_transfer rc=0x\n"), "kv_transfer rc=0")


# ------------------------------------------------------------------- offline analyses of a layout run


@pytest.fixture
def layout_run(suite_runs: SuiteLanes) -> Path:
    """scheduler_ab.sh's "new" side: a layouts_suite.sh output (distserve, c1, tapped scheduler, PROFILE)."""
    run = suite_runs.result("scheduler_ab.sh")
    assert run.returncode == 0, run.tail()
    return unpack_ab(run) / "new"


@pytest.mark.parametrize("script", ["scheduler_ab.sh"])
def test_tpot_forecast_pairs_the_tapped_decisions_with_the_measured_requests(
        script: str, layout_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with tarfile.open(layout_run / "results.tar.gz") as results:
        results.extractall(tmp_path, filter="data")
    assert tpot_forecast.main([str(tmp_path), "--heartbeat-s", "0.2"]) == 0  # distserve's heartbeat
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()[2:]]
    requests = read_json(layout_run / "summary.json")["workloads"]["random"]["configs"][LAYOUT][0]["requests"]
    assert [(run.strip(), worker.strip(), int(n)) for run, worker, n, *_ in rows] == [
        (f"{LAYOUT}__random__r1", "both-gpu0", requests)]


@pytest.mark.parametrize("script", ["scheduler_ab.sh"])
def test_layout_check_and_replay_set_the_planner_against_the_run(script: str, layout_run: Path,
                                                                 tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"  # the one the run was seeded with, as it recorded it
    profile.write_text(json.dumps(read_json(layout_run / "summary.json")["scheduler_profile"]))
    # Its exit code is the verdict, which turns on the attainment measured: wall clock on a shared CPU.
    assert layout_check.main([str(layout_run), "--out", str(tmp_path / "check"), "--profile", str(profile)]) in (0, 1)
    verdict = read_json(tmp_path / "check" / "check.json")["random"]
    assert verdict["recommended"] == LAYOUT  # one GPU's layouts: c1 alone
    assert [m["config"] for m in verdict["measured"]] == [LAYOUT]
    assert layout_replay.main([str(layout_run), "--out", str(tmp_path / "replay"), "--profile", str(profile)]) == 0
    replayed = read_json(tmp_path / "replay" / "replay.json")
    assert [r["run"] for r in replayed] == [f"{LAYOUT}__random__r1"]
    assert all(0 <= r[side]["attainment"] <= 1 for r in replayed for side in ("measured", "simulated"))


@pytest.mark.parametrize("script", ["scheduler_ab.sh"])
def test_gateway_cost_fits_the_event_loop_per_token(script: str, layout_run: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert gateway_cost.main([str(layout_run)]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^{LAYOUT}__random__r1\s+[\d.]+\s+\d+\s+\d+", out, re.MULTILINE), out
    assert "--gateway-request-ms" in out and "--gateway-token-us" in out


@pytest.mark.parametrize("script", ["scheduler_ab.sh"])
def test_replot_judges_the_same_requests_by_another_slo(script: str, layout_run: Path) -> None:
    # An SLO of ten minutes: every request the run completed meets it, whatever this CPU's load was.
    assert distserve.main(["--replot", str(layout_run), "--replot-slo", "600000", "600000"]) == 0
    judged = layout_run / "slo-ttft600000-tpot600000"
    rows = read_json(judged / "summary.json")["workloads"]["random"]["configs"][LAYOUT]
    measured = read_json(layout_run / "summary.json")["workloads"]["random"]["configs"][LAYOUT]
    assert [(r["rate"], r["requests"], r["completed"]) for r in rows] == [
        (r["rate"], r["requests"], r["completed"]) for r in measured]
    assert all(r["attainment"] == 1.0 for r in rows)
    assert {"goodput_random.png", "attainment_random.png"} <= {f.name for f in judged.iterdir()}

