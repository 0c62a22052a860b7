"""Run-scoped settings: every key of the run config has a kind; fixed keys a run sets differently are refused,
those it leaves out come from the running services; the docs table is the classification."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import yaml

from coordinator.recipe import run_settings as rs
from meshrl.v1 import common_pb2, trainer_pb2
from coordinator.runapi.runs import parse_run_config
from services.common.config import load_config, settings_json
from services.reward.config import RewardSettings
from services.trainer.config import TrainerSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "coordinator.md"


def trainer(**data) -> rs.Running:
    return rs.Running("trainer", "127.0.0.1:7000", json.loads(settings_json(load_config(TrainerSettings, data=data))))


def reward(**data) -> rs.Running:
    return rs.Running("reward", "127.0.0.1:7001", json.loads(settings_json(load_config(RewardSettings, data=data))))


def asked_keys(cfg) -> dict:
    dump = cfg.model_dump(mode="json")
    return {k: rs.value_at(dump, k) for k in rs.user_keys(cfg)}


def test_every_key_of_the_run_config_schema_is_classified_and_every_entry_is_used():
    keys = rs.schema_keys()
    assert {"actor.lr", "actor.tp_size", "critic.lr", "reward.components", "rollout.temperature"} <= set(keys)
    kinds = {key: rs.classify(key).kind for key in keys}
    assert set(kinds.values()) == {rs.RUN, rs.FIXED, rs.LAUNCH}
    used = {key if key in rs.SETTINGS else key.split(".")[0] + ".*" for key in keys}
    assert used == set(rs.SETTINGS)


def test_the_learning_rate_is_run_scoped_and_the_mesh_is_fixed():
    assert rs.classify("actor.lr").kind == rs.RUN
    assert rs.classify("rollout.temperature").kind == rs.RUN
    assert rs.classify("actor.tp_size").kind == rs.FIXED
    assert rs.classify("model.path").kind == rs.FIXED


def test_the_docs_table_is_the_classification():
    assert rs.settings_table() in DOC.read_text()


def test_user_keys_are_the_keys_the_run_wrote_not_the_defaults():
    cfg = parse_run_config("actor: {lr: 0.5, tp_size: 3}\nreward: {components: [{name: boxed}]}\n")
    assert rs.user_keys(cfg) == ["actor.lr", "actor.tp_size", "reward.components"]


def test_a_fixed_key_the_run_sets_differently_is_refused_naming_both_values():
    cfg = parse_run_config("actor: {lr: 0.5, tp_size: 3}\n")
    with pytest.raises(ValueError) as err:
        rs.check_fixed(asked_keys(cfg), [trainer(actor={"lr": 2e-5})])
    assert str(err.value) == ("actor.tp_size: the running trainer has 1, this run asks 3 (set when the trainer "
                              "starts; restart it to change)")


def test_rule_components_travel_with_the_run_and_a_reward_model_that_differs_is_refused():
    rules = parse_run_config("reward: {components: [{name: boxed, weight: 2}]}\n")
    rs.check_components(asked_keys(rules), [reward()])
    assert [(c.name, c.weight) for c in rs.score_components(rules)] == [("boxed", 2.0)]
    model = parse_run_config("reward: {components: [{name: model, params: {path: rm}}]}\n")
    assert rs.score_components(model) == []
    with pytest.raises(ValueError) as err:
        rs.check_components(asked_keys(model), [reward()])
    assert str(err.value) == (
        'reward.components: the running reward replica 127.0.0.1:7001 has [{"call": "meshrl", "function": null, '
        '"label": null, "name": "default", "params": {}, "weight": 1.0}], this run asks [{"call": "meshrl", '
        '"function": null, "label": null, "name": "model", "params": {"path": "rm"}, "weight": 1.0}] (reward models and user functions are loaded '
        'when the replica starts; restart it to change, or use built-in rules only)')


def test_a_key_the_run_leaves_out_takes_the_running_services_value_and_the_runs_own_keys_stay():
    cfg = parse_run_config("actor: {lr: 0.5}\nrollout: {servers: ['127.0.0.1:9']}\n")
    running = [trainer(model={"dtype": "bfloat16"}, actor={"lr": 2e-5, "grad_clip": 0.3}),
               rs.Running("rollout", "127.0.0.1:9", {"rollout": {"temperature": 0.7, "servers": []}})]
    rs.check_fixed(asked_keys(cfg), running)
    effective = rs.effective_config(cfg, running)
    assert (effective.model.dtype, effective.actor.lr, effective.actor.grad_clip) == ("bfloat16", 0.5, 0.3)
    # Sampling the replica holds is taken; its pool keys are the coordinator's and stay the run's.
    assert (effective.rollout.temperature, effective.rollout.servers) == (0.7, ["127.0.0.1:9"])


def test_the_effective_config_keeps_the_token_but_its_text_leaves_it_out():
    cfg = parse_run_config("server: {auth_token: s3cret}\nreward: {function: 'mod:score'}\n")
    effective = rs.effective_config(cfg, [trainer()])
    assert effective.server.auth_token.get_secret_value() == "s3cret"
    text = rs.config_text(effective)
    assert "s3cret" not in text and "auth_token" not in text
    assert parse_run_config(text).reward.components[0].function == "mod:score"


def test_a_run_with_a_critic_on_a_trainer_without_one_is_refused():
    cfg = parse_run_config("critic: {lr: 0.001}\n")
    with pytest.raises(ValueError) as err:
        rs.check_critic(cfg, [trainer()])
    assert str(err.value) == ("critic: the running trainer has no critic, this run asks for one (set when the "
                              "trainer starts; restart it with a `critic:` section)")


class FakeTrainer:
    """GetInfo and ConfigureRun of a trainer started with `data`; ConfigureRun answers what it was asked."""

    def __init__(self, **data):
        self.settings = load_config(TrainerSettings, data=data)
        self.configured = None

    async def GetInfo(self, request):
        return common_pb2.ServiceInfo(role="trainer", details={"settings": settings_json(self.settings)})

    async def ConfigureRun(self, request):
        self.configured = request
        return trainer_pb2.ConfigureRunResponse(actor=request.actor, actor_lr=request.actor.lr)


def settle(cfg, trainer, **kwargs):
    return asyncio.run(rs.settle(cfg, [], trainer, "127.0.0.1:7000", **kwargs))


def test_a_new_run_configures_the_trainer_with_its_own_lr_and_a_restarted_schedule():
    trainer = FakeTrainer(actor={"lr": 2e-5})
    effective = settle(parse_run_config("actor: {lr: 0.5}\nrollout: {n: 2, max_tokens: 6}\n"), trainer)
    assert (trainer.configured.actor.lr, trainer.configured.reset_schedule) == (0.5, True)
    assert effective.actor.lr == 0.5


def test_a_resumed_run_keeps_its_recorded_settings_and_its_schedule_step():
    cfg = parse_run_config("run: {num_steps: 3}\nrollout: {n: 2, max_tokens: 6}\n")
    recorded = yaml.safe_load(rs.config_text(settle(cfg, FakeTrainer(actor={"lr": 0.5}))))
    # The trainer restarted with another lr: the run keeps the one it trained with.
    restarted = FakeTrainer(actor={"lr": 2e-5})
    effective = settle(cfg, restarted, recorded=recorded, resume=True)
    assert (restarted.configured.actor.lr, restarted.configured.reset_schedule, effective.actor.lr) == (
        0.5, False, 0.5)


def test_a_resumed_run_refuses_a_trainer_restarted_with_other_fixed_settings():
    cfg = parse_run_config("run: {num_steps: 3}\nrollout: {n: 2, max_tokens: 6}\n")
    recorded = yaml.safe_load(rs.config_text(settle(cfg, FakeTrainer())))
    with pytest.raises(ValueError) as err:
        settle(cfg, FakeTrainer(model={"dtype": "bfloat16"}), recorded=recorded, resume=True)
    assert str(err.value) == ('model.dtype: the running trainer has "bfloat16", this run asks "float32" (set when '
                              'the trainer starts; restart it to change)')


def test_an_effective_config_that_fails_its_checks_leaves_the_trainer_unconfigured():
    trainer = FakeTrainer(actor={"lr": 2e-5})
    with pytest.raises(ValueError) as err:
        settle(parse_run_config("actor: {lr: 0.5}\nrollout: {n: 1, max_tokens: 6}\n"), trainer)  # n 1 under grpo
    assert str(err.value).startswith("rollout.n: algorithm.adv_estimator grpo compares the samples of each prompt")
    assert trainer.configured is None


class ClampingTrainer(FakeTrainer):
    """A trainer that answers ConfigureRun with another lr than it was asked (one that clamps it, say)."""

    async def ConfigureRun(self, request):
        answer = await super().ConfigureRun(request)
        answer.actor.lr = 1e-4
        return answer


def test_a_trainer_that_applies_other_values_than_the_runs_is_refused_naming_both():
    with pytest.raises(RuntimeError) as err:
        settle(parse_run_config("actor: {lr: 0.5}\nrollout: {n: 2, max_tokens: 6}\n"), ClampingTrainer())
    assert str(err.value).startswith("actor: the trainer applied lr: 0.0001 ")
    assert "not the run's lr: 0.5 " in str(err.value)
