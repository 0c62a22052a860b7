"""Run toolcalc episodes in-process (the model, the chat template's observation deltas, the real `calculator` tool
code): the SFT script's measure of the model before any RL, independent of the rollout service's loop."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass, field

import torch

from examples.toolcalc.chat import encode, prompt_ids
from examples.toolcalc.reward import compute_score
from services.common.chat_delta import observation_ids
from services.common.tool_calls import parse_hermes
from services.env.calculator import Calculator
from services.env.types import ToolError

CALCULATOR = Calculator()
# What the recipe's tool agent hands the chat template: the one tool's schema.
TOOLS = [CALCULATOR.schema()]
MAX_TURNS = 3
MAX_TOKENS_PER_TURN = 80


@dataclass
class RunEpisode:
    ids: list[int]
    num_prompt: int
    text: str = ""
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    done: bool = False
    calls: list[str] = field(default_factory=list)


def call_tool(name: str, arguments: dict) -> tuple[str, bool]:
    """(observation, failed) for one call, as the env service answers it."""
    if name != CALCULATOR.name:
        return f"Error: unknown tool {name!r}", True
    try:
        return asyncio.run(CALCULATOR(arguments)), False
    except ToolError as e:
        return f"Error: {e}", True


@torch.no_grad()
def _generate_turn(model, tokenizer, episodes: list[RunEpisode], greedy: bool) -> list[list[int]]:
    """One turn for each episode (batched, left-padded): the sampled ids, up to and including the eos."""
    width, pad, eos = max(len(e.ids) for e in episodes), tokenizer.pad_token_id, tokenizer.eos_token_id
    enc = {"input_ids": torch.tensor([[pad] * (width - len(e.ids)) + e.ids for e in episodes]),
           "attention_mask": torch.tensor([[0] * (width - len(e.ids)) + [1] * len(e.ids) for e in episodes])}
    kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    out = model.generate(**enc, max_new_tokens=MAX_TOKENS_PER_TURN, pad_token_id=pad, eos_token_id=eos, **kw)
    return [ids[: ids.index(eos) + 1] if eos in ids else ids for ids in out[:, width:].tolist()]


def _step(tokenizer, episode: RunEpisode, sampled: list[int]) -> None:
    """Append a turn; when it calls tools, run them and append the observation delta, else the episode ends."""
    eos = tokenizer.eos_token_id
    episode.ids += sampled
    episode.num_turns += 1
    parsed = parse_hermes(tokenizer.decode(sampled, skip_special_tokens=True))
    if not parsed.has_calls or sampled[-1] != eos or episode.num_turns >= MAX_TURNS:
        episode.done = True
        return
    messages = []
    for call in parsed.calls:
        content, failed = call_tool(call.name, call.arguments)
        episode.num_tool_errors += failed
        episode.calls.append(str(call.arguments.get("expression", "")))
        messages.append({"role": "tool", "content": content})
    for error in parsed.errors:
        episode.num_tool_errors += 1
        messages.append({"role": "tool", "content": f"Error: {error}"})
    episode.num_tool_calls += len(parsed.calls) + len(parsed.errors)
    episode.ids += observation_ids(tokenizer, messages, end_text=tokenizer.eos_token)


def run_episodes(model, tokenizer, rows: list[dict], *, greedy: bool = True, tools=TOOLS,
                 opening: str = "") -> list[RunEpisode]:
    """Every row's episode, turns batched across the episodes still running; `opening` forces the first turn's
    start (`<tool_call>`: the model must call, which measures what it does once it calls)."""
    episodes = [RunEpisode(ids=(p := prompt_ids(tokenizer, r["prompt"], tools)), num_prompt=len(p)) for r in rows]
    forced = encode(tokenizer, opening) if opening else []
    while active := [e for e in episodes if not e.done]:
        start = [RunEpisode(ids=e.ids + forced, num_prompt=0) if forced and not e.num_turns else e for e in active]
        for e, sampled in zip(active, _generate_turn(model, tokenizer, start, greedy)):
            _step(tokenizer, e, (forced if not e.num_turns else []) + sampled)
    for e in episodes:
        e.text = tokenizer.decode(e.ids[e.num_prompt:], skip_special_tokens=True)
    return episodes


def evaluate(model, tokenizer, rows: list[dict], *, greedy: bool = True, batch_size: int = 100,
             opening: str = "") -> dict:
    """Accuracy, the share of episodes that called the tool, that called it with the right expression, tool calls
    and turns per episode and the tool error rate (errors / calls)."""
    was_training = model.training
    model.eval()
    episodes = []
    for i in range(0, len(rows), batch_size):
        episodes += run_episodes(model, tokenizer, rows[i:i + batch_size], greedy=greedy, opening=opening)
    model.train(was_training)
    n = max(len(rows), 1)
    right = [f"{r['extra_info']['a']}*{r['extra_info']['b']}" for r in rows]
    calls = sum(e.num_tool_calls for e in episodes)
    return {"accuracy": sum(compute_score(r["data_source"], e.text, r["reward_model"]["ground_truth"])["score"]
                            for e, r in zip(episodes, rows)) / n,
            "tool_call_rate": sum(e.num_tool_calls > 0 for e in episodes) / n,
            "right_call_rate": sum(x in e.calls for e, x in zip(episodes, right)) / n,
            "tool_calls_per_episode": calls / n,
            "turns_per_episode": sum(e.num_turns for e in episodes) / n,
            "tool_error_rate": sum(e.num_tool_errors for e in episodes) / max(calls, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="examples/toolcalc/model")
    p.add_argument("--data", default="examples/toolcalc/data/heldout.parquet")
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--sampled", action="store_true", help="temperature 1 (seeded) instead of greedy")
    p.add_argument("--forced-call", action="store_true", help="open every first turn with `<tool_call>`")
    args = p.parse_args()
    from transformers import Qwen2ForCausalLM

    from examples.toolcalc.chat import build_tokenizer
    from examples.wordproblems.task import read_parquet

    torch.manual_seed(0)
    model = Qwen2ForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    rows = read_parquet(args.data)[:args.rows]
    print(json.dumps(evaluate(model, build_tokenizer(), rows, greedy=not args.sampled,
                              opening="<tool_call>" if args.forced_call else "")))


if __name__ == "__main__":
    main()
