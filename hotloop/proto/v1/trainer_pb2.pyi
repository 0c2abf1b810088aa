from hotloop.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("algorithm", "step", "latest_version", "last_metrics", "runtime")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    algorithm: str
    step: int
    latest_version: int
    last_metrics: _containers.ScalarMap[str, float]
    runtime: _common_pb2.RuntimeInfo
    def __init__(self, algorithm: _Optional[str] = ..., step: _Optional[int] = ..., latest_version: _Optional[int] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., runtime: _Optional[_Union[_common_pb2.RuntimeInfo, _Mapping]] = ...) -> None: ...

class FetchAdapterRequest(_message.Message):
    __slots__ = ("version", "tenant")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    version: int
    tenant: str
    def __init__(self, version: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class FetchAdapterChunk(_message.Message):
    __slots__ = ("info", "data")
    INFO_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.VersionInfo
    data: bytes
    def __init__(self, info: _Optional[_Union[_common_pb2.VersionInfo, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
