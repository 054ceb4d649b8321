"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2): config mapping, HF state dict -> params,
partition rules; registered with ``models.registry``. Its layer is the shared decoder's default
(``models.decoder``): pre-norm attention with RoPE, a SiLU-gated MLP.

Its parameter names are the other families' starting point: :func:`attention_params`,
:func:`mlp_params`, :func:`layer_params` and their shapes and rules are public for that.
"""
from __future__ import annotations

import numpy as np

from jaxrunner.models import registry
from jaxrunner.models.config import (ModelConfig, UnsupportedModelError, check_activation, common_fields,
                                     rope_scaling)
from jaxrunner.models.decoder import Decoder
from jaxrunner.models.params import build_decoder_params, decoder_shapes, group_qkv, take
from jaxrunner.parallel import sharding


# ----------------------------------------------------------------------------- config
def config_from_hf(cfg: dict, source: str = "config.json") -> ModelConfig:
    """Mistral is Llama with an optional sliding window; Qwen2 adds biases on the q/k/v projections."""
    check_activation(cfg, source, ("silu",))
    model_type = cfg.get("model_type")
    return ModelConfig(**common_fields(cfg, source), attention_bias=_attention_bias(model_type, cfg, source),
                       sliding_window=_sliding_window(model_type, cfg), rope_scaling=rope_scaling(cfg, source))


def _attention_bias(model_type: str, cfg: dict, source: str) -> bool:
    if model_type == "qwen2":
        return True  # Qwen2 always has q/k/v biases (and none on o_proj)
    if cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{source}: attention_bias=True is not supported for {model_type}")
    return False


def _sliding_window(model_type: str, cfg: dict) -> int | None:
    window = cfg.get("sliding_window")
    if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
        return None
    return int(window) if window else None


# ----------------------------------------------------------------------------- params
def attention_params(state, cfg: ModelConfig, prefix: str, source: str) -> dict[str, np.ndarray]:
    """``wqkv`` (grouped by KV head, see ``models.params``), ``wo`` and, with biases, ``bqkv``."""
    d, p = cfg.hidden_size, prefix + "self_attn."
    q = take(state, p + "q_proj.weight", (cfg.q_size, d), source)
    k = take(state, p + "k_proj.weight", (cfg.kv_size, d), source)
    v = take(state, p + "v_proj.weight", (cfg.kv_size, d), source)
    layer = {"wqkv": group_qkv(q, k, v, cfg).T, "wo": take(state, p + "o_proj.weight", (d, cfg.q_size), source).T}
    if cfg.attention_bias:
        layer["bqkv"] = group_qkv(take(state, p + "q_proj.bias", (cfg.q_size,), source),
                                  take(state, p + "k_proj.bias", (cfg.kv_size,), source),
                                  take(state, p + "v_proj.bias", (cfg.kv_size,), source), cfg)
    return layer


def mlp_params(state, cfg: ModelConfig, prefix: str, source: str) -> dict[str, np.ndarray]:
    """``w_gate_up`` (gate and up interleaved column by column) and ``w_down``."""
    d, inter, p = cfg.hidden_size, cfg.intermediate_size, prefix + "mlp."
    gate = take(state, p + "gate_proj.weight", (inter, d), source)
    up = take(state, p + "up_proj.weight", (inter, d), source)
    return {"w_gate_up": np.stack([gate, up], axis=1).reshape(2 * inter, d).T,
            "w_down": take(state, p + "down_proj.weight", (d, inter), source).T}


def layer_params(state, cfg: ModelConfig, i: int, source: str) -> dict[str, np.ndarray]:
    d, p = cfg.hidden_size, f"model.layers.{i}."
    return {"attn_norm": take(state, p + "input_layernorm.weight", (d,), source),
            **attention_params(state, cfg, p, source),
            "mlp_norm": take(state, p + "post_attention_layernorm.weight", (d,), source),
            **mlp_params(state, cfg, p, source)}


def build_params(state, cfg: ModelConfig, place, source: str = "checkpoint", progress: bool = False) -> dict:
    return build_decoder_params(state, cfg, place, source, progress, layer_params)


def attention_mlp_shapes(cfg: ModelConfig) -> dict:
    """Leaf shapes of :func:`attention_params` and :func:`mlp_params`."""
    d, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = cfg.q_size + 2 * cfg.kv_size
    shapes = {"wqkv": (d, qkv), "wo": (cfg.q_size, d), "w_gate_up": (d, 2 * inter), "w_down": (inter, d)}
    if cfg.attention_bias:
        shapes["bqkv"] = (qkv,)
    return shapes


def param_shapes(cfg: ModelConfig) -> dict:
    d = cfg.hidden_size
    return decoder_shapes(cfg, {"attn_norm": (d,), "mlp_norm": (d,), **attention_mlp_shapes(cfg)})


# ----------------------------------------------------------------------------- tensor parallelism
# Megatron-style: q/k/v and gate/up split by output columns (whole KV-head groups and whole gate/up
# pairs per shard, see models.params), o and down by input rows (XLA all-reduces their outputs).
ATTENTION_MLP_RULES = {"wqkv": sharding.COLUMN, "bqkv": sharding.SPLIT, "wo": sharding.ROW,
                       "w_gate_up": sharding.COLUMN, "w_down": sharding.ROW}
QUANTIZED_LEAVES = ("wqkv", "wo", "w_gate_up", "w_down")
KV_GROUPED_LEAVES = ("wqkv", "bqkv")


def partition_rules(cfg: ModelConfig, tp: int) -> dict:
    return {**sharding.vocab_rules(cfg, tp), **ATTENTION_MLP_RULES, "attn_norm": sharding.REPLICATED,
            "mlp_norm": sharding.REPLICATED, "final_norm": sharding.REPLICATED}


FAMILY = registry.register(registry.ModelFamily(
    name="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
    model_types=("llama", "mistral", "qwen2"),
    config_from_hf=config_from_hf,
    architecture=Decoder,  # Llama's parts are the decoder's defaults
    build_params=build_params,
    param_shapes=param_shapes,
    partition_rules=partition_rules,
    quantized_leaves=QUANTIZED_LEAVES,
    kv_grouped_leaves=KV_GROUPED_LEAVES,
    quantized_embedding=True,
))
