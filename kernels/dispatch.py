"""Public entry point: shape checks and the choice of implementation.

``impl="auto"`` resolves to the Pallas kernel on GPU/TPU. On CPU it resolves to the native kernel
(``cpu/paged_attention.cc`` through XLA's FFI, built on first use) when a C++ compiler can build
it, else to the plain-XLA path. Pallas only *interprets* on CPU, orders of magnitude slower.
"""
from __future__ import annotations

import jax

IMPLS = ("reference", "xla", "native", "pallas")


def resolve_impl(impl: str = "auto", platform: str | None = None, head_dim: int | None = None) -> str:
    """The concrete implementation ``impl`` stands for on ``platform`` (default backend), for
    heads of ``head_dim`` (unknown: any size the implementation takes)."""
    if impl in IMPLS:
        return impl
    if impl != "auto":
        raise ValueError(f"impl must be 'auto' or one of {IMPLS}, got {impl!r}")
    platform = (platform or jax.default_backend()).lower()
    if platform in ("gpu", "cuda", "rocm", "tpu"):
        return "pallas"
    from jaxrunner.kernels import native

    fits = head_dim is None or native.supports(head_dim)
    return "native" if fits and native.available() else "xla"


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


def write_kv_and_attend(q, k_new, v_new, k_pages, v_pages, slot_mapping, kv_lens, page_indices, cu_q_lens,
                        num_seqs, *, sm_scale, sliding_window=None, soft_cap=None, impl="auto",
                        max_prefill_seqs=None):
    """One layer of a model step: :func:`write_kv_pages`, then :func:`ragged_paged_attention` over
    the written pools. Returns ``(out, k_pages, v_pages)``.

    Prefer it to the two calls when the pools are a donated output of the step: the xla path
    threads the pools through its loops and returns those, so XLA keeps one buffer per pool.
    With the two calls the pre-loop pool is returned while the loop carries another version of
    it, and XLA copies the whole pool at every layer (measured: 60 pool copies per SmolLM2 decode
    step, 18 ms of a 46 ms batch-1 token on CPU).
    """
    impl = resolve_impl(impl, head_dim=q.shape[-1])  # one choice for the write and the attention
    if impl == "native":  # in place for bf16 pools too
        from jaxrunner.kernels.native import write_kv_pages_native as write_kv_pages
    else:
        from jaxrunner.kernels.kv_write import write_kv_pages

    k_pages, v_pages = write_kv_pages(k_pages, v_pages, k_new, v_new, slot_mapping)
    return _attend(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                   sliding_window=sliding_window, soft_cap=soft_cap, impl=impl, max_prefill_seqs=max_prefill_seqs,
                   return_pools=True)


def _attend(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window,
            soft_cap, impl, max_prefill_seqs, return_pools):
    """Checks, the choice of implementation, and (``return_pools``) the pools to continue with."""
    _check(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sm_scale, sliding_window,
           soft_cap)
    impl = resolve_impl(impl, head_dim=q.shape[-1])
    kw = dict(sm_scale=float(sm_scale),
              sliding_window=None if sliding_window is None else int(sliding_window),
              soft_cap=None if soft_cap is None else float(soft_cap))
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if impl == "xla":  # hands back the pools its loops carried
        from jaxrunner.kernels.xla import ragged_paged_attention_xla

        return ragged_paged_attention_xla(*args, **kw, max_prefill_seqs=max_prefill_seqs, return_pools=return_pools)
    if impl == "reference":
        from jaxrunner.kernels.reference import ragged_paged_attention_reference as fn
    elif impl == "native":
        from jaxrunner.kernels.native import ragged_paged_attention_native as fn
    else:
        from jaxrunner.kernels.pallas_kernel import ragged_paged_attention_pallas as fn
    out = fn(*args, **kw)
    return (out, k_pages, v_pages) if return_pools else out
