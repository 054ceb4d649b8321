"""The native few-row matmul (``kernels/cpu/small_matmul.cc``, bf16 or float32 operands) against
a float64 oracle (``matmul_oracle``), and where the model routes a product to it."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner import kernels
from jaxrunner.kernels import native
from jaxrunner.models import linear as quant_linear
from matmul_oracle import assert_matches_float64, assert_nan_weight_poisons_only_its_output, custom_calls, normal

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native CPU kernel unavailable: {native.unavailable_reason()}")



def _check(x, w, transposed):
    got = jax.jit(functools.partial(native.small_matmul_native, transposed=transposed))(x, w)
    assert_matches_float64(got, x, w, transposed)


DTYPES = pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])


@DTYPES
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (64, 16), (7, 48), (130, 80)])
def test_weights_k_by_n(rows, k, n, dtype):
    """[K, N] weights, including K below the split count and K not a multiple of four."""
    rng = np.random.default_rng(rows * 1000 + k + n)
    _check(normal(rng, (rows, k), dtype=dtype), normal(rng, (k, n), 0.05, dtype), transposed=False)


@DTYPES
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k", [(4096, 576), (1023, 64), (3, 32)])
def test_weights_n_by_k(rows, n, k, dtype):
    """[N, K] weights (the tied embedding as LM head), including N not a multiple of four."""
    rng = np.random.default_rng(rows * 1000 + k + n)
    _check(normal(rng, (rows, k), dtype=dtype), normal(rng, (n, k), 0.05, dtype), transposed=True)


def test_each_output_sees_only_its_own_weights():
    assert_nan_weight_poisons_only_its_output(native.small_matmul_native, rows=2)


@pytest.mark.parametrize("x_shape, w_shape, transposed, dtype, w_dtype", [
    ((5, 64), (64, 16), False, jnp.bfloat16, jnp.bfloat16),  # too many rows
    ((1, 64), (64, 24), False, jnp.bfloat16, jnp.bfloat16),  # N not a multiple of 16
    ((1, 48), (16, 48), True, jnp.bfloat16, jnp.bfloat16),   # K not a multiple of 32 (bf16)
    ((1, 40), (16, 40), True, jnp.float32, jnp.float32),     # K not a multiple of 16 (float32)
    ((1, 64), (32, 16), False, jnp.bfloat16, jnp.bfloat16),  # K mismatch
    ((1, 64), (64, 16), False, jnp.float32, jnp.bfloat16),   # mixed dtypes
    ((1, 64), (64, 16), False, jnp.float16, jnp.float16),    # neither bf16 nor float32
])
def test_unsupported_inputs_say_why(x_shape, w_shape, transposed, dtype, w_dtype):
    x, w = jnp.zeros(x_shape, dtype), jnp.zeros(w_shape, w_dtype)
    assert not native.small_matmul_supported(x, w, transposed)
    with pytest.raises(ValueError, match="native small matmul takes x"):
        native.small_matmul_native(x, w, transposed=transposed)


def _native_calls(fn, *args) -> int:
    return custom_calls(native.MATMUL_TARGET_NAME, fn, *args)


def test_model_routes_one_row_products_only():
    """The model's matmuls use the kernel for one row on one CPU device (a batch-1 decode, the LM
    head of one sequence), bf16 or float32; multi-row and mixed-dtype products stay with XLA, and so
    does everything on several devices."""
    here = kernels.capabilities().matmuls  # what the runner hands the model in this one-CPU process
    assert here.one_row == "native"
    matmul = functools.partial(quant_linear.matmul_f32_acc, matmuls=here)
    linear_f32 = functools.partial(quant_linear.linear_f32, matmuls=here)
    rng = np.random.default_rng(1)
    w, embed = normal(rng, (64, 96)), normal(rng, (256, 64))
    one, four = normal(rng, (1, 64)), normal(rng, (4, 64))
    assert _native_calls(matmul, one, w) == 1
    assert _native_calls(lambda x, e: matmul(x, e, contract=(-1, 1)), one, embed) == 1
    assert _native_calls(matmul, four, w) == 0
    assert _native_calls(matmul, one.astype(jnp.float32), w.astype(jnp.float32)) == 1
    assert _native_calls(linear_f32, one.astype(jnp.float32), w.astype(jnp.float32)) == 1
    assert _native_calls(linear_f32, one.astype(jnp.float32), w) == 0
    several = kernels.capabilities("cpu", device_count=2).matmuls
    assert several.one_row == "xla"
    assert _native_calls(functools.partial(quant_linear.matmul_f32_acc, matmuls=several), one, w) == 0
    for x, weights, contract in ((one, w, (-1, 0)), (one, embed, (-1, 1)), (one.astype(jnp.float32), w.astype(jnp.float32), (-1, 0))):
        got = matmul(x, weights, contract=contract)
        want = jax.lax.dot_general(x.astype(jnp.float32), weights.astype(jnp.float32),
                                   (((1,), (contract[1] % 2,)), ((), ())), precision="highest")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
