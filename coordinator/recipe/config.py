"""The run config: every section of a recipe YAML, validated before any service is called."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from coordinator.recipe.distill import check_distill_config
from services.common.config import MeshSettings, ModelConfig, Section, ServerConfig, bool_choice
from services.env.config import EnvConfig
from services.reference.config import ReferenceConfig
from services.reward.config import RewardConfig
from services.rollout.config import RolloutConfig
from services.trainer.config import ActorConfig, CriticConfig, WeightSyncConfig
from services.trainer.policy_losses import DEFAULT_POLICY_LOSS, policy_loss_settings
from services.trainer.types import ActorLoss, CriticLoss, DPOLoss
from services.training_api.config import TrainingApiSection


class PolicyLossConfig(Section):
    """`algorithm.policy_loss:` the loss's name (POLICY_LOSSES in services/trainer/policy_losses.py) and its own
    settings beside it, checked by that loss's settings class and sent to the trainer unread."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    name: str = DEFAULT_POLICY_LOSS

    @property
    def settings(self) -> dict[str, Any]:
        """The settings the recipe wrote, as the loss's class reads them (a flag's "0.1" becomes 0.1)."""
        given = dict(self.model_extra or {})
        return policy_loss_settings(self.name, given, key="algorithm.policy_loss").model_dump(include=set(given))

    @model_validator(mode="after")
    def _settings_of_the_loss(self):
        policy_loss_settings(self.name, dict(self.model_extra or {}), key="algorithm.policy_loss")
        return self


# The clip knobs verl keeps beside loss_mode; written at algorithm level they are the policy loss's settings.
CLIP_KEYS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")


class RolloutCorrectionConfig(Section):
    """`algorithm.rollout_correction:` importance weights between the trainer's old policy and the rollout
    engine's own log-probs (coordinator/training/rollout_correction.py). `decoupled`: a trainer old-log-prob pass each
    step, the weights scale the advantages, the PPO ratio is taken against the trainer's old policy. `bypass`:
    the rollout log-probs are the old policy (no old-log-prob pass; the PPO clip bounds pi / pi_rollout), the
    metrics come from the parity steps (algorithm.logprob_parity_every). `preset` names a published combination
    (PRESETS); the keys written beside it override its values."""

    # icepop, seq_mask_tis or geo_rs: sets mode decoupled and the level/method/thresholds of PRESETS.
    preset: Literal["icepop", "seq_mask_tis", "geo_rs"] | None = None
    mode: Literal["off", "decoupled", "bypass"] = "off"
    # YAML reads a bare `off` as false.
    _mode_off = field_validator("mode", mode="before")(bool_choice(None, "off"))
    # token: w per token; sequence: the product over the sequence; geometric: exp(mean log-ratio) per sequence.
    level: Literal["token", "sequence", "geometric"] = "token"
    # truncate: w capped at threshold (TIS); mask: w outside [threshold_low, threshold] rejects the token or
    # sequence (it trains on nothing), the rest keep weight 1; mask_is: the same rejection, and each kept token is
    # weighted by its own token ratio (IcePop at level token, NeMo-RL's seq-mask-tis at level geometric).
    method: Literal["truncate", "mask", "mask_is"] = "truncate"
    threshold: float = Field(2.0, gt=0)
    # mask and mask_is only; None = 1 / threshold.
    threshold_low: float | None = Field(None, ge=0)
    # A sequence with any token ratio below it is rejected whole (verl's rollout_token_veto_threshold); None = off.
    veto_threshold: float | None = Field(None, gt=0, lt=1)

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("preset") is None:
            return data
        if data["preset"] not in PRESETS:
            return data                       # the Literal names the choices
        if data.get("mode") not in (None, "decoupled"):
            raise ValueError(f"mode: preset {data['preset']!r} weights the advantages, which mode "
                             f"{data['mode']!r} does not; leave mode out (the preset sets decoupled)")
        return {**PRESETS[data["preset"]], **data, "mode": "decoupled"}

    @model_validator(mode="after")
    def _bounds(self):
        if self.threshold_low is not None and self.method == "truncate":
            raise ValueError(f"threshold_low: only used by methods mask and mask_is (got {self.method!r})")
        if self.threshold_low is not None and self.threshold_low >= self.threshold:
            raise ValueError(f"threshold_low: {self.threshold_low} must be below threshold {self.threshold}")
        return self


# Published corrections as this section's settings (docs/algorithms.md gives their formulas and sources).
PRESETS: dict[str, dict[str, Any]] = {
    # IcePop (inclusionAI's Ring-1T report, 2025): the token ratio kept as the weight inside [0.5, 5], 0 outside.
    "icepop": {"level": "token", "method": "mask_is", "threshold": 5.0, "threshold_low": 0.5},
    # NeMo-RL's seq-mask-tis: a sequence whose geometric-mean ratio leaves [0.999, 1.001] is rejected, the kept
    # ones' tokens weighted by their own ratios.
    "seq_mask_tis": {"level": "geometric", "method": "mask_is", "threshold": 1.001, "threshold_low": 0.999},
    # verl's geo_rs: geometric-mean rejection in [1/1.001, 1.001] (weight 1), with a 1e-4 token veto.
    "geo_rs": {"level": "geometric", "method": "mask", "threshold": 1.001, "veto_threshold": 1.0e-4},
}


class FilterGroupsConfig(Section):
    """`algorithm.filter_groups:` DAPO's dynamic sampling (coordinator/training/dynamic_sampling.py): a step generates
    batches of data.rollout_batch_size prompts, drops every group whose `metric` is the same for all its samples
    (advantage 0 under the group estimators: it teaches nothing), until it holds data.rollout_batch_size groups.
    Every prompt generated is consumed (the data position moves past it)."""

    enable: bool = False
    # acc: the reward function's `acc` when it returns one, else its score (as `accuracy` reads it); score: the
    # reward service's score; seq_reward: the score with algorithm.overlong_buffer's penalty added.
    metric: Literal["acc", "score", "seq_reward"] = "acc"
    # Generation batches one step may make (0 = no bound, verl's meaning). A step that reaches the bound short
    # trains on the groups it kept (verl raises), said once per run and counted in train/num_groups_short.
    max_num_gen_batches: int = Field(0, ge=0)


class OverlongBufferConfig(Section):
    """`algorithm.overlong_buffer:` DAPO's soft overlong punishment, added to each sample's reward by the coordinator
    (verl's reward_model.overlong_buffer): a response of L model tokens longer than rollout.max_tokens - len gets
    -min(1, (L - (rollout.max_tokens - len)) / len) * penalty_factor."""

    enable: bool = False
    len: int = Field(0, ge=0)
    penalty_factor: float = Field(1.0, ge=0)


class AlgorithmConfig(Section):
    """`algorithm:` advantage estimator, KL handling and PPO loss settings (verl's names)."""

    # rl: GRPO/PPO/RLOO/REINFORCE++ with rollouts; dpo: offline preference optimisation (`dpo:` section).
    kind: Literal["rl", "dpo"] = "rl"
    # distill: on-policy distillation, the advantage is the reverse KL to the teacher alone (distill_kl_coef).
    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae",
                           "distill"] = "grpo"
    # On-policy distillation (coordinator/training/advantages.py, docs/algorithms.md): the teacher is served by the
    # reference replicas (reference.model_path); each token's advantage gains
    # -distill_kl_coef * (log pi_student - log pi_teacher). None: 1.0 under adv_estimator distill, else off (0).
    distill_kl_coef: float | None = Field(None, ge=0)
    # False gives Dr. GRPO's mean-centred advantages.
    norm_adv_by_std: bool = True
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    whiten_advantages: bool = True
    # KL as a loss term in the trainer ...
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: Literal["k1", "k2", "k3"] = "k3"
    # ... or as a per-token reward penalty, fixed or adaptive toward target_kl.
    use_kl_in_reward: bool = False
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0)
    target_kl: float = Field(0.1, gt=0)
    kl_horizon: int = Field(10000, ge=1)
    # The policy loss and its settings: `{name: gspo, clip_ratio_low: 3.0e-4, clip_ratio_high: 4.0e-4}`; the
    # clip knobs (clip_ratio_low, clip_ratio_high, clip_ratio_c) may also be written here, one level up, as verl does.
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    entropy_coeff: float = Field(0.0, ge=0)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "token-mean"
    # seq-mean-token-sum-norm's constant length (Dr. GRPO); None = rollout.max_tokens.
    loss_scale_factor: float | None = Field(None, gt=0)
    ppo_epochs: int = Field(1, ge=1)
    ppo_mini_batch_size: int = Field(0, ge=0)
    # Critic (PPO).
    clip_value: float = Field(0.5, ge=0)
    # Truncated importance sampling between the rollout engine and the trainer (None = off).
    tis_cap: float | None = Field(None, gt=0)
    # Token/sequence importance weights (truncated or masked) between rollout and trainer; tis_cap: c is
    # shorthand for {mode: decoupled, level: token, method: truncate, threshold: c}.
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    # Old log-probs: `always` a trainer ComputeLogProbs pass per step; `auto` skips that pass when the batch
    # is one optimizer step (ppo_epochs 1, one mini-batch) and nothing before the update needs them (no TIS,
    # no KL in the reward): TrainActor then takes its own detached log-probs, exactly the old policy's.
    old_logprobs: Literal["auto", "always"] = "auto"
    # When `auto` skips them, old log-probs are still computed at step 1 and every k-th step, for the
    # rollout-vs-trainer parity metric (0: never).
    logprob_parity_every: int = Field(10, ge=0)
    # DAPO: dynamic sampling, and the overlong penalty.
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)

    @model_validator(mode="before")
    @classmethod
    def _clip_keys_into_policy_loss(cls, data: Any) -> Any:
        """`algorithm.clip_ratio_low: x` is `algorithm.policy_loss.clip_ratio_low: x` (refused when both are set)."""
        if not isinstance(data, dict) or not any(k in data for k in CLIP_KEYS):
            return data
        data = dict(data)
        loss = data.get("policy_loss") or {}
        loss = dict(loss) if isinstance(loss, dict) else loss.model_dump()
        for k in CLIP_KEYS:
            if k in data:
                if k in loss:
                    raise ValueError(f"{k}: set here and in algorithm.policy_loss.{k}; keep one")
                loss[k] = data.pop(k)
        data["policy_loss"] = loss
        return data

    @model_validator(mode="after")
    def _one_correction(self):
        if self.tis_cap and self.rollout_correction.mode != "off":
            raise ValueError("tis_cap: set either tis_cap or rollout_correction, not both")
        return self


class DPOConfig(Section):
    """`dpo:` preference optimisation settings (used when algorithm.kind is dpo)."""

    loss_type: Literal["sigmoid", "ipo", "cdpo"] = "sigmoid"
    beta: float = Field(0.1, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    # Pairs per step; each step is one TrainDPO call.
    batch_size: int = Field(16, ge=1)
    mini_batch_size: int = Field(0, ge=0)
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    # Reference log-probs already in the dataset (summed over the response), else from the reference pool.
    ref_chosen_key: str = "ref_chosen_logprob"
    ref_rejected_key: str = "ref_rejected_logprob"
    # Held-out preference pairs for preference accuracy (default: data.heldout_files when they hold pairs).
    heldout_files: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _smoothing_needs_cdpo(self):
        if self.label_smoothing and self.loss_type != "cdpo":
            raise ValueError(f"label_smoothing: only used by loss_type cdpo (got {self.loss_type!r})")
        return self


class DataConfig(Section):
    """`data:` where prompts come from and how many per step."""

    train_files: list[str] = Field(default_factory=lambda: ["examples/arith/data/train.jsonl"], min_length=1)
    heldout_files: list[str] = Field(default_factory=list)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    # The row field that picks the reward and reaches it as `data_source` (verl's data.reward_fn_key).
    reward_fn_key: str = "data_source"
    # Prompts per step (verl's data.train_batch_size; 256 as in verl's GSM8K recipes).
    rollout_batch_size: int = Field(256, ge=1)
    shuffle: bool = True
    seed: int = 0
    max_prompt_length: int | None = Field(None, ge=1)
    # A prompt over max_prompt_length: refused at load naming its row (false, verl's default), or dropped and
    # counted in every step's `data/num_overlong_dropped` (true).
    filter_overlong_prompts: bool = False
    apply_chat_template: bool = False
    # Held-out prompts evaluated (greedy) before training and after the last step; 0 = all.
    heldout_size: int = Field(0, ge=0)


class TrainerSection(Section):
    """`trainer:` where the trainer's rank 0 listens, and how `meshrl up` launches it."""

    address: str = ""
    nproc_per_node: int = Field(1, ge=1)
    devices: str = ""
    timeout_s: float = Field(600.0, gt=0)


class RunSection(Section):
    """`run:` length, outputs, checkpoints, async mode, state store."""

    name: str = "run"
    num_steps: int = Field(10, ge=1)
    run_dir: str = "runs"
    seed: int = 0
    checkpoint_every: int = Field(0, ge=0)
    # The weights the run starts from: "" = model.path's (a trainer that trained another run reloads them), or a
    # run id (that run's newest checkpoint) or a checkpoint folder (coordinator/runapi/checkpoints.py).
    init_from: str = ""
    # Held-out evaluation every k steps (0 = only before the first and after the last step).
    eval_every: int = Field(0, ge=0)
    # Overlap the next steps' generation with this step's update (coordinator/training/async_rollouts.py): up to
    # max_staleness batches in flight, so no sample trains more than max_staleness weight versions behind.
    async_mode: bool = False
    max_staleness: int = Field(1, ge=0)
    # A group (prompt) whose oldest token is staler than max_staleness: regenerated on the current weights, or
    # dropped from its step (its prompt consumed, counted in async/dropped_stale, never trained). The same holds for
    # the groups a restarted coordinator reloads from the ledger (coordinator/training/ledger.py; counted in
    # async/groups_regenerated, async/groups_dropped_stale).
    stale_samples: Literal["regenerate", "drop"] = "regenerate"
    # Run state store; empty = in memory (lost with the coordinator).
    redis_url: str = ""
    # Key prefix of the run state and of the service registry in Redis (read by the coordinator and by every
    # replica that registers): two deployments sharing a Redis database keep apart by it.
    redis_prefix: str = "meshrl"
    # TensorBoard event files in <run_dir>/tensorboard (needs the tensorboard package).
    tensorboard: bool = True
    # Log metrics to this Weights & Biases project when wandb is installed ("" = off).
    wandb_project: str = ""
    # One OpenTelemetry trace per step in <run_dir>/traces.jsonl, the services' spans included (`meshrl trace`);
    # OTLP as well when OTEL_EXPORTER_OTLP_ENDPOINT is set (docs/observability.md).
    traces: bool = True
    # Seconds between replica re-discovery / health checks.
    refresh_interval_s: float = Field(5.0, gt=0)
    # One line per sample of every step in <run_dir>/samples.jsonl: prompt, response, reward, its components
    # and extra keys, a failed score's error, and the row's data_source, ability, extra_info.
    save_samples: bool = True
    # Warn once (console and coordinator log) when no prompt group had any reward variance for this many steps in
    # a row (`train/frac_zero_adv_groups` 1: every advantage 0); 0 = never (coordinator/recipe/no_signal.py).
    zero_variance_warn_steps: int = Field(3, ge=0)
    # Runs beside others on one mesh (docs/many_runs.md): contended rollout/reward/reference calls are granted in
    # proportion to priority; max_pool_calls caps this run's calls in flight per pool (0 = no cap of its own).
    priority: float = Field(1.0, gt=0)
    max_pool_calls: int = Field(0, ge=0)


class CoordinatorConfig(Section):
    """`coordinator:` the run API server."""

    address: str = ""


class RunConfig(MeshSettings):
    """A whole recipe. Unknown sections or keys fail with the key named."""

    model_config = MeshSettings.model_config | {"extra": "forbid"}

    model: ModelConfig = ModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    reference: ReferenceConfig = ReferenceConfig()
    # The env replicas (tools, environments) the rollout replicas' episode loops call; `meshrl up` starts them.
    env: EnvConfig = EnvConfig()
    actor: ActorConfig = ActorConfig()
    critic: CriticConfig | None = None
    # Read by the trainer (one YAML serves every service of `meshrl up`); validated here as well.
    weight_sync: WeightSyncConfig = WeightSyncConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    dpo: DPOConfig = DPOConfig()
    data: DataConfig = DataConfig()
    run: RunSection = RunSection()
    trainer: TrainerSection = TrainerSection()
    coordinator: CoordinatorConfig = CoordinatorConfig()
    server: ServerConfig = ServerConfig()
    # Read by the training API that `meshrl mesh` serves beside the coordinator (docs/training_api.md).
    training_api: TrainingApiSection = TrainingApiSection()

    @model_validator(mode="after")
    def _async_settings(self):
        r = self.run
        if r.async_mode and r.max_staleness == 0:
            raise ValueError("run.max_staleness: 0 keeps no batch in flight; set run.async_mode: false for a "
                             "synchronous run, or max_staleness >= 1")
        if not r.async_mode and r.max_staleness > 1:
            raise ValueError(f"run.max_staleness: {r.max_staleness} batches in flight need run.async_mode: true")
        if not r.async_mode and self.rollout.partial_rollouts != "off":
            raise ValueError(f"rollout.partial_rollouts: {self.rollout.partial_rollouts!r} needs run.async_mode: "
                             "true (a synchronous run has no generation in flight when the weights update)")
        return self

    @model_validator(mode="after")
    def _dapo_settings(self):
        a, n, max_tokens = self.algorithm, self.rollout.n, self.rollout.max_tokens
        if a.filter_groups.enable and a.kind != "rl":
            raise ValueError(f"algorithm.filter_groups.enable: filters rollout groups; algorithm.kind {a.kind!r} "
                             f"makes none")
        if a.filter_groups.enable and n < 2:
            raise ValueError(f"algorithm.filter_groups.enable: a group of rollout.n={n} sample has no reward "
                             f"variance to keep it by; set rollout.n >= 2")
        ob = a.overlong_buffer
        if ob.enable and self.rollout.agent.name:
            raise ValueError(f"algorithm.overlong_buffer.enable: measures one response against rollout.max_tokens; "
                             f"rollout.agent.name {self.rollout.agent.name!r} plays multi-turn episodes")
        if ob.enable and not 1 <= ob.len <= max_tokens:
            raise ValueError(f"algorithm.overlong_buffer.len: {ob.len} must be in [1, rollout.max_tokens="
                             f"{max_tokens}] (the last tokens before the response limit, where the penalty grows)")
        return self

    @model_validator(mode="after")
    def _distill_settings(self):
        check_distill_config(self, distill_coef(self.algorithm))
        return self

    @property
    def needs_reference(self) -> bool:
        a = self.algorithm
        return a.use_kl_loss or a.use_kl_in_reward or distill_coef(a) > 0


def distill_coef(a: AlgorithmConfig) -> float:
    """The weight of the reverse-KL-to-teacher advantage in effect (0: no distillation)."""
    if a.distill_kl_coef is not None:
        return a.distill_kl_coef
    return 1.0 if a.adv_estimator == "distill" else 0.0


@dataclass(frozen=True)
class TrainerLosses:
    """The loss settings a run sends with every TrainActor, TrainCritic and TrainDPO call."""

    actor: ActorLoss
    critic: CriticLoss
    dpo: DPOLoss


def trainer_losses(cfg: RunConfig) -> TrainerLosses:
    """The one place the YAML's names (verl's: entropy_coeff, ...) become the trainer's. The policy loss's
    settings pass through unread: their names are the recipe's, and the trainer checks them."""
    a, d = cfg.algorithm, cfg.dpo
    actor = ActorLoss(policy_loss=a.policy_loss.name, policy_loss_settings=a.policy_loss.settings,
                      kl_coef=a.kl_loss_coef if a.use_kl_loss else 0.0, kl_type=a.kl_loss_type,
                      entropy_coef=a.entropy_coeff, loss_agg_mode=a.loss_agg_mode,
                      loss_scale_factor=a.loss_scale_factor or float(cfg.rollout.max_tokens),
                      ppo_epochs=a.ppo_epochs, mini_batch_size=a.ppo_mini_batch_size, temperature=1.0)
    critic = CriticLoss(clip_value=a.clip_value, ppo_epochs=a.ppo_epochs, mini_batch_size=a.ppo_mini_batch_size)
    dpo = DPOLoss(loss_type=d.loss_type, beta=d.beta, label_smoothing=d.label_smoothing,
                  mini_batch_size=d.mini_batch_size)
    return TrainerLosses(actor, critic, dpo)


def rollout_correction(a: AlgorithmConfig) -> RolloutCorrectionConfig:
    """The correction in effect: algorithm.rollout_correction, or what the older tis_cap key stands for."""
    if a.tis_cap:
        return RolloutCorrectionConfig(mode="decoupled", level="token", method="truncate", threshold=a.tis_cap)
    return a.rollout_correction
