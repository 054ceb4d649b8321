"""Quantizing a loaded model: the formats of ``models/quant.py`` applied to a ``LoadedModel``'s
linear layers, taking a GGUF's own blocks where they are exact (``gguf_blocks.py``), and placed
again on the model's mesh. ``models/quant.py`` stays a leaf: the formats, no loading."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxrunner.models import registry
from jaxrunner.models.loading.gguf import open_gguf
from jaxrunner.models.params import group_qkv
from jaxrunner.models.quant import WEIGHT_FORMATS, check_params_quantizable, check_quantization, quantize_params
from jaxrunner.parallel import sharding



def quantize_model(model, quantization: str, group_size: int = 32):
    """A ``LoadedModel`` with its linear layers quantized (a new one; ``model`` is not changed).

    From a GGUF, the weight-only formats take the file's own ``Q4_0``/``Q4_1``/``Q4_K``/``Q8_0``
    blocks as they are (``loading/gguf_blocks.py``; int4 from the file keeps its group of 32,
    and a ``Q8_0`` tensor stays int8 group 32 under ``"int4"``); other tensors are quantized from
    float. A sharded model is placed again by ``parallel.sharding``."""
    check_quantization(quantization, group_size)
    check_params_quantizable(model.params, quantization, group_size)
    replace = {}
    if quantization != "w8a8" and model.source.kind == "gguf" and model.kv_head_replication == 1:
        replace = _gguf_leaves(model.source.path, model.config, quantization)
    family = registry.family_for_config(model.config)
    params = quantize_params(model.params, quantization, group_size, replace, family.quantized_leaves,
                             family.quantized_embedding)
    if model.mesh is not None and model.mesh.devices.size > 1:
        rules = registry.partition_rules(model.config)
        params = jax.device_put(params, sharding.param_shardings(params, model.mesh, rules))
    return dataclasses.replace(model, params=params)


def _gguf_leaves(path: str, cfg, quantization: str) -> dict:
    """{(layer, leaf name): weight-only leaf} for every fused leaf whose GGUF parts all have an
    exact packed form of one kind that ``quantization`` takes (int8 takes only int8 blocks)."""
    state = open_gguf(path).state_dict
    out = {}
    if cfg.tie_word_embeddings:
        embed = state.packed("model.embed_tokens.weight")
        if _same_kind([embed], quantization):
            out["embed"] = embed
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        parts = {"wqkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                 "wo": ["self_attn.o_proj"], "w_gate_up": ["mlp.gate_proj", "mlp.up_proj"],
                 "w_down": ["mlp.down_proj"]}
        for name, hf_names in parts.items():
            leaves = [state.packed(p + hf + ".weight") for hf in hf_names]
            if not _same_kind(leaves, quantization):
                continue
            if name == "wqkv":
                out[i, name] = {key: group_qkv(*(leaf[key] for leaf in leaves), cfg) for key in leaves[0]}
            elif name == "w_gate_up":  # rows interleaved gate, up (see models/params.py)
                out[i, name] = {key: np.stack([leaf[key] for leaf in leaves], axis=1).reshape(
                    -1, leaves[0][key].shape[1]) for key in leaves[0]}
            else:
                out[i, name] = leaves[0]
    return out


def _same_kind(leaves: list, quantization: str) -> bool:
    if any(leaf is None for leaf in leaves):
        return False
    kinds = {(leaf["packed"].dtype, leaf["scales"].shape[1], tuple(sorted(leaf))) for leaf in leaves}
    if len(kinds) != 1:
        return False
    return WEIGHT_FORMATS[quantization] == "int4" or leaves[0]["packed"].dtype == np.int8
