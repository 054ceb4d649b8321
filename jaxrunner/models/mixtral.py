"""Mixtral: Llama attention and a sparse MoE MLP (``num_local_experts``, top ``num_experts_per_tok``,
the chosen probabilities renormalized); registered with ``models.registry``."""
from __future__ import annotations

from jaxrunner.models import moe_decoder, registry
from jaxrunner.models.config import UnsupportedModelError, check_activation, common_fields, rope_scaling
from jaxrunner.models.llama import attention_params
from jaxrunner.models.params import build_decoder_params, take


def config_from_hf(cfg: dict, source: str = "config.json") -> moe_decoder.MoEConfig:
    check_activation(cfg, source, ("silu",))
    if cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{source}: attention_bias=True is not supported for mixtral")
    window = cfg.get("sliding_window")
    try:
        experts, top_k = int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"])
    except KeyError as missing:
        raise UnsupportedModelError(f"{source}: missing required field {missing}") from None
    config = moe_decoder.MoEConfig(**common_fields(cfg, source, default_eps=1e-5), sliding_window=int(window) if window else None,
                                   rope_scaling=rope_scaling(cfg, source), num_experts=experts,
                                   num_experts_per_tok=top_k, normalize_top_k=True)
    moe_decoder.check_experts(config, source)
    return config


def _layer_params(state, cfg: moe_decoder.MoEConfig, i: int, source: str) -> dict:
    d, p = cfg.hidden_size, f"model.layers.{i}."
    if p + "mlp.experts.gate_up_proj" in state:  # saved by transformers' own fused layout
        moe_prefix = p + "mlp."
        gate, up, down = moe_decoder.fused_experts(state, cfg, moe_prefix, source)
    else:
        moe_prefix = p + "block_sparse_moe."
        gate, up, down = moe_decoder.stacked_experts(state, cfg, moe_prefix, ("w1", "w3", "w2"), source)
    return {"attn_norm": take(state, p + "input_layernorm.weight", (d,), source),
            **attention_params(state, cfg, p, source),
            "mlp_norm": take(state, p + "post_attention_layernorm.weight", (d,), source),
            "router": take(state, moe_prefix + "gate.weight", (cfg.num_experts, d), source).T,
            **moe_decoder.expert_params(gate, up, down)}


def build_params(state, cfg, place, source: str = "checkpoint", progress: bool = False) -> dict:
    return build_decoder_params(state, cfg, place, source, progress, _layer_params)


FAMILY = registry.register(registry.ModelFamily(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    config_from_hf=config_from_hf,
    architecture=moe_decoder.MoEDecoder,
    build_params=build_params,
    param_shapes=moe_decoder.param_shapes,
    partition_rules=moe_decoder.partition_rules,
    quantized_leaves=moe_decoder.QUANTIZED_LEAVES,
    kv_grouped_leaves=moe_decoder.KV_GROUPED_LEAVES,
))
