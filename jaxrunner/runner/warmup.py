"""Warm-up on randomized dummy batches, the attention self-check and the MoE expert-load probe
(the memory budget and KV-pool sizing are ``runner.memory``).

Why random and not zeros: zero token ids, zero positions and all-scratch page tables take different
paths in data-dependent code (dynamic int8 activation scales of zero, sampler branches that never
run, gathers that read only page 0) and hide wrong indexing — a bad gather of zeros still looks like
zeros. Every dummy batch here is drawn from one seeded ``jax.random`` key, so warm-up is
reproducible, and it has exactly the shapes, dtypes and pytree structure serving uses, so nothing
compiles after it.
"""
from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner import kernels
from jaxrunner.runner.batch import (MAX_ALLOWED_TOKEN_IDS, MAX_BANNED_TOKENS, MAX_LOGIT_BIAS, SCRATCH_PAGE,
                                    empty_batch)
from jaxrunner.runner.buckets import Bucket
from jaxrunner.runner.memory import StartupError
# The engine's start-up still calls these through this module; they live in runner.memory.
from jaxrunner.runner.memory import check_pool_fits, check_weights_fit, memory_budget, size_kv_pool  # noqa: F401

WARMUP_MAX_CONTEXT = 256       # cached tokens before a warm-up query (one decode per batch goes up to the full width)
SELF_CHECK_MAX_PAGES = 32      # page-table width of the attention self-check's case


# ----------------------------------------------------------------------------- dummy batches
def _split_tokens(rng: np.random.Generator, num_tokens: int, num_seqs: int,
                  max_prefill_seqs: int | None = None) -> np.ndarray:
    """Random query lengths: a mix of decodes (1 token) and prefill chunks summing to <= num_tokens,
    with at most ``max_prefill_seqs`` prefill chunks (the scheduler's bound)."""
    is_decode = rng.random(num_seqs) < 0.5
    if max_prefill_seqs is not None:
        is_decode[np.flatnonzero(~is_decode)[max_prefill_seqs:]] = True
    q_lens = np.ones(num_seqs, np.int64)
    prefill = np.flatnonzero(~is_decode)
    spare = num_tokens - num_seqs
    if len(prefill) and spare > 0:
        extra = rng.multinomial(rng.integers(0, spare + 1), np.full(len(prefill), 1 / len(prefill)))
        q_lens[prefill] += extra
    return q_lens


def _fill_random_sampling(rng: np.random.Generator, sampling: dict, num_seqs: int, vocab: int) -> None:
    """Random per-row sampling parameters; each feature is on for the whole batch or not, so that
    across buckets both sides of every ``lax.cond`` in the sampler execute."""
    on = lambda: rng.random() < 0.5  # noqa: E731
    rows = slice(0, num_seqs)
    sampling["temperature"][rows] = np.where(rng.random(num_seqs) < 0.5, 0.0, rng.uniform(0.3, 1.5, num_seqs))
    sampling["seeds"][rows] = rng.integers(0, 2**32, num_seqs, dtype=np.uint64).astype(np.uint32)
    sampling["seeds_high"][rows] = rng.integers(0, 2**32, num_seqs, dtype=np.uint64).astype(np.uint32)
    if on():
        sampling["top_k"][rows] = rng.integers(0, 64, num_seqs)
        sampling["top_p"][rows] = rng.uniform(0.3, 1.0, num_seqs)
        sampling["min_p"][rows] = np.where(rng.random(num_seqs) < 0.5, 0.0, rng.uniform(0, 0.2, num_seqs))
    if on():
        sampling["repetition_penalty"][rows] = rng.uniform(0.8, 1.5, num_seqs)
        sampling["presence_penalty"][rows] = rng.uniform(-1, 1, num_seqs)
        sampling["frequency_penalty"][rows] = rng.uniform(-1, 1, num_seqs)
        history = sampling["history"]
        history[rows] = rng.integers(0, vocab, (num_seqs, history.shape[1]))
    if on():
        sampling["banned"][rows, : MAX_BANNED_TOKENS // 2] = rng.integers(0, vocab, (num_seqs, MAX_BANNED_TOKENS // 2))
    if on():
        sampling["num_logprobs"][rows] = rng.integers(-1, 21, num_seqs)
    if on():  # some rows restricted to a few tokens, the others free
        restricted = np.flatnonzero(rng.random(num_seqs) < 0.5)
        width = int(rng.integers(1, MAX_ALLOWED_TOKEN_IDS + 1))
        sampling["allowed_token_ids"][restricted, :width] = rng.integers(0, vocab, (len(restricted), width))
    if on():
        width = int(rng.integers(1, MAX_LOGIT_BIAS + 1))
        sampling["logit_bias_ids"][rows, :width] = rng.integers(0, vocab, (num_seqs, width))
        sampling["logit_bias_values"][rows, :width] = rng.uniform(-100, 100, (num_seqs, width))


def random_dummy_batch(key: jax.Array, bucket: Bucket, page_size: int, num_pages: int, vocab_size: int,
                       max_model_len: int, max_prefill_seqs: int | None = None,
                       max_context: int | None = None) -> dict:
    """A batch of ``bucket``'s shape filled with random but *valid* contents (see module docstring).

    ``max_context`` bounds the cached tokens before each query, except for the first decode,
    which still reaches anywhere up to the full page table: attention's cost follows the real
    context lengths, and a warm-up run need not pay for 16 sequences of the model's full length
    (the executable, and so what is proven, is the same)."""
    seed = int(jax.random.randint(key, (), 0, np.iinfo(np.int32).max))
    rng = np.random.default_rng(seed)
    batch = empty_batch(bucket, page_size)
    num_seqs = int(rng.integers(1, bucket.num_seqs + 1))
    q_lens = _split_tokens(rng, bucket.num_tokens, num_seqs, max_prefill_seqs)
    max_len = min(max_model_len, bucket.num_pages * page_size)
    long_row = int(np.argmax(q_lens == 1)) if np.any(q_lens == 1) else -1
    cursor = 0
    for s, q_len in enumerate(q_lens):
        q_len = int(min(q_len, max_len))
        longest = max_len if max_context is None or s == long_row else min(max_len, q_len + max_context)
        kv_len = int(rng.integers(q_len, longest + 1))
        needed = math.ceil(kv_len / page_size)  # a small pool may repeat pages: still valid, never scratch
        pages = rng.choice(np.arange(1, num_pages), size=needed, replace=needed > num_pages - 1)
        positions = np.arange(kv_len - q_len, kv_len)
        rows = slice(cursor, cursor + q_len)
        batch["token_ids"][rows] = rng.integers(0, vocab_size, q_len)
        batch["positions"][rows] = positions
        batch["slot_mapping"][rows] = pages[positions // page_size] * page_size + positions % page_size
        batch["page_indices"][s, : len(pages)] = pages
        batch["kv_lens"][s] = kv_len
        cursor += q_len
        batch["cu_q_lens"][s + 1] = cursor
        batch["logits_indices"][s] = cursor - 1
        batch["sampling"]["positions"][s] = kv_len
        batch["sampling"]["prompt_lens"][s] = int(rng.integers(1, kv_len + 1))
    batch["cu_q_lens"][num_seqs + 1:] = cursor
    batch["num_seqs"][...] = num_seqs
    # some tokens read the previous step's sampled ids on the device (async scheduling)
    fed = rng.random(cursor) < 0.25
    batch["feed_rows"][:cursor] = np.where(fed, rng.integers(0, bucket.num_seqs, cursor), -1)
    _fill_random_sampling(rng, batch["sampling"], num_seqs, vocab_size)
    if "draft_rows" in batch:  # speculative verification: random rows, some checking a proposal
        spec, rows = batch["draft_rows"], len(batch["draft_rows"]["tokens"])
        spec["logits_indices"][:] = rng.integers(0, max(cursor, 1), rows)
        spec["seqs"][:] = rng.integers(0, num_seqs, rows)
        spec["positions"][:] = rng.integers(0, max_len, rows)
        spec["tokens"][:] = np.where(rng.random(rows) < 0.5, rng.integers(0, vocab_size, rows), -1)
    if rng.random() < 0.5:  # prompt logprobs for some rows (the next prompt token's id)
        wanted = rng.random(cursor) < 0.5
        batch["prompt_targets"][:cursor] = np.where(wanted, rng.integers(0, vocab_size, cursor), -1)
    return batch


def zeros_dummy_batch(bucket: Bucket, page_size: int) -> dict:
    """The zero-filled batch (for comparison only): same shapes, so the same executables."""
    batch = empty_batch(bucket, page_size)
    batch["num_seqs"][...] = bucket.num_seqs
    return batch


# ----------------------------------------------------------------------------- self-check
# one jitted function for every engine of the process: a second start-up compiles the check again only for new shapes
_checked_attention = jax.jit(kernels.ragged_paged_attention, static_argnames=("sm_scale", "impl", "max_prefill_seqs"))


def attention_self_check(impl: str, bucket: Bucket, page_size: int, num_q_heads: int, num_kv_heads: int,
                         head_dim: int, dtype, key: jax.Array, max_prefill_seqs: int | None = None) -> float:
    """Compare the serving attention impl with the reference on a random case of ``bucket``'s
    tokens and sequences, with a page table of at most ``SELF_CHECK_MAX_PAGES`` (the reference is
    dense: at the model's full length its case alone took seconds at every start).

    Catches a kernel that miscompiles on new hardware before any request sees it. Returns the max
    abs difference; raises StartupError when it exceeds the tolerance that the cache dtype and the
    precision of the impl's dots allow (``kernels.tolerance.attention_tolerance``: a multiple of
    the dot format's unit roundoff times max|v|, plus float32 accumulation over the longest
    sequence): about 1e-6 for float32 caches on full-precision dots, 2e-3 on TF32, 0.07 for
    bfloat16 caches.
    """
    from jaxrunner.kernels.tolerance import attention_tolerance

    bucket = Bucket(bucket.num_tokens, bucket.num_seqs, min(bucket.num_pages, SELF_CHECK_MAX_PAGES))
    num_pages = bucket.num_seqs * bucket.num_pages + 1
    dummy = random_dummy_batch(key, bucket, page_size, num_pages, 64, 1 << 30, max_prefill_seqs)
    k1, k2, k3 = jax.random.split(key, 3)
    q = jax.random.normal(k1, (bucket.num_tokens, num_q_heads, head_dim), jnp.float32).astype(dtype)
    pool_shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_pages = jax.random.normal(k2, pool_shape, jnp.float32).astype(dtype)
    v_pages = jax.random.normal(k3, pool_shape, jnp.float32).astype(dtype)
    args = (q, k_pages, v_pages, dummy["kv_lens"], dummy["page_indices"], dummy["cu_q_lens"], dummy["num_seqs"])
    outs = {}
    for name in (impl, "reference"):
        out = _checked_attention(*args, sm_scale=head_dim ** -0.5, impl=name, max_prefill_seqs=max_prefill_seqs)
        outs[name] = np.asarray(out, np.float32)[: int(dummy["cu_q_lens"][-1])]
    error = float(np.max(np.abs(outs[impl] - outs["reference"]), initial=0.0))
    tolerance = attention_tolerance(impl, dtype, max_abs_v=float(jnp.max(jnp.abs(v_pages.astype(jnp.float32)))),
                                    max_kv_len=int(np.max(dummy["kv_lens"], initial=1)))
    if not np.isfinite(error) or error > tolerance:
        raise StartupError(f"attention self-check failed: impl {impl!r} differs from the reference by "
                           f"{error:.3g} (tolerance {tolerance:.3g} for {jnp.dtype(dtype).name}) on bucket {bucket}")
    return error


# ----------------------------------------------------------------------------- warm-up
def warm_up(runner, buckets: list[Bucket], *, key: jax.Array, mode: str, page_size: int, vocab_size: int,
            max_model_len: int, progress: bool = False, max_prefill_seqs: int | None = None) -> tuple[dict, dict]:
    """Compile every bucket, then execute each once on its dummy batch and check the outputs.

    Running (not only compiling) matters: it fills the dispatch path and proves the executable
    works on data. Returns (per-bucket trace/lower/compile/run seconds, persistent-cache outcome
    and XLA's memory analysis; wall seconds of each phase). The phases are consecutive, so they add
    up to warm-up's wall time: ``dummy_batches``, ``trace`` and ``lower`` (Σ over buckets, on this
    thread), ``compile`` (the wait for compile threads beyond lowering), ``run``.
    """
    from tqdm.auto import tqdm

    start = time.perf_counter()
    if mode == "random":
        batches = {b: random_dummy_batch(jax.random.fold_in(key, i), b, page_size, runner.cache_spec.num_pages,
                                         vocab_size, max_model_len, max_prefill_seqs, WARMUP_MAX_CONTEXT)
                   for i, b in enumerate(buckets)}
    else:
        batches = {b: zeros_dummy_batch(b, page_size) for b in buckets}
    built = time.perf_counter()
    per_bucket = runner.compile_all(batches)
    compiled = time.perf_counter()
    for bucket in tqdm(buckets, desc="warm-up", disable=not progress):
        batch = batches[bucket]
        run_start = time.perf_counter()
        sampled = runner.execute(bucket, batch)
        per_bucket[bucket]["run_s"] = time.perf_counter() - run_start
        if mode == "random":
            check_sampled(sampled, int(batch["num_seqs"]), vocab_size, bucket)
    traced = sum(info["trace_s"] for info in per_bucket.values())
    lowered = sum(info["lower_s"] for info in per_bucket.values())
    phases = {"dummy_batches": built - start, "trace": traced, "lower": lowered,
              "compile": compiled - built - traced - lowered, "run": time.perf_counter() - compiled}
    return {str(b): info for b, info in per_bucket.items()}, phases


def check_sampled(sampled: dict, live: int, vocab_size: int, bucket: Bucket) -> None:
    """Warm-up self-check: sampled ids inside the vocabulary, logprobs finite."""
    tokens, logprobs = np.asarray(sampled["tokens"])[:live], np.asarray(sampled["logprobs"])[:live]
    if np.any((tokens < 0) | (tokens >= vocab_size)) or not np.all(np.isfinite(logprobs)):
        raise StartupError(f"warm-up self-check: bucket {bucket} produced invalid samples "
                           f"(tokens {tokens.tolist()}, logprobs {logprobs.tolist()})")


# ----------------------------------------------------------------------------- MoE expert load
def expert_load_report(runner, architecture, bucket: Bucket, random_batch: dict, page_size: int) -> dict:
    """How the dummy tokens of ``bucket`` spread over a MoE model's experts, random against zeros.

    With zeros every token is the same token at the same position, so every layer routes them all
    to the same ``top_k`` experts; and the zero batch has no live rows at all, which the MoE layer
    skips, so its expert loop never runs. XLA's memory analysis is of the one executable both
    batches run (static shapes), so its peak temporaries are the same for both: what differs is the
    load, the expert blocks the loop runs, and the step's time. Counts come from
    ``architecture.expert_load`` (the forward with attention inside each sequence and no cache).
    """
    from jaxrunner.models import moe

    probe = jax.jit(architecture.expert_load)
    cfg = architecture.cfg
    report = {"bucket": str(bucket), "num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok}
    for name, batch in (("random", random_batch), ("zeros", zeros_dummy_batch(bucket, page_size))):
        live = int(batch["cu_q_lens"][int(batch["num_seqs"])])
        segments = np.searchsorted(batch["cu_q_lens"][1:], np.arange(bucket.num_tokens), side="right")
        args = (runner.params, batch["token_ids"], batch["positions"], segments.astype(np.int32))
        counts = np.asarray(probe(*args, np.int32(live)))
        rows = np.asarray(probe(*args, np.int32(bucket.num_tokens)))
        start = time.perf_counter()
        runner.execute(bucket, batch)
        report[name] = {"tokens": live, **load_spread(counts), "rows_max_over_mean": load_spread(rows)["max_over_mean"],
                        "expert_blocks": sum(moe.blocks_for_counts(c, bucket.num_tokens, cfg.num_experts_per_tok)
                                             for c in counts),
                        "step_s": time.perf_counter() - start}
    return report


def load_spread(counts: np.ndarray) -> dict:
    """Per-layer expert counts [layers, E] -> the worst layer's max/mean and the mean coefficient
    of variation (None without tokens)."""
    counts = np.asarray(counts, np.float64)
    mean = counts.mean(axis=1)
    if not np.all(mean > 0):
        return {"max_over_mean": None, "cv": None}
    return {"max_over_mean": round(float(np.max(counts.max(axis=1) / mean)), 3),
            "cv": round(float(np.mean(counts.std(axis=1) / mean)), 3)}
