"""#23's open MFU probes on one GPU: the trainer's engine step (bench/trainer_mfu.py's workload, fixed 8 x 2,048
tokens) beside the same step with one change that is not in the trainer, each measured in this run. Probes, not
trainer features: a change that wins becomes a trainer setting or default and is then measured by trainer_mfu.py.

  engine            TrainerEngine.train_actor as shipped (trainer_mfu.py's `engine`): the baseline
  bf16_residual     under autocast (fp32 master weights) the embedding's output cast to bf16, so the residual
                    stream (block inputs, residual adds, norm inputs) is bf16 as under FSDP2's mixed precision;
                    the trainer's stream is fp32 there
  fused_proj        Qwen2's q/k/v and gate/up projections each run as one matmul over the concatenated weights
                    (patched into transformers' Qwen2 classes for the run; parameters and names unchanged)
  bf16_only         actor.param_dtype bfloat16 (bf16 weights and AdamW state: no fp32 master weights)
  clip_in_adamw     the clip coefficient handed to fused AdamW as its `grad_scale` (the kernel divides each
                    gradient by it) instead of a foreach multiply over every gradient before the step
  combined          bf16_residual, fused_proj and clip_in_adamw together: what the three would give as one
  residual_clip     bf16_residual and clip_in_adamw together (the two that won alone on an H100, 2026-12-05)

Inductor's max-autotune is a probe too: run this script again with TORCHINDUCTOR_MAX_AUTOTUNE=1 in its own process
and inductor cache (`bench/gpu_session.sh mfuautotune` does both).

    PYTHONPATH=.:protos python bench/mfu_probes.py --size 1.5b --out /tmp/mfu_probes.json
    PYTHONPATH=.:protos python bench/mfu_probes.py --device cpu --size tiny --dtype bfloat16 --out /tmp/p.json  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import trainer_mfu as tm  # noqa: E402


def _to_autocast_dtype(module, args, out):
    kind = out.device.type
    if torch.is_autocast_enabled(kind) and out.is_floating_point():
        return out.to(torch.get_autocast_dtype(kind))
    return None


@contextlib.contextmanager
def bf16_residual():
    """Every engine built inside casts its embedding's output to the autocast dtype."""
    real = tm.build_engine

    def build(*args, **kwargs):
        engine = real(*args, **kwargs)
        engine.rank.actor.module.model.embed_tokens.register_forward_hook(_to_autocast_dtype)
        return engine

    tm.build_engine = build
    try:
        yield
    finally:
        tm.build_engine = real


@contextlib.contextmanager
def fused_projections():
    """Qwen2's attention and MLP with their input projections fused into one matmul each."""
    from transformers.models.qwen2 import modeling_qwen2 as q2

    def mlp(self, x):
        gate, up = F.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight])).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)

    def attn(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        shape = hidden_states.shape[:-1]
        qkv = F.linear(hidden_states, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]),
                       torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]))
        sizes = (self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features)
        q, k, v = (t.reshape(*shape, -1, self.head_dim).transpose(1, 2) for t in qkv.split(sizes, dim=-1))
        cos, sin = position_embeddings
        q, k = q2.apply_rotary_pos_emb(q, k, cos, sin)
        fn = q2.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, q2.eager_attention_forward)
        out, weights = fn(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                          sliding_window=self.sliding_window, **kwargs)
        return self.o_proj(out.reshape(*shape, -1).contiguous()), weights

    saved = q2.Qwen2MLP.forward, q2.Qwen2Attention.forward
    q2.Qwen2MLP.forward, q2.Qwen2Attention.forward = mlp, attn
    try:
        yield
    finally:
        q2.Qwen2MLP.forward, q2.Qwen2Attention.forward = saved


@contextlib.contextmanager
def clip_in_adamw():
    """The engine's last (deferred) optimizer step clips inside fused AdamW: the norm as before, then
    grad_scale = 1 / min(1, max_norm / (norm + 1e-6)) on the device; no multiply pass over the gradients."""
    from services.trainer.model import trained as tr
    from services.trainer.model.optim import clip_grad_norm

    real = tr._deferred_step

    def step(trained, layout):
        assert trained.loss_scale == 1.0 and trained.cfg.grad_clip > 0, "probe: bf16 with grad_clip > 0 only"
        # max_norm 0: the trainer's own norm (tied copy counted once, summed over stages), no multiply.
        norm = clip_grad_norm([p for p in trained.module.parameters() if p.requires_grad], 0.0,
                              pp_group=layout.pp_group, skip=layout.tied_copy, sync=False)
        coef = (trained.cfg.grad_clip / (norm + 1e-6)).clamp(max=1.0)
        opt = trained.optimizer
        lr = opt.param_groups[0]["lr"]
        opt.found_inf = (~torch.isfinite(norm)).float()
        opt.grad_scale = (1.0 / coef).float()
        try:
            opt.step()
        finally:
            del opt.found_inf, opt.grad_scale
        opt.zero_grad(set_to_none=True)
        return norm, lr, None

    tr._deferred_step = step
    try:
        yield
    finally:
        tr._deferred_step = real


PROBES = {  # name: (contexts entered together, actor overrides)
    "engine": ((), {}),
    "bf16_residual": ((bf16_residual,), {}),
    "fused_proj": ((fused_projections,), {}),
    "bf16_only": ((), {"param_dtype": "bfloat16"}),
    "clip_in_adamw": ((clip_in_adamw,), {}),
    "combined": ((bf16_residual, fused_projections, clip_in_adamw), {}),
    "residual_clip": ((bf16_residual, clip_in_adamw), {}),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="1.5b", choices=sorted(tm.SHAPES))
    parser.add_argument("--probes", default=",".join(PROBES))
    parser.add_argument("--profile", type=lambda v: v.split(","), default=["engine", "combined"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default=None, help="model.dtype (default bfloat16 on CUDA, float32 elsewhere)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.size == "tiny":
        args.seq = min(args.seq, 128)
    dev, shape = args.device, tm.SHAPES[args.size]
    dtype = args.dtype or ("bfloat16" if dev.startswith("cuda") else "float32")
    out = {"benchmark": "mfu_probes", "size": args.size, "batch": args.batch, "seq": args.seq,
           "device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu", "torch": torch.__version__,
           "max_autotune": os.environ.get("TORCHINDUCTOR_MAX_AUTOTUNE", "0") == "1", "probes": {}}
    out_path = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / args.size
        num_params = tm.save_model(shape, path, dev)
        flops = tm.model_flops_per_step(shape, num_params, args.batch, args.seq)
        samples = tm.make_samples(args.batch, args.seq, shape["vocab_size"])
        for name in args.probes.split(","):
            contexts, overrides = PROBES[name]
            t0 = time.perf_counter()
            try:
                with contextlib.ExitStack() as stack:
                    for context in contexts:
                        stack.enter_context(context())
                    r = tm.run_engine(str(path), samples, dev, args.warmup, args.steps, amp=False,
                                      overrides=overrides, dtype=dtype, budget=args.batch * args.seq, parity=False,
                                      profile=name in args.profile,
                                      trace=str(Path(tmp) / f"trace_{name}.json") if name in args.profile else None)
                t = statistics.median(r["times"])
                r.update(step_seconds=round(t, 4), tokens_per_s=round(args.batch * args.seq / t, 1),
                         mfu=round(flops / t / tm.PEAK_BF16, 4), times=[round(x, 4) for x in r["times"]])
                if dev.startswith("cuda"):
                    r["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
            except Exception as e:  # noqa: BLE001 - one probe's failure must not lose the others
                traceback.print_exc()
                r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            r["wall_seconds_incl_load"] = round(time.perf_counter() - t0, 1)
            base = out["probes"].get("engine", {}).get("step_seconds")
            if base and "step_seconds" in r:
                r["speedup_vs_engine"] = round(base / r["step_seconds"], 4)
            out["probes"][name] = r
            print(name, json.dumps({k: v for k, v in r.items() if k not in ("times", "profile")}), flush=True)
            tm.free(dev)
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
