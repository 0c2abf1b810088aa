from hotloop.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReferenceStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReferenceStatus(_message.Message):
    __slots__ = ("model", "runtime")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    model: str
    runtime: _common_pb2.RuntimeInfo
    def __init__(self, model: _Optional[str] = ..., runtime: _Optional[_Union[_common_pb2.RuntimeInfo, _Mapping]] = ...) -> None: ...

class LogprobsRequest(_message.Message):
    __slots__ = ("id", "prompt_ids", "completion_ids")
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LogprobsResult(_message.Message):
    __slots__ = ("id", "logprobs")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    id: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, id: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...
