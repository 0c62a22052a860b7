"""bench/episodes.py on tiny settings (CPU, the arith model, a real env replica process): the tool-calling workload
does the work it claims, beside a baseline of exactly the same sampled tokens. No timing is asserted."""

from __future__ import annotations

import json
import re

from bench import episodes as bench
from services.env.calculator import evaluate


# Worked by hand from the bench's documented rule (length x (character-code sum mod 997 + 2) + 7):
# "" -> 0 x 2 + 7; "12+7=19": codes 49+50+43+55+61+49+57 = 364, 7 x 366 + 7; "zz 3": 122+122+32+51 = 327, 4 x 329 + 7.
ANSWERS = {"": 7, "12+7=19": 2569, "zz 3": 1323}


def test_the_scripted_parser_reads_every_turn_as_one_calculator_call_the_calculator_answers():
    for text, answer in ANSWERS.items():
        parsed = bench.scripted_calculator_call(text)
        [call] = parsed.calls
        assert call.name == "calculator" and not parsed.errors and parsed.content == text
        assert set(call.arguments) == {"expression"}
        assert evaluate(call.arguments["expression"]) == answer


def test_the_episodes_bench_plays_tool_calls_through_an_env_replica_beside_the_same_token_generate(tmp_path):
    out = tmp_path / "episodes_cpu.json"
    bench.main(["--device", "cpu", "--prompts", "2", "--n", "2", "--turns", "3", "--tokens-per-turn", "4",
                "--rounds", "1", "--no-loop-cases", "--out", str(out)])
    result = json.loads(out.read_text())
    tool = result["tool_calling"]
    cases = tool["cases"]
    episodes = cases["tool_episodes"]
    # 4 episodes x 3 turns, a calculator call after each of the first two turns, none failed
    assert (episodes["rows"], episodes["turns"], episodes["tool_calls"], episodes["tool_errors"]) == (4, 12, 8, 0)
    assert episodes["end_reasons"] == {"max_turns": 4}
    # the observations (the tool turns' template delta) are in the episodes but not among the sampled tokens; the
    # first one is the env replica's calculator answer in the template's tool turn (the arith tokenizer keeps letters
    # and digits of `<tool_response>\n...\n</tool_response>`)
    assert episodes["observation_tokens"] > 0
    assert re.fullmatch(r"toolresponse\d+toolresponse", episodes["first_observation_text"])
    assert episodes["final_context_tokens_max"] >= episodes["prompt_tokens_mean"] + 12 + episodes[
        "observation_tokens"] / 4 - 1
    # the baselines sampled exactly as many tokens, from the same batch
    assert tool["same_sampled_tokens"] is True
    assert cases["generate_same_tokens"]["sampled_tokens"] == episodes["sampled_tokens"] == 4 * 3 * 4
    assert cases["generate_same_tokens"]["rows"] == cases["single_turn_same_tokens"]["rows"] == 4
    assert episodes["batcher_engine_calls_per_round"] >= 3          # at least one engine call per turn
    assert result["provenance"]["source_paths"][-1] == "bench/episodes.py"
    assert "scripted" in tool and "median_s" not in result        # --no-loop-cases: no loop-cost cases
