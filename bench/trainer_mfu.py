"""Tokens/s and MFU of the trainer's TrainActor path on one GPU, beside a plain transformers + AdamW loop.

Models: Qwen2.5-0.5B- and 1.5B-shaped Qwen2 configs with random weights (saved with save_pretrained
and loaded by the trainer as any model folder). Batch: 8 sequences of 2048 tokens (1 prompt token +
2047 response tokens, so the trainer's loss covers the same positions as the plain loop's LM loss),
one optimizer step per call (mini_batch_size 0, ppo_epochs 1). Variants, all measured in one run:

  plain              AutoModelForCausalLM in bf16, model(ids, labels=ids).loss, backward,
                     clip_grad_norm_, torch.optim.AdamW (default foreach), zero_grad
  engine             TrainerEngine.train_actor as shipped (model.dtype bf16: bf16 params and AdamW state)
  engine_amp         as shipped with fp32 master weights (actor.param_dtype float32, actor.dtype bfloat16)
  engine_tuned       TrainerEngine.train_actor with three changes patched in from here (what the trainer
                     would need, see `tuned_trainer`): the LM head and log-prob/entropy fused (no fp32
                     [tokens, vocab] tensors: bf16 logits + two Triton row kernels), AdamW(fused=True),
                     a foreach grad-norm with one host sync instead of one per parameter
  engine_tuned_amp   the same with fp32 master weights
  *_compile          the same plus torch.compile of each decoder block (regional compilation)

MFU = model FLOPs / step time / peak, model FLOPs = 6 * N * tokens + 12 * layers * hidden * seq * tokens
(torchtitan's count: N = parameters with the tied embedding once, attention not halved for the causal
mask); peak = 989 TFLOP/s, the H200 SXM datasheet's dense bf16 rate. The run also measures an
8192^3 bf16 matmul and reports MFU against that ceiling too.

    PYTHONPATH=.:protos python bench/trainer_mfu.py [--sizes 0.5b,1.5b] [--out bench/results/trainer_mfu.json]
    PYTHONPATH=.:protos python bench/trainer_mfu.py --device cpu --tiny      # smoke test of the script
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import services.trainer.engine as trainer_engine  # noqa: E402
from services.common.config import load_config  # noqa: E402
from services.common.modeling import pad_batch, response_logprobs  # noqa: E402
from services.trainer.batch import ActorLoss, TrainSample, validate_actor_batch  # noqa: E402

PEAK_BF16 = 989e12
SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1000, tie_word_embeddings=True),
}

# --------------------------------------------------------------------------------------------------
# The fused LM head + log-prob + entropy (the change proposed for services/common/modeling.py)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the eager fallback below
    triton = None

if triton is not None:
    @triton.jit
    def _head_fwd_kernel(logits_ptr, target_ptr, logp_ptr, ent_ptr, lse_ptr, stride, V, temperature,
                         BLOCK: tl.constexpr):
        """One row: log-softmax of logits / T at the target and the entropy, in one pass (online softmax)."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        w = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            z = tl.load(base + idx, mask=idx < V, other=-float("inf")).to(tl.float32) / temperature
            m_new = tl.maximum(m, z)
            live = m_new > -float("inf")
            alpha = tl.where(live, tl.exp(m - m_new), 0.0)
            e = tl.where(live, tl.exp(z - m_new), 0.0)
            s = s * alpha + e
            w = w * alpha + tl.where(e > 0, e * z, 0.0)
            m = m_new
        big = tl.max(m, 0)
        scale = tl.where(m > -float("inf"), tl.exp(m - big), 0.0)
        total = tl.sum(s * scale, 0)
        lse = big + tl.log(total)
        t = tl.load(target_ptr + row)
        zt = tl.load(base + t).to(tl.float32) / temperature
        tl.store(logp_ptr + row, zt - lse)
        tl.store(ent_ptr + row, lse - tl.sum(w * scale, 0) / total)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _head_bwd_kernel(logits_ptr, target_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, stride, V, temperature,
                         BLOCK: tl.constexpr):
        """d(g_logp * logp + g_ent * H)/d logits, written over the logits (bf16) in place."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        lse = tl.load(lse_ptr + row)
        h = tl.load(ent_ptr + row)
        gl = tl.load(glogp_ptr + row)
        ge = tl.load(gent_ptr + row)
        t = tl.load(target_ptr + row)
        for start in range(0, V, BLOCK):
            idx = start + offs
            mask = idx < V
            u = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32) / temperature
            logp = u - lse
            p = tl.exp(logp)
            du = -gl * p - ge * p * (logp + h) + tl.where(idx == t, gl, 0.0)
            tl.store(base + idx, (du / temperature).to(logits_ptr.dtype.element_ty), mask=mask)


def _rows_fwd(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """(logp, entropy, lse) [N] of each row of bf16 logits [N, V] at temperature."""
    N, V = logits.shape
    if triton is not None and logits.is_cuda:
        out = torch.empty((3, N), dtype=torch.float32, device=logits.device)
        _head_fwd_kernel[(N,)](logits, targets, out[0], out[1], out[2], logits.stride(0), V, float(temperature),
                               BLOCK=4096, num_warps=8)
        return out[0], out[1], out[2]
    logp, ent, lse = [], [], []
    for z, t in zip(logits.split(1024), targets.split(1024)):
        z = z.float() / temperature
        c = torch.logsumexp(z, -1)
        p = torch.exp(z - c.unsqueeze(-1))
        logp.append(z.gather(1, t.unsqueeze(-1)).squeeze(-1) - c)
        ent.append(c - (p * z).sum(-1))
        lse.append(c)
    return torch.cat(logp), torch.cat(ent), torch.cat(lse)


def _rows_bwd_(logits, targets, lse, ent, g_logp, g_ent, temperature: float) -> torch.Tensor:
    """Overwrites logits [N, V] with the gradient of sum(g_logp * logp + g_ent * entropy)."""
    N, V = logits.shape
    if triton is not None and logits.is_cuda:
        _head_bwd_kernel[(N,)](logits, targets, lse, ent, g_logp.contiguous(), g_ent.contiguous(), logits.stride(0),
                               V, float(temperature), BLOCK=4096, num_warps=8)
        return logits
    for rows in torch.arange(N, device=logits.device).split(1024):
        u = logits[rows].float() / temperature
        logp = u - lse[rows].unsqueeze(-1)
        p = logp.exp()
        du = -g_logp[rows].unsqueeze(-1) * p - g_ent[rows].unsqueeze(-1) * p * (logp + ent[rows].unsqueeze(-1))
        du.scatter_add_(1, targets[rows].unsqueeze(-1), g_logp[rows].unsqueeze(-1))
        logits[rows] = (du / temperature).to(logits.dtype)
    return logits


class _HeadLogprobs(torch.autograd.Function):
    """logp and entropy of hidden [N, d] @ weight [V, d]^T: keeps only the bf16 logits for backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature):
        logits = hidden @ weight.t()                                           # [N, V], compute dtype
        logp, ent, lse = _rows_fwd(logits, targets, temperature)
        ctx.save_for_backward(hidden, weight, targets, logits, lse, ent)
        ctx.temperature = temperature
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, logits, lse, ent = ctx.saved_tensors
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float()
        dlogits = _rows_bwd_(logits, targets, lse, ent, g_logp, g_ent, ctx.temperature)
        return dlogits @ weight, dlogits.t() @ hidden, None, None


def fused_response_logprobs(model, prompts, responses, *, pad_id: int, temperature: float = 1.0,
                            with_entropy: bool = False):
    """services.common.modeling.response_logprobs with the same outputs, without [B, R, V] fp32 tensors.

    The backbone's hidden states are taken at the response positions first, then the LM head and the
    log-softmax run fused (logits stay in the compute dtype, as the model's own lm_head produces
    them; the softmax math is fp32 inside the kernels).
    """
    device = next(model.parameters()).device
    input_ids, attention_mask, positions, mask, targets = pad_batch(prompts, responses, pad_id=pad_id, device=device)
    hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    B, R = positions.shape
    h = torch.gather(hidden, 1, positions.unsqueeze(-1).expand(-1, -1, hidden.size(-1)))          # [B, R, d]
    head = model.lm_head
    assert getattr(head, "bias", None) is None
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else head.weight.dtype
    logp, ent = _HeadLogprobs.apply(h.reshape(B * R, -1).to(dtype), head.weight.to(dtype), targets.reshape(-1),
                                    float(temperature or 1.0))
    logp = logp.view(B, R) * mask
    if not with_entropy:
        return logp, mask
    return logp, mask, ent.view(B, R) * mask


@torch.no_grad()
def foreach_clip_grad_norm(params, max_norm: float, *, pp_group=None, skip=None) -> float:
    """trainer_engine.clip_grad_norm for one rank without DTensors: one foreach norm, one host sync."""
    assert pp_group is None or torch.distributed.get_world_size(pp_group) == 1
    grads = [p.grad for p in params if p.grad is not None and p is not skip]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, norm, foreach=True)
    return float(norm)


@contextlib.contextmanager
def tuned_trainer():
    """Patches the trainer module's log-prob function and grad clipping (restored on exit)."""
    saved = trainer_engine.response_logprobs, trainer_engine.clip_grad_norm
    trainer_engine.response_logprobs = fused_response_logprobs
    trainer_engine.clip_grad_norm = foreach_clip_grad_norm
    try:
        yield
    finally:
        trainer_engine.response_logprobs, trainer_engine.clip_grad_norm = saved


def use_fused_adamw(engine) -> None:
    a = engine.actor
    fused = a.module.parameters().__next__().is_cuda
    opt = torch.optim.AdamW(a.module.parameters(), lr=a.cfg.lr, betas=tuple(a.cfg.betas), eps=a.cfg.eps,
                            weight_decay=a.cfg.weight_decay, fused=fused or None)
    a.optimizer = opt
    a.scheduler = torch.optim.lr_scheduler.LambdaLR(opt, trainer_engine.lr_lambda(a.cfg))


def compile_blocks(module) -> None:
    from services.trainer.parallelize import transformer_blocks

    for block in transformer_blocks(module):
        block.compile()


# --------------------------------------------------------------------------------------------------
# Measurement


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def model_flops_per_step(cfg: dict, num_params: int, batch: int, seq: int) -> float:
    tokens = batch * seq
    return 6 * num_params * tokens + 12 * cfg["num_hidden_layers"] * cfg["hidden_size"] * seq * tokens


def save_model(shape: dict, path: Path, dev: str) -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**shape, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    n = model.num_parameters()
    del model
    return n


def make_samples(batch: int, seq: int, vocab: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(batch):
        ids = torch.randint(3, vocab, (seq,), generator=g).tolist()
        r = seq - 1
        out.append(TrainSample(prompt_ids=ids[:1], response_ids=ids[1:], advantages=torch.randn(r, generator=g).tolist(),
                               old_logprobs=[-math.log(vocab)] * r))
    return out


def time_steps(step, warmup: int, steps: int, dev: str) -> list[float]:
    for _ in range(warmup):
        step()
    sync(dev)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return times


def run_plain(path: str, samples, dev: str, warmup: int, steps: int, dtype) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.tensor([s.prompt_ids + s.response_ids for s in samples], device=dev)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = time_steps(step, warmup, steps, dev)
    del model, opt
    return {"times": times}


def build_engine(path: str, dev: str, *, amp: bool, dtype: str, budget: int):
    from services.trainer.engine import TrainerEngine, TrainerSettings

    actor = {"lr": 1e-6, "micro_batch_token_budget": budget}
    if amp:
        actor.update(param_dtype="float32", dtype="bfloat16")
    return TrainerEngine(load_config(TrainerSettings, data={"model": {"path": path, "dtype": dtype, "device": dev},
                                                            "actor": actor}))


def run_engine(path: str, samples, dev: str, warmup: int, steps: int, *, amp: bool, tuned: bool, compile: bool,
               dtype: str, budget: int, parity: bool, profile: bool = False) -> dict:
    ctx = tuned_trainer() if tuned else contextlib.nullcontext()
    with ctx:
        engine = build_engine(path, dev, amp=amp, dtype=dtype, budget=budget)
        if tuned:
            use_fused_adamw(engine)
        if compile:
            compile_blocks(engine.actor.module)
        extra = {}
        if parity:
            extra["fused_head_parity"] = head_parity(engine, samples, dev)
        loss = ActorLoss()
        metrics = []

        def step():
            metrics.append(engine.train_actor(samples, loss))

        times = time_steps(step, warmup, steps, dev)
        if profile:
            extra["profile"] = profile_step(step, dev)
        engine.close()
    internal = [m["seconds"] for m in metrics[-steps:]]
    del engine
    return {"times": times, "engine_reported_seconds": internal, "last_metrics": {
        k: metrics[-1][k] for k in ("loss", "grad_norm", "entropy", "num_optimizer_steps")}, **extra}


KERNEL_KINDS = (("lm_head_logprob_triton", ("_head_fwd", "_head_bwd")), ("flash_attention", ("flash", "fmha", "attention")),
                ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90")),
                ("optimizer", ("adam", "multi_tensor")), ("compiled_elementwise", ("triton_",)),
                ("embedding", ("embedding",)), ("reduce_norm", ("reduce", "norm")))


def profile_step(step, dev: str) -> dict:
    """Device time of one step by kernel kind (torch.profiler), against its wall time."""
    from torch.profiler import ProfilerActivity, profile

    sync(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        sync(dev)
        wall = time.perf_counter() - t0
    kinds: dict[str, float] = {}
    top = []
    for item in prof.key_averages():
        us = getattr(item, "self_device_time_total", 0) or 0
        if us <= 0 or getattr(item, "device_type", None) is None or "CUDA" not in str(item.device_type):
            continue
        name = item.key.lower()
        kind = next((k for k, pats in KERNEL_KINDS if any(p in name for p in pats)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e3
        top.append((us / 1e3, item.count, item.key[:90]))
    top.sort(reverse=True)
    busy = sum(kinds.values())
    return {"wall_ms": round(wall * 1e3, 1), "gpu_busy_ms": round(busy, 1),
            "by_kind_ms": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"ms": round(ms, 2), "calls": n, "name": k} for ms, n, k in top[:25]]}


def head_parity(engine, samples, dev: str) -> dict:
    """fused_response_logprobs vs response_logprobs on 2 x 512 tokens: values and gradients."""
    model = engine.actor.module
    n = min(511, len(samples[0].response_ids))
    ps = [s.prompt_ids for s in samples[:2]]
    rs = [s.response_ids[:n] for s in samples[:2]]
    adv = torch.randn(2, n, generator=torch.Generator().manual_seed(3)).to(dev)
    watch = {"lm_head": model.lm_head.weight, "layer0_down_proj": model.model.layers[0].mlp.down_proj.weight}
    out = {}
    for name, fn in (("reference", response_logprobs), ("fused", fused_response_logprobs)):
        model.zero_grad(set_to_none=True)
        with engine._amp():
            logp, mask, ent = fn(model, ps, rs, pad_id=engine.pad_id, temperature=1.0, with_entropy=True)
        ((logp * adv).sum() + 0.1 * ent.sum()).backward()
        out[name] = (logp.detach().float(), ent.detach().float(), {k: w.grad.detach().float().clone()
                                                                   for k, w in watch.items()})
    model.zero_grad(set_to_none=True)
    (lr, er, gr), (lf, ef, gf) = out["reference"], out["fused"]
    res = {"logp_max_abs_diff": float((lr - lf).abs().max()), "entropy_max_abs_diff": float((er - ef).abs().max())}
    for k in gr:
        res[f"grad_rel_diff_{k}"] = float((gr[k] - gf[k]).norm() / gr[k].norm().clamp(min=1e-30))
    return res


def matmul_ceiling(dev: str) -> float | None:
    if not dev.startswith("cuda"):
        return None
    n = 8192
    a, b = torch.randn(n, n, device=dev, dtype=torch.bfloat16), torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * 20 / (start.elapsed_time(end) / 1e3)


def free(dev: str) -> None:
    gc.collect()
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


VARIANTS = {
    # name: (kind, amp, tuned, compile)
    "plain": ("plain", False, False, False),
    "engine": ("engine", False, False, False),
    "engine_amp": ("engine", True, False, False),
    "engine_tuned": ("engine", False, True, False),
    "engine_tuned_amp": ("engine", True, True, False),
    "engine_tuned_compile": ("engine", False, True, True),
    "engine_tuned_amp_compile": ("engine", True, True, True),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model, short sequences (CPU smoke test)")
    parser.add_argument("--sizes", default="0.5b,1.5b")
    parser.add_argument("--variants", default="plain,engine,engine_amp,engine_tuned,engine_tuned_amp")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget", type=int, default=16384, help="actor.micro_batch_token_budget")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "trainer_mfu.json"))
    parser.add_argument("--merge", action="store_true", help="add to the variants already in --out")
    parser.add_argument("--profile", type=lambda v: v.split(","), default=[],
                        help="variants to profile one extra step of (device time by kernel kind)")
    args = parser.parse_args(argv)
    dev = args.device
    sizes = ["tiny"] if args.tiny else args.sizes.split(",")
    variants = args.variants.split(",")
    dtype_name = "bfloat16" if dev.startswith("cuda") else "float32"
    dtype = getattr(torch, dtype_name)
    ceiling = matmul_ceiling(dev)
    print(f"bf16 8192^3 matmul: {ceiling / 1e12:.0f} TFLOP/s" if ceiling else "no GPU ceiling", flush=True)
    out_path = Path(args.out)
    previous = json.loads(out_path.read_text()) if args.merge and out_path.exists() else {}
    results = {e["size"]: e for e in previous.get("results", [])}
    out = {"benchmark": "trainer_mfu", "device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
           "peak_flops_bf16": PEAK_BF16, "measured_bf16_matmul_flops": ceiling,
           "flops_formula": "6*N*tokens + 12*layers*hidden*seq*tokens (N with the tied embedding once)",
           "torch": torch.__version__, "transformers": __import__("transformers").__version__,
           "triton": getattr(triton, "__version__", None), "python": platform.python_version(),
           "sequences": "1 prompt token + (seq-1) response tokens; one optimizer step per call",
           "results": []}

    def write() -> None:
        for e in results.values():
            plain = e["variants"].get("plain", {}).get("tokens_per_s")
            for r in e["variants"].values():
                if plain and "tokens_per_s" in r:
                    r["vs_plain"] = round(r["tokens_per_s"] / plain, 3)
        out["results"] = list(results.values())
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(out, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            shape = SHAPES[size]
            path = Path(tmp) / size
            num_params = save_model(shape, path, dev)
            free(dev)
            samples = make_samples(args.batch, args.seq, shape["vocab_size"])
            t0 = time.perf_counter()
            validate_actor_batch(samples, ActorLoss(), vocab_size=shape["vocab_size"], max_len=4096)
            validate_s = time.perf_counter() - t0
            flops = model_flops_per_step(shape, num_params, args.batch, args.seq)
            entry = results.setdefault(size, {"size": size, "variants": {}})
            entry.update({"size": size, "shape": shape, "num_parameters": num_params, "batch": args.batch,
                          "seq": args.seq, "tokens_per_step": args.batch * args.seq, "model_flops_per_step": flops,
                          "validate_actor_batch_seconds": round(validate_s, 4), "variants": entry["variants"]})
            for name in variants:
                kind, amp, tuned, comp = VARIANTS[name]
                t_variant = time.perf_counter()
                try:
                    if kind == "plain":
                        r = run_plain(str(path), samples, dev, args.warmup, args.steps, dtype)
                    else:
                        r = run_engine(str(path), samples, dev, args.warmup, args.steps, amp=amp, tuned=tuned,
                                       compile=comp, dtype=dtype_name, budget=args.budget,
                                       parity=(name == "engine_tuned"), profile=name in args.profile)
                except Exception as e:  # noqa: BLE001 - an OOM in one variant must not lose the others
                    traceback.print_exc()
                    r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                if "times" in r:
                    t = statistics.median(r["times"])
                    r.update(step_seconds=round(t, 4), tokens_per_s=round(args.batch * args.seq / t, 1),
                             tflops=round(flops / t / 1e12, 1), mfu=round(flops / t / PEAK_BF16, 4),
                             times=[round(x, 4) for x in r["times"]])
                    if ceiling:
                        r["mfu_vs_measured_matmul"] = round(flops / t / ceiling, 4)
                    if dev.startswith("cuda"):
                        r["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
                r["wall_seconds_incl_load"] = round(time.perf_counter() - t_variant, 1)
                entry["variants"][name] = r
                print(size, name, json.dumps({k: v for k, v in r.items() if k != "times"}), flush=True)
                free(dev)
                write()
            shutil_rm(path)

    write()
    print("\nsize  variant                   tok/s      MFU   vs plain")
    for e in results.values():
        for name, r in e["variants"].items():
            if "tokens_per_s" in r:
                print(f"{e['size']:5s} {name:24s} {r['tokens_per_s']:9.0f}  {r['mfu']:6.3f}  {r.get('vs_plain', 0):.3f}")
            else:
                print(f"{e['size']:5s} {name:24s} {r.get('error')}")
    print(f"wrote {args.out}")


def shutil_rm(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
