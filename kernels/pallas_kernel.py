"""Ragged paged attention as Pallas kernels (GPU via Triton, TPU via Mosaic).

Shared structure
----------------
The wrapper (plain XLA, all O(T * Hq * D) or O(S)) cuts the packed query rows into blocks of
``block_q`` rows of ONE sequence (:mod:`jaxrunner.kernels.blocks`), gathers the queries into
``[NB, Hkv, block_q * G, D]`` (row ``j * G + g`` = token ``j`` of the block, query head ``g`` of
the group sharing kv head ``h``), runs the kernel, and gathers the outputs back to token rows.
Doing the ragged -> block re-layout outside the kernel keeps the kernel's query/output tiles
dense and aligned, and a block never writes rows that belong to another sequence. All the
GQA query heads of a kv head are one tile, so each K/V tile is read once per group, not per head.

Inside, one program owns (query block, kv head) and runs a flash-attention online softmax over
its sequence's cache, visiting only pages up to the block's last query position (and from the
first position inside the sliding window), so work scales with the real ``kv_len``, not with the
page-table width. Scores, the running max/sum and the accumulator are float32; ``p`` is cast to
the cache dtype for the PV matmul (standard flash-attention practice; bf16 error ~1e-3).
Float32 caches ask for ``Precision.HIGHEST`` dots: Triton's default for float32 operands is
TF32 (~1e-3 error), which the start-up self-check's tolerance (``kernels.tolerance``) refuses.
Non-owned cache slots (beyond ``kv_len``) may hold anything, even NaN: scores are masked with a
select, and V rows beyond ``kv_len`` are never loaded (masked loads) or zeroed before the PV
matmul.

GPU specifics: the scores carry log2(e) (folded into ``sm_scale``), so the softmax uses
``exp2``; ``num_stages=3`` lets Triton pipeline the page-table load that feeds the K/V
addresses (at 2 stages it does not); programs run on 4 warps up to 128 x 128 accumulators.
Shared memory is budgeted before lowering: Triton refuses a kernel over the device's limit only
when it compiles (a failed start-up, not a fallback), so :func:`choose_gpu_tiles` shortens
``block_k`` (and :func:`gpu_max_rows` the query tiles) until :func:`shared_memory_estimate`, one
buffer per dot operand as measured on an H200, fits the limit of the device's compute
capability. On an H200 only float32 head_dim 256 prefill tiles need it; GPUs with 99 KiB
(sm_86/89/120) need it for float32 head_dim 128 and bf16 head_dim 256 too.

Split-KV: a decode batch of few (query block, kv head) programs -- batch 1 of SmolLM2 is 3 --
leaves most SMs idle. :func:`choose_num_splits` picks, at trace time from the shapes, a segment
axis for the grid: each program walks one contiguous share of its block's live kv tiles and
writes its normalised output and log2-sum-exp2; :func:`merge_splits` combines them in XLA.

GPU: why Triton and not Mosaic GPU
----------------------------------
Pallas' default GPU backend in jax 0.10 is Mosaic GPU; we pass
``jax.experimental.pallas.triton.CompilerParams`` to get the Triton backend instead, because:

* a paged cache needs a data-dependent row gather. Mosaic GPU's lowering rejects array indexers
  ("Arrays are not supported as indices", checked in jax 0.10.2), so every page would have to be
  its own TMA ``copy_gmem_to_smem`` driven by a scalar page id; a first attempt at exactly that
  stopped at Mosaic GPU's copy constraints ("Only copies transferring a number of bytes
  divisible by the warpgroup size are supported") before any compute was written;
* Mosaic GPU computes in warpgroup (wgmma) tiles with M = 64, while a decode block has only
  ``G`` (1..8) query rows per kv head;
* Triton takes all of it natively: ``k_ref[slots, h, :]`` with ``slots`` computed from a vector
  load of the page table is one pointer-tensor load, ``fori_loop`` with data-dependent bounds
  becomes an ``scf.for`` Triton can software-pipeline, and small M is padded to 16 rows for
  ``tl.dot``. KV tiles are ``block_k`` (default 64) cache rows regardless of ``page_size``, so
  page sizes 8..128 all give full-width tiles.

The test suite runs where there is no GPU: the kernel is tested in interpret mode and its
lowering to Triton IR is tested (jax 0.10, and the newest jax in CI's second environment, which
needs an abstract GPU to lower without one and warns that its Pallas Triton backend is
deprecated). ``scripts/device_check.sh`` compiles and runs it on a GPU; its H200 results are in
``benchmarks/device/``.

TPU: Mosaic with scalar prefetch
--------------------------------
On TPU the page table, per-block sequence ids and lengths go through scalar prefetch
(``PrefetchScalarGridSpec``) into SMEM, where the K/V BlockSpec index maps read them. The grid
is ``(query block, kv step)``; a step covers ``pages_per_step`` pages (enough for >= 128 cache
rows, amortising the ~0.35 us per-step cost), each page its own BlockSpec over the same pool so
the pipeline double-buffers every page DMA. The index map returns the pool page
``page_indices[seq, clamp(col, first, last)]``: clamping to the block's needed pages makes grid
steps past them repeat the previous block index, so no DMA is issued, and ``pl.when`` skips
their compute. Pages are fetched whole (``[page_size * Hkv, D]``, the pool's native layout, a
free reshape), so each page is DMA'd once for all kv heads, and head ``h`` is the strided row
slice ``h::Hkv`` (``tpu.strided_load``). Query / output tiles pad rows to the sublane tile
(8 f32, 16 bf16). This path is verified to *lower* from this CPU-only machine and to be correct
in interpret mode; Mosaic's final compile happens only on a TPU and has not been exercised.
Known risk there: strided sublane loads of packed bf16 rows (public TPU kernels bitcast to
uint32 for that); if Mosaic rejects them, fetch per-head via manual DMA instead.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxrunner.kernels.blocks import choose_block_q, query_blocks, sanitize

_NEG_INF = float("-inf")
LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)

# Split-KV: a decode batch of few (query block, kv head) programs leaves most of a large GPU idle,
# so the kv range of each block is cut into segments that run as programs of their own and are
# merged afterwards by their log-sum-exp. The split count is picked at trace time from the shapes:
# enough programs to give every SM of a large GPU (132 on an H200) about two, with each segment
# still at least MIN_TILES_PER_SPLIT kv tiles long (the merge costs an f32 write per segment).
FILL_PROGRAMS = 264
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64

# Shared memory a Triton program may use (the opt-in maximum per block), by CUDA compute
# capability. Triton refuses a kernel over it only when it compiles, on the device, so the tiles
# are chosen to fit before lowering (see :func:`choose_gpu_tiles`).
SHARED_MEMORY_BYTES = {(7, 0): 96 << 10, (7, 5): 64 << 10, (8, 0): 163 << 10, (8, 6): 99 << 10,
                       (8, 7): 163 << 10, (8, 9): 99 << 10, (9, 0): 227 << 10, (10, 0): 227 << 10,
                       (12, 0): 99 << 10}
DEFAULT_SHARED_MEMORY_BYTES = 99 << 10  # unknown GPU, or lowering without one: the smallest recent part
SHARED_MEMORY_SLACK = 1 << 10            # barriers and alignment beside the tiles (768 bytes measured)
# K/V tile rows from the default down: shorter tiles are what frees shared memory (the stages do
# not, see shared_memory_estimate).
GPU_BLOCK_K_LADDER = (64, 32, 16)
GPU_NUM_STAGES = 3


def dot_precision(dtype):
    """The precision the kernels ask of their dots: ``HIGHEST`` for float32 caches (full-precision
    dots; Triton would otherwise run them on TF32, ~1e-3 error), the default for 16-bit ones."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _div(x, d: int):
    """Integer division of NON-NEGATIVE ``x`` by a static ``d``: a plain truncating divide.
    (``//`` lowers to a sign-corrected floor division; Mosaic's ``sign`` lowering needs a real
    TPU to query, which breaks lowering from a CPU host.)"""
    return jax.lax.div(x, jnp.asarray(d, jnp.int32))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# --------------------------------------------------------------------------------------------
# wrapper: ragged tokens -> query blocks -> kernel -> token rows
# --------------------------------------------------------------------------------------------

def _prepare(q, k_pages, kv_lens, page_indices, cu_q_lens, num_seqs, block_q, row_multiple,
             pow2_rows, max_rows):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    n_seq = page_indices.shape[0]
    group = num_q_heads // num_kv_heads
    cu, q_lens, kv, _ = sanitize(kv_lens, cu_q_lens, num_seqs)
    # Blocks: on an accelerator streaming a K/V tile costs far more than a query row of MXU /
    # tensor-core work, so favour big blocks (kv_weight) up to ``max_rows`` tile rows (register /
    # VMEM budget of the accumulator); decode-only batches still get block_q = 1.
    bq = block_q or choose_block_q(num_tokens, n_seq, group, kv_weight=64.0,
                                   max_block_q=max(1, max_rows // group))
    qb = query_blocks(cu, q_lens, num_tokens, bq)
    nb = qb.num_blocks
    rows = bq * group
    if pow2_rows:   # Triton: power-of-two tiles, tl.dot needs M >= 16
        rows_pad = max(row_multiple, _next_pow2(rows))
    else:           # Mosaic: whole sublane tiles (8 rows f32, 16 rows bf16)
        rows_pad = -(-rows // row_multiple) * row_multiple
    meta = dict(
        seq=qb.block_seq,
        qpos0=kv[qb.block_seq] - q_lens[qb.block_seq] + qb.block_start,
        nrows=qb.block_rows,
        kvl=kv[qb.block_seq],
    )
    qblk = q[qb.row_token].reshape(nb, bq, num_kv_heads, group, head_dim)
    qblk = qblk.transpose(0, 2, 1, 3, 4).reshape(nb, num_kv_heads, rows, head_dim)
    if rows_pad != rows:
        qblk = jnp.pad(qblk, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))
    return qb, meta, qblk, bq, rows, rows_pad


def _finish(out, qb, bq, rows, num_q_heads, dtype):
    nb, num_kv_heads, _, head_dim = out.shape
    group = num_q_heads // num_kv_heads
    out = out[:, :, :rows].reshape(nb, num_kv_heads, bq, group, head_dim)
    out = out.transpose(0, 2, 1, 3, 4).reshape(nb * bq, num_q_heads, head_dim)
    return out[qb.token_row].astype(dtype)


def _row_positions(qpos0, nrows, rows_pad, group):
    """Per tile row: absolute query position and whether the row is live."""
    r = jax.lax.broadcasted_iota(jnp.int32, (rows_pad, 1), 0)
    j = _div(r, group)
    return qpos0 + j, j < nrows


def _kv_range(qpos0, nrows, kvl, sliding_window):
    """[lo, hi) cache positions any live row of the block may attend to."""
    hi = jnp.minimum(kvl, qpos0 + nrows)
    hi = jnp.where(nrows > 0, hi, 0)
    lo = jnp.int32(0)
    if sliding_window is not None:
        lo = jnp.maximum(qpos0 - (sliding_window - 1), 0)
    return lo, hi


def _online_update(carry, s, v, mask, v_live, exp=jnp.exp):
    """One flash-attention step. s [R, Bk] f32 (masked below), v [Bk, D] cache dtype; m and l
    are [R, 1]. ``exp`` is ``jnp.exp2`` when the scores carry the log2(e) factor (GPU).
    ``v_live`` None: V rows past ``kv_len`` were already zeroed by a masked load."""
    m_prev, l_prev, acc = carry
    s = jnp.where(mask, s, _NEG_INF)
    m_cur = jnp.max(s, axis=1, keepdims=True)
    m_new = jnp.maximum(m_prev, m_cur)
    m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
    alpha = exp(m_prev - m_safe)
    p = jnp.where(mask, exp(s - m_safe), 0.0)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    if v_live is not None:
        v = jnp.where(v_live, v, jnp.zeros_like(v))
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=dot_precision(v.dtype), preferred_element_type=jnp.float32)
    return m_new, l_new, acc * alpha + pv


def _scores(q, k, sm_scale, soft_cap, log2_domain=False):
    """Scaled (and soft-capped) scores, f32. ``log2_domain``: times log2(e), for ``exp2``; without
    a soft cap the factor is folded into the scale, so it costs nothing."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=dot_precision(q.dtype),
                            preferred_element_type=jnp.float32)
    if soft_cap is None:
        return s * (sm_scale * LOG2E if log2_domain else sm_scale)
    s = soft_cap * jnp.tanh(s * (sm_scale / soft_cap))
    return s * LOG2E if log2_domain else s


# --------------------------------------------------------------------------------------------
# GPU (Triton) kernel
# --------------------------------------------------------------------------------------------

def _split_tiles(t_lo, t_hi, num_splits):
    """This program's share ``[lo, hi)`` of the kv tiles ``[t_lo, t_hi)`` (grid axis 2)."""
    if num_splits == 1:
        return t_lo, t_hi
    split = pl.program_id(2)
    per = _div(jnp.maximum(t_hi - t_lo, 0) + num_splits - 1, num_splits)
    lo = t_lo + split * per
    return lo, jnp.minimum(t_hi, lo + per)


def _gpu_kernel(seq_ref, qpos0_ref, nrows_ref, kvl_ref, pt_ref, q_ref, k_ref, v_ref, o_ref,
                *lse_ref, sm_scale, sliding_window, soft_cap, group, page_size, width, block_k,
                num_pages, num_splits, masked_loads):
    from jax.experimental.pallas import triton as plgpu  # lazy: Triton's Pallas backend exists only where jax ships it

    b = pl.program_id(0)
    h = pl.program_id(1)
    seq = seq_ref[b]
    qpos0 = qpos0_ref[b]
    nrows = nrows_ref[b]
    kvl = kvl_ref[b]
    q = q_ref[...]                                              # [R, D]
    rows_pad, head_dim = q.shape
    qpos, row_live = _row_positions(qpos0, nrows, rows_pad, group)
    lo, hi = _kv_range(qpos0, nrows, kvl, sliding_window)
    t_lo, t_hi = _split_tiles(_div(lo, block_k), _div(hi + block_k - 1, block_k), num_splits)

    def body(t, carry):
        l_idx = t * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        col = jnp.minimum(_div(l_idx, page_size), width - 1)
        page = pt_ref[seq, col]                                 # [Bk] page-table gather
        page = jnp.minimum(jnp.maximum(page, 0), num_pages - 1)  # never fault on bad input
        slots = page * page_size + jax.lax.rem(l_idx, jnp.int32(page_size))
        live = (l_idx < kvl)[:, None]
        if masked_loads:  # rows past kv_len are neither read nor allowed to leak (NaN * 0)
            full = jnp.broadcast_to(live, (block_k, head_dim))
            k = plgpu.load(k_ref.at[slots, h, :], mask=full, other=0.0)   # [Bk, D] row gather
            v = plgpu.load(v_ref.at[slots, h, :], mask=full, other=0.0)
            v_live = None
        else:
            k = k_ref[slots, h, :]
            v = v_ref[slots, h, :]
            v_live = live
        s = _scores(q, k, sm_scale, soft_cap, log2_domain=True)
        lrow = l_idx[None, :]
        mask = (lrow <= qpos) & (lrow < kvl) & row_live
        if sliding_window is not None:
            mask &= lrow > qpos - sliding_window
        return _online_update(carry, s, v, mask, v_live, exp=jnp.exp2)

    init = (jnp.full((rows_pad, 1), _NEG_INF, jnp.float32),
            jnp.zeros((rows_pad, 1), jnp.float32),
            jnp.zeros((rows_pad, head_dim), jnp.float32))
    m, l_sum, acc = jax.lax.fori_loop(t_lo, t_hi, body, init)
    o_ref[...] = (acc / jnp.where(l_sum == 0, 1.0, l_sum)).astype(o_ref.dtype)
    if lse_ref:  # split-KV: this segment's log2-sum-exp2, -inf when it saw no kv
        lse = jnp.where(l_sum == 0, _NEG_INF, m + jnp.log2(jnp.where(l_sum == 0, 1.0, l_sum)))
        lse_ref[0][...] = lse[:, 0]


def shared_memory_limit(device=None) -> int:
    """Bytes of shared memory a Triton program may use on ``device`` (default: the first device
    of the default backend): read from its compute capability, else the conservative default
    (also when lowering from a machine without a GPU)."""
    if device is None:
        if jax.default_backend() != "gpu":
            return DEFAULT_SHARED_MEMORY_BYTES
        device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)  # "9.0" on CUDA devices
    try:
        major, minor = (int(part) for part in str(capability).split(".")[:2])
    except ValueError:
        return DEFAULT_SHARED_MEMORY_BYTES
    return SHARED_MEMORY_BYTES.get((major, minor), DEFAULT_SHARED_MEMORY_BYTES)


def shared_memory_estimate(head_dim: int, itemsize: int, rows_pad: int, block_k: int,
                           num_stages: int = 1) -> int:
    """Bytes of shared memory one program of the Triton kernel asks for: one buffer per ``tl.dot``
    operand (the query tile, the K and V tiles, the probabilities), in the cache dtype, and
    ``SHARED_MEMORY_SLACK`` for barriers. ``num_stages`` adds nothing: the K/V loads are gathers
    through registers, not pipelined copies, so Triton keeps one buffer of each whatever the
    stages. Measured on an H200 (jax 0.11.2): for head_dim 256, float32, 128 rows and
    ``block_k`` 64, Triton asked for 295,680 bytes, this sum exactly; every tile set whose sum fit
    the limit compiled, whatever its stages."""
    del num_stages
    tiles = rows_pad * head_dim + 2 * block_k * head_dim + rows_pad * block_k
    return tiles * itemsize + SHARED_MEMORY_SLACK


def choose_gpu_tiles(head_dim: int, itemsize: int, rows_pad: int, limit: int,
                     block_k: int | None = None, num_stages: int | None = None) -> tuple[int, int]:
    """``(block_k, num_stages)``: the longest K/V tile of ``GPU_BLOCK_K_LADDER`` (or the caller's
    ``block_k``) whose shared memory fits in ``limit`` bytes, and ``num_stages`` (default
    ``GPU_NUM_STAGES``). Raises ValueError when nothing fits."""
    stages = num_stages or GPU_NUM_STAGES
    ladder = (block_k,) if block_k else GPU_BLOCK_K_LADDER
    for bk in ladder:
        if shared_memory_estimate(head_dim, itemsize, rows_pad, bk) <= limit:
            return bk, stages
    bk = ladder[-1]
    raise ValueError(
        f"the Triton kernel needs about {shared_memory_estimate(head_dim, itemsize, rows_pad, bk)} bytes "
        f"of shared memory for head_dim {head_dim}, a {itemsize}-byte cache, {rows_pad}-row query tiles and "
        f"block_k {bk}; the device allows {limit}")


def gpu_num_warps(rows_pad: int, head_dim: int) -> int:
    """Warps per program: 4, and 8 once the float32 accumulator ``[rows, D]`` passes 128 x 128
    (more registers to hold it). On an H200, 128 x 128 bf16 prefill tiles ran faster on 4 warps
    than on 8 (``benchmarks/device/``); larger accumulators were not timed."""
    return 8 if rows_pad * head_dim > 128 * 128 else 4


def gpu_max_rows(head_dim: int, itemsize: int, limit: int) -> int:
    """The most query rows a Triton tile may have (128 where it fits): the largest whose shared
    memory still leaves room for 32-row K/V tiles."""
    return next((rows for rows in (128, 64, 32)
                 if shared_memory_estimate(head_dim, itemsize, rows, 32) <= limit), 16)


def choose_num_splits(num_programs: int, max_kv_tiles: int) -> int:
    """Split-KV segments per (query block, kv head), from static shapes (see FILL_PROGRAMS)."""
    if num_programs >= FILL_PROGRAMS:
        return 1
    wanted = -(-FILL_PROGRAMS // num_programs)
    return max(1, min(wanted, max_kv_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


def merge_splits(o, lse):
    """Merge split-KV segments: o [..., S, R, D] f32 (each normalised by its own sum), lse
    [..., S, R] log2-sum-exp2 of each segment (-inf: empty). Returns [..., R, D] f32."""
    top = jnp.max(lse, axis=-2, keepdims=True)
    top = jnp.where(top == _NEG_INF, 0.0, top)
    w = jnp.exp2(lse - top)                                     # 0 for empty segments
    total = jnp.sum(w, axis=-2)
    out = jnp.sum(w[..., None] * o, axis=-3)
    return out / jnp.where(total == 0, 1.0, total)[..., None]


def _gpu_call(meta, page_indices, qblk, k_pages, v_pages, *, sm_scale, sliding_window, soft_cap,
              group, block_k, num_warps, num_stages, num_splits, masked_loads, interpret,
              shared_memory_bytes):
    from jax.experimental.pallas import triton as plgpu  # lazy: Triton's Pallas backend exists only where jax ships it

    nb, num_kv_heads, rows_pad, head_dim = qblk.shape
    num_pages, page_size = k_pages.shape[:2]
    width = page_indices.shape[1]
    block_k, num_stages = choose_gpu_tiles(head_dim, jnp.dtype(k_pages.dtype).itemsize, rows_pad,
                                           shared_memory_bytes, block_k, num_stages)
    if num_splits is None:
        num_splits = choose_num_splits(nb * num_kv_heads, -(-width * page_size // block_k))
    if num_warps is None:
        num_warps = gpu_num_warps(rows_pad, head_dim)
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    kernel = functools.partial(
        _gpu_kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        group=group, page_size=page_size, width=width, block_k=block_k, num_pages=num_pages,
        num_splits=num_splits, masked_loads=masked_loads and not interpret)
    whole = pl.no_block_spec  # small metadata and the pools: whole arrays, indexed in-kernel
    q_tile = pl.BlockSpec((None, None, rows_pad, head_dim), lambda b, h, *_: (b, h, 0, 0))
    if num_splits == 1:
        out_specs, out_shape = q_tile, jax.ShapeDtypeStruct(qblk.shape, qblk.dtype)
    else:
        seg = (nb, num_kv_heads, num_splits, rows_pad)
        out_specs = [pl.BlockSpec((None, None, None, rows_pad, head_dim),
                                  lambda b, h, s: (b, h, s, 0, 0)),
                     pl.BlockSpec((None, None, None, rows_pad), lambda b, h, s: (b, h, s, 0))]
        out_shape = [jax.ShapeDtypeStruct(seg + (head_dim,), jnp.float32),
                     jax.ShapeDtypeStruct(seg, jnp.float32)]
    out = pl.pallas_call(
        kernel,
        grid=(nb, num_kv_heads, num_splits) if num_splits > 1 else (nb, num_kv_heads),
        in_specs=[whole] * 5 + [q_tile, whole, whole],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_triton",
    )(meta["seq"], meta["qpos0"], meta["nrows"], meta["kvl"], page_indices, qblk,
      k_pages.reshape(flat), v_pages.reshape(flat))
    if num_splits == 1:
        return out
    return merge_splits(*out).astype(qblk.dtype)


# --------------------------------------------------------------------------------------------
# TPU (Mosaic) kernel
# --------------------------------------------------------------------------------------------

def _tpu_block_range(b, seq_ref, qpos0_ref, nrows_ref, kvl_ref, page_size, sliding_window):
    lo, hi = _kv_range(qpos0_ref[b], nrows_ref[b], kvl_ref[b], sliding_window)
    first = _div(lo, page_size)
    last = jnp.maximum(_div(hi + page_size - 1, page_size) - 1, first)
    return first, last, hi > lo


def _tpu_kv_index_map(b, w, seq_ref, qpos0_ref, nrows_ref, kvl_ref, pt_ref, *, page_size, width,
                      sliding_window, sub, pages_per_step, num_pages):
    first, last, _ = _tpu_block_range(b, seq_ref, qpos0_ref, nrows_ref, kvl_ref, page_size,
                                      sliding_window)
    # Clamp into [first, last]: grid steps outside it keep the same block index, so the
    # pipeline issues no DMA for them (and the kernel skips their compute).
    col = jnp.minimum(jnp.maximum(w * pages_per_step + sub, first), last)
    col = jnp.minimum(col, width - 1)
    page = pt_ref[seq_ref[b] * width + col]
    return jnp.minimum(jnp.maximum(page, 0), num_pages - 1), 0, 0


def _tpu_kernel(seq_ref, qpos0_ref, nrows_ref, kvl_ref, pt_ref, q_ref, *rest, sm_scale,
                sliding_window, soft_cap, group, page_size, num_kv_heads, pages_per_step):
    kv_refs = rest[:2 * pages_per_step]
    o_ref, m_ref, l_ref, acc_ref = rest[2 * pages_per_step:]
    b = pl.program_id(0)
    w = pl.program_id(1)
    qpos0 = qpos0_ref[b]
    nrows = nrows_ref[b]
    kvl = kvl_ref[b]
    rows_pad = q_ref.shape[1]
    first, last, any_kv = _tpu_block_range(b, seq_ref, qpos0_ref, nrows_ref, kvl_ref,
                                           page_size, sliding_window)

    @pl.when(w == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    qpos, row_live = _row_positions(qpos0, nrows, rows_pad, group)
    for sub in range(pages_per_step):
        col = w * pages_per_step + sub
        k_ref, v_ref = kv_refs[2 * sub], kv_refs[2 * sub + 1]

        @pl.when(any_kv & (col >= first) & (col <= last))
        def _step():
            l_idx = col * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
            mask = (l_idx <= qpos) & (l_idx < kvl) & row_live
            if sliding_window is not None:
                mask &= l_idx > qpos - sliding_window
            v_live = jax.lax.broadcasted_iota(jnp.int32, (page_size, 1), 0) + col * page_size < kvl
            for h in range(num_kv_heads):
                # head h of a [page_size * Hkv, D] page is the strided row slice h::Hkv
                rows = pl.ds(h, page_size, stride=num_kv_heads) if num_kv_heads > 1 \
                    else pl.ds(0, page_size)
                k = k_ref[rows, :]
                v = v_ref[rows, :]
                s = _scores(q_ref[h], k, sm_scale, soft_cap)
                carry = (m_ref[h], l_ref[h], acc_ref[h])
                m_new, l_new, acc_new = _online_update(carry, s, v, mask, v_live)
                m_ref[h] = m_new
                l_ref[h] = l_new
                acc_ref[h] = acc_new

    @pl.when(w == pl.num_programs(1) - 1)
    def _done():
        l_sum = l_ref[...]
        o_ref[...] = (acc_ref[...] / jnp.where(l_sum == 0, 1.0, l_sum)).astype(o_ref.dtype)


def _tpu_call(meta, page_indices, qblk, k_pages, v_pages, *, sm_scale, sliding_window, soft_cap,
              group, interpret, pages_per_step=None):
    from jax.experimental.pallas import tpu as pltpu  # lazy: Mosaic's Pallas backend matters only for TPU

    nb, num_kv_heads, rows_pad, head_dim = qblk.shape
    num_pages, page_size = k_pages.shape[:2]
    width = page_indices.shape[1]
    # Several pages per grid step amortise the per-step overhead (~0.35 us): aim at >= 128
    # cache rows per step. Each page is its own BlockSpec of the same pool, so the pipeline
    # double-buffers every page DMA.
    pps = pages_per_step or max(1, min(width, 128 // page_size))
    steps = -(-width // pps)
    flat = (num_pages, page_size * num_kv_heads, head_dim)
    common = dict(page_size=page_size, width=width, sliding_window=sliding_window,
                  pages_per_step=pps, num_pages=num_pages)
    kv_specs = []
    for sub in range(pps):
        spec = pl.BlockSpec((None, page_size * num_kv_heads, head_dim),
                            functools.partial(_tpu_kv_index_map, sub=sub, **common))
        kv_specs += [spec, spec]
    q_spec = pl.BlockSpec((None, num_kv_heads, rows_pad, head_dim), lambda b, w, *_: (b, 0, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(nb, steps),
        in_specs=[q_spec] + kv_specs,
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((num_kv_heads, rows_pad, 1), jnp.float32),
                        pltpu.VMEM((num_kv_heads, rows_pad, 1), jnp.float32),
                        pltpu.VMEM((num_kv_heads, rows_pad, head_dim), jnp.float32)],
    )
    kernel = functools.partial(
        _tpu_kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        group=group, page_size=page_size, num_kv_heads=num_kv_heads, pages_per_step=pps)
    kf = k_pages.reshape(flat)
    vf = v_pages.reshape(flat)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qblk.shape, qblk.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(meta["seq"], meta["qpos0"], meta["nrows"], meta["kvl"], page_indices.reshape(-1), qblk,
      *([kf, vf] * pps))


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------

def _prepare_gpu(q, k_pages, kv_lens, page_indices, cu_q_lens, num_seqs, block_q, limit):
    itemsize = jnp.dtype(k_pages.dtype).itemsize
    return _prepare(q, k_pages, kv_lens, page_indices, cu_q_lens, num_seqs, block_q, row_multiple=16,
                    pow2_rows=True, max_rows=gpu_max_rows(q.shape[-1], itemsize, limit))


def gpu_kernel_alone(args, *, sm_scale, sliding_window=None, soft_cap=None, block_q=None,
                     interpret=None, shared_memory_bytes=None, **tuning):
    """The GPU path's Triton call (and split-KV merge) apart from its wrapper, for timing the
    kernel alone (``scripts/device_check.py``): ``(kernel, inputs)``, where ``inputs`` are the
    wrapper's outputs for ``args`` (the usual seven arrays), computed once, and ``kernel`` a
    jitted function of them. ``tuning``: ``block_k``, ``num_warps``, ``num_stages``,
    ``num_splits``, ``masked_loads``, as for :func:`ragged_paged_attention_pallas`."""
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs = args
    limit = shared_memory_bytes or shared_memory_limit()
    page_indices = jnp.asarray(page_indices, jnp.int32)

    def prepare(q, kv_lens, page_indices, cu_q_lens, num_seqs):
        _, meta, qblk, *_ = _prepare_gpu(q, k_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                         block_q, limit)
        return meta, qblk

    meta, qblk = jax.jit(prepare)(q, kv_lens, page_indices, cu_q_lens, num_seqs)
    options = dict(block_k=None, num_warps=None, num_stages=None, num_splits=None,
                   masked_loads=True) | tuning
    kernel = jax.jit(functools.partial(
        _gpu_call, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        group=q.shape[1] // k_pages.shape[2], shared_memory_bytes=limit,
        interpret=jax.default_backend() == "cpu" if interpret is None else interpret, **options))
    return kernel, (meta, page_indices, qblk, k_pages, v_pages)


def _default_backend_variant() -> str:
    return "tpu" if jax.default_backend() == "tpu" else "gpu"


def ragged_paged_attention_pallas(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                  num_seqs, *, sm_scale, sliding_window=None, soft_cap=None,
                                  variant=None, interpret=None, block_q=None, block_k=None,
                                  num_warps=None, num_stages=None, num_splits=None,
                                  masked_loads=True, shared_memory_bytes=None):
    """Pallas ragged paged attention.

    ``variant``: "gpu" (Triton) or "tpu" (Mosaic); default from the backend. ``interpret``:
    default True on CPU (tests), False elsewhere. GPU tuning (static): ``block_k`` cache rows
    per tile (None: the longest of ``GPU_BLOCK_K_LADDER`` whose tiles fit the device's shared
    memory, ``shared_memory_bytes``, None: :func:`shared_memory_limit`) and ``num_stages``
    (None: 3, so the page-table load that feeds the K/V addresses is pipelined too; at 2 Triton
    does not pipeline a load whose result feeds other load addresses);
    ``num_warps`` (None: :func:`gpu_num_warps`); ``num_splits`` split-KV
    segments (None: :func:`choose_num_splits`); ``masked_loads`` False: load whole tiles and
    zero dead V rows with a select instead (always so in interpret mode, whose discharge of a
    masked gather load is not implemented; the masked form is covered by lowering tests).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = num_q_heads // num_kv_heads
    variant = variant or _default_backend_variant()
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    page_indices = jnp.asarray(page_indices, jnp.int32)
    if variant == "gpu":
        limit = shared_memory_bytes or shared_memory_limit()
        qb, meta, qblk, bq, rows, _ = _prepare_gpu(q, k_pages, kv_lens, page_indices, cu_q_lens,
                                                  num_seqs, block_q, limit)
        out = _gpu_call(meta, page_indices, qblk, k_pages, v_pages, sm_scale=sm_scale,
                        sliding_window=sliding_window, soft_cap=soft_cap, group=group,
                        block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                        num_splits=num_splits, masked_loads=masked_loads, interpret=interpret,
                        shared_memory_bytes=limit)
    elif variant == "tpu":
        qb, meta, qblk, bq, rows, rows_pad = _prepare(
            q, k_pages, kv_lens, page_indices, cu_q_lens, num_seqs, block_q,
            row_multiple=8 * (4 // jnp.dtype(q.dtype).itemsize), pow2_rows=False,
            max_rows=256)
        out = _tpu_call(meta, page_indices, qblk, k_pages, v_pages, sm_scale=sm_scale,
                        sliding_window=sliding_window, soft_cap=soft_cap, group=group,
                        interpret=interpret)
    else:
        raise ValueError(f"variant must be 'gpu' or 'tpu', got {variant!r}")
    return _finish(out, qb, bq, rows, num_q_heads, q.dtype)
