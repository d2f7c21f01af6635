import json

from lab.micro.bench_scheduler_decisions import BenchConfig, _decision_key, main, run
from scheduler.types import DecisionKind, Reason, RouteDecision, SiteReason


def test_the_benchmarked_cluster_serves_its_load_so_the_decisions_timed_are_placements() -> None:
    """A cluster offered more than it can prefill queues most requests behind a few, and the
    benchmark would time deque appends instead of routing decisions."""
    result = run(BenchConfig(seconds=0.5, indexed_blocks=10_000))
    assert result["requests"] > 400
    assert result["queued_fraction"] < 0.05
    assert result["placed_fraction"] > 0.95
    assert 0 < result["route_p50_ms"] <= result["route_p99_ms"]


def test_reasons_hash_as_their_values_so_digests_stay_comparable_across_builds() -> None:
    """Reasons became enums (None when absent); the digest still hashes their values, or '' when absent,
    as it did when they were strings, so digests recorded before the change still compare."""
    placed = RouteDecision("r", DecisionKind.ROUTE, "d", None, 1.5, 2.5, 0.5, Reason.ROUND_ROBIN,
                           prefill_reason=SiteReason.LOCAL_CHEAPER, max_tokens=8)
    as_strings = ("route", "d", None, 1.5, 2.5, 0.5, "round_robin", "local_cheaper", 8)
    assert _decision_key(placed) == repr(as_strings).encode()
    queued = RouteDecision("q", DecisionKind.QUEUE)
    assert _decision_key(queued) == repr(("queue", None, None, None, None, None, "", "", None)).encode()


def test_the_command_prints_and_writes_the_same_figures(tmp_path, capsys) -> None:
    out = tmp_path / "decisions.json"
    main(["--seconds", "0.3", "--json", str(out)])
    written = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == written
    assert written["requests"] > 0 and len(written["decisions_sha256"]) == 64
