"""Phi-3 (and Phi-4-mini, which shares its architecture): Llama's layer with q/k/v fused into one
``qkv_proj`` ([q; k; v] rows) and gate/up into one ``gate_up_proj`` ([gate; up] rows) in the
checkpoint, and RoPE over the first ``partial_rotary_factor * head_dim`` dims of each head.

The fused checkpoint tensors are split and re-fused into jaxrunner's own layouts (``wqkv`` grouped
by KV head, ``w_gate_up`` interleaved: ``models.params``), so tensor parallelism and int8 work as
for Llama.

Long-RoPE (``rope_scaling`` ``longrope`` / ``su``) is served up to
``original_max_position_embeddings`` tokens (the served ``max_position_embeddings``, so a longer
``max_model_len`` is refused at start-up): there transformers rotates with the ``short_factor``
frequencies and scales cos/sin by the attention factor, and so does this forward. Beyond it
transformers switches every position of a forward to the ``long_factor`` frequencies once the
*sequence* passes that length, which a paged engine that prefills in chunks and keeps earlier keys
in its cache cannot reproduce token for token.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jaxrunner.models import layers, llama, registry
from jaxrunner.models.config import ModelConfig, UnsupportedModelError, check_activation, common_fields
from jaxrunner.models.decoder import Decoder
from jaxrunner.models.params import build_decoder_params, group_qkv, take


@dataclasses.dataclass(frozen=True)
class Phi3Config(ModelConfig):
    rotary_dim: int = 0  # dims of each head that RoPE rotates (the rest pass through)
    rope_short_factor: tuple[float, ...] | None = None  # long-RoPE: each frequency divided by its factor
    rope_attention_factor: float = 1.0                  # long-RoPE: cos and sin scaled by it


def _rope_params(cfg: dict) -> dict:
    return cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}


def _partial_rotary_factor(cfg: dict) -> float:
    return float(cfg.get("partial_rotary_factor") or _rope_params(cfg).get("partial_rotary_factor") or 1.0)


def _long_rope_fields(cfg: dict, fields: dict, rotary: int, source: str) -> dict:
    """Long-RoPE as transformers computes it below ``original_max_position_embeddings``, which
    becomes the served limit."""
    params = _rope_params(cfg)
    original = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    short = params.get("short_factor")
    if not original or short is None or len(short) != rotary // 2:
        raise UnsupportedModelError(f"{source}: long-RoPE needs original_max_position_embeddings and "
                                    f"{rotary // 2} short_factor values; got {original!r} and {short!r}")
    factor = params.get("factor") or fields["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dict(max_position_embeddings=min(int(original), fields["max_position_embeddings"]),
                rope_short_factor=tuple(float(f) for f in short), rope_attention_factor=float(attention))


def config_from_hf(cfg: dict, source: str = "config.json") -> Phi3Config:
    check_activation(cfg, source, ("silu",))
    if cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{source}: attention_bias=True is not supported for phi3")
    fields = common_fields(cfg, source, default_eps=1e-5)
    rotary = int(fields["head_dim"] * _partial_rotary_factor(cfg))
    if rotary <= 0 or rotary % 2 or rotary > fields["head_dim"]:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor gives {rotary} rotary dims of "
                                    f"head_dim {fields['head_dim']}; expected an even number in (0, head_dim]")
    kind = _rope_params(cfg).get("rope_type", _rope_params(cfg).get("type"))
    if kind in ("longrope", "su"):
        fields.update(_long_rope_fields(cfg, fields, rotary, source))
    elif kind not in (None, "default"):
        raise UnsupportedModelError(f"{source}: rope_scaling type {kind!r} is not supported for phi3 "
                                    "(supported: default, longrope, su)")
    window = cfg.get("sliding_window")
    return Phi3Config(**fields, sliding_window=int(window) if window else None, rotary_dim=rotary)


def rope_tables(cfg: Phi3Config, positions):
    """cos and sin [T, rotary_dim]; with long-RoPE, the short factors and the attention factor."""
    if cfg.rope_short_factor is None:
        return layers.rope_tables(cfg, positions, rotary_dim=cfg.rotary_dim)
    exponents = np.arange(0, cfg.rotary_dim, 2).astype(np.float32) / np.float32(cfg.rotary_dim)
    inv_freq = np.float32(1.0) / (np.asarray(cfg.rope_short_factor, np.float32)
                                  * np.power(np.float32(cfg.rope_theta), exponents))
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq.astype(np.float32))[None, :]
    cos, sin = jnp.cos(angles) * cfg.rope_attention_factor, jnp.sin(angles) * cfg.rope_attention_factor
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


@dataclasses.dataclass(frozen=True)
class Phi3Decoder(Decoder):
    """Llama's layer over partial (and long) RoPE tables."""

    def context(self, positions, meta, num_rows: int) -> dict:
        return {"rope": rope_tables(self.cfg, positions)}


def layer_params(state, cfg: Phi3Config, i: int, source: str) -> dict:
    d, inter, p = cfg.hidden_size, cfg.intermediate_size, f"model.layers.{i}."
    qkv = take(state, p + "self_attn.qkv_proj.weight", (cfg.q_size + 2 * cfg.kv_size, d), source)
    q, k, v = np.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size])
    gate, up = np.split(take(state, p + "mlp.gate_up_proj.weight", (2 * inter, d), source), 2)
    return {"attn_norm": take(state, p + "input_layernorm.weight", (d,), source),
            "wqkv": group_qkv(q, k, v, cfg).T,
            "wo": take(state, p + "self_attn.o_proj.weight", (d, cfg.q_size), source).T,
            "mlp_norm": take(state, p + "post_attention_layernorm.weight", (d,), source),
            "w_gate_up": np.stack([gate, up], axis=1).reshape(2 * inter, d).T,
            "w_down": take(state, p + "mlp.down_proj.weight", (d, inter), source).T}


def build_params(state, cfg: Phi3Config, place, source: str = "checkpoint", progress: bool = False) -> dict:
    return build_decoder_params(state, cfg, place, source, progress, layer_params)


FAMILY = registry.register(registry.ModelFamily(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    config_from_hf=config_from_hf,
    architecture=Phi3Decoder,
    build_params=build_params,
    param_shapes=llama.param_shapes,
    partition_rules=llama.partition_rules,
    quantized_leaves=llama.QUANTIZED_LEAVES,
    kv_grouped_leaves=llama.KV_GROUPED_LEAVES,
))
