from rpcgen.baton.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepSample(_message.Message):
    __slots__ = ("kind", "tokens", "context_tokens", "seconds", "attention_tokens_sq", "decode_seqs")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[StepSample.Kind]
        KIND_PREFILL: _ClassVar[StepSample.Kind]
        KIND_DECODE: _ClassVar[StepSample.Kind]
        KIND_MIXED: _ClassVar[StepSample.Kind]
    KIND_UNSPECIFIED: StepSample.Kind
    KIND_PREFILL: StepSample.Kind
    KIND_DECODE: StepSample.Kind
    KIND_MIXED: StepSample.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_TOKENS_SQ_FIELD_NUMBER: _ClassVar[int]
    DECODE_SEQS_FIELD_NUMBER: _ClassVar[int]
    kind: StepSample.Kind
    tokens: int
    context_tokens: int
    seconds: float
    attention_tokens_sq: int
    decode_seqs: int
    def __init__(self, kind: _Optional[_Union[StepSample.Kind, str]] = ..., tokens: _Optional[int] = ..., context_tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., attention_tokens_sq: _Optional[int] = ..., decode_seqs: _Optional[int] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("kind", "block_hash", "tier")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[KVEvent.Kind]
        KIND_STORED: _ClassVar[KVEvent.Kind]
        KIND_EVICTED: _ClassVar[KVEvent.Kind]
    KIND_UNSPECIFIED: KVEvent.Kind
    KIND_STORED: KVEvent.Kind
    KIND_EVICTED: KVEvent.Kind
    class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TIER_GPU: _ClassVar[KVEvent.Tier]
        TIER_HOST: _ClassVar[KVEvent.Tier]
        TIER_DISK: _ClassVar[KVEvent.Tier]
    TIER_GPU: KVEvent.Tier
    TIER_HOST: KVEvent.Tier
    TIER_DISK: KVEvent.Tier
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    kind: KVEvent.Kind
    block_hash: int
    tier: KVEvent.Tier
    def __init__(self, kind: _Optional[_Union[KVEvent.Kind, str]] = ..., block_hash: _Optional[int] = ..., tier: _Optional[_Union[KVEvent.Tier, str]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "address", "status")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    status: _worker_pb2.WorkerStatus
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., status: _Optional[_Union[_worker_pb2.WorkerStatus, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s",)
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("status", "samples", "kv_events")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    status: _worker_pb2.WorkerStatus
    samples: _containers.RepeatedCompositeFieldContainer[StepSample]
    kv_events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, status: _Optional[_Union[_worker_pb2.WorkerStatus, _Mapping]] = ..., samples: _Optional[_Iterable[_Union[StepSample, _Mapping]]] = ..., kv_events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known", "switch_to_role")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    SWITCH_TO_ROLE_FIELD_NUMBER: _ClassVar[int]
    known: bool
    switch_to_role: str
    def __init__(self, known: _Optional[bool] = ..., switch_to_role: _Optional[str] = ...) -> None: ...

class SLO(_message.Message):
    __slots__ = ("ttft_ms", "tpot_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    tpot_ms: float
    def __init__(self, ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "prefix_block_hashes", "tier", "slo", "max_tokens", "conversation_id", "model", "num_choices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_CHOICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    prefix_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    tier: str
    slo: SLO
    max_tokens: int
    conversation_id: str
    model: str
    num_choices: int
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., prefix_block_hashes: _Optional[_Iterable[int]] = ..., tier: _Optional[str] = ..., slo: _Optional[_Union[SLO, _Mapping]] = ..., max_tokens: _Optional[int] = ..., conversation_id: _Optional[str] = ..., model: _Optional[str] = ..., num_choices: _Optional[int] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("kind", "decode_worker", "prefill_worker", "predicted_ttft_ms", "predicted_tpot_ms", "reason", "retry_after_s", "max_tokens", "decode_worker_id", "prefill_worker_id", "cached_blocks", "prefill_reason", "model")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[RouteResponse.Kind]
        KIND_ROUTE: _ClassVar[RouteResponse.Kind]
        KIND_QUEUE: _ClassVar[RouteResponse.Kind]
        KIND_DEGRADE: _ClassVar[RouteResponse.Kind]
        KIND_REJECT: _ClassVar[RouteResponse.Kind]
    KIND_UNSPECIFIED: RouteResponse.Kind
    KIND_ROUTE: RouteResponse.Kind
    KIND_QUEUE: RouteResponse.Kind
    KIND_DEGRADE: RouteResponse.Kind
    KIND_REJECT: RouteResponse.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_REASON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    kind: RouteResponse.Kind
    decode_worker: str
    prefill_worker: str
    predicted_ttft_ms: float
    predicted_tpot_ms: float
    reason: str
    retry_after_s: float
    max_tokens: int
    decode_worker_id: str
    prefill_worker_id: str
    cached_blocks: int
    prefill_reason: str
    model: str
    def __init__(self, kind: _Optional[_Union[RouteResponse.Kind, str]] = ..., decode_worker: _Optional[str] = ..., prefill_worker: _Optional[str] = ..., predicted_ttft_ms: _Optional[float] = ..., predicted_tpot_ms: _Optional[float] = ..., reason: _Optional[str] = ..., retry_after_s: _Optional[float] = ..., max_tokens: _Optional[int] = ..., decode_worker_id: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., cached_blocks: _Optional[int] = ..., prefill_reason: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class FinishedRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class FinishedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LiveWorker(_message.Message):
    __slots__ = ("address", "status", "role_switch")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROLE_SWITCH_FIELD_NUMBER: _ClassVar[int]
    address: str
    status: _worker_pb2.WorkerStatus
    role_switch: RoleSwitch
    def __init__(self, address: _Optional[str] = ..., status: _Optional[_Union[_worker_pb2.WorkerStatus, _Mapping]] = ..., role_switch: _Optional[_Union[RoleSwitch, _Mapping]] = ...) -> None: ...

class RoleSwitch(_message.Message):
    __slots__ = ("worker_id", "from_role", "to_role", "state")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[RoleSwitch.State]
        STATE_DRAINING: _ClassVar[RoleSwitch.State]
        STATE_SWITCHING: _ClassVar[RoleSwitch.State]
        STATE_DONE: _ClassVar[RoleSwitch.State]
    STATE_UNSPECIFIED: RoleSwitch.State
    STATE_DRAINING: RoleSwitch.State
    STATE_SWITCHING: RoleSwitch.State
    STATE_DONE: RoleSwitch.State
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_ROLE_FIELD_NUMBER: _ClassVar[int]
    TO_ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    from_role: str
    to_role: str
    state: RoleSwitch.State
    def __init__(self, worker_id: _Optional[str] = ..., from_role: _Optional[str] = ..., to_role: _Optional[str] = ..., state: _Optional[_Union[RoleSwitch.State, str]] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("worker_id", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("role_switch",)
    ROLE_SWITCH_FIELD_NUMBER: _ClassVar[int]
    role_switch: RoleSwitch
    def __init__(self, role_switch: _Optional[_Union[RoleSwitch, _Mapping]] = ...) -> None: ...

class ReportWorkerFailureRequest(_message.Message):
    __slots__ = ("worker_address", "reason", "detail")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[ReportWorkerFailureRequest.Reason]
        REASON_UNAVAILABLE: _ClassVar[ReportWorkerFailureRequest.Reason]
        REASON_STREAM_BROKEN: _ClassVar[ReportWorkerFailureRequest.Reason]
    REASON_UNSPECIFIED: ReportWorkerFailureRequest.Reason
    REASON_UNAVAILABLE: ReportWorkerFailureRequest.Reason
    REASON_STREAM_BROKEN: ReportWorkerFailureRequest.Reason
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    worker_address: str
    reason: ReportWorkerFailureRequest.Reason
    detail: str
    def __init__(self, worker_address: _Optional[str] = ..., reason: _Optional[_Union[ReportWorkerFailureRequest.Reason, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class ReportWorkerFailureResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[LiveWorker]
    def __init__(self, workers: _Optional[_Iterable[_Union[LiveWorker, _Mapping]]] = ...) -> None: ...
