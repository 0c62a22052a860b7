from meshrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OptimSettings(_message.Message):
    __slots__ = ("lr", "weight_decay", "betas", "eps", "grad_clip", "lr_schedule", "warmup_steps", "total_steps", "min_lr_ratio")
    LR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETAS_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_RATIO_FIELD_NUMBER: _ClassVar[int]
    lr: float
    weight_decay: float
    betas: _containers.RepeatedScalarFieldContainer[float]
    eps: float
    grad_clip: float
    lr_schedule: str
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    def __init__(self, lr: _Optional[float] = ..., weight_decay: _Optional[float] = ..., betas: _Optional[_Iterable[float]] = ..., eps: _Optional[float] = ..., grad_clip: _Optional[float] = ..., lr_schedule: _Optional[str] = ..., warmup_steps: _Optional[int] = ..., total_steps: _Optional[int] = ..., min_lr_ratio: _Optional[float] = ...) -> None: ...

class ConfigureRunRequest(_message.Message):
    __slots__ = ("actor", "critic", "reset_schedule", "start", "adapter")
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    CRITIC_FIELD_NUMBER: _ClassVar[int]
    RESET_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    actor: OptimSettings
    critic: OptimSettings
    reset_schedule: bool
    start: RunStart
    adapter: str
    def __init__(self, actor: _Optional[_Union[OptimSettings, _Mapping]] = ..., critic: _Optional[_Union[OptimSettings, _Mapping]] = ..., reset_schedule: _Optional[bool] = ..., start: _Optional[_Union[RunStart, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class RunStart(_message.Message):
    __slots__ = ("checkpoint",)
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint: str
    def __init__(self, checkpoint: _Optional[str] = ...) -> None: ...

class ConfigureRunResponse(_message.Message):
    __slots__ = ("actor", "critic", "actor_lr", "started_from", "weight_version")
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    CRITIC_FIELD_NUMBER: _ClassVar[int]
    ACTOR_LR_FIELD_NUMBER: _ClassVar[int]
    STARTED_FROM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    actor: OptimSettings
    critic: OptimSettings
    actor_lr: float
    started_from: str
    weight_version: int
    def __init__(self, actor: _Optional[_Union[OptimSettings, _Mapping]] = ..., critic: _Optional[_Union[OptimSettings, _Mapping]] = ..., actor_lr: _Optional[float] = ..., started_from: _Optional[str] = ..., weight_version: _Optional[int] = ...) -> None: ...

class TrainSample(_message.Message):
    __slots__ = ("prompt_ids", "response_ids", "advantages", "old_logprobs", "ref_logprobs", "response_ids_packed", "advantages_packed", "old_logprobs_packed", "ref_logprobs_packed", "loss_mask")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    OLD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_PACKED_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_PACKED_FIELD_NUMBER: _ClassVar[int]
    OLD_LOGPROBS_PACKED_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_PACKED_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    advantages: _containers.RepeatedScalarFieldContainer[float]
    old_logprobs: _containers.RepeatedScalarFieldContainer[float]
    ref_logprobs: _containers.RepeatedScalarFieldContainer[float]
    response_ids_packed: bytes
    advantages_packed: bytes
    old_logprobs_packed: bytes
    ref_logprobs_packed: bytes
    loss_mask: bytes
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ..., advantages: _Optional[_Iterable[float]] = ..., old_logprobs: _Optional[_Iterable[float]] = ..., ref_logprobs: _Optional[_Iterable[float]] = ..., response_ids_packed: _Optional[bytes] = ..., advantages_packed: _Optional[bytes] = ..., old_logprobs_packed: _Optional[bytes] = ..., ref_logprobs_packed: _Optional[bytes] = ..., loss_mask: _Optional[bytes] = ...) -> None: ...

class ActorLoss(_message.Message):
    __slots__ = ("policy_loss", "policy_loss_settings", "kl_coef", "kl_type", "entropy_coef", "loss_agg_mode", "loss_scale_factor", "ppo_epochs", "mini_batch_size", "temperature")
    POLICY_LOSS_FIELD_NUMBER: _ClassVar[int]
    POLICY_LOSS_SETTINGS_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    KL_TYPE_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_COEF_FIELD_NUMBER: _ClassVar[int]
    LOSS_AGG_MODE_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    PPO_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    MINI_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    policy_loss: str
    policy_loss_settings: str
    kl_coef: float
    kl_type: str
    entropy_coef: float
    loss_agg_mode: str
    loss_scale_factor: float
    ppo_epochs: int
    mini_batch_size: int
    temperature: float
    def __init__(self, policy_loss: _Optional[str] = ..., policy_loss_settings: _Optional[str] = ..., kl_coef: _Optional[float] = ..., kl_type: _Optional[str] = ..., entropy_coef: _Optional[float] = ..., loss_agg_mode: _Optional[str] = ..., loss_scale_factor: _Optional[float] = ..., ppo_epochs: _Optional[int] = ..., mini_batch_size: _Optional[int] = ..., temperature: _Optional[float] = ...) -> None: ...

class TrainActorRequest(_message.Message):
    __slots__ = ("samples", "loss", "columns", "run_step", "adapter")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    RUN_STEP_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[TrainSample]
    loss: ActorLoss
    columns: TrainColumns
    run_step: RunStep
    adapter: str
    def __init__(self, samples: _Optional[_Iterable[_Union[TrainSample, _Mapping]]] = ..., loss: _Optional[_Union[ActorLoss, _Mapping]] = ..., columns: _Optional[_Union[TrainColumns, _Mapping]] = ..., run_step: _Optional[_Union[RunStep, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class RunStep(_message.Message):
    __slots__ = ("run_id", "step", "data_position", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DATA_POSITION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    data_position: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., data_position: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class TrainColumns(_message.Message):
    __slots__ = ("prompt_ids", "response_ids", "advantages", "old_logprobs", "ref_logprobs", "loss_mask")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    OLD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _common_pb2.Ragged
    response_ids: _common_pb2.Ragged
    advantages: bytes
    old_logprobs: bytes
    ref_logprobs: bytes
    loss_mask: bytes
    def __init__(self, prompt_ids: _Optional[_Union[_common_pb2.Ragged, _Mapping]] = ..., response_ids: _Optional[_Union[_common_pb2.Ragged, _Mapping]] = ..., advantages: _Optional[bytes] = ..., old_logprobs: _Optional[bytes] = ..., ref_logprobs: _Optional[bytes] = ..., loss_mask: _Optional[bytes] = ...) -> None: ...

class ValuesRequest(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenSequence]
    def __init__(self, sequences: _Optional[_Iterable[_Union[_common_pb2.TokenSequence, _Mapping]]] = ...) -> None: ...

class TokenValues(_message.Message):
    __slots__ = ("id", "values")
    ID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    id: str
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, id: _Optional[str] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class ValuesResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TokenValues]
    def __init__(self, results: _Optional[_Iterable[_Union[TokenValues, _Mapping]]] = ...) -> None: ...

class CriticSample(_message.Message):
    __slots__ = ("prompt_ids", "response_ids", "returns", "old_values", "loss_mask")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    OLD_VALUES_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    returns: _containers.RepeatedScalarFieldContainer[float]
    old_values: _containers.RepeatedScalarFieldContainer[float]
    loss_mask: bytes
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ..., returns: _Optional[_Iterable[float]] = ..., old_values: _Optional[_Iterable[float]] = ..., loss_mask: _Optional[bytes] = ...) -> None: ...

class TrainCriticRequest(_message.Message):
    __slots__ = ("samples", "clip_value", "ppo_epochs", "mini_batch_size", "run_step")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CLIP_VALUE_FIELD_NUMBER: _ClassVar[int]
    PPO_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    MINI_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUN_STEP_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[CriticSample]
    clip_value: float
    ppo_epochs: int
    mini_batch_size: int
    run_step: RunStep
    def __init__(self, samples: _Optional[_Iterable[_Union[CriticSample, _Mapping]]] = ..., clip_value: _Optional[float] = ..., ppo_epochs: _Optional[int] = ..., mini_batch_size: _Optional[int] = ..., run_step: _Optional[_Union[RunStep, _Mapping]] = ...) -> None: ...

class TrainResponse(_message.Message):
    __slots__ = ("step", "metrics", "repeated")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    REPEATED_FIELD_NUMBER: _ClassVar[int]
    step: int
    metrics: _containers.ScalarMap[str, float]
    repeated: bool
    def __init__(self, step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., repeated: _Optional[bool] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("targets", "bucket_bytes", "adapter")
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedScalarFieldContainer[str]
    bucket_bytes: int
    adapter: str
    def __init__(self, targets: _Optional[_Iterable[str]] = ..., bucket_bytes: _Optional[int] = ..., adapter: _Optional[str] = ...) -> None: ...

class PushResult(_message.Message):
    __slots__ = ("target", "ok", "error", "seconds", "adapter", "payload")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    target: str
    ok: bool
    error: str
    seconds: float
    adapter: str
    payload: str
    def __init__(self, target: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ..., adapter: _Optional[str] = ..., payload: _Optional[str] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "results", "num_bytes", "seconds")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    results: _containers.RepeatedCompositeFieldContainer[PushResult]
    num_bytes: int
    seconds: float
    def __init__(self, weight_version: _Optional[int] = ..., results: _Optional[_Iterable[_Union[PushResult, _Mapping]]] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("path", "run_step", "merged", "adapter")
    PATH_FIELD_NUMBER: _ClassVar[int]
    RUN_STEP_FIELD_NUMBER: _ClassVar[int]
    MERGED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    path: str
    run_step: RunStep
    merged: bool
    adapter: str
    def __init__(self, path: _Optional[str] = ..., run_step: _Optional[_Union[RunStep, _Mapping]] = ..., merged: _Optional[bool] = ..., adapter: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "step", "weight_version", "run_step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    weight_version: int
    run_step: RunStep
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., run_step: _Optional[_Union[RunStep, _Mapping]] = ...) -> None: ...

class PreferencePair(_message.Message):
    __slots__ = ("prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logprob", "ref_rejected_logprob")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_IDS_FIELD_NUMBER: _ClassVar[int]
    REF_CHOSEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    REF_REJECTED_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    chosen_ids: _containers.RepeatedScalarFieldContainer[int]
    rejected_ids: _containers.RepeatedScalarFieldContainer[int]
    ref_chosen_logprob: float
    ref_rejected_logprob: float
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., chosen_ids: _Optional[_Iterable[int]] = ..., rejected_ids: _Optional[_Iterable[int]] = ..., ref_chosen_logprob: _Optional[float] = ..., ref_rejected_logprob: _Optional[float] = ...) -> None: ...

class DPOLoss(_message.Message):
    __slots__ = ("loss_type", "beta", "label_smoothing", "mini_batch_size")
    LOSS_TYPE_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    LABEL_SMOOTHING_FIELD_NUMBER: _ClassVar[int]
    MINI_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    loss_type: str
    beta: float
    label_smoothing: float
    mini_batch_size: int
    def __init__(self, loss_type: _Optional[str] = ..., beta: _Optional[float] = ..., label_smoothing: _Optional[float] = ..., mini_batch_size: _Optional[int] = ...) -> None: ...

class TrainDPORequest(_message.Message):
    __slots__ = ("pairs", "loss", "run_step")
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    RUN_STEP_FIELD_NUMBER: _ClassVar[int]
    pairs: _containers.RepeatedCompositeFieldContainer[PreferencePair]
    loss: DPOLoss
    run_step: RunStep
    def __init__(self, pairs: _Optional[_Iterable[_Union[PreferencePair, _Mapping]]] = ..., loss: _Optional[_Union[DPOLoss, _Mapping]] = ..., run_step: _Optional[_Union[RunStep, _Mapping]] = ...) -> None: ...

class Datum(_message.Message):
    __slots__ = ("model_input", "target_tokens", "weights", "logprobs", "advantages")
    MODEL_INPUT_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    model_input: _containers.RepeatedScalarFieldContainer[int]
    target_tokens: _containers.RepeatedScalarFieldContainer[int]
    weights: _containers.RepeatedScalarFieldContainer[float]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    advantages: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, model_input: _Optional[_Iterable[int]] = ..., target_tokens: _Optional[_Iterable[int]] = ..., weights: _Optional[_Iterable[float]] = ..., logprobs: _Optional[_Iterable[float]] = ..., advantages: _Optional[_Iterable[float]] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("data", "loss_fn", "loss_fn_config", "adapter")
    class LossFnConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DATA_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    data: _containers.RepeatedCompositeFieldContainer[Datum]
    loss_fn: str
    loss_fn_config: _containers.ScalarMap[str, float]
    adapter: str
    def __init__(self, data: _Optional[_Iterable[_Union[Datum, _Mapping]]] = ..., loss_fn: _Optional[str] = ..., loss_fn_config: _Optional[_Mapping[str, float]] = ..., adapter: _Optional[str] = ...) -> None: ...

class DatumOutput(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ForwardBackwardResponse(_message.Message):
    __slots__ = ("outputs", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[DatumOutput]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, outputs: _Optional[_Iterable[_Union[DatumOutput, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class AdamParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("adam_params", "adapter")
    ADAM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adam_params: AdamParams
    adapter: str
    def __init__(self, adam_params: _Optional[_Union[AdamParams, _Mapping]] = ..., adapter: _Optional[str] = ...) -> None: ...

class AdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class AdapterResponse(_message.Message):
    __slots__ = ("name", "rank", "weight_version", "adapters", "unloaded")
    class UnloadedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    weight_version: int
    adapters: _containers.RepeatedScalarFieldContainer[str]
    unloaded: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ..., weight_version: _Optional[int] = ..., adapters: _Optional[_Iterable[str]] = ..., unloaded: _Optional[_Mapping[str, str]] = ...) -> None: ...

class OptimStepResponse(_message.Message):
    __slots__ = ("step", "weight_version", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    weight_version: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., weight_version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...
