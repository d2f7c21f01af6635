"""protobuf <-> engine / kvtransfer dataclasses: the only place the worker's messages meet them.

Every `*_from_proto` validates while converting and raises the engine's `InvalidRequestError` (or
`ValueError` for handshake fields) naming the bad field; the worker's servicer maps those to
INVALID_ARGUMENT. proto3 has no "unset" for scalars, so a few zero values mean "default":
`top_p = 0` and `repetition_penalty = 0` mean 1.0 and `max_tokens = 0` means the engine default.
`temperature = 0` is a real value (greedy), as in the OpenAI API.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.batch import TokenLogprobs
from engine.errors import InvalidRequestError
from engine.outputs import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured.constraint import GrammarKind, GuidedDecoding
from kvtransfer.base import HandshakeInfo, TransferState
from kvtransfer.layout import KVLayoutInfo
from rpcgen.baton.v1 import worker_pb2 as pb

_FINISH_TO_PROTO = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}
_GUIDED_TO_PROTO = {
    GrammarKind.JSON_OBJECT: pb.GUIDED_KIND_JSON_OBJECT,
    GrammarKind.JSON_SCHEMA: pb.GUIDED_KIND_JSON_SCHEMA,
    GrammarKind.LARK: pb.GUIDED_KIND_LARK,
}
_GUIDED_FROM_PROTO = {v: k for k, v in _GUIDED_TO_PROTO.items()}
_OUTCOME_TO_PROTO = {
    TransferState.DONE: pb.TRANSFER_OUTCOME_DONE,
    TransferState.FAILED: pb.TRANSFER_OUTCOME_FAILED,
    TransferState.TIMED_OUT: pb.TRANSFER_OUTCOME_TIMED_OUT,
    TransferState.CANCELLED: pb.TRANSFER_OUTCOME_ABORTED,
}
_OUTCOME_FROM_PROTO = {v: k for k, v in _OUTCOME_TO_PROTO.items()}


# ---- sampling -----------------------------------------------------------------------------------
def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError (from SamplingParams' own validation) on bad values."""
    defaults = SamplingParams()
    return SamplingParams(
        max_tokens=msg.max_tokens or defaults.max_tokens,
        temperature=float(msg.temperature),
        top_k=msg.top_k,
        top_p=float(msg.top_p) if msg.top_p else 1.0,
        min_p=float(msg.min_p),
        seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=float(msg.presence_penalty),
        frequency_penalty=float(msg.frequency_penalty),
        repetition_penalty=float(msg.repetition_penalty) if msg.repetition_penalty else 1.0,
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        guided=guided_from_proto(msg.guided) if msg.HasField("guided") else None,
        num_draft_tokens=msg.num_draft_tokens if msg.HasField("num_draft_tokens") else None,
        prior_output_tokens=msg.prior_output_tokens,
        priority=msg.priority,
    )


def guided_from_proto(msg: pb.GuidedDecoding) -> GuidedDecoding:
    """A fresh constraint (and so fresh parser state) per request; raises InvalidRequestError."""
    if msg.kind not in _GUIDED_FROM_PROTO:
        raise InvalidRequestError(f"sampling.guided.kind {msg.kind} is not a known grammar kind")
    return GuidedDecoding(_GUIDED_FROM_PROTO[msg.kind], msg.spec)


def guided_to_proto(guided: GuidedDecoding) -> pb.GuidedDecoding:
    return pb.GuidedDecoding(kind=_GUIDED_TO_PROTO[guided.kind], spec=guided.spec)


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        stop_token_ids=list(params.stop_token_ids),
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
        prior_output_tokens=params.prior_output_tokens,
        priority=params.priority,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.num_draft_tokens is not None:
        msg.num_draft_tokens = params.num_draft_tokens
    if params.guided is not None:
        msg.guided.CopyFrom(guided_to_proto(params.guided))
    return msg


def prompt_from_proto(token_ids: Iterable[int], field: str = "prompt_token_ids") -> list[int]:
    prompt = [int(t) for t in token_ids]
    if not prompt:
        raise InvalidRequestError(f"{field} is empty: at least one token is required")
    return prompt


# ---- outputs ------------------------------------------------------------------------------------
def logprob_to_proto(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprob_from_proto(msg: pb.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(token_id=msg.token_id, logprob=msg.logprob,
                         top=tuple((t.token_id, t.logprob) for t in msg.top))


def finish_reason_to_proto(reason: FinishReason | None) -> pb.FinishReason:
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(reason: pb.FinishReason) -> FinishReason | None:
    if reason == pb.FINISH_REASON_CONTENT_FILTER:
        return FinishReason.STOP  # the engine has no content filter; the gateway sets it
    return _FINISH_FROM_PROTO[reason]


def output_to_proto(out: RequestOutput, request_id: str) -> pb.GenerateResponse:
    """One engine delta as one stream message; `request_id` is the caller's id (the engine's may differ)."""
    return pb.GenerateResponse(
        request_id=request_id,
        token_ids=list(out.new_token_ids),
        text=out.new_text,
        logprobs=[logprob_to_proto(lp) for lp in out.logprobs],
        finish_reason=finish_reason_to_proto(out.finish_reason),
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        error=out.error or "",
    )


# ---- transfers ----------------------------------------------------------------------------------
def outcome_to_proto(state: TransferState) -> pb.TransferOutcome:
    """A terminal TransferState as the Prefill response's outcome (CANCELLED reads ABORTED)."""
    if state not in _OUTCOME_TO_PROTO:
        raise ValueError(f"transfer state {state.value} is not terminal")
    return _OUTCOME_TO_PROTO[state]


def outcome_from_proto(outcome: pb.TransferOutcome) -> TransferState:
    if outcome not in _OUTCOME_FROM_PROTO:
        raise ValueError(f"PrefillResponse.outcome {outcome} is not a terminal outcome")
    return _OUTCOME_FROM_PROTO[outcome]


# ---- handshake ----------------------------------------------------------------------------------
def layout_to_proto(layout: KVLayoutInfo) -> pb.KVLayout:
    return pb.KVLayout(
        protocol_version=layout.protocol_version,
        model_id=layout.model_id,
        dtype=layout.dtype,
        layout=layout.layout,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        tp_size=layout.tp_size,
        tp_rank=layout.tp_rank,
        pp_size=layout.pp_size,
        pp_rank=layout.pp_rank,
        first_layer=layout.first_layer,
    )


def layout_from_proto(msg: pb.KVLayout) -> KVLayoutInfo:
    """Raises ValueError naming the bad field (KVLayoutInfo validates itself)."""
    return KVLayoutInfo(
        protocol_version=msg.protocol_version,
        model_id=msg.model_id,
        dtype=msg.dtype,
        layout=msg.layout,
        block_size=msg.block_size,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        tp_size=msg.tp_size,
        tp_rank=msg.tp_rank,
        pp_size=msg.pp_size or 1,
        pp_rank=msg.pp_rank,
        first_layer=msg.first_layer,
    )


def handshake_to_proto(info: HandshakeInfo) -> pb.KVHandshake:
    return pb.KVHandshake(
        layout=layout_to_proto(info.layout),
        agent_name=info.agent_name,
        agent_metadata=info.agent_metadata,
        base_address=info.base_address,
        num_blocks=info.num_blocks,
        bytes_per_block=info.bytes_per_block,
        device_kind=info.device_kind,
        device_id=info.device_id,
        ranks=[handshake_to_proto(r) for r in info.ranks],
    )


def handshake_from_proto(msg: pb.KVHandshake) -> HandshakeInfo:
    """Raises ValueError naming the bad field (HandshakeInfo validates itself)."""
    if not msg.HasField("layout"):
        raise ValueError("handshake has no layout")
    return HandshakeInfo(
        layout=layout_from_proto(msg.layout),
        agent_name=msg.agent_name,
        agent_metadata=msg.agent_metadata,
        base_address=msg.base_address,
        num_blocks=msg.num_blocks,
        bytes_per_block=msg.bytes_per_block,
        device_kind=msg.device_kind,
        device_id=msg.device_id,
        ranks=tuple(handshake_from_proto(r) for r in msg.ranks),
    )
