"""Quantization of the linear layers' weights: the formats, packing and unpacking, and turning a
float params tree into a quantized one. The products themselves are in ``models/linear.py``.

Formats (``EngineConfig.quantization``):

- ``"int8"``: weight-only. Each output channel (or, from a GGUF ``Q8_0``, each group of 32 inputs
  of it) has a symmetric scale: ``w = scale * q``, ``q`` int8. Activations stay float (bf16 or
  float32) and products accumulate in float32.
- ``"int4"``: weight-only, group-wise along the input dimension (``group_size`` 32 or 64):
  ``w = scale * q + offset`` with ``q`` in 0..15. From float weights the scale and offset span each
  group's min..max; from a GGUF's ``Q4_0``/``Q4_1``/``Q4_K`` they are the file's own (exact).
- ``"w4a8"``: the weights of ``"int4"``, and in every weight-only product (the int8 LM head too)
  the activations rounded to int8 per run of 32 inputs (:func:`round_activations_int8`): GGUF's
  ``Q8_1``, what llama.cpp multiplies 4-bit weights with. The native CPU kernel then multiplies
  few rows as int8 (``kernels/cpu/quant_dot8.h``), faster where integer products are cheaper than
  float ones; every other path multiplies the same rounded values as floats.
- ``"w8a8"``: int8 weights and per-token dynamic int8 activations (what ``"int8"`` meant before
  weight-only int8 existed): see :func:`quantize_w8a8_weight`.

A weight-only leaf is a dict, in the torch ``[out, in]`` = ``[N, K]`` orientation (each output's
groups contiguous, as in a GGUF block)::

    {"packed": int8 [N, K] | uint8 [N, K/2], "scales": float32 | float16 [N, G], "offsets": like scales}

``offsets`` only for int4; ``G = K / group_size`` (1 for per-channel int8). Scales and offsets
taken from a GGUF's ``Q4_0``/``Q4_1``/``Q8_0`` blocks keep the file's float16 (both alike):
float32 copies added a third to the bytes an int4 decode step reads. int4 nibbles follow GGUF's
``Q4_0`` block layout: in each run of 32 inputs, byte ``i`` holds input ``i`` in its low nibble
and input ``i + 16`` in its high one, so a 16-byte load unpacks into two 16-lane vectors.
A ``"w8a8"`` leaf keeps the float layout ``[K, N]``: ``{"q": int8 [K, N], "scale": float32 [N]}``.

Which leaves are quantized goes by leaf name (:data:`QUANTIZED_WEIGHTS`); norms, biases and an
untied LM head stay float. With ``"int8"``/``"int4"`` a tied embedding (``embed``, [V, D], which
the LM head reads whole for every token) becomes int8 per row, or keeps a GGUF's own blocks: rows
are dequantized when gathered (:func:`take_rows`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MIN_ACTIVATION_SCALE = 1e-12
QUANTIZED_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")
QUANTIZATIONS = ("int8", "int4", "w4a8", "w8a8")
WEIGHT_FORMATS = {"int8": "int8", "int4": "int4", "w4a8": "int4"}  # weight-only quantization -> its leaves' format
GROUP_SIZES = (32, 64)
NIBBLE_RUN = 32  # inputs per run of 16 bytes in the int4 layout
ACTIVATION_RUN = 32  # inputs that share one scale in "w4a8"'s int8 activations


# ----------------------------------------------------------------------------- weight-only


def check_group_size(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"quantization_group_size: must be one of {GROUP_SIZES}, got {group_size!r}")


def check_int4_shape(k: int, group_size: int, name: str = "weight") -> None:
    """int4 groups must tile each row: ``K`` a multiple of the group size (and of 32)."""
    check_group_size(group_size)
    if k % group_size:
        raise ValueError(f"quantization_group_size: int4 needs the input size of {name} ({k}) to be a "
                         f"multiple of the group size {group_size} (valid group sizes: {GROUP_SIZES})")


def is_weight_only(w) -> bool:
    return isinstance(w, dict) and "packed" in w


def is_int4(w) -> bool:
    return is_weight_only(w) and w["packed"].dtype == np.uint8


def in_features(w) -> int:
    """K of a weight-only leaf."""
    return w["packed"].shape[-1] * (2 if is_int4(w) else 1)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[N, K] values 0..15 -> [N, K/2] uint8 in the GGUF ``Q4_0`` order (see module docstring)."""
    n, k = q.shape
    runs = q.astype(np.uint8).reshape(n, k // NIBBLE_RUN, 2, NIBBLE_RUN // 2)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_nibbles(packed):
    """[..., N, K/2] uint8 -> [..., N, K] values 0..15 (numpy or jax, whichever it is given)."""
    xp = jnp if isinstance(packed, jax.Array) else np
    *lead, n, half = packed.shape
    runs = packed.reshape(*lead, n, half // 16, 1, 16)
    both = xp.concatenate([runs & 15, runs >> 4], axis=-2)
    return both.reshape(*lead, n, half * 2)


def quantize_int8(w_nk: np.ndarray) -> dict:
    """[N, K] float -> per-output-channel symmetric int8 (scale = max|w| / 127 over K)."""
    w = np.asarray(w_nk, np.float32)
    scale = np.max(np.abs(w), axis=1, keepdims=True) / 127.0
    q = np.round(w / np.where(scale > 0, scale, 1.0))
    return {"packed": np.clip(q, -127, 127).astype(np.int8), "scales": scale.astype(np.float32)}


def quantize_int4(w_nk: np.ndarray, group_size: int = 32) -> dict:
    """[N, K] float -> int4 groups spanning each group's min..max (``Q4_1``-like, asymmetric)."""
    w = np.asarray(w_nk, np.float32)
    n, k = w.shape
    check_int4_shape(k, group_size)
    groups = w.reshape(n, k // group_size, group_size)
    lo, hi = groups.min(axis=-1), groups.max(axis=-1)
    scale = (hi - lo) / 15.0
    q = np.round((groups - lo[..., None]) / np.where(scale > 0, scale, 1.0)[..., None])
    q = np.clip(q, 0, 15).reshape(n, k)
    return {"packed": pack_nibbles(q), "scales": scale.astype(np.float32), "offsets": lo.astype(np.float32)}


def dequantize(w: dict, dtype=jnp.float32):
    """A weight-only leaf -> the float [N, K] it stands for (numpy in, numpy out; jax likewise)."""
    xp = jnp if isinstance(w["packed"], jax.Array) else np
    q = unpack_nibbles(w["packed"]) if is_int4(w) else w["packed"]
    *lead, n, k = q.shape
    groups = w["scales"].shape[-1]
    q = q.astype(xp.float32).reshape(*lead, n, groups, k // groups)
    out = q * w["scales"][..., None].astype(xp.float32)
    if "offsets" in w:
        out = out + w["offsets"][..., None].astype(xp.float32)
    return out.reshape(*lead, n, k).astype(dtype)


def take_rows(w: dict, ids, dtype):
    """Rows ``ids`` of a weight-only leaf, dequantized to ``dtype`` (an embedding lookup)."""
    return dequantize({key: jnp.take(part, ids, axis=0) for key, part in w.items()}, dtype)


def quantize_weight_only(w_kn, quantization: str, group_size: int = 32) -> dict:
    """A float [K, N] params leaf -> its weight-only leaf ([N, K] orientation)."""
    w_nk = np.asarray(jnp.asarray(w_kn, jnp.float32)).T
    return quantize_int8(w_nk) if WEIGHT_FORMATS[quantization] == "int8" else quantize_int4(w_nk, group_size)


def round_activations_int8(x: jax.Array) -> jax.Array:
    """``x`` [..., K] (K a multiple of 32) as the ``"w4a8"`` products multiply it, float32: each run
    of 32 inputs becomes ``q * dx`` with ``q = round_half_even(x * (127 / peak))`` in -127..127 and
    ``dx = peak * (1 / 127)``, ``peak`` the run's largest magnitude. The native kernel rounds in
    the same float32 steps (``kernels/cpu/quant_dot8.h``), so every path sees the same integers."""
    k = x.shape[-1]
    if k % ACTIVATION_RUN:
        raise ValueError(f"quantization 'w4a8': the inputs of every product must be whole runs of "
                         f"{ACTIVATION_RUN}, got {k}")
    runs = x.astype(jnp.float32).reshape(*x.shape[:-1], k // ACTIVATION_RUN, ACTIVATION_RUN)
    peak = jnp.max(jnp.abs(runs), axis=-1, keepdims=True)
    inverse = jnp.where(peak > 0, 127.0 / jnp.where(peak > 0, peak, 1.0), 0.0)
    dx = peak * np.float32(1.0 / 127.0)
    return (jnp.round(runs * inverse) * dx).reshape(x.shape)


# ----------------------------------------------------------------------------- w8a8


def quantize_w8a8_weight(w: jax.Array) -> dict[str, jax.Array]:
    """[in, out] float weight -> {"q": int8 [in, out], "scale": float32 [out]}; paired at run time
    with per-token dynamic activation scales (:func:`quantize_activations`)."""
    w32 = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w32), axis=0) / 127.0
    q = jnp.round(w32 / jnp.where(scale > 0, scale, 1.0)).astype(jnp.int8)
    return {"q": q, "scale": scale}


def quantize_activations(x: jax.Array, guard: bool = True) -> tuple[jax.Array, jax.Array]:
    """Per-token int8 activations and their scales (scale = max|x| / 127 over the hidden dim).

    This is the data-dependent path that warm-up must exercise with real-looking inputs: on an
    all-zero row the raw scale is 0 and ``x / scale`` is 0/0 = NaN, so the scale is guarded with a
    floor (``MIN_ACTIVATION_SCALE``) and a zero row quantizes to exact zeros; ``guard=False``
    shows the unguarded 0/0."""
    x32 = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / 127.0
    if guard:
        scale = jnp.maximum(scale, MIN_ACTIVATION_SCALE)
    return jnp.round(x32 / scale).astype(jnp.int8), scale


# ----------------------------------------------------------------------------- params trees


def check_quantization(quantization, group_size: int = 32, field: str = "quantization") -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"{field}: must be None or one of {QUANTIZATIONS}, got {quantization!r}")
    check_group_size(group_size)


def check_params_quantizable(params: dict, quantization: str, group_size: int = 32) -> None:
    """Refuse, before any work, a tree whose leaves cannot take ``quantization``."""
    if WEIGHT_FORMATS.get(quantization) != "int4":
        return
    for name, value in params["layers"][0].items():
        if name in QUANTIZED_WEIGHTS and not isinstance(value, dict):
            check_int4_shape(value.shape[0], group_size, name)


def quantize_params(params: dict, quantization: str, group_size: int = 32, replace: dict | None = None,
                    leaves: tuple[str, ...] = QUANTIZED_WEIGHTS, embedding: bool = True) -> dict:
    """Quantize every linear layer's weight (the layer ``leaves``; a model family's
    ``quantized_leaves``), and with ``embedding`` a tied embedding too: int8 per row, weight-only
    under every format (its lookups read rows; ``"w8a8"`` models too, whose decode steps read the
    whole table for the logits: half the bytes of a bf16 one).

    ``replace``: {(layer index, leaf name): weight-only leaf} taken as they are instead (a GGUF's
    own quantized blocks). New leaves are on the default device; a sharded engine places the tree
    again (``parallel.sharding.param_shardings`` knows these leaves)."""
    check_quantization(quantization, group_size)
    check_params_quantizable(params, quantization, group_size)
    replace = replace or {}

    def convert(i, name, value):
        if name not in leaves:
            return value
        if quantization == "w8a8":
            return quantize_w8a8_weight(value)
        leaf = replace.get((i, name))
        if leaf is None:
            leaf = quantize_weight_only(value, quantization, group_size)
        return {key: jnp.asarray(part) for key, part in leaf.items()}

    layers = [{name: convert(i, name, value) for name, value in layer.items()}
              for i, layer in enumerate(params["layers"])]
    out = {**params, "layers": layers}
    tied = "embed" in params and "lm_head" not in params
    if embedding and tied and not isinstance(params["embed"], dict):
        leaf = replace.get("embed") or quantize_int8(np.asarray(jnp.asarray(params["embed"], jnp.float32)))
        out["embed"] = {key: jnp.asarray(part) for key, part in leaf.items()}
    return out


def quantize_params_w8a8(params: dict) -> dict:
    return quantize_params(params, "w8a8")
