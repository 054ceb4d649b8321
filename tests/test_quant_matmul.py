"""Weight-only quantized products (``models/linear.py``): the native CPU kernel
(``kernels/cpu/quant_matmul.cc``) and the XLA path against a float64 oracle, which products go
where, and the XLA path lowering for GPU and TPU.

The oracle multiplies x (as given, widened) with the dequantized weight in float64. The kernel
accumulates in float32 and scales once per group: its error is a few float32 ulps of
sum |x| |w|. With AVX512-VNNI or AVX2, its few-row products round x to 16 bits per run of 32
inputs first (``cpu/quant_dot.h``), which adds at most max|x over the run| / 65024 per input. The XLA path dequantizes to x's dtype first, so with bf16 activations the weight is rounded to bf16
too (one bf16 ulp of each weight)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner import kernels
from jaxrunner.kernels import cpu_isa, native
from jaxrunner.kernels.testing import lowering_context
from jaxrunner.models import linear, quant

needs_native = pytest.mark.skipif(not native.available(), reason=f"native CPU kernel unavailable: {native.unavailable_reason()}")
FORMATS = [("int8", 32), ("int4", 32), ("int4", 64)]


def _case(fmt, group, rows, dtype, k=192, n=80, seed=0):
    rng = np.random.default_rng(seed)
    leaf = quant.quantize_weight_only(rng.standard_normal((k, n)).astype(np.float32), fmt, group)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    return x, {name: jnp.asarray(part) for name, part in leaf.items()}, leaf


def _oracle(x, leaf):
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    w64 = quant.dequantize(leaf, np.float64)
    return x64 @ w64.T, np.abs(x64) @ np.abs(w64).T


def _kernel_bound(x, leaf):
    """What the native kernel may differ from the oracle by: float32 rounding, plus x's rounding
    to 16 bits per run of 32 inputs (max|x over the run| / 65024 per input)."""
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    _, magnitude = _oracle(x, leaf)
    run_peak = np.repeat(np.abs(x64).reshape(x64.shape[0], -1, 32).max(axis=-1), 32, axis=-1)
    x16 = (run_peak / 65024) @ np.abs(quant.dequantize(leaf, np.float64)).T
    return 4 * x64.shape[1] * np.finfo(np.float32).eps * magnitude + x16 + 1e-30


def _assert_kernel_within_bound(x, leaf):
    w = {name: jnp.asarray(part) for name, part in leaf.items()}
    got = np.asarray(jax.jit(native.quantized_matmul_native)(x, w))
    want, _ = _oracle(x, leaf)
    bound = _kernel_bound(x, leaf)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


@needs_native
@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("rows,n", [(1, 80), (2, 80), (4, 80), (7, 40), (9, 24), (16, 8), (70, 88)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_kernel_matches_float64_oracle(fmt, group, rows, n, dtype):
    """Few rows stream the codes; more go through the panel GEMMs (float32 with AVX2, integer with
    AVX512-VNNI; 16 outputs a work item: whole, part-filled and under one panel; rows in whole
    passes and a remainder) or the tiles elsewhere."""
    x, w, leaf = _case(fmt, group, rows, dtype, n=n)
    got = np.asarray(jax.jit(native.quantized_matmul_native)(x, w))
    want, _ = _oracle(x, leaf)
    assert got.dtype == np.float32 and got.shape == want.shape
    bound = _kernel_bound(x, leaf)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


@needs_native
@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("n", [44, 88])
@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("scales", [np.float32, np.float16])
def test_one_row_equals_its_row_in_a_batch(fmt, group, n, int8_activations, scales):
    """A decode's product does not depend on what else is in the batch: one row alone (on AVX2,
    eight outputs summed together, then the last few alone) gives the same floats as that row
    among two or three, where each output is summed alone."""
    x, _, leaf = _case(fmt, group, 3, jnp.float32, k=576, n=n, seed=11)
    w = {name: jnp.asarray(part if name == "packed" else part.astype(scales)) for name, part in leaf.items()}
    product = jax.jit(functools.partial(native.quantized_matmul_native, int8_activations=int8_activations))
    alone = np.asarray(product(x[:1], w))
    for rows in (2, 3):
        np.testing.assert_array_equal(alone, np.asarray(product(x[:rows], w))[:1])


@needs_native
@pytest.mark.parametrize("fmt,group", [("int8", 32), ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize("scales", [np.float32, np.float16])
def test_rows_on_the_int8_grid_multiply_as_any_other(fmt, group, scales):
    """x already on an int8 grid per run ("w4a8" rounds it so) lets VNNI multiply only the high
    int8 plane of its 16-bit rounding: a row on the grid alone gives the same floats as beside a
    row off the grid, where both planes are multiplied."""
    x, _, leaf = _case(fmt, group, 2, jnp.float32, k=576, n=80, seed=12)
    w = {name: jnp.asarray(part if name == "packed" else part.astype(scales)) for name, part in leaf.items()}
    on_grid = quant.round_activations_int8(x[:1])
    assert not np.array_equal(np.asarray(quant.round_activations_int8(x[1:])), np.asarray(x[1:]))
    product = jax.jit(native.quantized_matmul_native)
    alone = np.asarray(product(on_grid, w))
    np.testing.assert_array_equal(alone, np.asarray(product(jnp.concatenate([on_grid, x[1:]]), w))[:1])
    want, bound = _rounded_oracle_bound(on_grid, leaf)
    assert np.all(np.abs(alone - want) <= bound)


@needs_native
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("k,group", [(32, 32), (544, 32), (576, 64)])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("scales", [np.float32, np.float16])
def test_native_kernel_takes_any_number_of_runs(fmt, k, group, rows, scales):
    """One run of 32 inputs, an odd number of runs (17: the integer dot products read runs in
    pairs, sixteen or eight at a time, and the last output's scales end the buffer), and groups
    of two runs: each matches the oracle."""
    x, _, leaf = _case(fmt, group, rows, jnp.float32, k=k, n=40, seed=2)
    leaf = {name: part if name == "packed" else part.astype(scales) for name, part in leaf.items()}
    _assert_kernel_within_bound(x, leaf)


@needs_native
@pytest.mark.parametrize("rows", [1, 3])
def test_int8_codes_at_the_ends_of_their_range(rows):
    """Codes of -128 and 127 against inputs that are each their run's peak, of either sign: the
    integer dot products' int16 pair sums are at their largest (2 * 128 * 127) and stay exact."""
    x, _, leaf = _case("int8", 32, rows, jnp.float32, k=256, n=24, seed=3)
    rng = np.random.default_rng(4)
    leaf = {**leaf, "packed": rng.choice(np.array([-128, 127, -127, 0], np.int8), size=leaf["packed"].shape)}
    x = jnp.asarray(3.0 * rng.choice(np.array([-1.0, 1.0], np.float32), size=x.shape))
    _assert_kernel_within_bound(x, leaf)


@needs_native
@pytest.mark.parametrize("fmt,n", [("int8", 8200), ("int4", 16400)])  # over 4 MiB packed: XLA's threads join
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_native_kernel_takes_float16_scales_and_big_products(fmt, n, rows):
    """A GGUF's leaves keep float16 scales and offsets, and a tied LM head is big enough that the
    kernel splits it over threads: both match the oracle like the small float32 cases."""
    x, _, leaf = _case(fmt, 32, rows, jnp.float32, k=512, n=n)
    leaf = {name: part if name == "packed" else part.astype(np.float16) for name, part in leaf.items()}
    w = {name: jnp.asarray(part) for name, part in leaf.items()}
    assert native.quantized_matmul_supported(x, w)
    got = np.asarray(jax.jit(native.quantized_matmul_native)(x, w))
    want, _ = _oracle(x, leaf)
    bound = _kernel_bound(x, leaf)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))
    unpacked = np.asarray(jax.jit(native.dequantize_native)(w))
    np.testing.assert_array_equal(unpacked, np.asarray(quant.dequantize(leaf, np.float32)))


@needs_native
@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("rows", [1, 3])
def test_few_row_kernel_error_follows_each_runs_peak(fmt, group, rows):
    """x with a spike of 1000 in some runs of 32 and values near 0.01 elsewhere: where the
    integer dot products take it, the runs with a spike lose their small inputs' low bits (within
    the stated bound) and the other runs keep theirs; everything stays within the bound."""
    x, w, leaf = _case(fmt, group, rows, jnp.float32)
    spiky = np.asarray(x) * 0.01
    spiky[:, ::64] = 1000.0  # the first input of every other run
    x = jnp.asarray(spiky)
    got = np.asarray(jax.jit(native.quantized_matmul_native)(x, w))
    want, _ = _oracle(x, leaf)
    bound = _kernel_bound(x, leaf)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))
    quiet = np.asarray(x).copy()
    quiet[:, ::64] = 0.0  # the same inputs without the spikes: every run at full precision
    got_quiet = np.asarray(jax.jit(native.quantized_matmul_native)(jnp.asarray(quiet), w))
    want_quiet, magnitude = _oracle(jnp.asarray(quiet), leaf)
    assert np.max(np.abs(got_quiet - want_quiet) / (magnitude + 1e-30)) < 1e-4


@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("where", ["here", "xla"])
def test_xla_path_matches_float64_oracle(fmt, group, dtype, where):
    """More rows than the kernel takes: XLA's dot, its weight unpacked by the native kernel (float32
    rows where the native matmuls are chosen, as on this host) or by XLA."""
    matmuls = kernels.capabilities().matmuls if where == "here" else kernels.XLA_MATMULS
    x, w, leaf = _case(fmt, group, linear.NATIVE_QUANT_ROWS + 3, dtype, seed=1)  # more rows than the kernel takes
    got = np.asarray(jax.jit(functools.partial(linear.weight_only_matmul, matmuls=matmuls))(x, w))
    want, magnitude = _oracle(x, leaf)
    weight_rounding = 0.0 if dtype == jnp.float32 else 2.0 ** -8
    bound = (4 * x.shape[1] * np.finfo(np.float32).eps + weight_rounding) * magnitude + 1e-30
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


def _native_calls(fn, *args) -> int:
    return jax.jit(fn).lower(*args).as_text().count(native.QUANT_MATMUL_TARGET_NAME)


@needs_native
def test_few_rows_go_to_the_kernel_and_more_to_xla():
    here = kernels.capabilities().matmuls  # one CPU device in this process: the native kernel
    assert here.weight_only == "native"
    # the native routes without the panel GEMMs, and without oneDNN's for bf16 rows (AMX, Zen 4)
    few = dataclasses.replace(here, weight_only_gemm=False, onednn_weight_only=())
    linear_f32 = functools.partial(linear.linear_f32, matmuls=few)
    x, w, _ = _case("int4", 32, 4, jnp.float32)
    assert _native_calls(linear_f32, x[:1], w) == 1
    assert _native_calls(linear_f32, x, w) == 1
    assert _native_calls(linear_f32, jnp.concatenate([x] * 4), w) == 1
    assert _native_calls(linear_f32, jnp.concatenate([x] * 5), w) == 0
    int8 = functools.partial(linear.linear_f32, matmuls=dataclasses.replace(few, weight_only_activations="int8"))
    assert _native_calls(int8, jnp.concatenate([x] * 4), w) == 1  # w4a8: the same routes
    assert _native_calls(int8, jnp.concatenate([x] * 5), w) == 0
    x8, w8, _ = _case("int8", 32, 4, jnp.float32)
    chunk = jnp.concatenate([x] * 128)  # a full prefill chunk
    for activations in ("float", "int8"):  # with them: every row count, every format and dtype...
        gemm = functools.partial(linear.linear_f32, matmuls=dataclasses.replace(
            few, weight_only_gemm=True, dequantize_min_rows=512, weight_only_activations=activations))
        for rows in (jnp.concatenate([x] * 40), jnp.concatenate([x] * 40).astype(jnp.bfloat16), chunk.astype(jnp.bfloat16)):
            assert _native_calls(gemm, rows, w) == 1
        assert _native_calls(gemm, jnp.concatenate([x8] * 5), w8) == 1
        # ...but XLA's dot on the unpacked weight for float32 chunks, unless x is rounded to int8
        unpacked = jax.jit(gemm).lower(chunk, w).as_text().count(native.DEQUANTIZE_TARGET_NAME)
        assert (unpacked, _native_calls(gemm, chunk, w)) == ((0, 1) if activations == "int8" else (1, 0))
        assert _native_calls(gemm, chunk[:-4], w) == 1
        every = dataclasses.replace(few, weight_only_gemm=True, dequantize_min_rows=0,
                                    weight_only_activations=activations)
        assert _native_calls(functools.partial(linear.linear_f32, matmuls=every), chunk, w) == 1  # no limit
    xla = kernels.choose_matmuls("xla")[0]
    assert xla.weight_only_gemm is False and xla.weight_only_panels == ()  # the plain baseline keeps XLA's dot
    more = jnp.concatenate([x] * 5)  # float32: the kernel unpacks the weight, XLA multiplies
    assert jax.jit(linear_f32).lower(more, w).as_text().count(native.DEQUANTIZE_TARGET_NAME) == 1
    assert jax.jit(linear_f32).lower(more.astype(jnp.bfloat16), w).as_text().count("custom_call") == 0  # oneDNN's: elsewhere
    assert _native_calls(linear_f32, x[:1, :96], {**w, "packed": w["packed"][:, :48],
                                                  "scales": w["scales"][:, :3], "offsets": w["offsets"][:, :3]}) == 1
    several = kernels.capabilities("cpu", device_count=2).matmuls  # sharded or replicated: XLA only
    assert jax.jit(functools.partial(linear.linear_f32, matmuls=several)).lower(x, w).as_text().count("custom_call") == 0


@needs_native
@pytest.mark.parametrize("fmt,group", FORMATS)
def test_native_dequantize_equals_the_numpy_one(fmt, group):
    _, w, leaf = _case(fmt, group, 1, jnp.float32)
    got = np.asarray(jax.jit(native.dequantize_native)(w))
    np.testing.assert_allclose(got, quant.dequantize(leaf, np.float32), rtol=1e-6, atol=1e-6)


def test_kernel_refuses_what_it_cannot_take():
    x, w, _ = _case("int4", 32, 1, jnp.float32)
    assert not native.quantized_matmul_supported(x[:, :100], w)
    assert not native.quantized_matmul_supported(jnp.zeros((0, 192)), w)
    assert not native.quantized_matmul_supported(x, {**w, "scales": w["scales"][:, :5]})  # groups of 38.4
    with pytest.raises(ValueError, match="native quantized matmul takes x"):
        native.quantized_matmul_native(jnp.zeros((2, 100)), w)


def test_cpu_features_are_detected_not_assumed():
    features = native.cpu_features()
    assert isinstance(features, list) and all(isinstance(f, str) for f in features)
    if native.available():  # the library says whether it built the panel GEMMs: AVX2, or AVX512-VNNI
        avx2 = "avx2" in features and "avx512f" not in features
        assert native.panel_gemm() == (avx2 or "avx512_vnni" in features)
        matmuls = kernels.capabilities().matmuls
        assert matmuls.weight_only_gemm == native.panel_gemm()
        rows = (512 if cpu_isa.splits_256bit_vectors() else 32) if avx2 else 0
        assert matmuls.dequantize_min_rows == (rows if matmuls.weight_only_gemm else 0)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("fmt,group,activations", [("int8", 32, "float"), ("int4", 32, "float"), ("int4", 32, "int8")])
def test_xla_path_lowers_for_gpu_and_tpu(platform, fmt, group, activations):
    """Accelerators take the XLA path: dequantize (int ops and a multiply-add) then one dot with
    float32 accumulation, after rounding x to int8 per run for "w4a8"; no host kernel in the program."""
    x, w, _ = _case(fmt, group, 32, jnp.bfloat16)  # more rows than the CPU kernel takes on this host
    matmuls = kernels.capabilities(platform).matmuls
    assert matmuls == kernels.XLA_MATMULS
    matmuls = dataclasses.replace(matmuls, weight_only_activations=activations)
    with lowering_context(platform):
        text = jax.jit(functools.partial(linear.linear_f32, matmuls=matmuls)).trace(x, w).lower(
            lowering_platforms=(platform,)).as_text()
    assert "dot_general" in text and "custom_call" not in text
    assert ("ui8" if fmt == "int4" else "i8") in text
    assert ("round_nearest_even" in text) == (activations == "int8")


@needs_native
def test_concurrent_calls_share_the_helper_thread_safely():
    """Few-row products share their outputs with one helper thread; a call that finds it taken by
    another runs alone. Calls from several threads at once must each get their own exact result."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [_case("int4", 32, rows, jnp.float32, k=576, n=1536, seed=seed) for seed, rows in enumerate([1, 2, 4])]
    product = jax.jit(native.quantized_matmul_native)
    want = [np.asarray(product(x, w)) for x, w, _ in cases]

    def repeat(i):
        x, w, _ = cases[i % len(cases)]
        return all(np.array_equal(np.asarray(product(x, w)), want[i % len(cases)]) for _ in range(40))

    with ThreadPoolExecutor(6) as pool:
        assert all(pool.map(repeat, range(6)))


# ---- "w4a8": activations rounded to int8 per run of 32 inputs (models/quant.py)


def _q8_1(x) -> tuple[np.ndarray, np.ndarray]:
    """GGUF's Q8_1 rounding of x [rows, K] in numpy: (integers q [rows, K], dx [rows, K / 32])."""
    runs = np.asarray(x.astype(jnp.float32), np.float32).reshape(x.shape[0], -1, 32)
    peak = np.abs(runs).max(axis=-1, keepdims=True)
    inverse = np.where(peak > 0, np.float32(127) / np.where(peak > 0, peak, 1), 0).astype(np.float32)
    return np.rint(runs * inverse).reshape(x.shape), (peak * np.float32(1 / 127))[..., 0]


def test_int8_activations_are_q8_1_runs():
    """Integers of at most 127 per run of 32, the run's peak at +-127, each input within half a
    step; a run of zeros stays zeros; input already on the grid keeps its integers."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 128)).astype(np.float32) * np.repeat(rng.uniform(1e-3, 1e3, (3, 4)), 32, axis=1)
    x[1, 32:64] = 0.0
    x = jnp.asarray(x, jnp.float32)
    q, dx = _q8_1(x)
    rounded = np.asarray(quant.round_activations_int8(x))
    step = np.repeat(dx, 32, axis=1)
    np.testing.assert_array_equal(rounded, (q * step).astype(np.float32))
    assert np.abs(q).max() == 127 and np.all(np.abs(q).reshape(3, 4, 32).max(axis=-1)[dx > 0] == 127)
    assert np.all(np.abs(rounded - np.asarray(x)) <= 0.5 * step * (1 + 1e-6))
    assert np.all(rounded[1, 32:64] == 0.0)
    np.testing.assert_array_equal(_q8_1(jnp.asarray(rounded))[0], q)
    with pytest.raises(ValueError, match="w4a8.*whole runs of 32"):
        quant.round_activations_int8(jnp.zeros((1, 48)))


def _rounded_oracle_bound(x, leaf):
    """(float64 product of the Q8_1-rounded x with the weight, float32 rounding's bound on it): a
    single integer of x rounded otherwise than the oracle rounds it falls outside."""
    q, dx = _q8_1(x)
    x64 = q.astype(np.float64) * np.repeat(dx.astype(np.float64), 32, axis=1)
    w64 = quant.dequantize(leaf, np.float64)
    return x64 @ w64.T, 4 * x.shape[1] * np.finfo(np.float32).eps * (np.abs(x64) @ np.abs(w64).T) + 1e-30


@needs_native
@pytest.mark.parametrize("fmt,group,k", [("int8", 32, 192), ("int8", 32, 544), ("int4", 32, 192), ("int4", 32, 544),
                                         ("int4", 64, 576)])  # 544: an odd number of runs
@pytest.mark.parametrize("rows,n", [(1, 80), (2, 80), (3, 80), (4, 40), (7, 80), (16, 24), (17, 8), (70, 88)])
@pytest.mark.parametrize("scales", [np.float32, np.float16])
def test_native_kernel_with_int8_activations_matches_the_rounded_oracle(fmt, group, k, rows, n, scales):
    """With AVX2 alone, int4 codes from three rows through the panel GEMM (16 outputs a work item:
    whole, part-filled, and under one panel), fewer rows and int8 codes through the per-output int8
    dot products; elsewhere up to four rows through the 16-bit ones on x's int8 grid, more through
    the float form on that grid: each equals the oracle on Q8_1-rounded x."""
    x, _, leaf = _case(fmt, group, rows, jnp.float32, k=k, n=n, seed=6)
    x = x * jnp.asarray(np.repeat(np.random.default_rng(7).uniform(0.01, 100, (rows, k // 32)), 32, axis=1),
                        jnp.float32)
    leaf = {name: part if name == "packed" else part.astype(scales) for name, part in leaf.items()}
    w = {name: jnp.asarray(part) for name, part in leaf.items()}
    got = np.asarray(jax.jit(functools.partial(native.quantized_matmul_native, int8_activations=True))(x, w))
    want, bound = _rounded_oracle_bound(x, leaf)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


@needs_native
@pytest.mark.parametrize("rows", [1, 3])
def test_int8_activations_with_int8_codes_at_the_ends_of_their_range(rows):
    """Codes of -128 and 127 against inputs at their run's peak, either sign: |code| times x with
    the code's sign (vpmaddubsw) stays exact at 2 * 128 * 127."""
    x, _, leaf = _case("int8", 32, rows, jnp.float32, k=256, n=24, seed=3)
    rng = np.random.default_rng(4)
    leaf = {**leaf, "packed": rng.choice(np.array([-128, 127, -127, 0], np.int8), size=leaf["packed"].shape)}
    x = jnp.asarray(3.0 * rng.choice(np.array([-1.0, 1.0], np.float32), size=x.shape))
    w = {name: jnp.asarray(part) for name, part in leaf.items()}
    got = np.asarray(jax.jit(functools.partial(native.quantized_matmul_native, int8_activations=True))(x, w))
    want, bound = _rounded_oracle_bound(x, leaf)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))


@pytest.mark.parametrize("fmt,group", [("int8", 32), ("int4", 32)])
@pytest.mark.parametrize("rows", [1, 3, linear.NATIVE_QUANT_ROWS + 3, 70])
@pytest.mark.parametrize("where", ["here", "xla"])
def test_every_path_multiplies_the_same_int8_activations(fmt, group, rows, where):
    """``weight_only_activations="int8"``: the native kernel (few rows; every row count of int4
    codes where it has the GEMM), the weight it unpacks for XLA's dot (more float32 rows) and XLA
    alone all equal the oracle on Q8_1-rounded x."""
    base = kernels.capabilities().matmuls if where == "here" else kernels.XLA_MATMULS
    matmuls = dataclasses.replace(base, weight_only_activations="int8")
    x, w, leaf = _case(fmt, group, rows, jnp.float32, seed=8)
    got = np.asarray(jax.jit(functools.partial(linear.weight_only_matmul, matmuls=matmuls))(x, w))
    want, bound = _rounded_oracle_bound(x, leaf)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) / bound))
    plain = np.asarray(jax.jit(functools.partial(linear.weight_only_matmul, matmuls=base))(x, w))
    assert np.max(np.abs(plain - want)) > 10 * np.max(np.abs(got - want))  # the rounding did happen


def test_onednn_products_take_the_rounded_int8_activations():
    """Where oneDNN takes weight-only products (bf16 rows on AMX CPUs), x is rounded before it as
    on every other path: the program rounds, then calls oneDNN, and not the native kernel."""
    if kernels.onednn_unavailable() is not None:
        pytest.skip(f"oneDNN unavailable: {kernels.onednn_unavailable()}")
    matmuls = dataclasses.replace(kernels.capabilities().matmuls, onednn_weight_only=("bfloat16",),
                                  weight_only_activations="int8")
    x, w, _ = _case("int4", 32, linear.ONEDNN_QUANT_MIN_ROWS + 3, jnp.bfloat16)
    text = jax.jit(functools.partial(linear.weight_only_matmul, matmuls=matmuls)).lower(x, w).as_text()
    assert "round_nearest_even" in text and "custom_call" in text
    assert native.QUANT_MATMUL_TARGET_NAME not in text
