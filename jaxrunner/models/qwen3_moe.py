"""Qwen3-MoE: Qwen3 attention (RMSNorm per head on q and k) and a sparse MoE MLP of
``num_experts`` experts of width ``moe_intermediate_size`` (top ``num_experts_per_tok``,
renormalized when ``norm_topk_prob``); registered with ``models.registry``.

Every layer must be sparse (the released models' default): ``decoder_sparse_step`` other than 1
or a non-empty ``mlp_only_layers`` would mix dense layers in, and is refused.
"""
from __future__ import annotations

from jaxrunner.models import moe_decoder, registry
from jaxrunner.models.config import UnsupportedModelError, check_activation, common_fields, rope_scaling
from jaxrunner.models.llama import attention_params
from jaxrunner.models.params import build_decoder_params, take


def _check_all_sparse(cfg: dict, source: str) -> None:
    step = cfg.get("decoder_sparse_step", 1)
    if step != 1:
        raise UnsupportedModelError(f"{source}: decoder_sparse_step={step} is not supported (only 1: every "
                                    "layer a mixture of experts)")
    if cfg.get("mlp_only_layers"):
        raise UnsupportedModelError(f"{source}: mlp_only_layers={cfg['mlp_only_layers']} is not supported (only []: "
                                    "every layer a mixture of experts)")


def config_from_hf(cfg: dict, source: str = "config.json") -> moe_decoder.MoEConfig:
    check_activation(cfg, source, ("silu",))
    _check_all_sparse(cfg, source)
    if cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{source}: attention_bias=True is not supported for qwen3_moe")
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError(f"{source}: use_sliding_window=True is not supported for qwen3_moe "
                                    "(Qwen3-MoE checkpoints ship it off)")
    try:
        experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
        fields = common_fields({**cfg, "intermediate_size": cfg["moe_intermediate_size"]}, source)
        top_k = int(cfg["num_experts_per_tok"])
    except KeyError as missing:
        raise UnsupportedModelError(f"{source}: missing required field {missing}") from None
    config = moe_decoder.MoEConfig(**fields, rope_scaling=rope_scaling(cfg, source), num_experts=experts,
                                   num_experts_per_tok=top_k, normalize_top_k=bool(cfg.get("norm_topk_prob", False)),
                                   qk_norm=True)
    moe_decoder.check_experts(config, source)
    return config


def _layer_params(state, cfg: moe_decoder.MoEConfig, i: int, source: str) -> dict:
    d, p = cfg.hidden_size, f"model.layers.{i}."
    moe_prefix = p + "mlp."
    if moe_prefix + "experts.gate_up_proj" in state:  # saved by transformers' own fused layout
        gate, up, down = moe_decoder.fused_experts(state, cfg, moe_prefix, source)
    else:
        gate, up, down = moe_decoder.stacked_experts(state, cfg, moe_prefix, ("gate_proj", "up_proj", "down_proj"),
                                                     source)
    return {"attn_norm": take(state, p + "input_layernorm.weight", (d,), source),
            **attention_params(state, cfg, p, source),
            "q_norm": take(state, p + "self_attn.q_norm.weight", (cfg.head_dim,), source),
            "k_norm": take(state, p + "self_attn.k_norm.weight", (cfg.head_dim,), source),
            "mlp_norm": take(state, p + "post_attention_layernorm.weight", (d,), source),
            "router": take(state, moe_prefix + "gate.weight", (cfg.num_experts, d), source).T,
            **moe_decoder.expert_params(gate, up, down)}


def build_params(state, cfg, place, source: str = "checkpoint", progress: bool = False) -> dict:
    return build_decoder_params(state, cfg, place, source, progress, _layer_params)


FAMILY = registry.register(registry.ModelFamily(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    config_from_hf=config_from_hf,
    architecture=moe_decoder.MoEDecoder,
    build_params=build_params,
    param_shapes=moe_decoder.param_shapes,
    partition_rules=moe_decoder.partition_rules,
    quantized_leaves=moe_decoder.QUANTIZED_LEAVES,
    kv_grouped_leaves=moe_decoder.KV_GROUPED_LEAVES,
))
