"""Activation checkpointing (actor.activation_checkpointing: none | full | selective): the blocks recompute
what each mode says in backward, a step with it on equals a step with it off, and the weights keep the
model's own names in weight sync, DCP checkpoints and ExportHF."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.common.config import load_config
from services.common.tensors.modeling import load_causal_lm
from services.common.tensors.weights import named_weights
from services.trainer.config import ActorConfig, TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.parallel.parallelize import apply_activation_checkpointing, checkpointed_blocks
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss

LOSS = ActorLoss(mini_batch_size=3, kl_coef=0.05, entropy_coef=0.01)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("ac") / "model", num_hidden_layers=4)


def engine(model_path: str, mode, **actor) -> TrainerEngine:
    data = {"model": {"path": model_path}, "actor": {"lr": 1e-2, "activation_checkpointing": mode, **actor}}
    return TrainerEngine(load_config(TrainerSettings, data=data))


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def backward_ops(model_path: str, mode: str, every: int = 1) -> dict[str, int]:
    """aten ops run during backward of one forward through the model with `mode` applied."""
    model = load_causal_lm(model_path, dtype="float32", device="cpu", trainable=True)
    apply_activation_checkpointing(model, mode, every)
    # The counter is on in forward too: selective checkpointing matches backward's ops to forward's.
    with OpCounter() as counter:
        loss = model(input_ids=torch.tensor([[3, 4, 5, 6, 7, 8]]), use_cache=False).logits.float().logsumexp(-1).sum()
        forward = dict(counter.counts)
        loss.backward()
    return {k: v - forward.get(k, 0) for k, v in counter.counts.items()}


def test_full_recomputes_the_blocks_matmuls_and_selective_only_the_cheap_ops(model_path):
    none, full, selective = (backward_ops(model_path, m) for m in ("none", "full", "selective"))
    # Full runs 6 of each block's 7 projections again in backward (recompute stops once backward has all it
    # needs: down_proj's output is not one of them); selective keeps their outputs.
    assert full["mm"] + full.get("addmm", 0) == none["mm"] + none.get("addmm", 0) + 4 * 6
    assert selective["mm"] + selective.get("addmm", 0) == none["mm"] + none.get("addmm", 0)
    # The MLP's SiLU is recomputed by both (its forward op runs in backward), never without checkpointing.
    assert none.get("silu", 0) == 0 and full["silu"] == 4 and selective["silu"] == 4


def test_every_k_th_block_is_checkpointed_by_its_layer_index(model_path):
    assert checkpointed_blocks(5, "full", 2) == [0, 2, 4]
    assert checkpointed_blocks(4, "selective", 3) == [0, 1, 2, 3]
    assert checkpointed_blocks(4, "none", 1) == []
    assert backward_ops(model_path, "full", every=2)["silu"] == 2


def test_true_and_false_keep_meaning_full_and_none_and_a_misspelled_mode_is_refused_by_key():
    assert ActorConfig(activation_checkpointing=True).activation_checkpointing == "full"
    assert ActorConfig(activation_checkpointing=False).activation_checkpointing == "none"
    with pytest.raises(ValueError, match="activation_checkpointing"):
        load_config(TrainerSettings, data={"actor": {"activation_checkpointing": "ful"}})
    with pytest.raises(ValueError, match="activation_checkpointing_every"):
        load_config(TrainerSettings, data={"actor": {"activation_checkpointing_every": 0}})


def one_step(e: TrainerEngine):
    samples = random_samples(6, seed=4)
    lps = e.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    for s, lp in zip(samples, lps):
        s.old_logprobs = lp
        s.ref_logprobs = [x - 0.05 for x in lp]
    metrics = e.train_actor(samples, LOSS)
    after = e.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    return metrics, after


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_step_with_checkpointing_equals_one_without_and_syncs_under_the_models_names(model_path, mode):
    off, on = engine(model_path, "none"), engine(model_path, mode)
    (m_off, lp_off), (m_on, lp_on) = one_step(off), one_step(on)
    for key in ("pg_loss", "kl_loss", "entropy", "grad_norm"):
        assert m_on[key] == pytest.approx(m_off[key], abs=1e-6), key
    for a, b in zip(lp_on, lp_off):
        assert a == pytest.approx(b, abs=1e-6)
    synced_on, _ = on.state_for_sync()
    synced_off, _ = off.state_for_sync()
    assert list(synced_on) == list(synced_off)
    assert all("_checkpoint_wrapped_module" not in k for k in synced_on)
    for k in synced_off:
        assert torch.allclose(synced_on[k], synced_off[k], atol=1e-6), k


def test_checkpoint_and_export_with_checkpointing_load_where_it_is_off(model_path, tmp_path):
    from safetensors.torch import load_file

    on = engine(model_path, "full")
    one_step(on)
    on.save_checkpoint(str(tmp_path / "ck"))
    on.export_hf(str(tmp_path / "hf"))
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    want = named_weights(on.rank.actor.module)
    assert set(exported) == set(want)
    off = engine(model_path, "none")
    off.load_checkpoint(str(tmp_path / "ck"))
    for k, v in named_weights(off.rank.actor.module).items():
        assert torch.equal(v, want[k]), k
    # The exported folder loads as the HF model it is.
    reloaded = load_causal_lm(str(tmp_path / "hf"), dtype="float32", device="cpu")
    for k, v in named_weights(reloaded).items():
        assert torch.equal(v, want[k].detach()), k
