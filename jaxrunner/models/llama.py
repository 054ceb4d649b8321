"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2): config mapping, pure forward over a params
pytree, HF state dict -> params, partition rules; registered with ``models.registry``.

The forward never knows how attention is done: it is handed an ``attention`` callable
``(q, k, v, layer_cache, meta, *, sm_scale, sliding_window) -> (out, layer_cache)`` — the dense
reference in tests, the paged kernels in the engine. Layers are unrolled in Python: on XLA:CPU a
``scan`` over layers measured several times slower per token.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner import kernels
from jaxrunner.models import registry
from jaxrunner.models.config import (ModelConfig, UnsupportedModelError, check_activation, common_fields,
                                     rope_scaling)
from jaxrunner.models.params import build_decoder_params, decoder_shapes, group_qkv, take
from jaxrunner.models import quant
from jaxrunner.models.linear import linear, linear_f32, matmul_f32_acc, weight_only_matmul
from jaxrunner.parallel import sharding


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 and cast back, as transformers does."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2], with Llama 3 / linear rope scaling applied (host, static)."""
    dim = cfg.head_dim
    # float32 throughout, as transformers computes it: angles at long positions amplify any drift.
    exponents = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / np.power(np.float32(cfg.rope_theta), exponents)).astype(np.float32)
    scaling = cfg.rope_scaling_dict
    if not scaling:
        return inv_freq.astype(np.float32)
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return (inv_freq / factor).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by `factor`, blend in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, head_dim], each half repeated (HF's rotate-half layout)."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(cfg))[None, :]
    # cos/sin of the half, then repeated: XLA fuses them into each layer's RoPE, so every
    # transcendental saved here is saved 30 times over.
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


def _rotate_half_matrix(head_dim: int) -> np.ndarray:
    """R with ``x @ R == concatenate([-x2, x1])``: one ±1 per column, so the product is exact."""
    half = head_dim // 2
    rotate = np.zeros((head_dim, head_dim), np.float32)
    rotate[np.arange(half) + half, np.arange(half)] = -1.0
    rotate[np.arange(half), np.arange(half) + half] = 1.0
    return rotate


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE on float32 [T, ..., D]: ``x * cos + rotate_half(x) * sin``.

    rotate_half is a [D, D] signed-permutation matmul rather than slices and a concatenate:
    XLA:CPU's loop fusion of the concatenate ran at ~3 ns per element (~10 ms of RoPE in a
    128-token bf16 prefill); the matmul and a plain elementwise fusion take about half that.
    The result is bitwise the same (each output is one input times ±1). HIGHEST precision keeps
    GPUs and TPUs from rounding x to TF32/bf16 in that product.
    """
    rotated = jnp.matmul(x, jnp.asarray(_rotate_half_matrix(x.shape[-1])), precision=jax.lax.Precision.HIGHEST)
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (x.shape[-1],)
    return x * cos.reshape(shape) + rotated * sin.reshape(shape)


def _attend(layer, x, cos, sin, layer_cache, meta, cfg: ModelConfig, attention, matmuls):
    """The attention half of a layer up to (not including) the output projection: returns the
    attention output [T, Hq*Dh] and the new layer cache.

    q, k and v stay float32 from the projection through RoPE (16-bit models too): rounding them
    to bf16 first cost XLA:CPU a convert round trip per elementwise op (~5 ms of a 117 ms bf16
    prefill); the attention callable casts them to its cache's dtype."""
    tokens = x.shape[0]
    h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
    qkv = linear_f32(h, layer["wqkv"], matmuls)
    if "bqkv" in layer:
        qkv = qkv + layer["bqkv"]
    group = cfg.num_heads // cfg.num_kv_heads
    qkv = qkv.reshape(tokens, cfg.num_kv_heads, group + 2, cfg.head_dim)  # grouped by KV head (params.py)
    qk = apply_rope(qkv[:, :, :group + 1], cos, sin)  # q heads and k of each KV group in one pass
    q = qk[:, :, :group].reshape(tokens, cfg.num_heads, cfg.head_dim)
    k = qk[:, :, group]
    v = qkv[:, :, group + 1]
    out, layer_cache = attention(q, k, v, layer_cache, meta, sm_scale=cfg.head_dim ** -0.5,
                                 sliding_window=cfg.sliding_window)
    return out.reshape(tokens, cfg.q_size), layer_cache


def _layer_tail(layer, x, attended, cfg: ModelConfig, matmuls):
    """The rest of a layer: output projection and residual, then the MLP."""
    return _mlp_block(layer, x + linear(attended.astype(x.dtype), layer["wo"], matmuls), cfg, matmuls)


def _last_layer_tail(layer, x, attended, cfg: ModelConfig, matmuls, rows, all_rows):
    """The last layer's tail on the sampled ``rows`` only; with ``all_rows`` (a traced bool), on
    every row when it holds, returning those hidden states too (zeros when it does not)."""
    def sampled_only(operands):
        x, attended = operands
        return _layer_tail(layer, jnp.take(x, rows, axis=0), jnp.take(attended, rows, axis=0), cfg, matmuls)

    if all_rows is None:
        return sampled_only((x, attended)), None

    def every_row(operands):
        full = _layer_tail(layer, *operands, cfg, matmuls)
        return jnp.take(full, rows, axis=0), full

    return jax.lax.cond(all_rows, every_row, lambda ops: (sampled_only(ops), jnp.zeros_like(ops[0])),
                        (x, attended))


def _mlp_block(layer, x, cfg: ModelConfig, matmuls):
    """SiLU(gate) * up in float32 from the float32-accumulated projection, rounded once for the
    down projection (bf16 elementwise math measured ~11 ms of converts per bf16 prefill)."""
    h = rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
    gate_up = linear_f32(h, layer["w_gate_up"], matmuls).reshape(*h.shape[:-1], cfg.intermediate_size, 2)  # interleaved
    gate, up = gate_up[..., 0], gate_up[..., 1]
    return x + linear((jax.nn.silu(gate) * up).astype(x.dtype), layer["w_down"], matmuls)


def forward(params, cfg: ModelConfig, token_ids, positions, kv_cache, meta, attention, rows=None, all_rows=None, *,
            matmuls: kernels.MatmulKernels = kernels.XLA_MATMULS):
    """Run the decoder on packed tokens [T]; returns final hidden states and the new cache.

    ``kv_cache`` is a list with one entry per layer (whatever the attention callable keeps there;
    ``None`` entries for cache-free attention); ``meta`` is what the callable reads of the step
    (``models.attention.AttentionMetadata`` for the paged cache, segment ids for the dense
    reference), passed through untouched. ``rows`` [N]: return only these rows' hidden states
    ([N, D]; default all [T, D]). The last layer then runs its output projection and MLP on those
    rows alone — a prefill chunk samples one row of hundreds, and that is ~3 % of its matmuls.

    ``all_rows`` (a traced bool, with ``rows``): when it holds, the last layer also runs on every
    row, and a third result holds all rows' final hidden states [T, D] (zeros when it does not) —
    what prompt logprobs need, paid only by the steps that ask for them.

    ``matmuls``: where the linear products run (``kernels.capabilities().matmuls``, chosen by the
    runner at start-up); the default, XLA's dot, runs anywhere.
    """
    x = embedding_rows(params, token_ids)
    cos, sin = rope_tables(cfg, positions)
    new_cache = []
    last = len(params["layers"]) - 1
    every_row = None
    for i, (layer, layer_cache) in enumerate(zip(params["layers"], kv_cache)):
        if i == last and rows is not None:
            attended, layer_cache = _attend(layer, x, cos, sin, layer_cache, meta, cfg, attention, matmuls)
            x, every_row = _last_layer_tail(layer, x, attended, cfg, matmuls, rows, all_rows)
        else:
            x, layer_cache = _traced_once_layer(layer, x, cos, sin, layer_cache, meta, cfg, attention, matmuls)
        new_cache.append(layer_cache)
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    if all_rows is None or rows is None:
        return hidden, new_cache
    return hidden, new_cache, rms_norm(every_row, params["final_norm"], cfg.rms_norm_eps)


def embedding_rows(params, token_ids) -> jax.Array:
    """The embedding rows of ``token_ids``, in the model's float dtype (a quantized embedding's
    gathered rows are dequantized)."""
    if quant.is_weight_only(params["embed"]):
        return quant.take_rows(params["embed"], token_ids, params["final_norm"].dtype)
    return jnp.take(params["embed"], token_ids, axis=0)


def _decoder_layer(layer, x, cos, sin, layer_cache, meta, cfg: ModelConfig, attention, matmuls):
    attended, layer_cache = _attend(layer, x, cos, sin, layer_cache, meta, cfg, attention, matmuls)
    return _layer_tail(layer, x, attended, cfg, matmuls), layer_cache


# Every layer but the last has the same shapes, so as a nested jit it is traced and lowered once per
# step shape instead of once per layer (start-up's Python work per bucket falls by about half); XLA
# inlines the calls before optimizing, so the compiled step is the same unrolled program.
_traced_once_layer = jax.jit(_decoder_layer, static_argnames=("cfg", "attention", "matmuls"))


def compute_logits(params, cfg: ModelConfig, hidden: jax.Array, *,
                   matmuls: kernels.MatmulKernels = kernels.XLA_MATMULS) -> jax.Array:
    """Float32 logits [N, V] for the hidden rows that are sampled (not every prefill token)."""
    if cfg.tie_word_embeddings:
        if quant.is_weight_only(params["embed"]):  # [V, D] is the [N, K] orientation already
            return weight_only_matmul(hidden, params["embed"], matmuls)
        return matmul_f32_acc(hidden, params["embed"], matmuls, contract=(-1, 1))
    return matmul_f32_acc(hidden, params["lm_head"], matmuls)


@dataclasses.dataclass(frozen=True)
class LlamaArchitecture:
    """The Llama-family functions the runner calls, bound to one config and to where its linear
    products run."""

    cfg: ModelConfig
    matmuls: kernels.MatmulKernels = kernels.XLA_MATMULS

    def forward(self, params, token_ids, positions, kv_cache, meta, attention, rows=None, all_rows=None):
        return forward(params, self.cfg, token_ids, positions, kv_cache, meta, attention, rows, all_rows,
                       matmuls=self.matmuls)

    def compute_logits(self, params, hidden):
        return compute_logits(params, self.cfg, hidden, matmuls=self.matmuls)


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


def _layer_params(state, cfg: ModelConfig, i: int, source: str) -> dict[str, np.ndarray]:
    d, p = cfg.hidden_size, f"model.layers.{i}."
    return {"attn_norm": take(state, p + "input_layernorm.weight", (d,), source),
            **attention_params(state, cfg, p, source),
            "mlp_norm": take(state, p + "post_attention_layernorm.weight", (d,), source),
            **mlp_params(state, cfg, p, source)}


def build_params(state, cfg: ModelConfig, place, source: str = "checkpoint", progress: bool = False) -> dict:
    return build_decoder_params(state, cfg, place, source, progress, _layer_params)


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
    architecture=LlamaArchitecture,
    build_params=build_params,
    param_shapes=param_shapes,
    partition_rules=partition_rules,
    quantized_leaves=QUANTIZED_LEAVES,
    kv_grouped_leaves=KV_GROUPED_LEAVES,
    quantized_embedding=True,
))
