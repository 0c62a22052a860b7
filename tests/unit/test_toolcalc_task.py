"""The toolcalc demo (examples/toolcalc): verl rows, the chat template's delta-stability and single bos, the SFT
rendering equal to what the episode loop appends, the reward, and the report's episode panels."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from examples.toolcalc.chat import build_tokenizer, encode, prompt_ids
from examples.toolcalc.episodes import TOOLS, call_tool
from examples.toolcalc.reward import compute_score
from examples.toolcalc.sft import MODEL_DIR, episode_ids
from examples.toolcalc.task import (AGENT_NAME, TEACHER_MIX, calculator_observation, make_rows, operands,
                                    teacher_episode)
from services.common.chat_delta import observation_ids, observation_text


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _conversation(row: dict, episode) -> list[dict]:
    """The teacher episode as OpenAI chat messages (calls as `tool_calls`), for rendering in one piece."""
    messages = list(row["prompt"])
    for i, turn in enumerate(episode.turns):
        if turn.startswith("<tool_call>"):
            args = json.loads(turn.split("\n")[1])["arguments"]
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": args}}]})
        else:
            messages.append({"role": "assistant", "content": turn})
        if i < len(episode.observations):
            messages.append({"role": "tool", "content": episode.observations[i]})
    return messages


def test_rows_are_verl_tool_agent_rows_with_a_disjoint_deterministic_split():
    train, heldout = make_rows(300, seed=0, split="train"), make_rows(100, seed=0, split="heldout")
    row = train[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "agent_name", "extra_info"}
    assert row["agent_name"] == AGENT_NAME and row["prompt"][0]["role"] == "user"
    a, b = operands(row)
    assert row["reward_model"]["ground_truth"] == str(a * b) and f"{a}*{b}" in row["prompt"][0]["content"]
    assert all(100 < x < 1000 and x % 100 for r in train + heldout for x in operands(r))
    assert not {operands(r) for r in train} & {operands(r) for r in heldout}
    assert make_rows(300, seed=0, split="train") == train and make_rows(300, seed=1, split="train") != train


def test_template_has_exactly_one_bos_and_encoding_adds_none(tok):
    ids = prompt_ids(tok, [{"role": "user", "content": "What is 123*456?"}], TOOLS)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "<s><|system|>tools: calculator<|end|><|user|>What is 123*456?<|end|><|assistant|>"
    assert encode(tok, "What is 1*2?").count(tok.bos_token_id) == 0


def test_one_more_tool_message_only_appends_text(tok):
    base = [{"role": "user", "content": "What is 123*456?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "123*456"}'}}]}]
    tool = {"role": "tool", "content": "56088"}
    for tools in (TOOLS, None):
        kw = {"tools": tools} if tools else {}
        before = tok.apply_chat_template(base, tokenize=False, **kw)
        after = tok.apply_chat_template([*base, tool], tokenize=False, add_generation_prompt=True, **kw)
        assert after.startswith(before)
        assert after[len(before):] == "<|tool|><tool_response>\n56088\n</tool_response><|end|><|assistant|>"
        # The assistant's end-of-turn is already in `before` (sampled by the model): the delta starts after it.
        assert observation_text(tok, [tool], end_text=tok.eos_token, tools=tools) == after[len(before):]


def test_tool_tags_survive_decoding_without_special_tokens(tok):
    text = "<tool_call>\n{}\n</tool_call><tool_response>\n1\n</tool_response>"
    assert tok.convert_tokens_to_ids("<tool_call>") != tok.unk_token_id
    assert tok.decode(encode(tok, text) + [tok.eos_token_id], skip_special_tokens=True) == text


@pytest.mark.parametrize("mode", list(TEACHER_MIX))
def test_sft_rendering_is_the_episode_loops_assembly_and_the_whole_conversation(tok, mode):
    row = make_rows(1, seed=3, split="train")[0]
    episode = teacher_episode(*operands(row), random.Random(0), {mode: 1.0})
    ids, labels = episode_ids(tok, row, episode)
    # The loop's assembly: prompt, each turn as sampled + eos, the observation delta between turns.
    loop_ids = prompt_ids(tok, row["prompt"], TOOLS)
    for i, turn in enumerate(episode.turns):
        loop_ids += encode(tok, turn) + [tok.eos_token_id]
        if i < len(episode.observations):
            loop_ids += observation_ids(tok, [{"role": "tool", "content": episode.observations[i]}],
                                        end_text=tok.eos_token)
    assert ids == loop_ids
    # No drift: the same ids as rendering the whole conversation through the template and encoding it once.
    whole = tok.apply_chat_template(_conversation(row, episode), tokenize=False, tools=TOOLS)
    assert ids == encode(tok, whole)
    # Labels: exactly the assistant turns and their end-of-turn tokens.
    trained = [i for i, lab in zip(ids, labels) if lab != -100]
    assert trained == [t for turn in episode.turns for t in encode(tok, turn) + [tok.eos_token_id]]


@pytest.mark.parametrize("mode", ["call", "bad_call"])
def test_sft_rendering_is_what_the_rollout_tool_agent_records(tok, mode):
    """The replica's EpisodeContext (services/rollout/agents/episodes.py) renders the prompt and the tool turn's delta
    exactly as the SFT data has them."""
    from services.common.tool_calls import parse_hermes
    from services.rollout.agents.episodes import EpisodeContext
    from services.rollout.types import SampleResult

    template = tok.chat_template
    ctx = EpisodeContext(tokenizer=tok, batcher=None, sampling=None, limits=None, parser=parse_hermes, tools=TOOLS,
                         env=None, episode_id="e", native_tools="tools" in template and "tool_calls" in template)
    row = make_rows(1, seed=4, split="train")[0]
    episode = teacher_episode(*operands(row), random.Random(0), {mode: 1.0})
    ids, _ = episode_ids(tok, row, episode)
    call = encode(tok, episode.turns[0]) + [tok.eos_token_id]
    sample = SampleResult(response_ids=call, logprobs=[0.0] * len(call), text=episode.turns[0],
                          finish_reason="stop", weight_version=0)
    recorded = ctx.render(list(row["prompt"])) + call + ctx.observation_ids(
        ctx.tool_messages([("call_1", episode.observations[0])]), after=sample)
    assert ids[:len(recorded)] == recorded
    assert ids[len(recorded):] == encode(tok, episode.turns[1]) + [tok.eos_token_id]


def test_teacher_observations_are_what_the_calculator_answers():
    assert calculator_observation("123*456") == "56088" == call_tool("calculator", {"expression": "123*456"})[0]
    assert calculator_observation("123 x 456").startswith("Error: expression: not arithmetic")
    assert call_tool("calculator", {"expression": "123 x 456"}) == (calculator_observation("123 x 456"), True)
    episode = teacher_episode(123, 456, random.Random(0), {"call": 1.0})
    assert episode.observations == ["56088"] and episode.turns[-1] == "#### 56088"


def test_reward_reads_the_last_answer_line():
    truth = "56088"
    called = "<tool_call>\n{}\n</tool_call><tool_response>\n56088\n</tool_response>#### 56088"
    assert compute_score("toolcalc", called, truth) == {"score": 1.0, "formatted": 1.0, "called_tool": 1.0}
    assert compute_score("toolcalc", "#### 60000", truth) == {"score": 0.0, "formatted": 1.0, "called_tool": 0.0}
    assert compute_score("toolcalc", "56088", truth)["score"] == 0.0


@pytest.mark.skipif(not (MODEL_DIR / "tokenizer.json").exists(), reason="no shipped model (run sft.py)")
def test_shipped_tokenizer_loads_with_autotokenizer_to_the_same_ids(tok):
    from transformers import AutoTokenizer

    shipped = AutoTokenizer.from_pretrained(MODEL_DIR)
    row = make_rows(1, seed=0, split="heldout")[0]
    episode = teacher_episode(*operands(row), random.Random(1), {"bad_call": 1.0})
    assert episode_ids(shipped, row, episode) == episode_ids(tok, row, episode)


def test_report_adds_a_row_of_episode_panels(tmp_path: Path):
    import matplotlib.image

    from coordinator.cli.report import plot_run

    step = {"reward_mean": 0.5, "accuracy": 0.5, "kl": 0.0}
    heights = []
    for extra in ({}, {"tool_calls_per_episode": 0.8, "turns_per_episode": 1.8, "tool_error_rate": 0.1}):
        run = tmp_path / str(len(extra))
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **step, **extra}) + "\n" for s in (1, 2)))
        heights.append(matplotlib.image.imread(plot_run(run)).shape[0])
    assert heights[1] > heights[0] * 1.4
