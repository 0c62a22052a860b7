"""The work both sides of the GRPO comparison do (bench/e2e_grpo.py, bench/peers/trl_grpo.py), in one place.

Imported from two virtual environments (meshrl's and TRL's): standard library at import time, torch and
transformers only inside `make_random_model`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARITH_MODEL = REPO / "examples" / "arith" / "model"
TRAIN_FILE = REPO / "examples" / "arith" / "data" / "train.jsonl"
HELDOUT_FILE = REPO / "examples" / "arith" / "data" / "heldout.jsonl"

# Shared by both sides; the per-shape entries below override them.
COMMON = dict(
    temperature=1.0, top_p=1.0,
    # KL(actor || reference) as a k3 loss term (TRL: beta, its only estimator), the recipe's coefficient.
    kl_coef=0.001, kl_estimator="k3",
    # One policy update per batch, as one mini-batch: the ratio is exactly 1, so clipping never acts.
    ppo_epochs=1, clip_ratio=0.2,
    # Token mean over the whole batch: meshrl loss_agg_mode token-mean = TRL loss_type "dapo".
    loss_agg="token-mean",
    # Rewards normalised by the group's std (meshrl norm_adv_by_std, TRL scale_rewards="group").
    scale_rewards_by_group_std=True,
    grad_clip=1.0, weight_decay=0.0, adam_betas=(0.9, 0.999), adam_eps=1e-8, lr_schedule="constant",
    data_seed=0, sampling_seed=1,
)

SHAPES = {
    # The demo recipe (examples/arith/grpo.yaml): 16 prompts x 8 samples, 6 new tokens, lr 2e-5.
    "arith": dict(model="examples/arith/model", prompts_per_step=16, n=8, max_new_tokens=6, lr=2.0e-5,
                  dtype="float32", steps=80, warmup_steps=5),
    # GPU variant: Qwen2.5-0.5B-shaped random bf16 model (the arith char tokenizer: prompt ids are a subset
    # of its vocabulary), 64 prompts x 8 samples, 256 new tokens (a random model rarely samples eos).
    "qwen2.5-0.5b": dict(model="random:qwen2.5-0.5b", prompts_per_step=64, n=8, max_new_tokens=256, lr=1.0e-6,
                         dtype="bfloat16", steps=20, warmup_steps=3),
    # examples/gpu/grpo.yaml's work (issue #38): Qwen2.5-1.5B-shaped random bf16 model, 32 prompts x 8 samples,
    # 512 new tokens, lr 1e-6. The recipe checkpoints every decoder block (actor.activation_checkpointing: full);
    # TRL's GRPOConfig does too by default (gradient_checkpointing=True, which bench/peers/trl_grpo.py keeps).
    "qwen2.5-1.5b": dict(model="random:qwen2.5-1.5b", prompts_per_step=32, n=8, max_new_tokens=512, lr=1.0e-6,
                         dtype="bfloat16", steps=8, warmup_steps=2),
    # The GPU variant's payloads (64 x 8 samples, 256 new tokens) with a tiny random model, so the mesh
    # overhead of those message sizes can be measured and profiled on a CPU.
    "tiny-256": dict(model="random:tiny-256", prompts_per_step=64, n=8, max_new_tokens=256, lr=1.0e-6,
                     dtype="float32", steps=12, warmup_steps=3),
}

QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
                  max_position_embeddings=4096, rope_theta=1000000.0)
# The larger Qwen2.5 shapes (their Hugging Face config.json numbers; 7B unties its head and has 152064 tokens).
QWEN25 = {
    "qwen2.5-0.5b": QWEN25_05B,
    "qwen2.5-1.5b": {**QWEN25_05B, "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "intermediate_size": 8960},
    "qwen2.5-3b": {**QWEN25_05B, "hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16,
                   "num_key_value_heads": 2, "intermediate_size": 11008},
    "qwen2.5-7b": {**QWEN25_05B, "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
                   "tie_word_embeddings": False},
}
# Random models by name (random:<name>); tiny-256 keeps the arith tokenizer's 44-token vocabulary.
RANDOM_MODELS = {**QWEN25,
                 "tiny-256": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  intermediate_size=128, vocab_size=44, tie_word_embeddings=True,
                                  max_position_embeddings=512)}


def settings(shape: str, **overrides) -> dict:
    """COMMON + SHAPES[shape] + overrides (None values ignored)."""
    if shape not in SHAPES:
        raise ValueError(f"--shape: unknown {shape!r} (expected one of {', '.join(SHAPES)})")
    out = {**COMMON, **SHAPES[shape], "shape": shape}
    out.update({k: v for k, v in overrides.items() if v is not None})
    return out


def model_path(s: dict, work_dir: Path) -> str:
    """The model folder of these settings; a random:... model is built once under work_dir."""
    if not s["model"].startswith("random:"):
        return str(REPO / s["model"])
    name = s["model"].split(":", 1)[1]
    path = work_dir / name
    if not (path / "config.json").is_file():
        make_random_model(path, dtype=s["dtype"], shape=RANDOM_MODELS[name])
    return str(path)


def make_random_model(path: Path, *, dtype: str, shape: dict = QWEN25_05B, init_in_dtype: bool = False,
                      device: str = "cpu") -> None:
    """Random Qwen2 weights of `shape` (seed 0) saved with the arith tokenizer files beside them.

    init_in_dtype: initialise straight in `dtype` (half the host memory of a float32 init for bf16: a 7B model
    needs about 15 GB instead of 30); the draws then differ from the default float32 init cast down.
    device: where the weights are drawn (a 1.5B init takes about 90 s on a CPU, seconds on a GPU; the draws differ)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    cfg = Qwen2Config(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    saved = torch.get_default_dtype()
    if init_in_dtype:
        torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    finally:
        torch.set_default_dtype(saved)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (ARITH_MODEL / name).is_file():
            shutil.copy(ARITH_MODEL / name, path / name)
    cfg_tok = json.loads((path / "tokenizer_config.json").read_text())
    cfg_tok["model_max_length"] = shape["max_position_embeddings"]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg_tok, indent=2))


def prompt_rows(path: Path, *, seed: int, count: int, shuffle: bool = True) -> list[dict]:
    """The first `count` prompts (0 = all) of meshrl's seeded stream (coordinator.recipe.data.PromptStream), in
    its order.

    TRL reads them in this order with shuffling off, so both sides train on the same prompts per step.
    """
    from coordinator.recipe.data import PromptStream, load_problems

    problems = load_problems([str(path)])
    stream = PromptStream(problems, seed=seed, shuffle=shuffle)
    return [{"prompt": p.prompt, "answer": p.ground_truth, "data_source": p.data_source, "id": p.id}
            for p in stream.take(count or len(problems))]


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])
