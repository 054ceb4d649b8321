import math

import pytest

from jaxrunner.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens) == (None, 16, 0)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == (None, None, False, None)
    assert p.skip_special_tokens is True
    assert not p.greedy


@pytest.mark.parametrize("temperature, greedy", [(0, True), (0.0, True), (1e-6, True),
                                                 (1e-5, False), (0.7, False), (2.0, False)])
def test_greedy_means_temperature_zero(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_k", -3),
    ("logprobs", 1.5),
    ("prompt_logprobs", -1),
    ("seed", -1),
    ("seed", 2**64),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", 1),
    ("include_stop_str_in_output", "no"),
    ("top_k", -2),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("min_tokens", -1),
    ("n", 0),
    ("logprobs", -1),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("max_tokens", 2.5),
    ("n", True),
    ("seed", "42"),
])
def test_rejects_out_of_range_with_field_and_value(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value)
    assert repr(value) in str(err.value)


def test_min_tokens_may_not_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens=9"):
        SamplingParams(max_tokens=8, min_tokens=9)
    assert SamplingParams(max_tokens=8, min_tokens=8).min_tokens == 8


@pytest.mark.parametrize("field, value", [
    ("top_p", 1.0), ("top_p", 1e-3), ("top_k", -1), ("top_k", 0), ("top_k", 1), ("max_tokens", None), ("prompt_logprobs", 0),
    ("seed", 2**64 - 1), ("include_stop_str_in_output", True), ("min_p", 0.0), ("min_p", 1.0),
    ("presence_penalty", -2.0), ("frequency_penalty", 2.0), ("repetition_penalty", 1e-3),
    ("logprobs", 0), ("logprobs", 5), ("seed", 0), ("temperature", 0), ("max_tokens", 1),
])
def test_accepts_boundaries(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    stops = ["a", "b"]
    p = SamplingParams(stop=stops)
    stops.append("c")
    assert p.stop == ["a", "b"]  # copied, not aliased


def test_bad_stops_rejected():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[1, -2])
    assert SamplingParams(stop_token_ids=(2, 3)).stop_token_ids == [2, 3]


def test_new_fields_default_like_vllm():
    p = SamplingParams()
    assert (p.prompt_logprobs, p.include_stop_str_in_output, p.logit_bias, p.allowed_token_ids, p.bad_words) == (
        None, False, None, None, None)


def test_min_tokens_with_unbounded_max_tokens():
    assert SamplingParams(max_tokens=None, min_tokens=50).min_tokens == 50
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=None, min_tokens=-1)


@pytest.mark.parametrize("field, value", [
    ("logit_bias", [1, 2]), ("logit_bias", {-1: 1.0}), ("logit_bias", {"a": 1.0}), ("logit_bias", {3: math.inf}),
    ("logit_bias", {3: "x"}), ("logit_bias", {True: 1.0}),
    ("allowed_token_ids", []), ("allowed_token_ids", [1, -1]), ("allowed_token_ids", "12"), ("allowed_token_ids", [1.0]),
    ("bad_words", "word"), ("bad_words", [""]), ("bad_words", ["  "]), ("bad_words", [3]),
])
def test_token_options_rejected_with_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**{field: value})


def test_token_options_are_copied():
    bias, allowed, words = {3: 1}, [1, 2], ["x"]
    p = SamplingParams(logit_bias=bias, allowed_token_ids=allowed, bad_words=words)
    bias[4], allowed[0], words[0] = 2.0, 9, "y"
    assert (p.logit_bias, p.allowed_token_ids, p.bad_words) == ({3: 1.0}, [1, 2], ["x"])
