from meshrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class CallToolsRequest(_message.Message):
    __slots__ = ("calls", "episode_id")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    episode_id: str
    def __init__(self, calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., episode_id: _Optional[str] = ...) -> None: ...

class ToolResult(_message.Message):
    __slots__ = ("id", "content", "error", "duration_s")
    ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    id: str
    content: str
    error: str
    duration_s: float
    def __init__(self, id: _Optional[str] = ..., content: _Optional[str] = ..., error: _Optional[str] = ..., duration_s: _Optional[float] = ...) -> None: ...

class CallToolsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ToolResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ToolResult, _Mapping]]] = ...) -> None: ...

class ListToolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListToolsResponse(_message.Message):
    __slots__ = ("tools_json",)
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    tools_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tools_json: _Optional[_Iterable[str]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("episode_id", "environment", "kwargs_json")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    environment: str
    kwargs_json: str
    def __init__(self, episode_id: _Optional[str] = ..., environment: _Optional[str] = ..., kwargs_json: _Optional[str] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("observation",)
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    observation: str
    def __init__(self, observation: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("episode_id", "action")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    action: str
    def __init__(self, episode_id: _Optional[str] = ..., action: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "reward", "done", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    observation: str
    reward: float
    done: bool
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, observation: _Optional[str] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class EndEpisodeRequest(_message.Message):
    __slots__ = ("episode_id",)
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    def __init__(self, episode_id: _Optional[str] = ...) -> None: ...

class EndEpisodeResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...
