"""A GGUF's quantized blocks -> jaxrunner's weight-only leaves (``models/quant.py``), without
going through float: the 4-bit codes are kept as they are and only the per-block scales move.
Scales and offsets that are the file's float16 values (``Q4_0``, ``Q4_1``, ``Q8_0``) stay float16:
at 4 bits, float32 copies were a third of the bytes a decode step reads.

- ``Q4_0`` (per 32: f16 ``d``, 16 bytes of nibbles; ``w = d * (q - 8)``): int4 group 32,
  ``scale = d``, ``offset = -8 d``. Exact.
- ``Q4_1`` (per 32: f16 ``d``, f16 ``m``, nibbles; ``w = d * q + m``): int4 group 32. Exact.
- ``Q4_K`` (per 256: f16 ``d``, ``dmin``, 12 bytes of 6-bit sub-block scales and mins, 128 bytes
  of nibbles; ``w = d * sc_j * q - dmin * m_j`` per sub-block of 32): repacked exactly into int4
  group 32 (``scale = d * sc_j``, ``offset = -dmin * m_j``), the nibbles reordered from its 64-wide
  runs into the 32-wide runs of the ``Q4_0`` layout.
- ``Q8_0`` (per 32: f16 ``d``, 32 int8; ``w = d * q``): int8 group 32. Exact.

Each function takes a tensor's raw bytes as ``[rows, bytes per row]`` uint8 and returns the leaf
for ``[rows, K]`` weights.
"""
from __future__ import annotations

import numpy as np

from jaxrunner.models.quant import pack_nibbles

PACKABLE_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """A block field of float16 values, kept float16: the leaf's scales stay as small as the file's."""
    return blocks[..., start:start + 2].copy().view(np.float16)[..., 0]


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    rows = raw.shape[0]
    return np.ascontiguousarray(raw).reshape(rows, -1, block_bytes)


def _nibbles_q4_0_order(qs: np.ndarray) -> np.ndarray:
    """[rows, blocks, 16] bytes of 32-wide runs -> [rows, blocks * 32] values 0..15 (low then high)."""
    values = np.concatenate([qs & 15, qs >> 4], axis=-1)
    return values.reshape(qs.shape[0], -1)


def q4_0(raw: np.ndarray) -> dict:
    b = _blocks(raw, 18)
    d = _f16(b, 0)
    return {"packed": pack_nibbles(_nibbles_q4_0_order(b[..., 2:])), "scales": d, "offsets": -8.0 * d}


def q4_1(raw: np.ndarray) -> dict:
    b = _blocks(raw, 20)
    return {"packed": pack_nibbles(_nibbles_q4_0_order(b[..., 4:])), "scales": _f16(b, 0), "offsets": _f16(b, 2)}


def q8_0(raw: np.ndarray) -> dict:
    b = _blocks(raw, 34)
    q = b[..., 2:].copy().view(np.int8).reshape(b.shape[0], -1)
    return {"packed": q, "scales": _f16(b, 0)}


def _q4_k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of 6-bit values -> (scales [.., 8], mins [.., 8]) (llama.cpp's get_scale_min_k4)."""
    s = s.astype(np.uint8)
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return (np.concatenate([low_sc, high_sc], -1).astype(np.float32),
            np.concatenate([low_m, high_m], -1).astype(np.float32))


def q4_k(raw: np.ndarray) -> dict:
    b = _blocks(raw, 144)
    rows, nblocks = b.shape[:2]
    d, dmin = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)  # products need float32
    sc, m = _q4_k_scales_mins(b[..., 4:16])
    qs = b[..., 16:].reshape(rows, nblocks, 4, 32)  # four runs of 64: low nibbles 0..31, high 32..63
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, nblocks * 256)
    return {"packed": pack_nibbles(q), "scales": (d[..., None] * sc).reshape(rows, -1),
            "offsets": -(dmin[..., None] * m).reshape(rows, -1)}


DECODERS = {"Q4_0": q4_0, "Q4_1": q4_1, "Q4_K": q4_k, "Q8_0": q8_0}


def weight_only_leaf(type_name: str, raw: np.ndarray) -> dict | None:
    """The leaf for a tensor of GGML type ``type_name`` (None when it has no exact packed form)."""
    decode = DECODERS.get(type_name)
    return None if decode is None else decode(raw)
