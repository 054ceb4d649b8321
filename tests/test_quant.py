"""int8 weights + per-token dynamic activation scales: the zero-input hazard and its guard, quality."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import make_llm, random_prompts, token_ids
from jaxrunner import SamplingParams
from jaxrunner.models.quant import int8_matmul, quantize_activations, quantize_weight


def test_zero_activations_unguarded_give_nan_guarded_give_zeros():
    x = jnp.zeros((4, 32), jnp.float32)
    w = quantize_weight(jax.random.normal(jax.random.key(0), (32, 16)))
    _, scale_raw = quantize_activations(x, guard=False)
    assert float(scale_raw.max()) == 0.0  # what a zero dummy batch produces
    # Unguarded, the quantizer computes 0/0 = NaN and casts it to int8: undefined behaviour that
    # a zero-filled warm-up would "pass" while exercising nothing real.
    assert np.isnan(np.asarray(x / scale_raw)).all()
    _, scale = quantize_activations(x)
    assert float(scale.min()) > 0.0
    assert np.all(np.asarray(int8_matmul(x, w)) == 0.0)


def test_int8_matmul_close_to_float():
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (8, 256))
    w = jax.random.normal(kw, (256, 64)) * 0.05
    exact = np.asarray(x @ w)
    approx = np.asarray(int8_matmul(x, quantize_weight(w)))
    assert np.max(np.abs(approx - exact)) / np.max(np.abs(exact)) < 0.03


@pytest.mark.parametrize("warmup_inputs", ["random", "zeros"])
def test_int8_engine_serves_finite_outputs(tiny_checkpoints, warmup_inputs):
    llm = make_llm(tiny_checkpoints["llama"], quantization="int8", warmup_inputs=warmup_inputs)
    prompts = random_prompts(6, 512, 3, 30, seed=2)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=1), use_tqdm=False)
    for out in outputs:
        assert len(out.outputs[0].token_ids) >= 1
        assert np.isfinite(out.outputs[0].cumulative_logprob)
    f32 = make_llm(tiny_checkpoints["llama"])
    agree = np.mean([a[0] == b[0] for a, b in zip(token_ids(outputs), token_ids(f32.generate(
        prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)))])
    assert agree >= 0.5  # first greedy token mostly survives int8 on a random model


def test_one_row_16bit_matmul_is_padded_and_exact():
    """A 1-row bf16 matmul (batch-1 decode) goes through the padded 4-row dot on CPU; the result
    has the caller's row count and equals the float32 product of the same bf16 values."""
    from jaxrunner.models.quant import matmul_f32_acc

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 64)), jnp.bfloat16)
    out = jax.jit(lambda x, w: matmul_f32_acc(x, w, contract=(-1, 1)))(x, w)
    assert out.shape == (1, 96) and out.dtype == jnp.float32
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
