"""LoRA adapters in the forward: fixed-shape slots beside the base weights, one slot per token row.

Up to ``max_loras`` adapters live on the device at once. Each targeted projection of each layer
holds every slot's low-rank factors stacked side by side, rank padded to ``max_lora_rank``:

- ``a`` [in, S * P * R]: slot ``s``'s columns are ``s * P * R .. (s + 1) * P * R``;
- ``b`` [S * P * R, out]: the matching rows, the adapter's scaling (``alpha / r``) folded in.

``P`` is the number of HF projections fused into ours (3 for ``wqkv``: q, k, v; 2 for
``w_gate_up``; 1 for ``wo`` and ``w_down``). Each part's rows of ``b`` are non-zero only in its own
columns of the fused layout (``models.params``), so one product serves the fused weight, and
padded ranks and absent targets are zeros.

A step's rows each name a slot (``lora_slots`` [T], 1..S; 0: no adapter), so one batch mixes
adapters: ``x @ a`` gives every slot's [T, S * P * R] projections, a one-hot mask keeps each row's
own slot, and ``@ b`` finishes the delta. Loading an adapter writes its slot (:func:`write`,
compiled at warm-up), so nothing compiles while serving; the shapes never change.

The forward does not know about slots: :func:`attach` puts each layer's slot weights beside its
params, and :func:`bind` (in the jitted step) replaces each targeted weight with a
:class:`LoraWeight` carrying the step's row mask, which ``models.linear.linear_f32`` multiplies as
base plus delta. A decoder whose last layer runs on the sampled rows only narrows the mask with
:func:`take_rows`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.parallel.sharding import LORA_KEY

# Our fused projections and the HF projections each is made of, in column order.
PROJECTIONS = {"wqkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",),
               "w_gate_up": ("gate_proj", "up_proj"), "w_down": ("down_proj",)}
SLOTS_KEY = LORA_KEY  # a layer's slot weights, under its params when attached


@functools.partial(jax.tree_util.register_dataclass, data_fields=("base", "a", "b", "mask"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class LoraWeight:
    """A projection's base weight (float or quantized) with the slots' factors and the step's rows'
    one-hot slot mask [T, S]."""

    base: object
    a: jax.Array     # [in, S * P * R]
    b: jax.Array     # [S * P * R, out]
    mask: jax.Array  # [T, S] in the activations' dtype: row t uses slot s (none: all zeros)

    def delta(self, x: jax.Array) -> jax.Array:
        """The adapters' float32 contribution for ``x`` [T, in]."""
        slots = self.mask.shape[-1]
        xa = jax.lax.dot_general(x, self.a.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        rank = xa.shape[-1] // slots
        keep = jnp.repeat(self.mask.astype(jnp.float32), rank, axis=-1)
        xa = (xa * keep).astype(x.dtype)
        return jax.lax.dot_general(xa, self.b.astype(x.dtype), (((xa.ndim - 1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The adapter slots an engine keeps on the device."""

    max_loras: int  # slots (a step's rows name 1..max_loras; 0 is no adapter)
    max_rank: int   # every adapter's rank is padded to this

    def empty_slots(self, layer_shapes: list[dict], dtype) -> list[dict]:
        """Zero slots for layers of ``layer_shapes`` (``models.params.param_shapes(cfg)["layers"]``)."""
        return empty_slots(layer_shapes, self.max_loras, self.max_rank, dtype)


def targets(layer: dict) -> tuple[str, ...]:
    """The projections of ``layer`` (a params layer, or its shapes) that adapters may target."""
    return tuple(name for name in PROJECTIONS if name in layer)


def slot_shapes(layer_shapes: dict, max_loras: int, max_rank: int) -> dict:
    """``{projection: {"a": shape, "b": shape}}`` of one layer's slots, from its leaf shapes
    ([in, out] per projection)."""
    shapes = {}
    for name in targets(layer_shapes):
        fan_in, fan_out = layer_shapes[name]
        width = max_loras * len(PROJECTIONS[name]) * max_rank
        shapes[name] = {"a": (fan_in, width), "b": (width, fan_out)}
    return shapes


def empty_slots(layer_shapes: list[dict], max_loras: int, max_rank: int, dtype) -> list[dict]:
    """Zero slots for every layer (host arrays), for the runner to place."""
    return [{name: {part: np.zeros(shape, dtype) for part, shape in parts.items()}
             for name, parts in slot_shapes(shapes, max_loras, max_rank).items()} for shapes in layer_shapes]


def attach(params: dict, slots: list[dict]) -> dict:
    """``params`` with each layer's slot weights under :data:`SLOTS_KEY` (no copy: new dicts only)."""
    return {**params, "layers": [{**layer, SLOTS_KEY: slot} for layer, slot in zip(params["layers"], slots)]}


def bind(params: dict, lora_slots: jax.Array, max_loras: int, dtype) -> dict:
    """Attached ``params`` as the forward reads them: each targeted weight a :class:`LoraWeight`
    whose mask selects the slot of every token row (``lora_slots`` [T], 0 for none, up to
    ``max_loras``), in the activations' ``dtype``."""
    mask = (lora_slots[:, None] == jnp.arange(1, max_loras + 1)[None, :]).astype(dtype)
    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        for name, factors in layer.pop(SLOTS_KEY).items():
            layer[name] = LoraWeight(layer[name], factors["a"], factors["b"], mask)
        layers.append(layer)
    return {**params, "layers": layers}


def take_rows(layer: dict, rows: jax.Array) -> dict:
    """``layer`` for a product over ``rows`` of the step's token rows only (each LoRA mask narrowed)."""
    return {name: dataclasses.replace(w, mask=jnp.take(w.mask, rows, axis=0)) if isinstance(w, LoraWeight) else w
            for name, w in layer.items()}


def write(slots: list[dict], slot: jax.Array, adapter: list[dict]) -> list[dict]:
    """``slots`` with slot ``slot`` (1-based) holding ``adapter`` (per layer and projection, ``a``
    [in, P * R] and ``b`` [P * R, out], the slots' dtype)."""
    def put(factors, new):
        width = new["a"].shape[1]
        start = (slot - 1) * width
        return {"a": jax.lax.dynamic_update_slice(factors["a"], new["a"].astype(factors["a"].dtype), (0, start)),
                "b": jax.lax.dynamic_update_slice(factors["b"], new["b"].astype(factors["b"].dtype), (start, 0))}

    return [{name: put(factors, layer_adapter[name]) for name, factors in layer.items()}
            for layer, layer_adapter in zip(slots, adapter)]

