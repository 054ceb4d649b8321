"""jax's own TPU kernel (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``) behind our
contract: the ``jax_tpu`` implementation, the default on TPU.

jax's kernel reads ONE pool whose heads interleave K and V (``[P, page_size, 2 * Hkv, D]``, K at
even heads), while the other implementations keep two. An engine running ``jax_tpu`` therefore
keeps each layer's cache in jax's layout (``dispatch.kv_pool_shapes``): the step's new K/V are
scattered into it in place (``kv_write.write_kv_pages_combined``) and the page table goes
straight to the kernel (:func:`attend_combined`), so no layer copies any page. A caller holding
two pools (the start-up self-check, tests, device checks) gets :func:`ragged_paged_attention_jax_tpu`,
which gathers the batch's pages into a combined pool first: a copy of ``S * W`` pages per call,
bounded by the page-table width, never of the whole pool.

Our contract is kept around the kernel: padded sequences' metadata is sanitised (jax's kernel
trusts ``num_seqs`` only), page-table entries are clamped into the pool (the kernel's DMAs are
not bounds-checked), ``num_seqs`` becomes the ``[1]`` array jax wants, and padding rows come out
as zeros. The kernel exists for TPU only: on other platforms it can be lowered for TPU (tests)
but not run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrunner.kernels.blocks import sanitize

# The KV-head counts jax's kernel lowers for (lowered for TPU: Hkv 1..32, Hq/Hkv 1..8, bf16 and float32,
# head_dim 128 and 256, pages of 8..128 rows; tests/test_kernel_lowering.py keeps the check). Why: its
# block of 2 * Hkv K/V heads must fill XLA's TPU tiles (8 rows of 32-bit words, two bf16 values a word),
# and with 8+ float32 KV heads it blocks the query heads of 4 KV heads, 8 rows only when each serves 2+.
_BF16_KV_HEADS = "1, 2, 4 or a multiple of 8"
_F32_KV_HEADS = "1, 2, 4, or a multiple of 4 with 2+ query heads per KV head"


def available() -> str | None:
    """None when the installed jax ships the kernel, else why not."""
    try:  # lazy: this is the probe: not every jax ships the TPU kernel
        from jax.experimental.pallas.ops.tpu import ragged_paged_attention  # noqa: F401
    except ImportError as e:
        return f"this jax has no jax.experimental.pallas.ops.tpu.ragged_paged_attention ({e})"
    return None


def heads_refused(num_kv_heads: int, num_q_heads: int | None = None, kv_dtype=None) -> str | None:
    """None when jax's kernel lowers for ``num_kv_heads`` KV heads (and ``num_q_heads`` query heads)
    in a ``kv_dtype`` pool, else why not. An unknown count or dtype is taken at its strictest (one
    query head per KV head; both dtypes), so ``auto`` never picks a kernel that refuses the model."""
    small = num_kv_heads in (1, 2, 4)
    group = None if num_q_heads is None else num_q_heads // num_kv_heads
    bf16_ok = small or num_kv_heads % 8 == 0
    f32_ok = small or (num_kv_heads % 4 == 0 and group is not None and group > 1)
    name = None if kv_dtype is None else jnp.dtype(kv_dtype).name
    if name == "float32":
        ok, rule = f32_ok, f"float32 pools take {_F32_KV_HEADS}"
    elif name is not None:
        ok, rule = bf16_ok, f"{name} pools take {_BF16_KV_HEADS}"
    else:
        ok, rule = bf16_ok and f32_ok, f"bfloat16 pools take {_BF16_KV_HEADS}; float32 ones {_F32_KV_HEADS}"
    if ok:
        return None
    heads = f"{num_kv_heads} KV heads" + ("" if group is None else f" ({num_q_heads} query heads)")
    return f"jax's TPU kernel does not tile {heads}: {rule}"


def interleave_kv(k_pages, v_pages):
    """Two pools [P, page_size, Hkv, D] as jax's one [P, page_size, 2 * Hkv, D], K at even heads."""
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    kv = jnp.stack([k_pages, v_pages], axis=3)  # [P, page, Hkv, 2, D]
    return kv.reshape(num_pages, page_size, 2 * num_kv_heads, head_dim)


def deinterleave_kv(kv_pages):
    """jax's combined pool [P, page_size, 2 * Hkv, D] as its K and V pools (:func:`interleave_kv`
    undone)."""
    return kv_pages[:, :, 0::2], kv_pages[:, :, 1::2]


def combined_pages(k_pages, v_pages, page_indices):
    """The batch's pages as one K/V-interleaved pool and the page table renumbered into it (the
    two-pool path only; an engine running ``jax_tpu`` keeps its cache combined)."""
    n_seq, width = page_indices.shape
    pages = jnp.clip(jnp.asarray(page_indices, jnp.int32).reshape(-1), 0, k_pages.shape[0] - 1)
    local = jnp.arange(n_seq * width, dtype=jnp.int32).reshape(n_seq, width)
    return interleave_kv(k_pages[pages], v_pages[pages]), local


def _block_sizes(num_tokens: int, width: int, kv_block=None, q_block=None):
    """jax's kernel looks its block sizes up by the *local* TPU's generation and refuses anywhere
    else; when lowering from another platform, pass its untuned defaults (128 pages, 32 queries)."""
    if jax.default_backend() == "tpu":
        return kv_block, q_block
    return kv_block or min(width, 128), q_block or min(num_tokens, 32)


def attend_combined(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window=None,
                    soft_cap=None, num_kv_pages_per_block=None, num_queries_per_block=None):
    """Our contract over jax's layout: ``kv_pages`` [P, page_size, 2 * Hkv, D] (K at even heads),
    read by the kernel where it lies, through the page table as given (clamped into the pool)."""
    # lazy: only some jax builds ship jax's TPU kernel (``available``); read at each call, so tests can swap it
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    kv_block, q_block = _block_sizes(q.shape[0], page_indices.shape[1], num_kv_pages_per_block,
                                     num_queries_per_block)
    cu, _, kv, _ = sanitize(kv_lens, cu_q_lens, num_seqs)
    n_live = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(1), 0, kv.shape[0])
    pages = jnp.clip(jnp.asarray(page_indices, jnp.int32), 0, kv_pages.shape[0] - 1)
    out = ragged_paged_attention(q, kv_pages, kv, pages, cu, n_live, sm_scale=sm_scale,
                                 sliding_window=sliding_window, soft_cap=soft_cap,
                                 num_kv_pages_per_block=kv_block, num_queries_per_block=q_block)
    live = jnp.arange(q.shape[0], dtype=jnp.int32) < cu[n_live[0]]
    return jnp.where(live[:, None, None], out, jnp.zeros_like(out))


def ragged_paged_attention_jax_tpu(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                   *, sm_scale, sliding_window=None, soft_cap=None,
                                   num_kv_pages_per_block=None, num_queries_per_block=None):
    """The two-pool contract: the batch's pages gathered into a combined pool, then
    :func:`attend_combined` over it."""
    pool, local = combined_pages(k_pages, v_pages, page_indices)
    return attend_combined(q, pool, kv_lens, local, cu_q_lens, num_seqs, sm_scale=sm_scale,
                           sliding_window=sliding_window, soft_cap=soft_cap,
                           num_kv_pages_per_block=num_kv_pages_per_block,
                           num_queries_per_block=num_queries_per_block)
