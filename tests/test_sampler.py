"""The on-device sampler against numpy: filters, penalties, inverse-CDF draws, logprobs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.runner import sampler
from jaxrunner.runner.batch import empty_batch
from jaxrunner.runner.buckets import Bucket


def numpy_keep_mask(logits, top_k, top_p, min_p):
    """vLLM's semantics written plainly: top-k, then top-p renormalized over the top-k set, min-p."""
    keep = np.ones_like(logits, bool)
    for r, row in enumerate(logits.astype(np.float64)):
        order = np.argsort(-row, kind="stable")
        allowed = np.zeros(len(row), bool)
        k = top_k[r] if top_k[r] > 0 else len(row)
        allowed[order[:k]] = True
        probs = np.exp(row - row[order[0]]) * allowed
        probs /= probs.sum()
        sorted_probs = probs[order]
        before = np.cumsum(sorted_probs) - sorted_probs
        nucleus = np.zeros(len(row), bool)
        nucleus[order[(before < top_p[r]) & allowed[order]]] = True
        nucleus[order[0]] = True
        allowed &= nucleus
        if min_p[r] > 0:
            full = np.exp(row - row.max())
            allowed &= full >= min_p[r] * full.max()
        keep[r] = allowed
    return keep


@pytest.mark.parametrize("scale", [8.0, 0.3])  # peaked (candidates decide) and flat (full-sort fallback)
def test_filters_match_numpy(scale):
    rng = np.random.default_rng(0)
    rows, vocab = 12, 1000
    logits = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
    top_k = rng.choice([0, 1, 5, 40, 300], rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.5, 0.9, 0.99], rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.05, 0.3], rows).astype(np.float32)
    filtered = np.asarray(jax.jit(sampler._filter_top_k_top_p_min_p)(logits, top_k, top_p, min_p))
    ours = np.isfinite(filtered)
    expected = numpy_keep_mask(logits, top_k, top_p, min_p)
    # ties at a threshold may keep one more token; none in continuous random logits
    np.testing.assert_array_equal(ours, expected)


def test_inverse_cdf_draws_follow_the_distribution():
    probs = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0], np.float32)
    logits = np.log(np.maximum(probs, 1e-38)).astype(np.float32)
    logits[-1] = -np.inf
    draws = 20000
    uniforms = jax.random.uniform(jax.random.key(0), (draws,))
    tokens = np.asarray(jax.jit(sampler._inverse_cdf_sample)(jnp.tile(logits, (draws, 1)), uniforms))
    freq = np.bincount(tokens, minlength=len(probs)) / draws
    np.testing.assert_allclose(freq, probs, atol=0.015)
    assert freq[-1] == 0


def _sampling(rows: int, **fields):
    params = empty_batch(Bucket(rows, rows, 1), 16)["sampling"]
    for name, value in fields.items():
        params[name][:] = value
    return params


def test_greedy_logprobs_and_top_logprobs():
    logits = jax.random.normal(jax.random.key(1), (4, 300)) * 3
    out = jax.jit(sampler.sample)(logits, _sampling(4, num_logprobs=5))
    expected = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_array_equal(out["tokens"], np.argmax(logits, axis=-1))
    np.testing.assert_allclose(out["logprobs"], np.max(expected, axis=-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["top_logprobs"][:, :5], np.sort(expected, axis=-1)[:, ::-1][:, :5], atol=1e-5)


def test_penalties_match_vllm_semantics():
    logits = np.array([[2.0, -1.0, 0.5, 1.0]], np.float32)
    history = np.full((1, 16), -1, np.int32)
    history[0, :3] = [0, 1, 1]  # prompt token 0, then outputs 1, 1
    params = _sampling(1, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    params["history"] = history
    params["prompt_lens"][:] = 1
    out = sampler._apply_penalties(jnp.asarray(logits), history, params["prompt_lens"], params["repetition_penalty"],
                                   params["presence_penalty"], params["frequency_penalty"])
    expected = [2.0 / 2, -1.0 * 2 - 0.25 * 2 - 0.5, 0.5, 1.0]
    np.testing.assert_allclose(np.asarray(out)[0], expected, rtol=1e-6)


def test_banned_tokens_never_sampled():
    logits = jnp.zeros((2, 50)).at[:, 7].set(10.0)
    banned = np.full((2, 16), -1, np.int32)
    banned[:, 0] = 7
    out = jax.jit(sampler.sample)(logits, {**_sampling(2, temperature=1.0, seeds=3), "banned": banned})
    assert 7 not in np.asarray(out["tokens"]).tolist()


@pytest.mark.parametrize("vocab", [49152, 32000, 151936, 50257, 7])
def test_two_level_argmax_is_numpys_first_argmax(vocab):
    """Block sizes that divide the vocabulary and ones that need padding; ties go to the first
    index, also across blocks, as with np.argmax."""
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((6, vocab)).astype(np.float32)
    x[1, :] = 1.0                       # all tied
    x[2, [vocab // 2, vocab - 1]] = 99  # a tie in two different blocks
    x[3, 0] = 50                        # the very first token
    x[4, -1] = 50                       # the very last token
    got = np.asarray(jax.jit(sampler.first_argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, x.argmax(axis=-1))
