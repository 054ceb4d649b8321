"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) as pure functions over a params pytree.

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

from jaxrunner.models.config import ModelConfig
from jaxrunner.models.quant import linear, linear_f32, matmul_f32_acc


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


def _attention_block(layer, x, cos, sin, layer_cache, meta, cfg: ModelConfig, attention, rows=None):
    """q, k and v stay float32 from the projection through RoPE (16-bit models too): rounding them
    to bf16 first cost XLA:CPU a convert round trip per elementwise op (~5 ms of a 117 ms bf16
    prefill); the attention callable casts them to its cache's dtype. With ``rows``, only those
    rows go on through the output projection (every row's K/V is still written)."""
    tokens = x.shape[0]
    h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
    qkv = linear_f32(h, layer["wqkv"])
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
    out = out.reshape(tokens, cfg.q_size)
    if rows is not None:
        x, out = jnp.take(x, rows, axis=0), jnp.take(out, rows, axis=0)
    return x + linear(out.astype(x.dtype), layer["wo"]), layer_cache


def _mlp_block(layer, x, cfg: ModelConfig):
    """SiLU(gate) * up in float32 from the float32-accumulated projection, rounded once for the
    down projection (bf16 elementwise math measured ~11 ms of converts per bf16 prefill)."""
    h = rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
    gate_up = linear_f32(h, layer["w_gate_up"]).reshape(*h.shape[:-1], cfg.intermediate_size, 2)  # interleaved
    gate, up = gate_up[..., 0], gate_up[..., 1]
    return x + linear((jax.nn.silu(gate) * up).astype(x.dtype), layer["w_down"])


def forward(params, cfg: ModelConfig, token_ids, positions, kv_cache, meta, attention, rows=None):
    """Run the decoder on packed tokens [T]; returns final hidden states and the new cache.

    ``kv_cache`` is a list with one entry per layer (whatever the attention callable keeps there;
    ``None`` entries for cache-free attention). ``rows`` [N]: return only these rows' hidden states
    ([N, D]; default all [T, D]). The last layer then runs its output projection and MLP on those
    rows alone — a prefill chunk samples one row of hundreds, and that is ~3 % of its matmuls.
    """
    x = jnp.take(params["embed"], token_ids, axis=0)
    cos, sin = rope_tables(cfg, positions)
    new_cache = []
    last = len(params["layers"]) - 1
    for i, (layer, layer_cache) in enumerate(zip(params["layers"], kv_cache)):
        if i == last:
            x, layer_cache = _decoder_layer(layer, x, cos, sin, layer_cache, meta, cfg, attention, rows)
        else:
            x, layer_cache = _traced_once_layer(layer, x, cos, sin, layer_cache, meta, cfg, attention)
        new_cache.append(layer_cache)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), new_cache


def _decoder_layer(layer, x, cos, sin, layer_cache, meta, cfg: ModelConfig, attention, rows=None):
    x, layer_cache = _attention_block(layer, x, cos, sin, layer_cache, meta, cfg, attention, rows)
    return _mlp_block(layer, x, cfg), layer_cache


# Every layer but the last has the same shapes, so as a nested jit it is traced and lowered once per
# step shape instead of once per layer (start-up's Python work per bucket falls by about half); XLA
# inlines the calls before optimizing, so the compiled step is the same unrolled program.
_traced_once_layer = jax.jit(_decoder_layer, static_argnames=("cfg", "attention"))


def compute_logits(params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Float32 logits [N, V] for the hidden rows that are sampled (not every prefill token)."""
    if cfg.tie_word_embeddings:
        return matmul_f32_acc(hidden, params["embed"], contract=(-1, 1))
    return matmul_f32_acc(hidden, params["lm_head"])


@dataclasses.dataclass(frozen=True)
class LlamaArchitecture:
    """The Llama-family functions the runner calls, bound to one config."""

    cfg: ModelConfig

    def forward(self, params, token_ids, positions, kv_cache, meta, attention, rows=None):
        return forward(params, self.cfg, token_ids, positions, kv_cache, meta, attention, rows)

    def compute_logits(self, params, hidden):
        return compute_logits(params, self.cfg, hidden)
