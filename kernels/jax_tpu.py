"""jax's own TPU kernel (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``) behind our
contract: the ``jax_tpu`` implementation, the default on TPU.

jax's kernel reads ONE pool whose heads interleave K and V (``[P, page_size, 2 * Hkv, D]``, K at
even heads), while ours keeps two. Each call therefore gathers the pages the batch's page table
names into a combined pool of its own (``[S * W, page_size, 2 * Hkv, D]``, page table renumbered
0..S*W-1): a copy of the batch's K/V once per layer, bounded by the bucket's page-table width,
never of the whole pool. A combined pool in the engine would remove the copy.

Our contract is kept around it: padded sequences' metadata is sanitised (jax's kernel trusts
``num_seqs`` only), ``num_seqs`` becomes the ``[1]`` array jax wants, and padding rows come out
as zeros. The kernel exists for TPU only: on other platforms it can be lowered for TPU (tests)
but not run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrunner.kernels.blocks import sanitize


def available() -> str | None:
    """None when the installed jax ships the kernel, else why not."""
    try:
        from jax.experimental.pallas.ops.tpu import ragged_paged_attention  # noqa: F401
    except ImportError as e:
        return f"this jax has no jax.experimental.pallas.ops.tpu.ragged_paged_attention ({e})"
    return None


def combined_pages(k_pages, v_pages, page_indices):
    """The batch's pages as one K/V-interleaved pool and the page table renumbered into it."""
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    n_seq, width = page_indices.shape
    pages = jnp.clip(jnp.asarray(page_indices, jnp.int32).reshape(-1), 0, num_pages - 1)
    kv = jnp.stack([k_pages[pages], v_pages[pages]], axis=3)  # [S*W, page, Hkv, 2, D]
    kv = kv.reshape(n_seq * width, page_size, 2 * num_kv_heads, head_dim)
    local = jnp.arange(n_seq * width, dtype=jnp.int32).reshape(n_seq, width)
    return kv, local


def _block_sizes(num_tokens: int, width: int, kv_block=None, q_block=None):
    """jax's kernel looks its block sizes up by the *local* TPU's generation and refuses anywhere
    else; when lowering from another platform, pass its untuned defaults (128 pages, 32 queries)."""
    if jax.default_backend() == "tpu":
        return kv_block, q_block
    return kv_block or min(width, 128), q_block or min(num_tokens, 32)


def ragged_paged_attention_jax_tpu(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                   *, sm_scale, sliding_window=None, soft_cap=None,
                                   num_kv_pages_per_block=None, num_queries_per_block=None):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    kv_block, q_block = _block_sizes(q.shape[0], page_indices.shape[1], num_kv_pages_per_block,
                                     num_queries_per_block)

    cu, _, kv, _ = sanitize(kv_lens, cu_q_lens, num_seqs)
    n_live = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(1), 0, kv.shape[0])
    pool, local = combined_pages(k_pages, v_pages, page_indices)
    out = ragged_paged_attention(q, pool, kv, local, cu, n_live, sm_scale=sm_scale,
                                 sliding_window=sliding_window, soft_cap=soft_cap,
                                 num_kv_pages_per_block=kv_block, num_queries_per_block=q_block)
    live = jnp.arange(q.shape[0], dtype=jnp.int32) < cu[n_live[0]]
    return jnp.where(live[:, None, None], out, jnp.zeros_like(out))
