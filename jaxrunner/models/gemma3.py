"""Gemma 3 (text): Gemma 2's layer plus a ``1 + w`` RMSNorm over each query and key head, two RoPE
bases (sliding layers ``rope_local_base_freq``, unscaled; global layers ``rope_theta`` with the
checkpoint's scaling), and five sliding layers to one global (``layer_types`` or
``sliding_window_pattern``). The layer is ``gemma2.GemmaDecoder``'s: it sees the q/k norms in the
params and the local base in the config.
"""
from __future__ import annotations

from jaxrunner.models import gemma2, llama, registry
from jaxrunner.models.config import UnsupportedModelError, rope_scaling
from jaxrunner.models.params import build_decoder_params, take
from jaxrunner.parallel import sharding


def _local_rope_theta(cfg: dict) -> float:
    if "rope_local_base_freq" in cfg:
        return float(cfg["rope_local_base_freq"])
    local = (cfg.get("rope_parameters") or {}).get(gemma2.SLIDING) or {}
    return float(local.get("rope_theta", 10000.0))


def config_from_hf(cfg: dict, source: str = "config.json") -> gemma2.GemmaConfig:
    local = (cfg.get("rope_parameters") or {}).get(gemma2.SLIDING) or {}
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"{source}: rope_parameters.sliding_attention.rope_type {local['rope_type']!r} is not "
                         "supported (sliding layers use plain RoPE)")
    return gemma2.GemmaConfig(**gemma2.gemma_fields(cfg, source, default_pattern=6),
                              rope_scaling=rope_scaling(cfg, source), local_rope_theta=_local_rope_theta(cfg))


def layer_params(state, cfg, i: int, source: str) -> dict:
    p = f"model.layers.{i}.self_attn."
    return {**gemma2.layer_params(state, cfg, i, source),
            "q_norm": take(state, p + "q_norm.weight", (cfg.head_dim,), source),
            "k_norm": take(state, p + "k_norm.weight", (cfg.head_dim,), source)}


def build_params(state, cfg, place, source: str = "checkpoint", progress: bool = False) -> dict:
    return build_decoder_params(state, cfg, place, source, progress, layer_params)


def param_shapes(cfg) -> dict:
    shapes = gemma2.param_shapes(cfg)
    for layer in shapes["layers"]:
        layer.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
    return shapes


def partition_rules(cfg, tp: int) -> dict:
    return {**gemma2.partition_rules(cfg, tp), "q_norm": sharding.REPLICATED, "k_norm": sharding.REPLICATED}


FAMILY = registry.register(registry.ModelFamily(
    name="gemma3",
    architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    config_from_hf=config_from_hf,
    architecture=gemma2.GemmaDecoder,
    build_params=build_params,
    param_shapes=param_shapes,
    partition_rules=partition_rules,
    quantized_leaves=llama.QUANTIZED_LEAVES,
    kv_grouped_leaves=llama.KV_GROUPED_LEAVES,
))
