"""Pipeline stages without a process group: interleaved (several stages per rank) split and config checks."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from services.common.config import load_config
from services.common.tensors.modeling import load_causal_lm
from services.common.tensors.weights import named_weights
from services.trainer.config import ActorConfig, TrainerSettings
from services.trainer.parallel.pipeline import check_stage_split, split_stages, stage_indices
from services.trainer.testing import make_tiny_model


def fake_pp_mesh(size: int, rank: int):
    return SimpleNamespace(size=lambda: size, get_local_rank=lambda: rank)


def test_interleaved_stages_are_looped_over_ranks():
    assert stage_indices(0, 2, 2) == [0, 2] and stage_indices(1, 2, 2) == [1, 3]
    assert stage_indices(1, 4, 3) == [1, 5, 9]


def test_two_ranks_with_two_stages_each_chain_to_the_whole_model_and_keep_hf_names(tmp_path):
    path = make_tiny_model(tmp_path / "model", num_hidden_layers=4)
    full = load_causal_lm(path)
    ranks = [load_causal_lm(path) for _ in range(2)]
    stages = {}
    for r, model in enumerate(ranks):
        for s, chunk in zip(stage_indices(r, 2, 2), split_stages(model, fake_pp_mesh(2, r), 2)):
            stages[s] = chunk
    # Rank 0 holds stages 0 and 2 (layers 0 and 2, the embedding), rank 1 stages 1 and 3 (layers 1 and 3, norm, head).
    first = ("model.embed_tokens", "model.layers.0.", "model.layers.2.")
    assert set(named_weights(ranks[0])) == {k for k in named_weights(full) if k.startswith(first)}
    assert set(named_weights(ranks[1])) == {k for k in named_weights(full) if not k.startswith(first)} | {"lm_head.weight"}
    # The container holds the very parameters its stages train.
    assert {id(p) for p in ranks[0].parameters()} == {id(p) for s in (0, 2) for p in stages[s].parameters()}
    with pytest.raises(RuntimeError, match="pipeline schedule"):
        ranks[0](torch.tensor([[3, 4]]))
    ids = torch.tensor([[3, 7, 9, 11, 5]])
    h = ids
    with torch.no_grad():
        for s in range(4):
            h = stages[s](h)
        h = stages[3].lm_head(h)                 # the last stage ends at the final norm; the loss runs the head
        want = full(input_ids=ids).logits
    assert torch.allclose(h, want, atol=1e-5)


def test_too_few_layers_for_the_stages_names_pp_stages_per_rank(tmp_path):
    with pytest.raises(ValueError, match=r"actor.pp_stages_per_rank: pp_size=2 x pp_stages_per_rank=3 = 6 .* 4 deco"):
        check_stage_split(4, 2, 3)
    with pytest.raises(ValueError, match=r"actor.pp_size: pp_size=4 x pp_stages_per_rank=1"):
        check_stage_split(2, 4, 1)
    model = load_causal_lm(make_tiny_model(tmp_path / "model", num_hidden_layers=2))
    with pytest.raises(ValueError, match="actor.pp_stages_per_rank"):
        split_stages(copy.deepcopy(model), fake_pp_mesh(2, 0), 2)


def test_interleaved_defaults_to_two_stages_per_rank_and_others_to_one():
    assert ActorConfig(pipeline_schedule="interleaved_1f1b", pp_size=2).stages_per_rank == 2
    assert ActorConfig(pipeline_schedule="interleaved_1f1b", pp_size=2, pp_stages_per_rank=3).stages_per_rank == 3
    assert ActorConfig(pipeline_schedule="1f1b", pp_size=2).stages_per_rank == 1


@pytest.mark.parametrize("actor,pattern", [
    (dict(pp_size=2, pipeline_schedule="interleaved_1f1b", num_microbatches=5), r"actor.num_microbatches: .* rounds"),
    (dict(pp_size=2, pipeline_schedule="interleaved_1f1b", num_microbatches=7), r"actor.num_microbatches"),
    (dict(pp_size=2, pipeline_schedule="1f1b", pp_stages_per_rank=2), r"pp_stages_per_rank: 2 stages per rank need"),
    (dict(pp_size=2, pipeline_schedule="interleaved_1f1b", pp_stages_per_rank=1), r"pp_stages_per_rank: .* at least 2"),
    (dict(pp_size=2, dp_size=2, dp_mode="ddp"), r"dp_mode: ddp cannot be combined with pipeline parallel"),
    (dict(pipeline_schedule="zero_bubble"), r"actor.pipeline_schedule"),
])
def test_bad_pipeline_settings_are_refused_naming_the_key(actor, pattern):
    with pytest.raises(ValueError, match=pattern):
        load_config(TrainerSettings, data={"model": {"path": "x"}, "actor": actor})


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8])
def test_microbatch_counts_interleaved_1f1b_accepts(n):
    actor = dict(pp_size=2, pipeline_schedule="interleaved_1f1b", num_microbatches=n)
    assert load_config(TrainerSettings, data={"model": {"path": "x"}, "actor": actor}).actor.num_microbatches == n
