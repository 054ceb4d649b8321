"""How the params pytree and the KV page pool are laid out on a ``("data", "model")`` mesh.

Megatron-style tensor parallelism expressed as shardings, with XLA's SPMD partitioner adding the
collectives:

- column-parallel (output dim split over ``"model"``): ``wqkv`` (+ ``bqkv``), ``w_gate_up``. The
  fused layouts (``jaxrunner.models.params``) make each shard's slice whole KV-head groups and whole
  gate/up pairs, so q/k/v, attention and the MLP activation stay local to a shard.
- row-parallel (input dim split): ``wo``, ``w_down``; their outputs are partial sums that XLA
  all-reduces.
- embeddings and the LM head along the vocabulary (when it divides evenly; replicated otherwise).
- the KV page pool along KV heads; every other leaf is replicated.

When the model has fewer KV heads than shards, :func:`replicate_kv_heads` copies each KV head onto
``tp / num_kv_heads`` shards first (the pool then holds ``tp`` heads, and the report says so).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrunner.models.config import ModelConfig
from jaxrunner.parallel.mesh import MODEL_AXIS, tensor_parallel_size

COLUMN_PARALLEL = ("wqkv", "w_gate_up")
ROW_PARALLEL = ("wo", "w_down")
VOCAB_PARALLEL = {"embed": P(MODEL_AXIS, None), "lm_head": P(None, MODEL_AXIS)}
KV_POOL_SPEC = P(None, None, MODEL_AXIS, None)  # [pages, page_size, kv_heads, head_dim]


def _leaf_names(path) -> list[str]:
    return [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]


def leaf_spec(path, shard_vocab: bool) -> P:
    """The PartitionSpec of one params leaf, from its key path (w8a8 weights are {"q", "scale"}, weight-only ones
    {"packed", "scales", "offsets"})."""
    names = _leaf_names(path)
    name = names[-1] if names else ""
    part = None
    if name in ("q", "scale") and len(names) >= 2:
        name, part = names[-2], name
    if name in ("packed", "scales", "offsets") and len(names) >= 2:
        # weight-only leaves are [out, in] (models/quant.py): split the outputs of column-parallel
        # weights; row-parallel ones stay whole on every shard
        return P(MODEL_AXIS, None) if names[-2] in COLUMN_PARALLEL else P()
    if name in COLUMN_PARALLEL:
        return P(MODEL_AXIS) if part == "scale" else P(None, MODEL_AXIS)
    if name == "bqkv":
        return P(MODEL_AXIS)
    if name in ROW_PARALLEL:
        return P() if part == "scale" else P(MODEL_AXIS, None)
    if name in VOCAB_PARALLEL and shard_vocab:
        return VOCAB_PARALLEL[name]
    return P()


def shards_vocab(cfg: ModelConfig, tp: int) -> bool:
    return cfg.vocab_size % tp == 0


def param_shardings(params, mesh: Mesh, cfg: ModelConfig):
    """A pytree of NamedShardings matching ``params`` (float or int8)."""
    for_path = sharding_for_path(mesh, cfg)
    return jax.tree_util.tree_map_with_path(lambda path, _: for_path(path), params)


def sharding_for_path(mesh: Mesh, cfg: ModelConfig):
    """``path -> NamedSharding``, for restoring a checkpoint whose tree is known only to orbax."""
    vocab = shards_vocab(cfg, tensor_parallel_size(mesh))
    return lambda path: NamedSharding(mesh, leaf_spec(path, vocab))


def kv_pool_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_POOL_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ----------------------------------------------------------------------------- KV-head replication
def kv_replication(cfg: ModelConfig, tp: int) -> int:
    """How many shards each KV head is copied onto (1: heads are split, not copied)."""
    return tp // cfg.num_kv_heads if tp > cfg.num_kv_heads else 1


def served_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config as served by ``tp`` shards: ``tp`` KV heads when they had to be replicated."""
    r = kv_replication(cfg, tp)
    return cfg if r == 1 else dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * r)


def replicate_kv_heads_in_layer(layer: dict, cfg: ModelConfig, tp: int) -> dict:
    """One layer's host params with every one of ``tp`` shards given its own KV head.

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

    layer = dict(layer, wqkv=regroup(layer["wqkv"]))
    if "bqkv" in layer:
        layer["bqkv"] = regroup(layer["bqkv"])
    return layer


def replicate_kv_heads(host_params: dict, cfg: ModelConfig, tp: int) -> tuple[dict, ModelConfig]:
    """:func:`replicate_kv_heads_in_layer` over a whole host params tree; also the served config."""
    layers = [replicate_kv_heads_in_layer(layer, cfg, tp) for layer in host_params["layers"]]
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
