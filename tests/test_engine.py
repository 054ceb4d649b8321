"""The engine end to end on a tiny random-weight Llama: batching, chunking, preemption, prefix
caching, sampling options, bad input, no compiles after warm-up, no leaked pages."""
from __future__ import annotations

import pytest

from engine_helpers import count_compilations, make_llm, random_prompts, token_ids
from jaxrunner import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return make_llm(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def prompts(llm):
    return random_prompts(32, llm.engine.model.config.vocab_size, 3, 60, seed=1)


@pytest.fixture(scope="module")
def alone(llm, prompts):
    """Greedy output of each prompt served on its own."""
    return [token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]


def assert_no_pages_held(llm):
    allocator = llm.engine.scheduler.allocator
    allocator.check_invariants()
    assert allocator.num_used_pages == 0
    assert not llm.engine.has_unfinished_requests()


def test_batch_of_32_matches_each_alone(llm, prompts, alone):
    batched = token_ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert batched == alone
    assert all(len(t) == 8 for t in batched)
    assert_no_pages_held(llm)


@pytest.mark.parametrize("chunked", [True, False])
def test_chunked_prefill_on_and_off_agree(tiny_checkpoints, prompts, alone, chunked):
    other = make_llm(tiny_checkpoints["llama"], enable_chunked_prefill=chunked, max_num_batched_tokens=64)
    long_prompts = prompts[:6]
    assert token_ids(other.generate(long_prompts, GREEDY, use_tqdm=False)) == alone[:6]
    steps = other.engine.stats()["tokens_per_step"]
    assert max(steps) <= 64
    assert_no_pages_held(other)


def test_one_prefill_per_step_keeps_outputs(tiny_checkpoints, prompts, alone):
    """max_num_prefill_seqs=1: the scheduler admits one prefill chunk per step and the attention's
    prefill pass is sized for one sequence; outputs must not change."""
    capped = make_llm(tiny_checkpoints["llama"], max_num_prefill_seqs=1)
    plans = []
    schedule = capped.engine.scheduler.schedule

    def recording_schedule():
        plans.append(schedule())
        return plans[-1]

    capped.engine.scheduler.schedule = recording_schedule
    assert token_ids(capped.generate(prompts[:12], GREEDY, use_tqdm=False)) == alone[:12]
    assert max(sum(c.num_tokens > 1 for c in plan.chunks) for plan in plans) == 1
    assert_no_pages_held(capped)


def test_preemption_keeps_outputs(tiny_checkpoints, prompts, alone):
    small = make_llm(tiny_checkpoints["llama"], num_pages=24)  # 23 usable pages of 8 tokens
    outputs = token_ids(small.generate(prompts[:12], GREEDY, use_tqdm=False))
    assert small.engine.stats()["num_preemptions"] > 0
    assert outputs == alone[:12]
    assert_no_pages_held(small)


def test_prefix_cache_hits_on_shared_system_prompt(llm, tiny_checkpoints):
    vocab = llm.engine.model.config.vocab_size
    system = random_prompts(1, vocab, 40, 40, seed=7)[0]["prompt_token_ids"]
    tails = random_prompts(6, vocab, 2, 10, seed=8)
    shared = [{"prompt_token_ids": system + t["prompt_token_ids"]} for t in tails]
    before = llm.engine.stats()["prefix_cache_hit_tokens"]
    with_cache = token_ids(llm.generate(shared, GREEDY, use_tqdm=False))
    assert llm.engine.stats()["prefix_cache_hit_tokens"] > before
    no_cache = make_llm(tiny_checkpoints["llama"], enable_prefix_caching=False)
    assert token_ids(no_cache.generate(shared, GREEDY, use_tqdm=False)) == with_cache
    assert no_cache.engine.stats()["prefix_cache_hit_tokens"] == 0


def test_seeded_sampling_independent_of_batch(llm, prompts):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    alone = token_ids(llm.generate([prompts[0]], seeded, use_tqdm=False))[0]
    others = [SamplingParams(temperature=0.7, max_tokens=5)] * 5
    batch = token_ids(llm.generate([prompts[0]] + prompts[1:6], [seeded] + others, use_tqdm=False))
    assert batch[0] == alone
    different = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=8, ignore_eos=True)
    assert token_ids(llm.generate([prompts[0]], different, use_tqdm=False))[0] != alone


def test_stop_conditions_and_logprobs(llm, prompts, alone):
    prompt, reference = prompts[2], alone[2]
    stop_id = reference[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    first = reference.index(stop_id)
    assert out.token_ids == reference[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, min_tokens=8,
                                                   stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert len(banned.token_ids) == 8 and stop_id not in banned.token_ids
    assert banned.finish_reason == "length"
    with_logprobs = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                                 use_tqdm=False)[0].outputs[0]
    assert len(with_logprobs.logprobs) == len(with_logprobs.token_ids)
    for token, entry in zip(with_logprobs.token_ids, with_logprobs.logprobs):
        assert token in entry and len(entry) <= 4
        assert entry[token].logprob == pytest.approx(max(e.logprob for e in entry.values()))  # greedy: the best
        assert entry[token].rank == 1


def test_stop_string_trims_text(llm):
    out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    if len(out.text) < 4:
        pytest.skip("random model produced too little text")
    stop = out.text[2:4]
    stopped = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == out.text[: out.text.index(stop)]


def test_stream_never_shows_part_of_a_stop_string(llm):
    """A stop string that spans two tokens: the stream holds its first part back, then drops it."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate(["The quick brown fox"], params, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    ends = [len(tokenizer.decode(out.token_ids[:i], skip_special_tokens=True)) for i in range(1, len(out.token_ids))]
    # a token boundary whose two neighbouring characters first occur together right there
    boundary = next(b for b in ends if 0 < b < len(out.text) and out.text.index(out.text[b - 1:b + 1]) == b - 1)
    stop = out.text[boundary - 1:boundary + 1]
    stopped = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    deltas = list(llm.stream("The quick brown fox", stopped))
    # deltas are never taken back: had the stop's first character been streamed, it would be in the sum
    assert "".join(deltas) == out.text[:boundary - 1]


def test_stream_deltas_add_up(llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    full = llm.generate(["Hello world"], params, use_tqdm=False)[0].outputs[0].text
    assert "".join(llm.stream("Hello world", params)) == full


def test_n_samples(llm, prompts):
    out = llm.generate([prompts[0]], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


@pytest.mark.parametrize("prompt, params, field", [
    ("", None, "prompt"),
    ({"prompt_token_ids": []}, None, "prompt"),
    ({"prompt_token_ids": [1] * 200}, None, "max_model_len"),
    ({"prompt_token_ids": [10**6]}, None, "vocabulary"),
])
def test_bad_input_is_rejected_and_serving_goes_on(llm, prompts, alone, prompt, params, field):
    engine = llm.engine
    engine.add_request("good", prompts[0], GREEDY)
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, params)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("good", prompts[1], GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["good"].outputs[0].token_ids == alone[0]


def test_sampling_params_validation_names_field():
    for kwargs, field in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                          ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_abort_frees_pages(llm, prompts):
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"abort-{i}", prompts[i], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.scheduler.allocator.num_used_pages > 0
    for i in range(4):
        engine.abort_request(f"abort-{i}")
    assert_no_pages_held(llm)


def record_device_calls(engine) -> list[str]:
    """Log the runner's dispatches and waits, in order (the real calls go through)."""
    calls, runner = [], engine.executor.runner
    dispatch, fetch = runner.dispatch, runner.fetch

    def logged_dispatch(*args):
        calls.append("dispatch")
        return dispatch(*args)

    def logged_fetch(*args, **kwargs):
        calls.append("fetch")
        return fetch(*args, **kwargs)

    runner.dispatch, runner.fetch = logged_dispatch, logged_fetch
    return calls


def outputs_of(outputs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outputs]


def test_async_scheduling_overlaps_and_matches_sync(tiny_checkpoints, prompts, alone):
    """Step N+1 is dispatched before step N is waited for, and nothing changes in the outputs:
    greedy and seeded sampling, stop tokens and strings (stops seen one step late), min_tokens,
    logprobs, a pool small enough to preempt, and an abort while a step is in flight."""
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[alone[2][3]]),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10),
              SamplingParams(temperature=0, max_tokens=9, min_tokens=6, stop_token_ids=[alone[4][1]]),
              SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=7, logprobs=2),
              SamplingParams(temperature=0, max_tokens=11, stop=["a"])]
    workload = [(prompts[i], params[i % len(params)]) for i in range(14)]
    results = {}
    for async_scheduling in (False, True):
        llm = make_llm(tiny_checkpoints["llama"], num_pages=24, async_scheduling=async_scheduling)
        engine = llm.engine
        calls = record_device_calls(engine)
        for i, (prompt, sp) in enumerate(workload):
            engine.add_request(str(i), prompt, sp)
        engine.add_request("aborted", prompts[20], SamplingParams(max_tokens=30, ignore_eos=True))
        finished, steps = {}, 0
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
            steps += 1
            if steps == 4:
                engine.abort_request("aborted")
        results[async_scheduling] = outputs_of(finished[str(i)] for i in range(len(workload)))
        assert "aborted" not in finished
        assert engine.stats()["num_preemptions"] > 0
        assert_no_pages_held(llm)
        overlapped = any(calls[i:i + 2] == ["dispatch", "dispatch"] for i in range(len(calls)))
        assert overlapped == async_scheduling
    assert results[True] == results[False]
    assert {reason for _, reason, _ in results[True]} == {"stop", "length"}


def test_penalties_make_async_scheduling_wait(llm, tiny_checkpoints, prompts):
    """Penalties need every past token on the host, so while such a request is unfinished each
    step is waited for before the next is planned; outputs equal the synchronous engine's."""
    penalized = SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, frequency_penalty=0.5,
                               ignore_eos=True)
    calls = record_device_calls(llm.engine)
    try:
        got = outputs_of(llm.generate(prompts[:3], penalized, use_tqdm=False))
    finally:
        vars(llm.engine.executor.runner).pop("dispatch"), vars(llm.engine.executor.runner).pop("fetch")
    assert len(calls) >= 16 and all(calls[i:i + 2] != ["dispatch", "dispatch"] for i in range(len(calls)))
    sync = make_llm(tiny_checkpoints["llama"], async_scheduling=False)
    assert got == outputs_of(sync.generate(prompts[:3], penalized, use_tqdm=False))
    assert got != outputs_of(llm.generate(prompts[:3], GREEDY, use_tqdm=False))  # the penalties did act


def test_request_too_big_for_the_pool_is_rejected(tiny_checkpoints):
    small = make_llm(tiny_checkpoints["llama"], num_pages=6, max_num_seqs=1, max_num_batched_tokens=16)  # 40 slots
    with pytest.raises(ValueError):
        small.engine.add_request("huge", {"prompt_token_ids": [5] * 60}, SamplingParams(max_tokens=20))
    assert not small.engine.has_unfinished_requests()


def test_serving_after_warmup_never_compiles(llm, prompts):
    mixed = [
        SamplingParams(temperature=0, max_tokens=6),
        SamplingParams(temperature=0.8, top_k=20, seed=1, max_tokens=9),
        SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05, max_tokens=7),
        SamplingParams(temperature=0.9, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3,
                       max_tokens=8),
        SamplingParams(temperature=0, logprobs=5, max_tokens=5, min_tokens=3),
        SamplingParams(temperature=0.5, stop=["e"], max_tokens=12),
    ]
    workload = prompts[:24] + [{"prompt_token_ids": prompts[0]["prompt_token_ids"] * 2}]
    params = [mixed[i % len(mixed)] for i in range(len(workload))]
    with count_compilations() as compiles:
        engine = llm.engine
        for i, (prompt, sp) in enumerate(zip(workload, params)):
            engine.add_request(f"mix-{i}", prompt, sp)
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            if steps == 3:
                engine.abort_request("mix-5")
        llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert compiles == []
    assert_no_pages_held(llm)


def test_default_kv_cache_dtype():
    """bfloat16 keeps a float32 pool on CPU only where the XLA scatter would write it: the native
    kernel writes bf16 rows in place."""
    from jaxrunner.runner.startup import default_kv_cache_dtype

    assert default_kv_cache_dtype("bfloat16", "cpu", "xla") == "float32"
    assert default_kv_cache_dtype("bfloat16", "cpu", "native") == "bfloat16"
    assert default_kv_cache_dtype("bfloat16", "gpu", "pallas") == "bfloat16"
    assert default_kv_cache_dtype("float32", "cpu", "native") == "float32"


@pytest.fixture(scope="module")
def fp8_xla_reads(tiny_checkpoints, prompts):
    """Greedy outputs over e4m3 pages through the plain-XLA attention: the oracle the native
    kernel's fp8 pages are held to (both read the same rounded K/V and compute in float32)."""
    xla = make_llm(tiny_checkpoints["llama"], kv_cache_dtype="fp8", attention_impl="xla")
    return token_ids(xla.generate(prompts[:8], GREEDY, use_tqdm=False))


@pytest.mark.parametrize("kv_cache_dtype,pool", [("fp8", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")])
def test_fp8_kv_cache_serves_without_compiles_or_leaks(tiny_checkpoints, prompts, alone, fp8_xla_reads,
                                                       kv_cache_dtype, pool):
    """vLLM's kv_cache_dtype names: pages of one byte a value, half of a bf16 pool's memory. The
    rounding moves outputs away from float pages', but not far; serving compiles nothing."""
    import jax.numpy as jnp

    fp8 = make_llm(tiny_checkpoints["llama"], kv_cache_dtype=kv_cache_dtype)
    runner = fp8.engine.executor.runner
    assert {pool_array.dtype for layer in runner.kv_cache for pool_array in layer} == {jnp.dtype(pool)}
    assert runner.attention_impl == "native"
    with count_compilations() as compiles:
        got = token_ids(fp8.generate(prompts[:8], GREEDY, use_tqdm=False))
    assert compiles == []
    assert_no_pages_held(fp8)
    if kv_cache_dtype == "fp8":
        assert got == fp8_xla_reads
    first_tokens = sum(g[0] == a[0] for g, a in zip(got, alone))
    assert first_tokens >= 6, (got, alone[:8])
