from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Ragged(_message.Message):
    __slots__ = ("lengths", "values")
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    lengths: bytes
    values: bytes
    def __init__(self, lengths: _Optional[bytes] = ..., values: _Optional[bytes] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("id", "prompt_ids", "response_ids", "prompt_ids_packed", "response_ids_packed")
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_PACKED_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_PACKED_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_ids_packed: bytes
    response_ids_packed: bytes
    def __init__(self, id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ..., prompt_ids_packed: _Optional[bytes] = ..., response_ids_packed: _Optional[bytes] = ...) -> None: ...

class TokenLogProbs(_message.Message):
    __slots__ = ("id", "logprobs", "logprobs_packed")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_PACKED_FIELD_NUMBER: _ClassVar[int]
    id: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    logprobs_packed: bytes
    def __init__(self, id: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., logprobs_packed: _Optional[bytes] = ...) -> None: ...

class LogProbsRequest(_message.Message):
    __slots__ = ("sequences", "temperature", "packed", "prompt_rows", "response_rows", "adapter")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ROWS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_ROWS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    temperature: float
    packed: bool
    prompt_rows: Ragged
    response_rows: Ragged
    adapter: str
    def __init__(self, sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., temperature: _Optional[float] = ..., packed: _Optional[bool] = ..., prompt_rows: _Optional[_Union[Ragged, _Mapping]] = ..., response_rows: _Optional[_Union[Ragged, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class LogProbsResponse(_message.Message):
    __slots__ = ("results", "weight_version", "logprob_rows")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_ROWS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TokenLogProbs]
    weight_version: int
    logprob_rows: Ragged
    def __init__(self, results: _Optional[_Iterable[_Union[TokenLogProbs, _Mapping]]] = ..., weight_version: _Optional[int] = ..., logprob_rows: _Optional[_Union[Ragged, _Mapping]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("version", "tensors", "total_bytes", "transport", "group_id", "adapter", "adapter_config", "base_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_CONFIG_FIELD_NUMBER: _ClassVar[int]
    BASE_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    total_bytes: int
    transport: str
    group_id: str
    adapter: str
    adapter_config: str
    base_id: str
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., transport: _Optional[str] = ..., group_id: _Optional[str] = ..., adapter: _Optional[str] = ..., adapter_config: _Optional[str] = ..., base_id: _Optional[str] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device_uuid", "handle", "storage_bytes", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "buffer_id")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    buffer_id: str
    def __init__(self, device_uuid: _Optional[str] = ..., handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., buffer_id: _Optional[str] = ...) -> None: ...

class DeviceBucket(_message.Message):
    __slots__ = ("offset", "nbytes", "checksum", "ipc")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    offset: int
    nbytes: int
    checksum: int
    ipc: CudaIpcHandle
    def __init__(self, offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[int] = ..., ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class WeightBucket(_message.Message):
    __slots__ = ("manifest", "data", "crc32", "device", "commit")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    manifest: WeightManifest
    data: bytes
    crc32: int
    device: DeviceBucket
    commit: bool
    def __init__(self, manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., device: _Optional[_Union[DeviceBucket, _Mapping]] = ..., commit: _Optional[bool] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "num_bytes", "seconds")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    num_bytes: int
    seconds: float
    def __init__(self, weight_version: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class WeightGroupRequest(_message.Message):
    __slots__ = ("group_id", "unique_id", "rank", "world_size", "timeout_s")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    unique_id: bytes
    rank: int
    world_size: int
    timeout_s: float
    def __init__(self, group_id: _Optional[str] = ..., unique_id: _Optional[bytes] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WeightGroupResponse(_message.Message):
    __slots__ = ("group_id", "device_uuid")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    device_uuid: str
    def __init__(self, group_id: _Optional[str] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceInfo(_message.Message):
    __slots__ = ("role", "model", "weight_version", "details")
    class DetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    weight_version: int
    details: _containers.ScalarMap[str, str]
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., weight_version: _Optional[int] = ..., details: _Optional[_Mapping[str, str]] = ...) -> None: ...
