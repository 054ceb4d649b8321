"""Batch bookkeeping shared by the attention implementations.

Everything here is a small on-device computation over the [S]-sized metadata (never over K/V),
so it costs nothing next to the attention itself and keeps every shape static.

Two views of the packed batch are used:

* per token (the reference): token ``t`` -> its sequence and its absolute position;
* per query block (the ``xla`` and ``pallas`` paths): the packed query rows are cut into blocks of
  ``block_q`` rows that each belong to ONE sequence, so that a block needs only its own sequence's
  pages.  Sequence ``s`` with ``q_len`` rows owns ``ceil(q_len / block_q)`` consecutive blocks.
  Summed over sequences that is at most ``(T + S * (block_q - 1)) // block_q`` blocks, the
  static bound used for the block axis; unused blocks are marked invalid (``block_rows == 0``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SCRATCH_PAGE = 0


def sanitize(kv_lens, cu_q_lens, num_seqs):
    """Make the metadata of padded sequences harmless.

    Sequences ``s >= num_seqs`` get ``q_len == 0`` and ``kv_len == 0`` whatever their entries
    hold, and ``cu_q_lens`` is made non-decreasing past ``num_seqs`` so searches over it are
    well defined. Returns ``(cu, q_lens, kv_lens, live)`` (int32).
    """
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    cu_q_lens = jnp.asarray(cu_q_lens, jnp.int32)
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    n_seq = kv_lens.shape[0]
    num_seqs = jnp.clip(num_seqs, 0, n_seq)
    idx = jnp.arange(n_seq + 1, dtype=jnp.int32)
    end = cu_q_lens[num_seqs]
    cu = jnp.where(idx <= num_seqs, cu_q_lens, end)
    live = jnp.arange(n_seq, dtype=jnp.int32) < num_seqs
    q_lens = jnp.where(live, cu[1:] - cu[:-1], 0)
    kv = jnp.where(live, kv_lens, 0)
    return cu, q_lens, kv, live


@dataclasses.dataclass(frozen=True)
class QueryBlocks:
    """Block view of the packed queries (all int32 device arrays).

    block_seq [NB]    sequence of each block (clamped to a real index for unused blocks)
    block_start [NB]  first query row of the block *within its sequence*
    block_rows [NB]   live rows in the block (0 for unused blocks)
    row_token [NB*block_q]  packed token row feeding each block row (clamped for dead rows)
    token_row [T]     block row holding each token's output (dead tokens: some live-or-not row)
    """

    block_q: int
    num_blocks: int
    block_seq: jax.Array
    block_start: jax.Array
    block_rows: jax.Array
    row_token: jax.Array
    token_row: jax.Array


def num_query_blocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Static upper bound on the number of single-sequence query blocks."""
    return max(1, (num_tokens + num_seqs * (block_q - 1)) // block_q)


def query_blocks(cu, q_lens, num_tokens: int, block_q: int, num_blocks: int | None = None) -> QueryBlocks:
    """Cut the packed query rows into single-sequence blocks of ``block_q`` rows (on device).

    ``cu``/``q_lens`` come from :func:`sanitize`; ``q_lens`` may be zeroed for sequences a pass
    skips (their tokens then map to no block). ``num_blocks`` overrides the static bound when the
    caller knows a tighter one.
    """
    n_seq = q_lens.shape[0]
    nb = num_blocks or num_query_blocks(num_tokens, n_seq, block_q)
    blocks_per_seq = (q_lens + block_q - 1) // block_q
    blk_end = jnp.cumsum(blocks_per_seq, dtype=jnp.int32)  # inclusive
    blk_begin = blk_end - blocks_per_seq
    b = jnp.arange(nb, dtype=jnp.int32)
    # first sequence whose inclusive block end exceeds b
    block_seq = jnp.sum((blk_end[None, :] <= b[:, None]).astype(jnp.int32), axis=1)
    used = block_seq < n_seq
    block_seq = jnp.minimum(block_seq, n_seq - 1)
    block_start = (b - blk_begin[block_seq]) * block_q
    block_rows = jnp.where(used, jnp.clip(q_lens[block_seq] - block_start, 0, block_q), 0)
    j = jnp.arange(block_q, dtype=jnp.int32)
    row_token = cu[block_seq][:, None] + block_start[:, None] + j[None, :]
    row_token = jnp.clip(row_token, 0, num_tokens - 1).reshape(-1)

    t = jnp.arange(num_tokens, dtype=jnp.int32)
    tok_seq = jnp.sum((cu[1:][None, :] <= t[:, None]).astype(jnp.int32), axis=1)
    tok_seq = jnp.minimum(tok_seq, n_seq - 1)
    i = t - cu[tok_seq]
    token_row = (blk_begin[tok_seq] + i // block_q) * block_q + i % block_q
    token_row = jnp.clip(token_row, 0, nb * block_q - 1)
    return QueryBlocks(block_q, nb, block_seq, block_start, block_rows, row_token, token_row)


def choose_block_q(num_tokens: int, num_seqs: int, group: int, *, kv_weight: float = 1.0,
                   max_block_q: int = 128, max_prefill_seqs: int | None = None) -> int:
    """Static query-block size for a (T, S) bucket.

    Work of a block size ``bq`` is modelled as ``NB(bq) * (bq * group + kv_weight)``: every block
    gathers its sequence's whole page-table row once (``kv_weight``, per kv head) and computes
    ``bq * group`` query rows against it. ``NB(bq)`` is the static bound above, so padding waste
    (``S * (bq - 1)`` rows in the worst case) is charged. Decode-only buckets (T == S) give 1.
    For a pass over at most ``max_prefill_seqs`` sequences the bound is the tighter
    ``ceil(T / bq) + max_prefill_seqs`` (each sequence wastes at most one partial block).
    """
    def num_blocks(bq: int) -> int:
        if max_prefill_seqs is None:
            return num_query_blocks(num_tokens, num_seqs, bq)
        return -(-num_tokens // bq) + max_prefill_seqs

    best, best_cost = 1, None
    bq = 1
    while bq <= max(1, min(max_block_q, num_tokens)):
        cost = num_blocks(bq) * (bq * group + kv_weight)
        if best_cost is None or cost < best_cost * 0.999:
            best, best_cost = bq, cost
        bq *= 2
    return best
