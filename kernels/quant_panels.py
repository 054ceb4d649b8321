"""Weight-only int4/int8 weights laid out once as panels of sixteen outputs, and their product
(``cpu/quant_panels.cc``; AVX512-VNNI builds: ``native.stored_panels``).

A weight-only leaf holds one output's codes after another (``packed`` [N, K/2] uint8 in GGUF's
order, or [N, K] int8) with ``scales`` / ``offsets`` [N, G]. The native kernel's integer dot
products then end each output in a sum across vector lanes and scale every 64 bytes of codes on
their own; its panel GEMM rearranges sixteen outputs at every call instead. :func:`to_panels`
rearranges the leaf once, so that a vector holds four bytes of each of sixteen outputs, and the
product reads it as it lies, for one row as for many. :func:`from_panels` gives the leaf back, bit
for bit.

Layout (``PanelWeight``), per panel p of outputs 16p .. 16p + 15 and run r of 32 inputs:
``codes[p, r * B + 64 q + 4 o + b]`` is byte 4q + b of output o's run (int4: B = 256, q < 4, the
run's 16 bytes; int8: B = 512, q < 8, its 32 codes, plus 128 as unsigned bytes), and
``scales[p, 16 g + o]`` (``offsets`` likewise) is output o's value of group g.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.kernels import native

PANEL = 16  # outputs per panel: one AVX-512 vector of int32 lanes
RUN = 32    # inputs per run


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PanelWeight:
    """A weight-only leaf laid out as panels (module docstring); ``offsets`` None without them."""
    codes: jax.Array
    scales: jax.Array
    offsets: jax.Array | None
    int4: bool

    def tree_flatten(self):
        if self.offsets is None:
            return (self.codes, self.scales), (self.int4, False)
        return (self.codes, self.scales, self.offsets), (self.int4, True)

    @classmethod
    def tree_unflatten(cls, static, children):
        int4, has_offsets = static
        return cls(children[0], children[1], children[2] if has_offsets else None, int4)

    @property
    def n(self) -> int:
        return self.codes.shape[0] * PANEL

    @property
    def k(self) -> int:
        return self.codes.shape[1] // (256 if self.int4 else 512) * RUN

    def offsets_operand(self) -> jax.Array:
        """The offsets, or an unread array of the scales' dtype (the kernels take both typed alike)."""
        return self.offsets if self.offsets is not None else jnp.zeros((1, 1), self.scales.dtype)

    def plain_like(self) -> dict:
        """The plain leaf's shapes and dtypes (``jax.ShapeDtypeStruct``), without unpacking."""
        groups = self.scales.shape[1] // PANEL
        packed = jax.ShapeDtypeStruct((self.n, self.k // 2 if self.int4 else self.k),
                                      jnp.uint8 if self.int4 else jnp.int8, sharding=self.codes.sharding)
        out = {"packed": packed,
               "scales": jax.ShapeDtypeStruct((self.n, groups), self.scales.dtype, sharding=self.scales.sharding)}
        if self.offsets is not None:
            out["offsets"] = jax.ShapeDtypeStruct((self.n, groups), self.offsets.dtype, sharding=self.offsets.sharding)
        return out


def fits_panels(leaf) -> bool:
    """Whether a weight-only leaf fits the layout: a matrix of whole panels and runs, groups of whole runs."""
    packed, scales = leaf["packed"], leaf["scales"]
    if packed.ndim != 2 or scales.ndim != 2 or packed.dtype not in (np.uint8, np.int8):
        return False
    int4 = packed.dtype == np.uint8
    n, k = packed.shape[0], packed.shape[1] * (2 if int4 else 1)
    groups = scales.shape[1]
    return n % PANEL == 0 and k % RUN == 0 and groups >= 1 and (k // RUN) % groups == 0


def to_panels(leaf: dict) -> PanelWeight:
    """The panel layout of a weight-only leaf (``fits_panels``); new arrays, on the leaf's device."""
    packed = leaf["packed"]
    int4 = packed.dtype == jnp.uint8
    n = packed.shape[0]
    quads = 4 if int4 else 8
    runs = packed.shape[1] // (16 if int4 else 32)
    codes = packed if int4 else jax.lax.bitcast_convert_type(packed, jnp.uint8) ^ jnp.uint8(0x80)
    codes = codes.reshape(n // PANEL, PANEL, runs, quads, 4).transpose(0, 2, 3, 1, 4)
    offsets = leaf.get("offsets")
    return PanelWeight(codes.reshape(n // PANEL, -1), _values_to_panels(leaf["scales"]),
                       None if offsets is None else _values_to_panels(offsets), bool(int4))


def from_panels(w: PanelWeight) -> dict:
    """The weight-only leaf ``w`` was laid out from, bit for bit."""
    quads = 4 if w.int4 else 8
    panels = w.codes.shape[0]
    runs = w.k // RUN
    codes = w.codes.reshape(panels, runs, quads, PANEL, 4).transpose(0, 3, 1, 2, 4).reshape(w.n, -1)
    if not w.int4:
        codes = jax.lax.bitcast_convert_type(codes ^ jnp.uint8(0x80), jnp.int8)
    out = {"packed": codes, "scales": _values_from_panels(w.scales)}
    if w.offsets is not None:
        out["offsets"] = _values_from_panels(w.offsets)
    return out


def panel_rows(w: PanelWeight, ids) -> dict:
    """Rows (outputs) ``ids`` of the weight ``w`` stands for, as a weight-only leaf's parts
    (``packed``, ``scales``, ``offsets``): an embedding lookup in a tied table laid out as panels."""
    quads = 4 if w.int4 else 8
    panel, lane = ids // PANEL, ids % PANEL
    codes = w.codes.reshape(w.codes.shape[0], w.k // RUN, quads, PANEL, 4)[panel, :, :, lane, :]
    codes = codes.reshape(*ids.shape, -1)
    if not w.int4:
        codes = jax.lax.bitcast_convert_type(codes ^ jnp.uint8(0x80), jnp.int8)

    def values(v):
        return v.reshape(v.shape[0], -1, PANEL)[panel, :, lane]

    out = {"packed": codes, "scales": values(w.scales)}
    if w.offsets is not None:
        out["offsets"] = values(w.offsets)
    return out


def _values_to_panels(values):
    n, groups = values.shape
    return values.reshape(n // PANEL, PANEL, groups).transpose(0, 2, 1).reshape(n // PANEL, groups * PANEL)


def _values_from_panels(values):
    panels, width = values.shape
    groups = width // PANEL
    return values.reshape(panels, groups, PANEL).transpose(0, 2, 1).reshape(panels * PANEL, groups)


def panel_matmul(x, w: PanelWeight, int8_activations: bool = False):
    """``x`` [rows, K] (bf16 or float32) times the weight ``w`` stands for, float32 [rows, N]: the
    same integers as the native few-row kernel (x rounded to 16 bits per run of 32 inputs, or first
    to int8 with ``int8_activations``, the ``"w4a8"`` quantization)."""
    native._require()  # built and registered with XLA (or why not)
    if x.ndim != 2 or x.shape[1] != w.k or x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"panel_matmul: x must be [rows, {w.k}] bf16 or float32, got {x.dtype}{list(x.shape)}")
    call = jax.ffi.ffi_call(native.PANEL_MATMUL_TARGET_NAME, jax.ShapeDtypeStruct((x.shape[0], w.n), jnp.float32))
    return call(x, w.codes, w.scales, w.offsets_operand(), has_offsets=np.int64(w.offsets is not None),
                int4=np.int64(w.int4), x_int8=np.int64(int8_activations))
