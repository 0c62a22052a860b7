"""verl-style reward for the word problems: `compute_score(data_source, solution_str, ground_truth, extra_info=None)`.

Plugs into meshrl unchanged (`reward.custom_function: {path: examples/wordproblems/reward.py, name: compute_score}`,
or verl's `custom_reward_function.path=... custom_reward_function.name=...` on the command line).
"""

from __future__ import annotations

import re

# GSM8K's answer line: `#### N` (commas allowed in N, as GSM8K writes thousands).
_FINAL_RE = re.compile(r"####\s*(-?[0-9][0-9,]*)")
_WORKED_RE = re.compile(r"(-?\d+)\s*([+-])\s*(-?\d+)\s*=\s*(-?\d+)")


def final_answer(solution_str: str) -> str | None:
    """The number after the last `####`, commas removed; None when the response has no answer line."""
    found = _FINAL_RE.findall(solution_str)
    return found[-1].replace(",", "") if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 for the right final answer, 0.0 otherwise; the dict's other keys are logged as metrics:
    `formatted` (an answer line was there) and `worked_ok` (the worked line's arithmetic is right)."""
    answer = final_answer(solution_str)
    worked = _WORKED_RE.search(solution_str)
    worked_ok = bool(worked) and (int(worked[1]) + (1 if worked[2] == "+" else -1) * int(worked[3])
                                  == int(worked[4]))
    return {"score": 1.0 if answer is not None and answer == str(ground_truth).strip() else 0.0,
            "formatted": float(answer is not None), "worked_ok": float(worked_ok)}
