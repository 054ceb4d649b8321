"""Qwen3 (dense): Llama's shape with an RMSNorm over each query and key head before RoPE.

Params: Llama's leaves plus ``q_norm`` and ``k_norm`` [head_dim] per layer (replicated under tensor
parallelism: every shard normalizes its own heads with the same weights).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrunner import kernels
from jaxrunner.models import blocks, llama, registry
from jaxrunner.models.config import ModelConfig, UnsupportedModelError, check_activation, common_fields, rope_scaling
from jaxrunner.models.params import build_decoder_params, take
from jaxrunner.parallel import sharding


def config_from_hf(cfg: dict, source: str = "config.json") -> ModelConfig:
    check_activation(cfg, source, ("silu",))
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError(f"{source}: use_sliding_window=True is not supported for qwen3 "
                                    "(Qwen3 checkpoints ship it off)")
    if cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{source}: attention_bias=True is not supported for qwen3")
    return ModelConfig(**common_fields(cfg, source), rope_scaling=rope_scaling(cfg, source))


def _layer(layer, x, cos, sin, layer_cache, meta, cfg: ModelConfig, attention, rows, matmuls):
    h = llama.rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
    qkv = blocks.norm_qk(blocks.project_qkv(layer, h, cfg, matmuls), layer["q_norm"], layer["k_norm"],
                         cfg.rms_norm_eps)
    out, layer_cache = blocks.attend(blocks.rotate_qk(qkv, cos, sin), layer_cache, meta, cfg, attention,
                                     sm_scale=cfg.head_dim ** -0.5, sliding_window=None)
    x, out = blocks.take_rows(rows, x, out)
    x = x + llama.linear(out.astype(x.dtype), layer["wo"], matmuls)
    h = llama.rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
    return x + blocks.gated_mlp(layer, h, cfg, jax.nn.silu, matmuls), layer_cache


def forward(params, cfg: ModelConfig, token_ids, positions, kv_cache, meta, attention, rows=None, *,
            matmuls: kernels.MatmulKernels = kernels.XLA_MATMULS):
    x = jnp.take(params["embed"], token_ids, axis=0)
    cos, sin = blocks.rope_tables(cfg, positions)
    new_cache, last = [], len(params["layers"]) - 1
    for i, (layer, layer_cache) in enumerate(zip(params["layers"], kv_cache)):
        x, layer_cache = _layer(layer, x, cos, sin, layer_cache, meta, cfg, attention, rows if i == last else None,
                                matmuls)
        new_cache.append(layer_cache)
    return llama.rms_norm(x, params["final_norm"], cfg.rms_norm_eps), new_cache


@dataclasses.dataclass(frozen=True)
class Qwen3Architecture:
    cfg: ModelConfig
    matmuls: kernels.MatmulKernels = kernels.XLA_MATMULS

    def forward(self, params, token_ids, positions, kv_cache, meta, attention, rows=None):
        return forward(params, self.cfg, token_ids, positions, kv_cache, meta, attention, rows, matmuls=self.matmuls)

    def compute_logits(self, params, hidden):
        return llama.compute_logits(params, self.cfg, hidden, matmuls=self.matmuls)


def _layer_params(state, cfg: ModelConfig, i: int, source: str) -> dict:
    p = f"model.layers.{i}."
    layer = llama._layer_params(state, cfg, i, source)
    layer["q_norm"] = take(state, p + "self_attn.q_norm.weight", (cfg.head_dim,), source)
    layer["k_norm"] = take(state, p + "self_attn.k_norm.weight", (cfg.head_dim,), source)
    return layer


def build_params(state, cfg: ModelConfig, place, source: str = "checkpoint", progress: bool = False) -> dict:
    return build_decoder_params(state, cfg, place, source, progress, _layer_params)


def param_shapes(cfg: ModelConfig) -> dict:
    shapes = llama.param_shapes(cfg)
    for layer in shapes["layers"]:
        layer.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
    return shapes


def partition_rules(cfg: ModelConfig, tp: int) -> dict:
    return {**llama.partition_rules(cfg, tp), "q_norm": sharding.REPLICATED, "k_norm": sharding.REPLICATED}


FAMILY = registry.register(registry.ModelFamily(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    config_from_hf=config_from_hf,
    architecture=Qwen3Architecture,
    build_params=build_params,
    param_shapes=param_shapes,
    partition_rules=partition_rules,
    quantized_leaves=llama.QUANTIZED_LEAVES,
    kv_grouped_leaves=llama.KV_GROUPED_LEAVES,
))
