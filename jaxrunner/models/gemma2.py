"""Gemma 2: Llama's attention and gated MLP rearranged, with Gemma's quirks.

- RMSNorm scaled by ``1 + w`` (``layers.offset_rms_norm``), and four norms per layer: before and
  after attention, before and after the MLP (the "post" norms act on the block's output, before
  the residual add).
- the embedding scaled by ``sqrt(hidden_size)`` (rounded to the activations' dtype, as HF does).
- GeGLU: ``gelu_tanh(gate) * up``.
- attention scaled by ``query_pre_attn_scalar ** -0.5`` (not ``head_dim``), its logits soft-capped
  (``attn_logit_softcapping``), and the output logits soft-capped (``final_logit_softcapping``).
- sliding-window and global layers alternating (``layer_types``; even layers slide when absent).
  The window and the cap reach the kernels per layer through the attention callable.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxrunner.models import layers, llama, registry
from jaxrunner.models.config import ModelConfig, UnsupportedModelError, check_activation, common_fields, rope_scaling
from jaxrunner.models.decoder import Decoder
from jaxrunner.models.params import build_decoder_params, decoder_shapes, take
from jaxrunner.parallel import sharding

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class GemmaConfig(ModelConfig):
    """``sliding_window`` stays None (not every layer slides); ``layer_windows`` has each layer's."""

    query_pre_attn_scalar: float = 1.0
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None    # Gemma 3: sliding layers' RoPE base (no scaling there)

    def layer_sliding_window(self, layer: int) -> int | None:
        return self.layer_windows[layer]


def layer_types(cfg: dict, default_pattern: int, source: str) -> list[str]:
    """Each layer's attention kind: ``layer_types`` if given, else every ``pattern``-th layer global."""
    num_layers = int(cfg["num_hidden_layers"])
    kinds = cfg.get("layer_types")
    if kinds is None:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default_pattern)
        kinds = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if len(kinds) != num_layers or not set(kinds) <= {SLIDING, FULL}:
        raise UnsupportedModelError(f"{source}: layer_types must list {num_layers} entries of "
                                    f"{SLIDING!r} / {FULL!r}; got {kinds}")
    return list(kinds)


def gemma_fields(cfg: dict, source: str, default_pattern: int) -> dict:
    """The fields Gemma 2 and Gemma 3 read alike."""
    check_activation(cfg, source, ("gelu_pytorch_tanh",), key="hidden_activation")
    if cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{source}: attention_bias=True is not supported for {cfg.get('model_type')}")
    fields = common_fields(cfg, source)
    window = cfg.get("sliding_window")
    kinds = layer_types(cfg, default_pattern, source)
    if SLIDING in kinds and not window:
        raise UnsupportedModelError(f"{source}: sliding layers need a positive sliding_window, got {window!r}")
    return dict(fields, query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or fields["head_dim"]),
                attn_logit_softcap=_cap(cfg.get("attn_logit_softcapping")),
                final_logit_softcap=_cap(cfg.get("final_logit_softcapping")),
                layer_windows=tuple(int(window) if kind == SLIDING else None for kind in kinds))


def _cap(value) -> float | None:
    return float(value) if value else None


def config_from_hf(cfg: dict, source: str = "config.json") -> GemmaConfig:
    return GemmaConfig(**gemma_fields(cfg, source, default_pattern=2), rope_scaling=rope_scaling(cfg, source))


# ----------------------------------------------------------------------------- layer
@dataclasses.dataclass(frozen=True)
class GemmaDecoder(Decoder):
    """Gemma 2 and 3: the decoder with Gemma's norms, scales, caps and per-layer windows; sliding
    layers use ``local_rope_theta`` where the config has one (Gemma 3)."""

    def embed(self, params, token_ids):
        x = layers.embedding_rows(params, token_ids)
        return x * jnp.asarray(self.cfg.hidden_size ** 0.5, x.dtype)

    def norm(self, x, weight):
        return layers.offset_rms_norm(x, weight, self.cfg.rms_norm_eps)

    def context(self, positions, meta, num_rows: int) -> dict:
        rope = layers.rope_tables(self.cfg, positions)
        local = rope if self.cfg.local_rope_theta is None else layers.rope_tables(
            self.cfg, positions, theta=self.cfg.local_rope_theta, scaling=())
        return {"rope": rope, "local_rope": local}

    def kind(self, index: int):
        return self.cfg.layer_sliding_window(index)

    def rope(self, context: dict, kind):
        return context["rope"] if kind is None else context["local_rope"]

    def qkv(self, layer, x):
        qkv = super().qkv(layer, x)
        if "q_norm" in layer:  # Gemma 3
            qkv = layers.norm_qk(qkv, layer["q_norm"], layer["k_norm"], self.cfg.rms_norm_eps,
                                 norm=layers.offset_rms_norm)
        return qkv

    def attention_scale(self) -> float:
        return self.cfg.query_pre_attn_scalar ** -0.5

    def attention_soft_cap(self) -> float | None:
        return self.cfg.attn_logit_softcap

    def finish(self, layer, x, attended, context: dict, attention, rows=None, probe=None):
        x = x + self.norm(layers.linear(attended.astype(x.dtype), layer["wo"], self.matmuls), layer["post_attn_norm"])
        h = layers.gated_mlp(layer, self.norm(x, layer["mlp_norm"]), self.cfg, layers.gelu_tanh, self.matmuls)
        return x + self.norm(h, layer["post_mlp_norm"])

    def logits(self, params, hidden):
        return layers.soft_cap(super().logits(params, hidden), self.cfg.final_logit_softcap)


# ----------------------------------------------------------------------------- params
NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
         "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}


def layer_params(state, cfg: ModelConfig, i: int, source: str) -> dict:
    p = f"model.layers.{i}."
    norms = {leaf: take(state, p + hf + ".weight", (cfg.hidden_size,), source) for leaf, hf in NORMS.items()}
    return {**norms, **llama.attention_params(state, cfg, p, source), **llama.mlp_params(state, cfg, p, source)}


def build_params(state, cfg: ModelConfig, place, source: str = "checkpoint", progress: bool = False) -> dict:
    return build_decoder_params(state, cfg, place, source, progress, layer_params)


def param_shapes(cfg: ModelConfig) -> dict:
    return decoder_shapes(cfg, {**dict.fromkeys(NORMS, (cfg.hidden_size,)), **llama.attention_mlp_shapes(cfg)})


def partition_rules(cfg: ModelConfig, tp: int) -> dict:
    norms = dict.fromkeys([*NORMS, "final_norm"], sharding.REPLICATED)
    return {**sharding.vocab_rules(cfg, tp), **llama.ATTENTION_MLP_RULES, **norms}


FAMILY = registry.register(registry.ModelFamily(
    name="gemma2",
    architectures=("Gemma2ForCausalLM",),
    model_types=("gemma2",),
    config_from_hf=config_from_hf,
    architecture=GemmaDecoder,
    build_params=build_params,
    param_shapes=param_shapes,
    partition_rules=partition_rules,
    quantized_leaves=llama.QUANTIZED_LEAVES,
    kv_grouped_leaves=llama.KV_GROUPED_LEAVES,
))
