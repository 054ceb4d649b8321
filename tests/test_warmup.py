"""Warm-up on randomized dummy batches, the bucket plan and the start-up report."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from engine_helpers import make_llm
from jaxrunner.runner.buckets import Bucket, BucketPlan
from jaxrunner.runner.memory import StartupError
from jaxrunner.runner.warmup import random_dummy_batch, zeros_dummy_batch

BUCKET = Bucket(64, 8, 16)


def _dummy(seed: int) -> dict:
    return random_dummy_batch(jax.random.key(seed), BUCKET, 8, 96, 512, 128)


def _leaves(batch) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(batch)]


def test_dummy_batches_reproducible_and_seed_dependent():
    a, b, c = _dummy(0), _dummy(0), _dummy(1)
    assert all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b)))
    assert not all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(c)))


def test_dummy_batches_are_valid_and_never_touch_the_scratch_page():
    for seed in range(20):
        batch = _dummy(seed)
        n = batch.num_seqs
        cu, kv = batch.attention.cu_q_lens, batch.attention.kv_lens
        assert 1 <= n <= BUCKET.num_seqs and cu[n] <= BUCKET.num_tokens
        assert np.all(np.diff(cu) >= 0) and np.all(kv[:n] >= np.diff(cu)[:n])
        for s in range(n):
            live_pages = batch.attention.page_indices[s, : -(-int(kv[s]) // 8)]
            assert np.all(live_pages > 0)  # page 0 is the scratch page
        live_slots = batch.attention.slot_mapping[: cu[n]]
        assert np.all(live_slots >= 8)
        assert np.any(batch.token_ids[: cu[n]] != 0)
        feed = batch.feed_rows
        assert np.all(feed[cu[n]:] == -1) and np.all(feed < BUCKET.num_seqs)


def test_pack_step_feeds_a_token_still_on_the_device():
    """Async scheduling: a decode whose input token was sampled by the step in flight gets a
    placeholder id and the row of that step's output to read it from."""
    from jaxrunner.engine.request import Request
    from jaxrunner.engine.scheduler import ScheduledChunk, StepPlan
    from jaxrunner.engine.step_input import build_step_input
    from jaxrunner.runner.batch import pack_step
    from jaxrunner.sampling_params import SamplingParams

    known = Request("known", [5, 6, 7], SamplingParams(max_tokens=4), seed=1)
    known.append_output(8)
    pending = Request("pending", [9, 10], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[3]), seed=2)
    pending.expect_output()
    for request, computed, pages in ((known, 3, [1]), (pending, 2, [2])):
        request.num_computed_tokens, request.page_ids = computed, pages
    plan = StepPlan([ScheduledChunk(known, 3, 1), ScheduledChunk(pending, 2, 1)])
    batch = pack_step(build_step_input(plan, (), feed_rows={"pending": 5}), Bucket(16, 4, 2), 8, 64)
    assert batch.token_ids[:2].tolist() == [8, 0] and batch.feed_rows[:3].tolist() == [-1, 5, -1]
    assert batch.sampling.positions[:2].tolist() == [4, 3]
    assert batch.sampling.banned[1, 0] == 3  # 1 expected output < min_tokens: stop ids stay banned
    with pytest.raises(RuntimeError, match="on the device"):
        build_step_input(plan, ())


def test_random_and_zero_batches_lower_to_the_same_program(tiny_checkpoints):
    llm = make_llm(tiny_checkpoints["llama"])
    runner = llm.engine.executor.runner
    bucket = llm.engine.executor.bucket_plan.buckets()[-1]
    random_batch = random_dummy_batch(jax.random.key(3), bucket, 8, runner.cache_spec.num_pages, 512, 128)
    assert runner.lower(random_batch).as_text() == runner.lower(zeros_dummy_batch(bucket, 8, runner.cfg.vocab_size)).as_text()


def test_startup_report_matches_what_was_allocated(tiny_checkpoints):
    llm = make_llm(tiny_checkpoints["llama"])
    report, runner = llm.startup_report, llm.engine.executor.runner
    assert report["kv_pages"] == runner.kv_cache[0][0].shape[0] == 96
    assert report["kv_bytes"] == runner.cache_spec.nbytes
    assert set(report["buckets"]) == {str(b) for b in llm.engine.executor.bucket_plan.buckets()}
    assert report["attention_impl"] == runner.attention_impl
    assert report["attention_self_check_max_abs_error"] < 1e-3
    assert report["max_concurrency_at_max_model_len"] == pytest.approx(95 * 8 / 128)


def test_weights_over_budget_fail_with_the_shortfall(tiny_checkpoints):
    with pytest.raises(StartupError, match=r"exceed the memory budget .* by [0-9.]+ MiB"):
        make_llm(tiny_checkpoints["llama"], memory_utilization=1e-9)


def test_bucket_plan_is_small_and_covers_every_step():
    plan = BucketPlan.from_limits(512, 64, 2048, 16)
    assert len(plan.buckets()) <= 100
    for tokens, seqs, pages in [(1, 1, 1), (512, 64, 128), (70, 3, 9), (17, 17, 2)]:
        bucket = plan.select(tokens, seqs, pages)
        assert bucket.num_tokens >= tokens and bucket.num_seqs >= seqs and bucket.num_pages >= pages
        assert bucket in plan.buckets()


def test_warmup_contexts_are_bounded_but_one_decode_spans_the_table():
    """Warm-up runs pay for short contexts only; one decode row still reaches far page-table columns."""
    bucket = Bucket(64, 8, 64)
    reached_far = False
    for seed in range(30):
        batch = random_dummy_batch(jax.random.key(seed), bucket, 8, 600, 512, 512, max_context=16)
        n = batch.num_seqs
        q_lens = np.diff(batch.attention.cu_q_lens)[:n]
        context = batch.attention.kv_lens[:n] - q_lens
        over = np.flatnonzero(context > 16)
        assert len(over) <= 1 and all(q_lens[i] == 1 for i in over)
        reached_far |= bool(np.any(context > 256))
    assert reached_far
