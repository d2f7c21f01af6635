from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompletionFinish(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPLETION_FINISH_UNSPECIFIED: _ClassVar[CompletionFinish]
    COMPLETION_FINISH_STOP: _ClassVar[CompletionFinish]
    COMPLETION_FINISH_LENGTH: _ClassVar[CompletionFinish]
    COMPLETION_FINISH_CONTENT_FILTER: _ClassVar[CompletionFinish]
    COMPLETION_FINISH_TOOL_CALLS: _ClassVar[CompletionFinish]
    COMPLETION_FINISH_ABORT: _ClassVar[CompletionFinish]
    COMPLETION_FINISH_ERROR: _ClassVar[CompletionFinish]
COMPLETION_FINISH_UNSPECIFIED: CompletionFinish
COMPLETION_FINISH_STOP: CompletionFinish
COMPLETION_FINISH_LENGTH: CompletionFinish
COMPLETION_FINISH_CONTENT_FILTER: CompletionFinish
COMPLETION_FINISH_TOOL_CALLS: CompletionFinish
COMPLETION_FINISH_ABORT: CompletionFinish
COMPLETION_FINISH_ERROR: CompletionFinish

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "n", "logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    presence_penalty: float
    frequency_penalty: float
    n: int
    logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., n: _Optional[int] = ..., logprobs: _Optional[int] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("model", "messages", "sampling", "user", "conversation_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling: SamplingOptions
    user: str
    conversation_id: str
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., user: _Optional[str] = ..., conversation_id: _Optional[str] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("model", "prompt", "sampling", "user", "echo")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    sampling: SamplingOptions
    user: str
    echo: bool
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., user: _Optional[str] = ..., echo: _Optional[bool] = ...) -> None: ...

class TextAlternative(_message.Message):
    __slots__ = ("token", "logprob")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token: str
    logprob: float
    def __init__(self, token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TextLogprob(_message.Message):
    __slots__ = ("token", "logprob", "raw", "top")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token: str
    logprob: float
    raw: bytes
    top: _containers.RepeatedCompositeFieldContainer[TextAlternative]
    def __init__(self, token: _Optional[str] = ..., logprob: _Optional[float] = ..., raw: _Optional[bytes] = ..., top: _Optional[_Iterable[_Union[TextAlternative, _Mapping]]] = ...) -> None: ...

class ChoiceDelta(_message.Message):
    __slots__ = ("index", "text", "finish", "refusal", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    finish: CompletionFinish
    refusal: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TextLogprob]
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., finish: _Optional[_Union[CompletionFinish, str]] = ..., refusal: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TextLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class CompletionChunk(_message.Message):
    __slots__ = ("id", "model", "created", "choices", "usage", "conversation_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    created: int
    choices: _containers.RepeatedCompositeFieldContainer[ChoiceDelta]
    usage: Usage
    conversation_id: str
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., created: _Optional[int] = ..., choices: _Optional[_Iterable[_Union[ChoiceDelta, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., conversation_id: _Optional[str] = ...) -> None: ...
