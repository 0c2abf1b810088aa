from hotloop.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WeightsUpdated(_message.Message):
    __slots__ = ("info", "fetch_from", "tenant")
    INFO_FIELD_NUMBER: _ClassVar[int]
    FETCH_FROM_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.VersionInfo
    fetch_from: str
    tenant: str
    def __init__(self, info: _Optional[_Union[_common_pb2.VersionInfo, _Mapping]] = ..., fetch_from: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class AdapterLoaded(_message.Message):
    __slots__ = ("replica", "info", "load_ms")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    info: _common_pb2.VersionInfo
    load_ms: float
    def __init__(self, replica: _Optional[str] = ..., info: _Optional[_Union[_common_pb2.VersionInfo, _Mapping]] = ..., load_ms: _Optional[float] = ...) -> None: ...

class FeedbackEvent(_message.Message):
    __slots__ = ("response_id", "score", "label", "text", "user", "received_at", "choice", "tenant")
    RESPONSE_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_AT_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    response_id: str
    score: float
    label: str
    text: str
    user: str
    received_at: float
    choice: int
    tenant: str
    def __init__(self, response_id: _Optional[str] = ..., score: _Optional[float] = ..., label: _Optional[str] = ..., text: _Optional[str] = ..., user: _Optional[str] = ..., received_at: _Optional[float] = ..., choice: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class TrafficEvent(_message.Message):
    __slots__ = ("response_id", "prompt_ids", "completion_ids", "logprobs", "policy_version", "served_at", "version_spans", "user", "choice", "temperature", "finish_reason", "tenant")
    RESPONSE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVED_AT_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    response_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_version: int
    served_at: float
    version_spans: _containers.RepeatedCompositeFieldContainer[_common_pb2.VersionSpan]
    user: str
    choice: int
    temperature: float
    finish_reason: str
    tenant: str
    def __init__(self, response_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_version: _Optional[int] = ..., served_at: _Optional[float] = ..., version_spans: _Optional[_Iterable[_Union[_common_pb2.VersionSpan, _Mapping]]] = ..., user: _Optional[str] = ..., choice: _Optional[int] = ..., temperature: _Optional[float] = ..., finish_reason: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class DeadLetter(_message.Message):
    __slots__ = ("subject", "payload", "reason")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    subject: str
    payload: bytes
    reason: str
    def __init__(self, subject: _Optional[str] = ..., payload: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class TenantRecord(_message.Message):
    __slots__ = ("name", "keys", "generation", "created_at", "config", "held", "reset_to")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    RESET_TO_FIELD_NUMBER: _ClassVar[int]
    name: str
    keys: _containers.RepeatedCompositeFieldContainer[TenantKey]
    generation: int
    created_at: float
    config: bool
    held: bool
    reset_to: int
    def __init__(self, name: _Optional[str] = ..., keys: _Optional[_Iterable[_Union[TenantKey, _Mapping]]] = ..., generation: _Optional[int] = ..., created_at: _Optional[float] = ..., config: _Optional[bool] = ..., held: _Optional[bool] = ..., reset_to: _Optional[int] = ...) -> None: ...

class TenantKey(_message.Message):
    __slots__ = ("id", "sha256", "created_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    sha256: str
    created_at: float
    def __init__(self, id: _Optional[str] = ..., sha256: _Optional[str] = ..., created_at: _Optional[float] = ...) -> None: ...
