"""Parallel trainers: `torchrun --nproc_per_node=N -m services.trainer` against one process.

Rank 0 serves gRPC and fans every command out to all ranks; DP ranks train on their share of every
mini-batch, TP ranks on column/row shards of every block. One TrainActor step must give the loss and
updated weights of a single-process run of the same batch, and a checkpoint saved on the multi-rank mesh
must resume on one rank. On CPU (gloo): fp32 within 1e-5. On GPUs (NCCL, one rank per GPU; marked gpu,
skipped without enough GPUs): fp32 and bf16 compute within the tolerances of `TOLERANCES`:

    PYTHONPATH=.:protos python -m pytest -q -m gpu tests/multiproc/test_trainer_mesh.py
"""

from __future__ import annotations

import asyncio
import os
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from meshrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.rpc.channel import create_channel
from services.common.config import load_config
from services.common.tensors.weights import named_weights
from services.trainer import convert
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss

REPO = Path(__file__).resolve().parents[2]
LORA = {"rank": 4, "alpha": 8}
LOSS = ActorLoss(mini_batch_size=4, kl_coef=0.05, entropy_coef=0.01)


@dataclass(frozen=True)
class Tolerance:
    """How close the mesh's step must be to the single process's: log-probs, loss metrics (abs + rel) and
    weights after the step (abs)."""

    logprob: float
    metric_abs: float
    metric_rel: float
    weight: float


# CPU gloo, fp32: only the reduction order differs. CUDA fp32 (TF32 off, torch's default for matmuls): the
# sharded GEMMs accumulate in another order. CUDA bf16 compute (fp32 master weights): the activations are
# rounded to 8 bits of mantissa (~4e-3 relative) and that rounding differs per layout; an AdamW step moves
# each weight by at most about lr (1e-4), so weights within 3 lr still catch a wrong or missing update.
TOLERANCES = {
    ("cpu", "float32"): Tolerance(logprob=1e-6, metric_abs=1e-5, metric_rel=0.0, weight=1e-5),
    ("cuda", "float32"): Tolerance(logprob=1e-4, metric_abs=1e-4, metric_rel=1e-4, weight=1e-4),
    ("cuda", "bfloat16"): Tolerance(logprob=5e-2, metric_abs=1e-2, metric_rel=3e-2, weight=3e-4),
}


class Launched:
    """A torchrun-launched trainer; `port` is parsed from rank 0's announce line."""

    def __init__(self, config: Path, log: Path, nproc: int = 2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "services.trainer", "--config", str(config), "--port", "0"]
        self.log = log.open("w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.port = None

    def _pump(self):
        for line in self.proc.stdout:
            self._lines.put(line)

    def wait_ready(self, timeout: float = 90.0) -> int:
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError("trainer did not announce its port") from None
            if "listening on" in line:
                self.port = int(line.rsplit(":", 1)[1])
                return self.port

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _samples(seed: int, old_from: TrainerEngine):
    samples = random_samples(8, seed=seed)
    lps = old_from.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    for s, lp in zip(samples, lps):
        s.old_logprobs = lp
        s.ref_logprobs = [x - 0.05 for x in lp]
    return samples


def _sequences(samples):
    return common_pb2.LogProbsRequest(sequences=[
        common_pb2.TokenSequence(id=str(i), prompt_ids=s.prompt_ids, response_ids=s.response_ids)
        for i, s in enumerate(samples)], temperature=1.0)


async def _drive(port: int, first, second, tmp_path):
    """What the mesh answers: its info, log-probs of `first`, a step on `first`, and (after a checkpoint and an
    HF export) a step on `second`."""
    async with create_channel(f"127.0.0.1:{port}") as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        info = await stub.GetInfo(common_pb2.GetInfoRequest())
        lp = await stub.ComputeLogProbs(_sequences(first))
        trained = await stub.TrainActor(convert.train_actor_to_pb(first, LOSS))
        await stub.SaveCheckpoint(trainer_pb2.CheckpointRequest(path=str(tmp_path / "ck")))
        await stub.ExportHF(trainer_pb2.CheckpointRequest(path=str(tmp_path / "hf")))
        trained_next = await stub.TrainActor(convert.train_actor_to_pb(second, LOSS))
        return info, lp, trained, trained_next


def _check_layout(info, trained, log: str, *, dp: int, tp: int, pp: int, schedule: str, dp_mode: str, device: str):
    """The mesh reports the layout it was asked for, each rank logs where it loaded, the bubble is the schedule's."""
    world = dp * tp * pp
    assert (info.details["dp"], info.details["tp"], info.details["pp"], info.details["world_size"]) == (
        str(dp), str(tp), str(pp), str(world))
    rank_devices = [f"cuda:{r}" for r in range(world)] if device == "cuda" else ["cpu"] * world
    assert info.details["devices"] == ",".join(rank_devices) and info.details["dp_mode"] == dp_mode
    stages_per_rank = 2 if schedule == "interleaved_1f1b" and pp > 1 else 1
    assert info.details["pp_stages_per_rank"] == str(stages_per_rank)
    assert trained.metrics["pipeline_bubble_fraction"] == pytest.approx((pp - 1) / (stages_per_rank * 2 + pp - 1))
    for rank in range(world):
        assert f"Rank {rank}: actor loaded on {rank_devices[rank]} (tp={tp} pp={pp} dp={dp})" in log


def _adapter_of(folder: Path) -> dict:
    """The adapter tensors of a peft export folder."""
    from safetensors.torch import load_file

    tensors = load_file(folder / "adapter_model.safetensors")
    assert tensors and all(".lora_" in k for k in tensors)
    return tensors


def _mesh_config(tmp_path, model, *, device, dtype, dp, tp, pp, schedule, dp_mode, budget, fused, checkpointing,
                 lora) -> Path:
    """The mesh's trainer.yaml (check_against_single_process's layout)."""
    config = tmp_path / "trainer.yaml"
    fused_line = "" if fused is None else f"  fused_logprobs: {str(fused).lower()}\n"
    config.write_text(f"model:\n  path: {model}\n  device: {device}\nactor:\n  lr: 1.0e-4\n  seed: 3\n  dtype: {dtype}\n"
                      f"  dp_size: {dp}\n  tp_size: {tp}\n"
                      f"  pp_size: {pp}\n  pipeline_schedule: {schedule}\n  num_microbatches: 2\n"
                      f"  dp_mode: {dp_mode}\n  micro_batch_token_budget: {budget}\n{fused_line}"
                      f"  activation_checkpointing: {checkpointing}\n"
                      + (f"  lora: {{rank: {LORA['rank']}, alpha: {LORA['alpha']}}}\n" if lora else ""))
    return config


def check_against_single_process(tmp_path, *, dp_mode: str = "fsdp", dp: int = 1, tp: int = 1, pp: int = 1,
                                 schedule: str = "1f1b", budget: int = 16384, fused: bool | None = False,
                                 device: str = "cpu", dtype: str = "float32", checkpointing: str = "none",
                                 lora: bool = False):
    # fused: the mesh computes log-probs through the fused LM head, the single process through the plain one
    # (None: both take the device's default). device cuda: every rank on its own GPU (LOCAL_RANK), NCCL; the
    # single process on cuda:0. dtype: the compute dtype (master weights stay fp32). checkpointing: the mesh's
    # actor.activation_checkpointing (the single process runs without). lora: both train LORA adapters (peft exports).
    tol = TOLERANCES[(device, dtype)]
    model = make_tiny_model(tmp_path / "model", num_hidden_layers=4)
    actor = {"lr": 1e-4, "seed": 3, "dtype": dtype} | ({"lora": LORA} if lora else {})
    config = _mesh_config(tmp_path, model, device=device, dtype=dtype, dp=dp, tp=tp, pp=pp, schedule=schedule,
                          dp_mode=dp_mode, budget=budget, fused=fused, checkpointing=checkpointing, lora=lora)
    launched = Launched(config, tmp_path / "torchrun.log", nproc=dp * tp * pp)
    single_model = {"path": model, "device": device}
    try:
        # The single-process run works while the ranks start.
        single = TrainerEngine(load_config(TrainerSettings, data={"model": single_model, "actor": actor}))
        first = _samples(1, single)
        expected_lp = single.compute_logprobs([s.prompt_ids for s in first], [s.response_ids for s in first])
        expected = single.train_actor(first, LOSS)
        expected_weights = {k: v.detach().clone() for k, v in named_weights(single.rank.actor.module).items()}
        if lora:
            single.export_hf(str(tmp_path / "single_hf"))
        second = _samples(2, single)
        expected_next = single.train_actor(second, LOSS)

        info, lp, trained, trained_next = asyncio.run(_drive(launched.wait_ready(), first, second, tmp_path))
    finally:
        launched.stop()
    _check_layout(info, trained, (tmp_path / "torchrun.log").read_text(), dp=dp, tp=tp, pp=pp, schedule=schedule,
                  dp_mode=dp_mode, device=device)

    for got, want in zip(lp.results, expected_lp):
        assert list(got.logprobs) == pytest.approx(want, abs=tol.logprob)
    for key in ("pg_loss", "kl_loss", "entropy", "grad_norm", "clip_frac"):
        assert trained.metrics[key] == pytest.approx(expected[key], abs=tol.metric_abs, rel=tol.metric_rel), key
    assert trained.step == 2

    from safetensors.torch import load_file

    if lora:                # the mesh's adapters after one step are the single process's (its export: the same names)
        expected_weights = _adapter_of(tmp_path / "single_hf")
    exported = load_file(tmp_path / "hf" / ("adapter_model.safetensors" if lora else "model.safetensors"))
    diff = max((exported[k] - expected_weights[k].cpu()).abs().max().item() for k in expected_weights)
    assert diff < tol.weight

    # The mesh run continued after the checkpoint; a 1-rank trainer resumed from it takes the same step.
    assert trained_next.metrics["pg_loss"] == pytest.approx(expected_next["pg_loss"], abs=tol.metric_abs,
                                                            rel=tol.metric_rel)
    resumed = TrainerEngine(load_config(TrainerSettings, data={"model": single_model, "actor": actor}))
    resumed.load_checkpoint(str(tmp_path / "ck"))
    again = resumed.train_actor(second, LOSS)
    assert again["pg_loss"] == pytest.approx(trained_next.metrics["pg_loss"], abs=tol.metric_abs, rel=tol.metric_rel)
    assert again["grad_norm"] == pytest.approx(trained_next.metrics["grad_norm"], rel=max(1e-5, tol.metric_rel))
    assert resumed.rank.actor.step == 4 and resumed.rank.weight_version == 2
    for k, v in named_weights(resumed.rank.actor.module).items():
        # Two steps apart from the single run: twice the one-step tolerance.
        assert torch.allclose(v, named_weights(single.rank.actor.module)[k], atol=2 * tol.weight if device == "cuda"
                              else tol.weight), k


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(dp=2, budget=24), dict(dp=2, dp_mode="ddp", budget=24), dict(tp=2),
                                  dict(pp=2, schedule="1f1b"), dict(pp=2, schedule="interleaved_1f1b"),
                                  dict(dp=2, budget=24, fused=True), dict(dp=2, dp_mode="ddp", budget=24, fused=True),
                                  dict(tp=2, fused=True)],
                         ids=["fsdp-dp2-accumulating", "ddp-dp2-accumulating", "tp2", "pp2-1f1b",
                              "pp2-interleaved-2-stages-per-rank", "fsdp-dp2-fused-head", "ddp-dp2-fused-head",
                              "tp2-vocab-parallel-head"])
def test_a_two_rank_step_matches_a_single_process_run(tmp_path, mesh):
    check_against_single_process(tmp_path, **mesh)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(dp=2, tp=2), dict(dp=2, pp=2, schedule="gpipe"), dict(pp=2, tp=2),
                                  dict(dp=2, pp=2, schedule="interleaved_1f1b")],
                         ids=["fsdp2-tp2", "fsdp2-pp2-gpipe", "pp2-tp2", "fsdp2-pp2-interleaved"])
def test_a_four_rank_2d_mesh_step_matches_a_single_process_run(tmp_path, mesh):
    check_against_single_process(tmp_path, **mesh)


@pytest.mark.slow
def test_an_eight_rank_3d_mesh_step_matches_a_single_process_run(tmp_path):
    # tp=2 x dp=2 x pp=2 on eight CPU processes: the layout the 8-GPU run takes.
    check_against_single_process(tmp_path, dp=2, tp=2, pp=2)


@pytest.mark.slow
@pytest.mark.parametrize("dp_mode", ["fsdp", "ddp"])
def test_a_two_rank_lora_step_matches_a_single_process_run(tmp_path, dp_mode):
    # LoRA trains data-parallel only; the adapters' grouped ops (lora_group.py) run on views of one fused storage.
    check_against_single_process(tmp_path, dp=2, dp_mode=dp_mode, budget=24, lora=True)


GPU_MESHES = {"one-rank": dict(), "fsdp-dp2": dict(dp=2, budget=24), "tp2": dict(tp=2), "pp2-1f1b": dict(pp=2),
              "fsdp2-tp2": dict(dp=2, tp=2), "fsdp2-tp2-pp2": dict(dp=2, tp=2, pp=2)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mesh", list(GPU_MESHES.values()), ids=list(GPU_MESHES))
def test_a_mesh_of_gpus_step_matches_a_single_gpu_run(tmp_path, mesh, dtype):
    # NCCL, one rank per GPU, CUDA defaults (compiled blocks, fused LM head where the layout allows it).
    world = mesh.get("dp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < world:
        pytest.skip(f"needs {world} CUDA GPUs, this machine has {have}")
    check_against_single_process(tmp_path, device="cuda", dtype=dtype, fused=None, **mesh)


@pytest.mark.slow
def test_a_single_process_checkpoint_resumes_on_a_two_stage_pipeline(tmp_path):
    # The other direction of the resharding above; the last stage finds the tied embedding's optimizer
    # state under the embedding's name.
    model = make_tiny_model(tmp_path / "model", num_hidden_layers=4)
    actor = {"lr": 1e-4, "seed": 3}
    config = tmp_path / "trainer.yaml"
    config.write_text(f"model:\n  path: {model}\nactor:\n  lr: 1.0e-4\n  seed: 3\n  pp_size: 2\n")
    launched = Launched(config, tmp_path / "torchrun.log", nproc=2)
    try:
        single = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model}, "actor": actor}))
        single.train_actor(_samples(1, single), LOSS)
        single.save_checkpoint(str(tmp_path / "ck"))
        second = _samples(2, single)
        expected = single.train_actor(second, LOSS)
        port = launched.wait_ready()

        async def drive():
            async with create_channel(f"127.0.0.1:{port}") as channel:
                stub = trainer_pb2_grpc.TrainerStub(channel)
                loaded = await stub.LoadCheckpoint(trainer_pb2.CheckpointRequest(path=str(tmp_path / "ck")))
                trained = await stub.TrainActor(convert.train_actor_to_pb(second, LOSS))
                await stub.ExportHF(trainer_pb2.CheckpointRequest(path=str(tmp_path / "hf")))
                return loaded, trained

        loaded, trained = asyncio.run(drive())
    finally:
        launched.stop()
    assert (loaded.step, loaded.weight_version) == (2, 1)
    assert trained.step == 4
    for key in ("pg_loss", "kl_loss", "grad_norm"):
        assert trained.metrics[key] == pytest.approx(expected[key], abs=1e-5), key
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "hf" / "model.safetensors")
    want = named_weights(single.rank.actor.module)
    assert set(exported) == set(want)
    assert max((exported[k] - want[k]).abs().max().item() for k in want) < 1e-5
