"""The parts decoder layers are built from: norms, RoPE, the q/k/v projection and its per-head
norms, attention through the callable the runner hands down, gated MLPs, soft caps, the embedding
lookup and the output head.

Conventions every family shares (``models.params`` lays the weights out for them): ``wqkv`` fused
and grouped by KV head (each KV head's G queries, then its k, then its v), ``w_gate_up`` with gate
and up interleaved column by column, q/k/v kept in float32 from the projection up to the attention
callable (which casts them to its cache's dtype), and the linear products run where the
``matmuls`` handed down say (``kernels.MatmulKernels``, chosen once by the runner).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner import kernels
from jaxrunner.models import quant
from jaxrunner.models.config import ModelConfig
from jaxrunner.models.linear import linear, linear_f32, matmul_f32_acc, weight_only_matmul

__all__ = ["rms_norm", "offset_rms_norm", "rope_inv_freq", "rope_tables", "apply_rope", "project_qkv", "norm_qk",
           "split_rotated", "attend", "gated_mlp", "gelu_tanh", "soft_cap", "embedding_rows", "output_logits",
           "linear", "linear_f32"]


# ----------------------------------------------------------------------------- norms
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 and cast back, as transformers does."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def offset_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: scaled by ``1 + w``, the product taken in float32 before the cast back."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


# ----------------------------------------------------------------------------- rotary positions
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


def rope_tables(cfg: ModelConfig, positions: jax.Array, theta: float | None = None, rotary_dim: int | None = None,
                scaling=None) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, rotary_dim], each half repeated (HF's rotate-half layout), for ``theta`` and
    ``scaling`` (default: the config's) over the first ``rotary_dim`` dims (default: all)."""
    if theta is not None or rotary_dim is not None or scaling is not None:
        cfg = dataclasses.replace(cfg, head_dim=rotary_dim or cfg.head_dim,
                                  rope_theta=cfg.rope_theta if theta is None else theta,
                                  rope_scaling=cfg.rope_scaling if scaling is None else scaling)
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(cfg))[None, :]
    # cos/sin of the half, then repeated: XLA fuses them into each layer's RoPE, so every
    # transcendental saved here is saved once per layer.
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
    XLA:CPU's loop fusion of the concatenate was about twice as slow as the matmul and a plain
    elementwise fusion. The result is bitwise the same (each output is one input times ±1).
    HIGHEST precision keeps GPUs and TPUs from rounding x to TF32/bf16 in that product.
    """
    rotated = jnp.matmul(x, jnp.asarray(_rotate_half_matrix(x.shape[-1])), precision=jax.lax.Precision.HIGHEST)
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (x.shape[-1],)
    return x * cos.reshape(shape) + rotated * sin.reshape(shape)


# ----------------------------------------------------------------------------- attention
def project_qkv(layer: dict, h: jax.Array, cfg: ModelConfig, matmuls) -> jax.Array:
    """``h @ wqkv (+ bqkv)`` as float32 [T, Hkv, G + 2, D]: each KV head's G queries, then k, then v."""
    qkv = linear_f32(h, layer["wqkv"], matmuls)
    if "bqkv" in layer:
        qkv = qkv + layer["bqkv"]
    group = cfg.num_heads // cfg.num_kv_heads
    return qkv.reshape(h.shape[0], cfg.num_kv_heads, group + 2, cfg.head_dim)


def norm_qk(qkv: jax.Array, q_norm: jax.Array, k_norm: jax.Array, eps: float, norm=rms_norm) -> jax.Array:
    """Per-head RMSNorm of the q and k slots of a grouped [T, Hkv, G + 2, D] (v untouched)."""
    group = qkv.shape[2] - 2
    weights = jnp.concatenate([jnp.broadcast_to(q_norm, (group, q_norm.shape[-1])), k_norm[None]], axis=0)
    qk = norm(qkv[:, :, :group + 1], weights, eps)
    return jnp.concatenate([qk, qkv[:, :, group + 1:]], axis=2)


def split_rotated(qkv: jax.Array, cos: jax.Array, sin: jax.Array, num_heads: int, matmuls=None):
    """q [T, Hq, D], k and v [T, Hkv, D] of a grouped [T, Hkv, G + 2, D], RoPE applied to q and k
    (all of a KV group's in one pass) over their first ``cos.shape[-1]`` dims: partial rotary
    when fewer than D, the rest passing through. The native kernel does the same (bit for bit
    what optimizing XLA computes) where ``matmuls.elementwise`` says so and it takes the shapes."""
    if matmuls is not None and matmuls.elementwise == "native" and kernels.rotary_supported(qkv, cos):
        return kernels.rotary_native(qkv, cos, sin)
    tokens, group, rotary = qkv.shape[0], qkv.shape[2] - 2, cos.shape[-1]
    qk = qkv[:, :, :group + 1]
    if rotary == qkv.shape[-1]:
        qk = apply_rope(qk, cos, sin)
    else:
        qk = jnp.concatenate([apply_rope(qk[..., :rotary], cos, sin), qk[..., rotary:]], axis=-1)
    return qk[:, :, :group].reshape(tokens, num_heads, qkv.shape[-1]), qk[:, :, group], qkv[:, :, group + 1]


def attend(q, k, v, layer_cache, meta, attention, *, sm_scale: float, sliding_window: int | None,
           soft_cap: float | None = None):
    """``attention`` (the runner's paged callable, or the dense reference) over q/k/v; returns
    (output [T, Hq * D], the layer's new cache)."""
    kwargs = {} if soft_cap is None else {"soft_cap": soft_cap}
    out, layer_cache = attention(q, k, v, layer_cache, meta, sm_scale=sm_scale, sliding_window=sliding_window,
                                 **kwargs)
    return out.reshape(q.shape[0], -1), layer_cache


# ----------------------------------------------------------------------------- MLP
def gated_mlp(layer: dict, h: jax.Array, cfg: ModelConfig, activation, matmuls) -> jax.Array:
    """``down(act(gate) * up)`` over the interleaved ``w_gate_up``: the activation and product in
    float32 from the float32-accumulated projection, rounded once for the down projection (SiLU's
    by the native kernel where ``matmuls.elementwise`` says so)."""
    gate_up = linear_f32(h, layer["w_gate_up"], matmuls)
    if activation is jax.nn.silu and matmuls.elementwise == "native" and h.ndim == 2 \
            and kernels.silu_mul_supported(gate_up, h.dtype):
        gated = kernels.silu_mul_native(gate_up, h.dtype)
    else:
        pairs = gate_up.reshape(*h.shape[:-1], cfg.intermediate_size, 2)
        gated = (activation(pairs[..., 0]) * pairs[..., 1]).astype(h.dtype)
    return linear(gated, layer["w_down"], matmuls)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (``gelu_pytorch_tanh``)."""
    return jax.nn.gelu(x, approximate=True)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)``: bounds logits smoothly to (-cap, cap); identity when ``cap`` is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


# ----------------------------------------------------------------------------- vocabulary
def embedding_rows(params, token_ids) -> jax.Array:
    """The embedding rows of ``token_ids``, in the model's float dtype (a quantized embedding's
    gathered rows are dequantized)."""
    if quant.is_weight_only(params["embed"]):
        return quant.take_rows(params["embed"], token_ids, params["final_norm"].dtype)
    if isinstance(params["embed"], kernels.PanelWeight):  # a tied table laid out for its logits
        return quant.dequantize(kernels.panel_rows(params["embed"], token_ids), params["final_norm"].dtype)
    return jnp.take(params["embed"], token_ids, axis=0)


def output_logits(params, cfg: ModelConfig, hidden: jax.Array, matmuls: kernels.MatmulKernels) -> jax.Array:
    """Float32 logits [N, V] of the hidden rows sampled (not every prefill token): the tied
    embedding or ``lm_head``."""
    if cfg.tie_word_embeddings:
        if quant.is_weight_only(params["embed"]):  # [V, D] is the [N, K] orientation already
            return weight_only_matmul(hidden, params["embed"], matmuls)
        if isinstance(params["embed"], kernels.PanelWeight):
            return linear_f32(hidden, params["embed"], matmuls)
        return matmul_f32_acc(hidden, params["embed"], matmuls, contract=(-1, 1))
    return matmul_f32_acc(hidden, params["lm_head"], matmuls)
