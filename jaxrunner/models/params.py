"""HF-named state dict (torch layout) -> jaxrunner's params pytree: what every family shares.

Each family (``models.registry``) maps its own tensor names; the conventions below are common.

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
from tqdm.auto import tqdm

from jaxrunner.models.config import ModelConfig
from jaxrunner.models.registry import family_for_config


class CheckpointError(ValueError):
    """A checkpoint is missing tensors or holds tensors of the wrong shape."""


# Half-precision floats a checkpoint stores that stay as they are on the host: the families only
# regroup, stack and transpose a layer's tensors there, and the device casts them (``cast_params``),
# where widening is cheap; numpy widens bfloat16 element by element, and it doubles the bytes moved.
_KEPT_ON_HOST = (np.dtype(jnp.bfloat16), np.dtype(np.float16))


def take(state: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...], source: str) -> np.ndarray:
    """Tensor ``name`` of ``shape``: bfloat16 and float16 as stored, anything else as float32."""
    if name not in state:
        raise CheckpointError(f"{source}: tensor {name!r} is missing")
    array = np.asarray(state[name])
    if tuple(array.shape) != shape:
        raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(array.shape)}, expected {shape}")
    return array if array.dtype in _KEPT_ON_HOST else array.astype(np.float32, copy=False)


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
    return build_params(state, cfg, lambda piece: jax.tree.map(lambda x: x.astype(np.float32), piece), source)


def params_from_state_dict(state: Mapping[str, np.ndarray], cfg: ModelConfig, dtype="float32",
                           source: str = "checkpoint") -> dict:
    """The params pytree as device arrays of ``dtype`` on the default device, built a piece at a
    time (see :func:`build_params`)."""
    return build_params(state, cfg, lambda piece: cast_params(piece, dtype), source)


def build_params(state: Mapping[str, np.ndarray], cfg: ModelConfig, place, source: str = "checkpoint",
                 progress: bool = False) -> dict:
    """The params pytree of ``cfg``'s family, each piece (the embedding, a layer, ...) handed to
    ``place(piece)`` as soon as it is built on the host, before the next is read.

    With ``place`` putting pieces on devices, host memory holds one layer's copy (float32, or the
    checkpoint's bfloat16/float16: :func:`take`), not the model's; with a lazy ``state`` (a GGUF's
    ``DequantizedTensors``, safetensors' ``SafetensorsTensors``) nothing else is resident.
    Top-level leaves arrive inside their one-key dict (``{"embed": array}``), so that ``place``
    sees their names (sharding goes by name).
    """
    return family_for_config(cfg).build_params(state, cfg, place, source, progress)


def build_decoder_params(state: Mapping[str, np.ndarray], cfg: ModelConfig, place, source: str, progress: bool,
                         layer_params) -> dict:
    """The usual decoder tree: ``embed``, ``layers`` (``layer_params(state, cfg, i, source)`` each),
    ``final_norm`` and, unless tied, ``lm_head`` ([d, vocab]), from the usual HF names."""
    d, vocab = cfg.hidden_size, cfg.vocab_size
    params = place({"embed": take(state, "model.embed_tokens.weight", (vocab, d), source)})
    layers = tqdm(range(cfg.num_layers), desc=f"Loading {os.path.basename(source)}", unit="layer",
                  disable=not progress, leave=False)
    params["layers"] = [place(layer_params(state, cfg, i, source)) for i in layers]
    params.update(place({"final_norm": take(state, "model.norm.weight", (d,), source)}))
    if not cfg.tie_word_embeddings:
        params.update(place({"lm_head": take(state, "lm_head.weight", (vocab, d), source).T}))
    return params


def decoder_shapes(cfg: ModelConfig, layer: dict) -> dict:
    """The shapes of :func:`build_decoder_params`'s tree, given one layer's leaf shapes."""
    d, vocab = cfg.hidden_size, cfg.vocab_size
    shapes = {"embed": (vocab, d), "layers": [dict(layer) for _ in range(cfg.num_layers)], "final_norm": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, vocab)
    return shapes


def param_shapes(cfg: ModelConfig) -> dict:
    """The shape of every leaf of the params pytree that ``build_params`` makes for ``cfg``."""
    return family_for_config(cfg).param_shapes(cfg)


def cast_params(params, dtype, shardings=None) -> dict:
    """Place every leaf as ``dtype`` (norm weights included, as HF does): on the default device, or
    by ``shardings`` (a pytree of ``jax.sharding.Sharding`` matching ``params``), in which case each
    device receives only its own slice of the host array."""
    dtype = jnp.dtype(dtype)
    # narrowed by XLA on the devices: numpy's float32 -> bfloat16 cast is several times slower
    if shardings is None:
        return jax.tree.map(lambda x: jnp.asarray(x).astype(dtype), params)
    return jax.tree.map(lambda x, s: jax.device_put(np.asarray(x), s).astype(dtype), params, shardings)


def params_nbytes(params) -> int:
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)))


def params_count(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
