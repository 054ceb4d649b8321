"""Quantized linear layers: the formats (``models/quant.py``), their refusals, ``"w8a8"``'s
zero-input guard, and engines serving quantized weights (greedy agreement, no compiles)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import count_compilations, make_llm, random_prompts, token_ids
from jaxrunner import SamplingParams, kernels
from jaxrunner.config import EngineConfig
from jaxrunner.models import quant
from jaxrunner.models.linear import w8a8_matmul
from jaxrunner.models.quant import quantize_activations, quantize_w8a8_weight


# ----------------------------------------------------------------------------- formats


def test_nibbles_round_trip_in_the_q4_0_layout():
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (3, 64)).astype(np.uint8)
    packed = quant.pack_nibbles(q)
    assert packed.shape == (3, 32) and packed.dtype == np.uint8
    # byte i of each 32-input run: input i low, input i + 16 high (GGUF Q4_0)
    assert packed[1, 5] == q[1, 5] | (q[1, 21] << 4) and packed[2, 16 + 3] == q[2, 32 + 3] | (q[2, 48 + 3] << 4)
    np.testing.assert_array_equal(quant.unpack_nibbles(packed), q)
    np.testing.assert_array_equal(np.asarray(quant.unpack_nibbles(jnp.asarray(packed))), q)


@pytest.mark.parametrize("fmt,group,bound", [("int8", 32, 0.5 / 127), ("int4", 32, 0.5 / 15), ("int4", 64, 0.5 / 15)])
def test_quantized_weights_are_within_half_a_step(fmt, group, bound):
    """Every weight dequantizes to within half a quantization step of its group (or channel)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((128, 48)).astype(np.float32)  # [K, N] as in the params tree
    leaf = quant.quantize_weight_only(w, fmt, group)
    back = quant.dequantize(leaf, np.float64)
    assert back.shape == (48, 128)
    span = np.abs(w.T).max(axis=1, keepdims=True) if fmt == "int8" else np.repeat(
        np.ptp(w.T.reshape(48, -1, group), axis=-1), group, axis=1)
    assert np.all(np.abs(back - w.T) <= bound * span * (2 if fmt == "int8" else 1) + 1e-6)
    if fmt == "int4":
        assert leaf["packed"].shape == (48, 64) and leaf["scales"].shape == (48, 128 // group)


def test_refusals_name_the_field_and_the_valid_values():
    with pytest.raises(ValueError, match=r"quantization: must be None or one of \('int8', 'int4', 'w4a8', 'w8a8'\)"):
        EngineConfig(model="x", quantization="int3")
    with pytest.raises(ValueError, match=r"quantization_group_size: must be one of \(32, 64\)"):
        EngineConfig(model="x", quantization="int4", quantization_group_size=48)
    params = {"layers": [{"wo": np.zeros((96, 64), np.float32), "attn_norm": np.ones(64, np.float32)}]}
    with pytest.raises(ValueError, match=r"quantization_group_size: int4 needs the input size of wo \(96\) "
                                         r"to be a multiple of the group size 64"):
        quant.quantize_params(params, "int4", 64)
    with pytest.raises(ValueError, match=r"quantization_group_size: int4 needs the input size of wo \(96\) "):
        quant.quantize_params(params, "w4a8", 64)  # int4's weights
    assert quant.is_weight_only(quant.quantize_params(params, "int4", 32)["layers"][0]["wo"])


# ----------------------------------------------------------------------------- w8a8


def test_zero_activations_unguarded_give_nan_guarded_give_zeros():
    x = jnp.zeros((4, 32), jnp.float32)
    w = quantize_w8a8_weight(jax.random.normal(jax.random.key(0), (32, 16)))
    _, scale_raw = quantize_activations(x, guard=False)
    assert float(scale_raw.max()) == 0.0  # what a zero dummy batch produces
    # Unguarded, the quantizer computes 0/0 = NaN and casts it to int8: undefined behaviour that
    # a zero-filled warm-up would "pass" while exercising nothing real.
    assert np.isnan(np.asarray(x / scale_raw)).all()
    _, scale = quantize_activations(x)
    assert float(scale.min()) > 0.0
    assert np.all(np.asarray(w8a8_matmul(x, w)) == 0.0)


def test_w8a8_matmul_close_to_float():
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (8, 256))
    w = jax.random.normal(kw, (256, 64)) * 0.05
    exact = np.asarray(x @ w)
    approx = np.asarray(w8a8_matmul(x, quantize_w8a8_weight(w)))
    assert np.max(np.abs(approx - exact)) / np.max(np.abs(exact)) < 0.03


# ----------------------------------------------------------------------------- engines


def _greedy(llm, prompts, n=6):
    return token_ids(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False))


@pytest.fixture(scope="module")
def float_tokens(tiny_checkpoints):
    prompts = random_prompts(6, 512, 3, 30, seed=2)
    return prompts, _greedy(make_llm(tiny_checkpoints["llama"]), prompts)


@pytest.mark.parametrize("quantization,dtype,min_agreement", [
    ("int8", "auto", 0.9), ("int4", "auto", 0.5), ("w4a8", "auto", 0.5), ("w8a8", "auto", 0.5),
    ("int4", "bfloat16", 0.5),  # panels where oneDNN takes bf16 rows too: both read them
])
def test_quantized_engine_agrees_with_float_and_never_compiles_while_serving(
        tiny_checkpoints, float_tokens, quantization, dtype, min_agreement):
    prompts, exact = float_tokens
    llm = make_llm(tiny_checkpoints["llama"], quantization=quantization, dtype=dtype)
    runner = llm.engine.executor.runner
    layer = runner.plain_params()["layers"][0]
    assert quant.is_weight_only(layer["w_down"]) == (quantization != "w8a8")
    assert quant.is_int4(layer["w_down"]) == (quantization in ("int4", "w4a8"))
    matmuls = llm.engine.executor.runner.matmuls
    assert matmuls.weight_only_activations == ("int8" if quantization == "w4a8" else "float")
    assert ("native panel GEMMs" in llm.startup_report["cpu_matmul"]) == matmuls.weight_only_gemm
    # where the panel kernel takes the model's activations, the step reads its layer weights laid
    # out as panels, from which the plain ones come back
    panels = quantization != "w8a8" and runner.params["final_norm"].dtype.name in matmuls.weight_only_panels
    step_leaf = runner.params["layers"][0]["w_down"]
    assert isinstance(step_leaf, kernels.PanelWeight) == panels
    if panels:
        np.testing.assert_array_equal(kernels.to_panels(layer["w_down"]).codes, step_leaf.codes)
    # "w8a8" weights as AMX-INT8 tiles where the native build has them (a CPU with AMX)
    tiles = quantization == "w8a8" and matmuls.w8a8_tiles
    assert isinstance(step_leaf, kernels.W8a8TileWeight) == tiles
    if tiles:
        np.testing.assert_array_equal(kernels.from_w8a8_tiles(step_leaf)["q"], layer["w_down"]["q"])
    with count_compilations() as compiles:
        got = _greedy(llm, prompts)
        _greedy(llm, prompts[:1])  # a one-sequence decode: the native kernel's few-row path
    assert compiles == []
    first = np.mean([a[0] == b[0] for a, b in zip(got, exact)])
    every = np.mean([np.mean(np.asarray(a) == np.asarray(b)) for a, b in zip(got, exact)])
    assert first >= min_agreement, (first, every)


def test_zero_warmup_inputs_serve_finite_w8a8_outputs(tiny_checkpoints):
    llm = make_llm(tiny_checkpoints["llama"], quantization="w8a8", warmup_inputs="zeros")
    out = llm.generate(random_prompts(2, 512, 3, 10, seed=3), SamplingParams(temperature=0, max_tokens=4, logprobs=1),
                       use_tqdm=False)
    assert all(np.isfinite(o.outputs[0].cumulative_logprob) for o in out)


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_tied_embedding_is_quantized_and_serves(tmp_path, quantization):
    """A tied embedding (the LM head every token reads whole) becomes int8 per row, weight-only,
    under every format: lookups dequantize their rows, the logits come from the packed table."""
    from conftest import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "tied", "llama", tied=True)
    prompts = random_prompts(4, 512, 3, 20, seed=4)
    exact = _greedy(make_llm(path), prompts)
    llm = make_llm(path, quantization=quantization)
    runner = llm.engine.executor.runner
    assert quant.is_weight_only(runner.plain_params()["embed"])
    # laid out as panels where the layers are: the lookups then read their rows out of them
    panels = runner.params["final_norm"].dtype.name in runner.matmuls.weight_only_panels
    assert isinstance(runner.params["embed"], kernels.PanelWeight) == panels
    with count_compilations() as compiles:
        got = _greedy(llm, prompts)
    assert compiles == []
    assert np.mean([a[0] == b[0] for a, b in zip(got, exact)]) >= 0.75
