from meshrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "max_tokens", "stop", "seed")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("id", "text", "prompt_ids")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    text: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[str] = ..., text: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "sampling", "packed", "columnar")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    COLUMNAR_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    packed: bool
    columnar: bool
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., packed: _Optional[bool] = ..., columnar: _Optional[bool] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("response_ids", "logprobs", "text", "finish_reason", "weight_version", "response_ids_packed", "logprobs_packed")
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_PACKED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_PACKED_FIELD_NUMBER: _ClassVar[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    finish_reason: str
    weight_version: int
    response_ids_packed: bytes
    logprobs_packed: bytes
    def __init__(self, response_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., weight_version: _Optional[int] = ..., response_ids_packed: _Optional[bytes] = ..., logprobs_packed: _Optional[bytes] = ...) -> None: ...

class RolloutResponse(_message.Message):
    __slots__ = ("prompt_id", "prompt_ids", "samples")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, prompt_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("responses", "response_rows", "logprob_rows")
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_ROWS_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[RolloutResponse]
    response_rows: _common_pb2.Ragged
    logprob_rows: _common_pb2.Ragged
    def __init__(self, responses: _Optional[_Iterable[_Union[RolloutResponse, _Mapping]]] = ..., response_rows: _Optional[_Union[_common_pb2.Ragged, _Mapping]] = ..., logprob_rows: _Optional[_Union[_common_pb2.Ragged, _Mapping]] = ...) -> None: ...
