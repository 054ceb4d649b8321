"""Qwen3 (dense): Llama's shape with an RMSNorm over each query and key head before RoPE.

Params: Llama's leaves plus ``q_norm`` and ``k_norm`` [head_dim] per layer (replicated under tensor
parallelism: every shard normalizes its own heads with the same weights).
"""
from __future__ import annotations

import dataclasses

from jaxrunner.models import layers, llama, registry
from jaxrunner.models.config import ModelConfig, UnsupportedModelError, check_activation, common_fields, rope_scaling
from jaxrunner.models.decoder import Decoder
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


@dataclasses.dataclass(frozen=True)
class Qwen3Decoder(Decoder):
    """Llama's layer with a per-head RMSNorm over q and k before RoPE."""

    def qkv(self, layer, x):
        return layers.norm_qk(super().qkv(layer, x), layer["q_norm"], layer["k_norm"], self.cfg.rms_norm_eps)


def layer_params(state, cfg: ModelConfig, i: int, source: str) -> dict:
    p = f"model.layers.{i}."
    layer = llama.layer_params(state, cfg, i, source)
    layer["q_norm"] = take(state, p + "self_attn.q_norm.weight", (cfg.head_dim,), source)
    layer["k_norm"] = take(state, p + "self_attn.k_norm.weight", (cfg.head_dim,), source)
    return layer


def build_params(state, cfg: ModelConfig, place, source: str = "checkpoint", progress: bool = False) -> dict:
    return build_decoder_params(state, cfg, place, source, progress, layer_params)


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
    architecture=Qwen3Decoder,
    build_params=build_params,
    param_shapes=param_shapes,
    partition_rules=partition_rules,
    quantized_leaves=llama.QUANTIZED_LEAVES,
    kv_grouped_leaves=llama.KV_GROUPED_LEAVES,
))
