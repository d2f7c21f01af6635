"""protobuf <-> scheduler.types conversion, and the --profile file's two forms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scheduler_harness import status

from rpcgen.baton.v1 import scheduler_pb2 as pb
from scheduler.adapters.convert import (
    InvalidMessageError,
    kv_event_from_proto,
    response_from_decision,
    sample_from_proto,
    snapshot_from_status,
    status_from_snapshot,
    summary_from_proto,
)
from scheduler.adapters.profiles import ProfileBook
from scheduler.core.cost_model import WorkerProfile
from scheduler.types import (
    SLO,
    DecisionKind,
    KVEvent,
    KVEventKind,
    KVTier,
    MixedSample,
    PrefillSample,
    Reason,
    RequestSummary,
    RouteDecision,
    Tier,
)
from services.gateway.routing.convert import summary_to_proto


def test_a_prefill_sample_keeps_its_attention_work_only_when_sent() -> None:
    sent = sample_from_proto(pb.StepSample(kind=pb.StepSample.KIND_PREFILL, tokens=100, seconds=0.1,
                                           attention_tokens_sq=30_000))
    unset = sample_from_proto(pb.StepSample(kind=pb.StepSample.KIND_PREFILL, tokens=100, seconds=0.1))
    assert sent == PrefillSample(tokens=100, seconds=0.1, attention_tokens_sq=30_000)
    assert unset.attention_tokens_sq is None  # type: ignore[union-attr]


def test_a_mixed_sample_keeps_both_parts_and_one_without_decodes_is_refused() -> None:
    mixed = sample_from_proto(pb.StepSample(kind=pb.StepSample.KIND_MIXED, tokens=100, attention_tokens_sq=30_000,
                                            decode_seqs=3, context_tokens=900, seconds=0.2))
    assert mixed == MixedSample(prefill_tokens=100, attention_tokens_sq=30_000, batch_size=3, context_tokens=900,
                                seconds=0.2)
    with pytest.raises(InvalidMessageError, match="decode_seqs"):
        sample_from_proto(pb.StepSample(kind=pb.StepSample.KIND_MIXED, tokens=100, seconds=0.2))


def test_a_request_summary_survives_the_wire_with_signed_hashes_as_uint64() -> None:
    summary = RequestSummary("r", 64, (-1, 7), Tier.PLUS, SLO(500, 50), 32, model="m", conversation_id="c",
                             num_choices=2)
    back = summary_from_proto(summary_to_proto(summary))
    assert back.prefix_hashes == (2**64 - 1, 7)
    assert (back.tier, back.slo, back.model, back.conversation_id) == (Tier.PLUS, SLO(500, 50), "m", "c")
    assert back.num_choices == 2
    unset = summary_to_proto(RequestSummary("r", 64, (), Tier.PLUS, SLO(500, 50), 32))
    unset.ClearField("num_choices")  # an older gateway's request: one choice
    assert summary_from_proto(unset).num_choices == 1


def test_a_request_without_slo_is_invalid() -> None:
    with pytest.raises(InvalidMessageError, match="SLO targets must be positive"):
        summary_from_proto(pb.RouteRequest(request_id="r", num_prompt_tokens=8, tier="free", max_tokens=8))


def test_an_unknown_role_names_the_valid_ones() -> None:
    with pytest.raises(InvalidMessageError, match="prefill, decode, both"):
        snapshot_from_status(status("w", role="encoder"), "w:1", now=0.0)


def test_a_local_prefill_decision_has_no_prefill_address_and_the_asked_max_tokens() -> None:
    workers = {"d": snapshot_from_status(status("d"), "d:1", now=0.0)}
    decision = RouteDecision("r", DecisionKind.ROUTE, decode_worker_id="d", predicted_ttft_ms=12.0)
    response = response_from_decision(decision, workers, asked_max_tokens=64)
    assert (response.decode_worker, response.prefill_worker, response.max_tokens) == ("d:1", "", 64)
    assert response.predicted_ttft_ms == 12.0 and not response.HasField("predicted_tpot_ms")


def test_a_degraded_decision_carries_the_lower_cap() -> None:
    workers = {"d": snapshot_from_status(status("d"), "d:1", now=0.0)}
    decision = RouteDecision("r", DecisionKind.DEGRADE, decode_worker_id="d", max_tokens=16)
    assert response_from_decision(decision, workers, asked_max_tokens=64).max_tokens == 16


def test_a_reject_without_retry_hint_leaves_retry_after_unset() -> None:
    decision = RouteDecision("r", DecisionKind.REJECT, reason=Reason.TOO_LARGE)
    response = response_from_decision(decision, {}, asked_max_tokens=64)
    assert response.kind == pb.RouteResponse.KIND_REJECT
    assert not response.HasField("retry_after_s") and response.max_tokens == 0


def test_a_bare_profile_seeds_every_model(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(WorkerProfile(decode_fixed_s=0.003).to_json())
    book = ProfileBook.load(path)
    assert book.for_model("anything") == WorkerProfile(decode_fixed_s=0.003)


def test_per_model_profiles_fall_back_to_the_star_entry() -> None:
    book = ProfileBook.from_data({"small": {"decode_fixed_s": 0.001}, "*": {"decode_fixed_s": 0.02}})
    assert book.for_model("small").decode_fixed_s == 0.001  # type: ignore[union-attr]
    assert book.for_model("other").decode_fixed_s == 0.02  # type: ignore[union-attr]
    assert ProfileBook.from_data({"small": {}}).for_model("other") is None


def test_a_profile_with_an_unknown_key_names_the_model_and_the_valid_keys(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"small": {"decode_fast_s": 1.0}}))
    with pytest.raises(ValueError, match=r"model 'small'.*valid keys: decode_fixed_s"):
        ProfileBook.load(path)


def test_a_status_carries_the_worker_batch_slots_context_and_remaining_tokens_both_ways() -> None:
    reported = status("w", max_num_seqs=8, running_context_tokens=4200, running_remaining_tokens=96)
    snapshot = snapshot_from_status(reported, "w:7000", now=1.0)
    assert (snapshot.max_num_seqs, snapshot.running_context_tokens, snapshot.running_remaining_tokens) == (8, 4200, 96)
    back = status_from_snapshot(snapshot)
    assert (back.max_num_seqs, back.running_context_tokens, back.running_remaining_tokens) == (8, 4200, 96)
    assert snapshot_from_status(status("old"), "old:7000", now=1.0).max_num_seqs == 0  # unknown


def test_a_status_carries_the_requests_received_and_those_awaiting_remote_kv_both_ways() -> None:
    snapshot = snapshot_from_status(status("w", requests_received=0, waiting_for_remote_kv=3), "w:7000", now=1.0)
    assert (snapshot.requests_received, snapshot.waiting_for_remote_kv) == (0, 3)  # 0 is a count, not "unknown"
    back = status_from_snapshot(snapshot)
    assert back.HasField("requests_received") and (back.requests_received, back.waiting_for_remote_kv) == (0, 3)
    older = snapshot_from_status(status("old"), "old:7000", now=1.0)
    assert older.requests_received is None and not status_from_snapshot(older).HasField("requests_received")


def test_a_decision_degraded_to_a_smaller_model_names_it_and_keeps_the_asked_cap() -> None:
    workers = {"s": snapshot_from_status(status("s"), "s:1", now=0.0)}
    decision = RouteDecision("r", DecisionKind.DEGRADE, decode_worker_id="s", model="small")
    response = response_from_decision(decision, workers, asked_max_tokens=64)
    assert (response.model, response.max_tokens, response.decode_worker) == ("small", 64, "s:1")


def test_the_prompt_count_of_a_prefill_backlog_crosses_the_wire() -> None:
    wire = status("p", role="prefill", queue_depth=1, inflight_prefill_tokens=10_240, inflight_prefill_requests=5)
    snapshot = snapshot_from_status(wire, "p:1", now=0.0)
    counts = (snapshot.queue_depth, snapshot.inflight_prefill_tokens, snapshot.inflight_prefill_requests)
    assert counts == (1, 10_240, 5)
    assert status_from_snapshot(snapshot).inflight_prefill_requests == 5


def test_a_kv_event_keeps_its_tier_and_an_older_workers_event_reads_as_gpu() -> None:
    host = pb.KVEvent(kind=pb.KVEvent.KIND_STORED, block_hash=5, tier=pb.KVEvent.TIER_HOST)
    assert kv_event_from_proto(host) == KVEvent(KVEventKind.STORED, 5, KVTier.HOST)
    assert kv_event_from_proto(pb.KVEvent(kind=pb.KVEvent.KIND_EVICTED, block_hash=5)).tier is KVTier.GPU
