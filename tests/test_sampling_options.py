"""vLLM's sampling options through the engine on a tiny random-weight Llama: each changes the
output as it should, bad values are refused at add_request, prompt logprobs equal a full
forward's log_softmax (transformers), and nothing compiles while serving a mix of them."""
from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import count_compilations, make_llm, random_prompts, token_ids
from jaxrunner import SamplingParams
from jaxrunner.engine.request import Request
from jaxrunner.outputs import Logprob
from jaxrunner.engine.step_input import banned_tokens
from jaxrunner.runner.step_batch import MAX_ALLOWED_TOKEN_IDS, MAX_LOGIT_BIAS

GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return make_llm(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def prompts(llm):
    return random_prompts(8, llm.engine.model.config.vocab_size, 3, 40, seed=2)


@pytest.fixture(scope="module")
def reference(llm, prompts):
    return token_ids(llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False))


def generate(llm, prompts, **params):
    return llm.generate(prompts, SamplingParams(**params), use_tqdm=False)


def test_allowed_token_ids_restrict_sampling(llm, prompts):
    allowed = [40, 41, 300]
    for temperature in (0.0, 1.0):
        outs = token_ids(generate(llm, prompts[:4], temperature=temperature, max_tokens=6, ignore_eos=True,
                                  allowed_token_ids=allowed, seed=1))
        assert all(set(t) <= set(allowed) for t in outs)


def test_logit_bias_moves_greedy_output(llm, prompts, reference):
    favoured = 77
    outs = token_ids(generate(llm, prompts[:4], logit_bias={favoured: 100.0}, **GREEDY))
    assert all(t == [favoured] * 8 for t in outs)
    first = reference[0][0]
    unbiased = token_ids(generate(llm, prompts[:1], logit_bias={first: -100.0}, **GREEDY))[0]
    assert unbiased[0] != first


def test_single_token_bad_word_is_never_generated(llm, prompts, reference):
    tokenizer = llm.get_tokenizer()
    for token in reference[1]:
        word = tokenizer.decode([token])
        if word.strip() and tokenizer.encode(word.lstrip(), add_special_tokens=False) == [token]:
            break
    else:
        pytest.skip("no output token decodes to a word of one token")
    out = token_ids(generate(llm, prompts[1:2], bad_words=[word], **GREEDY))[0]
    assert token not in out and out != reference[1]


def test_bad_word_bans_its_last_token_after_the_rest():
    """vLLM's semantics on the host side: the last token is banned only after the others."""
    request = Request("r", [1, 2, 3], SamplingParams(min_tokens=0), max_tokens=8, seed=0,
                      bad_words_token_ids=[[10, 11, 12], [20]])
    assert banned_tokens(request, eos_token_ids=(2,)) == [20]
    request.append_output(10)
    assert banned_tokens(request, (2,)) == [20]
    request.append_output(11)
    assert banned_tokens(request, (2,)) == [12, 20]
    assert request.needs_host_history  # a multi-token word reads the output on the host
    with_min = Request("m", [1], SamplingParams(min_tokens=2, stop_token_ids=[7]), max_tokens=8, seed=0)
    assert banned_tokens(with_min, (2,)) == [2, 7] and not with_min.needs_host_history


def test_multi_token_bad_word(llm, prompts, reference):
    tokenizer = llm.get_tokenizer()
    out = reference[2]
    for i in range(1, len(out) - 1):
        word = tokenizer.decode(out[i:i + 2])
        if word.strip() and word == word.lstrip() and tokenizer.encode(word, add_special_tokens=False) == out[i:i + 2]:
            break
    else:
        pytest.skip("no two output tokens re-encode to themselves")
    banned = token_ids(generate(llm, prompts[2:3], bad_words=[word], **GREEDY))[0]
    assert banned[:i + 1] == out[:i + 1] and banned[i + 1] != out[i + 1]


def test_logprobs_are_logprob_objects_with_ranks(llm, prompts):
    out = generate(llm, prompts[:1], temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logprobs=3)[0].outputs[0]
    for token, entry in zip(out.token_ids, out.logprobs):
        assert all(isinstance(v, Logprob) for v in entry.values())
        top = sorted((v for t, v in entry.items() if t != token or v.rank <= 3), key=lambda v: v.rank)
        assert [v.rank for v in top][:3] == [1, 2, 3]
        better = [v for v in entry.values() if v.logprob > entry[token].logprob + 1e-6]
        assert entry[token].rank >= len(better) + 1
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_logprobs_zero_returns_the_sampled_token(llm, prompts):
    out = generate(llm, prompts[:1], logprobs=0, **GREEDY)[0].outputs[0]
    assert [list(entry) for entry in out.logprobs] == [[t] for t in out.token_ids]
    assert all(entry[t].rank == 1 for t, entry in zip(out.token_ids, out.logprobs))  # greedy
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_cumulative_logprob_comes_with_logprobs_only(llm, prompts):
    """As vLLM: without ``logprobs`` a completion has no cumulative logprob (the sampler skips the
    normalizer for a batch where no row asks), beside one that asks in the same batch."""
    plain, asking = llm.generate(prompts[:2], [SamplingParams(**GREEDY), SamplingParams(logprobs=0, **GREEDY)],
                                 use_tqdm=False)
    assert plain.outputs[0].cumulative_logprob is None and plain.outputs[0].logprobs is None
    assert asking.outputs[0].cumulative_logprob < 0


def test_seed_uses_all_64_bits(llm, prompts):
    sampled = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    low = token_ids(generate(llm, prompts[:1], seed=7, **sampled))[0]
    assert low == token_ids(generate(llm, prompts[:1], seed=7, **sampled))[0]
    assert low != token_ids(generate(llm, prompts[:1], seed=7 + 2**32, **sampled))[0]


def test_max_tokens_none_runs_to_max_model_len(llm):
    prompt = {"prompt_token_ids": list(range(5, 105))}
    out = generate(llm, [prompt], temperature=0.0, max_tokens=None, ignore_eos=True)[0].outputs[0]
    assert len(out.token_ids) == llm.engine.max_model_len - 100 and out.finish_reason == "length"


def test_top_k_zero_and_minus_one_both_disable(llm, prompts):
    outs = [token_ids(generate(llm, prompts[:2], temperature=1.0, seed=3, max_tokens=6, top_k=k)) for k in (0, -1)]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("params, field", [
    (dict(logprobs=21), "logprobs"), (dict(logprobs=10**6), "logprobs"), (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(stop_token_ids=[10**9]), "stop_token_ids"), (dict(logit_bias={512: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[3, 512]), "allowed_token_ids"),
    (dict(logit_bias={t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
    (dict(allowed_token_ids=list(range(MAX_ALLOWED_TOKEN_IDS + 1))), "allowed_token_ids"),
    (dict(bad_words=[f"w{i}" for i in range(70)]), "bad_words"),
])
def test_engine_refuses_what_the_model_cannot_serve(llm, params, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}") as err:
        llm.engine.add_request("bad", {"prompt_token_ids": [5, 6]}, SamplingParams(**params))
    assert any(word in str(err.value) for word in ("[0,", "at most"))
    assert not llm.engine.has_unfinished_requests()
    llm.engine.add_request("bad", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=1))  # id still free
    llm.engine.abort_request("bad")


def full_forward_logprobs(model_dir: str, ids: list[int]) -> np.ndarray:
    """log_softmax of transformers' logits at every prompt position [len(ids), vocab]."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def test_prompt_logprobs_match_a_full_forward(llm, tiny_checkpoints):
    """A prompt longer than the step's token budget (two prefill chunks), served twice: the second
    time its pages are in the prefix cache, which requests with prompt logprobs skip."""
    ids = np.random.default_rng(9).integers(3, 512, 100).tolist()
    expected = full_forward_logprobs(tiny_checkpoints["llama"], ids)
    for _ in range(2):
        out = generate(llm, [{"prompt_token_ids": ids}], prompt_logprobs=3, max_tokens=2, temperature=0.0)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for position in range(1, len(ids)):
            entry, row = out.prompt_logprobs[position], expected[position - 1]
            actual = entry[ids[position]]
            assert actual.logprob == pytest.approx(row[ids[position]], abs=2e-4)
            assert actual.rank == 1 + int(np.sum(row > row[ids[position]] + 1e-9))
            top = np.argsort(-row)[:3]
            assert all(entry[int(t)].rank == r for r, t in enumerate(top, start=1) if int(t) != ids[position])
            assert set(top.tolist()) <= set(entry)
    assert out.num_cached_tokens == 0


def test_serving_new_options_never_compiles(llm, prompts):
    vocab = llm.engine.model.config.vocab_size
    mixed = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=7, allowed_token_ids=list(range(50, 90))),
        SamplingParams(temperature=0, max_tokens=6, logit_bias={7: 5.0, 9: -50.0}, logprobs=0),
        SamplingParams(temperature=0.9, max_tokens=8, bad_words=["the", "fox jumps"], seed=2**40),
        SamplingParams(temperature=0, max_tokens=None, prompt_logprobs=2, logprobs=20),
        SamplingParams(temperature=0.7, top_k=0, max_tokens=5, min_tokens=2, stop_token_ids=[vocab - 1]),
        SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.2, allowed_token_ids=[3, 4, 5]),
    ]
    workload = random_prompts(18, vocab, 3, 90, seed=4)
    with count_compilations() as compiles:
        outputs = llm.generate(workload, [mixed[i % len(mixed)] for i in range(len(workload))], use_tqdm=False)
    assert compiles == []
    assert all(o.finished for o in outputs)
    assert outputs[3].prompt_logprobs is not None and outputs[3].prompt_logprobs[1] is not None


def test_prompt_logprobs_survive_preemption(llm, tiny_checkpoints):
    """A pool too small for the batch preempts requests mid-prompt or mid-output; their prompt
    logprobs (positions recorded before a preemption are kept) equal those of an unpressed engine."""
    workload = random_prompts(6, 512, 40, 70, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    expected = llm.generate(workload, params, use_tqdm=False)
    small = make_llm(tiny_checkpoints["llama"], num_pages=24)
    got = small.generate(workload, params, use_tqdm=False)
    assert small.engine.stats()["num_preemptions"] > 0
    for ours, theirs in zip(got, expected):
        assert ours.prompt_logprobs[0] is None and len(ours.prompt_logprobs) == len(theirs.prompt_logprobs)
        for entry, reference in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:]):
            assert entry.keys() == reference.keys()
            for token, value in entry.items():
                assert value.logprob == pytest.approx(reference[token].logprob, abs=1e-4)
                assert value.rank == reference[token].rank


# A request value for every SamplingParams field (a new field must be added here and to the server's
# request models, or this fails): the server cannot silently drop an option the engine has.
_HTTP_VALUES = {
    "n": 1, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1,
    "presence_penalty": 0.3, "frequency_penalty": 0.2, "seed": 11, "max_tokens": 5, "min_tokens": 2,
    "stop": ["xyz"], "stop_token_ids": [3], "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 1,
    "skip_special_tokens": False, "include_stop_str_in_output": True, "logit_bias": {"5": 1.5},
    "allowed_token_ids": [4, 5, 6], "bad_words": ["no"], "structured_outputs": {"regex": "[a-z]+"},
    "truncate_prompt_tokens": 8,
}


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_sampling_option_reaches_the_engine_over_http(endpoint):
    import dataclasses

    from jaxrunner.entrypoints.openai import protocol

    fields = [f.name for f in dataclasses.fields(SamplingParams)]
    assert sorted(_HTTP_VALUES) == sorted(fields)
    body = {k: v for k, v in _HTTP_VALUES.items() if k not in ("logprobs", "max_tokens")}
    if endpoint == "chat":
        request = protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)
    else:
        request = protocol.CompletionRequest(prompt="hi", **body)
    params = protocol.sampling_params(request, max_tokens=5, logprobs=2, max_model_len=64)
    expected = dict(_HTTP_VALUES, logit_bias={5: 1.5})
    for name in fields:
        value = getattr(params, name)
        if name == "structured_outputs":
            assert value.regex == "[a-z]+"
        else:
            assert value == expected[name], name
