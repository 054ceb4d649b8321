"""Write the step's new keys/values into the paged KV pool.

The pool ``[P, page_size, Hkv, D]`` is viewed as ``[P * page_size, Hkv, D]`` (a free reshape:
row-major, so slot ``page * page_size + offset`` is row ``slot``) and the new rows are scattered
with ``.at[slots].set``. Under buffer donation (the engine donates the cache into its jitted step)
XLA performs the scatter in place: the cost is O(T * Hkv * D), independent of the pool size
(``tests/test_kernels.py`` checks the compiled HLO has no pool-sized copy and that the outputs
are the donated input buffers). ``jax_tpu``'s combined pool ``[P, page_size, 2 * Hkv, D]`` is
written the same way, a token's K and V interleaved into one row (:func:`write_kv_pages_combined`).

Caveat, XLA:CPU and 16-bit pools: XLA:CPU has no bf16/f16 scatter; it "normalises" one by
converting the whole pool to f32, scattering, and converting back -- O(pool) per call (measured:
~56 ms for a 2 x 25 MB bf16 pool vs ~0.01 ms for f32, whatever the pool size). A same-width
integer view does not help (``bitcast_convert_type`` is materialised as a pool-sized copy on
XLA:CPU). On CPU the native kernel's write (``native.write_kv_pages_native``, aliased in place)
handles bf16 pools; without it keep the KV cache in float32. On GPU/TPU bf16 scatters are native.

Padding tokens carry slots inside ``SCRATCH_PAGE`` (page 0), which no sequence owns; several of
them may hit the same slot, in which case any one of the values lands there -- harmless, since
nothing reads the scratch page through a live mask.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxrunner.kernels.blocks import SCRATCH_PAGE


def check_write_shapes(k_pages, v_pages, k_new, v_new, slot_mapping) -> None:
    """The shape contract of a page write (shared with the native write)."""
    if k_new.shape[1:] != k_pages.shape[2:] or v_new.shape != k_new.shape or v_pages.shape != k_pages.shape:
        raise ValueError(f"k_new/v_new {k_new.shape}/{v_new.shape} do not match pool "
                         f"{k_pages.shape}")
    if slot_mapping.shape != k_new.shape[:1]:
        raise ValueError(f"slot_mapping {slot_mapping.shape} vs tokens {k_new.shape[0]}")


def write_kv_pages(k_pages, v_pages, k_new, v_new, slot_mapping):
    """Scatter ``k_new``/``v_new`` [T, Hkv, D] into the pools at flat ``slot_mapping`` [T]."""
    check_write_shapes(k_pages, v_pages, k_new, v_new, slot_mapping)
    return _scatter_rows(k_pages, k_new, slot_mapping), _scatter_rows(v_pages, v_new, slot_mapping)


def write_kv_pages_combined(kv_pages, k_new, v_new, slot_mapping):
    """Scatter ``k_new``/``v_new`` [T, Hkv, D] into jax's combined pool ``kv_pages``
    [P, page_size, 2 * Hkv, D] (K at even heads, V at odd: ``jax_tpu``'s layout) at flat
    ``slot_mapping`` [T]: one scatter of rows that hold both, in place under donation like
    :func:`write_kv_pages`."""
    num_tokens, num_kv_heads, head_dim = k_new.shape
    if kv_pages.ndim != 4 or kv_pages.shape[2:] != (2 * num_kv_heads, head_dim) or v_new.shape != k_new.shape:
        raise ValueError(f"k_new/v_new {k_new.shape}/{v_new.shape} do not match the combined pool "
                         f"{kv_pages.shape}: expected [P, page_size, {2 * num_kv_heads}, {head_dim}]")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {slot_mapping.shape} vs tokens {num_tokens}")
    rows = jnp.stack([to_pool_dtype(k_new, kv_pages.dtype), to_pool_dtype(v_new, kv_pages.dtype)],
                     axis=2)  # [T, Hkv, 2, D]
    return _scatter_rows(kv_pages, rows.reshape(num_tokens, 2 * num_kv_heads, head_dim), slot_mapping)


def is_fp8(dtype) -> bool:
    """Whether ``dtype`` (a name or dtype; None: unknown) is one of the 8-bit float page dtypes
    (``kv_cache_dtype`` "fp8*")."""
    return dtype is not None and jnp.dtype(dtype) in (jnp.float8_e4m3fn, jnp.float8_e5m2)


def to_pool_dtype(rows, dtype):
    """``rows`` in a pool's ``dtype``. An 8-bit float pool saturates at its largest finite value
    first (e4m3fn has no infinity: a plain cast turns anything past 448 into NaN, and one NaN in a
    page poisons every later score of its sequence); the native write rounds the same way."""
    dtype = jnp.dtype(dtype)
    if is_fp8(dtype):
        largest = float(jnp.finfo(dtype).max)
        rows = jnp.clip(rows.astype(jnp.float32), -largest, largest)
    return rows.astype(dtype)


def _scatter_rows(pool, new, slot_mapping):
    """``new`` [T, H, D] scattered into ``pool`` [P, page_size, H, D] at flat ``slot_mapping``.

    The pool is viewed as [P * page_size, H, D]: only leading dims merge, so the view is free on
    TPU too, whose layouts tile the two minor dims."""
    num_pages, page_size = pool.shape[:2]
    flat = (num_pages * page_size, *pool.shape[2:])
    # An out-of-range slot (a bug upstream) is sent to the scratch page rather than clamped onto a
    # live page.
    slots = jnp.asarray(slot_mapping, jnp.int32)
    slots = jnp.where((slots >= 0) & (slots < flat[0]), slots, SCRATCH_PAGE * page_size)
    if slots.shape[0] == 1:
        # XLA rewrites a one-row scatter into a dynamic-update-slice, and on XLA:CPU that one is
        # not done in place inside a model step: the donated pool is copied whole at every layer
        # (measured: 60 pool copies per batch-1 decode step of SmolLM2). A second row aimed at the
        # scratch page keeps it a real scatter, which is in place.
        slots = jnp.concatenate([slots, jnp.full((1,), SCRATCH_PAGE * page_size, jnp.int32)])
        new = jnp.concatenate([new, jnp.zeros_like(new)])
    written = pool.reshape(flat).at[slots].set(to_pool_dtype(new, pool.dtype), mode="promise_in_bounds")
    return written.reshape(pool.shape)
