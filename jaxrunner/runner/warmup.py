"""Warm-up on randomized dummy batches, the attention self-check and the MoE expert-load probe
(the memory budget and KV-pool sizing are ``runner.memory``).

Why random and not zeros: zero token ids, zero positions and all-scratch page tables take different
paths in data-dependent code (dynamic int8 activation scales of zero, sampler branches that never
run, gathers that read only page 0) and hide wrong indexing — a bad gather of zeros still looks like
zeros. Every dummy batch here is drawn from one seeded ``jax.random`` key, so warm-up is
reproducible, and it is laid out by the code that lays out served batches
(``step_batch.lay_out``), so it has exactly their shapes, dtypes and pytree structure, and nothing
compiles after it.
"""
from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxrunner import kernels
from jaxrunner.executor_protocol import NO_FEED, NO_TOKEN, SequenceInput
from jaxrunner.kernels.tolerance import attention_tolerance
from jaxrunner.models import moe
from jaxrunner.runner.buckets import Bucket
from jaxrunner.runner.memory import StartupError
from jaxrunner.runner.step_batch import AttentionMetadata, StepBatch, lay_out, random_sampling_rows


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


@dataclasses.dataclass(frozen=True)
class _RandomQuery:
    """One dummy sequence's query: its length, context, pages, tokens and prompt length."""

    kv_len: int
    pages: np.ndarray
    token_ids: np.ndarray
    prompt_len: int


def _random_query(rng: np.random.Generator, q_len: int, longest: int, page_size: int, num_pages: int,
                  vocab_size: int) -> _RandomQuery:
    """A query of ``q_len`` tokens ending anywhere up to ``longest`` cached tokens, on random pages."""
    kv_len = int(rng.integers(q_len, longest + 1))
    needed = math.ceil(kv_len / page_size)  # a small pool may repeat pages: still valid, never scratch
    pages = rng.choice(np.arange(1, num_pages), size=needed, replace=needed > num_pages - 1)
    token_ids = rng.integers(0, vocab_size, q_len)
    return _RandomQuery(kv_len, pages, token_ids, int(rng.integers(1, kv_len + 1)))


def _on_own_pages(rng: np.random.Generator, queries: list[_RandomQuery], num_pages: int) -> list[_RandomQuery]:
    """``queries`` moved onto pages that no two of them share (drawn from the pool but page 0)."""
    pages = rng.permutation(np.arange(1, num_pages))
    starts = np.cumsum([0] + [len(query.pages) for query in queries])
    if starts[-1] > len(pages):
        raise ValueError(f"{starts[-1]} pages asked of a pool of {num_pages - 1} usable pages")
    return [dataclasses.replace(query, pages=pages[start:end])
            for query, start, end in zip(queries, starts[:-1], starts[1:])]


def _random_drafts(rng: np.random.Generator, q_lens: np.ndarray, draft_rows: int) -> list[int]:
    """Proposals per query (speculative buckets): about half of the queries of 2+ tokens end in
    1..q-1 of them, while the bucket's draft rows last."""
    drafts, left = [], draft_rows
    for q_len in q_lens:
        most = min(int(q_len) - 1, left)
        drafts.append(int(rng.integers(1, most + 1)) if most > 0 and rng.random() < 0.5 else 0)
        left -= drafts[-1]
    return drafts


def random_dummy_batch(key: jax.Array, bucket: Bucket, page_size: int, num_pages: int, vocab_size: int,
                       max_model_len: int, max_prefill_seqs: int | None = None,
                       max_context: int | None = None, max_loras: int = 0, own_pages: bool = False) -> StepBatch:
    """A batch of ``bucket``'s shape filled with random but *valid* contents (see module docstring),
    laid out by ``step_batch.lay_out`` as served batches are. A quarter of the tokens read the
    previous step's sampled ids on the device (async scheduling); in about half of the batches,
    half of the rows want prompt logprobs. With ``max_loras`` adapter slots, each sequence runs
    with a random one of them or none.

    ``max_context`` bounds the cached tokens before each query, except for the first decode,
    which still reaches anywhere up to the full page table: attention's cost follows the real
    context lengths, and a warm-up run need not pay for 16 sequences of the model's full length
    (the executable, and so what is proven, is the same).

    ``own_pages``: every sequence on pages no other one uses, as served sequences write theirs
    (the pool must hold them all), so no two live tokens write the same cache slot."""
    seed = int(jax.random.randint(key, (), 0, np.iinfo(np.int32).max))
    rng = np.random.default_rng(seed)
    num_seqs = int(rng.integers(1, bucket.num_seqs + 1))
    max_len = min(max_model_len, bucket.num_pages * page_size)
    q_lens = np.minimum(_split_tokens(rng, bucket.num_tokens, num_seqs, max_prefill_seqs), max_len)
    long_row = int(np.argmax(q_lens == 1)) if np.any(q_lens == 1) else -1
    longest = [max_len if max_context is None or s == long_row else min(max_len, int(q_len) + max_context)
               for s, q_len in enumerate(q_lens)]
    queries = [_random_query(rng, int(q_len), top, page_size, num_pages, vocab_size)
               for q_len, top in zip(q_lens, longest)]
    if own_pages:
        queries = _on_own_pages(rng, queries, num_pages)
    tokens = int(np.sum(q_lens))
    feed = np.where(rng.random(tokens) < 0.25, rng.integers(0, bucket.num_seqs, tokens), NO_FEED)
    sampling = random_sampling_rows(rng, [query.prompt_len for query in queries], vocab_size,
                                    bucket.num_pages * page_size)
    drafts = _random_drafts(rng, q_lens, bucket.num_draft_rows)
    targets = None
    if rng.random() < 0.5:
        targets = np.where(rng.random(tokens) < 0.5, rng.integers(0, vocab_size, tokens), NO_TOKEN)
    starts = np.cumsum(q_lens) - q_lens
    adapters = rng.integers(0, max_loras + 1, len(queries))
    return lay_out(bucket, page_size, vocab_size, [
        SequenceInput(token_ids=query.token_ids, feed_rows=feed[start:start + q_len], kv_len=query.kv_len,
                      pages=query.pages, prompt_targets=None if targets is None else targets[start:start + q_len],
                      sampling=row, num_drafts=k, lora_slot=int(adapter))
        for query, q_len, start, row, k, adapter in zip(queries, q_lens, starts, sampling, drafts, adapters)],
        lora=max_loras > 0)


def zeros_dummy_batch(bucket: Bucket, page_size: int, vocab_size: int, lora: bool = False) -> StepBatch:
    """The zero-filled batch (for comparison only): same shapes, so the same executables."""
    batch = StepBatch.empty(bucket, page_size, vocab_size, lora)
    batch.attention.num_seqs[...] = bucket.num_seqs
    return batch


# ----------------------------------------------------------------------------- self-check
# one jitted layer for every engine of the process: a second start-up compiles the check again only for new shapes
_checked_layer = jax.jit(kernels.write_kv_and_attend, static_argnames=("sm_scale", "impl", "max_prefill_seqs"))


@dataclasses.dataclass(frozen=True)
class SelfCheckCase:
    """One layer's step, as serving calls ``kernels.write_kv_and_attend``: the step's queries and
    new K/V, the cache (two pools, ``k_pages``/``v_pages``) and the step's metadata."""

    q: jax.Array                # [T, Hq, D]
    k_new: jax.Array            # [T, Hkv, D]
    v_new: jax.Array
    k_pages: jax.Array          # [P, page_size, Hkv, D]
    v_pages: jax.Array
    meta: AttentionMetadata     # the step's slots, lengths and page table

    def layer_args(self, impl: str) -> tuple:
        """``write_kv_and_attend``'s positional arguments with the cache in the layout ``impl``
        serves from (``kernels.kv_pools``: jax_tpu's one combined pool, else K and V apart)."""
        meta = self.meta
        return (self.q, self.k_new, self.v_new, kernels.kv_pools(impl, self.k_pages, self.v_pages),
                meta.slot_mapping, meta.kv_lens, meta.page_indices, meta.cu_q_lens, meta.num_seqs)


def self_check_case(bucket: Bucket, page_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype,
                    key: jax.Array, max_prefill_seqs: int | None = None) -> SelfCheckCase:
    """A random step of ``bucket``'s tokens and sequences, with a page table of at most
    ``SELF_CHECK_MAX_PAGES`` (the reference is dense: at the model's full length its case alone
    took seconds at every start), each sequence on pages of its own."""
    bucket = Bucket(bucket.num_tokens, bucket.num_seqs, min(bucket.num_pages, SELF_CHECK_MAX_PAGES))
    num_pages = bucket.num_seqs * bucket.num_pages + 1
    dummy = random_dummy_batch(key, bucket, page_size, num_pages, 64, 1 << 30, max_prefill_seqs, own_pages=True)
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)

    # queries and new rows come in a compute dtype: an 8-bit float pool's model computes in bf16 or wider
    rows_dtype = jnp.bfloat16 if kernels.is_fp8(dtype) else dtype

    def normal(k, shape, dtype=dtype):
        return jax.random.normal(k, shape, jnp.float32).astype(dtype)

    pool_shape, new_shape = (num_pages, page_size, num_kv_heads, head_dim), (bucket.num_tokens, num_kv_heads, head_dim)
    return SelfCheckCase(q=normal(k1, (bucket.num_tokens, num_q_heads, head_dim), rows_dtype),
                         k_new=normal(k2, new_shape, rows_dtype), v_new=normal(k3, new_shape, rows_dtype),
                         k_pages=normal(k4, pool_shape), v_pages=normal(k5, pool_shape), meta=dummy.attention)


def attention_self_check(impl: str, bucket: Bucket, page_size: int, num_q_heads: int, num_kv_heads: int,
                         head_dim: int, dtype, key: jax.Array, max_prefill_seqs: int | None = None) -> float:
    """Run one layer's step through the entry point serving uses (``kernels.write_kv_and_attend``,
    the cache in ``impl``'s own layout: one combined pool for ``jax_tpu``) and the reference over
    the same K and V in two pools, on a random case (:func:`self_check_case`).

    Catches a kernel (or a cache write) that miscompiles on new hardware before any request sees
    it. Returns the max abs difference of the outputs; raises StartupError when it exceeds the
    tolerance that the cache dtype and the precision of the impl's dots allow
    (``kernels.tolerance.attention_tolerance``: a multiple of the dot format's unit roundoff times
    max|v|, plus float32 accumulation over the longest sequence): about 1e-6 for float32 caches
    on full-precision dots, 2e-3 on TF32, 0.07 for bfloat16 caches; or when the written cache
    differs from the reference's write anywhere but the scratch page (writes are copies: exact).
    """
    case = self_check_case(bucket, page_size, num_q_heads, num_kv_heads, head_dim, dtype, key, max_prefill_seqs)
    outs, caches = {}, {}
    for name in (impl, "reference"):
        out, pools = _checked_layer(*case.layer_args(name), sm_scale=head_dim ** -0.5, impl=name,
                                    max_prefill_seqs=max_prefill_seqs)
        outs[name] = np.asarray(out, np.float32)[: int(case.meta.cu_q_lens[-1])]
        caches[name] = [np.asarray(pool[kernels.SCRATCH_PAGE + 1:], np.float32) for pool in kernels.kv_from_pools(pools)]
    if not all(np.array_equal(mine, want) for mine, want in zip(caches[impl], caches["reference"])):
        raise StartupError(f"attention self-check failed: impl {impl!r} wrote the step's K/V into its cache "
                           f"differently from the reference on bucket {bucket}")
    error = float(np.max(np.abs(outs[impl] - outs["reference"]), initial=0.0))
    tolerance = attention_tolerance(impl, dtype, max_abs_v=float(np.max(np.abs(caches["reference"][1]))),
                                    max_kv_len=int(np.max(case.meta.kv_lens, initial=1)))
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
    start = time.perf_counter()
    max_loras = 0 if runner.lora_spec is None else runner.lora_spec.max_loras
    if mode == "random":
        batches = {b: random_dummy_batch(jax.random.fold_in(key, i), b, page_size, runner.cache_spec.num_pages,
                                         vocab_size, max_model_len, max_prefill_seqs, WARMUP_MAX_CONTEXT, max_loras)
                   for i, b in enumerate(buckets)}
    else:
        batches = {b: zeros_dummy_batch(b, page_size, vocab_size, max_loras > 0) for b in buckets}
    built = time.perf_counter()
    per_bucket = runner.compile_all(batches)
    compiled = time.perf_counter()
    if max_loras:
        fill_lora_slots(runner, jax.random.fold_in(key, len(buckets)))
    for bucket in tqdm(buckets, desc="warm-up", disable=not progress):
        batch = batches[bucket]
        run_start = time.perf_counter()
        sampled = runner.execute(bucket, batch)
        per_bucket[bucket]["run_s"] = time.perf_counter() - run_start
        if mode == "random":
            check_sampled(sampled, batch.num_seqs, vocab_size, bucket)
    if max_loras:
        fill_lora_slots(runner, None)
    traced = sum(info["trace_s"] for info in per_bucket.values())
    lowered = sum(info["lower_s"] for info in per_bucket.values())
    phases = {"dummy_batches": built - start, "trace": traced, "lower": lowered,
              "compile": compiled - built - traced - lowered, "run": time.perf_counter() - compiled}
    return {str(b): info for b, info in per_bucket.items()}, phases


def fill_lora_slots(runner, key: jax.Array | None) -> None:
    """Write every adapter slot through the writer serving uses (compiling it now): random small
    factors under ``key`` (the buckets then run real adapter products), zeros for None."""
    rng = np.random.default_rng(None if key is None else int(jax.random.randint(key, (), 0, 2**31 - 1)))
    slots = runner.lora_spec.max_loras

    def values(shape) -> np.ndarray:
        return np.zeros(shape, np.float32) if key is None else (0.02 * rng.standard_normal(shape)).astype(np.float32)

    for slot in range(1, slots + 1):
        adapter = [{name: {"a": values((factors["a"].shape[0], factors["a"].shape[1] // slots)),
                           "b": [values((part.shape[0] // slots, part.shape[1])) for part in factors["b"]]}
                    for name, factors in layer.items()} for layer in runner.lora_slots]
        runner.write_lora_slot(slot, adapter)


def check_sampled(sampled: dict, live: int, vocab_size: int, bucket: Bucket) -> None:
    """Warm-up self-check: sampled ids inside the vocabulary, logprobs finite."""
    tokens, logprobs = np.asarray(sampled["tokens"])[:live], np.asarray(sampled["logprobs"])[:live]
    if np.any((tokens < 0) | (tokens >= vocab_size)) or not np.all(np.isfinite(logprobs)):
        raise StartupError(f"warm-up self-check: bucket {bucket} produced invalid samples "
                           f"(tokens {tokens.tolist()}, logprobs {logprobs.tolist()})")


# ----------------------------------------------------------------------------- MoE expert load
def expert_load_report(runner, architecture, bucket: Bucket, random_batch: StepBatch, page_size: int) -> dict:
    """How the dummy tokens of ``bucket`` spread over a MoE model's experts, random against zeros.

    With zeros every token is the same token at the same position, so every layer routes them all
    to the same ``top_k`` experts; and the zero batch has no live rows at all, which the MoE layer
    skips, so its expert loop never runs. XLA's memory analysis is of the one executable both
    batches run (static shapes), so its peak temporaries are the same for both: what differs is the
    load, the expert blocks the loop runs, and the step's time. Counts come from
    ``architecture.expert_load`` (the forward with attention inside each sequence and no cache).
    """
    probe = jax.jit(architecture.expert_load)
    cfg = architecture.cfg
    report = {"bucket": str(bucket), "num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok}
    for name, batch in (("random", random_batch), ("zeros", zeros_dummy_batch(bucket, page_size, architecture.cfg.vocab_size))):
        live = batch.num_live_tokens
        segments = np.searchsorted(batch.attention.cu_q_lens[1:], np.arange(bucket.num_tokens), side="right")
        args = (runner.params, batch.token_ids, batch.positions, segments.astype(np.int32))
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
