"""Reference ragged paged attention: plain jnp, obviously correct, jittable.

It is the oracle the other implementations are tested against and a fallback that runs
anywhere. Each query token gathers its own sequence's full page-table row (``W * page_size``
cache slots), builds the causal / length / window mask and does the softmax in float32. The cost
is therefore ``T * W * page_size`` per kv head: fine for tests and small batches, wasteful for
prefill (every token of a prompt re-gathers the same pages) -- that is what ``xla`` fixes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrunner.kernels.blocks import sanitize


def _precision(dtype):
    # f32 inputs: ask for true f32 dots (GPUs would otherwise default to TF32); bf16: default.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def ragged_paged_attention_reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                     num_seqs, *, sm_scale, sliding_window=None, soft_cap=None):
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    n_seq, width = page_indices.shape
    group = num_q_heads // num_kv_heads
    span = width * page_size

    cu, q_lens, kv, _ = sanitize(kv_lens, cu_q_lens, num_seqs)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    tok_seq = jnp.sum((cu[1:][None, :] <= t[:, None]).astype(jnp.int32), axis=1)
    tok_live = tok_seq < n_seq
    tok_seq = jnp.minimum(tok_seq, n_seq - 1)
    pos = kv[tok_seq] - q_lens[tok_seq] + (t - cu[tok_seq])  # [T]

    pages = jnp.clip(jnp.asarray(page_indices, jnp.int32)[tok_seq], 0, k_pages.shape[0] - 1)
    k = k_pages.at[pages].get(mode="promise_in_bounds").reshape(num_tokens, span, num_kv_heads,
                                                                 head_dim)
    v = v_pages.at[pages].get(mode="promise_in_bounds").reshape(num_tokens, span, num_kv_heads,
                                                                 head_dim)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    prec = _precision(q.dtype)
    s = jnp.einsum("thgd,tlhd->thgl", qg, k.astype(jnp.float32), precision=prec) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)

    l_idx = jnp.arange(span, dtype=jnp.int32)
    mask = (l_idx[None, :] <= pos[:, None]) & tok_live[:, None]
    if sliding_window is not None:
        mask &= l_idx[None, :] > pos[:, None] - sliding_window
    mask = mask[:, None, None, :]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    # Zero V outside the mask so non-finite garbage in unowned cache slots cannot leak (0 * NaN).
    vmask = mask[:, 0, 0, :][:, :, None, None]
    v = jnp.where(vmask, v.astype(jnp.float32), 0.0)
    o = jnp.einsum("thgl,tlhd->thgd", p, v, precision=prec)
    o = o / jnp.where(denom == 0, 1.0, denom)
    return o.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
