"""Remove padding (services/common/tensors/packing.py): packed rows give the padded path's log-probs, entropies, values,
losses and gradients (fp32 CPU, 1e-5), micro-batches are filled to the token budget, and what cannot pack is
refused by name."""

from __future__ import annotations

import pytest
import torch

from services.common.config import load_config
from services.common.tensors.fused import enable_fused_head, sequence_logprobs
from services.common.tensors.modeling import batched_logprobs, load_causal_lm
from services.common.tensors.packing import enable_packing, pack_by_token_sum, token_layout
from services.common.tensors.weights import named_weights
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss, CriticLoss, CriticSample

TOL = 1e-5


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def engine(model_path: str, packed: bool, **actor) -> TrainerEngine:
    critic = actor.pop("critic", None)
    data = {"model": {"path": model_path},
            "actor": {"lr": 1e-2, "shuffle": False, "use_remove_padding": packed, **actor}}
    if critic is not None:
        data["critic"] = critic
    return TrainerEngine(load_config(TrainerSettings, data=data))


def ids(samples):
    return [s.prompt_ids for s in samples], [s.response_ids for s in samples]


def test_a_packed_row_restarts_positions_per_sequence_and_points_at_each_response_token():
    lay = token_layout([[5, 6], [7]], [[8, 9, 10], [11, 12]], pad_id=0, device=torch.device("cpu"), packed=True)
    assert lay.input_ids.tolist() == [[5, 6, 8, 9, 10, 7, 11, 12]]
    assert lay.model_kwargs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert lay.model_kwargs["packed"].bounds == (0, 5, 8) and lay.model_kwargs["packed"].max_len == 5
    # The hidden state at position i predicts token i + 1: the last prompt token predicts the first response one.
    assert lay.src.tolist() == [1, 2, 3, 5, 6] and lay.targets.tolist() == [8, 9, 10, 11, 12]
    assert lay.mask.tolist() == [[True, True, True], [True, True, False]]


def test_rows_of_one_length_keep_the_padded_layout_when_packing():
    """Nothing to remove: [B, L] without packing arguments (the padded path's attention kernel), same positions."""
    prompts, responses = [[5, 6], [7, 8, 9]], [[10, 11, 12], [13, 14]]
    lay = token_layout(prompts, responses, pad_id=0, device=torch.device("cpu"), packed=True)
    ref = token_layout(prompts, responses, pad_id=0, device=torch.device("cpu"), packed=False)
    assert lay.input_ids.tolist() == [[5, 6, 10, 11, 12], [7, 8, 9, 13, 14]] and lay.model_kwargs == {}
    for a, b in zip(lay[2:], ref[2:]):
        assert torch.equal(a, b)


def test_packed_micro_batches_fill_the_token_budget_and_a_longer_sequence_runs_alone():
    lengths = [7, 3, 30, 5, 5, 2, 9, 1]
    groups = pack_by_token_sum(lengths, 10)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [2] in groups                                         # over budget: alone
    assert all(sum(lengths[i] for i in g) <= 10 for g in groups if g != [2])
    # 32 tokens under the budget need at least 4 micro-batches of 10; first fit, longest first, makes 4.
    assert len(groups) == 5


@pytest.mark.parametrize("fused", [False, True])
def test_packed_logprobs_entropy_and_gradients_equal_the_padded_ones(model_path, fused):
    model = load_causal_lm(model_path, trainable=True)
    model.train(False)
    enable_packing(model, "test")
    if fused:
        enable_fused_head(model)
    prompts, responses = ids(random_samples(7, seed=4))
    grads, outs = [], []
    for packed in (False, True):
        model.zero_grad()
        logp, mask, ent = sequence_logprobs(model, prompts, responses, pad_id=0, device=torch.device("cpu"),
                                            temperature=0.7, packed=packed, fused=fused)
        (logp.sum() + 0.3 * ent.sum()).backward()
        outs.append((logp.detach(), mask, ent.detach()))
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
    (lp_pad, m_pad, ent_pad), (lp_pack, m_pack, ent_pack) = outs
    assert torch.equal(m_pad, m_pack) and int(m_pad.sum()) == sum(map(len, responses))
    assert (lp_pad - lp_pack).abs().max() < TOL and (ent_pad - ent_pack).abs().max() < TOL
    assert lp_pack[~m_pack].abs().max() == 0                    # padding entries stay 0
    for k in grads[0]:
        assert torch.allclose(grads[0][k], grads[1][k], atol=TOL, rtol=1e-5), k


def test_sequences_in_one_packed_row_do_not_see_each_other(model_path):
    model = load_causal_lm(model_path)
    enable_packing(model, "test")
    prompts, responses = [[5, 6, 7]], [[8, 9]]
    alone = sequence_logprobs(model, prompts, responses, pad_id=0, device=torch.device("cpu"), packed=True)[0]
    # The same sequence after another one in the same row: a leak across the boundary would change it.
    both = sequence_logprobs(model, [[20, 21, 22, 23]] + prompts, [[24, 25, 26]] + responses, pad_id=0,
                             device=torch.device("cpu"), packed=True)[0]
    assert (both[1, :2] - alone[0]).abs().max() < TOL


def test_the_actor_step_and_compute_logprobs_packed_equal_padded(model_path):
    samples = random_samples(8, seed=5)
    loss = ActorLoss(mini_batch_size=4, kl_coef=0.05, entropy_coef=0.01)
    results = []
    for packed in (False, True):
        # AdamW's eps 1e-6, not 1e-8: its first step moves a weight by lr * g / (|g| + eps), so a gradient within
        # rounding of 0 (1e-11 apart on the two paths) would move the weights 1e-5 apart with eps 1e-8.
        e = engine(model_path, packed, micro_batch_token_budget=30, eps=1e-6)
        assert e.rank.layout.packed is packed
        lps = e.compute_logprobs(*ids(samples))
        for s, lp in zip(samples, lps):
            s.old_logprobs, s.ref_logprobs = lp, [x - 0.05 for x in lp]
        metrics = e.train_actor(samples, loss)
        results.append((lps, metrics, {k: v.detach().clone() for k, v in named_weights(e.rank.actor.module).items()}))
    (lp_a, m_a, w_a), (lp_b, m_b, w_b) = results
    assert max(abs(x - y) for ra, rb in zip(lp_a, lp_b) for x, y in zip(ra, rb)) < TOL
    for key in ("pg_loss", "kl_loss", "entropy", "loss", "grad_norm"):
        assert m_a[key] == pytest.approx(m_b[key], abs=TOL), key
    assert max((w_a[k] - w_b[k]).abs().max().item() for k in w_a) < TOL


def test_critic_values_and_its_update_packed_equal_padded(model_path):
    samples = random_samples(6, seed=6)
    critic_samples = [CriticSample(s.prompt_ids, s.response_ids, returns=[0.5] * len(s.response_ids))
                      for s in samples]
    results = []
    for packed in (False, True):
        e = engine(model_path, packed, micro_batch_token_budget=25, critic={"lr": 1e-2})
        values = e.compute_values(*ids(samples))
        metrics = e.train_critic(critic_samples, CriticLoss(clip_value=0.0, mini_batch_size=3))
        results.append((values, metrics, e.compute_values(*ids(samples))))
    (v_a, m_a, after_a), (v_b, m_b, after_b) = results
    assert [len(v) for v in v_a] == [len(s.response_ids) for s in samples]
    assert max(abs(x - y) for ra, rb in zip(v_a, v_b) for x, y in zip(ra, rb)) < TOL
    assert m_a["vf_loss"] == pytest.approx(m_b["vf_loss"], abs=TOL)
    assert max(abs(x - y) for ra, rb in zip(after_a, after_b) for x, y in zip(ra, rb)) < TOL


def test_reference_logprobs_packed_equal_padded(model_path):
    from services.reference.config import ReferenceSettings
    from services.reference.engine import ReferenceEngine

    def reference(packed: bool) -> ReferenceEngine:
        return ReferenceEngine(load_config(ReferenceSettings, data={"model": {"path": model_path}, "reference": {
            "use_remove_padding": packed, "micro_batch_token_budget": 20}}))

    padded, packed = reference(False), reference(True)
    assert (padded.info()["use_remove_padding"], packed.info()["use_remove_padding"]) == (False, True)
    prompts, responses = ids(random_samples(9, seed=7))
    a, b = padded.logprobs_sync(prompts, responses), packed.logprobs_sync(prompts, responses)
    assert [len(x) for x in b] == [len(r) for r in responses]
    assert max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)) < TOL
    # The plain model scored by the shared function on padded rows agrees too.
    plain = batched_logprobs(load_causal_lm(model_path), prompts, responses, pad_id=0)
    assert max(abs(x - y) for ra, rb in zip(plain, b) for x, y in zip(ra, rb)) < TOL


def test_a_model_whose_attention_cannot_pack_is_refused_by_the_key(model_path):
    model = load_causal_lm(model_path)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match=r"^actor.use_remove_padding: cannot pack .*'eager'"):
        enable_packing(model, "actor.use_remove_padding")
