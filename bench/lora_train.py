"""LoRA vs full fine-tuning through the trainer itself (TrainerEngine.train_actor: its compile, fused head, packing,
activation checkpointing, master weights and AdamW): seconds per actor step and peak device memory, in one call.

    python bench/lora_train.py --shape qwen2.5-1.5b --rank 16              # GPU: bench/results/lora_train_gpu.json
    python bench/lora_train.py --shape tiny --batch 2 --prompt 8 --response 24 --steps 3   # CPU smoke

Each variant runs in its own process (a clean peak): `full` (fp32 master weights, bf16 compute), `lora` (the frozen
bf16 base, fp32 adapters, the trainer's lean adapter forward: services/trainer/model/lora.py lean_forward, one
meshrl::lora_linear op a layer, q/k/v and gate/up through one meshrl::lora_group op each), `lora_ungrouped` (that
forward with every layer on its own op: before lora_group), `lora_addmm` (the lean forward before lora_linear:
nn.Linear + addmm with the base output as C, autograd's backward) and `lora_peft` (peft's own LoraLayer.forward).
`lora_merged` is several runs' updates in one pass (services/trainer/updates/merged.py, as the trainer runs
concurrent runs' TrainActor calls): `--adapters` adapters, `batch / adapters` rows each, every row under its own
adapter (model/lora_mixed.py: a group's adapters through one meshrl::lora_group op with their mask);
`lora_ops` is `lora` with the torch.library ops where the eager trainer now runs their autograd.Functions
(lora_linear.eager: before 27f87ca). `lora_merged_autograd` is that pass before the mask op (commit 95975e8: each
layer its own autograd ops), `lora_merged_switching` the pass as it stepped before this bench's --host-profile found
its cost (each adapter made the active one through peft's set_adapter for its optimizer step, whose clip walked the
module's trainable parameters and waited for the GPU; every adapter made trainable again after). Beside
`lora` (one adapter, the same `batch` rows) they say what serving several runs in one pass costs.
One step = one TrainActor call of `batch` sequences (prompt + response tokens each) in one optimizer step (merged:
one train_actors command, an optimizer step per adapter); the median of the steps after `--warmup` (compiles happen
there). Peak = torch.cuda.max_memory_allocated over the steps, weights
and optimizer state included.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "protos"), str(REPO / "bench")]

VARIANTS = ("full", "lora", "lora_ops", "lora_ungrouped", "lora_addmm", "lora_peft", "lora_merged",
            "lora_merged_autograd", "lora_merged_switching")
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=64, max_position_embeddings=256, tie_word_embeddings=True)


# Qwen2.5-1.5B's 28 layers at the tiny width: a step's compute is next to nothing, so its time on a CPU is about the
# host's own work per layer and micro-batch (dispatch, autograd, the adapters' ops), which a GPU step waits on.
SHAPES = {"tiny": TINY, "tiny-deep": dict(TINY, num_hidden_layers=28)}


def model_folder(shape: str, root: Path, device: str) -> Path:
    from peers.settings import QWEN25, make_random_model

    out = root / shape
    if not (out / "config.json").is_file():
        make_random_model(out, dtype="bfloat16", shape=SHAPES.get(shape) or QWEN25[shape],
                          init_in_dtype=True, device=device)
    return out


def addmm_lean_forward(layer, group=None):
    """The trainer's lean adapter forward before meshrl::lora_linear (commit f66f66d): base(x), A, then one addmm
    with the base output as C; autograd's backward."""
    import torch

    base = layer.base_layer

    def forward(x, *args, **kwargs):
        result = base(x, *args, **kwargs)
        if layer.disable_adapters:
            return result
        name = layer.active_adapters[0]
        lora_a, lora_b, scaling = layer.lora_A[name], layer.lora_B[name], float(layer.scaling[name])
        h = x if torch.is_autocast_enabled(x.device.type) else x.to(lora_a.weight.dtype)
        z = lora_a(h)
        out = torch.addmm(result.reshape(-1, result.shape[-1]), z.reshape(-1, z.shape[-1]).to(result.dtype),
                          lora_b.weight.to(result.dtype).t(), alpha=scaling)
        return out.view(result.shape)
    return forward


def one(args) -> dict:
    """One variant in this process: build the trainer, time `steps` TrainActor calls."""
    import torch

    from services.common.config import load_config
    from services.trainer.config import TrainerSettings
    from services.trainer.engine import TrainerEngine
    from services.trainer.types import ActorLoss, TrainSample

    # "lora@selective:4096": that variant with its own activation_checkpointing and micro_batch_token_budget;
    # "lora@full/2": checkpointing every 2nd block (actor.activation_checkpointing_every)
    name, _, rest = args.variant.partition("@")
    checkpointing, _, budget = rest.partition(":")
    checkpointing, _, every = checkpointing.partition("/")
    if name == "lora_peft":
        from services.trainer.model import lora

        lora.lean_forward = lambda layer, group=None: type(layer).forward.__get__(layer)     # peft's own forward
    if name == "lora_addmm":
        from services.trainer.model import lora

        lora.lean_forward = addmm_lean_forward
    if name == "lora_ungrouped":
        from services.trainer.model import lora

        lora.sibling_groups = lambda model, layers: {}
    if name == "lora_ops":
        from services.trainer.model import lora_linear

        lora_linear.eager = lambda: False
    if name == "lora_merged_autograd":
        from services.trainer.model import lora_mixed

        lora_mixed.mixed_linear = autograd_mixed_linear
        lora_mixed.mixed_group = lambda layers, x, mixed: [autograd_mixed_linear(m, x, mixed) for m in layers]
    cuda = args.device.startswith("cuda")
    actor = {"lr": 1e-5, "activation_checkpointing": checkpointing or args.checkpointing,
             "micro_batch_token_budget": int(budget or args.micro_batch_tokens
                                             or args.batch * (args.prompt + args.response)),
             "activation_checkpointing_every": int(every or 1), "compile": args.compile}
    if name != "full":
        actor["lora"] = {"rank": args.rank, "alpha": 2 * args.rank}
    settings = load_config(TrainerSettings, data={"model": {"path": args.model, "dtype": "bfloat16",
                                                             "device": args.device}, "actor": actor})
    e = TrainerEngine(settings)
    module = e.rank.actor.module
    g = torch.Generator().manual_seed(0)
    vocab = e.rank.vocab_size
    samples = [TrainSample(prompt_ids=torch.randint(3, vocab, (args.prompt,), generator=g).tolist(),
                           response_ids=torch.randint(3, vocab, (args.response,), generator=g).tolist(),
                           advantages=torch.randn(args.response, generator=g).tolist(),
                           old_logprobs=[0.0] * args.response, ref_logprobs=[]) for _ in range(args.batch)]
    for s, lp in zip(samples, e.compute_logprobs([s.prompt_ids for s in samples], [s.response_ids for s in samples])):
        s.old_logprobs = lp
    if cuda:
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    step = (merged_step(e, samples, args.adapters, name == "lora_merged_switching") if name.startswith("lora_merged")
            else lambda: e.train_actor(samples, ActorLoss(mini_batch_size=args.batch)))
    times = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        out = step()                                                        # returns host floats: synced
        if isinstance(out, list) and any(isinstance(o, BaseException) for o in out):
            raise next(o for o in out if isinstance(o, BaseException))
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    profile = kernel_table(step) if cuda and args.profile else None
    host = host_table(step, cuda) if args.host_profile else None
    tokens = args.batch * (args.prompt + args.response)
    step_s = statistics.median(times[args.warmup:])
    return {"variant": args.variant, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "steps_s": times, "tokens": tokens,
            "params": sum(p.numel() for n, p in module.named_parameters() if ".lora_" not in n),
            "trainable_params": sum(p.numel() for p in module.parameters() if p.requires_grad),
            "resident_bytes": resident if cuda else None,
            "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "activation_checkpointing": actor["activation_checkpointing"],
            "micro_batch_token_budget": actor["micro_batch_token_budget"], "kernels_top": profile,
            "host_top": host,
            "compiled": e.rank.compiled, "fused_logprobs": e.rank.fused_logprobs, "packed": e.rank.layout.packed,
            "param_dtype": e.rank.param_dtype, "compute_dtype": e.rank.compute_dtype}


def autograd_mixed_linear(layer, x, mixed):
    """The merged pass's adapted linear before meshrl::lora_group took a mask (commit 95975e8): every layer its own
    casts, GEMMs, mask and sum, autograd's backward."""
    import torch
    import torch.nn.functional as F

    base = layer.base_layer
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    a = torch.cat([layer.lora_A[n].weight for n in mixed.names]).to(dtype)
    b = torch.cat([layer.lora_B[n].weight for n in mixed.names], dim=1).to(dtype)
    ranks = tuple(layer.lora_A[n].weight.shape[0] for n in mixed.names)
    scalings = tuple(float(layer.scaling[n]) for n in mixed.names)
    z = torch.mm(x2, a.t()) * mixed.mask(ranks, scalings, dtype)
    y = F.linear(x2, base.weight.to(dtype), None if base.bias is None else base.bias.to(dtype))
    return torch.addmm(y, z, b.t()).view(*x.shape[:-1], -1)


def merged_step(e, samples, adapters: int, switching: bool = False):
    """The step function of the merged variants: `adapters` adapters (the run's and named ones), the rows split among
    them, one train_actors command."""
    from services.trainer.types import ActorLoss
    from services.trainer.updates import merged

    names = [""] + [f"run{i}" for i in range(1, adapters)]
    for name in names[1:]:
        e.create_adapter(name)
    if why := merged.unmergeable(e.rank, names):              # else train_actors would run each update alone
        raise SystemExit(f"lora_merged: the adapters cannot share one pass: {why}")
    if switching:
        switching_steps(e, names)
    size = -(-len(samples) // adapters)
    calls = [(samples[i * size:(i + 1) * size], ActorLoss(mini_batch_size=size), name) for i, name in enumerate(names)]
    return lambda: e.commands.run("train_actors", calls)


def switching_steps(e, names: list[str]) -> None:
    """The merged pass's adapter handling as it ran before (lora_merged_switching): every adapter made trainable by a
    walk of the module's parameters; each adapter the active one (peft's set_adapter on every layer) for a synced
    optimizer step whose clip reads the module's trainable parameters; every adapter trainable again after the last
    one's step; the run's adapter the active one at the end."""
    from contextlib import contextmanager

    from services.trainer.model import adapter_set, trained as trained_mod
    from services.trainer.model.optim import clip_grad_norm
    from services.trainer.updates import merged

    module = e.rank.actor.module
    marks = tuple(f".lora_{ab}.{adapter_set.adapter_name(n)}." for n in names for ab in "AB")

    def trainable():
        for n, p in module.named_parameters():
            if any(m in n for m in marks):
                p.requires_grad_(True)

    @contextmanager
    def together(rank, names):
        try:
            trainable()
            yield [rank.actor if not n else adapter_set.get(rank, n).trained for n in names]
        finally:
            adapter_set._activate(module, adapter_set.ADAPTER)

    def clip(trained, layout, *, sync=True):
        params = [p for p in trained.module.parameters() if p.requires_grad]
        return clip_grad_norm(params, trained.cfg.grad_clip, pp_group=layout.pp_group, skip=layout.tied_copy,
                              grad_scale=trained.loss_scale, sync=sync)

    def step(trained, layout, *, defer=False):
        name = "" if trained is e.rank.actor else trained.name
        adapter_set._activate(module, adapter_set.adapter_name(name))
        out = trained_mod._step(trained, layout)
        if name == names[-1]:
            trainable()
        return out
    adapter_set.together = together
    trained_mod._clip = clip
    merged.optimizer_step = step


def kernel_table(step, top: int = 25) -> dict:
    """One more step under torch.profiler: its wall ms beside the GPU's busy ms and launches (a step whose wall is
    well over its kernels' time waits on the host's launches, not the GPU), and the kernels that took the most
    time, [name, ms, calls]."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    rows = sorted((r for r in prof.key_averages() if r.device_time_total > 0), key=lambda r: r.device_time_total,
                  reverse=True)
    return {"wall_ms": round(1e3 * wall, 1), "kernel_ms": round(sum(r.device_time_total for r in rows) / 1e3, 1),
            "launches": sum(r.count for r in rows),
            "top": [[r.key[:90], round(r.device_time_total / 1e3, 2), r.count] for r in rows[:top]]}


def host_table(step, cuda: bool, top: int = 40) -> dict:
    """One more step under cProfile: the Python functions whose own and callees' time (cumulative) was the most,
    [function, cumulative ms, own ms, calls]. cProfile's hooks slow Python-heavy code more than kernel launches, so
    read it as where the host's time goes, not as a step time."""
    import cProfile
    import pstats

    import torch

    prof = cProfile.Profile()
    prof.enable()
    step()
    if cuda:
        torch.cuda.synchronize()
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][3], reverse=True)
    return {"total_ms": round(1e3 * st.total_tt, 1),
            "top": [[f"{Path(f).name}:{line}:{fn}", round(1e3 * ct, 1), round(1e3 * tt, 1), nc]
                    for (f, line, fn), (cc, nc, tt, ct, _) in rows[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=1536)
    ap.add_argument("--adapters", type=int, default=4, help="adapters of the lora_merged variants")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--checkpointing", default="full", choices=["none", "full", "selective"])
    ap.add_argument("--micro-batch-tokens", type=int, default=0,
                    help="actor.micro_batch_token_budget of the variants that name none (0: the whole batch at once)")
    ap.add_argument("--variants", default="full,lora,lora_peft",
                    help="comma-separated; NAME@CHECKPOINTING[/EVERY][:TOKENS] runs that variant with its own "
                         "activation_checkpointing (and micro_batch_token_budget)")
    ap.add_argument("--compile", default="auto", choices=["auto", "true", "false"],
                    help="actor.compile (false: the eager trainer that serves several runs' adapters)")
    ap.add_argument("--profile", action="store_true", help="each variant's top GPU kernels of one more step")
    ap.add_argument("--host-profile", action="store_true",
                    help="each variant's costliest Python calls of one more step")
    ap.add_argument("--models", default="/tmp/meshrl-gpu-work/models")
    ap.add_argument("--out", default=None)
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)      # the child process's one variant
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--device", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = model_folder(args.shape, Path(args.models), device)
    rows = []
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", variant, "--model", str(model), "--device", device]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        rows.append(json.loads(line[7:]) if line else {"variant": variant, "error": proc.stderr[-2000:]})
        print(json.dumps(rows[-1]), flush=True)
    by = {r["variant"]: r for r in rows if "step_s" in r}
    ratios = {}
    single = next((u for u in by if u.partition("@")[0] == "lora"), None)     # one adapter: the merged ones' baseline
    for v in by:
        if v != "full" and "full" in by:
            ratios[f"{v}_step_vs_full"] = by[v]["step_s"] / by["full"]["step_s"]
            if cuda:
                ratios[f"{v}_peak_vs_full"] = by[v]["peak_bytes"] / by["full"]["peak_bytes"]
        if v.startswith("lora_merged") and single:
            ratios[f"{v.partition('@')[0]}_step_vs_lora"] = by[v]["step_s"] / by[single]["step_s"]
    result = {"benchmark": "lora_train", "device": torch.cuda.get_device_name() if cuda else "cpu",
              "shape": args.shape, "lora_rank": args.rank, "batch": args.batch, "prompt": args.prompt,
              "response": args.response, "adapters": args.adapters, "activation_checkpointing": args.checkpointing,
              "compile": args.compile,
              "goal": "lora step <= 0.7 x full, lora peak <= 0.5 x full", "ratios": ratios, "results": rows}
    from provenance import SOURCES, stamp

    stem = f"lora_train{'_gpu' if cuda else ''}"
    if args.out and Path(args.out).stem in SOURCES:      # a result file of its own (lora_merged_train_gpu.json)
        stem = Path(args.out).stem
    path = Path(args.out or REPO / "bench" / "results" / f"{stem}.json")
    path.write_text(json.dumps(stamp(stem, result), indent=1) + "\n")
    print(json.dumps(ratios))


if __name__ == "__main__":
    main()
