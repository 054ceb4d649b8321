"""Pieces the decoder families beyond Llama put together (``qwen3``, ``gemma2``, ``gemma3``, ``phi3``).

They follow ``models.llama``'s conventions: fused ``wqkv`` grouped by KV head and ``w_gate_up``
interleaved (``models.params``), q/k/v kept in float32 up to the attention callable, the last layer
cut to the sampled ``rows``, the linear products run where the ``matmuls`` handed down say
(``kernels.MatmulKernels``). The Llama forward itself keeps its own code, so its numbers do not move.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrunner.models.config import ModelConfig
from jaxrunner.models.llama import apply_rope, linear, linear_f32, rms_norm, rope_inv_freq


def offset_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: scaled by ``1 + w``, the product taken in float32 before the cast back."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions: jax.Array, theta: float | None = None, rotary_dim: int | None = None,
                scaling=None) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, rotary_dim] (rotate-half layout) for ``theta`` and ``scaling`` (default: the config's)."""
    spec = dataclasses.replace(cfg, head_dim=rotary_dim or cfg.head_dim,
                               rope_theta=cfg.rope_theta if theta is None else theta,
                               rope_scaling=cfg.rope_scaling if scaling is None else scaling)
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(spec))[None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


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


def rotate_qk(qkv: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on the q and k slots of a grouped [T, Hkv, G + 2, D] over its first ``cos.shape[-1]``
    dims (partial rotary when fewer than D); the rest and v pass through."""
    group, rotary = qkv.shape[2] - 2, cos.shape[-1]
    qk = qkv[:, :, :group + 1]
    if rotary == qkv.shape[-1]:
        qk = apply_rope(qk, cos, sin)
    else:
        qk = jnp.concatenate([apply_rope(qk[..., :rotary], cos, sin), qk[..., rotary:]], axis=-1)
    return jnp.concatenate([qk, qkv[:, :, group + 1:]], axis=2)


def attend(qkv: jax.Array, layer_cache, meta, cfg: ModelConfig, attention, *, sm_scale: float,
           sliding_window: int | None, soft_cap: float | None = None):
    """Split a grouped [T, Hkv, G + 2, D] into q/k/v and attend; returns ([T, Hq * D], cache)."""
    tokens, group = qkv.shape[0], qkv.shape[2] - 2
    q = qkv[:, :, :group].reshape(tokens, cfg.num_heads, cfg.head_dim)
    kwargs = {} if soft_cap is None else {"soft_cap": soft_cap}
    out, layer_cache = attention(q, qkv[:, :, group], qkv[:, :, group + 1], layer_cache, meta, sm_scale=sm_scale,
                                 sliding_window=sliding_window, **kwargs)
    return out.reshape(tokens, cfg.q_size), layer_cache


def gated_mlp(layer: dict, h: jax.Array, cfg: ModelConfig, activation, matmuls) -> jax.Array:
    """``down(act(gate) * up)`` over the interleaved ``w_gate_up``, elementwise math in float32."""
    gate_up = linear_f32(h, layer["w_gate_up"], matmuls).reshape(*h.shape[:-1], cfg.intermediate_size, 2)
    return linear((activation(gate_up[..., 0]) * gate_up[..., 1]).astype(h.dtype), layer["w_down"], matmuls)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (``gelu_pytorch_tanh``)."""
    return jax.nn.gelu(x, approximate=True)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)``: bounds logits smoothly to (-cap, cap); identity when ``cap`` is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def take_rows(rows, *arrays):
    """``arrays`` cut to ``rows`` (all of them when ``rows`` is None)."""
    if rows is None:
        return arrays
    return tuple(jnp.take(a, rows, axis=0) for a in arrays)
