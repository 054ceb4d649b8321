"""The linear layers' weights packed for oneDNN's matmul (``kernels.onednn_pack``), and back.

Where ``kernels.MatmulKernels.onednn_dtypes`` says so (chosen at start-up per CPU kind), a runner
packs its params once when it takes them: each layer's [in, out] matrices (the family's
``quantized_leaves``) and an untied output head. From then on their products, of every row count,
run on oneDNN without repacking the weight per call (``models.linear``). A tied embedding is not
packed: the token lookup reads it too, so packing it would hold the vocabulary twice, and at one
row (SmolLM2's head, bf16) the packed product was no faster than the native one-row kernel.

Where ``kernels.MatmulKernels.xla_weights_nk`` says so (their dtype, and enough inputs), the layer
weights (and an untied head) that stay on XLA's dot are held transposed instead, [out, in]
(:class:`TransposedWeight`): XLA:CPU's dot multiplied them faster that way (per CPU kind,
``kernels.platform_support.XLA_WEIGHTS_NK``).

Where ``kernels.MatmulKernels.weight_only_panels`` names the model's activation dtype (its final
norm's), the weight-only int8/int4 layer weights, and a tied embedding quantized to int8, are laid
out as panels of sixteen outputs instead (``kernels.PanelWeight``), which every product reads in
place: the native kernel's, and oneDNN's where it takes the rows (``models.linear``); the
embedding's token lookup reads its rows out of them (``models/layers.py``).

Where ``kernels.MatmulKernels.w8a8_tiles`` is set (a CPU with AMX-INT8), the ``"w8a8"`` layer
weights are laid out as AMX-INT8 tiles (``kernels.W8a8TileWeight``), whose products the native
kernel runs whole: the rounding of x to int8, the int8 product and the scales in one call.

The packed tree is what the jitted step reads; users see the plain one (:func:`unpack`,
:func:`plain_like`), bit for bit what was packed.
"""
from __future__ import annotations

import dataclasses

import jax

from jaxrunner import kernels
from jaxrunner.models import quant

HEAD = "lm_head"
EMBED = "embed"


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class TransposedWeight:
    """A [K, N] weight held as ``data`` [N, K], the orientation XLA:CPU's dot multiplied faster
    where ``MatmulKernels.xla_weights_nk`` is set (``models.linear`` contracts its last axis)."""
    data: jax.Array

    def tree_flatten(self):
        return (self.data,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(children[0])

    @property
    def plain_shape(self) -> tuple[int, int]:
        return self.data.shape[1], self.data.shape[0]

    @property
    def dtype(self):
        return self.data.dtype


def pack(params: dict, leaves: tuple[str, ...], matmuls: kernels.MatmulKernels) -> dict:
    """``params`` with the layer ``leaves`` and an untied output head packed where ``matmuls``
    packs their dtype and size, and the other float ones transposed where it names their dtype and
    they have enough inputs; where it lays weight-only ones out as panels for the model's dtype, those
    of the layers and a tied quantized embedding so; ``"w8a8"`` ones as AMX-INT8 tiles where it
    says so; the same tree when it changes nothing."""
    panels = _activation_dtype(params) in matmuls.weight_only_panels
    w8a8 = matmuls.w8a8_tiles and any(kernels.fits_w8a8_tiles(w) for layer in params["layers"] for w in layer.values())
    if not matmuls.onednn_dtypes and not matmuls.xla_weights_nk and not panels and not w8a8:
        return params

    def laid_out(w):
        if w8a8 and kernels.fits_w8a8_tiles(w):
            return kernels.to_w8a8_tiles(w)
        if quant.is_weight_only(w):
            return kernels.to_panels(w) if panels and kernels.fits_panels(w) else w
        if not (isinstance(w, jax.Array) and w.ndim == 2 and jax.numpy.issubdtype(w.dtype, jax.numpy.floating)):
            return w  # quantized leaves, biases, norms
        if w.dtype.name in matmuls.onednn_dtypes and w.nbytes >= matmuls.onednn_min_weight_bytes:
            return kernels.onednn_pack(w)
        if w.dtype.name in matmuls.xla_weights_nk and w.shape[0] >= matmuls.xla_weights_nk_min_inputs:
            return TransposedWeight(w.T)
        return w

    layers = [{name: laid_out(w) if name in leaves else w for name, w in layer.items()} for layer in params["layers"]]
    out = {**params, "layers": layers}
    if HEAD in params:
        out[HEAD] = laid_out(params[HEAD])
    if panels and quant.is_weight_only(params.get(EMBED)):  # a tied, quantized table: its logits read it whole
        out[EMBED] = laid_out(params[EMBED])
    return out


def _activation_dtype(params: dict) -> str | None:
    """The model's float dtype, as its final norm holds it (the activations' dtype)."""
    norm = params.get("final_norm")
    return norm.dtype.name if norm is not None else None


def is_packed(leaf) -> bool:
    """Whether ``leaf`` is laid out for the step (packed for oneDNN, transposed, as panels or tiles)."""
    return isinstance(leaf, (kernels.OnednnPackedWeight, TransposedWeight, kernels.PanelWeight, kernels.W8a8TileWeight))


def unpack(params: dict) -> dict:
    """The plain params a packed tree was made from (new arrays; the same tree when nothing is packed)."""
    def plain(w):
        if isinstance(w, TransposedWeight):
            return w.data.T
        if isinstance(w, kernels.PanelWeight):
            return kernels.from_panels(w)
        if isinstance(w, kernels.W8a8TileWeight):
            return kernels.from_w8a8_tiles(w)
        return kernels.onednn_unpack(w)
    return _map_packed(params, plain)


def plain_like(params: dict) -> dict:
    """The plain params' shapes, dtypes and shardings, without unpacking (packed leaves become
    ``jax.ShapeDtypeStruct``, a panel weight the plain leaf's dict of them)."""
    def like(w):
        if isinstance(w, (kernels.PanelWeight, kernels.W8a8TileWeight)):
            return w.plain_like()
        return jax.ShapeDtypeStruct(w.plain_shape, w.dtype, sharding=w.data.sharding)
    return _map_packed(params, like)


def _map_packed(params: dict, plain) -> dict:
    if not any(is_packed(leaf) for leaf in jax.tree.leaves(params, is_leaf=is_packed)):
        return params
    return jax.tree.map(lambda leaf: plain(leaf) if is_packed(leaf) else leaf, params, is_leaf=is_packed)
