"""HF-named state dict (torch layout) -> jaxrunner's params pytree.

Weights are stored ``[in, out]`` so the forward is ``x @ w``. Q/K/V and gate/up are fused into one
matrix each at load time: fewer, larger matmuls cost less per-op overhead on XLA:CPU and feed the
matrix units better on accelerators.
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.models.config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint is missing tensors or holds tensors of the wrong shape."""


def _take(state: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...], source: str) -> np.ndarray:
    if name not in state:
        raise CheckpointError(f"{source}: tensor {name!r} is missing")
    array = np.asarray(state[name])
    if tuple(array.shape) != shape:
        raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(array.shape)}, expected {shape}")
    return array.astype(np.float32, copy=False)


def _layer_params(state, cfg: ModelConfig, i: int, source: str) -> dict[str, np.ndarray]:
    d, inter = cfg.hidden_size, cfg.intermediate_size
    p = f"model.layers.{i}."
    q = _take(state, p + "self_attn.q_proj.weight", (cfg.q_size, d), source)
    k = _take(state, p + "self_attn.k_proj.weight", (cfg.kv_size, d), source)
    v = _take(state, p + "self_attn.v_proj.weight", (cfg.kv_size, d), source)
    gate = _take(state, p + "mlp.gate_proj.weight", (inter, d), source)
    up = _take(state, p + "mlp.up_proj.weight", (inter, d), source)
    layer = {
        "attn_norm": _take(state, p + "input_layernorm.weight", (d,), source),
        "wqkv": np.concatenate([q, k, v], axis=0).T,
        "wo": _take(state, p + "self_attn.o_proj.weight", (d, cfg.q_size), source).T,
        "mlp_norm": _take(state, p + "post_attention_layernorm.weight", (d,), source),
        "w_gate_up": np.concatenate([gate, up], axis=0).T,
        "w_down": _take(state, p + "mlp.down_proj.weight", (d, inter), source).T,
    }
    if cfg.attention_bias:
        layer["bqkv"] = np.concatenate([
            _take(state, p + "self_attn.q_proj.bias", (cfg.q_size,), source),
            _take(state, p + "self_attn.k_proj.bias", (cfg.kv_size,), source),
            _take(state, p + "self_attn.v_proj.bias", (cfg.kv_size,), source),
        ])
    return layer


def params_from_state_dict(state: Mapping[str, np.ndarray], cfg: ModelConfig, dtype="float32",
                           source: str = "checkpoint") -> dict:
    """Build the params pytree (device arrays of ``dtype``) from an HF-named state dict."""
    d, vocab = cfg.hidden_size, cfg.vocab_size
    host = {
        "embed": _take(state, "model.embed_tokens.weight", (vocab, d), source),
        "layers": [_layer_params(state, cfg, i, source) for i in range(cfg.num_layers)],
        "final_norm": _take(state, "model.norm.weight", (d,), source),
    }
    if not cfg.tie_word_embeddings:
        host["lm_head"] = _take(state, "lm_head.weight", (vocab, d), source).T
    return cast_params(host, dtype)


def cast_params(params, dtype) -> dict:
    """Place every leaf on the default device as ``dtype`` (norm weights included, as HF does)."""
    dtype = jnp.dtype(dtype)
    return jax.tree.map(lambda x: jnp.asarray(x, dtype=dtype), params)


def params_nbytes(params) -> int:
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)))


def params_count(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
