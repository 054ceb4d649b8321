"""Random paged-attention batches for tests, benchmarks and device checks.

Builds a packed ragged batch the way the engine does (pages scattered over the pool, page-table
rows padded with ``SCRATCH_PAGE``, padded tokens and padded sequences) with fresh random
contents. With ``poison=True`` every cache slot no live token owns (scratch page, free pages,
the tail of each sequence's last page) and the padded query rows are filled with NaN / garbage,
so an implementation that reads or leaks them fails loudly.
"""
from __future__ import annotations

import contextlib
import dataclasses

import jax
import ml_dtypes
import numpy as np

from jaxrunner.kernels.blocks import SCRATCH_PAGE


@dataclasses.dataclass
class PagedCase:
    q: np.ndarray             # [T, Hq, D]
    k_pages: np.ndarray       # [P, page_size, Hkv, D]
    v_pages: np.ndarray
    kv_lens: np.ndarray       # [S] int32
    page_indices: np.ndarray  # [S, W] int32
    cu_q_lens: np.ndarray     # [S+1] int32
    num_seqs: np.ndarray      # int32 scalar
    q_lens: list
    live_kv_lens: list

    @property
    def num_live_tokens(self) -> int:
        return int(self.cu_q_lens[int(self.num_seqs)])

    def max_abs_score(self, sm_scale: float, soft_cap: float | None = None) -> float:
        """The largest ``|q . k| * sm_scale`` (soft-capped) of any live query row against its
        sequence's live cache rows: what ``kernels.tolerance`` scales with."""
        q = np.asarray(self.q, np.float32)
        group = q.shape[1] // self.k_pages.shape[2]
        top = 0.0
        for s, kv_len in enumerate(self.live_kv_lens):
            slots = np.arange(kv_len)
            pages = self.page_indices[s, slots // self.k_pages.shape[1]]
            k = np.asarray(self.k_pages[pages, slots % self.k_pages.shape[1]], np.float32)  # [L, Hkv, D]
            rows = q[self.cu_q_lens[s]:self.cu_q_lens[s + 1]]                               # [n, Hq, D]
            scores = np.einsum("nhd,lhd->nhl", rows, np.repeat(k, group, axis=1)) * sm_scale
            top = max(top, float(np.max(np.abs(scores), initial=0.0)))
        return min(top, soft_cap) if soft_cap is not None else top

    def args(self):
        return (self.q, self.k_pages, self.v_pages, self.kv_lens, self.page_indices,
                self.cu_q_lens, self.num_seqs)


def _to_dtype(x, dtype):
    if dtype in ("bfloat16", "bf16"):
        return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


def make_case(rng: np.random.Generator, q_lens, kv_lens, *, num_q_heads, num_kv_heads, head_dim,
              page_size, num_pages=None, width=None, num_tokens=None, max_seqs=None,
              dtype="float32", poison=True, scale=1.0) -> PagedCase:
    """A random packed batch. ``q_lens[i] <= kv_lens[i]``; padding up to ``num_tokens`` rows,
    ``max_seqs`` sequences and ``width`` page-table columns."""
    q_lens = [int(x) for x in q_lens]
    kv_lens = [int(x) for x in kv_lens]
    assert len(q_lens) == len(kv_lens) and all(0 < a <= b for a, b in zip(q_lens, kv_lens))
    n_live = len(q_lens)
    max_seqs = max_seqs or n_live
    pages_needed = [-(-n // page_size) for n in kv_lens]
    width = width or max(max(pages_needed, default=1), 1)
    assert width >= max(pages_needed, default=0)
    total = sum(pages_needed)
    num_pages = num_pages or total + 1 + max(2, total // 4)
    assert num_pages >= total + 1
    t_live = sum(q_lens)
    num_tokens = num_tokens or t_live
    assert num_tokens >= t_live and max_seqs >= n_live

    free = rng.permutation(np.arange(1, num_pages))  # SCRATCH_PAGE (0) is never owned
    page_indices = np.full((max_seqs, width), SCRATCH_PAGE, np.int32)
    owned = np.zeros((num_pages, page_size), bool)
    at = 0
    for s, (n, kvl) in enumerate(zip(pages_needed, kv_lens)):
        page_indices[s, :n] = free[at:at + n]
        at += n
        for i in range(kvl):
            owned[page_indices[s, i // page_size], i % page_size] = True

    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = rng.standard_normal(shape, dtype=np.float32) * scale
    v = rng.standard_normal(shape, dtype=np.float32)
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim), dtype=np.float32) * scale
    if poison:
        k[~owned] = np.nan
        v[~owned] = np.nan
        # padded query rows: finite garbage (the contract wants finite output for them)
        q[t_live:] = 1e3
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:n_live + 1] = np.cumsum(q_lens)
    cu[n_live + 1:] = t_live
    kv = np.zeros(max_seqs, np.int32)
    kv[:n_live] = kv_lens
    if poison and max_seqs > n_live:
        # garbage metadata for padded sequences: implementations must ignore it
        kv[n_live:] = rng.integers(0, width * page_size + 1, max_seqs - n_live)
        cu[n_live + 1:] = t_live + rng.integers(0, max(1, num_tokens - t_live) + 1,
                                                max_seqs - n_live)
    return PagedCase(_to_dtype(q, dtype), _to_dtype(k, dtype), _to_dtype(v, dtype), kv,
                     page_indices, cu, np.asarray(n_live, np.int32), q_lens, kv_lens)



ABSTRACT_DEVICES = {"cuda": ("NVIDIA H200", 132, "gpu"), "tpu": ("TPU v5 lite", 1, "tpu")}


def lowering_context(platform: str):
    """Context to lower for ``platform`` (``"cuda"`` or ``"tpu"``) on a host without that device.

    Lowering asks which device it lowers for: jax >= 0.11 refuses Triton kernels when no GPU is
    present, and Mosaic's lowering of some ops (``sign``) and jax's TPU kernels need the TPU
    generation. An abstract device (``jax.sharding.use_abstract_mesh``) stands in: an H200, a
    TPU v5e. Other platforms need nothing.
    """
    if platform not in ABSTRACT_DEVICES or not hasattr(jax.sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType  # lazy: older jax has no AbstractDevice

    kind, cores, plat = ABSTRACT_DEVICES[platform]
    device = AbstractDevice(device_kind=kind, num_cores=cores, platform=plat)
    mesh = AbstractMesh((1,), ("lowering",), axis_types=(AxisType.Explicit,),
                        abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"


def triton_modules(lowered) -> list[str]:
    """The Triton IR of every Pallas Triton kernel in ``lowered`` (a ``jax.stages.Lowered`` for
    cuda), as MLIR text with source locations.

    Pallas hands XLA each kernel as a custom call whose backend config carries the Triton module
    serialized as MLIR bytecode (``ir``); that is what XLA compiles, so this is the kernel as the
    device gets it. jax has no public way to print it: the bytecode is parsed in a context of
    jax's dialects plus Triton's (private ``jax._src`` names, as Pallas itself uses)."""
    from jax._src.interpreters import mlir as jax_mlir  # lazy: private, only this debugging aid needs them
    from jax._src.lib.triton import dialect as triton_dialect
    from jax.extend.mlir import ir

    blobs = []

    def visit(operation) -> None:
        for region in operation.regions:
            for block in region.blocks:
                for op in block.operations:
                    attrs = op.operation.attributes
                    if (op.operation.name == "stablehlo.custom_call"
                            and ir.StringAttr(attrs["call_target_name"]).value == TRITON_CALL_TARGET):
                        blobs.append(ir.StringAttr(ir.DictAttr(attrs["mhlo.backend_config"])["ir"]).value_bytes)
                    visit(op.operation)

    visit(lowered.compiler_ir("stablehlo").operation)
    context = jax_mlir.make_ir_context()
    triton_dialect.register_dialect(context)
    return [ir.Module.parse(blob, context=context).operation.get_asm(enable_debug_info=True, pretty_debug_info=True)
            for blob in blobs]
