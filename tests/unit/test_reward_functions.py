"""Built-in rule rewards on hand-made cases."""

import pytest

from services.reward.functions import REWARD_FUNCTIONS, answers_equal, last_boxed, parse_number


def call(name, response, ground_truth="", *, response_ids=(), **params):
    return REWARD_FUNCTIONS[name](prompt="p", response=response, response_ids=list(response_ids),
                                  ground_truth=ground_truth, data_source="test", **params)


@pytest.mark.parametrize("response", ["82", " 82", "82\n", "82.0", "+82", "82.00", " +82.0 "])
def test_exact_match_treats_equal_numbers_as_equal(response):
    assert call("exact_match", response, "82") == 1.0


@pytest.mark.parametrize("response", ["83", "8 2", "82a", "", "-82", "820"])
def test_exact_match_rejects_different_answers(response):
    assert call("exact_match", response, "82") == 0.0


def test_exact_match_compares_text_after_stripping_whitespace():
    assert call("exact_match", "  Paris\n", "Paris") == 1.0
    assert call("exact_match", "paris", "Paris") == 0.0


def test_nan_and_infinity_are_not_numbers_so_only_identical_text_matches():
    assert parse_number("nan") is None and parse_number("Infinity") is None
    assert not answers_equal("nan", "NaN")
    assert not answers_equal("inf", "Infinity")


def test_gsm8k_takes_the_last_number_after_the_hashes_without_commas():
    response = "She has 3 + 4 = 7 apples. #### 5\nWait, recount. #### 1,234"
    assert call("gsm8k", response, "1234") == 1.0
    assert call("gsm8k", response, "5") == 0.0


def test_gsm8k_reads_the_answer_out_of_a_full_ground_truth_solution():
    solution = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert call("gsm8k", "so 48 + 24 = 72\n#### 72", solution) == 1.0
    assert call("gsm8k", "#### 72.0", solution) == 1.0
    assert call("gsm8k", "#### $72", solution) == 1.0


def test_gsm8k_strict_mode_gives_nothing_without_hashes_and_flexible_takes_the_last_number():
    assert call("gsm8k", "the answer is 72", "72") == 0.0
    assert call("gsm8k", "the answer is 1,072", "1072", mode="flexible") == 1.0


def test_gsm8k_gives_format_score_to_a_well_formed_wrong_answer():
    assert call("gsm8k", "#### 71", "72", format_score=0.1) == pytest.approx(0.1)


def test_last_boxed_handles_nested_braces_and_picks_the_last_box():
    text = r"first \boxed{1} then \boxed{\frac{a}{b^{2}}} done"
    assert last_boxed(text) == r"\frac{a}{b^{2}}"
    assert last_boxed(r"\boxed{unclosed {x}") is None
    assert last_boxed("no box") is None


def test_boxed_compares_the_last_box_with_a_bare_or_boxed_ground_truth():
    assert call("boxed", r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}") == 1.0
    assert call("boxed", r"\boxed{ 42 }", r"The answer is \boxed{42.0}") == 1.0
    assert call("boxed", r"\boxed{41}", "42") == 0.0
    assert call("boxed", "42", "42") == 0.0  # no box, no reward


def test_format_fullmatch_requires_the_whole_response_and_search_does_not():
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    good = "<think>a\nb</think>\n<answer>7</answer>"
    assert call("format", good, pattern=pattern) == 1.0
    assert call("format", "preamble " + good, pattern=pattern) == 0.0
    assert call("format", "preamble " + good, pattern=pattern, match="search") == 1.0


def test_format_without_a_pattern_or_with_a_broken_one_names_the_param():
    with pytest.raises(ValueError, match="params.pattern"):
        call("format", "x")
    with pytest.raises(ValueError, match="params.pattern"):
        call("format", "x", pattern="(")


def test_length_penalty_is_zero_up_to_target_then_falls_linearly_to_minus_scale():
    def pen(n):
        return call("length_penalty", "x" * n, response_ids=range(n), max_length=20, target=10, scale=2.0)

    assert pen(0) == 0.0 and pen(10) == 0.0
    assert pen(15) == pytest.approx(-1.0)
    assert pen(20) == pytest.approx(-2.0) and pen(50) == pytest.approx(-2.0)
    values = [pen(n) for n in range(0, 30)]
    assert all(a >= b for a, b in zip(values, values[1:])) and max(values) <= 0.0


def test_length_penalty_counts_characters_when_asked_and_needs_token_ids_otherwise():
    assert call("length_penalty", "abcd", max_length=8, unit="chars") == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="response_ids"):
        call("length_penalty", "abcd", max_length=8)
    with pytest.raises(ValueError, match="params.max_length"):
        call("length_penalty", "abcd", max_length=0, unit="chars")
