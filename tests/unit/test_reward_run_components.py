"""A run's rule components sent with a Score request: they replace the replica's list for that request, travel
over the wire intact, and anything but a built-in rule is refused by its field."""

import asyncio

import pytest

from meshrl.v1 import reward_pb2
from services.common.config import load_config
from services.reward.config import ComponentConfig, RewardSettings
from services.reward.convert import components_from_pb, components_to_pb
from services.reward.engine import RewardEngine
from services.reward.types import ScoreItem

ITEMS = [ScoreItem(id="a", response="12", ground_truth="13")]


def engine_for(reward: dict) -> RewardEngine:
    return RewardEngine(load_config(RewardSettings, data={"reward": reward}))


def test_a_requests_components_replace_the_replicas_and_the_next_request_gets_its_own_again():
    engine = engine_for({})
    run = [ComponentConfig(name="format", weight=2.0, params={"pattern": r"\d+"}, label="digits")]
    [r] = asyncio.run(engine.score(ITEMS, run))
    assert (r.score, r.components) == (2.0, {"digits": 1.0})
    [again] = asyncio.run(engine.score(ITEMS))
    assert again.components == {"default": 0.0}
    assert engine.run_components(run) is engine.run_components(list(run))


def test_components_cross_the_wire_with_weights_params_and_labels():
    run = [ComponentConfig(name="format", weight=0.5, params={"pattern": "x"}, label="fmt"),
           ComponentConfig(name="exact_match")]
    request = reward_pb2.ScoreRequest(components=components_to_pb(run))
    assert components_from_pb(request) == run
    assert components_from_pb(reward_pb2.ScoreRequest()) is None


@pytest.mark.parametrize("component, message", [
    (ComponentConfig(name="model", params={"path": "rm"}),
     "components[0]: 'model' is not a built-in rule; reward models and user functions are loaded when the reward "
     "replica starts (its reward.components)"),
    (ComponentConfig(name="nope"),
     "components[0].name: unknown reward 'nope' (built-ins: default, exact_match, gsm8k, math, boxed, format, length_penalty, "
     "model, embedding; or give function: 'package.module:function')"),
])
def test_a_component_that_is_not_a_built_in_rule_is_refused_by_its_field(component, message):
    with pytest.raises(ValueError) as err:
        asyncio.run(engine_for({}).score(ITEMS, [component]))
    assert str(err.value) == message


def test_bad_params_json_on_the_wire_is_refused_by_its_field():
    request = reward_pb2.ScoreRequest(components=[reward_pb2.RewardComponent(name="format", params_json="[1]")])
    with pytest.raises(ValueError) as err:
        components_from_pb(request)
    assert str(err.value) == "components[0].params_json: must be a JSON object"
