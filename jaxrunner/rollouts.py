"""What a reinforcement-learning loop needs beside sampling: the rollouts as padded arrays, and the
log-probabilities of token sequences under a params pytree, differentiable, computed by the same
model functions the engine serves (so the policy that is trained is the policy that sampled).

    outputs = llm.generate(prompts, SamplingParams(n=8, temperature=1.0))
    batch = pad_rollouts(outputs)
    loss = lambda p: -(advantages * completion_logprob_sums(p, config, batch)).mean()
    llm.update_weights(optax.apply_updates(params, ...))
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.models import lora, registry
from jaxrunner.models.attention import DenseAttention
from jaxrunner.models.config import ModelConfig


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "prompt_lens", "lengths", "prompt_index", "sampled_logprobs"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Rollouts:
    """Every sample of every prompt, one row each, right-padded with 0 to a common length (a pytree:
    it passes into jitted losses as it is)."""

    tokens: jax.Array        # [B, L] int32: prompt then completion
    prompt_lens: jax.Array   # [B] int32
    lengths: jax.Array       # [B] int32: prompt + completion
    prompt_index: jax.Array  # [B] int32: which output (prompt) each row came from
    # [B, L] float32: each completion token's logprob when it was sampled (the behaviour policy's,
    # for importance ratios), 0 elsewhere; None unless the outputs carry logprobs (logprobs=0)
    sampled_logprobs: jax.Array | None = None

    @property
    def completion_mask(self) -> jax.Array:
        """[B, L] bool: the completion's tokens."""
        positions = jnp.arange(self.tokens.shape[1])[None, :]
        return (positions >= self.prompt_lens[:, None]) & (positions < self.lengths[:, None])


def pad_rollouts(outputs, length: int | None = None) -> Rollouts:
    """``RequestOutput``s (each with its n completions) as one padded batch on the device.
    ``length``: pad to this many tokens (a fixed shape compiles the loss once); default the longest."""
    rows, prompt_lens, prompt_index, sampled = [], [], [], []
    for index, output in enumerate(outputs):
        for completion in output.outputs:
            rows.append(list(output.prompt_token_ids) + list(completion.token_ids))
            prompt_lens.append(len(output.prompt_token_ids))
            prompt_index.append(index)
            sampled.append(None if completion.logprobs is None else
                           [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)])
    longest = max(len(row) for row in rows)
    length = longest if length is None else length
    if longest > length:
        raise ValueError(f"length={length}: a rollout has {longest} tokens")
    tokens = np.zeros((len(rows), length), np.int32)
    logprobs = np.zeros((len(rows), length), np.float32)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
        if sampled[i] is not None:
            logprobs[i, prompt_lens[i]:len(row)] = sampled[i]
    has_logprobs = all(values is not None for values in sampled)
    return Rollouts(jnp.asarray(tokens), jnp.asarray(prompt_lens, jnp.int32),
                    jnp.asarray([len(row) for row in rows], jnp.int32), jnp.asarray(prompt_index, jnp.int32),
                    jnp.asarray(logprobs) if has_logprobs else None)


def sequence_logprobs(params, config: ModelConfig, tokens: jax.Array, adapter=None) -> jax.Array:
    """[B, L] float32: log p(tokens[b, t] | tokens[b, :t]) under ``params`` (with a LoRA
    ``adapter`` in one slot's layout, ``models.lora.new_adapter``, when given); 0 at t = 0.

    The rows run as one packed batch through the model's forward with dense causal attention
    within each row (no KV cache), so it is differentiable in ``params``. Padding at the end of a
    row only attends to its own row: mask it out of any sum."""
    batch, length = tokens.shape
    flat = tokens.reshape(-1)
    positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), batch)
    segments = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), length)
    architecture = registry.architecture_for(config)
    if adapter is not None:
        params = lora.with_adapter(params, adapter, flat.shape[0], config.num_kv_heads)
    hidden, _ = architecture.forward(params, flat, positions, [None] * config.num_layers, segments, DenseAttention())
    logits = architecture.compute_logits(params, hidden).reshape(batch, length, -1)
    logprobs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    taken = jnp.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(taken, ((0, 0), (1, 0)))


def completion_logprob_sums(params, config: ModelConfig, rollouts: Rollouts, adapter=None) -> jax.Array:
    """[B]: each completion's total log-probability under ``params`` (and ``adapter``: see
    ``sequence_logprobs``): the policy-gradient term."""
    per_token = sequence_logprobs(params, config, rollouts.tokens, adapter)
    return jnp.sum(jnp.where(rollouts.completion_mask, per_token, 0.0), axis=-1)
