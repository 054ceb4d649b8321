"""Serve a user's Flax NNX module: the protocol it follows and the adapter the runner calls.

A module is servable when it has

* ``config``: a ``jaxrunner.models.config.ModelConfig`` — the engine sizes the KV cache, the
  buckets and the vocabulary checks from it (``num_layers``, ``num_kv_heads``, ``head_dim``,
  ``vocab_size``, ``max_position_embeddings``, ``eos_token_ids``);
* ``embed(token_ids [T]) -> [T, D]``;
* ``layers``: a sequence of ``config.num_layers`` layers, each called as
  ``layer(x [T, D], positions [T], attend) -> [T, D]``, where the layer calls
  ``attend(q [T, Hq, Dh], k [T, Hkv, Dh], v [T, Hkv, Dh]) -> [T, Hq, Dh]`` exactly once: the
  engine's paged attention (keys and values written into the layer's pages, then attended causally
  within each sequence; ``sm_scale`` and ``sliding_window`` may be passed as keywords);
* ``norm(x) -> x`` (the final norm) and ``logits(x [N, D]) -> [N, V]``.

The module's state (``nnx.split``) is the params pytree the engine serves: ``LLM.params`` returns
it and ``LLM.update_weights`` takes one like it. The forward runs inside the same jitted step as
the built-in models, with the same kernels, buckets and random warm-up. ``models/nnx_llama.py``
is a Llama written this way.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrunner.models.config import ModelConfig

PROTOCOL = ("config", "embed", "layers", "norm", "logits")


def check_protocol(module) -> ModelConfig:
    """The module's config, or ``ValueError`` naming what the module lacks."""
    missing = [name for name in PROTOCOL if not hasattr(module, name)]
    if missing:
        raise ValueError(f"module: {type(module).__name__} lacks {', '.join(missing)} (a servable Flax NNX module "
                         f"has {', '.join(PROTOCOL)}; see jaxrunner.models.flax_nnx)")
    if not isinstance(module.config, ModelConfig):
        raise ValueError(f"module.config: expected a jaxrunner ModelConfig, got {type(module.config).__name__}")
    if len(module.layers) != module.config.num_layers:
        raise ValueError(f"module.layers: {len(module.layers)} layers, but config.num_layers is "
                         f"{module.config.num_layers}")
    return module.config


class _Attend:
    """The ``attend`` a layer is handed: paged attention over that layer's cache entry."""

    def __init__(self, attention, layer_cache, meta, cfg: ModelConfig):
        self._attention, self._cache, self._meta, self._cfg = attention, layer_cache, meta, cfg
        self.calls = 0

    def __call__(self, q, k, v, *, sm_scale=None, sliding_window=None):
        self.calls += 1
        scale = self._cfg.head_dim ** -0.5 if sm_scale is None else sm_scale
        out, self._cache = self._attention(q, k, v, self._cache, self._meta, sm_scale=scale,
                                           sliding_window=sliding_window if sliding_window is not None
                                           else self._cfg.sliding_window)
        return out

    @property
    def cache(self):
        return self._cache


@dataclasses.dataclass(frozen=True)
class NnxArchitecture:
    """``forward`` and ``compute_logits`` over an NNX module's state (the runner's params)."""

    graphdef: object
    cfg: ModelConfig

    def _module(self, params):
        from flax import nnx  # lazy: flax is heavy, and only NNX modules need it

        return nnx.merge(self.graphdef, params)

    def forward(self, params, token_ids, positions, kv_cache, meta, attention, rows=None, all_rows=None):
        """As ``models.decoder.Decoder.forward``: ``meta`` (the step's ``AttentionMetadata``) reaches the
        paged attention through each layer's ``attend``; with ``all_rows`` (a traced bool, with
        ``rows``) a third result holds every row's final hidden state when it holds (zeros when not)."""
        module = self._module(params)
        x = module.embed(token_ids)
        new_cache = []
        for i, (layer, layer_cache) in enumerate(zip(module.layers, kv_cache)):
            attend = _Attend(attention, layer_cache, meta, self.cfg)
            x = layer(x, positions, attend)
            if attend.calls != 1:
                raise ValueError(f"module.layers[{i}]: called attend {attend.calls} times; a layer calls it once")
            new_cache.append(attend.cache)
        if rows is None:
            return module.norm(x), new_cache
        hidden = module.norm(jnp.take(x, rows, axis=0))
        if all_rows is None:
            return hidden, new_cache
        every_row = jax.lax.cond(all_rows, lambda y: module.norm(y).astype(y.dtype), jnp.zeros_like, x)
        return hidden, new_cache, every_row

    def compute_logits(self, params, hidden):
        return self._module(params).logits(hidden).astype(jnp.float32)


def split_module(module):
    """(architecture, params) of a servable module; ``ValueError`` when it is not one."""
    from flax import nnx  # lazy: flax is heavy, and only NNX modules need it

    cfg = check_protocol(module)
    graphdef, state = nnx.split(module)
    return NnxArchitecture(graphdef, cfg), state
