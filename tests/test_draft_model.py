"""Speculative decoding with a draft model: exact greedy output, the draft's own KV bookkeeping
(catch-up after rejections, eviction from a small draft pool), no compiles, no pages left."""
from __future__ import annotations

import inspect

import time

import pytest

from conftest import build_tiny_checkpoint
from engine_helpers import count_compilations, make_llm, random_prompts, token_ids
from jaxrunner import LLM, SamplingParams
from jaxrunner.config import EngineConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_checkpoints):
    return make_llm(tiny_checkpoints["llama"], async_scheduling=False)


@pytest.fixture(scope="module")
def self_drafted(tiny_checkpoints):
    """The target is its own draft: every greedy proposal should be accepted, so an acceptance
    rate near 1 shows the draft's KV follows the request exactly through rollbacks."""
    path = tiny_checkpoints["llama"]
    return make_llm(path, speculative_method="draft_model", speculative_model=path, num_speculative_tokens=3)


@pytest.fixture(scope="module")
def other_drafted(tiny_checkpoints):
    """Another family as the draft (same vocabulary, unrelated weights: proposals mostly wrong), a
    draft pool of 30 pages that several long requests overflow, and two prefill chunks per step."""
    return make_llm(tiny_checkpoints["llama"], speculative_method="draft_model",
                    speculative_model=tiny_checkpoints["qwen2"], num_speculative_tokens=4, num_pages=30,
                    max_num_prefill_seqs=2)


@pytest.fixture(scope="module")
def workload(plain):
    vocab = plain.engine.model.config.vocab_size
    return random_prompts(6, vocab, 5, 40, seed=4)


def assert_nothing_held(llm):
    engine = llm.engine
    engine.scheduler.allocator.check_invariants()
    assert engine.scheduler.allocator.num_used_pages == 0 and not engine.has_unfinished_requests()
    proposer = engine.executor.draft_proposer
    assert proposer.num_free_pages == proposer.runner.cache_spec.num_pages - 1  # every page but the scratch one


def test_self_drafted_greedy_output_is_exact_and_accepted(plain, self_drafted, workload):
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    penalized = SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True)
    params = [GREEDY] * len(workload) + [sampled, penalized]
    prompts = workload + workload[:2]
    expected = token_ids(plain.generate(prompts, params, use_tqdm=False))
    with count_compilations() as compiles:
        outputs = self_drafted.generate(prompts, params, use_tqdm=False)
    assert compiles == []
    got = token_ids(outputs)
    assert got[:len(workload)] == expected[:len(workload)] and got[-1] == expected[-1]
    assert len(got[len(workload)]) == 12
    greedy = outputs[:len(workload)]
    proposed = sum(o.num_draft_tokens for o in greedy)
    assert proposed >= len(workload) * 5
    assert sum(o.num_accepted_draft_tokens for o in greedy) >= 0.9 * proposed
    assert outputs[-1].num_draft_tokens == 0  # penalties: never speculates
    assert_nothing_held(self_drafted)


def test_unrelated_draft_keeps_output_exact_in_a_small_draft_pool(plain, other_drafted, workload):
    """A draft model that guesses badly, in a pool too small for every request: the output stays
    exact, and the drafting runs behind the executor (after a step is fetched), never while the
    scheduler plans."""
    proposer = other_drafted.engine.executor.draft_proposer
    dropped, callers = [], set()
    forget, propose_many = proposer.forget, proposer.propose_many
    proposer.forget = lambda request_id: dropped.append(request_id) or forget(request_id)

    def spied(queries):
        callers.update(frame.function for frame in inspect.stack()[1:6])
        return propose_many(queries)

    proposer.propose_many = spied
    long_prompts = random_prompts(10, plain.engine.model.config.vocab_size, 50, 90, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    try:
        with count_compilations() as compiles:
            got = token_ids(other_drafted.generate(long_prompts, params, use_tqdm=False))
    finally:
        vars(proposer).pop("forget")
        vars(proposer).pop("propose_many")
    assert "fetch" in callers and "schedule" not in callers
    assert compiles == []
    assert got == token_ids(plain.generate(long_prompts, params, use_tqdm=False))
    stats = other_drafted.engine.stats()
    assert stats["num_draft_tokens"] > 0 and stats["spec_acceptance_rate"] < 0.5
    assert len(dropped) > len(long_prompts)  # evicted for room, then forgotten when finished
    assert_nothing_held(other_drafted)


def test_draft_options_map_from_vllm_speculative_config():
    from jaxrunner.llm import _engine_options

    options = _engine_options({"speculative_config": {"model": "draft", "num_speculative_tokens": 2,
                                                      "quantization": "int4"}})
    assert options == {"speculative_method": "draft_model", "speculative_model": "draft",
                       "num_speculative_tokens": 2, "speculative_quantization": "int4"}


@pytest.mark.parametrize("options, field", [
    (dict(speculative_method="draft_model"), "speculative_model"),
    (dict(speculative_model="draft"), "speculative_model"),
    (dict(speculative_method="ngram", speculative_model="draft"), "speculative_model"),
    (dict(speculative_method="draft_model", speculative_model="draft", prompt_lookup_max=3), "prompt_lookup_max"),
    (dict(speculative_method="draft_model", speculative_model="draft", speculative_quantization="int3"),
     "speculative_quantization"),
])
def test_bad_draft_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**options)


def test_unusable_draft_fails_before_loading(tiny_checkpoints, tmp_path):
    """A draft that is missing, or whose vocabulary is not the target's, is refused from the config
    files alone, before any weight is read or anything compiles."""
    other_vocab = build_tiny_checkpoint(tmp_path / "vocab256", "llama", vocab_size=256)
    target = tiny_checkpoints["llama"]
    for draft, message in ((str(tmp_path / "missing"), "not found"), (other_vocab, "vocabulary has 256 tokens")):
        start = time.perf_counter()
        with count_compilations() as compiles, pytest.raises(ValueError, match=f"speculative_model: .*{message}"):
            LLM(target, speculative_method="draft_model", speculative_model=draft, progress=False)
        assert compiles == [] and time.perf_counter() - start < 10
