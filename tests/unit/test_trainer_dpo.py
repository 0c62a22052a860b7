"""TrainDPO on the engine (no server): loss vs a hand computation, exact accumulation, margins, validation."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from meshrl.v1 import trainer_pb2
from services.common.config import load_config
from services.common.tensors.weights import named_weights
from services.trainer import convert
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model
from services.trainer.types import DPOLoss, PreferencePair


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_dpo") / "model")


def engine(model_path: str, **actor) -> TrainerEngine:
    return TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model_path},
                                                            "actor": {"lr": 1e-2, **actor}}))


def params(e: TrainerEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in named_weights(e.rank.actor.module).items()}


def random_pairs(num: int, *, seed: int = 0, vocab_size: int = 32) -> list[PreferencePair]:
    """Pairs of random lengths; reference sums are set to something other than the policy's."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, vocab_size, (n,), generator=g).tolist()  # noqa: E731
    size = lambda hi: int(torch.randint(1, hi + 1, (1,), generator=g))  # noqa: E731
    return [PreferencePair(ids(size(6)), ids(size(6)), ids(size(6)), -float(torch.rand(1, generator=g)) * 20,
                           -float(torch.rand(1, generator=g)) * 20) for _ in range(num)]


def policy_sums(e: TrainerEngine, pairs) -> tuple[list[float], list[float]]:
    chosen = e.compute_logprobs([p.prompt_ids for p in pairs], [p.chosen_ids for p in pairs])
    rejected = e.compute_logprobs([p.prompt_ids for p in pairs], [p.rejected_ids for p in pairs])
    return [sum(x) for x in chosen], [sum(x) for x in rejected]


def hand_loss(pc, pr, rc, rr, loss: DPOLoss) -> float:
    """The paper's formulas, one pair at a time, in plain Python."""
    total = 0.0
    for a, b, c, d in zip(pc, pr, rc, rr):
        h = (a - c) - (b - d)
        sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
        if loss.loss_type == "ipo":
            total += (h - 1 / (2 * loss.beta)) ** 2
        else:
            eps = loss.label_smoothing
            total += -(1 - eps) * math.log(sig(loss.beta * h)) - eps * math.log(sig(-loss.beta * h))
    return total / len(pc)


@pytest.mark.parametrize("loss", [DPOLoss(beta=0.1), DPOLoss(loss_type="ipo", beta=0.5),
                                  DPOLoss(loss_type="cdpo", beta=0.2, label_smoothing=0.1)],
                         ids=["sigmoid", "ipo", "cdpo"])
def test_dpo_loss_and_rewards_equal_a_hand_computation_from_the_policy_sums(model_path, loss):
    e = engine(model_path)
    pairs = random_pairs(5)
    pc, pr = policy_sums(e, pairs)
    rc, rr = [p.ref_chosen_logprob for p in pairs], [p.ref_rejected_logprob for p in pairs]
    m = e.train_dpo(pairs, loss)
    assert m["loss"] == pytest.approx(hand_loss(pc, pr, rc, rr, loss), rel=1e-5)
    b = loss.beta
    chosen_r = [b * (x - y) for x, y in zip(pc, rc)]
    rejected_r = [b * (x - y) for x, y in zip(pr, rr)]
    assert m["rewards/chosen"] == pytest.approx(sum(chosen_r) / 5, rel=1e-5, abs=1e-6)
    assert m["rewards/rejected"] == pytest.approx(sum(rejected_r) / 5, rel=1e-5, abs=1e-6)
    assert m["rewards/margins"] == pytest.approx((sum(chosen_r) - sum(rejected_r)) / 5, rel=1e-5, abs=1e-6)
    assert m["rewards/accuracy"] == pytest.approx(sum(c > r for c, r in zip(chosen_r, rejected_r)) / 5)
    assert m["logps/chosen"] == pytest.approx(sum(pc) / 5, rel=1e-5)
    assert m["logps/rejected"] == pytest.approx(sum(pr) / 5, rel=1e-5)
    assert m["num_pairs"] == 5 and m["num_optimizer_steps"] == 1 and m["lr"] == pytest.approx(1e-2)
    assert m["num_tokens"] == sum(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
    assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0


def test_one_dpo_step_equals_a_hand_written_adamw_step_on_the_plain_model(model_path):
    # Adam's first step is lr * g / (|g| + eps): with the default eps 1e-8, a gradient of rounding-noise size
    # (~1e-9: k_proj.bias, whose exact gradient is 0) turns an fp32 summation-order difference into an update
    # difference of ~1e-6. eps 1e-5 keeps the noise out and every real gradient in Adam's normal regime.
    e = engine(model_path, lr=1e-3, grad_clip=0.5, eps=1e-5)
    model = copy.deepcopy(e.rank.actor.module)
    pairs = random_pairs(4, seed=1)
    e.train_dpo(pairs, DPOLoss(beta=0.3))

    # One sequence per forward, no padding, no packing: the definition of the summed log-prob.
    def seq_logp(prompt, response):
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(response).unsqueeze(1)).sum()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, eps=1e-5)
    losses = []
    for p in pairs:
        h = (seq_logp(p.prompt_ids, p.chosen_ids) - p.ref_chosen_logprob) - \
            (seq_logp(p.prompt_ids, p.rejected_ids) - p.ref_rejected_logprob)
        losses.append(-F.logsigmoid(0.3 * h))
    torch.stack(losses).mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    want = named_weights(model)
    got = named_weights(e.rank.actor.module)
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    assert diff < 1e-6
    assert e.rank.weight_version == 1 and e.rank.actor.step == 1


def test_micro_batches_by_token_budget_accumulate_to_exactly_the_whole_batch_gradient(model_path):
    pairs = random_pairs(7, seed=2)
    # A small lr: Adam's first step is lr * g / (|g| + eps), so near-zero gradients amplify rounding.
    # A budget of 20 tokens holds one pair (two rows) per micro-batch at most.
    whole = engine(model_path, lr=1e-4, shuffle=False)
    packed = engine(model_path, lr=1e-4, shuffle=False, micro_batch_token_budget=20)
    a = whole.train_dpo(pairs, DPOLoss(beta=0.2))
    b = packed.train_dpo(pairs, DPOLoss(beta=0.2))
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    pa, pb = params(whole), params(packed)
    assert max((pa[k] - pb[k]).abs().max().item() for k in pa) < 1e-6


def test_mini_batches_take_one_optimizer_step_each_and_bump_the_weight_version_once(model_path):
    e = engine(model_path)
    m = e.train_dpo(random_pairs(5, seed=3), DPOLoss(mini_batch_size=2))
    assert m["num_optimizer_steps"] == 3 and e.rank.actor.step == 3 and e.rank.weight_version == 1


def test_one_dpo_step_raises_the_chosen_over_rejected_margin_of_the_pairs(model_path):
    e = engine(model_path, lr=3e-3)
    pairs = random_pairs(6, seed=4)
    pc, pr = policy_sums(e, pairs)
    # Reference = policy before the step: the implicit rewards start at zero.
    for p, c, r in zip(pairs, pc, pr):
        p.ref_chosen_logprob, p.ref_rejected_logprob = c, r
    first = e.train_dpo(pairs, DPOLoss(beta=0.1))
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    qc, qr = policy_sums(e, pairs)
    margins = [(c2 - c1) - (r2 - r1) for c1, r1, c2, r2 in zip(pc, pr, qc, qr)]
    assert sum(margins) / len(margins) > 0.5
    second = e.train_dpo(pairs, DPOLoss(beta=0.1))
    assert second["rewards/margins"] > 0 and second["loss"] < math.log(2)
    assert second["rewards/accuracy"] > 0.5
    assert e.rank.weight_version == 2


def _bad_cases():
    def edit(fn, **loss):
        pairs = random_pairs(3, seed=5)
        fn(pairs)
        return pairs, DPOLoss(**loss)

    nothing = lambda p: None  # noqa: E731
    return {
        "empty batch": (([], DPOLoss()), "pairs: empty batch"),
        "empty prompt": (edit(lambda p: p[1].prompt_ids.clear()), r"pairs\[1\]\.prompt_ids: empty"),
        "empty chosen": (edit(lambda p: p[2].chosen_ids.clear()), r"pairs\[2\]\.chosen_ids: empty"),
        "empty rejected": (edit(lambda p: p[0].rejected_ids.clear()), r"pairs\[0\]\.rejected_ids: empty"),
        "chosen outside vocab": (edit(lambda p: p[1].chosen_ids.__setitem__(0, 32)),
                                 r"pairs\[1\]\.chosen_ids: token id 32"),
        "negative rejected id": (edit(lambda p: p[2].rejected_ids.__setitem__(0, -1)),
                                 r"pairs\[2\]\.rejected_ids: token id -1"),
        "too long": (edit(lambda p: p[0].chosen_ids.extend([5] * 64)), r"pairs\[0\]\.chosen_ids: .* limit of 64"),
        "nan ref": (edit(lambda p: setattr(p[1], "ref_chosen_logprob", float("nan"))),
                    r"pairs\[1\]\.ref_chosen_logprob: not finite"),
        "inf ref": (edit(lambda p: setattr(p[2], "ref_rejected_logprob", float("-inf"))),
                    r"pairs\[2\]\.ref_rejected_logprob: not finite"),
        "unknown loss_type": (edit(nothing, loss_type="kto"), "loss.loss_type"),
        "zero beta": (edit(nothing, beta=0.0), "loss.beta"),
        "nan beta": (edit(nothing, beta=float("nan")), "loss.beta"),
        "label smoothing too big": (edit(nothing, loss_type="cdpo", label_smoothing=0.5), "loss.label_smoothing"),
        "label smoothing without cdpo": (edit(nothing, label_smoothing=0.1), "loss.label_smoothing"),
        "negative mini batch": (edit(nothing, mini_batch_size=-1), "loss.mini_batch_size"),
    }


BAD = _bad_cases()


@pytest.fixture(scope="module")
def shared_engine(model_path) -> TrainerEngine:
    return engine(model_path)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_dpo_input_is_a_value_error_naming_the_field_and_pair_and_nothing_is_applied(shared_engine, case):
    (pairs, loss), pattern = BAD[case]
    e = shared_engine
    before, version, step = params(e), e.rank.weight_version, e.rank.actor.step
    with pytest.raises(ValueError, match=pattern):
        e.train_dpo(pairs, loss)
    after = params(e)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert (e.rank.weight_version, e.rank.actor.step) == (version, step)
    assert not e.rank.actor.optimizer.state


def test_proto_zeros_of_dpo_loss_read_as_defaults_and_pairs_round_trip():
    pairs, loss = convert.train_dpo_from_pb(trainer_pb2.TrainDPORequest(
        pairs=[trainer_pb2.PreferencePair(prompt_ids=[1, 2], chosen_ids=[3], rejected_ids=[4, 5],
                                          ref_chosen_logprob=-1.5, ref_rejected_logprob=-2.5)]))
    assert loss == DPOLoss(loss_type="sigmoid", beta=0.1, label_smoothing=0.0, mini_batch_size=0)
    assert pairs == [PreferencePair([1, 2], [3], [4, 5], -1.5, -2.5)]
    again = convert.train_dpo_from_pb(convert.train_dpo_to_pb(pairs, DPOLoss("cdpo", 0.25, 0.125, 2)))
    assert again == (pairs, DPOLoss("cdpo", 0.25, 0.125, 2))
    # A negative beta is not a zero: it stays and fails validation instead of silently becoming 0.1.
    assert convert.dpo_loss_from_pb(trainer_pb2.DPOLoss(beta=-1.0)).beta == -1.0
