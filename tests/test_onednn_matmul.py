"""oneDNN's matmul on packed weights (``kernels/cpu/onednn_matmul.cc``) against a float64 oracle
(``matmul_oracle``), which weights the model packs and routes there, and how the engine option
``cpu_matmul`` chooses it."""
from __future__ import annotations

import dataclasses
import functools
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner import kernels
from jaxrunner.config import EngineConfig
from jaxrunner.kernels import native, onednn
from jaxrunner.models import linear, quant
from matmul_oracle import assert_matches_float64, assert_nan_weight_poisons_only_its_output, custom_calls, normal

X86_LINUX = platform.system() == "Linux" and platform.machine() == "x86_64"
needs_onednn = pytest.mark.skipif(onednn.unavailable_reason() is not None and not X86_LINUX,
                                  reason=f"oneDNN unavailable off x86-64 Linux: {onednn.unavailable_reason()}")
# oneDNN's bf16 matmul needs AVX-512 at least: on a CPU with AVX2 alone it has float32 only.
needs_onednn_bf16 = pytest.mark.skipif(onednn.unavailable_reason() is None and not onednn.has_matmul("bfloat16"),
                                       reason="oneDNN has no bf16 matmul on this CPU (AVX2 alone)")
BF16_AND_F32 = [pytest.param(jnp.bfloat16, marks=needs_onednn_bf16), jnp.float32]


def test_onednn_is_installed_and_builds_on_x86_64_linux():
    """A default dependency there: its absence is an installation bug, not a reason to skip."""
    if not X86_LINUX:
        pytest.skip("oneDNN is a default dependency on x86-64 Linux only")
    assert onednn.unavailable_reason() is None



def _packed_matmul(x, w, transposed=False):
    return jax.jit(onednn.onednn_matmul)(x, onednn.onednn_pack(w, transposed=transposed))


@needs_onednn
@pytest.mark.parametrize("dtype", BF16_AND_F32)
@pytest.mark.parametrize("rows", [1, 2, 17, 64])
@pytest.mark.parametrize("k, n, transposed", [(576, 960, False), (130, 80, False), (7, 48, False),
                                              (64, 1023, True), (576, 4096, True)])
def test_matches_a_float64_oracle(rows, k, n, transposed, dtype):
    """Every row count, odd shapes (one block of columns, a split into halves at a block boundary,
    K not a multiple of the VNNI pair) and both orientations of the weight."""
    rng = np.random.default_rng(rows * 1000 + k + n)
    w_shape = (n, k) if transposed else (k, n)
    x, w = normal(rng, (rows, k), dtype=dtype), normal(rng, w_shape, 0.05, dtype)
    assert_matches_float64(_packed_matmul(x, w, transposed), x, w, transposed)


@needs_onednn
@pytest.mark.parametrize("dtype", BF16_AND_F32)
def test_packing_keeps_every_bit_and_says_its_size(dtype):
    """Unpacking gives back the weight bit for bit (what ``LLM.params`` shows); the packed size is
    known before anything is traced, and covers at least the weight."""
    w = normal(np.random.default_rng(0), (130, 200), dtype=dtype)
    for weights, transposed in ((w, False), (w.T, True)):
        packed = onednn.onednn_pack(weights, transposed=transposed)
        assert (packed.k, packed.n, packed.plain_shape) == (130, 200, weights.shape)
        assert packed.data.shape == (onednn.packed_bytes(130, 200, dtype),) and packed.data.nbytes >= w.nbytes
        np.testing.assert_array_equal(np.asarray(onednn.onednn_unpack(packed)), np.asarray(weights))


@needs_onednn
@needs_onednn_bf16
def test_each_output_sees_only_its_own_weights():
    assert_nan_weight_poisons_only_its_output(_packed_matmul, rows=33)


@needs_onednn
@needs_onednn_bf16
def test_calls_from_two_threads_at_once_each_get_their_own_answer():
    """Primitives are shared and each thread brings its own scratchpad: products of two threads,
    interleaved, match the same products run alone."""
    import concurrent.futures

    rng = np.random.default_rng(2)
    w = onednn.onednn_pack(normal(rng, (256, 512), 0.05))
    xs = [normal(rng, (rows, 256)) for rows in (3, 40, 3, 40)]
    fn = jax.jit(onednn.onednn_matmul)
    alone = [np.asarray(fn(x, w)) for x in xs]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for _ in range(5):
            together = list(pool.map(lambda x: np.asarray(fn(x, w)), xs))
            for got, want in zip(together, alone):
                np.testing.assert_array_equal(got, want)


@needs_onednn
@needs_onednn_bf16
def test_unsupported_inputs_say_why():
    w = onednn.onednn_pack(jnp.zeros((64, 16), jnp.bfloat16))
    for x in (jnp.zeros((4, 32), jnp.bfloat16), jnp.zeros((4, 64), jnp.float32), jnp.zeros((2, 4, 64), jnp.bfloat16)):
        with pytest.raises(ValueError, match=r"the oneDNN matmul takes x \[M, 64\] bfloat16"):
            onednn.onednn_matmul(x, w)
    with pytest.raises(ValueError, match="oneDNN packs bf16 or float32 weights, not float16"):
        onednn.onednn_pack(jnp.zeros((64, 16), jnp.float16))
    with pytest.raises(ValueError, match="oneDNN packs 2-D weights"):
        onednn.onednn_pack(jnp.zeros((2, 64, 16), jnp.bfloat16))


def _onednn_calls(fn, *args) -> int:
    return custom_calls(onednn.TARGET_NAME, fn, *args)


@needs_onednn
@needs_onednn_bf16
def test_the_chosen_weights_are_packed_and_their_products_go_to_onednn():
    """``onednn_dtypes`` and ``onednn_min_weight_bytes`` decide which layer leaves and which head are
    packed (an untied head, never a tied embedding: the lookup reads it too); packed products go to
    oneDNN at every row count, the rest stays on XLA; unpacking gives the plain tree back."""
    from jaxrunner.models import packed_weights

    rng = np.random.default_rng(1)
    w, small, embed, head = normal(rng, (64, 96)), normal(rng, (64, 8)), normal(rng, (256, 64)), normal(rng, (64, 256))
    params = {"layers": [{"wqkv": w, "wo": small, "norm": normal(rng, (64,))}], "embed": embed}
    bf16 = kernels.MatmulKernels(onednn_dtypes=("bfloat16",), onednn_min_weight_bytes=small.nbytes + 1)
    packed = packed_weights.pack(params, ("wqkv", "wo"), bf16)
    layer = packed["layers"][0]
    assert packed_weights.is_packed(layer["wqkv"]) and not packed_weights.is_packed(layer["wo"])
    assert "lm_head" not in packed and packed["embed"] is embed and layer["norm"] is params["layers"][0]["norm"]
    assert packed_weights.is_packed(packed_weights.pack({**params, "lm_head": head}, (), bf16)["lm_head"])
    for rows in (1, 5, 64):
        x = normal(rng, (rows, 64))
        assert _onednn_calls(lambda x, p: linear.matmul_f32_acc(x, p["layers"][0]["wqkv"], bf16), x, packed) == 1
        assert _onednn_calls(lambda x, p: linear.matmul_f32_acc(x, p["layers"][0]["wo"], bf16), x, packed) == 0
        got = linear.matmul_f32_acc(x, layer["wqkv"], bf16)
        np.testing.assert_allclose(np.asarray(got), np.asarray(linear.matmul_f32_acc(x, w, kernels.XLA_MATMULS)),
                                   rtol=1e-5, atol=1e-5)
    assert packed_weights.pack(params, ("wqkv",), kernels.XLA_MATMULS) is params
    assert packed_weights.pack(params, ("wqkv",), kernels.MatmulKernels(onednn_dtypes=("float32",))) == params
    plain = packed_weights.unpack(packed)
    assert jax.tree.structure(plain) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, plain, params)
    like = packed_weights.plain_like(packed)
    assert like["layers"][0]["wqkv"].shape == w.shape and like["embed"] is embed


def test_weights_left_to_xla_can_be_held_transposed():
    """With ``xla_weights_nk``, the float layer weights and an untied head that oneDNN does not take
    are held [out, in]: their products equal the plain ones (one row through the native kernel,
    more through XLA's dot), quantized leaves and norms are left alone, and unpacking gives the
    plain tree back bit for bit."""
    from jaxrunner.models import packed_weights

    rng = np.random.default_rng(6)
    w, head, norm = normal(rng, (64, 96)), normal(rng, (64, 256)), normal(rng, (64,))
    leaf = _weight_only_leaf(rng, "int4", 96, 64, 32, jnp.float16)
    params = {"layers": [{"wqkv": w, "wo": leaf, "norm": norm}], "embed": normal(rng, (256, 64)), "lm_head": head}
    here = kernels.capabilities("cpu").matmuls
    nk = dataclasses.replace(here, onednn_dtypes=(), xla_weights_nk=("bfloat16",), xla_weights_nk_min_inputs=0)
    laid = packed_weights.pack(params, ("wqkv", "wo"), nk)
    layer = laid["layers"][0]
    assert isinstance(layer["wqkv"], packed_weights.TransposedWeight) and layer["wqkv"].data.shape == (96, 64)
    assert isinstance(laid["lm_head"], packed_weights.TransposedWeight)
    assert layer["wo"] is leaf and layer["norm"] is norm and laid["embed"] is params["embed"]
    for rows in (1, 5, 64):
        x = normal(rng, (rows, 64))
        for plain, held in ((w, layer["wqkv"]), (head, laid["lm_head"])):
            np.testing.assert_allclose(np.asarray(jax.jit(linear.matmul_f32_acc, static_argnums=2)(x, held, nk)),
                                       np.asarray(linear.matmul_f32_acc(x, plain, kernels.XLA_MATMULS)),
                                       rtol=1e-5, atol=1e-5)
    jax.tree.map(np.testing.assert_array_equal, packed_weights.unpack(laid), params)
    assert packed_weights.plain_like(laid)["layers"][0]["wqkv"].shape == w.shape
    assert packed_weights.pack(params, ("wqkv",), dataclasses.replace(nk, xla_weights_nk=())) is params
    # only the dtypes and input counts the CPU kind's row names: the rest stay as the model holds them
    for other in (dataclasses.replace(nk, xla_weights_nk=("float32",)),
                  dataclasses.replace(nk, xla_weights_nk_min_inputs=65)):
        kept = packed_weights.pack(params, ("wqkv",), other)
        assert kept["layers"][0]["wqkv"] is w and kept["lm_head"] is head
    wide = packed_weights.pack(params, ("wqkv",), dataclasses.replace(nk, xla_weights_nk_min_inputs=64))
    assert isinstance(wide["layers"][0]["wqkv"], packed_weights.TransposedWeight)


def test_an_engine_on_weights_held_transposed_generates_what_it_does_on_plain_ones(tiny_checkpoints, monkeypatch):
    """Where the CPU kind's ``XLA_WEIGHTS_NK`` row names float32 (here for every width, as if this
    CPU were such a kind), ``auto`` serves the layer weights [N, K] and shows the plain ones: the
    tokens are those of ``cpu_matmul="xla"`` on the weights as given."""
    from engine_helpers import make_llm, random_prompts, token_ids
    from jaxrunner import SamplingParams
    from jaxrunner.kernels import platform_support
    from jaxrunner.models import packed_weights

    path = tiny_checkpoints["llama"]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = random_prompts(3, 512, 10, 30, seed=7)
    plain = make_llm(path, cpu_matmul="xla")
    want = token_ids(plain.generate(prompts, greedy, use_tqdm=False))
    monkeypatch.setattr(platform_support, "_xla_weights_nk", lambda: (("float32",), 0))
    llm = make_llm(path, cpu_matmul="auto")
    assert isinstance(llm.engine.executor.runner.params["layers"][0]["wqkv"], packed_weights.TransposedWeight)
    assert "float32 weights transposed" in llm.startup_report["cpu_matmul"]
    jax.tree.map(np.testing.assert_array_equal, llm.params, plain.params)
    assert token_ids(llm.generate(prompts, greedy, use_tqdm=False)) == want


# ----------------------------------------------------------------------------- weight-only int4/int8
needs_avx512_bf16 = pytest.mark.skipif(
    onednn.unavailable_reason() is not None or "avx512_bf16" not in native.cpu_features(),
    reason="oneDNN's weight-only products unpack to bf16 with AVX512-BF16, which this CPU lacks")


def _weight_only_leaf(rng, fmt: str, n: int, k: int, group: int, scale_dtype) -> dict:
    """A random weight-only leaf ([N, K] orientation, models/quant.py): every code, scales and
    offsets of both signs where the format has them."""
    groups = k // (group or k)  # group 0: one scale per output
    scales = jnp.asarray(rng.uniform(0.005, 0.05, (n, groups)) * rng.choice([-1, 1], (n, groups)), scale_dtype)
    if fmt == "int8":
        return {"packed": jnp.asarray(rng.integers(-128, 128, (n, k)), jnp.int8), "scales": scales}
    return {"packed": jnp.asarray(rng.integers(0, 256, (n, k // 2)), jnp.uint8), "scales": scales,
            "offsets": jnp.asarray(rng.uniform(-0.2, 0.2, (n, groups)), scale_dtype)}


def _dequantized_bf16(leaf):
    """The bf16 weight [N, K] the kernel multiplies: quant.dequantize in float32, rounded once."""
    return quant.dequantize(leaf, jnp.float32).astype(jnp.bfloat16)


@needs_avx512_bf16
@pytest.mark.parametrize("fmt, group, scale_dtype", [("int4", 32, jnp.float16), ("int4", 64, jnp.float32),
                                                     ("int8", 32, jnp.float16), ("int8", 0, jnp.float32)])
@pytest.mark.parametrize("rows", [1, 17, 130])
@pytest.mark.parametrize("k, n", [(576, 960), (64, 100), (2048, 300)])
def test_weight_only_products_match_their_bf16_weights(fmt, group, scale_dtype, rows, k, n):
    """Unpacked a tile at a time into oneDNN's layout, each weight rounds to bf16 as
    ``quant.dequantize`` then a cast rounds it, so the product is that bf16 weight's within float32
    summation error: GGUF-style float16 scales and float32 ones, int4 groups of 32 and 64, int8 per
    group and per channel; one tile or several, one half or two, a part-filled last block."""
    rng = np.random.default_rng(rows * 7 + k + n + group)
    leaf = _weight_only_leaf(rng, fmt, n, k, group, scale_dtype)
    x = normal(rng, (rows, k))
    got = jax.jit(onednn.onednn_quant_matmul)(x, leaf)
    assert_matches_float64(got, x, _dequantized_bf16(leaf), transposed=True)


@needs_avx512_bf16
def test_a_weight_only_output_sees_only_its_own_weights():
    """A NaN scale poisons its output alone, in every tile and at the halves' seam (no stray reads of
    the neighbouring outputs or of the padding)."""
    rng = np.random.default_rng(3)
    leaf = _weight_only_leaf(rng, "int4", 300, 2048, 32, jnp.float32)
    poisoned = (5, 191, 192, 299)
    leaf["scales"] = leaf["scales"].at[poisoned, 7].set(jnp.nan)
    got = np.asarray(jax.jit(onednn.onednn_quant_matmul)(normal(rng, (40, 2048)), leaf))
    assert np.isnan(got[:, poisoned]).all() and np.isfinite(np.delete(got, poisoned, axis=1)).all()


@needs_avx512_bf16
@pytest.mark.parametrize("fmt, group, scale_dtype", [("int4", 32, jnp.float16), ("int4", 64, jnp.float32),
                                                     ("int8", 32, jnp.float16), ("int8", 0, jnp.float32)])
@pytest.mark.parametrize("rows", [5, 130])
@pytest.mark.parametrize("k, n", [(576, 960), (64, 112), (2048, 304)])
def test_weight_only_products_read_panels_bit_for_bit(fmt, group, scale_dtype, rows, k, n):
    """Laid out as panels (``kernels.to_panels``), a weight unpacks into the same bf16 tiles, so
    oneDNN's product equals the one on the plain leaf bit for bit, and so the bf16 weight's: one
    tile or several, one half or two, a last block of 64 columns part-filled by whole panels."""
    rng = np.random.default_rng(rows * 5 + k + n + group)
    leaf = _weight_only_leaf(rng, fmt, n, k, group, scale_dtype)
    x = normal(rng, (rows, k))
    got = np.asarray(jax.jit(onednn.onednn_panel_matmul)(x, kernels.to_panels(leaf)))
    np.testing.assert_array_equal(got, np.asarray(jax.jit(onednn.onednn_quant_matmul)(x, leaf)))
    assert_matches_float64(got, x, _dequantized_bf16(leaf), transposed=True)


@needs_avx512_bf16
def test_a_panel_output_sees_only_its_own_weights():
    """A NaN scale (int4) or offset poisons its output alone, read out of panels: at the edges of a
    panel, of a block of 64 columns, at the halves' seam and in the part-filled last block."""
    rng = np.random.default_rng(6)
    leaf = _weight_only_leaf(rng, "int4", 304, 2048, 32, jnp.float32)
    poisoned = (0, 15, 16, 63, 191, 192, 303)
    leaf["scales"] = leaf["scales"].at[poisoned[:4], 7].set(jnp.nan)
    leaf["offsets"] = leaf["offsets"].at[poisoned[4:], 63].set(jnp.nan)
    got = np.asarray(jax.jit(onednn.onednn_panel_matmul)(normal(rng, (40, 2048)), kernels.to_panels(leaf)))
    assert np.isnan(got[:, poisoned]).all() and np.isfinite(np.delete(got, poisoned, axis=1)).all()


@needs_onednn
@pytest.mark.parametrize("layout", ["plain", "panels"])
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_many_bf16_rows_of_weight_only_products_go_to_onednn(layout, activations):
    """With ``onednn_weight_only``, bf16 products of ``ONEDNN_QUANT_MIN_ROWS`` rows or more go to
    oneDNN; fewer stay on the native kernel, and float32 rows never go. A weight laid out as panels
    takes the same routes, reading the panels on both, with the plain leaf's results (``"w4a8"``
    rounds x to int8 before oneDNN's product of either)."""
    matmuls = kernels.MatmulKernels(weight_only="native", onednn_weight_only=("bfloat16",),
                                    weight_only_activations=activations)
    rng = np.random.default_rng(4)
    leaf = _weight_only_leaf(rng, "int4", 96, 64, 32, jnp.float16)
    w, onednn_target, native_target = ((leaf, onednn.QUANT_TARGET, native.QUANT_MATMUL_TARGET_NAME) if layout == "plain"
                                       else (kernels.to_panels(leaf), onednn.PANEL_TARGET, native.PANEL_MATMUL_TARGET_NAME))
    product = functools.partial(linear.linear_f32, matmuls=matmuls)
    fewest = linear.ONEDNN_QUANT_MIN_ROWS
    for rows, dtype, want in ((fewest - 1, jnp.bfloat16, 0), (fewest, jnp.bfloat16, 1), (64, jnp.bfloat16, 1),
                              (64, jnp.float32, 0)):
        x = jnp.zeros((rows, 64), dtype)
        assert custom_calls(onednn_target, product, x, w) == want, (rows, dtype)
        on_native = rows < fewest if layout == "plain" else not want  # plain 64 float32 rows: dequantized for XLA
        assert custom_calls(native_target, product, x, w) == on_native, (rows, dtype)
    without = functools.partial(linear.linear_f32, matmuls=kernels.MatmulKernels(weight_only="native"))
    assert custom_calls(onednn_target, without, jnp.zeros((64, 64), jnp.bfloat16), w) == 0
    if layout == "panels" and onednn.unavailable_reason() is None and "avx512_bf16" in native.cpu_features():
        x = normal(rng, (fewest + 3, 64))
        np.testing.assert_array_equal(np.asarray(jax.jit(product)(x, w)), np.asarray(jax.jit(product)(x, leaf)))


@needs_onednn
def test_weight_only_inputs_it_cannot_take_say_why():
    leaf = _weight_only_leaf(np.random.default_rng(5), "int4", 64, 64, 32, jnp.float16)
    with pytest.raises(ValueError, match="the oneDNN quantized matmul takes x \\[rows, K\\] bf16"):
        onednn.onednn_quant_matmul(jnp.zeros((20, 64), jnp.float32), leaf)
    with pytest.raises(ValueError, match="groups of whole runs of 32"):
        onednn.onednn_quant_matmul(jnp.zeros((20, 96), jnp.bfloat16), leaf)
    with pytest.raises(ValueError, match=r"the oneDNN panel matmul takes x \[rows, 64\] bf16"):
        onednn.onednn_panel_matmul(jnp.zeros((20, 64), jnp.float32), kernels.to_panels(leaf))


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
    assert xla.onednn_dtypes == () == xla.onednn_weight_only and xla.one_row == auto.one_row  # the one-row kernel is not this choice
    gpu, why = kernels.choose_matmuls("onednn", "gpu")
    assert gpu == kernels.XLA_MATMULS and "gpu" in why  # a CPU option: elsewhere it changes nothing
    if onednn.unavailable_reason() is None:
        chosen, why = kernels.choose_matmuls("onednn", "cpu")
        want = ("float32", "bfloat16") if onednn.has_matmul("bfloat16") else ("float32",)  # bf16: AVX-512
        assert chosen.onednn_dtypes == want and why == "asked for"
        assert chosen.onednn_min_weight_bytes == 0
    else:
        with pytest.raises(ValueError, match="cpu_matmul='onednn': oneDNN's matmul is unavailable here"):
            kernels.choose_matmuls("onednn", "cpu")


def test_the_table_applies_to_the_cpu_it_names(monkeypatch):
    """``ONEDNN_FASTER``'s first row whose flag the CPU has decides ``auto``; a CPU kind not in the
    table keeps XLA's dot."""
    from jaxrunner.kernels import native, platform_support

    for flags, want in ((["amx_bf16", "avx512_bf16", "avx512f"], platform_support.ONEDNN_FASTER[0][1:]),
                        (["avx512_bf16", "avx512f"], ((), 0, ("bfloat16",))),
                        (["avx2", "fma"], platform_support.NOT_FASTER)):
        monkeypatch.setattr(native, "cpu_features", lambda flags=flags: flags)
        assert platform_support._onednn_faster() == want


@needs_onednn
def test_an_engine_on_packed_weights_shows_and_swaps_plain_ones(tiny_checkpoints):
    """The runner steps on packed weights; ``LLM.params`` gives the plain ones back bit for bit
    (as the checkpoint holds them), and a swap is packed in place: no compile, and the
    tokens of a fresh engine on the new weights."""
    from engine_helpers import TINY_ENGINE, count_compilations, make_llm, random_prompts, token_ids
    from jaxrunner import LLM, SamplingParams
    from jaxrunner.models import packed_weights
    from jaxrunner.models.loading import load_model
    from jaxrunner.models.loading.hf import read_hf_config

    path = tiny_checkpoints["llama"]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = make_llm(path, cpu_matmul="onednn")
    runner = llm.engine.executor.runner
    assert packed_weights.is_packed(runner.params["layers"][0]["wqkv"])
    jax.tree.map(np.testing.assert_array_equal, llm.params, load_model(path, "float32", progress=False).params)
    prompts = random_prompts(3, 512, 10, 30, seed=5)
    new = jax.tree.map(lambda x: x * 1.5 if x.ndim == 2 else x, llm.params)
    with count_compilations() as compiles:
        llm.update_weights(new)
        swapped = token_ids(llm.generate(prompts, greedy, use_tqdm=False))
    assert compiles == []
    assert packed_weights.is_packed(runner.params["layers"][0]["wqkv"])
    jax.tree.map(np.testing.assert_array_equal, llm.params, new)
    fresh = LLM.from_params(new, read_hf_config(path), **dict(TINY_ENGINE, cpu_matmul="onednn"))
    assert swapped == token_ids(fresh.generate(prompts, greedy, use_tqdm=False))


@needs_avx512_bf16
def test_an_int4_engine_on_onednn_generates_what_it_does_on_xla(tiny_checkpoints):
    """bf16 activations, int4 weights: prefill chunks of more rows than the native kernel takes run
    on oneDNN (the same bf16 weights, summed in another order), and the greedy tokens are those
    of the engine on XLA's dot."""
    from engine_helpers import make_llm, random_prompts, token_ids
    from jaxrunner import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts(4, 512, 20, 60, seed=7)
    tokens = {}
    for choice in ("onednn", "xla"):
        llm = make_llm(tiny_checkpoints["llama"], dtype="bfloat16", quantization="int4", cpu_matmul=choice)
        assert llm.engine.executor.runner.matmuls.onednn_weight_only == (("bfloat16",) if choice == "onednn" else ())
        tokens[choice] = token_ids(llm.generate(prompts, greedy, use_tqdm=False))
    assert tokens["onednn"] == tokens["xla"]
