from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_CONTENT_FILTER: _ClassVar[FinishReason]

class GuidedKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GUIDED_KIND_UNSPECIFIED: _ClassVar[GuidedKind]
    GUIDED_KIND_JSON_OBJECT: _ClassVar[GuidedKind]
    GUIDED_KIND_JSON_SCHEMA: _ClassVar[GuidedKind]
    GUIDED_KIND_LARK: _ClassVar[GuidedKind]

class PrefillMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFILL_MODE_AUTO: _ClassVar[PrefillMode]
    PREFILL_MODE_REMOTE: _ClassVar[PrefillMode]
    PREFILL_MODE_LOCAL: _ClassVar[PrefillMode]

class PrefillPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFILL_PATH_UNSPECIFIED: _ClassVar[PrefillPath]
    PREFILL_PATH_REMOTE: _ClassVar[PrefillPath]
    PREFILL_PATH_LOCAL: _ClassVar[PrefillPath]
    PREFILL_PATH_LOCAL_FALLBACK: _ClassVar[PrefillPath]

class TransferOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_OUTCOME_UNSPECIFIED: _ClassVar[TransferOutcome]
    TRANSFER_OUTCOME_DONE: _ClassVar[TransferOutcome]
    TRANSFER_OUTCOME_FAILED: _ClassVar[TransferOutcome]
    TRANSFER_OUTCOME_TIMED_OUT: _ClassVar[TransferOutcome]
    TRANSFER_OUTCOME_ABORTED: _ClassVar[TransferOutcome]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_CONTENT_FILTER: FinishReason
GUIDED_KIND_UNSPECIFIED: GuidedKind
GUIDED_KIND_JSON_OBJECT: GuidedKind
GUIDED_KIND_JSON_SCHEMA: GuidedKind
GUIDED_KIND_LARK: GuidedKind
PREFILL_MODE_AUTO: PrefillMode
PREFILL_MODE_REMOTE: PrefillMode
PREFILL_MODE_LOCAL: PrefillMode
PREFILL_PATH_UNSPECIFIED: PrefillPath
PREFILL_PATH_REMOTE: PrefillPath
PREFILL_PATH_LOCAL: PrefillPath
PREFILL_PATH_LOCAL_FALLBACK: PrefillPath
TRANSFER_OUTCOME_UNSPECIFIED: TransferOutcome
TRANSFER_OUTCOME_DONE: TransferOutcome
TRANSFER_OUTCOME_FAILED: TransferOutcome
TRANSFER_OUTCOME_TIMED_OUT: TransferOutcome
TRANSFER_OUTCOME_ABORTED: TransferOutcome

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop_token_ids", "stop", "ignore_eos", "logprobs", "guided", "num_draft_tokens", "prior_output_tokens", "priority")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GUIDED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIOR_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: int
    guided: GuidedDecoding
    num_draft_tokens: int
    prior_output_tokens: int
    priority: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., guided: _Optional[_Union[GuidedDecoding, _Mapping]] = ..., num_draft_tokens: _Optional[int] = ..., prior_output_tokens: _Optional[int] = ..., priority: _Optional[int] = ...) -> None: ...

class GuidedDecoding(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: GuidedKind
    spec: str
    def __init__(self, kind: _Optional[_Union[GuidedKind, str]] = ..., spec: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "prefill_mode", "prefill_worker", "tier", "choices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    prefill_mode: PrefillMode
    prefill_worker: str
    tier: str
    choices: _containers.RepeatedCompositeFieldContainer[Choice]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prefill_mode: _Optional[_Union[PrefillMode, str]] = ..., prefill_worker: _Optional[str] = ..., tier: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[Choice, _Mapping]]] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("request_id", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sampling: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "prefill_path", "fallback_reason", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PATH_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    prefill_path: PrefillPath
    fallback_reason: str
    error: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., prefill_path: _Optional[_Union[PrefillPath, str]] = ..., fallback_reason: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_agent", "remote_block_ids", "num_cached_tokens", "attempt", "transfer_timeout_s", "choice_sampling", "destination_follows")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CHOICE_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    decode_agent: str
    remote_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    attempt: int
    transfer_timeout_s: float
    choice_sampling: _containers.RepeatedCompositeFieldContainer[SamplingParams]
    destination_follows: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., decode_agent: _Optional[str] = ..., remote_block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., attempt: _Optional[int] = ..., transfer_timeout_s: _Optional[float] = ..., choice_sampling: _Optional[_Iterable[_Union[SamplingParams, _Mapping]]] = ..., destination_follows: _Optional[bool] = ...) -> None: ...

class PrefillDestinationRequest(_message.Message):
    __slots__ = ("request_id", "attempt", "remote_block_ids", "num_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    attempt: int
    remote_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., attempt: _Optional[int] = ..., remote_block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillDestinationResponse(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_logprob", "outcome", "reason", "prefill_seconds", "transfer_seconds", "transfer_bytes", "num_prefill_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_logprob: TokenLogprob
    outcome: TransferOutcome
    reason: str
    prefill_seconds: float
    transfer_seconds: float
    transfer_bytes: int
    num_prefill_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., outcome: _Optional[_Union[TransferOutcome, str]] = ..., reason: _Optional[str] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., num_prefill_cached_tokens: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("protocol_version", "model_id", "dtype", "layout", "block_size", "num_layers", "num_kv_heads", "head_dim", "tp_size", "tp_rank", "pp_size", "pp_rank", "first_layer")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model_id: str
    dtype: str
    layout: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    first_layer: int
    def __init__(self, protocol_version: _Optional[int] = ..., model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., layout: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., first_layer: _Optional[int] = ...) -> None: ...

class KVHandshake(_message.Message):
    __slots__ = ("layout", "agent_name", "agent_metadata", "base_address", "num_blocks", "bytes_per_block", "device_kind", "device_id", "ranks")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    agent_name: str
    agent_metadata: bytes
    base_address: int
    num_blocks: int
    bytes_per_block: int
    device_kind: str
    device_id: int
    ranks: _containers.RepeatedCompositeFieldContainer[KVHandshake]
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., base_address: _Optional[int] = ..., num_blocks: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., device_kind: _Optional[str] = ..., device_id: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[KVHandshake, _Mapping]]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("decode", "worker_id")
    DECODE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    decode: KVHandshake
    worker_id: str
    def __init__(self, decode: _Optional[_Union[KVHandshake, _Mapping]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("prefill", "worker_id")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    prefill: KVHandshake
    worker_id: str
    def __init__(self, prefill: _Optional[_Union[KVHandshake, _Mapping]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "model", "queue_depth", "running_seqs", "free_blocks", "total_blocks", "block_size", "inflight_prefill_tokens", "held_blocks", "quarantined_requests", "waiting_for_remote_kv", "inflight_transfers", "draining", "max_num_seqs", "inflight_prefill_requests", "running_context_tokens", "running_remaining_tokens", "requests_received", "max_prefill_chunk", "kv_tiers")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_REMOTE_KV_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_PREFILL_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REMAINING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    KV_TIERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    model: str
    queue_depth: int
    running_seqs: int
    free_blocks: int
    total_blocks: int
    block_size: int
    inflight_prefill_tokens: int
    held_blocks: int
    quarantined_requests: int
    waiting_for_remote_kv: int
    inflight_transfers: int
    draining: bool
    max_num_seqs: int
    inflight_prefill_requests: int
    running_context_tokens: int
    running_remaining_tokens: int
    requests_received: int
    max_prefill_chunk: int
    kv_tiers: _containers.RepeatedCompositeFieldContainer[KVTierStatus]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., queue_depth: _Optional[int] = ..., running_seqs: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., inflight_prefill_tokens: _Optional[int] = ..., held_blocks: _Optional[int] = ..., quarantined_requests: _Optional[int] = ..., waiting_for_remote_kv: _Optional[int] = ..., inflight_transfers: _Optional[int] = ..., draining: _Optional[bool] = ..., max_num_seqs: _Optional[int] = ..., inflight_prefill_requests: _Optional[int] = ..., running_context_tokens: _Optional[int] = ..., running_remaining_tokens: _Optional[int] = ..., requests_received: _Optional[int] = ..., max_prefill_chunk: _Optional[int] = ..., kv_tiers: _Optional[_Iterable[_Union[KVTierStatus, _Mapping]]] = ...) -> None: ...

class KVTierStatus(_message.Message):
    __slots__ = ("tier", "capacity_blocks", "occupied_blocks", "pinned_blocks", "hit_blocks", "spills_dropped")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OCCUPIED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPILLS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    tier: str
    capacity_blocks: int
    occupied_blocks: int
    pinned_blocks: int
    hit_blocks: int
    spills_dropped: int
    def __init__(self, tier: _Optional[str] = ..., capacity_blocks: _Optional[int] = ..., occupied_blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., spills_dropped: _Optional[int] = ...) -> None: ...

class InjectFaultRequest(_message.Message):
    __slots__ = ("fault", "times", "delay_s")
    FAULT_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    DELAY_S_FIELD_NUMBER: _ClassVar[int]
    fault: str
    times: int
    delay_s: float
    def __init__(self, fault: _Optional[str] = ..., times: _Optional[int] = ..., delay_s: _Optional[float] = ...) -> None: ...

class InjectFaultResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
