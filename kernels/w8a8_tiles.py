"""``"w8a8"`` weights held as AMX-INT8 tiles, and their products (``cpu/w8a8_matmul.cc``).

A ``"w8a8"`` leaf (``{"q": int8 [K, N], "scale": float32 [N]}``, ``models/quant.py``) is held
as its 64 x 16 tiles in AMX's VNNI form, [N/16, K/64, 16, 16, 4] int8, K and N padded with zeros
to whole tiles. The native kernel then rounds x to int8, multiplies on AMX-INT8 and scales the
int32 sums in one call, where XLA ran a handful of small fusions around its int8 dot for every
product (docs/performance.md, "CPU model 207"). Laid out once at start-up
(``models.packed_weights``) where ``MatmulKernels.w8a8_tiles`` is set; users see the plain leaf
(:func:`from_w8a8_tiles`), bit for bit.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.kernels import native

TILE_N, TILE_K, QUAD = 16, 64, 4


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class W8a8TileWeight:
    """A ``"w8a8"`` leaf held as AMX-INT8 tiles (module docstring). ``k``: the weight's inputs
    before padding (its outputs are ``scale``'s length)."""
    tiles: jax.Array  # [ceil(N/16), ceil(K/64), 16, 16, 4] int8
    scale: jax.Array  # [N] float32
    k: int

    def tree_flatten(self):
        return (self.tiles, self.scale), self.k

    @classmethod
    def tree_unflatten(cls, k, children):
        return cls(*children, k)

    @property
    def n(self) -> int:
        return self.scale.shape[0]

    def plain_like(self) -> dict:
        """The plain leaf's shapes and dtypes (``jax.ShapeDtypeStruct``), without unpacking."""
        return {"q": jax.ShapeDtypeStruct((self.k, self.n), jnp.int8, sharding=self.tiles.sharding),
                "scale": jax.ShapeDtypeStruct((self.n,), self.scale.dtype, sharding=self.scale.sharding)}


def fits_w8a8_tiles(w) -> bool:
    """Whether ``w`` is a ``"w8a8"`` leaf the tiles can hold: int8 q [K, N], float32 scale [N]."""
    return (isinstance(w, dict) and set(w) == {"q", "scale"} and w["q"].ndim == 2 and w["q"].dtype == jnp.int8
            and w["scale"].dtype == jnp.float32 and w["scale"].shape == (w["q"].shape[1],))


def to_w8a8_tiles(w: dict) -> W8a8TileWeight:
    """The tile layout of a ``"w8a8"`` leaf; new arrays, on the leaf's device."""
    q = w["q"]
    k, n = q.shape
    blocks, steps = -(-n // TILE_N), -(-k // TILE_K)
    padded = jnp.pad(q, ((0, steps * TILE_K - k), (0, blocks * TILE_N - n)))
    # [steps, 16 quads, 4, blocks, 16] -> [blocks, steps, 16 quads, 16 outputs, 4]
    tiles = padded.reshape(steps, TILE_K // QUAD, QUAD, blocks, TILE_N).transpose(3, 0, 1, 4, 2)
    return W8a8TileWeight(tiles, w["scale"], k)


def from_w8a8_tiles(w: W8a8TileWeight) -> dict:
    """The ``"w8a8"`` leaf ``w`` was laid out from, bit for bit."""
    blocks, steps = w.tiles.shape[:2]
    q = w.tiles.transpose(1, 2, 4, 0, 3).reshape(steps * TILE_K, blocks * TILE_N)[:w.k, :w.n]
    return {"q": q, "scale": w.scale}


def w8a8_tile_matmul(x: jax.Array, w: W8a8TileWeight, min_scale: float) -> jax.Array:
    """``models.linear.w8a8_matmul`` of ``x`` [M, K] (bf16 or float32) on AMX-INT8, bit for bit:
    x rounded to int8 per row (scale max(max|x| / 127, ``min_scale``)), int32 sums, scaled back
    to ``x``'s dtype (see ``cpu/w8a8_matmul.cc``). Runs where ``native.w8a8_matmul_ready()``."""
    if not native.w8a8_matmul_ready():
        raise native.NativeKernelUnavailable("the AMX-INT8 matmul does not run here (no AMX-INT8 build, or AMX "
                                             "not granted)")
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float32) or x.shape[1] != w.k:
        raise ValueError(f"the AMX-INT8 matmul takes x bf16 or float32 [M, {w.k}]; got x {x.dtype}{list(x.shape)}")
    call = jax.ffi.ffi_call(native.W8A8_MATMUL_TARGET_NAME, jax.ShapeDtypeStruct((x.shape[0], w.n), x.dtype))
    return call(x, w.tiles, w.scale, min_scale=np.float32(min_scale))
