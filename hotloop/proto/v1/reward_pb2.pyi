from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreRequest(_message.Message):
    __slots__ = ("id", "prompt", "completion", "task", "scorer")
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    SCORER_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt: str
    completion: str
    task: TaskSpec
    scorer: str
    def __init__(self, id: _Optional[str] = ..., prompt: _Optional[str] = ..., completion: _Optional[str] = ..., task: _Optional[_Union[TaskSpec, _Mapping]] = ..., scorer: _Optional[str] = ...) -> None: ...

class TaskSpec(_message.Message):
    __slots__ = ("task_id", "tests", "entry_point", "test_cases", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TESTS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_POINT_FIELD_NUMBER: _ClassVar[int]
    TEST_CASES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    tests: str
    entry_point: str
    test_cases: _containers.RepeatedScalarFieldContainer[str]
    extra: _containers.ScalarMap[str, str]
    def __init__(self, task_id: _Optional[str] = ..., tests: _Optional[str] = ..., entry_point: _Optional[str] = ..., test_cases: _Optional[_Iterable[str]] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("id", "reward", "passed", "failed", "timed_out", "error", "status", "seconds")
    ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    reward: float
    passed: int
    failed: int
    timed_out: bool
    error: str
    status: str
    seconds: float
    def __init__(self, id: _Optional[str] = ..., reward: _Optional[float] = ..., passed: _Optional[int] = ..., failed: _Optional[int] = ..., timed_out: _Optional[bool] = ..., error: _Optional[str] = ..., status: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...
