"""Reference log-prob throughput on a GPU: ReferenceEngine vs a plain transformers forward, same run.

Qwen2.5-0.5B-shaped random-init bf16 model; 64 sequences of 256 prompt + 256 response tokens.
`PYTHONPATH=.:protos python bench/reference_gpu.py`: the result goes under the key "reference_gpu" of --out
(bench/results/reward_reference.json, whose CPU keys bench/reward_reference.py writes); other keys stay.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
import transformers


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/results/reward_reference.json")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    cfg = transformers.Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                                   tie_word_embeddings=True, max_position_embeddings=4096)
    tmp = tempfile.mkdtemp()
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt), generator=g).tolist()
    responses = torch.randint(0, cfg.vocab_size, (a.batch, a.response), generator=g).tolist()
    tokens = a.batch * (a.prompt + a.response)

    from services.common.config import load_config
    from services.reference.config import ReferenceSettings
    from services.reference.engine import ReferenceEngine

    engine = ReferenceEngine(load_config(ReferenceSettings, data={
        "model": {"path": tmp, "dtype": "bfloat16", "device": "cuda"},
        "reference": {"micro_batch_token_budget": 16384}}))

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2]

    ids = torch.tensor([p + r for p, r in zip(prompts, responses)], device="cuda")
    model = engine.model

    @torch.no_grad()
    def plain():
        # The baseline a user would write: one forward, fp32 log-softmax over every position, gather.
        out = []
        for i in range(0, a.batch, 16):
            logits = model(input_ids=ids[i:i + 16]).logits[:, a.prompt - 1:-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[i:i + 16, a.prompt:, None]).squeeze(-1))
        return torch.cat(out)

    t_plain = timed(plain)
    t_engine = timed(lambda: engine.logprobs_sync(prompts, responses))
    got = torch.tensor(engine.logprobs_sync(prompts, responses))
    want = plain().cpu()
    result = {"benchmark": "reference_logprobs_gpu", "device": torch.cuda.get_device_name(),
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "model": "Qwen2.5-0.5B-shaped random init, bf16", "batch": a.batch, "prompt_tokens": a.prompt,
              "response_tokens": a.response,
              "plain_forward": {"seconds": t_plain, "tokens_per_s": tokens / t_plain},
              "reference_engine": {"seconds": t_engine, "tokens_per_s": tokens / t_engine},
              "engine_vs_plain": t_plain / t_engine,
              "max_abs_logprob_diff_vs_plain": float((got - want).abs().max())}
    try:
        with open(a.out) as f:
            merged = json.load(f)
    except (OSError, ValueError):
        merged = {}
    merged["reference_gpu"] = result
    with open(a.out, "w") as f:
        f.write(json.dumps(merged, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
