"""Episodes/s of a tool-calling workload through the rollout replica's episode loop and a real env replica, beside
the single-turn rate of the same token count (issue 24), on CPU (the arith model) or one GPU (a random
Qwen2.5-0.5B-shaped model, torch engine with its CUDA-graph decode).

    OMP_NUM_THREADS=1 nice .venv/bin/python bench/episodes.py --device cpu --rounds 9 --shared
    PYTHONPATH=.:protos python bench/episodes.py --device cuda --shape qwen2.5-0.5b      # bench/gpu_session.sh episodes

The tool-calling workload (`tool_calling` in the JSON): P prompts x n episodes of the real `tool_agent` loop
(services/rollout/agents/loops.py), each T model turns of K sampled tokens with a `calculator` call after each of the
first T-1 turns. Each prompt is a chat message rendered with the calculator's schema in the system turn (the
tokenizer's template knows no tools: the Hermes tools text, as the HTTP API's function calling writes it). The env
replica is its own process (`python -m services.env`, port 0, started as `meshrl up` starts it); each call goes to it
over gRPC through the replica's env pool (services/rollout/agents/env_client.py) and its answer is appended as the chat
template's delta for the tool message (token-exact, mask 0). SCRIPTED: the model side's tool call. A random (or
arith) model writes no `<tool_call>` text, so the loop's tool-call parser is the bench's `scripted_calculator_call`,
which reads every turn as one calculator call whose expression is computed from the turn's decoded text; the
turns themselves are sampled by the model as usual.

Beside it, in the same run, rounds interleaved: `generate_same_tokens`, one engine `generate` of the same batch
(the episodes' first prompts, n samples each) sampling T x K tokens per sample, and `single_turn_same_tokens`,
the same as `single_turn` episodes (the loop without tools). End-of-sequence: the CPU engine's eos ids are emptied
so every turn and every baseline row samples exactly its K / T x K tokens (the trained arith model would otherwise
stop after its answer); on the GPU the random model's eos (1 id of 151,936) is left on and the JSON counts the
tokens actually sampled. On CPU the arith model's context is raised from 64 to --context positions (RoPE; the
weights are the committed ones) so that the tools prompt and T turns fit.

--device cpu also runs the loop-cost cases of the earlier episodes_cpu.py (64 one-turn samples by `generate`, as
`single_turn` episodes, the same one by one, and 16 three-turn episodes with a fixed observation batched vs one by
one) and writes bench/results/episodes_cpu.json; --device cuda writes bench/results/episodes_gpu.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from bench.provenance import stamp  # noqa: E402
from services.common.tool_calls import ParsedText, ToolCall  # noqa: E402
from services.rollout.agents import episodes  # noqa: E402
from services.rollout.agents.episodes import EpisodePrompt, EpisodeRunner  # noqa: E402
from services.rollout.config import AgentConfig, RolloutSettings  # noqa: E402
from services.rollout.types import GenerateBatch, PromptInput, SamplingParams  # noqa: E402

ARITH = REPO / "examples" / "arith" / "model"
RESULTS = REPO / "bench" / "results"
PROMPTS = [f"{a}+{b}=" for a, b in [(12, 7), (3, 4), (45, 9), (81, 11), (6, 60), (20, 22), (9, 9), (70, 5)]]
PARSER = "bench.episodes:scripted_calculator_call"
# Each device's defaults: prompts x n episodes, T turns of K tokens, timed rounds, the engine's batch.
DEFAULTS = {"cpu": dict(prompts=8, n=4, turns=4, tokens_per_turn=8, rounds=9, context=1024),
            "cuda": dict(prompts=32, n=8, turns=4, tokens_per_turn=64, rounds=5, context=0)}


def scripted_calculator_call(text: str) -> ParsedText:
    """The bench's tool-call parser (the scripted model side): every turn is one calculator call, its expression
    computed from the turn's text (so each call differs and the calculator really evaluates it)."""
    checksum = sum(map(ord, text)) % 997
    return ParsedText(content=text, calls=[ToolCall(name="calculator",
                                                    arguments={"expression": f"{len(text)} * {checksum + 2} + 7"})])


# ---- the model


def build(args):
    """(model, tokenizer): the committed arith model (CPU), or a random Qwen2.5-0.5B-shaped one in bf16 (as
    bench/rollout_gpu.py builds it) with the arith tokenizer (as bench/e2e_grpo.py's random models have)."""
    import torch

    from services.common.tensors.modeling import load_causal_lm
    from services.rollout.local_model import try_tokenizer

    tokenizer = try_tokenizer(str(ARITH))
    tokenizer.model_max_length = 1 << 20        # the arith files say 64; the context is the model's here
    if args.shape == "arith":
        model = load_causal_lm(str(ARITH), dtype="float32", device=args.device)
        if args.context:
            model.config.max_position_embeddings = args.context
        return model, tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.peers.settings import QWEN25_05B
    cfg = Qwen2Config(**QWEN25_05B, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    model.eval().requires_grad_(False)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    return model, tokenizer


def engine_for(args, model, tokenizer, *, batch: int, eos: bool = True, kv_cache: str = "none"):
    """kv_cache none: today's engine (CUDA graphs on a GPU); paged: rollout.kv_cache paged (eager steps);
    paged_graphs: paged with rollout.kv_cache_cuda_graphs."""
    from services.rollout.engine_torch.engine import TorchEngine

    cuda = args.device.startswith("cuda")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    settings = RolloutSettings(model={"path": str(ARITH) if args.shape == "arith" else "random-init",
                                      "device": args.device, "dtype": dtype},
                               rollout={"max_batch_size": batch, "cuda_graphs": cuda and kv_cache == "none",
                                        "kv_cache": "none" if kv_cache == "none" else "paged",
                                        "kv_cache_cuda_graphs": kv_cache == "paged_graphs"})
    engine = TorchEngine(settings, model=model, tokenizer=tokenizer)
    if not eos:
        if engine._graph_decoder is not None:
            raise ValueError("--device cuda: eos stays on (the graph decoder holds its eos ids)")
        engine.eos_ids = set()
    return engine


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


# ---- the env replica


def start_env(tmp: Path):
    """One env replica hosting `calculator`, its own process on port 0, started the way `meshrl up` starts it."""
    from coordinator.cli.launcher import Launcher

    config = tmp / "env.yaml"
    config.write_text(yaml.safe_dump({"env": {"builtin_tools": ["calculator"]}}))
    launcher = Launcher(str(config), log_dir=tmp / "logs")
    try:
        address = launcher.wait_ready(launcher.start("env"), timeout=120)
    except BaseException:
        launcher.stop_all()
        raise
    return launcher, address


# ---- the tool-calling workload


def tool_cases(args, engine, env):
    """The three cases of the tool-calling workload, each a coroutine function returning its records."""
    T, K = args.turns, args.tokens_per_turn
    agent = AgentConfig(name="tool_agent", max_turns=T, max_tokens_per_turn=K, tools=["calculator"],
                        max_total_tokens=1 << 20, tool_call_parser=PARSER)
    runner = EpisodeRunner(engine, env, agent, max_tokens=K)
    single = AgentConfig(name="single_turn", max_total_tokens=T * K, max_tokens_per_turn=T * K)
    single_runner = EpisodeRunner(engine, None, single, max_tokens=T * K)
    questions = [f"What is {a} times {b}? Use the calculator." for a, b in
                 [(123, 45), (67, 891), (12, 34), (505, 6), (77, 77), (314, 15), (9, 876), (250, 4)]]
    prompts = [EpisodePrompt(id=f"q{i}", messages=[{"role": "user", "content": questions[i % len(questions)]
                                                    + (f" ({i})" if i >= len(questions) else "")}])
               for i in range(args.prompts)]
    first_ids: list[list[int]] = []

    async def tool_episodes():
        groups = await runner.run(prompts, SamplingParams(n=args.n, temperature=1.0, max_tokens=K), agent)
        if not first_ids:
            first_ids.extend(g.episodes[0].prompt_ids for g in groups)
        return [e for g in groups for e in g.episodes]

    async def generate_same_tokens():
        batch = GenerateBatch([PromptInput(id=f"q{i}", prompt_ids=ids) for i, ids in enumerate(first_ids)],
                              SamplingParams(n=args.n, temperature=1.0, max_tokens=T * K))
        return [s for r in await engine.generate(batch) for s in r.samples]

    async def single_turn_same_tokens():
        groups = await single_runner.run([EpisodePrompt(id=f"q{i}", prompt_ids=ids) for i, ids in enumerate(first_ids)],
                                         SamplingParams(n=args.n, temperature=1.0, max_tokens=T * K), single)
        return [e for g in groups for e in g.episodes]

    return {"tool_episodes": tool_episodes, "generate_same_tokens": generate_same_tokens,
            "single_turn_same_tokens": single_turn_same_tokens}, runner


def describe(name: str, records, tokenizer) -> dict:
    """Token counts (and for tool episodes: calls, errors, end reasons, observation ids) of one round's output."""
    if name == "generate_same_tokens":
        return {"rows": len(records), "sampled_tokens": sum(len(s.response_ids) for s in records)}
    sampled = sum(sum(e.loss_mask) for e in records)
    out = {"rows": len(records), "sampled_tokens": sampled,
           "observation_tokens": sum(len(e.loss_mask) - sum(e.loss_mask) for e in records),
           "end_reasons": dict(Counter(e.end_reason for e in records))}
    if name == "tool_episodes":
        out |= {"turns": sum(e.num_turns for e in records), "tool_calls": sum(e.num_tool_calls for e in records),
                "tool_errors": sum(e.num_tool_errors for e in records),
                "prompt_tokens_mean": statistics.mean(len(e.prompt_ids) for e in records),
                "final_context_tokens_max": max(len(e.prompt_ids) + len(e.response_ids) for e in records),
                "first_observation_text": _first_observation(records[0], tokenizer)}
    return out


def _first_observation(episode, tokenizer) -> str:
    """The first tool observation of an episode as the model reads it (its ids decoded, special tokens kept)."""
    mask = episode.loss_mask
    start = mask.index(0)
    end = mask.index(1, start) if 1 in mask[start:] else len(mask)
    return tokenizer.decode(episode.response_ids[start:end], skip_special_tokens=False)


async def run_tool_workload(args, engine, env) -> dict:
    """Warm-up, then --rounds rounds of the three cases interleaved; medians, rates and what each round did."""
    cases, runner = tool_cases(args, engine, env)
    check(describe("tool_episodes", await cases["tool_episodes"](), engine.tokenizer), args)   # warm-up (CUDA:
    for name in ("generate_same_tokens", "single_turn_same_tokens"):           # compiles, captures) and first prompts
        await cases[name]()
    graphs_warm = dict(getattr(engine._graph_decoder, "stats", None) or {})
    times: dict[str, list[float]] = {k: [] for k in cases}
    shape: dict[str, dict] = {}
    calls0, ticks0, decode_batches = runner.batcher.num_calls, runner.batcher.num_ticks, 0
    for _ in range(args.rounds):
        for name, fn in cases.items():
            sync(args.device)
            before = engine.stats["decode_batches"]
            t0 = time.perf_counter()
            records = await fn()
            sync(args.device)
            times[name].append(time.perf_counter() - t0)
            if name == "tool_episodes":
                decode_batches += engine.stats["decode_batches"] - before
            shape[name] = describe(name, records, engine.tokenizer)   # the last round's (each round is checked)
            if name == "tool_episodes":
                check(shape[name], args)
    out = {}
    for name, ts in times.items():
        med, d = statistics.median(ts), shape[name]
        out[name] = {"median_s": med, "all_s": ts, "rows_per_s": d["rows"] / med,
                     "sampled_tokens_per_s": d["sampled_tokens"] / med, **d}
        if "observation_tokens" in d:
            out[name]["all_tokens_per_s"] = (d["sampled_tokens"] + d["observation_tokens"]) / med
    tool, base = out["tool_episodes"], out["generate_same_tokens"]
    tool |= {"episodes_per_s": tool["rows_per_s"],
             # engine generate calls the loop's batcher made (one per tick and sampling), and the decode batches the
             # engine ran for them (it merges calls queued while it decodes), per round
             "batcher_engine_calls_per_round": (runner.batcher.num_calls - calls0) / args.rounds,
             "batcher_ticks_per_round": (runner.batcher.num_ticks - ticks0) / args.rounds,
             "engine_decode_batches_per_round": decode_batches / args.rounds}
    graphs_end = dict(getattr(engine._graph_decoder, "stats", None) or {})
    return {"cases": out,
            "tool_episodes_over_generate_time": tool["median_s"] / base["median_s"],
            "tool_episode_rate_over_generate_rate": tool["rows_per_s"] / base["rows_per_s"],
            "single_turn_over_generate_time": out["single_turn_same_tokens"]["median_s"] / base["median_s"],
            "same_sampled_tokens": tool["sampled_tokens"] == base["sampled_tokens"]
            == out["single_turn_same_tokens"]["sampled_tokens"],
            "graph_decoder_stats": {"after_warmup": graphs_warm, "at_end": graphs_end} if graphs_end else None}


def check(tool: dict, args) -> None:
    """What every round of tool episodes must have done (a bench of other work is worse than none)."""
    episodes_n = args.prompts * args.n
    want = {"rows": episodes_n, "turns": episodes_n * args.turns, "tool_calls": episodes_n * (args.turns - 1),
            "tool_errors": 0}
    got = {k: tool[k] for k in want}
    if got != want or tool["end_reasons"] != {"max_turns": episodes_n}:
        raise RuntimeError(f"tool episodes did other work than scripted: {got} / {tool['end_reasons']}, want {want}")


# ---- the loop-cost cases of the earlier episodes_cpu.py (CPU)


async def three_turns(ctx, prompt, sampling):
    """Three model turns with a fixed observation between them (no tool: the loop's own cost)."""
    rec = ctx.recorder(ctx.prompt_ids(prompt))
    observation = ctx.tokenizer.encode("+1=", add_special_tokens=False)
    for turn in range(3):
        sample = await ctx.generate(rec.context_ids, max_tokens=4)
        rec.add_sampled(sample)
        if turn < 2:
            rec.add_observation(observation)
    return rec.finish("max_turns", ctx.tokenizer)


async def _one_by_one(runner, prompts, sampling, agent, n):
    for p in prompts:
        for _ in range(n):
            await runner.run([p], sampling, agent)


async def run_loop_cases(engine, rounds: int) -> dict:
    """64 one-turn samples by one generate, as single_turn episodes, and one by one; 16 three-turn episodes."""
    runner = EpisodeRunner(engine, None, AgentConfig(name="single_turn"), max_tokens=6)
    episodes.AGENT_LOOPS["bench_three_turns"] = three_turns
    multi = AgentConfig(name="single_turn")   # the loop is named per prompt below
    sampling = SamplingParams(n=8, temperature=1.0, max_tokens=6)
    prompts = [EpisodePrompt(id=p, text=p) for p in PROMPTS]
    multi_prompts = [EpisodePrompt(id=p, text=p, agent_name="bench_three_turns") for p in PROMPTS[:2]]
    one = SamplingParams(n=1, temperature=1.0, max_tokens=6)
    cases = {
        "generate": lambda: engine.generate(GenerateBatch([PromptInput(text=p) for p in PROMPTS], sampling)),
        "episodes": lambda: runner.run(prompts, sampling, runner.defaults),
        "episodes_one_by_one": lambda: _one_by_one(runner, prompts, one, runner.defaults, 8),
        "three_turn_episodes": lambda: runner.run(multi_prompts, sampling, multi),
        "three_turn_episodes_one_by_one": lambda: _one_by_one(runner, multi_prompts, one, multi, 8),
    }
    await cases["generate"]()   # warm up
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            await fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"samples_per_case": {"one_turn": len(PROMPTS) * 8, "three_turn_episodes": len(multi_prompts) * 8},
            "median_s": med, "all_s": times,
            "episodes_over_generate": med["episodes"] / med["generate"],
            "one_by_one_over_batched": med["episodes_one_by_one"] / med["episodes"],
            "three_turn_one_by_one_over_batched": med["three_turn_episodes_one_by_one"] / med["three_turn_episodes"],
            "engine_calls_per_tick_note": "batched: one engine call per tick for every ready turn"}


# ---- main


async def measure(args, address: str) -> dict:
    from services.env.config import EnvConfig
    from services.rollout.agents.env_client import EnvClient

    import torch
    model, tokenizer = build(args)
    cpu = not args.device.startswith("cuda")
    episodes_n = args.prompts * args.n
    result: dict = {"benchmark": "episodes", "device": torch.cuda.get_device_name() if not cpu else "cpu",
                    "model": ("examples/arith/model (committed weights)" if args.shape == "arith"
                              else "Qwen2.5-0.5B shape, random init (bench.peers.settings.QWEN25_05B), bf16"),
                    "tokenizer": "examples/arith/model (character-level; its template knows no tools)",
                    "torch": torch.__version__, "engine": "torch" + (", rollout.cuda_graphs" if not cpu else "")}
    if cpu and args.loop_cases:
        result |= await run_loop_cases(engine_for(args, model, tokenizer, batch=64), args.rounds)
    env = EnvClient.from_section(EnvConfig(servers=[address]))
    runs, errors = {}, {}
    try:
        for i, kv in enumerate(args.kv_caches.split(",")):
            try:
                engine = engine_for(args, model, tokenizer, batch=max(64, episodes_n), eos=not cpu, kv_cache=kv)
                runs[kv] = await run_tool_workload(args, engine, env)
            except Exception as e:     # a later cache failing (paged_graphs' first GPU run) keeps the others
                if i == 0:
                    raise
                errors[kv] = f"{type(e).__name__}: {e}"[:500]
                continue
            if engine._paged is not None:
                runs[kv]["paged_kv_metrics"] = engine._paged.metrics()
    finally:
        await env.close()
    tool = runs[args.kv_caches.split(",")[0]]
    if len(runs) + len(errors) > 1:      # issue 44: the same workload with each rollout.kv_cache, in this process
        result["by_kv_cache"] = {kv: {"tool_episodes_s": t["cases"]["tool_episodes"]["median_s"],
                                      "generate_same_tokens_s": t["cases"]["generate_same_tokens"]["median_s"],
                                      "tool_episodes_over_generate_time": t["tool_episodes_over_generate_time"],
                                      **({"paged_kv_metrics": t["paged_kv_metrics"]} if "paged_kv_metrics" in t
                                         else {})} for kv, t in runs.items()}
        result["by_kv_cache"].update({kv: {"error": e} for kv, e in errors.items()})
    result["tool_calling"] = {
        "workload": {"prompts": args.prompts, "n": args.n, "episodes": episodes_n, "turns": args.turns,
                     "tokens_per_turn": args.tokens_per_turn, "sampled_tokens_per_episode": args.turns
                     * args.tokens_per_turn, "tool_calls_per_episode": args.turns - 1, "rounds": args.rounds,
                     "context_positions": engine.max_model_len, "sampling": {"temperature": 1.0, "top_p": 1.0}},
        "scripted": ("the model side's tool call: the turns are sampled by the model, but the loop's tool_call_parser "
                     f"is {PARSER}, which reads every turn as one calculator call (expression from the turn's text); "
                     "the rest is the real tool_agent loop, a real env replica (own process, port 0, gRPC through "
                     "the env pool) and the template's delta of each tool message appended token-exact"),
        "eos": ("off: the engine's eos ids emptied, every turn and baseline row samples exactly its tokens" if cpu
                else "on (1 id of 151,936; a random model practically never samples it): counts are as sampled"),
        "env_replica": "python -m services.env (builtin_tools: [calculator]), started by coordinator.cli.launcher",
        **tool}
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--shape", default=None, help="arith (CPU default) or qwen2.5-0.5b (CUDA default)")
    for key in ("prompts", "n", "turns", "tokens_per_turn", "rounds", "context"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    parser.add_argument("--no-loop-cases", dest="loop_cases", action="store_false",
                        help="CPU: leave out the loop-cost cases of the earlier episodes_cpu.py")
    parser.add_argument("--kv-caches", default="none",
                        help="caches to run in turn: none, paged, paged_graphs (paged + kv_cache_cuda_graphs)")
    parser.add_argument("--shared", action="store_true", help="the machine was shared with other jobs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    for key, value in DEFAULTS[kind].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.shape = args.shape or ("qwen2.5-0.5b" if kind == "cuda" else "arith")
    if args.shape not in ("arith", "qwen2.5-0.5b"):
        parser.error(f"--shape: unknown {args.shape!r} (arith or qwen2.5-0.5b)")
    if args.turns < 2:
        parser.error("--turns: at least 2 (a tool call needs a turn after it)")
    stem = f"episodes_{'gpu' if kind == 'cuda' else 'cpu'}"
    out = Path(args.out) if args.out else RESULTS / f"{stem}.json"
    with tempfile.TemporaryDirectory(prefix="meshrl-episodes-bench-") as tmp:
        launcher, address = start_env(Path(tmp))
        try:
            result = asyncio.run(measure(args, address))
        finally:
            launcher.stop_all()
    result = stamp(stem, result, shared_machine=args.shared)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    tool = result["tool_calling"]
    print(json.dumps({name: {k: c[k] for k in ("median_s", "rows_per_s", "sampled_tokens_per_s")}
                      for name, c in tool["cases"].items()}, indent=2))
    print(f"tool episodes / generate (time): x{tool['tool_episodes_over_generate_time']:.2f}; wrote {out}")
    if "by_kv_cache" in result:
        print(json.dumps(result["by_kv_cache"], indent=2))
    return result


if __name__ == "__main__":
    main()
