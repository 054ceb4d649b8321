"""Public entry point: shape checks and the choice of implementation.

``impl="auto"`` never picks an implementation that cannot lower for the shapes:

* GPU: the Pallas (Triton) kernel when ``head_dim`` is a power of two from 16 to 256 (Triton
  tiles are powers of two and ``tl.dot`` needs K >= 16), else the plain-XLA path;
* TPU: jax's own ragged paged attention kernel (``jax_tpu``) when ``head_dim`` is a multiple of
  128 (its lane layout), the KV-head count is one it tiles (``jax_tpu.heads_refused``: 3, 6 or
  12 bf16 KV heads are not) and the installed jax ships it, else our Pallas (Mosaic) kernel when
  pages hold at least 2 rows (Mosaic rejects its one-row page slices), else plain XLA;
* CPU: the native kernel (``cpu/paged_attention.cc`` through XLA's FFI, built on first use) when
  a C++ compiler can build it and it takes ``head_dim``, else the plain-XLA path. Pallas only
  *interprets* on CPU, orders of magnitude slower.

:func:`choose_impl` also says why, for start-up reports and ``jaxrunner info``.
"""
from __future__ import annotations

import importlib

import jax.numpy as jnp

from jaxrunner.kernels import jax_tpu
from jaxrunner.kernels.kv_write import is_fp8, write_kv_pages, write_kv_pages_combined
from jaxrunner.kernels.names import ATTENTION_IMPLS, ATTENTION_KERNELS, AUTO, FP8_POOL_IMPLS
from jaxrunner.kernels.platform_support import capabilities
from jaxrunner.kernels.native import supports as supports_head_dim, write_kv_pages_native
from jaxrunner.kernels.xla import ragged_paged_attention_xla


def triton_supports(head_dim: int | None) -> bool:
    """Whether the Triton kernel lowers for heads of ``head_dim`` (any page size does)."""
    return head_dim is None or (16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0)


def choose_impl(impl: str = "auto", platform: str | None = None, head_dim: int | None = None,
                page_size: int | None = None, num_kv_heads: int | None = None, num_q_heads: int | None = None,
                kv_dtype=None) -> tuple[str, str]:
    """``(implementation, why)`` for ``impl`` on ``platform`` (default backend), for heads of
    ``head_dim``, pages of ``page_size`` rows, ``num_kv_heads``/``num_q_heads`` heads as the kernel
    sees them (per shard) and a ``kv_dtype`` pool (None: unknown; the TPU choice then assumes
    the strictest case). What runs on the platform at all is :func:`capabilities`' answer."""
    if is_fp8(kv_dtype) and impl not in (AUTO, *FP8_POOL_IMPLS):
        raise ValueError(f"attention_impl={impl!r} does not read {jnp.dtype(kv_dtype).name} KV pages "
                         f"(kv_cache_dtype fp8*); valid with them: 'auto' or one of {FP8_POOL_IMPLS}")
    if impl == "jax_tpu" and num_kv_heads is not None and kv_dtype is not None:
        refused = jax_tpu.heads_refused(num_kv_heads, num_q_heads, kv_dtype)
        if refused:  # jax's own error would come from deep in its kernel, after the weights loaded
            raise ValueError(f"attention_impl='jax_tpu': {refused}; 'auto' picks a kernel that takes them")
    if impl in ATTENTION_IMPLS:
        return impl, "asked for"
    if impl != AUTO:
        raise ValueError(f"impl must be {AUTO!r} or one of {ATTENTION_IMPLS}, got {impl!r}")
    caps = capabilities(platform)
    if is_fp8(kv_dtype) and caps.platform != "cpu":
        return "xla", f"{caps.platform.upper()}: plain XLA, the one kernel here that reads 8-bit float KV pages"
    if caps.platform == "gpu":
        if triton_supports(head_dim):
            return "pallas", "GPU: the Pallas Triton kernel"
        return "xla", (f"GPU: head_dim {head_dim} is not a power of two in [16, 256], which the "
                       "Triton kernel's tiles need; plain XLA instead")
    if caps.platform == "tpu":
        why = caps.attention["jax_tpu"]
        if why is None and head_dim is not None and head_dim % 128:
            why = f"head_dim {head_dim} is not a multiple of 128, which jax's TPU kernel needs"
        if why is None and num_kv_heads is not None:
            why = jax_tpu.heads_refused(num_kv_heads, num_q_heads, kv_dtype)
        if why is None:
            return "jax_tpu", "TPU: jax's ragged paged attention kernel"
        if page_size == 1:
            return "xla", f"TPU: {why}, and our Mosaic kernel needs pages of 2+ rows; plain XLA instead"
        return "pallas", f"TPU: {why}; our Pallas Mosaic kernel instead"
    if caps.attention["native"] is not None:
        return "xla", f"CPU: native kernel unavailable ({caps.attention['native']})"
    if head_dim is not None and not supports_head_dim(head_dim):
        return "xla", f"CPU: the native kernel does not take head_dim {head_dim}"
    return "native", "CPU: the native kernel"


def resolve_impl(impl: str = "auto", platform: str | None = None, head_dim: int | None = None,
                 page_size: int | None = None, num_kv_heads: int | None = None, num_q_heads: int | None = None,
                 kv_dtype=None) -> str:
    """The concrete implementation ``impl`` stands for (see :func:`choose_impl`)."""
    return choose_impl(impl, platform, head_dim, page_size, num_kv_heads, num_q_heads, kv_dtype)[0]


def kv_pool_shapes(impl: str, num_pages: int, page_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[tuple[int, int, int, int], ...]:
    """The shapes of the pools one layer's cache holds for ``impl`` (a concrete implementation):
    ``(k_pages, v_pages)``, each [P, page_size, Hkv, D]; for ``jax_tpu`` the one pool its kernel
    reads, [P, page_size, 2 * Hkv, D] with K at even heads, so that no step copies pages into it.
    :func:`write_kv_and_attend` takes the pools in this layout."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl == "jax_tpu":
        return ((num_pages, page_size, 2 * num_kv_heads, head_dim),)
    return ((num_pages, page_size, num_kv_heads, head_dim),) * 2


def kv_pools(impl: str, k_pages, v_pages) -> tuple:
    """K and V pools [P, page_size, Hkv, D] as one layer's cache in :func:`kv_pool_shapes`' layout
    for ``impl``: ``(k_pages, v_pages)``, or for ``jax_tpu`` its one K/V-interleaved pool."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    return (jax_tpu.interleave_kv(k_pages, v_pages),) if impl == "jax_tpu" else (k_pages, v_pages)


def kv_from_pools(pools: tuple) -> tuple:
    """``(k_pages, v_pages)`` of one layer's cache in either layout (:func:`kv_pools` undone)."""
    return jax_tpu.deinterleave_kv(pools[0]) if len(pools) == 1 else tuple(pools)


def _check(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sm_scale, sliding_window,
           soft_cap):
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(f"q must be [T, Hq, D] and k_pages [P, page_size, Hkv, D]; got "
                         f"{q.shape} and {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages {v_pages.shape} != k_pages {k_pages.shape}")
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k_pages.shape[2]
    if k_pages.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: q {head_dim}, pages {k_pages.shape[3]}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    _check_batch(kv_lens, page_indices, cu_q_lens, sliding_window, soft_cap)


def _check_batch(kv_lens, page_indices, cu_q_lens, sliding_window, soft_cap):
    if page_indices.ndim != 2 or kv_lens.shape != page_indices.shape[:1]:
        raise ValueError(f"page_indices {page_indices.shape} / kv_lens {kv_lens.shape} mismatch")
    if cu_q_lens.shape != (page_indices.shape[0] + 1,):
        raise ValueError(f"cu_q_lens {cu_q_lens.shape} must be [S+1] with "
                         f"S={page_indices.shape[0]}")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if soft_cap is not None and not float(soft_cap) > 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale, sliding_window=None, soft_cap=None, impl="auto", max_prefill_seqs=None):
    """Attention of packed ragged queries over a paged KV cache (see docs/architecture.md).

    q [T, Hq, D]; k_pages/v_pages [P, page_size, Hkv, D]; kv_lens [S]; page_indices [S, W];
    cu_q_lens [S+1]; num_seqs scalar. Returns [T, Hq, D] in q's dtype (f32 accumulation).
    ``max_prefill_seqs`` (static): a promise that at most this many sequences have more than one
    query token; the xla path then runs decodes and prefill chunks in separate passes (others
    ignore it). Breaking the promise gives wrong outputs: the engine's scheduler enforces it.
    """
    return _attend(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                   sliding_window=sliding_window, soft_cap=soft_cap, impl=impl, max_prefill_seqs=max_prefill_seqs,
                   return_pools=False)


def write_kv_and_attend(q, k_new, v_new, pools, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                        sm_scale, sliding_window=None, soft_cap=None, impl="auto", max_prefill_seqs=None):
    """One layer of a model step: :func:`write_kv_pages`, then :func:`ragged_paged_attention` over
    the written pools. ``pools`` is the layer's cache in :func:`kv_pool_shapes`' layout:
    ``(k_pages, v_pages)``, or ``(kv_pages,)``, jax's combined pool, which only ``jax_tpu`` reads
    (``jax_tpu`` over two pools gathers the batch's pages at every call). Returns ``(out, pools)``.

    Prefer it to the two calls when the pools are a donated output of the step: the xla path
    threads the pools through its loops and returns those, so XLA keeps one buffer per pool.
    With the two calls the pre-loop pool is returned while the loop carries another version of
    it, and XLA copies the whole pool at every layer (measured: 60 pool copies per SmolLM2 decode
    step, 18 ms of a 46 ms batch-1 token on CPU).
    """
    # one choice for the write and the attention
    impl = resolve_impl(impl, head_dim=q.shape[-1], page_size=pools[0].shape[1], num_kv_heads=k_new.shape[1],
                        num_q_heads=q.shape[1], kv_dtype=pools[0].dtype)
    if len(pools) == 1:
        return _write_combined_and_attend(q, k_new, v_new, pools[0], slot_mapping, kv_lens, page_indices, cu_q_lens,
                                          num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
                                          soft_cap=soft_cap, impl=impl)
    if len(pools) != 2:
        raise ValueError(f"pools: expected (k_pages, v_pages) or jax_tpu's (kv_pages,), got {len(pools)} arrays")
    k_pages, v_pages = pools
    write = write_kv_pages_native if impl == "native" else write_kv_pages  # native: in place for bf16 pools too
    k_pages, v_pages = write(k_pages, v_pages, k_new, v_new, slot_mapping)
    out, k_pages, v_pages = _attend(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                    sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, impl=impl,
                                    max_prefill_seqs=max_prefill_seqs, return_pools=True)
    return out, (k_pages, v_pages)


def _write_combined_and_attend(q, k_new, v_new, kv_pages, slot_mapping, kv_lens, page_indices, cu_q_lens, num_seqs,
                               *, sm_scale, sliding_window, soft_cap, impl):
    """``jax_tpu`` over its own layout: the step's K/V scattered into the combined pool in place,
    the page table handed to jax's kernel as it is."""
    if impl != "jax_tpu":
        raise ValueError(f"pools: one combined pool is jax_tpu's layout, but impl is {impl!r}; pass "
                         f"(k_pages, v_pages) for it, or impl='jax_tpu' (see kv_pool_shapes)")
    if q.ndim != 3 or q.shape[2] != kv_pages.shape[3] or q.shape[1] % k_new.shape[1]:
        raise ValueError(f"q {q.shape} does not fit the combined pool {kv_pages.shape}: expected [T, Hq, "
                         f"{kv_pages.shape[3]}] with Hq a multiple of the pool's {kv_pages.shape[2] // 2} KV heads")
    _check_batch(kv_lens, page_indices, cu_q_lens, sliding_window, soft_cap)
    kv_pages = write_kv_pages_combined(kv_pages, k_new, v_new, slot_mapping)
    out = jax_tpu.attend_combined(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=float(sm_scale),
                                  sliding_window=None if sliding_window is None else int(sliding_window),
                                  soft_cap=None if soft_cap is None else float(soft_cap))
    return out, (kv_pages,)


def _attend(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window,
            soft_cap, impl, max_prefill_seqs, return_pools):
    """Checks, the choice of implementation, and (``return_pools``) the pools to continue with."""
    _check(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sm_scale, sliding_window,
           soft_cap)
    impl = resolve_impl(impl, head_dim=q.shape[-1], page_size=k_pages.shape[1], num_kv_heads=k_pages.shape[2],
                        num_q_heads=q.shape[1], kv_dtype=k_pages.dtype)
    kw = dict(sm_scale=float(sm_scale),
              sliding_window=None if sliding_window is None else int(sliding_window),
              soft_cap=None if soft_cap is None else float(soft_cap))
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if impl == "xla":  # hands back the pools its loops carried
        return ragged_paged_attention_xla(*args, **kw, max_prefill_seqs=max_prefill_seqs, return_pools=return_pools)
    module, function = ATTENTION_KERNELS[impl]
    out = getattr(importlib.import_module(f"jaxrunner.kernels.{module}"), function)(*args, **kw)
    return (out, k_pages, v_pages) if return_pools else out
