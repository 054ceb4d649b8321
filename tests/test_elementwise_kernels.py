"""The native element-wise kernels around the products: the SiLU product of a gated MLP
(``kernels/cpu/gated_activation.cc``) against a float64 oracle and XLA's fusion of the same, RoPE
(``kernels/cpu/rotary.cc``) against ``layers.split_rotated`` under XLA, bit for bit, and where the
model routes to them (``MatmulKernels.elementwise``)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner import kernels
from jaxrunner.kernels import native
from jaxrunner.models import layers
from jaxrunner.models.config import ModelConfig
from matmul_oracle import custom_calls

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native CPU kernel unavailable: {native.unavailable_reason()}")

SILU_TARGET, ROTARY_TARGET = native.SILU_MUL_TARGET_NAME, native.ROTARY_TARGET_NAME


def _xla(gate_up, dtype):
    pairs = gate_up.reshape(gate_up.shape[0], -1, 2)
    return (jax.nn.silu(pairs[..., 0]) * pairs[..., 1]).astype(dtype)


def _float64(gate_up):
    pairs = np.asarray(gate_up, np.float64).reshape(gate_up.shape[0], -1, 2)
    gate, up = pairs[..., 0], pairs[..., 1]
    return gate / (1 + np.exp(-gate)) * up


@pytest.mark.parametrize("rows, width", [(1, 16), (3, 48), (64, 1536), (257, 80)])
def test_float32_within_rounding_of_float64(rows, width):
    gate_up = jax.random.normal(jax.random.key(rows + width), (rows, 2 * width), jnp.float32) * 6
    got = np.asarray(jax.jit(native.silu_mul_native, static_argnums=1)(gate_up, jnp.float32))
    want = _float64(gate_up)
    assert got.dtype == np.float32 and got.shape == (rows, width)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("rows, width", [(1, 16), (64, 1536)])
def test_bfloat16_rounds_as_xla_does(rows, width):
    """Rounded to bf16 as ``astype`` rounds: equal to XLA's fusion but where the float32 values
    straddle a rounding boundary (then one unit in the last place)."""
    gate_up = jax.random.normal(jax.random.key(7), (rows, 2 * width), jnp.float32) * 4
    got = np.asarray(native.silu_mul_native(gate_up, jnp.bfloat16).astype(jnp.float32))
    want = np.asarray(_xla(gate_up, jnp.bfloat16).astype(jnp.float32))
    assert np.mean(got != want) < 1e-3
    np.testing.assert_allclose(got, want, rtol=2 ** -7)
    exact = np.asarray(jnp.asarray(native.silu_mul_native(gate_up, jnp.float32)).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(got, exact)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_special_values_follow_xla(dtype):
    """NaN in a gate or an up gives NaN; infinities and saturated gates give what XLA gives."""
    gates = [np.nan, 1.0, np.inf, -np.inf, 100.0, -100.0, -88.0, 0.0, -0.0, 30.0, -30.0, 2.0, -2.0, 0.5, 1e-30, -5.0]
    ups = [1.0, np.nan, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1.0, 3.0, np.inf, 0.5, 4.0, 1.0, 1e30]
    gate_up = jnp.asarray(np.stack([gates, ups], axis=1).reshape(1, 32), jnp.float32)
    got = np.asarray(native.silu_mul_native(gate_up, dtype).astype(jnp.float32))
    want = np.asarray(_xla(gate_up, dtype).astype(jnp.float32))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-30)


def test_refuses_what_it_does_not_take():
    for gate_up, dtype in ((jnp.zeros((2, 40)), jnp.float32), (jnp.zeros((2, 32), jnp.bfloat16), jnp.float32),
                           (jnp.zeros((2, 32)), jnp.float16), (jnp.zeros((2, 2, 32)), jnp.float32)):
        assert not native.silu_mul_supported(gate_up, dtype)
        with pytest.raises(ValueError, match="native SiLU product"):
            native.silu_mul_native(gate_up, dtype)


def _mlp_inputs(intermediate: int = 48, hidden: int = 32):
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=hidden, intermediate_size=intermediate,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                      max_position_embeddings=64, tie_word_embeddings=True)
    key = jax.random.key(3)
    layer = {"w_gate_up": jax.random.normal(key, (hidden, 2 * intermediate), jnp.bfloat16) * 0.2,
             "w_down": jax.random.normal(jax.random.fold_in(key, 1), (intermediate, hidden), jnp.bfloat16) * 0.2}
    h = jax.random.normal(jax.random.fold_in(key, 2), (5, hidden), jnp.bfloat16)
    return layer, h, cfg


def test_gated_mlp_routes_silu_only_where_chosen():
    layer, h, cfg = _mlp_inputs()
    on = dataclasses.replace(kernels.XLA_MATMULS, elementwise="native")

    def mlp(activation, matmuls):
        return lambda x: layers.gated_mlp(layer, x, cfg, activation, matmuls)

    assert custom_calls(SILU_TARGET, mlp(jax.nn.silu, on), h) == 1
    assert custom_calls(SILU_TARGET, mlp(jax.nn.silu, kernels.XLA_MATMULS), h) == 0
    assert custom_calls(SILU_TARGET, mlp(layers.gelu_tanh, on), h) == 0
    got = np.asarray(mlp(jax.nn.silu, on)(h).astype(jnp.float32))
    want = np.asarray(mlp(jax.nn.silu, kernels.XLA_MATMULS)(h).astype(jnp.float32))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def _rope_tables(tokens: int, dim: int):
    angles = (jnp.arange(tokens) * 37.0)[:, None] * (10000.0 ** (-jnp.arange(dim // 2) / (dim // 2)))[None]
    return jnp.concatenate([jnp.cos(angles)] * 2, -1), jnp.concatenate([jnp.sin(angles)] * 2, -1)


def _rotated_fma(x, cos, sin):
    """fma(x, cos, rotate_half(x) * sin) rounded once (long double holds the exact sum's digits)."""
    half = x.shape[-1] // 2
    rotated = (np.concatenate([-x[..., half:], x[..., :half]], -1) * sin).astype(np.float32)
    return (x.astype(np.longdouble) * cos + rotated).astype(np.float32)


@pytest.mark.parametrize("tokens, kv_heads, group, dim", [(1, 8, 1, 32), (5, 2, 4, 128), (64, 3, 3, 64), (257, 1, 2, 64)])
def test_rotary_rounds_as_optimized_xla(tokens, kv_heads, group, dim):
    """Bit for bit the fused multiply-add XLA makes of ``apply_rope`` when it optimizes (the tests
    run XLA unoptimized, which rounds x * cos too: within one rounding of the terms apart)."""
    qkv = jax.random.normal(jax.random.key(tokens), (tokens, kv_heads, group + 2, dim), jnp.float32) * 3
    cos, sin = _rope_tables(tokens, dim)
    q, k, v = (np.asarray(a) for a in jax.jit(native.rotary_native)(qkv, cos, sin))
    x, c, s = np.asarray(qkv), np.asarray(cos)[:, None, :], np.asarray(sin)[:, None, :]
    np.testing.assert_array_equal(q, _rotated_fma(x[:, :, :group].reshape(tokens, -1, dim), c, s))
    np.testing.assert_array_equal(k, _rotated_fma(x[:, :, group], c, s))
    np.testing.assert_array_equal(v, x[:, :, group + 1])
    want = jax.jit(lambda a, c, s: layers.split_rotated(a, c, s, kv_heads * group))(qkv, cos, sin)
    for got, xla in zip((q, k, v), want):
        np.testing.assert_allclose(got, np.asarray(xla), rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(x).max())


def test_rotary_keeps_a_nan_to_its_pair():
    """A NaN input reaches its own output and its rotation partner's (XLA's permutation product
    spreads it over the whole head instead: 0 * NaN); the rest of the head stays finite."""
    qkv = jax.random.normal(jax.random.key(2), (2, 1, 3, 64), jnp.float32).at[0, 0, 0, 3].set(jnp.nan)
    cos, sin = _rope_tables(2, 64)
    q, k, v = (np.asarray(a) for a in native.rotary_native(qkv, cos, sin))
    assert np.flatnonzero(np.isnan(q[0, 0])).tolist() == [3, 35]
    assert np.isfinite(q[1]).all() and np.isfinite(k).all() and np.isfinite(v).all()


def test_rotary_refuses_what_it_does_not_take():
    cos, sin = _rope_tables(3, 64)
    for qkv, c in ((jnp.zeros((3, 2, 3, 48)), _rope_tables(3, 48)[0]), (jnp.zeros((3, 2, 3, 64)), cos[:, :32]),
                   (jnp.zeros((3, 2, 3, 64), jnp.bfloat16), cos), (jnp.zeros((3, 2, 2, 64)), cos)):
        assert not native.rotary_supported(qkv, c)
        with pytest.raises(ValueError, match="native RoPE"):
            native.rotary_native(qkv, c, c)


def test_split_rotated_routes_whole_head_rope_only_where_chosen():
    qkv = jax.random.normal(jax.random.key(1), (4, 2, 5, 64), jnp.float32)
    cos, sin = _rope_tables(4, 64)
    on = dataclasses.replace(kernels.XLA_MATMULS, elementwise="native")

    def split(matmuls, c, s):
        return lambda a: layers.split_rotated(a, c, s, 6, matmuls)

    assert custom_calls(ROTARY_TARGET, split(on, cos, sin), qkv) == 1
    assert custom_calls(ROTARY_TARGET, split(kernels.XLA_MATMULS, cos, sin), qkv) == 0
    assert custom_calls(ROTARY_TARGET, split(on, cos[:, :32], sin[:, :32]), qkv) == 0  # partial rotary
