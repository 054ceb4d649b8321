"""On-device sampling for one step: allowed tokens, logit bias, bans, penalties, temperature,
top-k / top-p / min-p, logprobs with ranks; and the logprobs of prompt tokens.

Every row carries its own parameters, so greedy and sampled requests share one executable. The
expensive parts (penalty counts, the thresholds behind top-k/top-p, Gumbel noise, top
logprobs) sit behind ``lax.cond`` on whether *any* row needs them: a greedy batch never pays for
them, and warm-up must feed random sampling parameters so that every branch is compiled and run.

Order, as vLLM applies them: the structured-output token bitmask, ``allowed_token_ids`` mask, ``logit_bias``, banned tokens (EOS and
stop ids under ``min_tokens``, the last token of a bad word), penalties, then temperature and the
filters. Token-id options travel as fixed-width per-row arrays padded with ``NO_TOKEN`` (widths in
``runner.step_batch``), so one executable serves every mix of them. The settings arrive as the
step batch's ``SamplingMetadata`` (``runner.step_batch``), one row per sampled sequence.

Randomness: a row's key is ``fold_in(fold_in(key(seed_low), seed_high), position)`` — the request's
64-bit seed and the position of the token being sampled — so a seeded request samples the same
tokens whatever else is batched.
Each row needs one uniform number (inverse-CDF sampling), not one per vocabulary entry.

Speculative verification: a row with a ``draft_tokens`` entry (``with_draft_rows``) checks a
proposed token d. Greedy rows need nothing new (the host accepts d while it equals the argmax). A
sampled row accepts d with probability p(d) under its processed, tempered and filtered
distribution p, else draws from the residual max(p - q, 0) of a point-mass proposal q, i.e. p
without d, renormalized: the token it returns is then distributed exactly as p (standard
rejection sampling), and equals d exactly when d was accepted. The acceptance test uses a second
uniform of the row's key (``ACCEPT_STREAM``).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxrunner import kernels
from jaxrunner.executor_protocol import NO_LOGPROBS, NO_TOKEN
from jaxrunner.runner.step_batch import MAX_LOGPROBS, DraftRows, SamplingMetadata

__all__ = ["sample", "prompt_logprobs", "empty_prompt_logprobs", "with_draft_rows", "verify_draws", "first_argmax",
           "MAX_LOGPROBS", "NO_LOGPROBS", "NO_TOKEN"]

ACCEPT_STREAM = 1  # folded into a row's key for the uniform of the speculative acceptance test


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


FILTER_CANDIDATES = 256  # top-k/top-p thresholds come from this many best tokens when they suffice
CDF_BLOCK = 1024         # two-level inverse-CDF sampling: block sums, then one block's cumsum
ARGMAX_BLOCK = 1024      # two-level greedy argmax: block maxima, then one block


def _thresholds(sorted_desc, log_normalizer, top_k, top_p):
    """Per-row logit threshold of top-k and nucleus filtering from the best logits, sorted
    descending ([S, K], K <= vocab), and whether those K candidates were enough to decide it."""
    width = sorted_desc.shape[-1]
    positions = jnp.arange(width)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, width), width)
    in_k = positions < k[:, None]
    kth_value = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)[:, 0]
    # top-p renormalizes over the top-k set when top-k is on, else over the whole vocabulary
    top_k_normalizer = jax.nn.logsumexp(jnp.where(in_k, sorted_desc, -jnp.inf), axis=-1)
    normalizer = jnp.where(top_k > 0, top_k_normalizer, log_normalizer)
    probs = jnp.where(in_k, jnp.exp(sorted_desc - normalizer[:, None]), 0.0)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.sum((mass_before < top_p[:, None]) & in_k, axis=-1) - 1  # the top token always stays
    nucleus_value = jnp.take_along_axis(sorted_desc, cutoff[:, None], axis=-1)[:, 0]
    threshold = jnp.maximum(jnp.where(top_k > 0, kth_value, -jnp.inf),
                            jnp.where(top_p < 1.0, nucleus_value, -jnp.inf))
    # a top-k set wider than the candidates needs the whole vocabulary, for its k-th value and for
    # the normalizer top-p then uses
    decided = jnp.where(top_k > 0, top_k <= width, (top_p >= 1.0) | (jnp.sum(probs, axis=-1) >= top_p))
    return threshold, decided


def _order_key(x):
    """float32 -> uint32 keys in the floats' order (-inf lowest, -0.0 just below +0.0), so that a
    bisection over keys visits every float between two bounds."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 != 0, ~bits, bits | jnp.uint32(1 << 31))


def _from_order_key(key):
    bits = jnp.where(key >> 31 != 0, key & jnp.uint32((1 << 31) - 1), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _smallest_satisfying(lowest, highest, satisfied):
    """Per row, the smallest float32 v in [lowest, highest] with ``satisfied(v)`` ([S] -> [S] bool),
    which must be false below some value and true from it on, and true at ``highest``. Bisection
    over the floats' order keys: at most 32 rounds, ending when every row has converged (a row
    with lowest == highest takes part in none)."""
    def halve(bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = satisfied(_from_order_key(mid))
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, _ = jax.lax.while_loop(lambda bounds: jnp.any(bounds[0] < bounds[1]), halve,
                               (_order_key(lowest), _order_key(highest)))
    return _from_order_key(lo)


def _exact_thresholds(logits, log_normalizer, top_k, top_p):
    """``_thresholds`` over the whole vocabulary, without sorting it: the k-th largest logit is the
    smallest logit v with fewer than k logits above it, and the nucleus threshold the smallest
    logit v whose top-k set's probability mass above v is below top_p (the tokens tied at v stay,
    as after a sort). Each is a bisection over float32 values, one pass over the logits a round:
    for 64 rows of 49152, tens of milliseconds against a sort's ~0.6 s on XLA:CPU."""
    lowest, highest = jnp.min(logits, axis=-1), jnp.max(logits, axis=-1)
    k_on, p_on = top_k > 0, top_p < 1.0
    kth = _smallest_satisfying(jnp.where(k_on, lowest, highest), highest,
                               lambda v: jnp.sum(logits > v[:, None], axis=-1) < top_k)
    in_k = logits >= jnp.where(k_on, kth, -jnp.inf)[:, None]
    top_k_normalizer = jax.nn.logsumexp(jnp.where(in_k, logits, -jnp.inf), axis=-1)
    normalizer = jnp.where(k_on, top_k_normalizer, log_normalizer)[:, None]

    def mass_above_below_top_p(v):
        above = in_k & (logits > v[:, None])
        return jnp.sum(jnp.where(above, jnp.exp(logits - normalizer), 0.0), axis=-1) < top_p

    nucleus = _smallest_satisfying(jnp.where(p_on, jnp.where(k_on, kth, lowest), highest), highest,
                                   mass_above_below_top_p)
    return jnp.maximum(jnp.where(k_on, kth, -jnp.inf), jnp.where(p_on, nucleus, -jnp.inf))


def _filter_top_k_top_p_min_p(logits, top_k, top_p, min_p, native_sampling: bool = False):
    """Mask logits outside each row's top-k / nucleus / min-p set with -inf (vLLM semantics).

    The top-k/top-p thresholds come from ``kernels.sampling_thresholds_native`` with
    ``native_sampling`` (XLA:CPU with the native kernels built: those of ``_exact_thresholds``,
    several times faster than XLA's TopK alone), else from ``_xla_thresholds``.
    """
    if native_sampling:
        threshold = kernels.sampling_thresholds_native(logits.astype(jnp.float32), top_k.astype(jnp.int32),
                                                       top_p.astype(jnp.float32))
    else:
        threshold = _xla_thresholds(logits, top_k, top_p)
    # keep p >= min_p * p_max. (max via jnp.max, not the TopK's first value: reading that made
    # XLA:CPU turn the TopK custom call into a full sort, 30x slower.)
    min_p_value = jnp.max(logits, axis=-1) + jnp.log(jnp.maximum(min_p, 1e-30))
    threshold = jnp.where(min_p > 0, jnp.maximum(threshold, min_p_value), threshold)
    return jnp.where(logits >= threshold[:, None], logits, -jnp.inf)


def _xla_thresholds(logits, top_k, top_p):
    """The top-k/top-p thresholds in XLA. The best ``FILTER_CANDIDATES`` logits decide most rows
    (a peaked nucleus, top-k within them). Only when some row is not decided by them (a flat
    distribution's nucleus, a wider top-k) do the bisections of ``_exact_thresholds`` run over the
    whole vocabulary; a row the candidates decide keeps their threshold either way, so its tokens
    do not depend on the rest of the batch."""
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    candidates = jax.lax.top_k(logits, min(FILTER_CANDIDATES, logits.shape[-1]))[0]
    threshold, decided = _thresholds(candidates, log_normalizer, top_k, top_p)
    return jax.lax.cond(  # operands passed explicitly: the closure form measured 30x slower
        jnp.all(decided), lambda full, known, done: known,
        lambda full, known, done: jnp.where(done, known, _exact_thresholds(full, log_normalizer, top_k, top_p)),
        logits, threshold, decided)


def _row_uniforms(seeds, seeds_high, positions, stream: int = 0):
    def one(seed, seed_high, position):
        key = jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), seed_high.astype(jnp.uint32))
        key = jax.random.fold_in(key, position)
        if stream:
            key = jax.random.fold_in(key, stream)
        return jax.random.uniform(key, (), jnp.float32)

    return jax.vmap(one)(seeds, seeds_high, positions)


def _inverse_cdf_sample(logits, uniforms, temperature=None, fallback=None):
    """Draw token ~ softmax(logits / temperature) per row with one uniform number per row
    (``temperature`` [S], default 1; ``fallback`` [S]: the rows' argmax, computed here if not given).

    Two levels so that no cumsum runs over the whole vocabulary: pick a block of ``CDF_BLOCK``
    tokens from the block masses, then a token inside it. The exponentials are summed per block
    without being stored, and the chosen block's are computed again: a [S, V] array of them was
    written and read back (64 rows of SmolLM2's 49152: about a fifth of a sampled batch's draw).
    """
    rows, vocab = logits.shape
    blocks = -(-vocab // CDF_BLOCK)
    padded = logits
    if blocks * CDF_BLOCK != vocab:
        padded = jnp.pad(logits, ((0, 0), (0, blocks * CDF_BLOCK - vocab)), constant_values=-jnp.inf)
    scale = 1.0 if temperature is None else (1.0 / temperature)[:, None, None]
    top = jnp.max(padded, axis=-1)[:, None, None]
    x = padded.reshape(rows, blocks, CDF_BLOCK)
    block_mass = jnp.sum(jnp.exp((x - top) * scale), axis=-1)
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    target = uniforms * block_cdf[:, -1]
    block = jnp.minimum(jnp.sum(block_cdf <= target[:, None], axis=-1), blocks - 1)
    remaining = target - jnp.take_along_axis(block_cdf - block_mass, block[:, None], axis=-1)[:, 0]
    chosen = jnp.take_along_axis(x, block[:, None, None], axis=1)  # [S, 1, CDF_BLOCK]
    inner_cdf = jnp.cumsum(jnp.exp((chosen - top) * scale)[:, 0], axis=-1)
    token = block * CDF_BLOCK + jnp.minimum(jnp.sum(inner_cdf <= remaining[:, None], axis=-1), CDF_BLOCK - 1)
    # float rounding can land on a zero-probability token (masked or padding): fall back to the best
    possible = jnp.take_along_axis(padded, token[:, None], axis=-1)[:, 0] > -jnp.inf
    fallback = first_argmax(logits) if fallback is None else fallback
    return jnp.where(possible, token, fallback).astype(jnp.int32)


def _block_size(vocab: int) -> int:
    """A divisor of ``vocab`` near ``ARGMAX_BLOCK`` (so no padded copy of the logits is needed),
    else ``ARGMAX_BLOCK`` itself (the logits are then padded)."""
    for delta in range(ARGMAX_BLOCK // 2):
        for size in (ARGMAX_BLOCK + delta, ARGMAX_BLOCK - delta):
            if vocab % size == 0:
                return size
    return ARGMAX_BLOCK


def first_argmax(x):
    """``jnp.argmax(x, axis=-1)`` (the first maximal index) of [S, vocab] logits, in two levels:
    block maxima (one plain max reduction over the logits), then an argmax inside each row's best
    block. XLA:CPU's variadic argmax reduction, and a where/min over the whole vocabulary, each
    cost 5-13 ms per 64 x 49152 step inside the model step (profiled); this costs about one max."""
    rows, vocab = x.shape
    size = _block_size(vocab)
    blocks = -(-vocab // size)
    if blocks * size != vocab:
        x = jnp.pad(x, ((0, 0), (0, blocks * size - vocab)), constant_values=-jnp.inf)
    x = x.reshape(rows, blocks, size)
    block_max = jnp.max(x, axis=-1)                                        # [S, blocks]
    best = jnp.max(block_max, axis=-1, keepdims=True)
    block = jnp.min(jnp.where(block_max == best, jnp.arange(blocks, dtype=jnp.int32), blocks), axis=-1)
    block = jnp.minimum(block, blocks - 1)  # a NaN row matches nothing: any valid block
    inside = jnp.take_along_axis(x, block[:, None, None], axis=1)[:, 0]    # [S, size]
    offset = jnp.min(jnp.where(inside == best, jnp.arange(size, dtype=jnp.int32), size), axis=-1)
    return (block * size + jnp.minimum(offset, size - 1)).astype(jnp.int32)


def _row_index(ids):
    return jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)


def _ban_tokens(logits, banned):
    return logits.at[_row_index(banned), jnp.where(banned >= 0, banned, 0)].min(
        jnp.where(banned >= 0, -jnp.inf, jnp.inf))


def _keep_allowed(logits, allowed):
    """Rows with any allowed id keep only those ids' logits; rows without keep all."""
    valid = allowed >= 0
    mask = jnp.zeros(logits.shape, jnp.bool_).at[_row_index(allowed), jnp.where(valid, allowed, 0)].max(valid)
    restricted = jnp.any(valid, axis=-1, keepdims=True)
    return jnp.where(restricted & ~mask, -jnp.inf, logits)


def _keep_bitmask(logits, bitmask):
    """Structured output: keep the logits of the tokens whose bit is set in the row's bitmask
    (bit t % 32 of word t // 32); a free row has every bit set."""
    rows, vocab = logits.shape
    if bitmask.shape[-1] * 32 < vocab:
        raise ValueError(f"token bitmask of {bitmask.shape[-1]} words covers fewer than the {vocab} logits")
    bits = jnp.right_shift(bitmask[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1
    return jnp.where(bits.reshape(rows, -1)[:, :vocab] != 0, logits, -jnp.inf)


def _add_logit_bias(logits, ids, values):
    valid = ids >= 0
    return logits.at[_row_index(ids), jnp.where(valid, ids, 0)].add(jnp.where(valid, values, 0.0))


def _draw(logits, sampling: SamplingMetadata, is_sampled, greedy_tokens, native_sampling: bool):
    """Temperature, top-k / top-p / min-p, then one inverse-CDF draw per row (``greedy_tokens``:
    the rows' argmax, the draw's fallback)."""
    # greedy rows take no part in filtering (their settings must not force the slow path)
    top_k = jnp.where(is_sampled, sampling.top_k, 0)
    top_p = jnp.where(is_sampled, sampling.top_p, 1.0)
    min_p = jnp.where(is_sampled, sampling.min_p, 0.0)
    temperature = jnp.where(is_sampled, sampling.temperature, 1.0)
    uniforms = _row_uniforms(sampling.seeds, sampling.seeds_high, sampling.positions)
    filters = jnp.any((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))

    def filtered(x):
        return _filter_top_k_top_p_min_p(x / temperature[:, None], top_k, top_p, min_p, native_sampling)

    if sampling.draft_tokens is None:
        # without filters the temperature goes into the draw's exponentials: no tempered copy of
        # the logits is written
        return jax.lax.cond(filters, lambda x: _inverse_cdf_sample(filtered(x), uniforms, fallback=greedy_tokens),
                            lambda x: _inverse_cdf_sample(x, uniforms, temperature, greedy_tokens), logits)
    scaled = jax.lax.cond(filters, filtered, lambda x: x / temperature[:, None], logits)
    return verify_draws(scaled, sampling.draft_tokens, uniforms,
                        _row_uniforms(sampling.seeds, sampling.seeds_high, sampling.positions, ACCEPT_STREAM))


def verify_draws(logits, draft_tokens, uniforms, accept_uniforms):
    """One token per row of ``softmax(logits)`` (processed, tempered, filtered); rows whose
    ``draft_tokens`` entry names a token verify it by rejection sampling (module docstring)."""
    has_draft = draft_tokens >= 0
    draft = jnp.maximum(draft_tokens, 0)
    log_p = jax.nn.log_softmax(logits, axis=-1)
    p_draft = jnp.exp(jnp.take_along_axis(log_p, draft[:, None], axis=-1)[:, 0])
    accepted = has_draft & (accept_uniforms < p_draft)
    is_draft = has_draft[:, None] & (jnp.arange(logits.shape[-1])[None, :] == draft[:, None])
    drawn = _inverse_cdf_sample(jnp.where(is_draft, -jnp.inf, logits), uniforms)
    return jnp.where(accepted, draft, drawn).astype(jnp.int32)


def _maybe(flag, fn, x):
    """``fn(x)`` when ``flag`` (a traced bool) holds for the batch, else ``x``: the cost is only paid
    by batches that need it."""
    return jax.lax.cond(flag, fn, lambda y: y, x)


def _processing_steps(sampling: SamplingMetadata) -> list:
    """Structured-output bitmask, allowed tokens, logit bias, bans, penalties: each as (whether
    some row of the batch uses it, the step on the logits)."""
    bitmask, allowed, banned = sampling.token_bitmask, sampling.allowed_token_ids, sampling.banned
    bias_ids, bias_values = sampling.logit_bias_ids, sampling.logit_bias_values
    needs_penalty = ((sampling.repetition_penalty != 1.0) | (sampling.presence_penalty != 0.0)
                     | (sampling.frequency_penalty != 0.0))
    return [
        (jnp.any(bitmask != -1), lambda l: _keep_bitmask(l, bitmask)),
        (jnp.any(allowed >= 0), lambda l: _keep_allowed(l, allowed)),
        (jnp.any(bias_ids >= 0), lambda l: _add_logit_bias(l, bias_ids, bias_values)),
        (jnp.any(banned >= 0), lambda l: _ban_tokens(l, banned)),
        (jnp.any(needs_penalty), lambda l: _apply_penalties(l, sampling.history, sampling.prompt_lens,
                                                            sampling.repetition_penalty, sampling.presence_penalty,
                                                            sampling.frequency_penalty)),
    ]


def _process_logits(logits, sampling: SamplingMetadata):
    """The logit-processing steps (:func:`_processing_steps`), each only in batches where some
    row uses it."""
    for used, step in _processing_steps(sampling):
        logits = _maybe(used, step, logits)
    return logits


def _ranks(raw, chosen):
    """vLLM's rank of each row's chosen token in the raw distribution: 1 + the tokens strictly
    more likely (one compare and a count over the vocabulary)."""
    chosen_logit = jnp.take_along_axis(raw, chosen[:, None], axis=-1)
    return (jnp.sum(raw > chosen_logit, axis=-1) + 1).astype(jnp.int32)


def _logprob_stats(raw, chosen, native: bool):
    """(each row's log normalizer, the rank of its ``chosen`` token): in one native pass per row
    with ``native`` (``kernels.logprob_stats_native``), else XLA's logsumexp and count."""
    if native:
        return kernels.logprob_stats_native(raw.astype(jnp.float32), chosen.astype(jnp.int32))
    return jax.nn.logsumexp(raw, axis=-1), _ranks(raw, chosen)


def _top_logprobs(raw, log_normalizer):
    values, ids = jax.lax.top_k(raw, MAX_LOGPROBS)
    return values - log_normalizer[:, None], ids.astype(jnp.int32)


def with_draft_rows(sampling: SamplingMetadata, draft_rows: DraftRows) -> SamplingMetadata:
    """The sampling settings of the sequences' rows followed by the draft rows: each draft row
    takes its sequence's settings, its own position, token bitmask and the proposal it verifies."""
    seqs = draft_rows.seqs
    rows = jax.tree.map(lambda x: jnp.concatenate([x, jnp.take(x, seqs, axis=0)]), sampling)
    no_draft = jnp.full(sampling.positions.shape, NO_TOKEN, jnp.int32)
    return dataclasses.replace(rows, positions=jnp.concatenate([sampling.positions, draft_rows.positions]),
                               token_bitmask=jnp.concatenate([sampling.token_bitmask, draft_rows.token_bitmask]),
                               draft_tokens=jnp.concatenate([no_draft, draft_rows.tokens]))


def sample(logits, sampling: SamplingMetadata, *, native_sampling: bool = False):
    """Sample one token per row of ``logits`` [S, V] with the row's settings in ``sampling`` (the
    step batch's ``SamplingMetadata``, or with ``draft_tokens`` after ``with_draft_rows``).

    Logprobs are those of the raw model distribution (before bias, bans, penalties and
    temperature), as vLLM reports them by default. They (the sampled token's, its rank and the top
    logprobs) are computed only in batches where some row asks for logprobs, zeros otherwise: the
    normalizer alone, a max and a sum of exponentials over the vocabulary, took about 6 % of a
    64-row SmolLM2 decode step (profiled). ``native_sampling``: top-k/top-p thresholds
    (``_filter_top_k_top_p_min_p``) and the logprobs' normalizer and ranks
    (``kernels.logprob_stats_native``) in the native CPU kernels.
    """
    raw = logits
    is_sampled = sampling.temperature > 0.0

    def processed_tokens(x):
        x = _process_logits(x, sampling)
        greedy_tokens = first_argmax(x)
        drawn = jax.lax.cond(jnp.any(is_sampled),
                             lambda y: _draw(y, sampling, is_sampled, greedy_tokens, native_sampling),
                             lambda y: greedy_tokens, x)
        return jnp.where(is_sampled, drawn, greedy_tokens)

    # A plain greedy batch skips processing, temperature, filters and the draw entirely (even
    # `logits / 1` over the vocabulary cost 6.5 ms per 64-row step, profiled), and its one cond
    # hands back tokens, not logits: a branch returning the logits as they were copied them
    # (0.6 ms a 64-row SmolLM2 step), since the raw ones stay alive for the logprobs.
    processing = functools.reduce(jnp.logical_or, [used for used, _ in _processing_steps(sampling)])
    tokens = jax.lax.cond(processing | jnp.any(is_sampled), processed_tokens, first_argmax, logits)

    rows = raw.shape[0]
    no_top = (jnp.zeros((rows, MAX_LOGPROBS), jnp.float32), jnp.zeros((rows, MAX_LOGPROBS), jnp.int32))
    empty = (jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.int32)) + no_top

    def logprob_details(x, with_top: bool):
        log_normalizer, ranks = _logprob_stats(x, tokens, native_sampling)
        token_logprobs = jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0] - log_normalizer
        return (token_logprobs, ranks) + (_top_logprobs(x, log_normalizer) if with_top else no_top)

    # one switch, not nested conds (a second cond around the TopK cost a copy of the logits): the
    # top logprobs' TopK over the vocabulary runs only where a row asks for some, not for the
    # sampled token's own logprob alone (logprobs=0, what RL rollouts take)
    wanted = jnp.where(jnp.any(sampling.num_logprobs > 0), 2, jnp.where(jnp.any(sampling.num_logprobs >= 0), 1, 0))
    token_logprobs, ranks, top_values, top_ids = jax.lax.switch(
        wanted, [lambda x: empty, functools.partial(logprob_details, with_top=False),
                 functools.partial(logprob_details, with_top=True)], raw)
    return {"tokens": tokens, "logprobs": token_logprobs, "ranks": ranks, "top_ids": top_ids,
            "top_logprobs": top_values}


PROMPT_LOGPROB_BLOCK = 128  # prompt rows whose [rows, vocab] logits are alive at once


def prompt_logprobs(logits_of, hidden, targets, *, native_sampling: bool = False):
    """For each token row, the logprob and rank of ``targets`` (the next prompt token; ``NO_TOKEN``
    rows are skipped) and the top ``MAX_LOGPROBS``, from ``logits_of(hidden rows) -> [N, V]``.
    ``native_sampling``: the normalizer and the ranks from ``kernels.logprob_stats_native``.

    Rows go through in blocks so that at most ``PROMPT_LOGPROB_BLOCK`` rows of logits exist at once.
    """
    tokens = hidden.shape[0]
    block = max(b for b in range(1, min(tokens, PROMPT_LOGPROB_BLOCK) + 1) if tokens % b == 0)

    def one_block(args):
        rows, row_targets = args
        raw = logits_of(rows)
        chosen = jnp.maximum(row_targets, 0)
        log_normalizer, ranks = _logprob_stats(raw, chosen, native_sampling)
        logprob = jnp.take_along_axis(raw, chosen[:, None], axis=-1)[:, 0] - log_normalizer
        top_values, top_ids = _top_logprobs(raw, log_normalizer)
        return logprob, ranks, top_values, top_ids

    blocks = (hidden.reshape(tokens // block, block, hidden.shape[-1]), targets.reshape(tokens // block, block))
    logprob, ranks, top_values, top_ids = jax.lax.map(one_block, blocks)
    return {"prompt_logprobs": logprob.reshape(tokens), "prompt_ranks": ranks.reshape(tokens),
            "prompt_top_logprobs": top_values.reshape(tokens, MAX_LOGPROBS),
            "prompt_top_ids": top_ids.reshape(tokens, MAX_LOGPROBS)}


def empty_prompt_logprobs(tokens: int):
    """What ``prompt_logprobs`` returns, as zeros: the branch of batches that want none."""
    return {"prompt_logprobs": jnp.zeros(tokens, jnp.float32), "prompt_ranks": jnp.zeros(tokens, jnp.int32),
            "prompt_top_logprobs": jnp.zeros((tokens, MAX_LOGPROBS), jnp.float32),
            "prompt_top_ids": jnp.zeros((tokens, MAX_LOGPROBS), jnp.int32)}
