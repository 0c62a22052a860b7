"""The registered policy losses (vanilla, gspo, gspo_token, cispo) and Dr. GRPO's aggregation: loss values and
gradients computed by hand on tiny tensors, and the registry's checks of a loss's name and settings."""

import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from coordinator.recipe.config import RunConfig, trainer_losses
from services.common.config import format_validation_error, load_config
from services.trainer.convert import actor_loss_from_pb, actor_loss_to_pb
from services.trainer.policy_losses import POLICY_LOSSES, policy_loss_settings
from services.trainer.types import ActorLoss
from services.trainer.updates.losses import aggregate
from services.trainer.updates.policy_losses import bound_policy_loss
from meshrl.v1 import trainer_pb2

E01 = math.exp(0.1)                                                  # a sequence ratio exp(mean log-ratio 0.1)


def run(name, settings, logp, old, adv, mask, mode="token-mean"):
    """(aggregated loss, d loss / d logp, clipped) of loss `name` on one batch of float64 rows."""
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    old, adv = torch.tensor(old, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64)
    mask = torch.tensor(mask, dtype=torch.bool)
    out = bound_policy_loss(name, settings)(logp, old, adv, mask)
    total = aggregate(out.loss, mask, mode)
    total.backward()
    return float(total.detach()), logp.grad.tolist(), out.clipped.tolist()


def test_vanilla_is_ppo_clip_with_dual_clip_three_by_default():
    # ratios 1.1 (A=1: inside, grad -A r = -1.1), 1.5 (A=1: clipped at 1.2, no grad), 5 (A=-1: loss 5 bounded at 3).
    logp = [[math.log(1.1), math.log(1.5), math.log(5.0)]]
    total, grad, clipped = run("vanilla", {}, logp, [[0.0] * 3], [[1.0, 1.0, -1.0]], [[1, 1, 1]])
    assert total == pytest.approx((-1.1 - 1.2 + 3.0) / 3)
    assert grad[0] == pytest.approx([-1.1 / 3, 0.0, 0.0])
    assert clipped == [[0.0, 1.0, 1.0]]


def test_gspo_ratio_is_the_exp_of_the_mean_log_ratio_and_its_gradient_spreads_over_the_sequence():
    # Row 0: log-ratios 0.2 and 0.0 -> s = e^0.1, A = 1: loss -s on each token, d/dlogp_t = -A s / 2.
    # Row 1: log-ratios 0.3, -0.3 (third token masked) -> s = 1, A = -2: loss 2, d/dlogp_t = 2 * 1 / 2 = 1.
    total, grad, clipped = run("gspo", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2},
                               [[0.2, 0.0, 0.0], [0.3, -0.3, 7.0]], [[0.0] * 3, [0.0] * 3],
                               [[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]], [[1, 1, 0], [1, 1, 0]], "seq-mean-token-mean")
    assert total == pytest.approx((-E01 + 2.0) / 2)                  # the mean over sequences
    assert grad[0] == pytest.approx([-E01 / 4, -E01 / 4, 0.0])       # / 2 tokens / 2 sequences
    assert grad[1] == pytest.approx([0.5, 0.5, 0.0])
    assert clipped == [[0.0] * 3, [0.0] * 3]


def test_gspo_clips_the_sequence_ratio_at_the_papers_tiny_range():
    # s = e^0.1 > 1 + 4e-4: with A = 1 the clipped term wins (loss -(1 + 4e-4), no gradient); with A = -1 the
    # unclipped one does (loss s, gradient -A s / 2 per token).
    total, grad, clipped = run("gspo", {}, [[0.2, 0.0], [0.2, 0.0]], [[0.0, 0.0], [0.0, 0.0]],
                               [[1.0, 1.0], [-1.0, -1.0]], [[1, 1], [1, 1]], "seq-mean-token-mean")
    assert total == pytest.approx((-(1 + 4e-4) + E01) / 2)
    assert grad[0] == [0.0, 0.0] and grad[1] == pytest.approx([E01 / 4, E01 / 4])
    assert clipped == [[1.0, 1.0], [0.0, 0.0]]


def test_gspo_token_equals_gspo_when_a_sequence_has_one_advantage():
    args = ([[0.2, 0.0, -0.4]], [[0.0, 0.1, 0.0]], [[0.5, 0.5, 0.5]], [[1, 1, 1]], "seq-mean-token-mean")
    settings = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}
    seq, tok = run("gspo", settings, *args), run("gspo_token", settings, *args)
    # log s = (0.2 - 0.1 - 0.4) / 3 = -0.1: loss -0.5 e^-0.1, gradient -0.5 e^-0.1 / 3 on each token.
    assert seq[0] == pytest.approx(-0.5 * math.exp(-0.1)) and tok[0] == pytest.approx(seq[0])
    assert tok[1][0] == pytest.approx(seq[1][0]) and seq[1][0] == pytest.approx([-0.5 * math.exp(-0.1) / 3] * 3)


def test_gspo_token_gives_each_token_its_own_advantage_with_the_sequence_ratio():
    # s = e^0.1 for both tokens (value), each token's gradient -A_t s on its own log-prob only; GSPO would see the
    # sequence's mean advantage 0 and give no gradient at all.
    settings = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}
    args = ([[0.2, 0.0]], [[0.0, 0.0]], [[1.0, -1.0]], [[1, 1]])
    total, grad, _ = run("gspo_token", settings, *args)
    assert total == pytest.approx(0.0, abs=1e-12)                     # (-s + s) / 2
    assert grad[0] == pytest.approx([-E01 / 2, E01 / 2])
    assert run("gspo", settings, *args)[1][0] == pytest.approx([0.0, 0.0])


def test_cispo_weights_every_token_by_its_clipped_stop_gradient_ratio_and_drops_none():
    # ratios 1, 1.5, 0.5 with A = 1, 1, -1 and clip 0.2/0.2: weights 1, 1.2, 0.8.
    # loss_t = -w A logp: 1.0, 2.4, -0.4; d/dlogp_t = -w A: -1, -1.2, 0.8 (PPO would give the 1.5 token none).
    logp = [[-1.0, -2.0, -0.5]]
    old = [[-1.0, -2.0 - math.log(1.5), -0.5 - math.log(0.5)]]
    total, grad, clipped = run("cispo", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}, logp, old,
                               [[1.0, 1.0, -1.0]], [[1, 1, 1]], "seq-mean-token-sum")
    assert total == pytest.approx(1.0 + 2.4 - 0.4)
    assert grad[0] == pytest.approx([-1.0, -1.2, 0.8])
    assert clipped == [[0.0, 1.0, 1.0]]


def test_cispo_default_has_no_lower_bound_in_effect():
    # ratio 0.1 keeps weight 0.1 (clip_ratio_low 1.0): gradient -w A = -0.1.
    _, grad, clipped = run("cispo", {}, [[-1.0]], [[-1.0 - math.log(0.1)]], [[1.0]], [[1]])
    assert grad[0] == pytest.approx([-0.1]) and clipped == [[0.0]]


def test_dr_grpo_aggregation_divides_each_sequence_sum_by_a_constant_length():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    total = aggregate(loss, mask, "seq-mean-token-sum-norm", scale=6.0)
    total.backward()
    assert float(total.detach()) == pytest.approx((6 / 6 + 4 / 6) / 2)
    assert loss.grad[0].tolist() == pytest.approx([1 / 12] * 3)
    assert loss.grad[1].tolist() == pytest.approx([1 / 12, 0, 0])
    with pytest.raises(ValueError, match="loss_scale_factor"):
        aggregate(loss, mask, "seq-mean-token-sum-norm")


def test_every_registered_loss_loads_and_its_default_settings_are_valid():
    for name, entry in POLICY_LOSSES.items():
        assert callable(bound_policy_loss(name, {})), name
        assert policy_loss_settings(name, {}, key="k") == entry.settings()


@pytest.mark.parametrize("name, settings, message", [
    ("ppo2", {}, "k.name: unknown policy loss 'ppo2'"),
    ("gspo", {"clip_ratio_c": 3.0}, "k.clip_ratio_c: not a setting of policy loss 'gspo'"),
    ("vanilla", {"clip_ratio_c": 0.5}, "k.clip_ratio_c: must be > 1"),
    ("cispo", {"clip_ratio_high": -1}, "k.clip_ratio_high: Input should be greater than or equal to 0"),
])
def test_a_bad_name_or_setting_is_refused_under_its_key(name, settings, message):
    with pytest.raises(ValueError) as err:
        policy_loss_settings(name, settings, key="k")
    assert str(err.value).startswith(message)


def test_the_loss_and_its_settings_cross_the_wire_under_the_recipes_names():
    loss = ActorLoss(policy_loss="gspo", policy_loss_settings={"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
                     loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=6.0)
    back = actor_loss_from_pb(trainer_pb2.ActorLoss.FromString(actor_loss_to_pb(loss).SerializeToString()))
    assert back == loss
    assert actor_loss_from_pb(trainer_pb2.ActorLoss()).policy_loss == "vanilla"
    with pytest.raises(ValueError, match="loss.policy_loss_settings: expected a JSON object"):
        actor_loss_from_pb(trainer_pb2.ActorLoss(policy_loss_settings="[1]"))


def _algorithm(**algorithm):
    return trainer_losses(RunConfig(algorithm=algorithm)).actor


def test_a_recipes_policy_loss_reaches_the_trainer_by_name_with_its_settings_unread():
    actor = _algorithm(policy_loss={"name": "cispo", "clip_ratio_high": 0.3})
    assert (actor.policy_loss, actor.policy_loss_settings) == ("cispo", {"clip_ratio_high": 0.3})
    # verl's place, one level up, is the same setting.
    assert _algorithm(clip_ratio_low=0.1, clip_ratio_c=0).policy_loss_settings == {"clip_ratio_low": 0.1,
                                                                                  "clip_ratio_c": 0}


@pytest.mark.parametrize("algorithm, message", [
    ({"policy_loss": {"name": "gspo"}, "clip_ratio_c": 3.0}, "algorithm.policy_loss.clip_ratio_c: not a setting"),
    ({"clip_ratio_low": 0.1, "policy_loss": {"clip_ratio_low": 0.2}}, "algorithm.clip_ratio_low: set here and in"),
    ({"policy_loss": {"name": "gpso"}}, "algorithm.policy_loss.name: unknown policy loss 'gpso' (did you mean"),
])
def test_a_recipe_with_a_bad_policy_loss_is_refused_before_start_naming_the_key(algorithm, message):
    with pytest.raises(ValidationError) as err:
        RunConfig(algorithm=algorithm)
    assert message in format_validation_error(err.value, model=RunConfig)


def test_the_drgrpo_recipe_turns_off_std_normalisation_and_divides_by_max_tokens():
    cfg = load_config(RunConfig, Path(__file__).resolve().parents[2] / "examples/arith/drgrpo.yaml")
    actor = trainer_losses(cfg).actor
    assert cfg.algorithm.norm_adv_by_std is False
    assert (actor.loss_agg_mode, actor.loss_scale_factor) == ("seq-mean-token-sum-norm", cfg.rollout.max_tokens)


def test_a_setting_given_as_text_reaches_the_trainer_as_the_losss_type():
    assert _algorithm(policy_loss={"name": "gspo", "clip_ratio_high": "1e-3"}).policy_loss_settings == {
        "clip_ratio_high": 0.001}
