"""How the params pytree and the KV page pool are laid out on a ``("data", "model")`` mesh.

Megatron-style tensor parallelism expressed as shardings, with XLA's SPMD partitioner adding the
collectives. Which leaf is split how is each family's own business: its ``partition_rules``
(``models.registry.partition_rules``) map every leaf name to a PartitionSpec, built from the specs
here; callers hand them in as ``rules_for``, a function of the number of shards (this package
imports nothing of the models):

- :data:`COLUMN` (output dim split over ``"model"``): fused q/k/v, gate/up. The fused layouts
  (``jaxrunner.models.params``) make each shard's slice whole KV-head groups and whole gate/up
  pairs, so q/k/v, attention and the MLP activation stay local to a shard.
- :data:`ROW` (input dim split): output and down projections; XLA all-reduces their partial sums.
- :func:`vocab_rules`: embeddings and the LM head along the vocabulary (when it divides evenly).
- the KV page pool along KV heads.

A leaf name the rules do not list is an error (:class:`PartitionRuleError`), never a silent
replication. On a mesh whose ``"model"`` axis has one device every leaf is whole on every device,
so no rules are consulted (that is how a Flax NNX module, whose leaves have no rules, is served).

When the model has fewer KV heads than shards, :func:`replicate_kv_heads` copies each KV head onto
``tp / num_kv_heads`` shards first (the pool then holds ``tp`` heads, and the report says so).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrunner.parallel.mesh import MODEL_AXIS, ModelShape, tensor_parallel_size

RulesFor = Callable[[int], Mapping[str, P]]  # shards -> leaf name -> PartitionSpec

COLUMN = P(None, MODEL_AXIS)      # [in, out] split by output columns
ROW = P(MODEL_AXIS, None)         # [in, out] split by input rows
SPLIT = P(MODEL_AXIS)             # a vector split along with a COLUMN weight's outputs (biases)
REPLICATED = P()
KV_POOL_SPEC = P(None, None, MODEL_AXIS, None)  # [pages, page_size, kv_heads, head_dim]


class PartitionRuleError(ValueError):
    """A params leaf that its family's partition rules do not name."""


def vocab_rules(cfg: ModelShape, tp: int) -> dict[str, P]:
    """``embed`` [vocab, d] and ``lm_head`` [d, vocab] split along the vocabulary when it divides."""
    if shards_vocab(cfg, tp):
        return {"embed": P(MODEL_AXIS, None), "lm_head": P(None, MODEL_AXIS)}
    return {"embed": REPLICATED, "lm_head": REPLICATED}


def _leaf_names(path) -> list[str]:
    return [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]


def _without_input_dim(spec: P) -> P:
    kept = (*spec[:-2], *spec[-1:]) if len(spec) >= 2 else ()
    return P(*kept) if any(axis is not None for axis in kept) else REPLICATED


# A quantized weight is a dict of parts; each part's spec derived from the float weight's [in, out]
# spec. A quantization format whose parts are not listed here cannot be sharded (an error).
def _weight_only_part(spec: P) -> P:
    """Weight-only parts are [out, in-derived]: the output dim takes the float weight's output
    axis; the packed input dim is never split (row-parallel weights stay whole on every shard)."""
    out_axis = spec[-1] if len(spec) >= 1 else None
    return P(out_axis, None) if out_axis is not None else REPLICATED


QUANTIZED_PART_SPECS = {
    "q": lambda spec: spec,               # w8a8: int8 [in, out], laid out as the float weight
    "scale": _without_input_dim,          # w8a8: one per output column, the input dim reduced
    "packed": _weight_only_part,          # int8/int4 weight-only (models/quant.py): [out, in] bytes
    "scales": _weight_only_part,          # [out, groups]
    "offsets": _weight_only_part,         # [out, groups]
}


# LoRA slot factors (models/lora.py), under a layer's "lora": "a" [in, slots] and "b" [slots, out] of a
# projection follow its sharding: a column-parallel projection splits b's output columns (a whole on
# every shard), a row-parallel one splits a's input rows (b whole; XLA all-reduces the partial sums).
LORA_KEY = "lora"
LORA_PART_SPECS = {"a": lambda spec: P(spec[0], None) if len(spec) >= 1 and spec[0] is not None else REPLICATED,
                   "b": lambda spec: P(None, spec[1]) if len(spec) >= 2 and spec[1] is not None else REPLICATED}


def leaf_spec(path, rules) -> P:
    """The PartitionSpec of one params leaf, from its key path and the family's ``rules`` (a
    quantized weight's parts by :data:`QUANTIZED_PART_SPECS`, LoRA factors by :data:`LORA_PART_SPECS`)."""
    names = _leaf_names(path)
    if len(names) >= 3 and names[-3] == LORA_KEY and names[-2] in rules and names[-1] in LORA_PART_SPECS:
        return LORA_PART_SPECS[names[-1]](rules[names[-2]])
    name, part = (names[-1] if names else ""), None
    if len(names) >= 2 and names[-2] in rules and names[-1] not in rules:
        name, part = names[-2], names[-1]
    if name not in rules:
        raise PartitionRuleError(f"params leaf {'/'.join(names) or '<root>'}: no partition rule for {name!r} "
                                 f"(rules name: {', '.join(sorted(rules))})")
    if part is None:
        return rules[name]
    if part not in QUANTIZED_PART_SPECS:
        raise PartitionRuleError(f"params leaf {'/'.join(names)}: no partition rule for the quantized part "
                                 f"{part!r} (known parts: {', '.join(QUANTIZED_PART_SPECS)})")
    return QUANTIZED_PART_SPECS[part](rules[name])


def shards_vocab(cfg: ModelShape, tp: int) -> bool:
    return cfg.vocab_size % tp == 0


def no_rules(tp: int) -> dict[str, P]:
    """The ``rules_for`` of a model served whole on every device (one shard consults no rule)."""
    return {}


def param_shardings(params, mesh: Mesh, rules_for: RulesFor):
    """A pytree of NamedShardings matching ``params`` (float or quantized)."""
    for_path = sharding_for_path(mesh, rules_for)
    return jax.tree_util.tree_map_with_path(lambda path, _: for_path(path), params)


def sharding_for_path(mesh: Mesh, rules_for: RulesFor):
    """``path -> NamedSharding``, for restoring a checkpoint whose tree is known only to orbax."""
    tp = tensor_parallel_size(mesh)
    if tp == 1:
        return lambda path: NamedSharding(mesh, REPLICATED)
    rules = rules_for(tp)
    return lambda path: NamedSharding(mesh, leaf_spec(path, rules))


def kv_pool_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_POOL_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ----------------------------------------------------------------------------- KV-head replication
def kv_replication(cfg: ModelShape, tp: int) -> int:
    """How many shards each KV head is copied onto (1: heads are split, not copied)."""
    return tp // cfg.num_kv_heads if tp > cfg.num_kv_heads else 1


def served_config(cfg: ModelShape, tp: int) -> ModelShape:
    """The config as served by ``tp`` shards: ``tp`` KV heads when they had to be replicated."""
    r = kv_replication(cfg, tp)
    return cfg if r == 1 else dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * r)


def replicate_kv_heads_in_layer(layer: dict, cfg: ModelShape, tp: int, grouped: tuple[str, ...]) -> dict:
    """One layer's host params with every one of ``tp`` shards given its own KV head: the leaves
    named in ``grouped`` (the family's ``kv_grouped_leaves``, laid out by KV-head group,
    ``models.params.group_qkv``) are regrouped.

    Group ``g`` (its ``G`` query heads, ``k_g``, ``v_g``) becomes ``r = tp / Hkv`` groups, each with
    ``G / r`` of the query heads and a copy of ``k_g``, ``v_g``; query head order is unchanged.
    """
    r = kv_replication(cfg, tp)
    if r == 1:
        return layer
    kv_heads, dim = cfg.num_kv_heads, cfg.head_dim
    group = cfg.num_heads // kv_heads

    def regroup(w: np.ndarray) -> np.ndarray:  # [..., Hkv * (G + 2) * D] -> [..., tp * (G / r + 2) * D]
        lead = w.shape[:-1]
        w = np.asarray(w).reshape(*lead, kv_heads, group + 2, dim)
        q = w[..., :group, :].reshape(*lead, kv_heads, r, group // r, dim)
        kv = np.broadcast_to(w[..., None, group:, :], (*lead, kv_heads, r, 2, dim))
        return np.concatenate([q, kv], axis=-2).reshape(*lead, -1)

    return {name: regroup(value) if name in grouped else value for name, value in layer.items()}


def replicate_kv_heads(host_params: dict, cfg: ModelShape, tp: int,
                       grouped: tuple[str, ...]) -> tuple[dict, ModelShape]:
    """:func:`replicate_kv_heads_in_layer` over a whole host params tree; also the served config."""
    layers = [replicate_kv_heads_in_layer(layer, cfg, tp, grouped) for layer in host_params["layers"]]
    return {**host_params, "layers": layers}, served_config(cfg, tp)


# ----------------------------------------------------------------------------- accounting
def bytes_per_device(tree) -> dict[str, int]:
    """Bytes each device holds of ``tree``'s arrays (only this process's devices)."""
    totals: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        for shard in leaf.addressable_shards:
            key = str(shard.device)
            totals[key] = totals.get(key, 0) + shard.data.nbytes
    return totals
