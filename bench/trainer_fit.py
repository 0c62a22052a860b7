"""Which Qwen2.5-shaped actor fits one GPU: a GRPO-shaped actor step (AdamW, bf16 compute under autocast, fp32
master weights, activation checkpointing on every block, 8 x 2,048 tokens), full fine-tuning and LoRA, per size.
Per (size, mode): peak device memory, step seconds (median of the steps after the first), tokens/s and MFU, or
"oom" with the phase it stopped in.

    python bench/trainer_fit.py --sizes 0.5b,1.5b,3b,7b              # GPU: bench/results/trainer_fit_gpu.json
    python bench/trainer_fit.py --sizes tiny --batch 2 --seq 64      # CPU smoke: bench/results/trainer_fit.json

The pieces are the trainer's own (parallelize.apply_activation_checkpointing, lora.apply_lora,
optim.build_adamw); the log-prob loss runs the LM head in checkpointed chunks of 1,024 tokens, as the fused head
keeps fp32 [tokens, vocab] logits out of memory. MFU counts 6 N T FLOPs for full fine-tuning and 4 N T under
LoRA (no weight gradients), recomputation and attention not counted, against the GPU's dense bf16 peak.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "protos"), str(REPO / "bench")]

from provenance import stamp  # noqa: E402
from trainer_mfu import SHAPES  # noqa: E402

from services.trainer.config import LoraSection  # noqa: E402
from services.trainer.model.lora import apply_lora  # noqa: E402
from services.trainer.model.optim import build_adamw  # noqa: E402
from services.trainer.parallel.parallelize import apply_activation_checkpointing  # noqa: E402

SIZES = {**SHAPES,
         "3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                    intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True),
         "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                    intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)}
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
CHUNK = 1024


def chunked_logprob_loss(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-mean log p(target) over every position, the head run per chunk and recomputed in backward."""
    from torch.utils.checkpoint import checkpoint

    def chunk_loss(h, t):
        logits = model.lm_head(h).float()
        return -logits.log_softmax(-1).gather(-1, t.unsqueeze(-1)).sum()

    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    total = sum(checkpoint(chunk_loss, h[i:i + CHUNK], t[i:i + CHUNK], use_reentrant=False)
                for i in range(0, h.shape[0], CHUNK))
    return total / t.numel()


def build(size: str, mode: str, device: torch.device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SIZES[size], attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        # LoRA: the frozen base in bf16, the adapters in fp32; full: fp32 master weights.
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16 if mode == "lora" else torch.float32)
    model.train(False)
    apply_activation_checkpointing(model, "full")
    if mode == "lora":
        apply_lora(model, LoraSection(rank=16, alpha=32), adapter_dtype=torch.float32)
    opt = build_adamw(model.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    return model, opt


def run(size: str, mode: str, device: torch.device, batch: int, seq: int, steps: int) -> dict:
    cuda = device.type == "cuda"
    phase, out = "build", {"size": size, "mode": mode, "tokens": batch * seq}
    try:
        model, opt = build(size, mode, device)
        n = sum(p.numel() for name, p in model.named_parameters() if ".lora_" not in name)
        out["num_params"] = n
        out["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq + 1), device=device)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            phase = "forward"
            with torch.autocast(device.type, dtype=torch.bfloat16):
                hidden = model.model(input_ids=ids[:, :-1], use_cache=False).last_hidden_state
                loss = chunked_logprob_loss(model, hidden, ids[:, 1:])
            phase = "backward"
            loss.backward()
            phase = "optimizer"
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        step_s = statistics.median(times[1:] or times)
        flops = (6 if mode == "full" else 4) * n * batch * seq
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if cuda and k in torch.cuda.get_device_name()), None)
        out.update(fits=True, step_s=step_s, tokens_per_s=batch * seq / step_s,
                   mfu=flops / step_s / (peak * 1e12) if peak else None,
                   peak_bytes=torch.cuda.max_memory_allocated() if cuda else None)
    except torch.OutOfMemoryError:
        out.update(fits=False, oom_in=phase,
                   peak_bytes=torch.cuda.max_memory_allocated() if cuda else None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="0.5b,1.5b,3b,7b")
    ap.add_argument("--modes", default="full,lora")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    rows = []
    for size in args.sizes.split(","):
        for mode in args.modes.split(","):
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            rows.append(run(size, mode, device, args.batch, args.seq, args.steps))
            print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "trainer_fit", "device": torch.cuda.get_device_name() if cuda else "cpu",
              "total_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
              "activation_checkpointing": "full", "compute": "bfloat16 autocast", "master": "float32",
              "batch": args.batch, "seq": args.seq, "results": rows}
    stem = f"trainer_fit{'_gpu' if cuda else ''}"
    path = Path(args.out or REPO / "bench" / "results" / f"{stem}.json")
    path.write_text(json.dumps(stamp(stem, result), indent=1) + "\n")


if __name__ == "__main__":
    main()
