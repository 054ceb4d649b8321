"""The linear layers' weights packed for oneDNN's matmul (``kernels.onednn_pack``), and back.

Where ``kernels.MatmulKernels.onednn_dtypes`` says so (chosen at start-up per CPU kind), a runner
packs its params once when it takes them: each layer's [in, out] matrices (the family's
``quantized_leaves``) and an untied output head. From then on their products, of every row count,
run on oneDNN without repacking the weight per call (``models.linear``). A tied embedding is not
packed: the token lookup reads it too, so packing it would hold the vocabulary twice, and at one
row (SmolLM2's head, bf16) the packed product was no faster than the native one-row kernel.

The packed tree is what the jitted step reads; users see the plain one (:func:`unpack`,
:func:`plain_like`), bit for bit what was packed.
"""
from __future__ import annotations

import jax

from jaxrunner import kernels

HEAD = "lm_head"


def pack(params: dict, leaves: tuple[str, ...], matmuls: kernels.MatmulKernels) -> dict:
    """``params`` with the layer ``leaves`` and an untied output head packed where ``matmuls``
    packs their dtype and size; the same tree when it packs nothing."""
    if not matmuls.onednn_dtypes:
        return params

    def packs(w) -> bool:
        return (isinstance(w, jax.Array) and w.ndim == 2 and w.dtype.name in matmuls.onednn_dtypes
                and w.nbytes >= matmuls.onednn_min_weight_bytes)

    layers = [{name: kernels.onednn_pack(w) if name in leaves and packs(w) else w for name, w in layer.items()}
              for layer in params["layers"]]
    out = {**params, "layers": layers}
    if HEAD in params and packs(params[HEAD]):
        out[HEAD] = kernels.onednn_pack(params[HEAD])
    return out


def is_packed(leaf) -> bool:
    return isinstance(leaf, kernels.OnednnPackedWeight)


def unpack(params: dict) -> dict:
    """The plain params a packed tree was made from (new arrays; the same tree when nothing is packed)."""
    return _map_packed(params, kernels.onednn_unpack)


def plain_like(params: dict) -> dict:
    """The plain params' shapes, dtypes and shardings, without unpacking (packed leaves become
    ``jax.ShapeDtypeStruct``)."""
    return _map_packed(params, lambda w: jax.ShapeDtypeStruct(w.plain_shape, w.dtype, sharding=w.data.sharding))


def _map_packed(params: dict, plain) -> dict:
    if not any(is_packed(leaf) for leaf in jax.tree.leaves(params, is_leaf=is_packed)):
        return params
    return jax.tree.map(lambda leaf: plain(leaf) if is_packed(leaf) else leaf, params, is_leaf=is_packed)
