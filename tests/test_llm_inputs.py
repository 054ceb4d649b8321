"""Bad input to LLM.generate/chat/stream: a ValueError naming the field, raised before anything is
queued, and the engine serves the next call as if nothing happened (tiny random-weight Llama)."""
from __future__ import annotations

import pytest

from engine_helpers import make_llm
from jaxrunner import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return make_llm(tiny_checkpoints["llama"])


def assert_nothing_left(llm) -> None:
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.allocator.num_used_pages == 0
    assert llm.engine_loop.num_requests() == 0


@pytest.mark.parametrize("prompts, field", [
    (None, "prompts"),
    (123, "prompts"),
    (b"hello", "prompts"),
    ({"prompt_token_ids": None}, "prompt_token_ids"),
    ({"prompt_token_ids": 5}, "prompt_token_ids"),
    ({"prompt_token_ids": "hello"}, "prompt_token_ids"),
    ({"prompt_token_ids": [5, 6.0, 7]}, "prompt_token_ids"),
    ({"prompt_token_ids": [5, True, 7]}, "prompt_token_ids"),
    ({"text": "hello"}, "prompt"),
    ("lone \ud800 surrogate", "Unicode"),
    (["hi", 123], r"prompts\[1\]"),
    ([], "prompts"),
])
def test_bad_prompt_names_the_field_and_leaves_nothing(llm, prompts, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_nothing_left(llm)
    outputs = llm.generate(["hi"], GREEDY, use_tqdm=False)
    assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == 4


def test_no_orphan_request_runs_on_the_next_call(llm):
    """The first prompt of a bad batch used to stay queued and run, unseen, during the next call."""
    with pytest.raises(ValueError):
        llm.generate(["hi", 123], GREEDY, use_tqdm=False)
    steps = llm.engine.num_steps
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert llm.engine.num_steps - steps == 1  # one prefill step: nobody else was served


@pytest.mark.parametrize("sampling_params, field", [
    ({"temperature": 0}, "sampling_params"),
    ("greedy", "sampling_params"),
    ([GREEDY, {"max_tokens": 3}], r"sampling_params\[1\]"),
    ([GREEDY], "sampling_params"),  # one given for two prompts
])
def test_bad_sampling_params_names_the_field(llm, sampling_params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(["hi", "there"], sampling_params, use_tqdm=False)
    assert_nothing_left(llm)


@pytest.mark.parametrize("messages, field", [
    ([{"role": "user"}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": None}], r"messages\[0\]\.content"),
    ([{"role": 3, "content": "hi"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "hi"}, "hello"], r"messages\[1\]"),
    ("hello", "messages"),
    (None, "messages"),
])
def test_bad_chat_messages_name_the_field(llm, messages, field):
    with pytest.raises(ValueError, match=field):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert_nothing_left(llm)


def test_bad_stream_prompt_raises_before_the_first_item(llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.stream({"prompt_token_ids": [1.5]}, GREEDY)
    assert_nothing_left(llm)


@pytest.mark.parametrize("model", [None, 5, ""])
def test_llm_without_a_model_name_raises(model):
    from jaxrunner import LLM

    with pytest.raises(ValueError, match="model"):
        LLM(model=model)
