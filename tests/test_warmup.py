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


def test_big_token_buckets_keep_one_sequence_and_the_large_sequence_buckets():
    """Under T tokens only 1, the ladder's buckets of at least T / 8 and the largest are compiled:
    a lone sequence keeps its bucket, a few sequences of a big step pad up."""
    plan = BucketPlan.from_limits(512, 64, 2048, 16)
    assert [plan.seqs_for(t) for t in (4, 32, 128, 512)] == [(1, 4), (1, 4, 16, 32), (1, 16, 64), (1, 64)]
    assert len(plan.buckets()) == 20
    assert plan.select(300, 1, 9) == Bucket(512, 1, 128)
    assert plan.select(300, 2, 9) == Bucket(512, 64, 128)
    assert plan.select(100, 5, 9) == Bucket(128, 16, 128)


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


def test_self_check_case_gives_every_sequence_pages_of_its_own():
    """The self-check compares the written caches exactly: no two live tokens may write one slot."""
    from jaxrunner.runner.warmup import self_check_case

    for seed in range(10):
        meta = self_check_case(Bucket(64, 8, 16), 8, 4, 2, 64, "float32", jax.random.key(seed)).meta
        live = np.diff(meta.cu_q_lens)[: int(meta.num_seqs)].sum()
        pages = [meta.page_indices[s, : -(-int(meta.kv_lens[s]) // 8)] for s in range(int(meta.num_seqs))]
        owned = np.concatenate(pages)
        assert np.all(owned > 0) and len(set(owned.tolist())) == len(owned)
        assert len(set(meta.slot_mapping[:live].tolist())) == live


def test_self_check_runs_jax_tpu_through_the_combined_pool_serving_uses():
    """For ``jax_tpu`` the self-check calls what a served layer calls, ``write_kv_and_attend``
    over jax's one K/V-interleaved pool (``kernels.kv_pool_shapes``), holding the reference's K
    and V; lowered for TPU it is the scatter into that pool and jax's kernel reading it where it
    lies, as in the engine (jax's kernel runs on TPU only: this CPU lowers it)."""
    from jaxrunner import kernels
    from jaxrunner.kernels import jax_tpu
    from jaxrunner.kernels.testing import lowering_context
    from jaxrunner.runner import warmup

    if jax_tpu.available() is not None:
        pytest.skip(jax_tpu.available())
    case = warmup.self_check_case(Bucket(32, 4, 8), 16, 8, 2, 128, "bfloat16", jax.random.key(0))
    args = case.layer_args("jax_tpu")
    (pool,) = args[3]
    assert pool.shape == kernels.kv_pool_shapes("jax_tpu", case.k_pages.shape[0], 16, 2, 128)[0]
    k_pages, v_pages = kernels.kv_from_pools(args[3])
    assert np.array_equal(k_pages, case.k_pages) and np.array_equal(v_pages, case.v_pages)
    assert case.layer_args("reference")[3] == (case.k_pages, case.v_pages)
    with lowering_context("tpu"):
        text = warmup._checked_layer.trace(*args, sm_scale=0.1, impl="jax_tpu", max_prefill_seqs=None).lower(
            lowering_platforms=("tpu",)).as_text()
    pool_type = "tensor<{}xbf16>".format("x".join(map(str, pool.shape)))
    kernel_call = next(line for line in text.splitlines() if "tpu_custom_call" in line)
    assert pool_type in kernel_call and "stablehlo.scatter" in text and "stablehlo.gather" not in text


@pytest.fixture
def tpu_kernel_on_cpu(monkeypatch):
    """jax's TPU kernel runs on TPU only: ``install(swap_kv)`` stands jax's own reference of the
    same kernel (``ref_ragged_paged_attention``, same layout and contract) in for it, so the
    self-check's ``jax_tpu`` path runs here end to end: the combined pool, the write into it, the
    wrapper's page handling. ``swap_kv``: read the pool with K and V swapped, a miscompiled layout.
    JAX's caches are cleared around it: what was traced with the stand-in must not outlive it."""
    from jaxrunner.kernels import jax_tpu

    if jax_tpu.available() is not None:
        pytest.skip(jax_tpu.available())
    import jax.experimental.pallas.ops.tpu.ragged_paged_attention as jax_rpa

    def install(swap_kv: bool = False) -> None:
        def reference_kernel(q, kv_pages, *meta, num_kv_pages_per_block=None, num_queries_per_block=None, **kw):
            if swap_kv:
                kv_pages = kv_pages.reshape(*kv_pages.shape[:2], -1, 2, kv_pages.shape[-1])[..., ::-1, :].reshape(
                    kv_pages.shape)

            def on_host(*arrays):  # the reference loops over the live sequences: it needs concrete values
                live = np.asarray(jax_rpa.ref_ragged_paged_attention(*arrays, **kw), q.dtype)  # live tokens only
                return np.concatenate([live, np.zeros((q.shape[0] - len(live), *q.shape[1:]), q.dtype)])

            return jax.pure_callback(on_host, jax.ShapeDtypeStruct(q.shape, q.dtype), q, kv_pages, *meta)

        monkeypatch.setattr(jax_rpa, "ragged_paged_attention", reference_kernel)
        jax.clear_caches()

    yield install
    jax.clear_caches()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_self_check_runs_the_jax_tpu_path_end_to_end(tpu_kernel_on_cpu, dtype):
    from jaxrunner.runner.warmup import attention_self_check

    tpu_kernel_on_cpu()
    error = attention_self_check("jax_tpu", Bucket(32, 4, 8), 16, 8, 2, 128, dtype, jax.random.key(1), 4)
    assert error <= (1e-5 if dtype == "float32" else 3e-2)


def test_self_check_stops_a_jax_tpu_path_that_reads_its_pool_wrong(tpu_kernel_on_cpu):
    from jaxrunner.runner.warmup import attention_self_check

    tpu_kernel_on_cpu(swap_kv=True)
    with pytest.raises(StartupError, match="'jax_tpu' differs from the reference"):
        attention_self_check("jax_tpu", Bucket(32, 4, 8), 16, 8, 2, 128, "float32", jax.random.key(1), 4)
