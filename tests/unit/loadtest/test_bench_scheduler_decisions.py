from loadtest.micro.bench_scheduler_decisions import BenchConfig, run


def test_the_benchmarked_cluster_serves_its_load_so_the_decisions_timed_are_placements() -> None:
    """A cluster offered more than it can prefill queues most requests behind a few, and the
    benchmark would time deque appends instead of routing decisions."""
    result = run(BenchConfig(seconds=0.5, indexed_blocks=10_000))
    assert result["requests"] > 400
    assert result["queued_fraction"] < 0.05
    assert result["placed_fraction"] > 0.95
    assert 0 < result["route_p50_ms"] <= result["route_p99_ms"]
