from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SafetyTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAFETY_TIER_UNSPECIFIED: _ClassVar[SafetyTier]
    SAFETY_TIER_NONE: _ClassVar[SafetyTier]
    SAFETY_TIER_PATTERN: _ClassVar[SafetyTier]
    SAFETY_TIER_CLASSIFIER: _ClassVar[SafetyTier]
    SAFETY_TIER_GUARD: _ClassVar[SafetyTier]
SAFETY_TIER_UNSPECIFIED: SafetyTier
SAFETY_TIER_NONE: SafetyTier
SAFETY_TIER_PATTERN: SafetyTier
SAFETY_TIER_CLASSIFIER: SafetyTier
SAFETY_TIER_GUARD: SafetyTier

class CheckInputRequest(_message.Message):
    __slots__ = ("org_id", "text", "request_id")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    org_id: str
    text: str
    request_id: str
    def __init__(self, org_id: _Optional[str] = ..., text: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class OutputChunk(_message.Message):
    __slots__ = ("org_id", "request_id", "delta", "final", "watch")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    WATCH_FIELD_NUMBER: _ClassVar[int]
    org_id: str
    request_id: str
    delta: str
    final: bool
    watch: bool
    def __init__(self, org_id: _Optional[str] = ..., request_id: _Optional[str] = ..., delta: _Optional[str] = ..., final: _Optional[bool] = ..., watch: _Optional[bool] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("allowed", "category", "score", "tier", "watch", "category_scores")
    class CategoryScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    WATCH_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_SCORES_FIELD_NUMBER: _ClassVar[int]
    allowed: bool
    category: str
    score: float
    tier: SafetyTier
    watch: bool
    category_scores: _containers.ScalarMap[str, float]
    def __init__(self, allowed: _Optional[bool] = ..., category: _Optional[str] = ..., score: _Optional[float] = ..., tier: _Optional[_Union[SafetyTier, str]] = ..., watch: _Optional[bool] = ..., category_scores: _Optional[_Mapping[str, float]] = ...) -> None: ...
