"""LoRA adapters in the forward: fixed-shape slots beside the base weights, one slot per token row.

Up to ``max_loras`` (S) adapters live on the device at once. Each targeted projection of each
layer holds every slot's low-rank factors stacked, rank padded to ``max_lora_rank`` (R):

- ``a`` [in, S * P * R]: slot ``s``'s columns are ``s * P * R .. (s + 1) * P * R``, part by part;
- ``b``: one [S * R, out_p] per part, slot ``s``'s rows ``s * R .. (s + 1) * R``, with the
  adapter's scaling (``alpha / r``) folded in.

``P`` is the number of HF projections fused into ours (3 for ``wqkv``: q, k, v; 2 for
``w_gate_up``: gate, up; 1 for ``wo`` and ``w_down``). The parts' deltas are placed into the fused
projection's layout (``models.params``: q/k/v grouped by KV head, gate and up interleaved) after
their products, so no zero block of a fused ``b`` is ever multiplied. Padded ranks and modules an
adapter does not target are zeros.

A step's rows each name a slot (``lora_slots`` [T], 1..S; 0: no adapter), so one batch mixes
adapters: ``x @ a`` gives every slot's projections, a one-hot mask keeps each row's own slot, and
``@ b`` per part finishes the delta. Loading an adapter writes its slot (:func:`write`, compiled
at warm-up), so nothing compiles while serving; the shapes never change.

The forward does not know about slots: :func:`attach` puts each layer's slot weights beside its
params, and :func:`bind` (in the jitted step) replaces each targeted weight with a
:class:`LoraWeight` carrying the step's row mask, which ``models.linear.linear_f32`` multiplies as
base plus delta (its products through the same kernels as the base's). A decoder whose last layer
runs on the sampled rows only narrows the mask with :func:`take_rows`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.models.config import ModelConfig
from jaxrunner.parallel.sharding import LORA_KEY

# Our fused projections and the HF projections each is made of, in column order.
PROJECTIONS = {"wqkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",),
               "w_gate_up": ("gate_proj", "up_proj"), "w_down": ("down_proj",)}
SLOTS_KEY = LORA_KEY  # a layer's slot weights, under its params when attached


def part_sizes(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """Output width of each HF projection fused into ``name``."""
    return {"wqkv": (cfg.q_size, cfg.kv_size, cfg.kv_size), "wo": (cfg.hidden_size,),
            "w_gate_up": (cfg.intermediate_size, cfg.intermediate_size), "w_down": (cfg.hidden_size,)}[name]


@functools.partial(jax.tree_util.register_dataclass, data_fields=("base", "a", "b", "mask", "active"),
                   meta_fields=("kv_heads",))
@dataclasses.dataclass(frozen=True)
class LoraWeight:
    """A projection's base weight (float or quantized) with the slots' factors and the step's rows'
    one-hot slot mask [T, S]."""

    base: object
    a: jax.Array     # [in, S * P * R]
    b: tuple         # per part [S * R, out_p]
    mask: jax.Array    # [T, S] in the activations' dtype: row t uses slot s (none: all zeros)
    active: jax.Array  # [] bool: some row of the step uses an adapter
    kv_heads: int      # q/k/v (3 parts) are grouped by this many KV heads

    def delta(self, x: jax.Array, matmul) -> jax.Array:
        """The adapters' float32 contribution [T, out] for ``x`` [T, in]; ``matmul(x, w)`` is the
        float32-accumulating product the base weight's uses. Skipped in a step with no adapter."""
        rows, slots, parts = x.shape[0], self.mask.shape[-1], len(self.b)

        def products(x):
            xa = matmul(x, self.a.astype(x.dtype)).reshape(rows, slots, parts, -1)
            xa = (xa * self.mask.astype(jnp.float32)[:, :, None, None]).astype(x.dtype)
            deltas = [matmul(xa[:, :, p].reshape(rows, -1), b.astype(x.dtype)) for p, b in enumerate(self.b)]
            return _fused(deltas, self.kv_heads)

        width = sum(b.shape[1] for b in self.b)
        return jax.lax.cond(self.active, products, lambda x: jnp.zeros((rows, width), jnp.float32), x)


def _fused(deltas: list, kv_heads: int) -> jax.Array:
    """The parts' deltas in the fused projection's column layout (``models.params``)."""
    rows = deltas[0].shape[0]
    if len(deltas) == 1:
        return deltas[0]
    if len(deltas) == 2:  # gate and up, interleaved column by column
        return jnp.stack(deltas, axis=-1).reshape(rows, -1)
    q, k, v = (d.reshape(rows, kv_heads, -1) for d in deltas)  # each KV head's queries, then k, then v
    return jnp.concatenate([q, k, v], axis=-1).reshape(rows, -1)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The adapter slots an engine keeps on the device."""

    max_loras: int  # slots (a step's rows name 1..max_loras; 0 is no adapter)
    max_rank: int   # every adapter's rank is padded to this

    def nbytes(self, cfg: ModelConfig, layer_shapes: list[dict], dtype) -> int:
        """What the slots of layers of ``layer_shapes`` hold, in bytes."""
        shapes = [part for layer in layer_shapes for parts in slot_shapes(cfg, layer, self.max_loras,
                                                                          self.max_rank).values()
                  for part in [parts["a"], *parts["b"]]]
        return sum(int(np.prod(shape)) for shape in shapes) * np.dtype(dtype).itemsize

    def empty_slots(self, cfg: ModelConfig, layer_shapes: list[dict], dtype) -> list[dict]:
        """Zero slots for layers of ``layer_shapes`` (``models.params.param_shapes(cfg)["layers"]``)."""
        return empty_slots(cfg, layer_shapes, self.max_loras, self.max_rank, dtype)


def targets(layer: dict) -> tuple[str, ...]:
    """The projections of ``layer`` (a params layer, or its shapes) that adapters may target."""
    return tuple(name for name in PROJECTIONS if name in layer)


def slot_shapes(cfg: ModelConfig, layer_shapes: dict, slots: int, rank: int) -> dict:
    """``{projection: {"a": shape, "b": [shape per part]}}`` of ``slots`` slots of one layer (one
    slot: an adapter's own factors), from its leaf shapes ([in, out] per projection)."""
    shapes = {}
    for name in targets(layer_shapes):
        sizes = part_sizes(name, cfg)
        shapes[name] = {"a": (layer_shapes[name][0], slots * len(sizes) * rank),
                        "b": [(slots * rank, size) for size in sizes]}
    return shapes


def empty_slots(cfg: ModelConfig, layer_shapes: list[dict], max_loras: int, max_rank: int, dtype) -> list[dict]:
    """Zero slots for every layer (host arrays), for the runner to place."""
    return [{name: {"a": np.zeros(parts["a"], dtype), "b": [np.zeros(shape, dtype) for shape in parts["b"]]}
             for name, parts in slot_shapes(cfg, shapes, max_loras, max_rank).items()} for shapes in layer_shapes]


def new_adapter(cfg: ModelConfig, layer_shapes: list[dict], rank: int, key: jax.Array, dtype=jnp.float32) -> list:
    """A fresh adapter of ``rank`` on every projection, in one slot's layout (what ``LLM.add_lora``
    and ``update_lora`` take, and what :func:`with_adapter` trains): ``a`` random (variance
    ``1 / in``), ``b`` zero, so it starts as the base model, as PEFT's initialisation does."""
    keys = iter(jax.random.split(key, len(layer_shapes) * len(PROJECTIONS)))
    adapter = []
    for shapes in layer_shapes:
        layer = {}
        for name, parts in slot_shapes(cfg, shapes, 1, rank).items():
            fan_in = parts["a"][0]
            layer[name] = {"a": (jax.random.normal(next(keys), parts["a"]) / np.sqrt(fan_in)).astype(dtype),
                           "b": [jnp.zeros(shape, dtype) for shape in parts["b"]]}
        adapter.append(layer)
    return adapter


def with_adapter(params: dict, adapter: list, num_rows: int, kv_heads: int) -> dict:
    """``params`` as the forward reads them with ``adapter`` (one slot's layout) on all of a
    step's ``num_rows`` rows: differentiable in both, for training an adapter in JAX."""
    return bind(attach(params, adapter), jnp.ones(num_rows, jnp.int32), 1, params["final_norm"].dtype, kv_heads)


def attach(params: dict, slots: list[dict]) -> dict:
    """``params`` with each layer's slot weights under :data:`SLOTS_KEY` (no copy: new dicts only)."""
    return {**params, "layers": [{**layer, SLOTS_KEY: slot} for layer, slot in zip(params["layers"], slots)]}


def bind(params: dict, lora_slots: jax.Array, max_loras: int, dtype, kv_heads: int) -> dict:
    """Attached ``params`` as the forward reads them: each targeted weight a :class:`LoraWeight`
    whose mask selects the slot of every token row (``lora_slots`` [T], 0 for none, up to
    ``max_loras``), in the activations' ``dtype``; ``kv_heads``: the served model's."""
    mask = (lora_slots[:, None] == jnp.arange(1, max_loras + 1)[None, :]).astype(dtype)
    active = jnp.any(lora_slots > 0)
    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        for name, factors in layer.pop(SLOTS_KEY).items():
            layer[name] = LoraWeight(layer[name], factors["a"], tuple(factors["b"]), mask, active, kv_heads)
        layers.append(layer)
    return {**params, "layers": layers}


def take_rows(layer: dict, rows: jax.Array) -> dict:
    """``layer`` for a product over ``rows`` of the step's token rows only (each LoRA mask narrowed)."""
    return {name: dataclasses.replace(w, mask=jnp.take(w.mask, rows, axis=0)) if isinstance(w, LoraWeight) else w
            for name, w in layer.items()}


def write(slots: list[dict], slot: jax.Array, adapter: list[dict]) -> list[dict]:
    """``slots`` with slot ``slot`` (1-based) holding ``adapter`` (per layer and projection, one
    slot's factors: :func:`slot_shapes` of one slot)."""
    def put(factors, new):
        def place(stack, part, axis):
            start = [0, 0]
            start[axis] = (slot - 1) * part.shape[axis]
            return jax.lax.dynamic_update_slice(stack, part.astype(stack.dtype), tuple(start))

        return {"a": place(factors["a"], new["a"], 1),
                "b": [place(stack, part, 0) for stack, part in zip(factors["b"], new["b"])]}

    return [{name: put(factors, layer_adapter[name]) for name, factors in layer.items()}
            for layer, layer_adapter in zip(slots, adapter)]

