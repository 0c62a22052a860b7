"""A user reward function that takes its time, so a test can kill a reward replica while a Score call is in flight."""

import time

from services.reward.functions import exact_match


def exact_match_slowly(*, prompt, response, response_ids, ground_truth, data_source, delay_s: float = 0.05):
    time.sleep(delay_s)
    return exact_match(prompt=prompt, response=response, response_ids=response_ids, ground_truth=ground_truth,
                       data_source=data_source)
