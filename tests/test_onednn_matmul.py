"""oneDNN's matmul (``kernels/cpu/onednn_matmul.cc``) against a float64 oracle (``matmul_oracle``),
where the model routes a product to it, and how the engine option ``cpu_matmul`` chooses it."""
from __future__ import annotations

import functools
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner import kernels
from jaxrunner.config import EngineConfig
from jaxrunner.kernels import onednn
from jaxrunner.models import linear
from matmul_oracle import assert_matches_float64, assert_nan_weight_poisons_only_its_output, custom_calls, normal

X86_LINUX = platform.system() == "Linux" and platform.machine() == "x86_64"
needs_onednn = pytest.mark.skipif(onednn.unavailable_reason() is not None and not X86_LINUX,
                                  reason=f"oneDNN unavailable off x86-64 Linux: {onednn.unavailable_reason()}")
ONEDNN_ALL = kernels.MatmulKernels(onednn_dtypes=("float32", "bfloat16"), onednn_min_rows=2)


def test_onednn_is_installed_and_builds_on_x86_64_linux():
    """A default dependency there: its absence is an installation bug, not a reason to skip."""
    if not X86_LINUX:
        pytest.skip("oneDNN is a default dependency on x86-64 Linux only")
    assert onednn.unavailable_reason() is None



def _check(x, w, transposed):
    got = jax.jit(functools.partial(onednn.onednn_matmul, transposed=transposed))(x, w)
    assert_matches_float64(got, x, w, transposed)


@needs_onednn
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rows", [2, 17, 64])
@pytest.mark.parametrize("k, n, transposed", [(576, 960, False), (130, 80, False), (7, 48, False),
                                              (64, 1023, True), (576, 4096, True)])
def test_matches_a_float64_oracle(rows, k, n, transposed, dtype):
    rng = np.random.default_rng(rows * 1000 + k + n)
    w_shape = (n, k) if transposed else (k, n)
    _check(normal(rng, (rows, k), dtype=dtype), normal(rng, w_shape, 0.05, dtype), transposed)


@needs_onednn
def test_each_output_sees_only_its_own_weights():
    assert_nan_weight_poisons_only_its_output(onednn.onednn_matmul, rows=33)


@pytest.mark.parametrize("x_shape, w_shape, transposed, dtype, w_dtype", [
    ((4, 64), (32, 16), False, jnp.bfloat16, jnp.bfloat16),  # K mismatch
    ((4, 64), (16, 32), True, jnp.bfloat16, jnp.bfloat16),   # K mismatch, [N, K]
    ((4, 64), (64, 16), False, jnp.float32, jnp.bfloat16),   # mixed dtypes
    ((4, 64), (64, 16), False, jnp.float16, jnp.float16),    # neither bf16 nor float32
    ((2, 4, 64), (64, 16), False, jnp.bfloat16, jnp.bfloat16),  # not 2-D
])
def test_unsupported_inputs_say_why(x_shape, w_shape, transposed, dtype, w_dtype):
    x, w = jnp.zeros(x_shape, dtype), jnp.zeros(w_shape, w_dtype)
    assert not onednn.onednn_supported(x, w, transposed)
    if onednn.unavailable_reason() is None:
        with pytest.raises(ValueError, match="oneDNN matmul takes x"):
            onednn.onednn_matmul(x, w, transposed=transposed)


def _onednn_calls(fn, *args) -> int:
    return custom_calls(onednn.TARGET_NAME, fn, *args)


@needs_onednn
def test_model_routes_the_chosen_dtypes_and_rows_only():
    """``onednn_dtypes``, ``onednn_min_rows`` and ``onednn_min_weight_bytes`` decide: bf16 products
    of 16+ rows here, float32, fewer rows and smaller weights stay on XLA; a quantized weight's
    product at many rows goes there once dequantized."""
    from jaxrunner.models import quant

    bf16_16 = kernels.MatmulKernels(onednn_dtypes=("bfloat16",), onednn_min_rows=16)
    matmul = functools.partial(linear.matmul_f32_acc, matmuls=bf16_16)
    rng = np.random.default_rng(1)
    w, embed = normal(rng, (64, 96)), normal(rng, (256, 64))
    many, few = normal(rng, (16, 64)), normal(rng, (15, 64))
    assert _onednn_calls(matmul, many, w) == 1
    assert _onednn_calls(lambda x, e: matmul(x, e, contract=(-1, 1)), many, embed) == 1
    assert _onednn_calls(matmul, few, w) == 0
    assert _onednn_calls(matmul, many.astype(jnp.float32), w.astype(jnp.float32)) == 0
    assert _onednn_calls(functools.partial(linear.matmul_f32_acc, matmuls=kernels.XLA_MATMULS), many, w) == 0
    big_only = kernels.MatmulKernels(onednn_dtypes=("bfloat16",), onednn_min_weight_bytes=embed.size * 2)
    assert _onednn_calls(functools.partial(linear.matmul_f32_acc, matmuls=big_only), many, w) == 0
    assert _onednn_calls(lambda x, e: linear.matmul_f32_acc(x, e, big_only, contract=(-1, 1)), many, embed) == 1
    packed = quant.quantize_weight_only(w, "int4", 32)
    assert _onednn_calls(lambda x, q: linear.linear_f32(x, q, bf16_16), many, packed) == 1
    for x, weights, contract in ((many, w, (-1, 0)), (many, embed, (-1, 1))):
        got = matmul(x, weights, contract=contract)
        want = jax.lax.dot_general(x.astype(jnp.float32), weights.astype(jnp.float32),
                                   (((1,), (contract[1] % 2,)), ((), ())), precision="highest")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the engine option
def test_cpu_matmul_option_is_checked_before_anything_loads():
    with pytest.raises(ValueError, match=r"EngineConfig.cpu_matmul: invalid value 'mkl'; valid: .*'onednn'"):
        EngineConfig(cpu_matmul="mkl")
    with pytest.raises(ValueError, match="cpu_matmul: invalid value"):
        kernels.choose_matmuls("mkl", "cpu")


def test_choose_matmuls_resolves_each_choice():
    auto, why = kernels.choose_matmuls("auto", "cpu")
    assert auto == kernels.capabilities("cpu").matmuls and why.startswith("CPU: ")
    xla, _ = kernels.choose_matmuls("xla", "cpu")
    assert xla.onednn_dtypes == () and xla.one_row == auto.one_row  # the one-row kernel is not this choice
    gpu, why = kernels.choose_matmuls("onednn", "gpu")
    assert gpu == kernels.XLA_MATMULS and "gpu" in why  # a CPU option: elsewhere it changes nothing
    if onednn.unavailable_reason() is None:
        chosen, why = kernels.choose_matmuls("onednn", "cpu")
        assert chosen.onednn_dtypes == ("float32", "bfloat16") and why == "asked for"
        assert chosen.onednn_min_rows == 2 and chosen.onednn_min_weight_bytes == 0
    else:
        with pytest.raises(ValueError, match="cpu_matmul='onednn': oneDNN's matmul is unavailable here"):
            kernels.choose_matmuls("onednn", "cpu")


def test_the_table_applies_to_the_cpu_it_names(monkeypatch):
    """``ONEDNN_FASTER``'s first row whose flag the CPU has decides ``auto``; a CPU kind not in the
    table keeps XLA's dot."""
    from jaxrunner.kernels import native, platform_support

    for flags, want in ((["amx_bf16", "avx512f"], platform_support.ONEDNN_FASTER[0][1:]),
                        (["avx2", "fma"], platform_support.NOT_FASTER)):
        monkeypatch.setattr(native, "cpu_features", lambda flags=flags: flags)
        assert platform_support._onednn_faster() == want
