"""Speculative decoding with n-gram proposals: the proposer, the options, exact greedy output, the
target distribution under rejection sampling, rollback of rejected KV, no compiles while serving."""
from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from scipy import stats

from engine_helpers import count_compilations, make_llm, random_prompts, token_ids
from jaxrunner import SamplingParams
from jaxrunner.config import EngineConfig
from jaxrunner.engine import page_allocator
from jaxrunner.engine.spec_decode import NgramProposer
from jaxrunner.runner import sampler
from jaxrunner.runner.step_batch import SamplingMetadata
from jaxrunner.runner.buckets import BucketPlan

SPEC = dict(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


# ----------------------------------------------------------------------------- proposer
def test_ngram_proposes_what_followed_the_last_occurrence():
    proposer = NgramProposer(3, min_n=1, max_n=3)
    assert proposer.propose([5, 6, 7, 8, 9, 5, 6, 7]) == [8, 9, 5]
    # the longest n-gram wins over a later shorter match; its last occurrence is taken
    assert proposer.propose([1, 2, 3, 4, 9, 3, 7, 1, 2, 3]) == [4, 9, 3]
    assert proposer.propose([1, 2, 3, 1, 2, 3, 5, 1, 2, 3]) == [5, 1, 2]
    assert proposer.propose([1, 2, 3, 4]) == []           # nothing repeats
    assert proposer.propose([4, 4, 4, 4, 4], limit=2) == [4, 4]  # an occurrence with room for 2
    assert proposer.propose([4, 4, 4, 4]) == [4]  # the only 3-gram occurrence has one successor
    assert proposer.propose([5, 6, 7, 5, 6], limit=0) == []
    assert NgramProposer(3, min_n=2, max_n=3).propose([1, 2, 3, 1]) == []  # 1-grams are below min


@pytest.mark.parametrize("options, field", [
    (dict(speculative_method="medusa"), "speculative_method"),
    (dict(num_speculative_tokens=3), "num_speculative_tokens"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_method="ngram", prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
    (dict(speculative_method="ngram", num_speculative_tokens=64, max_num_batched_tokens=64), "num_speculative_tokens"),
])
def test_bad_speculative_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        EngineConfig(**options)


def test_speculative_defaults():
    config = EngineConfig(speculative_method="ngram")
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (3, 2, 4)


def test_every_bucket_has_room_for_the_proposals_a_step_can_carry():
    plan = BucketPlan.from_limits(64, 8, 128, 8, num_speculative_tokens=3)
    for tokens in range(1, 65):
        for seqs in range(1, min(tokens, 8) + 1):
            bucket = plan.select(tokens, seqs, 16)
            assert bucket.num_draft_rows >= min(tokens - seqs, 3 * min(seqs, 8))
    assert all(b.num_draft_rows == 0 for b in BucketPlan.from_limits(64, 8, 128, 8).buckets())


# ----------------------------------------------------------------------------- rejection sampling
def _verify(logits: np.ndarray, draft: int, temperature: float, draws: int, **filters) -> np.ndarray:
    """Tokens of ``draws`` rows (seeds 0..draws-1) that each verify ``draft`` under ``logits``."""
    params = SamplingMetadata.empty(draws, 16, vocab_size=logits.shape[-1])
    params.temperature[:] = temperature
    params.seeds[:] = np.arange(draws)
    params.positions[:] = 7
    for name, value in filters.items():
        getattr(params, name)[:] = value
    params = dataclasses.replace(params, draft_tokens=np.full(draws, draft, np.int32))
    out = jax.jit(sampler.sample)(np.tile(logits, (draws, 1)), params)
    return np.asarray(out["tokens"])


@pytest.mark.parametrize("draft", [0, 3, 5])  # the likeliest token, a middling one, one filtered out
def test_rejection_sampling_keeps_the_target_distribution(draft):
    probs = np.array([0.3, 0.2, 0.15, 0.15, 0.1, 0.05, 0.03, 0.02] + [1e-4] * 24, np.float32)  # >= MAX_LOGPROBS
    logits = np.log(probs)
    temperature, top_k, draws = 0.8, 5, 20000
    tokens = _verify(logits, draft, temperature, draws, top_k=top_k)
    target = np.exp(logits.astype(np.float64) / temperature)
    target[np.argsort(-logits)[top_k:]] = 0
    target /= target.sum()
    counts = np.bincount(tokens, minlength=len(logits))
    assert counts[target == 0].sum() == 0
    support = target > 0
    _, p_value = stats.chisquare(counts[support], target[support] * draws)
    assert p_value > 1e-3, (counts / draws, target)


def test_greedy_rows_verify_against_the_argmax():
    logits = np.log(np.array([0.1, 0.6, 0.3] + [1e-3] * 21, np.float32))
    assert set(_verify(logits, 1, 0.0, 4)) == {1}
    assert set(_verify(logits, 2, 0.0, 4)) == {1}


# ----------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def plain(tiny_checkpoints):
    return make_llm(tiny_checkpoints["llama"], async_scheduling=False)


@pytest.fixture(scope="module")
def spec(tiny_checkpoints):
    return make_llm(tiny_checkpoints["llama"], **SPEC)


@pytest.fixture(scope="module")
def workload(plain):
    """Repetitive prompts (a phrase said several times) and random ones."""
    vocab = plain.engine.model.config.vocab_size
    rng = np.random.default_rng(3)
    repetitive = [{"prompt_token_ids": rng.integers(3, vocab, rng.integers(3, 7)).tolist() * 5} for _ in range(5)]
    return repetitive + random_prompts(5, vocab, 5, 40, seed=4)


def registered_keys_of(allocator, sequences) -> set:
    """Prefix-cache keys of every full page of the given token sequences."""
    keys = set()
    for tokens in sequences:
        parent = page_allocator._ROOT_HASH
        for page in range(len(tokens) // allocator.page_size):
            key = allocator._key(parent, tokens, page)
            keys.add(key)
            parent = hash(key)
    return keys


def assert_no_pages_held(llm):
    allocator = llm.engine.scheduler.allocator
    allocator.check_invariants()
    assert allocator.num_used_pages == 0
    assert not llm.engine.has_unfinished_requests()


def test_greedy_output_is_token_identical(plain, spec, workload):
    """Speculation changes nothing in greedy outputs, for requests batched with others that cannot
    speculate (penalties) or sample; the repetitive prompts do accept proposals; rejected
    proposals leave no page behind and never reach the prefix cache."""
    penalized = SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    params = [GREEDY] * len(workload) + [penalized, sampled]
    prompts = workload + workload[:2]
    expected = token_ids(plain.generate(prompts, params, use_tqdm=False))
    spec.engine.scheduler.allocator.reset_prefix_cache()
    outputs = spec.generate(prompts, params, use_tqdm=False)
    got = token_ids(outputs)
    assert got[:len(workload) + 1] == expected[:len(workload) + 1]
    assert len(got[-1]) == 12
    stats_ = spec.engine.stats()
    assert stats_["num_accepted_draft_tokens"] > 0 and 0 < stats_["spec_acceptance_rate"] <= 1
    repetitive = outputs[:5]
    assert sum(o.num_draft_tokens for o in repetitive) > 0
    assert sum(o.num_accepted_draft_tokens for o in repetitive) > 0
    assert outputs[len(workload)].num_draft_tokens == 0  # penalties: never speculates
    assert_no_pages_held(spec)
    allocator = spec.engine.scheduler.allocator
    real = [o.prompt_token_ids + o.outputs[0].token_ids for o in outputs]
    assert set(allocator._page_by_key) <= registered_keys_of(allocator, real)


def test_cached_prefix_after_speculation_gives_the_same_output(plain, spec, workload):
    """A prompt that extends a finished speculative request reuses its cached pages; the output
    equals the plain engine's, so the cached KV is that of the accepted tokens only."""
    first = spec.generate(workload[:3], GREEDY, use_tqdm=False)
    follow_ups = [{"prompt_token_ids": o.prompt_token_ids + o.outputs[0].token_ids} for o in first]
    got = spec.generate(follow_ups, GREEDY, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in got) > 0
    assert token_ids(got) == token_ids(plain.generate(follow_ups, GREEDY, use_tqdm=False))
    assert_no_pages_held(spec)


def test_seeded_sampling_with_speculation_is_reproducible(spec, workload):
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
    first = token_ids(spec.generate(workload[:4], params, use_tqdm=False))
    assert first == token_ids(spec.generate(workload[:4], params, use_tqdm=False))


def test_serving_with_speculation_never_compiles(spec, workload):
    mixed = [GREEDY, SamplingParams(temperature=0.9, top_k=20, seed=1, max_tokens=9),
             SamplingParams(temperature=0, logprobs=3, max_tokens=7, stop=["e"]),
             SamplingParams(temperature=0.5, max_tokens=12, min_tokens=4)]
    prompts = workload * 2
    with count_compilations() as compiles:
        outputs = spec.generate(prompts, [mixed[i % len(mixed)] for i in range(len(prompts))], use_tqdm=False)
    assert compiles == []
    assert sum(o.num_accepted_draft_tokens for o in outputs) > 0
    assert_no_pages_held(spec)


def test_vllm_speculative_config_maps_to_engine_options():
    from jaxrunner.llm import _engine_options

    options = _engine_options({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                      "prompt_lookup_max": 3}})
    assert options == {"speculative_method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    with pytest.raises(ValueError, match="speculative_config: unknown key"):
        _engine_options({"speculative_config": {"method": "ngram", "draft_tensor_parallel_size": 2}})


# ----------------------------------------------------------------------------- scheduler rollback
def test_rejected_proposals_are_rolled_back_in_the_scheduler():
    """A verify chunk takes pages for the proposals and budget for them; after a rejection only the
    known token counts as computed, the pages of rejected positions are free again and nothing
    past the computed tokens is registered in the prefix cache."""
    from jaxrunner.engine.page_allocator import PageAllocator
    from jaxrunner.engine.request import Request
    from jaxrunner.engine.scheduler import Scheduler, SchedulerConfig

    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, page_size=4, num_pages=32,
                             max_num_spec_seqs=8)
    allocator = PageAllocator(config.num_pages, config.page_size)
    scheduler = Scheduler(config, allocator, speculative=True)
    request = Request("r", [7, 8, 9, 10, 7, 8], SamplingParams(max_tokens=20))
    scheduler.add(request)
    plan = scheduler.schedule()                   # the prompt: 6 tokens, 2 pages
    assert plan.chunks[0].propose == 18           # guesses wanted for the first decode, capped by max_tokens
    scheduler.update(plan)
    request.append_output(9)                      # "7 8 9" occurred: the lookup proposes 10 7 8
    scheduler.receive_proposal(request, NgramProposer(3, 1, 3).propose(request.all_token_ids, plan.chunks[0].propose))
    plan = scheduler.schedule()
    (chunk,) = plan.chunks
    assert chunk.draft_token_ids == [10, 7, 8] and chunk.num_tokens == 4 and chunk.sample
    assert plan.num_batched_tokens == 4 and len(request.page_ids) == 3  # positions 6..9 reach page 3
    scheduler.update(plan)
    assert request.num_computed_tokens == 7
    request.append_output(5)                      # the model disagreed with the first proposal
    scheduler.accept_drafts(chunk, 0)
    assert request.num_computed_tokens == 7 and len(request.page_ids) == allocator.pages_for_tokens(8) == 2
    assert request.spec_backoff > 0 and request.proposal is None  # no guesses for the next few decodes
    allocator.check_invariants([request])
    assert len(allocator._page_by_key) == 1       # the one full page of computed tokens only
    plan = scheduler.schedule()
    assert plan.chunks[0].draft_token_ids == [] and plan.num_batched_tokens == 1 and plan.chunks[0].propose == 0
    scheduler.update(plan)
    scheduler.finish(request, "abort")
    allocator.check_invariants([])
    assert allocator.num_used_pages == 0


def test_steps_overlap_while_every_request_backs_off(spec, plain, workload):
    """Text with nothing to copy: after a lookup finds nothing the request backs off, and steps
    are dispatched ahead again (async scheduling) with unchanged greedy output."""
    engine, calls = spec.engine, []
    dispatch, fetch = engine.executor.runner.dispatch, engine.executor.runner.fetch
    engine.executor.runner.dispatch = lambda *args: calls.append("dispatch") or dispatch(*args)
    engine.executor.runner.fetch = lambda *args, **kwargs: calls.append("fetch") or fetch(*args, **kwargs)
    prompt = {"prompt_token_ids": list(range(3, 43))}  # no token twice: nothing to look up at first
    try:
        got = spec.generate([prompt], GREEDY, use_tqdm=False)
    finally:
        vars(engine.executor.runner).pop("dispatch"), vars(engine.executor.runner).pop("fetch")
    assert any(calls[i:i + 2] == ["dispatch", "dispatch"] for i in range(len(calls)))
    assert token_ids(got) == token_ids(plain.generate([prompt], GREEDY, use_tqdm=False))


def test_structured_output_with_speculation_is_token_identical_and_checks_each_proposal(plain, spec):
    """Constrained requests speculate: each proposal is verified under the grammar's mask at its
    place, so greedy outputs equal those without speculation and every output keeps the constraint."""
    from jaxrunner.sampling_params import StructuredOutputsParams

    phrase = "the cat sat the cat sat"
    prompts = [f"{phrase} {phrase}", "the cat", "on the mat"]
    constraints = [StructuredOutputsParams(regex="(the cat sat ){1,3}end"),
                   StructuredOutputsParams(choice=[phrase, "a dog"]),
                   StructuredOutputsParams(json={"type": "object", "properties": {"n": {"enum": [1, 2, 3]}},
                                                 "required": ["n"]}, disable_any_whitespace=True)]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=c) for c in constraints]
    expected = plain.generate(prompts, params, use_tqdm=False)
    before = spec.engine.num_draft_tokens
    outputs = spec.generate(prompts, params, use_tqdm=False)
    assert token_ids(outputs) == token_ids(expected)
    assert spec.engine.num_draft_tokens > before
    assert re.fullmatch("(the cat sat ){1,3}end", outputs[0].outputs[0].text), outputs[0].outputs[0]
    assert outputs[1].outputs[0].text in (phrase, "a dog") and outputs[2].outputs[0].text in ('{"n":1}', '{"n":2}',
                                                                                            '{"n":3}')
    assert_no_pages_held(spec)
