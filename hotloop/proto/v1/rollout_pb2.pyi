from hotloop.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "sampling", "pin_version", "return_prompt_ids", "request_id", "stream", "priority", "tenant")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[_common_pb2.Prompt]
    sampling: _common_pb2.SamplingParams
    pin_version: int
    return_prompt_ids: bool
    request_id: str
    stream: bool
    priority: int
    tenant: str
    def __init__(self, prompts: _Optional[_Iterable[_Union[_common_pb2.Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., pin_version: _Optional[int] = ..., return_prompt_ids: _Optional[bool] = ..., request_id: _Optional[str] = ..., stream: _Optional[bool] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs", "tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("prompt_index", "sample_index", "text", "token_ids", "logprobs", "finish_reason", "policy_version", "prompt_token_ids", "final", "version_spans", "top_logprobs", "token_texts", "num_prompt_tokens", "tenant")
    PROMPT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TEXTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    prompt_index: int
    sample_index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    policy_version: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    final: bool
    version_spans: _containers.RepeatedCompositeFieldContainer[_common_pb2.VersionSpan]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    token_texts: _containers.RepeatedScalarFieldContainer[str]
    num_prompt_tokens: int
    tenant: str
    def __init__(self, prompt_index: _Optional[int] = ..., sample_index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., policy_version: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., final: _Optional[bool] = ..., version_spans: _Optional[_Iterable[_Union[_common_pb2.VersionSpan, _Mapping]]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., token_texts: _Optional[_Iterable[str]] = ..., num_prompt_tokens: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class AdapterChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: AdapterHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[AdapterHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class AdapterHeader(_message.Message):
    __slots__ = ("info", "make_latest", "tenant")
    INFO_FIELD_NUMBER: _ClassVar[int]
    MAKE_LATEST_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.VersionInfo
    make_latest: bool
    tenant: str
    def __init__(self, info: _Optional[_Union[_common_pb2.VersionInfo, _Mapping]] = ..., make_latest: _Optional[bool] = ..., tenant: _Optional[str] = ...) -> None: ...

class PushAdapterResponse(_message.Message):
    __slots__ = ("loaded", "verify_ms", "load_ms", "already_present")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    loaded: _common_pb2.VersionInfo
    verify_ms: float
    load_ms: float
    already_present: bool
    def __init__(self, loaded: _Optional[_Union[_common_pb2.VersionInfo, _Mapping]] = ..., verify_ms: _Optional[float] = ..., load_ms: _Optional[float] = ..., already_present: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("model", "latest_version", "versions", "running_requests", "update_mode", "engine", "runtime", "swap", "foreground_requests", "waiting_requests", "known_latest_version", "catch_up", "tenants", "resident_adapters")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_MODE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    SWAP_FIELD_NUMBER: _ClassVar[int]
    FOREGROUND_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    latest_version: int
    versions: _containers.RepeatedCompositeFieldContainer[_common_pb2.VersionInfo]
    running_requests: int
    update_mode: str
    engine: str
    runtime: _common_pb2.RuntimeInfo
    swap: str
    foreground_requests: int
    waiting_requests: int
    known_latest_version: int
    catch_up: str
    tenants: _containers.RepeatedCompositeFieldContainer[TenantVersions]
    resident_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., latest_version: _Optional[int] = ..., versions: _Optional[_Iterable[_Union[_common_pb2.VersionInfo, _Mapping]]] = ..., running_requests: _Optional[int] = ..., update_mode: _Optional[str] = ..., engine: _Optional[str] = ..., runtime: _Optional[_Union[_common_pb2.RuntimeInfo, _Mapping]] = ..., swap: _Optional[str] = ..., foreground_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., known_latest_version: _Optional[int] = ..., catch_up: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[TenantVersions, _Mapping]]] = ..., resident_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class TenantVersions(_message.Message):
    __slots__ = ("tenant", "latest_version", "versions", "known_latest_version", "catch_up")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    CATCH_UP_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    latest_version: int
    versions: _containers.RepeatedCompositeFieldContainer[_common_pb2.VersionInfo]
    known_latest_version: int
    catch_up: str
    def __init__(self, tenant: _Optional[str] = ..., latest_version: _Optional[int] = ..., versions: _Optional[_Iterable[_Union[_common_pb2.VersionInfo, _Mapping]]] = ..., known_latest_version: _Optional[int] = ..., catch_up: _Optional[str] = ...) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutLoad(_message.Message):
    __slots__ = ("foreground_requests", "waiting_requests", "board_path", "board_nonce")
    FOREGROUND_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BOARD_PATH_FIELD_NUMBER: _ClassVar[int]
    BOARD_NONCE_FIELD_NUMBER: _ClassVar[int]
    foreground_requests: int
    waiting_requests: int
    board_path: str
    board_nonce: int
    def __init__(self, foreground_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., board_path: _Optional[str] = ..., board_nonce: _Optional[int] = ...) -> None: ...
