"""Ragged paged attention in plain XLA (the CPU path).

Design
------
The packed query rows are cut into blocks of ``block_q`` rows that each belong to ONE sequence
(:mod:`jaxrunner.kernels.blocks`; the mapping is computed on device from ``cu_q_lens``). A
``fori_loop`` then walks the page table in chunks of a few pages: each step gathers, for every
block, the chunk of its own sequence's pages (``[NB, chunk_rows, Hkv*D]``), computes the block's
scores against it with the causal / length / window mask, and folds them into a flash-attention
online softmax (running max, sum and accumulator, all float32). Outputs are gathered back to
packed token rows at the end.

Why this shape:

* Cost is ``NB * (pages actually needed)``: the loop runs only up to the chunk holding the
  batch's longest live position (a dynamic trip count) and starts at the earliest position any
  sliding window reaches, so it scales with real kv lengths and at most with the page-table
  width ``W`` the engine buckets -- never with ``max_model_len`` and never with
  ``T x (kv of all sequences)``.
* The chunk loop is the big win on XLA:CPU: gathering all of a block's pages at once
  materialises ``[NB, W*page_size, Hkv, D]`` in DRAM and reads it back (3 passes over K/V);
  a chunk of a few MB stays in cache between its gather and its dots. On GPU/TPU (where this
  path is the fallback for shapes the kernels do not take) chunks are sized for fewer loop
  steps instead (:func:`_chunk_rows`). Measured 3x faster for
  decode and ~2x for prefill than the gather-everything version of this same code, and it
  keeps memory O(NB * chunk) instead of O(NB * W * page_size).
* ``block_q`` is static, picked from (T, S) by :func:`blocks.choose_block_q`: decode-only
  batches (T == S) get ``block_q = 1`` (one block per sequence, nothing wasted); prefill-heavy
  batches get larger blocks so that one gather serves many query rows and the dots get a
  useful M dimension. The static block count ``(T + S*(block_q-1)) // block_q`` charges the
  worst-case padding, so the choice never blows up for mixed batches.
* GQA without repeating K/V: queries are viewed as ``[.., Hkv, G, D]`` and each kv head serves
  its ``G`` query heads in the same dot.
* Pages are gathered as whole rows of the ``[P, page_size*Hkv*D]`` view with indices clamped
  beforehand (``promise_in_bounds``): XLA:CPU then copies contiguous rows, about 2x faster than
  the 4-D gather. The tiny block metadata goes through an ``optimization_barrier`` first, or XLA
  fuses its index arithmetic into the big gathers and recomputes it per element.
* Two dot formulations, chosen statically:
  - ``block_q == 1`` and fewer than 16 blocks (small decode batches, batch-1 latency):
    "blockdiag". A dot with a batch dim over kv heads makes XLA:CPU
    transpose the gathered K/V (heads are not major in the pool layout). Instead each block does
    ONE plain matmul on the pool-native layout: K as ``[rows, Hkv*D]`` times a block-diagonal
    ``[Hkv*D, Hkv*G]`` query matrix (and P^T V the same way, keeping the diagonal blocks).
    Hkv x the flops, but decode is memory-bound.
  - ``block_q > 1`` (prefill / mixed), and decode batches of 16+ sequences: "dot", batched over
    (block, kv head); blockdiag's Hkv x flops lose once there are many blocks. Wide decode
    batches walk 32 cache rows per step (measured, SmolLM2 heads, 64 sequences of kv 150..400:
    6.0 ms vs 11.0 ms for blockdiag with 64 rows; at 1 sequence blockdiag stays ahead, 0.15 vs
    0.24 ms).
* Masked scores use ``where(mask, s, -inf)`` with a guarded max, and V rows past ``kv_len``
  are zeroed, so rows with nothing to attend to (padding) come out as finite zeros and
  non-finite garbage in cache slots no live token owns cannot leak into outputs (``0 * NaN``).

Numbers (XLA:CPU, shared 2-core machine, interleaved runs): 64 decode seqs, kv 256..512,
Hq 9 / Hkv 3, D 64, page 16, f32: ~13 ms vs ~39 ms for the reference; prefill 4 x 256 tokens:
~19 ms vs ~790 ms. ``scripts/bench_attention.py`` reproduces them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrunner.kernels.blocks import choose_block_q, query_blocks, sanitize


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


# Two passes (decodes, then prefill chunks) only for buckets of 32+ sequences: there the mixed
# single pass wastes most (each decode alone in a multi-row block), and the second pass's extra
# compile time (it doubles the attention HLO) is paid for 3 of the default 26 buckets, not all.
TWO_PASS_MIN_SEQS = 32
BLOCKDIAG_MAX_BLOCKS = 16  # decode batches of at least this many sequences use "dot" (measured)


CPU_CHUNK_BUDGET = 2 << 20      # bytes: one step's gathered K chunk stays in a core's L2
DEVICE_CHUNK_BUDGET = 64 << 20  # bytes: on GPU/TPU the chunk lives in HBM anyway; fewer steps
DEVICE_MAX_CHUNK_ROWS = 1024    # (each while-loop step costs kernel launches) beat cache fit


def _chunk_rows(num_blocks: int, row_width: int, formulation: str, platform: str | None = None) -> int:
    """Cache rows per loop step, halved while one step's gathered K chunk (f32) exceeds the budget.

    CPU: 64 (blockdiag) / 128 (dot) rows under a 2 MB budget, so the chunk stays resident in a
    core's L2 between the gather and the dots. Measured on XLA:CPU, 2 cores: an 8 MB budget made
    wide decode and mixed batches 1.5-2x slower (64 blocks walked 128 rows a step instead of 32).
    GPU/TPU: up to 1024 rows under 64 MB: there no cache holds the chunk, and every loop step
    costs a few kernel launches, so the loop should take few, large steps.
    """
    platform = (platform or jax.default_backend()).lower()
    if platform in ("gpu", "cuda", "rocm", "tpu"):
        rows, budget = DEVICE_MAX_CHUNK_ROWS, DEVICE_CHUNK_BUDGET
    else:
        rows, budget = (64 if formulation == "blockdiag" else 128), CPU_CHUNK_BUDGET
    while rows > 8 and num_blocks * rows * row_width * 4 > budget:
        rows //= 2
    return rows


def ragged_paged_attention_xla(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                               *, sm_scale, sliding_window=None, soft_cap=None, block_q=None,
                               formulation=None, chunk_rows=None, max_prefill_seqs=None,
                               two_pass_min_seqs=TWO_PASS_MIN_SEQS, return_pools=False):
    """See the module docstring. ``max_prefill_seqs``: a promise that at most this many sequences
    have more than one query token; a bucket of 32+ sequences that can hold prefill chunks
    (``T > S``) then runs decodes and prefill chunks as two passes with their own block sizes.
    ``return_pools``: also return the pools as they come out of the loop(s), ``(out, k, v)``."""
    num_tokens, num_q_heads, _ = q.shape
    n_seq = page_indices.shape[0]
    group = num_q_heads // k_pages.shape[2]
    cu, q_lens, kv, _ = sanitize(kv_lens, cu_q_lens, num_seqs)
    attend = functools.partial(_attend, q, kv=kv, cu=cu, page_indices=page_indices, sm_scale=sm_scale,
                               sliding_window=sliding_window, soft_cap=soft_cap, chunk_rows=chunk_rows)
    if max_prefill_seqs is None or block_q is not None or num_tokens <= n_seq or n_seq < two_pass_min_seqs:
        # kv_weight=32: fitted on XLA:CPU (streaming one block's K/V costs about as much as 32
        # query rows of dots; scripts/bench_attention.py --sweep-block-q re-measures).
        bq = block_q or choose_block_q(num_tokens, n_seq, group, kv_weight=32.0)
        out, k_pages, v_pages = attend(k_pages, v_pages, q_lens, bq, None, formulation)
    else:
        prefills = min(max_prefill_seqs, n_seq)
        bq = choose_block_q(num_tokens, n_seq, group, kv_weight=32.0, max_prefill_seqs=prefills)
        is_decode = q_lens == 1
        decode_out, k_pages, v_pages = attend(k_pages, v_pages, jnp.where(is_decode, q_lens, 0), 1, n_seq,
                                              formulation)
        prefill_out, k_pages, v_pages = attend(k_pages, v_pages, jnp.where(is_decode, 0, q_lens), bq,
                                               -(-num_tokens // bq) + prefills, None)
        token_seq = jnp.sum((cu[1:][None, :] <= jnp.arange(num_tokens, dtype=jnp.int32)[:, None]), axis=1)
        token_is_decode = is_decode[jnp.minimum(token_seq, n_seq - 1)]
        out = jnp.where(token_is_decode[:, None, None], decode_out, prefill_out)
    return (out, k_pages, v_pages) if return_pools else out


def _attend(q, k_pages, v_pages, q_lens, bq, nb, formulation, *, kv, cu, page_indices, sm_scale,
            sliding_window, soft_cap, chunk_rows):
    """One pass over the sequences with ``q_lens > 0``, in blocks of ``bq`` rows (at most ``nb``).

    Returns ``(out, k_pages, v_pages)``, the pools being the loop's pass-through (see below)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    width = page_indices.shape[1]
    group = num_q_heads // num_kv_heads
    qb = query_blocks(cu, q_lens, num_tokens, bq, nb)
    nb = qb.num_blocks
    formulation = formulation or ("blockdiag" if bq == 1 and nb < BLOCKDIAG_MAX_BLOCKS else "dot")
    if formulation not in ("blockdiag", "dot"):
        raise ValueError(f"formulation must be 'blockdiag' or 'dot', got {formulation!r}")

    # Per-block metadata, all tiny. The optimization barrier materialises it before it meets
    # K/V: otherwise XLA fuses the index arithmetic into the big gathers and recomputes it per
    # element, which serialises and de-vectorises them (measured several times slower).
    num_pages = k_pages.shape[0]
    chunk = max(1, min(width, (chunk_rows or _chunk_rows(nb, num_kv_heads * head_dim,
                                                         formulation)) // page_size))
    n_chunks = -(-width // chunk)
    pages = jnp.asarray(page_indices, jnp.int32).at[qb.block_seq].get(mode="clip")  # [NB, W]
    pages = jnp.clip(pages, 0, num_pages - 1)  # so the big gathers may promise in-bounds
    pages = jnp.pad(pages, ((0, 0), (0, n_chunks * chunk - width)))  # pad: scratch, masked
    pages = pages.reshape(nb, n_chunks, chunk).transpose(1, 0, 2)          # [C, NB, chunk]
    kvl = kv[qb.block_seq]                                                 # [NB]
    qpos0 = kvl - q_lens[qb.block_seq] + qb.block_start                    # [NB]
    rows = qb.block_rows
    # Chunks any block needs: [c_lo, c_hi). Work scales with the batch's longest live
    # sequence, not with the page-table width.
    rows_chunk = chunk * page_size
    hi = jnp.max(jnp.where(rows > 0, jnp.minimum(kvl, qpos0 + rows), 0))
    c_hi = jnp.minimum((hi + rows_chunk - 1) // rows_chunk, n_chunks)
    c_lo = jnp.int32(0)
    if sliding_window is not None:
        lo = jnp.min(jnp.where(rows > 0, jnp.maximum(qpos0 - (sliding_window - 1), 0), hi))
        c_lo = jnp.minimum(lo // rows_chunk, c_hi)
    pages, kvl, qpos0, rows, row_token, token_row, c_lo, c_hi = jax.lax.optimization_barrier(
        (pages, kvl, qpos0, rows, qb.row_token, qb.token_row, c_lo, c_hi))

    qblk = q.at[row_token].get(mode="clip").reshape(nb, bq, num_kv_heads, group, head_dim)
    qblk = qblk.astype(jnp.float32) * sm_scale
    # Pages are gathered as whole rows of the [P, page_size*Hkv*D] view with in-bounds
    # indices: XLA:CPU then copies contiguous rows (~2x faster than the 4-D gather, measured).
    row = page_size * num_kv_heads * head_dim
    k_rows = k_pages.reshape(num_pages, row)
    v_rows = v_pages.reshape(num_pages, row)
    j = jnp.arange(bq, dtype=jnp.int32)
    qpos = qpos0[:, None] + j[None, :]                                     # [NB, bq]
    row_live = j[None, :] < rows[:, None]
    prec = _precision(q.dtype)
    hd = num_kv_heads * head_dim
    n = bq * num_kv_heads * group
    eye = jnp.eye(num_kv_heads, dtype=jnp.float32)
    if formulation == "blockdiag":
        # [NB, Hkv*D, bq*Hkv*G] block-diagonal queries (see the module docstring)
        qbd = jnp.einsum("bjhgd,hk->bkdjhg", qblk, eye).reshape(nb, hd, n)

    def chunk_step(c, carry):
        m_prev, l_prev, acc, k_rows, v_rows = carry
        # The pools ride in the loop state behind a no-op barrier so that XLA cannot treat them
        # as loop-invariant: XLA:CPU upcasts 16-bit gathers by converting the gathered operand,
        # and loop-invariant code motion would hoist that convert -- of the WHOLE pool -- out of
        # the loop (measured: two pool-sized converts per call). Inside the body the convert
        # fuses into the gather and touches only the gathered rows. No copy results (checked in
        # tests/test_kernels.py) -- provided the caller continues with the pools that come OUT of
        # the loop (``return_pools``): in a step that writes the pool and then attends, returning
        # the pre-loop pool as the new cache leaves two live versions of it, and XLA copies the
        # whole pool at every layer (measured: 60 pool copies per decode step of SmolLM2, 18 ms
        # of a 46 ms batch-1 token).
        k_rows, v_rows = jax.lax.optimization_barrier((k_rows, v_rows))
        pg = jax.lax.dynamic_index_in_dim(pages, c, 0, keepdims=False)     # [NB, chunk]
        k = k_rows.at[pg].get(mode="promise_in_bounds").reshape(nb, rows_chunk, hd)
        v = v_rows.at[pg].get(mode="promise_in_bounds").reshape(nb, rows_chunk, hd)
        lpos = c * rows_chunk + jnp.arange(rows_chunk, dtype=jnp.int32)
        mask = (lpos[None, None, :] <= qpos[:, :, None]) & row_live[:, :, None]  # [NB,bq,Lc]
        if sliding_window is not None:
            mask &= lpos[None, None, :] > qpos[:, :, None] - sliding_window
        v = jnp.where((lpos[None, :] < kvl[:, None])[:, :, None], v.astype(jnp.float32), 0.0)
        if formulation == "blockdiag":
            s = jnp.einsum("bld,bdn->bln", k.astype(jnp.float32), qbd, precision=prec)
            s = s.reshape(nb, rows_chunk, bq, num_kv_heads * group)        # [NB, Lc, bq, HG]
            mask = mask.transpose(0, 2, 1)[..., None]                      # [NB, Lc, bq, 1]
            red = 1
        else:
            k = k.reshape(nb, rows_chunk, num_kv_heads, head_dim).astype(jnp.float32)
            s = jnp.einsum("bqhgd,blhd->bhqgl", qblk, k, precision=prec)   # [NB,H,bq,G,Lc]
            mask = mask[:, None, :, None, :]
            red = 4
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=red))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.where(mask, jnp.exp(s - jnp.expand_dims(m_safe, red)), 0.0)
        l_new = l_prev * alpha + jnp.sum(p, axis=red)
        if formulation == "blockdiag":
            pv = jnp.einsum("bln,blm->bnm", p.reshape(nb, rows_chunk, n), v, precision=prec)
            acc = acc * alpha.reshape(nb, n, 1) + pv                       # [NB, n, Hkv*D]
        else:
            v = v.reshape(nb, rows_chunk, num_kv_heads, head_dim)
            pv = jnp.einsum("bhqgl,blhd->bhqgd", p, v, precision=prec)
            acc = acc * alpha[..., None] + pv                              # [NB,H,bq,G,D]
        return m_new, l_new, acc, k_rows, v_rows

    if formulation == "blockdiag":
        state = (nb, bq, num_kv_heads * group)
        acc0 = jnp.zeros((nb, n, hd), jnp.float32)
    else:
        state = (nb, num_kv_heads, bq, group)
        acc0 = jnp.zeros((nb, num_kv_heads, bq, group, head_dim), jnp.float32)
    init = (jnp.full(state, -jnp.inf, jnp.float32), jnp.zeros(state, jnp.float32), acc0,
            k_rows, v_rows)
    _, l_sum, acc, k_rows, v_rows = jax.lax.fori_loop(c_lo, c_hi, chunk_step, init)
    l_sum = jnp.where(l_sum == 0, 1.0, l_sum)
    if formulation == "blockdiag":
        acc = acc.reshape(nb, bq, num_kv_heads, group, num_kv_heads, head_dim)
        o = jnp.einsum("bjhgkd,hk->bjhgd", acc, eye)
        o = o / l_sum.reshape(nb, bq, num_kv_heads, group)[..., None]
    else:
        o = (acc / l_sum[..., None]).transpose(0, 2, 1, 3, 4)             # [NB,bq,H,G,D]

    o = o.reshape(nb * bq, num_q_heads, head_dim)
    out = o.at[token_row].get(mode="clip").astype(q.dtype)
    return out, k_rows.reshape(k_pages.shape), v_rows.reshape(v_pages.shape)
