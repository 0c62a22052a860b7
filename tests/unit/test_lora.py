"""LoRA RL (actor.lora): only the adapters train, the reference is the base model with them off, replicas and
ExportHF(merged) get merged weights under the model's own names, checkpoints hold the adapters, and bad settings are
refused by key before anything starts."""

from __future__ import annotations

import asyncio

import pytest
import torch

from coordinator.recipe.config import RunConfig
from coordinator.recipe.preflight import check_run
from meshrl.v1 import common_pb2, reference_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.common.tensors.modeling import load_causal_lm, response_logprobs
from services.common.tensors.weights import named_weights
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples, sequences_pb
from services.trainer.types import ActorLoss

LORA = {"rank": 4, "alpha": 8}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("lora") / "model")


def engine(model_path: str, lora=LORA, **actor) -> TrainerEngine:
    data = {"model": {"path": model_path}, "actor": {"lr": 1e-2, "lora": lora, **actor}}
    return TrainerEngine(load_config(TrainerSettings, data=data))


def ids(samples):
    return [s.prompt_ids for s in samples], [s.response_ids for s in samples]


def train(e: TrainerEngine, samples, steps: int = 2) -> None:
    for _ in range(steps):
        for s, lp in zip(samples, e.compute_logprobs(*ids(samples))):
            s.old_logprobs = lp
        e.train_actor(samples, ActorLoss(mini_batch_size=3))


def base_logprobs(model_path: str, samples) -> list[list[float]]:
    model = load_causal_lm(model_path, dtype="float32", device="cpu")
    logp, _ = response_logprobs(model, *ids(samples), pad_id=0)
    return [logp[i, :len(s.response_ids)].tolist() for i, s in enumerate(samples)]


def test_only_adapters_train_and_the_reference_stays_the_base_model(model_path):
    e = engine(model_path)
    trainable = {n for n, p in e.rank.actor.module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in e.rank.actor.module.named_parameters() if not p.requires_grad}
    samples = random_samples(6, seed=1)
    base = base_logprobs(model_path, samples)
    # Adapters start at B = 0: the policy is the base model until the first step.
    for got, want in zip(e.compute_logprobs(*ids(samples)), base):
        assert got == pytest.approx(want, abs=1e-6)
    train(e, samples)
    after = e.compute_logprobs(*ids(samples))
    assert max(abs(a - b) for x, y in zip(after, base) for a, b in zip(x, y)) > 1e-3
    for got, want in zip(e.compute_reference_logprobs(*ids(samples)), base):
        assert got == pytest.approx(want, abs=1e-6)
    for n, p in e.rank.actor.module.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    # The adapters are back on after the reference pass.
    assert e.compute_logprobs(*ids(samples)) == after


def test_sync_and_export_merge_the_adapters_under_the_models_own_names(model_path, tmp_path):
    from safetensors.torch import load_file

    e = engine(model_path)
    samples = random_samples(6, seed=2)
    train(e, samples)
    synced, _ = e.state_for_sync()
    plain = load_causal_lm(model_path, dtype="float32", device="cpu")
    assert list(synced) == list(named_weights(plain))
    e.export_hf(str(tmp_path / "hf"), merged=True)
    assert set(load_file(tmp_path / "hf" / "model.safetensors")) == set(synced)
    # A plain model with the exported (merged) weights answers what the LoRA policy answers.
    for got, want in zip(base_logprobs(str(tmp_path / "hf"), samples), e.compute_logprobs(*ids(samples))):
        assert got == pytest.approx(want, abs=1e-5)


def test_a_checkpoint_holds_the_adapters_and_resumes_the_policy(model_path, tmp_path):
    e = engine(model_path)
    samples = random_samples(6, seed=3)
    train(e, samples)
    e.save_checkpoint(str(tmp_path / "ck"))
    resumed = engine(model_path)
    resumed.load_checkpoint(str(tmp_path / "ck"))
    assert resumed.compute_logprobs(*ids(samples)) == e.compute_logprobs(*ids(samples))
    assert resumed.rank.actor.step == e.rank.actor.step
    # Only the adapters (and their AdamW state) are in it, not the frozen base weights.
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(tmp_path / "ck" / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("actor.model.")]
    assert model_keys and [k for k in model_keys if ".lora_" not in k] == []


def test_the_trainer_answers_as_a_reference_replica_with_the_adapters_off(model_path):
    from services.trainer.servicer import start

    samples = random_samples(4, seed=4)

    async def main():
        settings = load_config(TrainerSettings, data={"model": {"path": model_path},
                                                       "actor": {"lr": 1e-2, "lora": LORA}})
        mesh, port, e = await start(settings, "127.0.0.1:0")
        try:
            await asyncio.to_thread(train, e, samples)
            async with create_channel(f"127.0.0.1:{port}") as channel:
                stub = reference_pb2_grpc.ReferenceStub(channel)
                info = await stub.GetInfo(common_pb2.GetInfoRequest())
                reply = await stub.ComputeLogProbs(sequences_pb(samples))
                return info, [list(r.logprobs) for r in reply.results]
        finally:
            await mesh.stop(0)
            e.close()

    info, got = asyncio.run(main())
    assert info.role == "reference"
    for g, want in zip(got, base_logprobs(model_path, samples)):
        assert g == pytest.approx(want, abs=1e-5)


def test_bad_lora_settings_are_refused_by_key_before_anything_starts(model_path):
    with pytest.raises(ValueError, match=r"actor\.lora\.rank"):
        load_config(RunConfig, data={"model": {"path": model_path}, "actor": {"lora": {"rank": 0}}})
    with pytest.raises(ValueError, match="actor.lora: LoRA runs with data parallel only"):
        load_config(RunConfig, data={"model": {"path": model_path}, "actor": {"lora": LORA, "tp_size": 2}})
    cfg = load_config(RunConfig, data={"model": {"path": model_path}, "rollout": {"max_tokens": 8},
                                       "actor": {"lora": {**LORA, "target_modules": ["q_proj", "qkv"]}}})
    check_run(load_config(RunConfig, data={"model": {"path": model_path}, "rollout": {"max_tokens": 8},
                                           "actor": {"lora": LORA}}))
    with pytest.raises(ValueError, match=r"^actor\.lora\.target_modules: 'qkv' match no linear layer"):
        check_run(cfg)
    with pytest.raises(ValueError, match=r"actor\.lora\.target_modules: 'qkv'"):
        engine(model_path, lora={**LORA, "target_modules": ["qkv"]})
