"""HF-named state dict (torch layout) -> jaxrunner's params pytree.

Weights are stored ``[in, out]`` so the forward is ``x @ w``. Q/K/V and gate/up are fused into one
matrix each at load time: fewer, larger matmuls cost less per-op overhead on XLA:CPU and feed the
matrix units better on accelerators.

The fused columns are laid out so that any tensor-parallel split of the output dimension is a
contiguous slice that a shard can use on its own (see ``jaxrunner.parallel``):

- ``wqkv``: grouped by KV head — for each KV head ``g``: its ``G`` query heads, then ``k_g``, then
  ``v_g`` (``[d, Hkv, G + 2, head_dim]`` flattened). A split into ``tp`` pieces hands each shard
  whole groups whenever ``tp`` divides ``Hkv``.
- ``w_gate_up``: gate and up interleaved column by column (``[d, inter, 2]`` flattened).

One layout for every degree of parallelism, so a checkpoint restores straight into any sharding.
"""
from __future__ import annotations

import os
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
        "wqkv": group_qkv(q, k, v, cfg).T,
        "wo": _take(state, p + "self_attn.o_proj.weight", (d, cfg.q_size), source).T,
        "mlp_norm": _take(state, p + "post_attention_layernorm.weight", (d,), source),
        "w_gate_up": np.stack([gate, up], axis=1).reshape(2 * inter, d).T,
        "w_down": _take(state, p + "mlp.down_proj.weight", (d, inter), source).T,
    }
    if cfg.attention_bias:
        layer["bqkv"] = group_qkv(
            _take(state, p + "self_attn.q_proj.bias", (cfg.q_size,), source),
            _take(state, p + "self_attn.k_proj.bias", (cfg.kv_size,), source),
            _take(state, p + "self_attn.v_proj.bias", (cfg.kv_size,), source), cfg)
    return layer


def group_qkv(q: np.ndarray, k: np.ndarray, v: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Stack q/k/v rows (torch ``[out, ...]`` layout) by KV head: ``[Hkv * (G + 2) * head_dim, ...]``."""
    kv_heads, dim = cfg.num_kv_heads, cfg.head_dim
    group = cfg.num_heads // kv_heads
    rest = q.shape[1:]
    parts = [q.reshape(kv_heads, group, dim, *rest), k.reshape(kv_heads, 1, dim, *rest),
             v.reshape(kv_heads, 1, dim, *rest)]
    return np.concatenate(parts, axis=1).reshape(-1, *rest)


def host_params_from_state_dict(state: Mapping[str, np.ndarray], cfg: ModelConfig,
                                source: str = "checkpoint") -> dict:
    """The params pytree as float32 host (numpy) arrays, from an HF-named state dict."""
    return _params_tree(state, cfg, source, lambda tree: tree)


def params_from_state_dict(state: Mapping[str, np.ndarray], cfg: ModelConfig, dtype="float32",
                           source: str = "checkpoint", shardings_of=None, progress: bool = False) -> dict:
    """Build the params pytree (device arrays of ``dtype``) from an HF-named state dict.

    One piece (the embedding, a layer, ...) is built on the host and placed before the next is
    read, so host memory holds one layer's float32 copy, not the model's; with a lazy ``state``
    (a GGUF's :class:`~jaxrunner.models.loading.gguf.DequantizedTensors`) nothing else is resident.
    ``shardings_of(piece)``: the piece's shardings (see :func:`cast_params`); None: default device.
    """
    return _params_tree(state, cfg, source,
                        lambda piece: cast_params(piece, dtype, None if shardings_of is None else shardings_of(piece)),
                        progress)


def _params_tree(state, cfg: ModelConfig, source: str, finish, progress: bool = False) -> dict:
    """The params pytree, each piece passed through ``finish`` as soon as it is built (top-level
    leaves inside their one-key dict, so that ``finish`` sees their names)."""
    from tqdm.auto import tqdm

    d, vocab = cfg.hidden_size, cfg.vocab_size
    params = finish({"embed": _take(state, "model.embed_tokens.weight", (vocab, d), source)})
    layers = tqdm(range(cfg.num_layers), desc=f"Loading {os.path.basename(source)}", unit="layer",
                  disable=not progress, leave=False)
    params["layers"] = [finish(_layer_params(state, cfg, i, source)) for i in layers]
    params.update(finish({"final_norm": _take(state, "model.norm.weight", (d,), source)}))
    if not cfg.tie_word_embeddings:
        params.update(finish({"lm_head": _take(state, "lm_head.weight", (vocab, d), source).T}))
    return params


def cast_params(params, dtype, shardings=None) -> dict:
    """Place every leaf as ``dtype`` (norm weights included, as HF does): on the default device, or
    by ``shardings`` (a pytree of ``jax.sharding.Sharding`` matching ``params``), in which case each
    device receives only its own slice of the host array."""
    dtype = jnp.dtype(dtype)
    if shardings is None:
        return jax.tree.map(lambda x: jnp.asarray(x, dtype=dtype), params)
    return jax.tree.map(lambda x, s: jax.device_put(np.asarray(x).astype(dtype, copy=False), s), params, shardings)


def params_nbytes(params) -> int:
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)))


def params_count(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
