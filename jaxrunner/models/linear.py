"""The linear layers' products: float weights, weight-only quantized ones (int8, int4) and
``"w8a8"`` ones, each routed to the native CPU kernel or to XLA. The formats are in
``models/quant.py``.

Where a product may run is decided once, at start-up, by the runner (``kernels.capabilities``) and
handed down as a ``kernels.MatmulKernels`` (the ``matmuls`` argument): nothing here asks JAX about
platforms or devices while the model is traced. Which products take the native kernel within that
choice (rows, dtypes, shapes) is decided here, from the static shapes."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrunner import kernels
from jaxrunner.models import lora, packed_weights, quant

NATIVE_MATMUL_ROWS = 1  # rows the native CPU matmul takes over (bf16 measured slower than XLA at 4)
# Rows the native quantized matmul takes. Up to 4 rows it streams the packed weights through
# registers; up to 16 its tiled path still beat dequantize-then-dot in XLA, but a 128-row prefill
# chunk ran faster through XLA's dot. Where it has the panel GEMMs (``matmuls.weight_only_gemm``)
# it takes every row count of int8 x and of float x below ``matmuls.dequantize_min_rows`` (where
# that is not 0; kernels/platform_support.py says where XLA's dot took over, per CPU kind).
NATIVE_QUANT_ROWS = 16
# Where oneDNN takes weight-only products (``MatmulKernels.onednn_weight_only``), it does from this
# many rows: on AMX it ran 1.0-1.8x the native kernel at 5-6 rows, 1.0-1.9x at 8, 1.6-2.9x at 16,
# and the native kernel's integer dot products of up to 4 rows beat it (bench_matmul.py --quantization).
ONEDNN_QUANT_MIN_ROWS = 5


def linear(x: jax.Array, w, matmuls: kernels.MatmulKernels) -> jax.Array:
    """``x @ w`` in ``x``'s dtype: :func:`linear_f32` rounded back."""
    return linear_f32(x, w, matmuls).astype(x.dtype)


def linear_f32(x: jax.Array, w, matmuls: kernels.MatmulKernels) -> jax.Array:
    """``x @ w`` with a float32 result: the quantized paths for a quantized weight, float32
    accumulation for 16-bit operands, kept unrounded for the float32 math that follows (activation,
    RoPE).

    16-bit operands accumulate in float32 (``preferred_element_type``), as transformers does, and
    on XLA:CPU that is also the fast path: measured [64, 576] x [576, 3072] bf16 -> f32 at 302
    GFLOP/s against 130 for a bf16 result and 152 for float32 operands (AVX512-BF16 here; no AMX).
    Float32 operands take the same route, so that one-row products reach the native kernel.
    A weight with LoRA slots (``models.lora.LoraWeight``) adds each row's adapter delta.
    """
    if isinstance(w, lora.LoraWeight):
        delta = w.delta(x.reshape(-1, x.shape[-1]), lambda rows, factor: matmul_f32_acc(rows, factor, matmuls))
        return linear_f32(x, w.base, matmuls) + delta.reshape(*x.shape[:-1], -1)
    if quant.is_weight_only(w):
        return weight_only_matmul(x, w, matmuls)
    if isinstance(w, kernels.PanelWeight):  # laid out at start-up (models.packed_weights)
        return panel_weight_matmul(x, w, matmuls)
    if isinstance(w, kernels.W8a8TileWeight):  # laid out at start-up: the whole product in one native call
        rows = kernels.w8a8_tile_matmul(x.reshape(-1, x.shape[-1]), w, quant.MIN_ACTIVATION_SCALE)
        return rows.reshape(*x.shape[:-1], w.n).astype(jnp.float32)
    if isinstance(w, dict):
        return w8a8_matmul(x, w).astype(jnp.float32)
    return matmul_f32_acc(x, w, matmuls)


def weight_only_matmul(x: jax.Array, w: dict, matmuls: kernels.MatmulKernels) -> jax.Array:
    """``x`` [..., K] times a weight-only leaf ([N, K] orientation), float32 result.

    With the native weight-only kernel (``matmuls.weight_only``: one CPU device), up to
    ``NATIVE_QUANT_ROWS`` rows go to it (where ``matmuls.weight_only_gemm``: every row count, but
    float32 ones only below ``matmuls.dequantize_min_rows`` where that is set): it unpacks the
    weights in registers and reads each byte once (a batch-1 decode streams the whole model per
    token, so bytes are time; a batch of decodes likewise). From ``ONEDNN_QUANT_MIN_ROWS`` rows of
    an activation dtype in ``matmuls.onednn_weight_only``, oneDNN's AMX matmul takes them instead,
    the weight unpacked a tile at a time while in cache. Otherwise XLA's dot with float32
    accumulation takes more rows, the weight dequantized first: by the native kernel for float32
    ``x`` (XLA's own unpacking fusion was several times slower), by XLA in ``x``'s dtype otherwise.
    A leaf laid out as panels at start-up (``kernels.PanelWeight``) goes to
    :func:`panel_weight_matmul` instead.

    With ``matmuls.weight_only_activations == "int8"`` (``"w4a8"``), ``x`` is rounded to int8 per
    run of 32 inputs on every path: by the native kernel where it takes the product, by
    :func:`quant.round_activations_int8` before the others (bf16 activations then carry the
    rounded values in bf16)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    onednn = _onednn_takes(x2, matmuls) and kernels.quantized_matmul_supported(x2, w)
    native_path = None if onednn else _native_quant_path(x2, w, matmuls)
    int8_activations = matmuls.weight_only_activations == "int8"
    if int8_activations and native_path != "matmul":  # the native kernel rounds them itself
        x2 = quant.round_activations_int8(x2).astype(x2.dtype)
    if onednn:
        out = kernels.onednn_quant_matmul(x2, w)
    elif native_path == "matmul":
        out = kernels.quantized_matmul_native(x2, w, int8_activations=int8_activations)
    else:
        if native_path == "dequantize":
            dense = kernels.dequantize_native(w, after=x2)
        else:
            dense = quant.dequantize(w, x.dtype)
        out = matmul_f32_acc(x2, dense, matmuls, contract=(-1, 1))
    return out.reshape(*lead, out.shape[-1])


def panel_weight_matmul(x: jax.Array, w: kernels.PanelWeight, matmuls: kernels.MatmulKernels) -> jax.Array:
    """``x`` [..., K] times a weight-only leaf laid out as panels, float32 result: from
    ``ONEDNN_QUANT_MIN_ROWS`` rows of an activation dtype in ``matmuls.onednn_weight_only`` on
    oneDNN (each tile unpacked from the panels), every other row count on the native panel kernel.
    ``"w4a8"`` rounds ``x`` to int8 on both (the native kernel rounds it itself)."""
    x2 = x.reshape(-1, x.shape[-1])
    int8_activations = matmuls.weight_only_activations == "int8"
    if _onednn_takes(x2, matmuls):
        rounded = quant.round_activations_int8(x2).astype(x2.dtype) if int8_activations else x2
        out = kernels.onednn_panel_matmul(rounded, w)
    else:
        out = kernels.panel_matmul(x2, w, int8_activations)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _onednn_takes(x: jax.Array, matmuls: kernels.MatmulKernels) -> bool:
    """Whether oneDNN's weight-only product takes the rows ``x`` [rows, K]: ``ONEDNN_QUANT_MIN_ROWS``
    or more, of a dtype in ``matmuls.onednn_weight_only``."""
    return x.shape[0] >= ONEDNN_QUANT_MIN_ROWS and x.dtype.name in matmuls.onednn_weight_only


def _native_quant_path(x: jax.Array, w: dict, matmuls: kernels.MatmulKernels) -> str | None:
    """"matmul" (the native kernel does the product), "dequantize" (it unpacks a float32 weight
    for XLA's dot: many float32 rows) or None (XLA alone: the XLA choice, shapes, bf16 rows)."""
    if matmuls.weight_only != "native" or not kernels.quantized_matmul_supported(x, w):
        return None
    rows, float32 = x.shape[0], x.dtype == jnp.float32
    int8_x = matmuls.weight_only_activations == "int8"
    limit = matmuls.dequantize_min_rows
    if rows <= NATIVE_QUANT_ROWS or (matmuls.weight_only_gemm and (int8_x or not float32 or not limit or rows < limit)):
        return "matmul"
    return "dequantize" if float32 else None


def w8a8_matmul(x: jax.Array, w: dict[str, jax.Array], guard: bool = True) -> jax.Array:
    """int8 activations (per-token dynamic scales) times int8 weights, int32 accumulation."""
    x_q, x_scale = quant.quantize_activations(x, guard)
    acc = jax.lax.dot_general(x_q, w["q"], (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * x_scale * w["scale"]).astype(x.dtype)


def matmul_f32_acc(x: jax.Array, w: jax.Array, matmuls: kernels.MatmulKernels,
                   contract: tuple[int, int] = (-1, 0)) -> jax.Array:
    """``x`` [rows, ...] contracted with ``w`` over (x's ``contract[0]``, w's ``contract[1]``),
    float32 result.

    With the native one-row matmul (``matmuls.one_row``: one CPU device), a one-row ``x`` and ``w``,
    both bf16 or both float32, go to the kernel (``kernels.small_matmul_native``), which streams
    each weight once: a batch-1 decode reads every weight per token. XLA:CPU read bf16 weights at
    ~9 GB/s against ~22 for the kernel on the largest projection ([576, 3072]: 398 vs 160 us per
    call), and float32 ones at ~19 GB/s over a token (batch-1 float32 TPOT 28.7 -> 23.8-25.7 ms
    through the kernel, medians of alternating runs). A weight packed for oneDNN
    (``kernels.OnednnPackedWeight``, in its own orientation whatever ``contract`` says) goes to
    oneDNN's matmul at every row count; a transposed one (``packed_weights.TransposedWeight``, a
    [K, N] weight held as [N, K]) contracts its last axis. Other 16-bit ``x`` with fewer than
    ``matmuls.min_16bit_rows`` rows are padded to that many (XLA:CPU routes a one-row bf16 dot to
    a slow GEMV; see ``kernels.capabilities``)."""
    if isinstance(w, kernels.OnednnPackedWeight):  # packed at start-up (models.packed_weights): every row count
        return kernels.onednn_matmul(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.n)
    if isinstance(w, packed_weights.TransposedWeight):  # [K, N] held as [N, K] at start-up: contract its last axis
        return matmul_f32_acc(x, w.data, matmuls, contract=(contract[0], 1))
    dims = (((x.ndim + contract[0]) % x.ndim,), ((w.ndim + contract[1]) % w.ndim,)), ((), ())
    native_layout = _native_matmul_layout(x, w, dims, matmuls)
    if native_layout is not None:
        return kernels.small_matmul_native(x, w, transposed=native_layout)
    rows = x.shape[0]
    pad = (x.ndim == 2 and dims[0][0][0] == 1 and rows < matmuls.min_16bit_rows and x.dtype != jnp.float32)
    if pad:
        x = jnp.pad(x, ((0, matmuls.min_16bit_rows - rows), (0, 0)))
    out = jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    return out[:rows] if pad else out


def _native_matmul_layout(x, w, dims, matmuls: kernels.MatmulKernels) -> bool | None:
    """Whether ``w`` is [N, K] (True) or [K, N] (False) when the native CPU matmul takes this
    product; None when it does not (the XLA choice, shapes or dtypes)."""
    if matmuls.one_row != "native":
        return None
    if x.ndim != 2 or w.ndim != 2 or dims[0][0] != (1,) or x.shape[0] > NATIVE_MATMUL_ROWS:
        return None
    transposed = dims[0][1] == (1,)
    return transposed if kernels.small_matmul_supported(x, w, transposed) else None
