from meshrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreItem(_message.Message):
    __slots__ = ("id", "prompt", "response", "response_ids", "ground_truth", "data_source", "response_ids_packed", "extra_info_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_PACKED_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt: str
    response: str
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    ground_truth: str
    data_source: str
    response_ids_packed: bytes
    extra_info_json: str
    def __init__(self, id: _Optional[str] = ..., prompt: _Optional[str] = ..., response: _Optional[str] = ..., response_ids: _Optional[_Iterable[int]] = ..., ground_truth: _Optional[str] = ..., data_source: _Optional[str] = ..., response_ids_packed: _Optional[bytes] = ..., extra_info_json: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items", "components")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    components: _containers.RepeatedCompositeFieldContainer[RewardComponent]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ..., components: _Optional[_Iterable[_Union[RewardComponent, _Mapping]]] = ...) -> None: ...

class RewardComponent(_message.Message):
    __slots__ = ("name", "weight", "params_json", "label")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    params_json: str
    label: str
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ..., params_json: _Optional[str] = ..., label: _Optional[str] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("id", "score", "components", "extras", "error")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ExtrasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: str
    score: float
    components: _containers.ScalarMap[str, float]
    extras: _containers.ScalarMap[str, float]
    error: str
    def __init__(self, id: _Optional[str] = ..., score: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ..., extras: _Optional[_Mapping[str, float]] = ..., error: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ...) -> None: ...
