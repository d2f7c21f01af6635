"""The Scheduler gRPC service over a real grpc.aio server: registration, heartbeats, routing per
policy, worker expiry and the queued-Route lifecycle."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from scheduler_harness import HEARTBEAT_TIMEOUT_S, StartCluster, address, route_request, status

from rpcgen.baton.v1 import scheduler_pb2 as pb

ROUTE = pb.RouteResponse.KIND_ROUTE
REJECT = pb.RouteResponse.KIND_REJECT


async def test_register_tells_the_worker_its_heartbeat_interval(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    response = await cluster.register("a")
    assert response.heartbeat_interval_s == pytest.approx(0.2)


async def test_round_robin_routes_alternate_and_answer_addresses(start_cluster: StartCluster) -> None:
    cluster = await start_cluster("round_robin")
    await cluster.register("a")
    await cluster.register("b")
    answers = [await cluster.route(route_request(f"r{i}")) for i in range(4)]
    assert [r.decode_worker for r in answers] == [address("a"), address("b")] * 2
    assert {(r.kind, r.prefill_worker, r.max_tokens, r.reason) for r in answers} == {(ROUTE, "", 64, "round_robin")}
    assert answers[0].decode_worker_id == "a" and answers[0].HasField("predicted_ttft_ms")


async def test_least_loaded_follows_heartbeat_load(start_cluster: StartCluster) -> None:
    cluster = await start_cluster("least_loaded")
    await cluster.register("a")
    await cluster.register("b")
    cluster.clock.advance(1.0)  # past the dispatch grace, so the heartbeats replace assumed load
    await cluster.heartbeat("a", running_seqs=6)
    await cluster.heartbeat("b", running_seqs=1)
    answers = [await cluster.route(route_request(f"r{i}")) for i in range(3)]
    assert [r.decode_worker_id for r in answers] == ["b", "b", "b"]  # 2, 3, 4 sequences < 6


async def test_prefix_aware_routes_to_the_worker_holding_the_prefix(start_cluster: StartCluster) -> None:
    cluster = await start_cluster("prefix_aware")
    await cluster.register("a")
    await cluster.register("b")
    stored = [pb.KVEvent(kind=pb.KVEvent.KIND_STORED, block_hash=h) for h in range(1, 33)]
    assert await cluster.heartbeat("b", kv_events=stored)
    answer = await cluster.route(route_request("r", prompt=512))
    assert (answer.decode_worker_id, answer.cached_blocks, answer.reason) == ("b", 32, "prefix_affinity")


async def test_goodput_sends_a_long_prompt_next_to_a_running_batch_to_the_prefill_worker(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster("goodput")
    await cluster.register("d", running_seqs=8)
    await cluster.register("p", role="prefill")
    answer = await cluster.route(route_request("r", prompt=2048, ttft_ms=5000))
    assert (answer.kind, answer.decode_worker, answer.prefill_worker) == (ROUTE, address("d"), address("p"))
    assert answer.prefill_reason == "remote_cheaper"


async def test_goodput_prefills_on_an_idle_decode_worker_and_says_why(start_cluster: StartCluster) -> None:
    cluster = await start_cluster("goodput")
    await cluster.register("d")
    await cluster.register("p", role="prefill")
    answer = await cluster.route(route_request("r", prompt=2048, ttft_ms=5000))
    # Nothing runs on "d" to be slowed down, and the hop only adds the hand-off: local is cheaper.
    assert (answer.decode_worker, answer.prefill_worker, answer.prefill_reason) == (address("d"), "", "local_cheaper")


async def test_a_silent_worker_is_dropped_after_the_deadline_and_never_routed_to(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster("round_robin")
    await cluster.register("alive")
    await cluster.register("silent")
    cluster.clock.advance(HEARTBEAT_TIMEOUT_S - 0.5)
    assert await cluster.heartbeat("alive")
    cluster.clock.advance(1.0)  # "silent" is now past its deadline, "alive" is not
    answers = [await cluster.route(route_request(f"r{i}")) for i in range(4)]
    assert {r.decode_worker_id for r in answers} == {"alive"}
    listed = await cluster.stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)
    assert [w.status.worker_id for w in listed.workers] == ["alive"]
    # Its next heartbeat is refused: it must register again (and re-announce its cache).
    assert not await cluster.heartbeat("silent")


async def test_a_heartbeat_from_an_unregistered_worker_is_refused(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    assert not await cluster.heartbeat("stranger")
    answer = await cluster.route(route_request("r"))
    assert (answer.kind, answer.reason, answer.retry_after_s) == (REJECT, "no_live_worker_for_model", 5.0)


async def test_a_queued_route_is_answered_when_a_later_tick_places_it(start_cluster: StartCluster) -> None:
    cluster = await start_cluster("goodput")
    await cluster.register("w", free_blocks=0)  # no KV room: the request must wait
    call = await cluster.queued_route(route_request("r", ttft_ms=5000))  # QUEUE comes at once
    assert cluster.service.scheduler.queued == 1
    cluster.clock.advance(0.5)
    await cluster.heartbeat("w", free_blocks=40)  # room for it now
    answer = await call.read()
    assert (answer.kind, answer.decode_worker_id) == (ROUTE, "w")
    assert cluster.service.scheduler.queued == 0


async def test_a_queued_route_that_waits_too_long_is_rejected_with_retry_after(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster("goodput")
    await cluster.register("w", free_blocks=0)
    call = await cluster.queued_route(route_request("r", ttft_ms=1000))
    cluster.clock.advance(1.1)  # past its TTFT target: it can no longer count towards goodput
    answer = await call.read()
    assert (answer.kind, answer.reason) == (REJECT, "admission_queue_timeout")
    assert answer.HasField("retry_after_s") and answer.retry_after_s > 0
    assert cluster.service.scheduler.queued == 0


async def test_a_caller_that_gives_up_leaves_the_queue(start_cluster: StartCluster) -> None:
    cluster = await start_cluster("goodput")
    await cluster.register("w", free_blocks=0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.route(route_request("r", ttft_ms=5000), timeout=0.3)
    assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    await cluster.until(lambda: cluster.service.scheduler.queued == 0)


async def test_finished_while_queued_ends_the_route_call(start_cluster: StartCluster) -> None:
    cluster = await start_cluster("goodput")
    await cluster.register("w", free_blocks=0)
    call = await cluster.queued_route(route_request("r", ttft_ms=5000))
    await cluster.stub.Finished(pb.FinishedRequest(request_id="r"), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() is grpc.StatusCode.CANCELLED
    assert cluster.service.scheduler.queued == 0


async def test_stopping_answers_queued_routes_unavailable_at_once(start_cluster: StartCluster) -> None:
    cluster = await start_cluster("goodput")
    await cluster.register("w", free_blocks=0)
    call = await cluster.queued_route(route_request("r", ttft_ms=5000))
    await asyncio.wait_for(cluster.service.stop(grace_s=5.0), 1.0)  # the queued call must not hold the drain
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE


async def test_an_unknown_tier_is_invalid_and_names_the_valid_ones(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.route(route_request("r", tier="gold"))
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "free, plus, enterprise" in info.value.details()


async def test_a_heartbeat_with_a_bad_sample_is_refused_whole(start_cluster: StartCluster) -> None:
    cluster = await start_cluster("least_loaded")
    await cluster.register("w")
    cluster.clock.advance(1.0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.heartbeat("w", running_seqs=9, samples=[pb.StepSample(seconds=0.1)])
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    listed = await cluster.stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)
    assert listed.workers[0].status.running_seqs == 0  # the load in the bad heartbeat was not applied


async def test_health_reports_serving(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    health = health_pb2_grpc.HealthStub(cluster.channel)
    for service in ("", "baton.v1.Scheduler"):
        answer = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_metrics_endpoint_exposes_decisions_workers_and_queue(start_cluster: StartCluster) -> None:
    cluster = await start_cluster("round_robin", metrics=True)
    await cluster.register("a")
    await cluster.register("b", role="prefill")
    for i in range(3):
        await cluster.route(route_request(f"r{i}", prompt=64))
    await cluster.until(lambda: cluster.service.metrics.live_workers.labels("prefill")._value.get() == 1)
    url = f"http://127.0.0.1:{cluster.service.metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    assert 'baton_scheduler_decisions_total{kind="route",reason="round_robin"} 3.0' in text
    assert 'baton_scheduler_live_workers{role="decode"} 1.0' in text
    assert 'baton_scheduler_live_workers{role="prefill"} 1.0' in text
    assert "baton_scheduler_queue_depth 0.0" in text
    assert "baton_scheduler_predicted_ttft_seconds_count 3.0" in text
    assert "baton_scheduler_registrations_total 2.0" in text


async def test_an_overloaded_free_request_is_degraded_when_the_service_is_configured_to(
    start_cluster: StartCluster,
) -> None:
    # 512 + 1024 tokens need 96 blocks of 16; 70 are free: only the halved request fits.
    cluster = await start_cluster("goodput", degrade_fraction=0.5)
    await cluster.register("d", free_blocks=70)
    answer = await cluster.route(route_request("free", prompt=512, max_tokens=1024, hashes=[]))
    degraded = (pb.RouteResponse.KIND_DEGRADE, 512, "degraded_to_meet_slo")
    assert (answer.kind, answer.max_tokens, answer.reason) == degraded
    queued = await cluster.queued_route(route_request("ent", prompt=512, max_tokens=1024, tier="enterprise", hashes=[]))
    queued.cancel()  # enterprise is never degraded: it waits


async def test_metrics_endpoint_exposes_the_per_fleet_autoscaling_gauges(start_cluster: StartCluster) -> None:
    cluster = await start_cluster("goodput", metrics=True)
    await cluster.register("d", running_seqs=8, free_blocks=250)
    await cluster.register("p", role="prefill", inflight_prefill_tokens=4096, queue_depth=2)
    await cluster.route(route_request("r", prompt=2048, ttft_ms=5000))
    metrics = cluster.service.metrics
    await cluster.until(lambda: metrics.fleet_prefill_backlog.labels("prefill")._value.get() > 0)
    url = f"http://127.0.0.1:{cluster.service.metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    for name in ("fleet_queue_seconds", "fleet_ttft_slack_ratio", "fleet_kv_usage_ratio",
                 "fleet_prefill_backlog_tokens", "fleet_decode_sequences"):
        assert f"baton_scheduler_{name}{{fleet=" in text, name
    assert metrics.fleet_queue.labels("prefill")._value.get() > 0
    assert metrics.fleet_kv_usage.labels("decode")._value.get() >= 0.75  # 750 of 1000 blocks in use, + reserved
    assert 'baton_scheduler_prefill_sites_total{reason="' in text


async def test_set_role_drains_the_worker_then_tells_it_in_the_heartbeat_answer(start_cluster: StartCluster) -> None:
    cluster = await start_cluster("round_robin")
    await cluster.register("a")
    await cluster.register("b")
    await cluster.heartbeat("a", running_seqs=2)
    answer = await cluster.stub.SetRole(pb.SetRoleRequest(worker_id="a", role="prefill"), timeout=5)
    assert (answer.role_switch.state, answer.role_switch.from_role) == (pb.RoleSwitch.STATE_DRAINING, "decode")
    routed = [await cluster.route(route_request(f"r{i}")) for i in range(3)]
    assert {r.decode_worker_id for r in routed} == {"b"}  # draining: nothing new for "a"
    request = pb.HeartbeatRequest(status=status("a"))  # idle now
    assert (await cluster.stub.Heartbeat(request, timeout=5)).switch_to_role == "prefill"
    listed = await cluster.stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)
    states = {w.status.worker_id: w.role_switch.state for w in listed.workers}
    assert states == {"a": pb.RoleSwitch.STATE_SWITCHING, "b": pb.RoleSwitch.STATE_UNSPECIFIED}
    reply = await cluster.stub.Heartbeat(pb.HeartbeatRequest(status=status("a", "prefill")), timeout=5)
    assert reply.switch_to_role == ""  # done
    listed = await cluster.stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)
    assert {w.status.worker_id: w.status.role for w in listed.workers} == {"a": "prefill", "b": "decode"}


@pytest.mark.parametrize(
    ("worker_id", "role", "code"),
    [("nobody", "prefill", grpc.StatusCode.NOT_FOUND), ("a", "leader", grpc.StatusCode.INVALID_ARGUMENT)],
)
async def test_set_role_refuses_unknown_workers_and_roles(
    start_cluster: StartCluster, worker_id: str, role: str, code: grpc.StatusCode
) -> None:
    cluster = await start_cluster("round_robin")
    await cluster.register("a")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await cluster.stub.SetRole(pb.SetRoleRequest(worker_id=worker_id, role=role), timeout=5)
    assert raised.value.code() == code


async def test_a_reported_failure_unlists_the_worker_until_its_next_heartbeat(start_cluster: StartCluster) -> None:
    cluster = await start_cluster("round_robin", metrics=True)
    await cluster.register("a")
    await cluster.register("b")
    report = pb.ReportWorkerFailureRequest(worker_address=address("a"), detail="connection refused",
                                           reason=pb.ReportWorkerFailureRequest.REASON_UNAVAILABLE)
    assert (await cluster.stub.ReportWorkerFailure(report, timeout=5)).known
    listed = await cluster.stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)
    assert [w.status.worker_id for w in listed.workers] == ["b"]
    assert {(await cluster.route(route_request(f"r{i}"))).decode_worker_id for i in range(3)} == {"b"}
    assert await cluster.heartbeat("a")  # alive after all: routable and listed again
    listed = await cluster.stub.ListWorkers(pb.ListWorkersRequest(), timeout=5)
    assert sorted(w.status.worker_id for w in listed.workers) == ["a", "b"]
    unknown = pb.ReportWorkerFailureRequest(worker_address="10.0.0.9:1",
                                            reason=pb.ReportWorkerFailureRequest.REASON_STREAM_BROKEN)
    assert not (await cluster.stub.ReportWorkerFailure(unknown, timeout=5)).known
    url = f"http://127.0.0.1:{cluster.service.metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    assert 'baton_scheduler_worker_failure_reports_total{outcome="marked",reason="unavailable"} 1.0' in text
    assert 'baton_scheduler_worker_failure_reports_total{outcome="unknown",reason="stream_broken"} 1.0' in text
    assert "baton_scheduler_worker_failures_cleared_total 1.0" in text


async def test_a_failure_report_without_address_or_reason_is_invalid(start_cluster: StartCluster) -> None:
    cluster = await start_cluster()
    for bad in (pb.ReportWorkerFailureRequest(reason=pb.ReportWorkerFailureRequest.REASON_UNAVAILABLE),
                pb.ReportWorkerFailureRequest(worker_address=address("a"))):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await cluster.stub.ReportWorkerFailure(bad, timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
