"""protobuf <-> dataclass conversion of the worker's messages."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.batch import TokenLogprobs
from engine.errors import InvalidRequestError
from engine.outputs import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from kvtransfer.base import HandshakeInfo, TransferState
from kvtransfer.layout import KVLayoutInfo
from rpcgen.baton.v1 import worker_pb2 as pb
from services.rpc import convert
from services.worker.servicer import _sampling, _tier_priority

LAYOUT = KVLayoutInfo(protocol_version=1, model_id="m", dtype="float32", layout="block_major_v1", block_size=16,
                      num_layers=2, num_kv_heads=2, head_dim=64, tp_size=1, tp_rank=0)


def test_sampling_params_round_trip() -> None:
    params = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, top_p=0.875, min_p=0.125, seed=42,
                            presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.25,
                            stop_token_ids=(1, 2), stop=("x",), ignore_eos=True, logprobs=3)
    assert convert.sampling_from_proto(convert.sampling_to_proto(params)) == params


def test_priority_round_trips_to_the_prefill_worker() -> None:
    assert convert.sampling_from_proto(convert.sampling_to_proto(SamplingParams(priority=2))).priority == 2


def test_a_generate_request_tier_sets_its_admission_priority() -> None:
    assert [_tier_priority(t) for t in ("enterprise", "plus", "free", "")] == [0, 1, 2, None]
    with pytest.raises(InvalidRequestError, match="tier must be one of"):
        _tier_priority("gold")
    assert _sampling(pb.SamplingParams(priority=1), _tier_priority("free")).priority == 2
    assert _sampling(pb.SamplingParams(priority=1), _tier_priority("")).priority == 1


def test_proto_zero_values_mean_defaults_but_temperature_zero_is_greedy() -> None:
    params = convert.sampling_from_proto(pb.SamplingParams())
    assert (params.max_tokens, params.top_p, params.repetition_penalty) == (16, 1.0, 1.0)
    assert params.greedy and params.seed is None and params.logprobs is None


@pytest.mark.parametrize("k", [None, 0, 4])
def test_num_draft_tokens_round_trips_unset_meaning_the_worker_default(k: int | None) -> None:
    params = SamplingParams(num_draft_tokens=k)
    assert convert.sampling_from_proto(convert.sampling_to_proto(params)).num_draft_tokens == k


def test_bad_sampling_values_raise_a_typed_error() -> None:
    with pytest.raises(InvalidRequestError, match="temperature must be"):
        convert.sampling_from_proto(pb.SamplingParams(temperature=-1.0))


def test_empty_prompt_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="prompt_token_ids is empty"):
        convert.prompt_from_proto([])


def test_handshake_round_trip_mirrors_every_field() -> None:
    info = HandshakeInfo(layout=LAYOUT, agent_name="a", agent_metadata=b"\x00md", base_address=4096,
                         num_blocks=10, bytes_per_block=LAYOUT.bytes_per_block, device_kind="cpu", device_id=0)
    assert convert.handshake_from_proto(convert.handshake_to_proto(info)) == info
    proto_fields = {f.name for f in pb.KVLayout.DESCRIPTOR.fields}
    assert proto_fields == set(LAYOUT.__dataclass_fields__)
    assert {f.name for f in pb.KVHandshake.DESCRIPTOR.fields} == set(HandshakeInfo.__dataclass_fields__)


def test_handshake_round_trip_keeps_the_follower_ranks() -> None:
    def rank(r: int) -> HandshakeInfo:
        layout = replace(LAYOUT, tp_size=2, tp_rank=r)
        return HandshakeInfo(layout=layout, agent_name=f"a-tp{r}", agent_metadata=b"md", base_address=4096 * (r + 1),
                             num_blocks=10, bytes_per_block=layout.bytes_per_block, device_kind="cuda", device_id=r)

    info = replace(rank(0), ranks=(rank(1),))
    assert convert.handshake_from_proto(convert.handshake_to_proto(info)) == info


def test_handshake_without_layout_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="no layout"):
        convert.handshake_from_proto(pb.KVHandshake(agent_name="a"))


def test_output_and_logprobs_to_proto() -> None:
    lp = TokenLogprobs(token_id=5, logprob=-0.25, top=((5, -0.25), (9, -2.0)))
    out = RequestOutput("engine-id", (5,), "hi", (lp,), FinishReason.LENGTH, 3, 1)
    msg = convert.output_to_proto(out, "caller-id")
    assert (msg.request_id, list(msg.token_ids), msg.finish_reason) == ("caller-id", [5], pb.FINISH_REASON_LENGTH)
    assert convert.logprob_from_proto(msg.logprobs[0]) == lp


@pytest.mark.parametrize("state", [TransferState.DONE, TransferState.FAILED, TransferState.TIMED_OUT,
                                   TransferState.CANCELLED])
def test_terminal_outcomes_round_trip(state: TransferState) -> None:
    assert convert.outcome_from_proto(convert.outcome_to_proto(state)) is state


def test_non_terminal_outcome_is_refused() -> None:
    with pytest.raises(ValueError, match="not terminal"):
        convert.outcome_to_proto(TransferState.TRANSFERRING)
