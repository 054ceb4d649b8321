"""The decoder every registered family runs: embedding, the layer loop, the final norm, the logits.

A family subclasses :class:`Decoder` and replaces the parts it does differently (Llama's are the
defaults): ``embed``, ``norm``, the per-step ``context`` (RoPE tables, masks), a layer's static
``kind`` (its sliding window), the attention's scale and soft cap, and the two halves of a layer,
``attend`` (norm, q/k/v, RoPE, attention) and ``finish`` (output projection, MLP, residuals). The loop is written once, here:

* the last layer's ``finish`` runs on the sampled ``rows`` alone (a prefill chunk samples one row
  of hundreds); with ``all_rows`` (a traced bool, prompt logprobs) it runs on every row when that
  holds, and every row's final hidden state comes back too;
* every other layer is a nested ``jax.jit``, traced and lowered once per step shape and layer kind
  instead of once per layer (XLA inlines the calls, so the compiled step is the same unrolled
  program). Layers are unrolled in Python: on XLA:CPU a ``scan`` over layers measured several
  times slower per token.

The forward never knows how attention is done: it is handed an ``attention`` callable
``(q, k, v, layer_cache, meta, *, sm_scale, sliding_window) -> (out, layer_cache)`` (the dense
reference in tests, the paged kernels in the engine) and passes ``meta`` to it untouched.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrunner import kernels
from jaxrunner.models import layers, lora
from jaxrunner.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Decoder:
    """One family's model functions, bound to its config and to where its linear products run
    (``matmuls``: ``kernels.capabilities().matmuls``, chosen by the runner; XLA's dot by default)."""

    cfg: ModelConfig
    matmuls: kernels.MatmulKernels = kernels.XLA_MATMULS

    # ------------------------------------------------------------------ the parts (Llama's)
    def embed(self, params, token_ids) -> jax.Array:
        return layers.embedding_rows(params, token_ids)

    def norm(self, x, weight) -> jax.Array:
        return layers.rms_norm(x, weight, self.cfg.rms_norm_eps)

    def context(self, positions, meta, num_rows: int) -> dict:
        """Per-step arrays every layer reads (a pytree of arrays): RoPE tables by default."""
        return {"rope": layers.rope_tables(self.cfg, positions)}

    def kind(self, index: int):
        """What makes layer ``index`` differ from the others at trace time (hashable): its
        sliding window by default."""
        return self.cfg.sliding_window

    def rope(self, context: dict, kind) -> tuple[jax.Array, jax.Array]:
        return context["rope"]

    def qkv(self, layer, x) -> jax.Array:
        """The layer's grouped float32 q/k/v [T, Hkv, G + 2, D] before RoPE."""
        return layers.project_qkv(layer, self.norm(x, layer["attn_norm"]), self.cfg, self.matmuls)

    def attention_scale(self) -> float:
        return self.cfg.head_dim ** -0.5

    def attention_soft_cap(self) -> float | None:
        """``cap`` of the attention logits' ``cap * tanh(s / cap)``, or None for none."""
        return None

    def attend(self, layer, x, context: dict, kind, layer_cache, meta, attention):
        """The first half of a layer: returns the attention output [T, Hq * D] (before its output
        projection) and the layer's new cache."""
        q, k, v = layers.split_rotated(self.qkv(layer, x), *self.rope(context, kind), self.cfg.num_heads,
                                       self.matmuls)
        return layers.attend(q, k, v, layer_cache, meta, attention, sm_scale=self.attention_scale(),
                             sliding_window=kind, soft_cap=self.attention_soft_cap())

    def finish(self, layer, x, attended, context: dict, attention, rows=None, probe=None) -> jax.Array:
        """The second half: output projection and residual, then the MLP and its residual. ``x``
        and ``attended`` hold ``rows`` of the step's token rows (None: all of them); ``probe``
        (a list, outside ``jit``) collects what a family reports per layer."""
        x = x + layers.linear(attended.astype(x.dtype), layer["wo"], self.matmuls)
        h = self.norm(x, layer["mlp_norm"])
        return x + layers.gated_mlp(layer, h, self.cfg, jax.nn.silu, self.matmuls)

    def logits(self, params, hidden) -> jax.Array:
        return layers.output_logits(params, self.cfg, hidden, self.matmuls)

    # ------------------------------------------------------------------ the loop
    def forward(self, params, token_ids, positions, kv_cache, meta, attention, rows=None, all_rows=None, *,
                probe=None):
        """Run the decoder on packed tokens [T]; returns final hidden states and the new cache.

        ``kv_cache`` has one entry per layer (whatever the attention callable keeps there; ``None``
        for cache-free attention). ``rows`` [N]: return only these rows' hidden states ([N, D];
        default all [T, D]). ``all_rows`` (with ``rows``): a third result holds every row's final
        hidden state [T, D] when it holds (zeros when it does not). ``probe``: see ``finish``.
        """
        x = self.embed(params, token_ids)
        context = self.context(positions, meta, x.shape[0])
        last = len(params["layers"]) - 1
        new_cache, every_row = [], None
        for i, (layer, layer_cache) in enumerate(zip(params["layers"], kv_cache)):
            kind = self.kind(i)
            if i == last and rows is not None:
                attended, layer_cache = self.attend(layer, x, context, kind, layer_cache, meta, attention)
                x, every_row = self._finish_rows(layer, x, attended, context, attention, rows, all_rows, probe)
            elif probe is not None or not _hashable(self, attention):
                x, layer_cache = _layer(self, kind, layer, x, context, layer_cache, meta, attention, probe)
            else:
                x, layer_cache = _traced_once_layer(self, kind, layer, x, context, layer_cache, meta, attention)
            new_cache.append(layer_cache)
        hidden = self.norm(x, params["final_norm"])
        if all_rows is None or rows is None:
            return hidden, new_cache
        return hidden, new_cache, self.norm(every_row, params["final_norm"])

    def compute_logits(self, params, hidden) -> jax.Array:
        """Float32 logits [N, V] for the hidden rows that are sampled."""
        return self.logits(params, hidden)

    def _finish_rows(self, layer, x, attended, context, attention, rows, all_rows, probe):
        """The last layer's ``finish`` on the sampled ``rows`` only; with ``all_rows``, on every row
        when it holds, returning those hidden states too (zeros when it does not)."""
        def sampled_only(operands):
            x, attended = operands
            return self.finish(lora.take_rows(layer, rows), jnp.take(x, rows, axis=0),
                               jnp.take(attended, rows, axis=0), context, attention, rows, probe)

        if all_rows is None:
            return sampled_only((x, attended)), None

        def every_row(operands):
            full = self.finish(layer, *operands, context, attention)
            return jnp.take(full, rows, axis=0), full

        return jax.lax.cond(all_rows, every_row, lambda ops: (sampled_only(ops), jnp.zeros_like(ops[0])),
                            (x, attended))


def _layer(decoder: Decoder, kind, layer, x, context, layer_cache, meta, attention, probe=None):
    attended, layer_cache = decoder.attend(layer, x, context, kind, layer_cache, meta, attention)
    return decoder.finish(layer, x, attended, context, attention, probe=probe), layer_cache


_traced_once_layer = jax.jit(_layer, static_argnames=("decoder", "kind", "attention"))


def _hashable(*objects) -> bool:
    try:
        hash(objects)
        return True
    except TypeError:
        return False
