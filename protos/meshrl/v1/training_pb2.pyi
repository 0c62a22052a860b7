from meshrl.v1 import common_pb2 as _common_pb2
from meshrl.v1 import rollout_pb2 as _rollout_pb2
from meshrl.v1 import trainer_pb2 as _trainer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateTrainingClientRequest(_message.Message):
    __slots__ = ("base_model", "rank")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    rank: int
    def __init__(self, base_model: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class TrainingClientInfo(_message.Message):
    __slots__ = ("client_id", "base_model", "rank", "weight_version", "step", "adapter")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    base_model: str
    rank: int
    weight_version: int
    step: int
    adapter: str
    def __init__(self, client_id: _Optional[str] = ..., base_model: _Optional[str] = ..., rank: _Optional[int] = ..., weight_version: _Optional[int] = ..., step: _Optional[int] = ..., adapter: _Optional[str] = ...) -> None: ...

class ClientRef(_message.Message):
    __slots__ = ("client_id",)
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    def __init__(self, client_id: _Optional[str] = ...) -> None: ...

class ClientForwardBackwardRequest(_message.Message):
    __slots__ = ("client_id", "request")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    request: _trainer_pb2.ForwardBackwardRequest
    def __init__(self, client_id: _Optional[str] = ..., request: _Optional[_Union[_trainer_pb2.ForwardBackwardRequest, _Mapping]] = ...) -> None: ...

class ClientOptimStepRequest(_message.Message):
    __slots__ = ("client_id", "adam_params")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ADAM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    adam_params: _trainer_pb2.AdamParams
    def __init__(self, client_id: _Optional[str] = ..., adam_params: _Optional[_Union[_trainer_pb2.AdamParams, _Mapping]] = ...) -> None: ...

class ModelInput(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("client_id", "prompts", "num_samples", "sampling_params")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[ModelInput]
    num_samples: int
    sampling_params: _rollout_pb2.SamplingParams
    def __init__(self, client_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[ModelInput, _Mapping]]] = ..., num_samples: _Optional[int] = ..., sampling_params: _Optional[_Union[_rollout_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class SampledSequence(_message.Message):
    __slots__ = ("tokens", "logprobs", "stop_reason")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    stop_reason: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., stop_reason: _Optional[str] = ...) -> None: ...

class PromptSamples(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SampledSequence]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SampledSequence, _Mapping]]] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("results", "weight_version")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PromptSamples]
    weight_version: int
    def __init__(self, results: _Optional[_Iterable[_Union[PromptSamples, _Mapping]]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("client_id", "path")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    path: str
    def __init__(self, client_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class StateResponse(_message.Message):
    __slots__ = ("path", "step", "weight_version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    weight_version: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ...) -> None: ...

class TokenizerResponse(_message.Message):
    __slots__ = ("files", "eos_token_id", "bos_token_id", "pad_token_id", "vocab_size")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    eos_token_id: int
    bos_token_id: int
    pad_token_id: int
    vocab_size: int
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ..., eos_token_id: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., pad_token_id: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("client_id", "texts", "add_special_tokens")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    add_special_tokens: bool
    def __init__(self, client_id: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, results: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("client_id", "ids", "skip_special_tokens")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    skip_special_tokens: bool
    def __init__(self, client_id: _Optional[str] = ..., ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...
