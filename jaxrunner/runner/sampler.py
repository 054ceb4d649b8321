"""On-device sampling for one step: penalties, temperature, top-k / top-p / min-p, logprobs.

Every row carries its own parameters, so greedy and sampled requests share one executable. The
expensive parts (penalty counts, the vocabulary sort behind top-k/top-p, Gumbel noise, top
logprobs) sit behind ``lax.cond`` on whether *any* row needs them: a greedy batch never pays for
them, and warm-up must feed random sampling parameters so that every branch is compiled and run.

Randomness: a row's key is ``fold_in(key(seed), position)`` — the request's seed and the position of
the token being sampled — so a seeded request samples the same tokens whatever else is batched.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_LOGPROBS = 20  # like vLLM's default max_logprobs: top-k logprobs returned per token, k <= this
NO_TOKEN = -1      # padding in token-id arrays (history, banned tokens)


def _apply_penalties(logits, history, prompt_lens, rep, presence, frequency):
    """vLLM semantics: repetition over prompt+output tokens, presence/frequency over output only."""
    rows, vocab = logits.shape
    valid = history >= 0
    ids = jnp.where(valid, history, 0)
    is_output = jnp.arange(history.shape[1])[None, :] >= prompt_lens[:, None]
    row_idx = jnp.broadcast_to(jnp.arange(rows)[:, None], ids.shape)
    out_counts = jnp.zeros((rows, vocab), jnp.float32).at[row_idx, ids].add((valid & is_output).astype(jnp.float32))
    seen = jnp.zeros((rows, vocab), jnp.bool_).at[row_idx, ids].max(valid)
    penalized = jnp.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
    logits = jnp.where(seen, penalized, logits)
    logits = logits - frequency[:, None] * out_counts
    return logits - presence[:, None] * (out_counts > 0)


def _filter_top_k_top_p_min_p(logits, top_k, top_p, min_p):
    """Mask logits outside each row's top-k / nucleus / min-p set with -inf."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth_value = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    probs_sorted = jax.nn.softmax(jnp.where(jnp.arange(vocab)[None] < k[:, None], sorted_desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    keep_sorted = mass_before < top_p[:, None]  # the top token is always kept
    cutoff_idx = jnp.sum(keep_sorted, axis=-1) - 1
    nucleus_value = jnp.take_along_axis(sorted_desc, cutoff_idx[:, None], axis=-1)
    threshold = jnp.maximum(kth_value, nucleus_value)
    max_logit = sorted_desc[:, :1]
    min_p_value = max_logit + jnp.log(jnp.maximum(min_p[:, None], 1e-30))  # p >= min_p * p_max
    threshold = jnp.where(min_p[:, None] > 0, jnp.maximum(threshold, min_p_value), threshold)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _gumbel_noise(seeds, positions, vocab):
    def row_noise(seed, position):
        key = jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), position)
        return jax.random.gumbel(key, (vocab,), jnp.float32)

    return jax.vmap(row_noise)(seeds, positions)


def sample(logits, params):
    """Sample one token per row. ``params`` is the sampling part of the step batch (all [S] arrays
    unless noted): temperature, top_k, top_p, min_p, repetition/presence/frequency penalties,
    seeds, positions, history [S, H], prompt_lens, banned [S, B], num_logprobs."""
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    banned = params["banned"]
    rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], banned.shape)
    logits = logits.at[rows, jnp.where(banned >= 0, banned, 0)].min(
        jnp.where(banned >= 0, -jnp.inf, jnp.inf))

    needs_penalty = (params["repetition_penalty"] != 1.0) | (params["presence_penalty"] != 0.0) | (
        params["frequency_penalty"] != 0.0)
    logits = jax.lax.cond(
        jnp.any(needs_penalty),
        lambda l: _apply_penalties(l, params["history"], params["prompt_lens"], params["repetition_penalty"],
                                   params["presence_penalty"], params["frequency_penalty"]),
        lambda l: l, logits)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    is_sampled = params["temperature"] > 0.0
    needs_filter = is_sampled & ((params["top_k"] > 0) | (params["top_p"] < 1.0) | (params["min_p"] > 0.0))

    def sampled_tokens(l):
        scaled = l / jnp.where(is_sampled, params["temperature"], 1.0)[:, None]
        scaled = jax.lax.cond(jnp.any(needs_filter),
                              lambda x: _filter_top_k_top_p_min_p(x, params["top_k"], params["top_p"], params["min_p"]),
                              lambda x: x, scaled)
        noise = _gumbel_noise(params["seeds"], params["positions"], l.shape[-1])
        return jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.any(is_sampled), sampled_tokens, lambda l: greedy_tokens, logits)
    tokens = jnp.where(is_sampled, drawn, greedy_tokens)
    token_logprobs = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]

    def top_logprobs(lp):
        return tuple(jax.lax.top_k(lp, MAX_LOGPROBS))

    empty = (jnp.zeros((logits.shape[0], MAX_LOGPROBS), jnp.float32),
             jnp.zeros((logits.shape[0], MAX_LOGPROBS), jnp.int32))
    top_values, top_ids = jax.lax.cond(jnp.any(params["num_logprobs"] > 0), top_logprobs, lambda lp: empty,
                                       raw_logprobs)
    return {"tokens": tokens, "logprobs": token_logprobs, "top_ids": top_ids.astype(jnp.int32),
            "top_logprobs": top_values}
