"""The float64 oracle the CPU matmul kernels (native few-row, oneDNN) are checked against, and what
their tests share: random operands and a count of a kernel's calls in a lowered function.

Products of two bf16 values are exact in float32 and the kernels sum in float32, so the only
error is float32 summation (and one rounding per product for float32 operands): the bound is a
few float32 ulps of the sum of |products|, far below one bf16 ulp of the result.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def normal(rng, shape, scale=1.0, dtype=jnp.bfloat16):
    """Standard normal values times ``scale``, rounded to ``dtype``."""
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def custom_calls(target: str, fn, *args) -> int:
    """How many calls of the FFI ``target`` the jitted ``fn(*args)`` lowers to."""
    return jax.jit(fn).lower(*args).as_text().count(target)


def assert_matches_float64(got, x, w, transposed: bool) -> None:
    """``got`` is ``x @ w`` (``x @ w.T`` when ``transposed``) within float32 summation error."""
    got = np.asarray(got)
    x64, w64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, w))
    w64 = w64.T if transposed else w64
    want = x64 @ w64
    bound = 4 * x.shape[1] * np.finfo(np.float32).eps * (np.abs(x64) @ np.abs(w64)) + 1e-30
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


def assert_nan_weight_poisons_only_its_output(matmul, rows: int) -> None:
    """``matmul(x, w, transposed=...)``: a NaN in one weight column ([K, N]) or row ([N, K]) poisons
    exactly that output, for ``rows`` rows of bf16 activations (no stray reads across tiles)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.bfloat16)
    w = (rng.standard_normal((64, 48)) * 0.05).astype(np.float32)
    w[:, 17] = np.nan
    for weights, transposed in ((w, False), (w.T, True)):
        got = np.asarray(matmul(x, jnp.asarray(weights, jnp.bfloat16), transposed=transposed))
        assert np.isnan(got[:, 17]).all() and np.isfinite(np.delete(got, 17, axis=1)).all(), transposed
