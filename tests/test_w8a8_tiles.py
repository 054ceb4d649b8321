"""``"w8a8"`` weights as AMX-INT8 tiles (``kernels.w8a8_tiles``, ``kernels/cpu/w8a8_matmul.cc``):
the layout round-trips on any machine; where the native build has AMX-INT8, the kernel computes
``models.linear.w8a8_matmul``'s formula exactly (IEEE float32 division for the scales)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner import kernels
from jaxrunner.kernels import native
from jaxrunner.models import linear, quant

needs_amx_int8 = pytest.mark.skipif(not native.w8a8_matmul_ready(),
                                    reason="the native build has no AMX-INT8 here (or AMX is not granted)")


def _leaf(rng, k, n):
    return quant.quantize_w8a8_weight(jnp.asarray(rng.normal(size=(k, n)) * 0.05, jnp.float32))


@pytest.mark.parametrize("k,n", [(576, 960), (100, 33), (64, 16), (130, 1000)])
def test_tiles_round_trip_bit_for_bit(k, n):
    leaf = _leaf(np.random.default_rng(k + n), k, n)
    tiles = kernels.to_w8a8_tiles(leaf)
    assert tiles.tiles.shape == (-(-n // 16), -(-k // 64), 16, 16, 4) and (tiles.k, tiles.n) == (k, n)
    back = kernels.from_w8a8_tiles(tiles)
    np.testing.assert_array_equal(back["q"], leaf["q"])
    np.testing.assert_array_equal(back["scale"], leaf["scale"])
    like = tiles.plain_like()
    assert like["q"].shape == (k, n) and like["q"].dtype == jnp.int8 and like["scale"].shape == (n,)


def _formula(x, leaf, dtype):
    """w8a8_matmul's formula in numpy float32 (IEEE division): what the kernel must give exactly."""
    x32 = np.asarray(x, np.float32)
    scale = np.maximum(np.abs(x32).max(-1, keepdims=True) / np.float32(127), np.float32(quant.MIN_ACTIVATION_SCALE))
    q = np.round(x32 / scale).astype(np.int32)
    acc = q @ np.asarray(leaf["q"], np.int32)
    y = (acc.astype(np.float32) * scale) * np.asarray(leaf["scale"])
    return np.asarray(jnp.asarray(y, dtype), np.float32)


@needs_amx_int8
@pytest.mark.parametrize("m,k,n,dtype", [(1, 576, 960, jnp.bfloat16), (5, 576, 1000, jnp.bfloat16),
                                         (17, 100, 33, jnp.float32), (64, 576, 3072, jnp.bfloat16),
                                         (130, 1536, 576, jnp.bfloat16), (70, 130, 50, jnp.float32)])
def test_kernel_computes_the_w8a8_formula_exactly(m, k, n, dtype):
    rng = np.random.default_rng(m * k + n)
    leaf = _leaf(rng, k, n)
    x = jnp.asarray(rng.normal(size=(m, k)) * rng.uniform(0.1, 10, size=(m, 1)), dtype)
    if m > 2:
        x = x.at[1].set(0)  # a zero row: the guarded scale gives exact zeros
    got = jax.jit(kernels.w8a8_tile_matmul, static_argnums=2)(x, kernels.to_w8a8_tiles(leaf), quant.MIN_ACTIVATION_SCALE)
    assert got.dtype == dtype and got.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(got, np.float32), _formula(x, leaf, dtype))
    if m > 2:
        assert not np.asarray(got[1], np.float32).any()
    # XLA's own path rounds some scales an ulp differently (its vectorised division), which moves
    # an input across a rounding boundary now and then: close, not equal
    xla = np.asarray(jax.jit(linear.w8a8_matmul)(x, leaf), np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), xla, atol=0.05 * np.abs(xla).max())


@needs_amx_int8
def test_kernel_refuses_what_it_does_not_take():
    leaf = kernels.to_w8a8_tiles(_leaf(np.random.default_rng(0), 64, 16))
    with pytest.raises(ValueError, match=r"x bf16 or float32 \[M, 64\]"):
        kernels.w8a8_tile_matmul(jnp.zeros((2, 32), jnp.bfloat16), leaf, 1e-12)
    with pytest.raises(ValueError, match="bf16 or float32"):
        kernels.w8a8_tile_matmul(jnp.zeros((2, 64), jnp.float16), leaf, 1e-12)


@needs_amx_int8
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_nan_in_a_row_makes_that_row_nan_as_xla_does(dtype):
    rng = np.random.default_rng(3)
    leaf = _leaf(rng, 100, 40)
    x = jnp.asarray(rng.normal(size=(3, 100)), dtype).at[1, 97].set(jnp.nan)  # in the tail of 16
    got = np.asarray(kernels.w8a8_tile_matmul(x, kernels.to_w8a8_tiles(leaf), quant.MIN_ACTIVATION_SCALE), np.float32)
    xla = np.asarray(jax.jit(linear.w8a8_matmul)(x, leaf), np.float32)
    assert np.isnan(got[1]).all() and np.isnan(xla[1]).all()
    assert np.isfinite(got[[0, 2]]).all()
