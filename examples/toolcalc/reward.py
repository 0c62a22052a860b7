"""verl-style reward for toolcalc: `compute_score(data_source, solution_str, ground_truth, extra_info=None)`.

`solution_str` is the episode's decoded response: the model's turns with the tool observations between them
(`<tool_call>...</tool_call><tool_response>\\n56088\\n</tool_response>#### 56088`). Plug it in as
`reward.custom_function: {path: examples/toolcalc/reward.py, name: compute_score}`.
"""

from __future__ import annotations

import re

# GSM8K's answer line `#### N`; the last one counts (tool observations never contain one).
_FINAL_RE = re.compile(r"####\s*(-?[0-9][0-9,]*)")


def final_answer(solution_str: str) -> str | None:
    """The number after the last `####`, commas removed; None when the response has no answer line."""
    found = _FINAL_RE.findall(solution_str)
    return found[-1].replace(",", "") if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 for the right final answer, else 0.0; the other keys are logged as metrics: `formatted` (an answer line
    was there) and `called_tool` (the response made at least one calculator call)."""
    answer = final_answer(solution_str)
    return {"score": 1.0 if answer is not None and answer == str(ground_truth).strip() else 0.0,
            "formatted": float(answer is not None), "called_tool": float("<tool_call>" in solution_str)}
