"""One-GPU smoke run of the trainer engine (not collected by pytest): cuda device, NCCL one-rank group,
fp32 and bf16-autocast updates, parity with a CPU run, checkpoint and export. Prints JSON."""

import json
import sys
import tempfile
import time

import torch

from services.common.config import load_config
from services.trainer.config import TrainerSettings
from services.trainer.engine import TrainerEngine
from services.trainer.testing import make_tiny_model, random_samples
from services.trainer.types import ActorLoss

out = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
d = tempfile.mkdtemp()
path = make_tiny_model(f"{d}/m")
eng = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": path, "device": "cuda"},
                                                       "actor": {"lr": 1e-4}}))
samples = random_samples(16, seed=1)
prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
lp = eng.compute_logprobs(prompts, responses)
for s, l in zip(samples, lp):
    s.old_logprobs = l
t = time.perf_counter()
m = eng.train_actor(samples, ActorLoss(mini_batch_size=8))
out["train_s"] = time.perf_counter() - t
out["metrics"] = {k: m[k] for k in ("pg_loss", "grad_norm", "clip_frac")}
out["device"] = eng.info()["devices"]
st, v = eng.state_for_sync()
out["sync_device"] = str(next(iter(st.values())).device)
eng.save_checkpoint(f"{d}/ck")
eng.export_hf(f"{d}/hf")
# CPU parity of the same update (fp32): lives in the same process, so a one-rank group is reused.
import os
cpu = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": path}, "actor": {"lr": 1e-4}}))
cpu_lp = cpu.compute_logprobs(prompts, responses)
out["lp_cuda_vs_cpu"] = max(abs(a - b) for x, y in zip(lp, cpu_lp) for a, b in zip(x, y))
cm = cpu.train_actor(samples, ActorLoss(mini_batch_size=8))
out["pg_loss_cpu"] = cm["pg_loss"]
cs, _ = cpu.state_for_sync()
out["param_cuda_vs_cpu"] = max((st[k] - cs[k]).abs().max().item() for k in st)
bf = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": path, "device": "cuda"},
                                                      "actor": {"lr": 1e-4, "dtype": "bfloat16"}}))
bm = bf.train_actor(samples, ActorLoss(mini_batch_size=8))
out["bf16_autocast_pg_loss"] = bm["pg_loss"]
re = TrainerEngine(load_config(TrainerSettings, data={"model": {"path": path, "device": "cuda"}, "actor": {"lr": 1e-4}}))
re.load_checkpoint(f"{d}/ck")
rs, _ = re.state_for_sync()
out["ckpt_roundtrip_maxdiff"] = max((st[k] - rs[k]).abs().max().item() for k in st)
print(json.dumps(out, indent=1))
