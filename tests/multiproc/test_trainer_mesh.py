"""Parallel trainers on CPU: `torchrun --nproc_per_node=N -m services.trainer` (gloo) against one process.

Rank 0 serves gRPC and fans every command out to all ranks; DP ranks train on their share of every
mini-batch, TP ranks on column/row shards of every block. One TrainActor step must give the loss and
updated weights of a single-process run of the same batch (fp32, within 1e-5), and a checkpoint saved
on the multi-rank mesh must resume on one rank.
"""

from __future__ import annotations

import asyncio
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from meshrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.channel import create_channel
from services.common.config import load_config
from services.common.weights import named_weights
from services.trainer import convert
from services.trainer.batch import ActorLoss
from services.trainer.engine import TrainerEngine, TrainerSettings
from services.trainer.testing import make_tiny_model, random_samples

REPO = Path(__file__).resolve().parents[2]
LOSS = ActorLoss(mini_batch_size=4, kl_coef=0.05, entropy_coef=0.01)


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


def check_against_single_process(tmp_path, *, dp_mode: str = "fsdp", dp: int = 1, tp: int = 1, pp: int = 1,
                                 schedule: str = "1f1b", budget: int = 16384, fused: bool = False):
    # fused: the mesh computes log-probs through the fused LM head, the single process through the plain one.
    model = make_tiny_model(tmp_path / "model", num_hidden_layers=4)
    actor = {"lr": 1e-4, "seed": 3}
    config = tmp_path / "trainer.yaml"
    config.write_text(f"model:\n  path: {model}\nactor:\n  lr: 1.0e-4\n  seed: 3\n  dp_size: {dp}\n  tp_size: {tp}\n"
                      f"  pp_size: {pp}\n  pipeline_schedule: {schedule}\n  num_microbatches: 2\n"
                      f"  dp_mode: {dp_mode}\n  micro_batch_token_budget: {budget}\n  fused_logprobs: {str(fused).lower()}\n")
    launched = Launched(config, tmp_path / "torchrun.log", nproc=dp * tp * pp)
    try:
        # The single-process run works while the two ranks start.
        single = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model}, "actor": actor}))
        first = _samples(1, single)
        expected_lp = single.compute_logprobs([s.prompt_ids for s in first], [s.response_ids for s in first])
        expected = single.train_actor(first, LOSS)
        expected_weights = {k: v.detach().clone() for k, v in named_weights(single.actor.module).items()}
        second = _samples(2, single)
        expected_next = single.train_actor(second, LOSS)

        port = launched.wait_ready()

        async def drive():
            async with create_channel(f"127.0.0.1:{port}") as channel:
                stub = trainer_pb2_grpc.TrainerStub(channel)
                info = await stub.GetInfo(common_pb2.GetInfoRequest())
                lp = await stub.ComputeLogProbs(_sequences(first))
                trained = await stub.TrainActor(convert.train_actor_to_pb(first, LOSS))
                await stub.SaveCheckpoint(trainer_pb2.CheckpointRequest(path=str(tmp_path / "ck")))
                await stub.ExportHF(trainer_pb2.CheckpointRequest(path=str(tmp_path / "hf")))
                trained_next = await stub.TrainActor(convert.train_actor_to_pb(second, LOSS))
                return info, lp, trained, trained_next

        info, lp, trained, trained_next = asyncio.run(drive())
    finally:
        launched.stop()

    world = dp * tp * pp
    assert (info.details["dp"], info.details["tp"], info.details["pp"], info.details["world_size"]) == (
        str(dp), str(tp), str(pp), str(world))
    assert info.details["devices"] == ",".join(["cpu"] * world) and info.details["dp_mode"] == dp_mode
    stages_per_rank = 2 if schedule == "interleaved_1f1b" and pp > 1 else 1
    assert info.details["pp_stages_per_rank"] == str(stages_per_rank)
    assert trained.metrics["pipeline_bubble_fraction"] == pytest.approx((pp - 1) / (stages_per_rank * 2 + pp - 1))
    log = (tmp_path / "torchrun.log").read_text()
    for rank in range(world):
        assert f"Rank {rank}: actor loaded on cpu (tp={tp} pp={pp} dp={dp})" in log

    for got, want in zip(lp.results, expected_lp):
        assert list(got.logprobs) == pytest.approx(want, abs=1e-6)
    for key in ("pg_loss", "kl_loss", "entropy", "grad_norm", "clip_frac"):
        assert trained.metrics[key] == pytest.approx(expected[key], abs=1e-5), key
    assert trained.step == 2

    from safetensors.torch import load_file

    exported = load_file(tmp_path / "hf" / "model.safetensors")
    diff = max((exported[k] - expected_weights[k]).abs().max().item() for k in expected_weights)
    assert diff < 1e-5

    # The 2-rank run continued after the checkpoint; a 1-rank trainer resumed from it takes the same step.
    assert trained_next.metrics["pg_loss"] == pytest.approx(expected_next["pg_loss"], abs=1e-5)
    resumed = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": model}, "actor": actor}))
    resumed.load_checkpoint(str(tmp_path / "ck"))
    again = resumed.train_actor(second, LOSS)
    assert again["pg_loss"] == pytest.approx(trained_next.metrics["pg_loss"], abs=1e-5)
    assert again["grad_norm"] == pytest.approx(trained_next.metrics["grad_norm"], rel=1e-5)
    assert resumed.actor.step == 4 and resumed.weight_version == 2
    for k, v in named_weights(resumed.actor.module).items():
        assert torch.allclose(v, named_weights(single.actor.module)[k], atol=1e-5), k


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(dp=2, budget=24), dict(dp=2, dp_mode="ddp", budget=24), dict(tp=2),
                                  dict(pp=2, schedule="1f1b"), dict(pp=2, schedule="interleaved_1f1b"),
                                  dict(dp=2, budget=24, fused=True), dict(dp=2, dp_mode="ddp", budget=24, fused=True)],
                         ids=["fsdp-dp2-accumulating", "ddp-dp2-accumulating", "tp2", "pp2-1f1b",
                              "pp2-interleaved-2-stages-per-rank", "fsdp-dp2-fused-head", "ddp-dp2-fused-head"])
def test_a_two_rank_step_matches_a_single_process_run(tmp_path, mesh):
    check_against_single_process(tmp_path, **mesh)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(dp=2, tp=2), dict(dp=2, pp=2, schedule="gpipe"), dict(pp=2, tp=2),
                                  dict(dp=2, pp=2, schedule="interleaved_1f1b")],
                         ids=["fsdp2-tp2", "fsdp2-pp2-gpipe", "pp2-tp2", "fsdp2-pp2-interleaved"])
def test_a_four_rank_2d_mesh_step_matches_a_single_process_run(tmp_path, mesh):
    check_against_single_process(tmp_path, **mesh)


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
    want = named_weights(single.actor.module)
    assert set(exported) == set(want)
    assert max((exported[k] - want[k]).abs().max().item() for k in want) < 1e-5
