"""The on-device sampler against numpy: filters, penalties, inverse-CDF draws, logprobs."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.kernels import native as native_kernels
from jaxrunner.runner import sampler
from jaxrunner.runner.step_batch import SamplingMetadata


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
        if top_p[r] < 1:  # 1 turns top-p off (the cumulative sum may round to 1 before the tail)
            nucleus = np.zeros(len(row), bool)
            nucleus[order[(before < top_p[r]) & allowed[order]]] = True
            nucleus[order[0]] = True
            allowed &= nucleus
        if min_p[r] > 0:
            full = np.exp(row - row.max())
            allowed &= full >= min_p[r] * full.max()
        keep[r] = allowed
    return keep


def _skip_without_native(native: bool):
    if native and not native_kernels.available():
        pytest.skip(f"native CPU kernels unavailable: {native_kernels.unavailable_reason()}")


def _filter(native: bool):
    return jax.jit(functools.partial(sampler._filter_top_k_top_p_min_p, native_sampling=native))


# peaked (the best candidates decide) and flat (the bisections over the whole vocabulary); top-k
# within the candidates and wider than them (300, 1000 > FILTER_CANDIDATES), alone and under top-p
@pytest.mark.parametrize("native", [False, True], ids=["xla", "native"])
@pytest.mark.parametrize("scale,vocab", [(8.0, 1000), (0.3, 1000), (0.3, 49152)])
def test_filters_match_numpy(scale, vocab, native):
    _skip_without_native(native)
    rng = np.random.default_rng(0)
    rows = 16
    logits = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
    top_k = rng.choice([0, 1, 5, 40, 300, 1000], rows).astype(np.int32)
    top_k[:4] = [300, 1000, 300, 0]
    top_p = rng.choice([1.0, 0.5, 0.9, 0.99], rows).astype(np.float32)
    top_p[:4] = [1.0, 1.0, 0.9, 0.95]
    min_p = rng.choice([0.0, 0.05, 0.3], rows).astype(np.float32)
    min_p[:4] = 0.0
    filtered = np.asarray(_filter(native)(logits, top_k, top_p, min_p))
    ours = np.isfinite(filtered)
    expected = numpy_keep_mask(logits, top_k, top_p, min_p)
    # ties at a threshold may keep one more token; none in continuous random logits
    np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize("native", [False, True], ids=["xla", "native"])
def test_filter_keeps_ties_at_the_threshold(native):
    """Logits in few distinct values, as after rounding to bf16: every token tied with the last
    one a sort would keep stays, and a top-k cut through a tie keeps the whole tie."""
    _skip_without_native(native)
    rng = np.random.default_rng(1)
    logits = rng.integers(0, 6, (3, 2000)).astype(np.float32) * 0.25
    top_k = np.array([0, 700, 0], np.int32)
    top_p = np.array([0.6, 1.0, 0.9], np.float32)
    min_p = np.zeros(3, np.float32)
    ours = np.isfinite(np.asarray(_filter(native)(logits, top_k, top_p, min_p)))
    expected = numpy_keep_mask(logits, top_k, top_p, min_p)
    for r in range(3):
        kept_values = np.unique(logits[r][expected[r]])
        np.testing.assert_array_equal(ours[r], logits[r] >= kept_values.min())


@pytest.mark.parametrize("native", [False, True], ids=["xla", "native"])
def test_filter_over_banned_tokens(native):
    """-inf logits (banned, masked) carry no mass and are never kept, also when top-k reaches
    past the finite ones."""
    _skip_without_native(native)
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 3000)).astype(np.float32)
    logits[:, ::2] = -np.inf
    logits[3, 5:] = -np.inf  # three finite tokens
    top_k = np.array([0, 2000, 40, 10], np.int32)
    top_p = np.array([0.9, 0.95, 1.0, 0.99], np.float32)
    min_p = np.zeros(4, np.float32)
    ours = np.isfinite(np.asarray(_filter(native)(logits, top_k, top_p, min_p)))
    np.testing.assert_array_equal(ours, numpy_keep_mask(logits, top_k, top_p, min_p) & np.isfinite(logits))


@pytest.mark.parametrize("native", [False, True], ids=["xla", "native"])
def test_filter_edges(native):
    """A vocabulary narrower than a vector, top-k 1, a tiny top-p, one finite token, all tied."""
    _skip_without_native(native)
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((5, 7)).astype(np.float32) * 2
    logits[3, 1:] = -np.inf
    logits[4] = 0.5
    top_k = np.array([1, 0, 3, 0, 2], np.int32)
    top_p = np.array([1.0, 1e-6, 0.5, 0.3, 0.5], np.float32)
    min_p = np.zeros(5, np.float32)
    ours = np.isfinite(np.asarray(_filter(native)(logits, top_k, top_p, min_p)))
    np.testing.assert_array_equal(ours[:4], numpy_keep_mask(logits, top_k, top_p, min_p)[:4] & np.isfinite(logits[:4]))
    assert ours[4].all()  # a cut through a tie keeps the whole tie


def test_a_row_the_candidates_decide_ignores_its_batch():
    """A peaked row keeps the same tokens whether or not a flat batch-mate sends the step down the
    bisection path."""
    rng = np.random.default_rng(2)
    peaked = rng.standard_normal(5000).astype(np.float32) * 8
    flat = rng.standard_normal(5000).astype(np.float32) * 0.3
    keep = jax.jit(sampler._filter_top_k_top_p_min_p)
    alone = keep(np.stack([peaked, peaked]), np.zeros(2, np.int32), np.full(2, 0.9, np.float32), np.zeros(2, np.float32))
    mixed = keep(np.stack([peaked, flat]), np.zeros(2, np.int32), np.full(2, 0.9, np.float32), np.zeros(2, np.float32))
    np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(mixed)[0])
    assert np.isfinite(np.asarray(mixed)[1]).sum() > sampler.FILTER_CANDIDATES


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
    params = SamplingMetadata.empty(rows, 16, vocab_size=151936)  # a bitmask wide enough for every test's logits
    for name, value in fields.items():
        getattr(params, name)[:] = value
    return params


def _sample(native: bool):
    _skip_without_native(native)
    return jax.jit(functools.partial(sampler.sample, native_sampling=native))


@pytest.mark.parametrize("native", [False, True], ids=["xla", "native"])
def test_greedy_logprobs_and_top_logprobs(native):
    logits = jax.random.normal(jax.random.key(1), (4, 300)) * 3
    out = _sample(native)(logits, _sampling(4, num_logprobs=5))
    expected = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_array_equal(out["tokens"], np.argmax(logits, axis=-1))
    np.testing.assert_allclose(out["logprobs"], np.max(expected, axis=-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["top_logprobs"][:, :5], np.sort(expected, axis=-1)[:, ::-1][:, :5], atol=1e-5)


@pytest.mark.parametrize("native", [False, True], ids=["xla", "native"])
def test_the_sampled_tokens_logprob_alone_skips_the_top_logprobs(native):
    """logprobs=0 (the sampled token's logprob and rank, as RL rollouts take them) gives the same
    figures whether or not a batch-mate asks for top logprobs; the top ones stay zeros without one."""
    logits = jax.random.normal(jax.random.key(2), (4, 300)) * 3
    alone = _sample(native)(logits, _sampling(4, num_logprobs=0))
    mixed_params = _sampling(4, num_logprobs=0)
    mixed_params.num_logprobs[1] = 5
    mixed = _sample(native)(logits, mixed_params)
    expected = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_allclose(alone["logprobs"], np.max(expected, axis=-1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(alone["ranks"], 1)
    np.testing.assert_array_equal(alone["logprobs"], mixed["logprobs"])
    assert not np.asarray(alone["top_logprobs"]).any() and np.asarray(mixed["top_logprobs"])[1, :5].all()


def test_penalties_match_vllm_semantics():
    logits = np.array([[2.0, -1.0, 0.5, 1.0]], np.float32)
    history = np.full((1, 16), -1, np.int32)
    history[0, :3] = [0, 1, 1]  # prompt token 0, then outputs 1, 1
    params = _sampling(1, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    params = dataclasses.replace(params, history=history)
    params.prompt_lens[:] = 1
    out = sampler._apply_penalties(jnp.asarray(logits), history, params.prompt_lens, params.repetition_penalty,
                                   params.presence_penalty, params.frequency_penalty)
    expected = [2.0 / 2, -1.0 * 2 - 0.25 * 2 - 0.5, 0.5, 1.0]
    np.testing.assert_allclose(np.asarray(out)[0], expected, rtol=1e-6)


def test_banned_tokens_never_sampled():
    logits = jnp.zeros((2, 50)).at[:, 7].set(10.0)
    banned = np.full((2, 16), -1, np.int32)
    banned[:, 0] = 7
    out = jax.jit(sampler.sample)(logits, dataclasses.replace(_sampling(2, temperature=1.0, seeds=3), banned=banned))
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


# ----------------------------------------------------------------------------- token-id options
def numpy_process(logits, allowed, bias_ids, bias_values, banned):
    """vLLM's order written plainly: allowed-token mask, logit bias, banned tokens."""
    out = logits.astype(np.float64).copy()
    for r in range(len(out)):
        ids = [t for t in allowed[r] if t >= 0]
        if ids:
            keep = np.zeros(out.shape[1], bool)
            keep[ids] = True
            out[r, ~keep] = -np.inf
        for t, v in zip(bias_ids[r], bias_values[r]):
            if t >= 0:
                out[r, t] += v
        out[r, [t for t in banned[r] if t >= 0]] = -np.inf
    return out


def _token_options(rows: int, vocab: int, rng):
    params = _sampling(rows)
    for r in range(rows):
        if r % 2:  # odd rows restricted, even rows free
            ids = rng.choice(vocab, 6, replace=False)
            params.allowed_token_ids[r, :6] = ids
        if r % 3:
            ids = rng.choice(vocab, 4, replace=False)
            params.logit_bias_ids[r, :4] = ids
            params.logit_bias_values[r, :4] = rng.uniform(-5, 5, 4)
        if r % 4 == 1:
            params.banned[r, :2] = params.allowed_token_ids[r, :2]  # some allowed ids banned too
    return params


def test_allowed_bias_and_bans_match_numpy():
    rng = np.random.default_rng(3)
    rows, vocab = 8, 300
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 2
    params = _token_options(rows, vocab, rng)
    got = np.asarray(jax.jit(sampler._process_logits)(logits, params))
    expected = numpy_process(logits, params.allowed_token_ids, params.logit_bias_ids,
                             params.logit_bias_values, params.banned)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_samples_follow_the_processed_logits(temperature):
    rng = np.random.default_rng(4)
    rows, vocab = 8, 300
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    params = _token_options(rows, vocab, rng)
    params.temperature[:] = temperature
    params.seeds[:] = np.arange(rows)
    tokens = np.asarray(jax.jit(sampler.sample)(logits, params)["tokens"])
    processed = numpy_process(logits, params.allowed_token_ids, params.logit_bias_ids,
                              params.logit_bias_values, params.banned)
    assert np.all(np.isfinite(processed[np.arange(rows), tokens]))  # never an excluded token
    if temperature == 0:
        np.testing.assert_array_equal(tokens, processed.argmax(axis=-1))


def test_logit_bias_moves_the_draw():
    logits = np.zeros((1, 50), np.float32)
    params = _sampling(1, temperature=1.0)
    params.logit_bias_ids[0, :2] = [11, 12]
    params.logit_bias_values[0, :2] = [np.log(1000.0), -100.0]
    draws = []
    step = jax.jit(sampler.sample)
    for seed in range(200):
        params.seeds[:] = seed
        draws.append(int(step(logits, params)["tokens"][0]))
    share = draws.count(11) / len(draws)
    assert abs(share - 1000 / 1049) < 0.05 and 12 not in draws


@pytest.mark.parametrize("native", [False, True], ids=["xla", "native"])
def test_ranks_and_logprobs_zero(native):
    """num_logprobs=0 still gets the sampled token's logprob and rank (vLLM returns them); a batch
    that asks for none returns zeros: it skips the normalizer over the vocabulary."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((5, 200)).astype(np.float32)
    params = _sampling(5, temperature=1.0, num_logprobs=0)
    params.seeds[:] = np.arange(5)
    out = _sample(native)(logits, params)
    tokens = np.asarray(out["tokens"])
    expected = 1 + (logits > logits[np.arange(5), tokens][:, None]).sum(axis=-1)
    np.testing.assert_array_equal(out["ranks"], expected)
    log_probs = logits - np.log(np.sum(np.exp(logits), axis=-1, keepdims=True))
    np.testing.assert_allclose(out["logprobs"], log_probs[np.arange(5), tokens], rtol=1e-5, atol=1e-5)
    none = _sample(native)(logits, _sampling(5, temperature=1.0))
    assert not np.any(np.asarray(none["ranks"])) and not np.any(np.asarray(none["top_ids"]))
    assert not np.any(np.asarray(none["logprobs"]))


@pytest.mark.parametrize("vocab", [7, 49152, 1003])
def test_native_logprob_stats_match_xla(vocab):
    """The native pass gives jax.nn.logsumexp's normalizer to float32 rounding and vLLM's rank
    exactly: ties with the chosen logit do not count, a NaN makes the normalizer NaN, a row of -inf
    gives -inf, an infinite logit gives that infinity, an id outside the row counts nothing."""
    _skip_without_native(True)
    from jaxrunner import kernels
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((7, vocab)) * 4).astype(np.float32)
    logits[1, : vocab // 2] = logits[1, 0]  # ties with the chosen logit
    logits[2, vocab - 1] = np.nan
    logits[3] = -np.inf
    logits[4, 3 % vocab] = np.inf
    chosen = np.array([0, 0, 1, 2, vocab - 1, -1, vocab], np.int32)
    normalizer, ranks = jax.jit(kernels.logprob_stats_native)(jnp.asarray(logits), jnp.asarray(chosen))
    expected = np.asarray(jax.nn.logsumexp(jnp.asarray(logits), axis=-1))
    finite = [0, 1, 5, 6]
    np.testing.assert_allclose(np.asarray(normalizer)[finite], expected[finite], rtol=1e-6, atol=0)
    assert np.isnan(normalizer[2]) and normalizer[3] == -np.inf and normalizer[4] == np.inf
    in_row = chosen[:5]
    expected_ranks = 1 + (logits[:5] > logits[np.arange(5), in_row][:, None]).sum(axis=-1)
    np.testing.assert_array_equal(np.asarray(ranks)[:5], expected_ranks)
    np.testing.assert_array_equal(np.asarray(ranks)[5:], 1)


def test_the_high_half_of_the_seed_changes_the_draw():
    logits = np.zeros((64, 1000), np.float32)
    params = _sampling(64, temperature=1.0, seeds=7)
    params.positions[:] = np.arange(64)
    low_only = np.asarray(jax.jit(sampler.sample)(logits, params)["tokens"])
    params.seeds_high[:] = 1  # seed 7 + 2**32
    high = np.asarray(jax.jit(sampler.sample)(logits, params)["tokens"])
    assert np.mean(low_only == high) < 0.2


@pytest.mark.parametrize("native", [False, True], ids=["xla", "native"])
def test_prompt_logprobs_match_numpy_log_softmax(native):
    _skip_without_native(native)
    rng = np.random.default_rng(6)
    tokens, width, vocab = 24, 16, 100
    hidden = rng.standard_normal((tokens, width)).astype(np.float32)
    weights = rng.standard_normal((width, vocab)).astype(np.float32)
    targets = np.where(rng.random(tokens) < 0.7, rng.integers(0, vocab, tokens), -1).astype(np.int32)
    got = jax.jit(lambda h, t: sampler.prompt_logprobs(lambda rows: rows @ weights, h, t, native_sampling=native))(
        hidden, targets)
    logits = hidden.astype(np.float64) @ weights
    logprobs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    rows = np.flatnonzero(targets >= 0)
    np.testing.assert_allclose(got["prompt_logprobs"][rows], logprobs[rows, targets[rows]], atol=1e-4)
    ranks = 1 + (logits[rows] > logits[rows, targets[rows]][:, None]).sum(axis=-1)
    np.testing.assert_array_equal(np.asarray(got["prompt_ranks"])[rows], ranks)
    top = np.argsort(-logprobs, axis=-1)[:, :sampler.MAX_LOGPROBS]
    np.testing.assert_array_equal(got["prompt_top_ids"], top)
    np.testing.assert_allclose(got["prompt_top_logprobs"], np.take_along_axis(logprobs, top, -1), atol=1e-4)


def test_token_bitmask_keeps_exactly_the_allowed_tokens():
    """Rows with a bitmask sample only tokens whose bit is set (llguidance's layout); a free row is untouched."""
    rng = np.random.default_rng(3)
    rows, vocab = 4, 1000
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    params = _sampling(rows, temperature=1.0, seeds=np.arange(rows), num_logprobs=0)
    allowed = [rng.choice(vocab, size, replace=False) for size in (1, 3, 40)]
    for row, ids in enumerate(allowed):
        words = np.zeros(params.token_bitmask.shape[1], np.uint32)
        np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
        params.token_bitmask[row] = words.view(np.int32)
    out = jax.jit(sampler.sample)(logits, params)
    for row, ids in enumerate(allowed):
        assert int(out["tokens"][row]) in set(ids.tolist())
    free = jax.jit(sampler.sample)(logits, _sampling(rows, temperature=1.0, seeds=np.arange(rows), num_logprobs=0))
    assert int(out["tokens"][3]) == int(free["tokens"][3])
    raw = logits - np.log(np.sum(np.exp(logits), axis=-1, keepdims=True))  # logprobs are the raw model's
    np.testing.assert_allclose(out["logprobs"], raw[np.arange(rows), np.asarray(out["tokens"])], rtol=1e-5, atol=1e-5)
