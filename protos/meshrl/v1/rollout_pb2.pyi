from meshrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "max_tokens", "stop", "seed", "adapter")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    adapter: str
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., adapter: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("prompts", "sampling", "packed", "columnar", "partial_rollout")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    COLUMNAR_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    sampling: SamplingParams
    packed: bool
    columnar: bool
    partial_rollout: str
    def __init__(self, prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., packed: _Optional[bool] = ..., columnar: _Optional[bool] = ..., partial_rollout: _Optional[str] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("response_ids", "logprobs", "text", "finish_reason", "weight_version", "response_ids_packed", "logprobs_packed", "weight_versions", "cached_prompt_tokens")
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_PACKED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_PACKED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    finish_reason: str
    weight_version: int
    response_ids_packed: bytes
    logprobs_packed: bytes
    weight_versions: _containers.RepeatedScalarFieldContainer[int]
    cached_prompt_tokens: int
    def __init__(self, response_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., weight_version: _Optional[int] = ..., response_ids_packed: _Optional[bytes] = ..., logprobs_packed: _Optional[bytes] = ..., weight_versions: _Optional[_Iterable[int]] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

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

class AgentSpec(_message.Message):
    __slots__ = ("name", "max_turns", "max_total_tokens", "max_tokens_per_turn", "tools", "tool_call_parser", "tool_error_policy", "environment", "environment_deterministic", "program")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_TURN_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_PARSER_FIELD_NUMBER: _ClassVar[int]
    TOOL_ERROR_POLICY_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_turns: int
    max_total_tokens: int
    max_tokens_per_turn: int
    tools: _containers.RepeatedScalarFieldContainer[str]
    tool_call_parser: str
    tool_error_policy: str
    environment: str
    environment_deterministic: bool
    program: str
    def __init__(self, name: _Optional[str] = ..., max_turns: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., max_tokens_per_turn: _Optional[int] = ..., tools: _Optional[_Iterable[str]] = ..., tool_call_parser: _Optional[str] = ..., tool_error_policy: _Optional[str] = ..., environment: _Optional[str] = ..., environment_deterministic: _Optional[bool] = ..., program: _Optional[str] = ...) -> None: ...

class EpisodePrompt(_message.Message):
    __slots__ = ("id", "text", "prompt_ids", "messages_json", "agent_name", "tools_kwargs_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_JSON_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    TOOLS_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    text: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    messages_json: str
    agent_name: str
    tools_kwargs_json: str
    def __init__(self, id: _Optional[str] = ..., text: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., messages_json: _Optional[str] = ..., agent_name: _Optional[str] = ..., tools_kwargs_json: _Optional[str] = ...) -> None: ...

class GenerateEpisodesRequest(_message.Message):
    __slots__ = ("prompts", "sampling", "agent", "partial_rollout")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[EpisodePrompt]
    sampling: SamplingParams
    agent: AgentSpec
    partial_rollout: str
    def __init__(self, prompts: _Optional[_Iterable[_Union[EpisodePrompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., agent: _Optional[_Union[AgentSpec, _Mapping]] = ..., partial_rollout: _Optional[str] = ...) -> None: ...

class EpisodeInfo(_message.Message):
    __slots__ = ("text", "end_reason", "num_turns", "num_tool_calls", "num_tool_errors", "env_reward", "env_metrics", "prompt_ids")
    class EnvMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    END_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOOL_ERRORS_FIELD_NUMBER: _ClassVar[int]
    ENV_REWARD_FIELD_NUMBER: _ClassVar[int]
    ENV_METRICS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    end_reason: str
    num_turns: int
    num_tool_calls: int
    num_tool_errors: int
    env_reward: float
    env_metrics: _containers.ScalarMap[str, float]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., end_reason: _Optional[str] = ..., num_turns: _Optional[int] = ..., num_tool_calls: _Optional[int] = ..., num_tool_errors: _Optional[int] = ..., env_reward: _Optional[float] = ..., env_metrics: _Optional[_Mapping[str, float]] = ..., prompt_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EpisodeGroup(_message.Message):
    __slots__ = ("prompt_id", "prompt_ids", "episodes")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    episodes: _containers.RepeatedCompositeFieldContainer[EpisodeInfo]
    def __init__(self, prompt_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., episodes: _Optional[_Iterable[_Union[EpisodeInfo, _Mapping]]] = ...) -> None: ...

class GenerateEpisodesResponse(_message.Message):
    __slots__ = ("groups", "response_rows", "logprob_rows", "loss_mask_rows", "version_rows")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_ROWS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_ROWS_FIELD_NUMBER: _ClassVar[int]
    VERSION_ROWS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[EpisodeGroup]
    response_rows: _common_pb2.Ragged
    logprob_rows: _common_pb2.Ragged
    loss_mask_rows: _common_pb2.Ragged
    version_rows: _common_pb2.Ragged
    def __init__(self, groups: _Optional[_Iterable[_Union[EpisodeGroup, _Mapping]]] = ..., response_rows: _Optional[_Union[_common_pb2.Ragged, _Mapping]] = ..., logprob_rows: _Optional[_Union[_common_pb2.Ragged, _Mapping]] = ..., loss_mask_rows: _Optional[_Union[_common_pb2.Ragged, _Mapping]] = ..., version_rows: _Optional[_Union[_common_pb2.Ragged, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("name", "unloaded", "adapters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    unloaded: bool
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., unloaded: _Optional[bool] = ..., adapters: _Optional[_Iterable[str]] = ...) -> None: ...
