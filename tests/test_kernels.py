"""Ragged paged attention and the KV page write against a float64 numpy oracle.

Every case draws fresh seeded random inputs; cache slots no live token owns hold NaN, padded
query rows hold large finite garbage and padded sequences carry garbage metadata, so an
implementation that reads outside its sequence, leaks masked values or leaves rows unwritten
fails. The native CPU kernel is built from source on first use (skipped, with the reason, where
no C++ compiler can build it). Pallas runs in interpret mode here (both the Triton/GPU and the Mosaic/TPU kernel bodies),
on small pools because interpretation is slow.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxrunner import kernels
from jaxrunner.kernels import blocks, native
from jaxrunner.kernels.kv_write import to_pool_dtype
from jaxrunner.kernels.pallas_kernel import ragged_paged_attention_pallas
from jaxrunner.kernels.reference import ragged_paged_attention_reference
from jaxrunner.kernels.testing import make_case
from jaxrunner.kernels.xla import ragged_paged_attention_xla


# ------------------------------------------------------------------------------------------
# oracle
# ------------------------------------------------------------------------------------------

def dense_attention_f64(case, *, sm_scale, sliding_window=None, soft_cap=None):
    """Per live token: gather its sequence's first kv_len slots, causal/window mask, softmax."""
    q = np.asarray(case.q, np.float64)
    kp = np.asarray(case.k_pages, np.float64)
    vp = np.asarray(case.v_pages, np.float64)
    _, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = kp.shape[1], kp.shape[2]
    group = num_q_heads // num_kv_heads
    out = np.full(q.shape, np.nan)
    row = 0
    for s, (q_len, kv_len) in enumerate(zip(case.q_lens, case.live_kv_lens)):
        slots = np.arange(kv_len)
        pages = case.page_indices[s, slots // page_size]
        k = kp[pages, slots % page_size]                       # [kv_len, Hkv, D]
        v = vp[pages, slots % page_size]
        assert np.isfinite(k).all() and np.isfinite(v).all()  # owned slots are never poisoned
        for i in range(q_len):
            pos = kv_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            qq = q[row + i].reshape(num_kv_heads, group, head_dim)
            sc = np.einsum("lhd,hgd->hgl", k[lo:pos + 1], qq) * sm_scale
            if soft_cap is not None:
                sc = soft_cap * np.tanh(sc / soft_cap)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[row + i] = np.einsum("hgl,lhd->hgd", p, v[lo:pos + 1]).reshape(num_q_heads,
                                                                                 head_dim)
        row += q_len
    return out


TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=1e-2, atol=1e-2)}


def check(out, case, dtype, **attn):
    out = np.asarray(out)
    assert out.shape == case.q.shape
    assert out.dtype == case.q.dtype
    out = out.astype(np.float64)
    assert np.isfinite(out).all(), "non-finite output rows (live or padding)"
    n = case.num_live_tokens
    want = dense_attention_f64(case, **attn)
    np.testing.assert_allclose(out[:n], want[:n], **TOL[dtype])


# ------------------------------------------------------------------------------------------
# implementations under test
# ------------------------------------------------------------------------------------------

def _impl(name):
    if name == "reference":
        return ragged_paged_attention_reference
    if name == "xla":
        return ragged_paged_attention_xla
    if name == "native":
        if not native.available():
            pytest.skip(f"native CPU kernel unavailable: {native.unavailable_reason()}")
        return native.ragged_paged_attention_native
    if name == "pallas_gpu":
        return functools.partial(ragged_paged_attention_pallas, variant="gpu", interpret=True)
    if name == "pallas_tpu":
        return functools.partial(ragged_paged_attention_pallas, variant="tpu", interpret=True)
    raise ValueError(name)


def run(name, case, **attn):
    fn = jax.jit(functools.partial(_impl(name), **attn))
    return fn(*[jnp.asarray(a) for a in case.args()])


ALL = ["reference", "xla", "native", "pallas_gpu", "pallas_tpu"]
FAST = ["reference", "xla", "native"]

# name -> (q_lens, kv_lens, make_case kwargs). Lengths cross page boundaries on purpose.
SHAPES = {
    "decode": ([1] * 8, [1, 7, 8, 9, 16, 17, 33, 65],
               dict(page_size=8, num_q_heads=8, num_kv_heads=2, head_dim=64)),
    "prefill": ([9, 16, 3], [9, 16, 3],
                dict(page_size=8, num_q_heads=6, num_kv_heads=2, head_dim=64)),
    "chunked": ([5, 12, 1, 7], [21, 12, 40, 8],
                dict(page_size=8, num_q_heads=4, num_kv_heads=4, head_dim=64)),
    "mixed_padded": ([1, 1, 6, 1, 10], [17, 3, 30, 64, 10],
                     dict(page_size=16, num_q_heads=12, num_kv_heads=4, head_dim=128,
                          num_tokens=32, max_seqs=8, width=6)),
}


@pytest.mark.parametrize("impl", ALL)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_oracle_f32(impl, shape):
    q_lens, kv_lens, kw = SHAPES[shape]
    rng = np.random.default_rng(zlib.crc32(f"{impl}/{shape}".encode()))
    case = make_case(rng, q_lens, kv_lens, **kw)
    check(run(impl, case, sm_scale=0.7 / np.sqrt(kw["head_dim"])), case, "float32",
          sm_scale=0.7 / np.sqrt(kw["head_dim"]))


@pytest.mark.parametrize("impl", ALL)
def test_bf16(impl):
    rng = np.random.default_rng(11)
    case = make_case(rng, [1, 4, 1, 9], [40, 20, 8, 9], num_q_heads=8, num_kv_heads=1,
                     head_dim=128, page_size=16, num_tokens=16, max_seqs=6, dtype="bfloat16")
    check(run(impl, case, sm_scale=128 ** -0.5), case, "bfloat16", sm_scale=128 ** -0.5)


@pytest.mark.parametrize("impl", ALL)
@pytest.mark.parametrize("attn", [dict(sliding_window=5), dict(soft_cap=2.0),
                                  dict(sliding_window=16, soft_cap=5.0)],
                         ids=["window", "softcap", "window+softcap"])
def test_window_and_softcap(impl, attn):
    rng = np.random.default_rng(5)
    # scale 3: logits large enough that the soft cap bites
    case = make_case(rng, [1, 7, 1, 3], [30, 19, 5, 24], num_q_heads=6, num_kv_heads=3,
                     head_dim=64, page_size=8, num_tokens=16, max_seqs=5, scale=3.0)
    check(run(impl, case, sm_scale=0.125, **attn), case, "float32", sm_scale=0.125, **attn)


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("page_size", [8, 32, 128])
def test_gqa_ratios_and_page_sizes(impl, group, page_size):
    rng = np.random.default_rng(group * 1000 + page_size)
    num_kv = 2
    kv_lens = [page_size - 1, page_size, page_size + 1, 2 * page_size + 3, 1]
    q_lens = [1, page_size, 3, page_size + 2, 1]
    case = make_case(rng, q_lens, kv_lens, num_q_heads=num_kv * group, num_kv_heads=num_kv,
                     head_dim=64, page_size=page_size, num_tokens=sum(q_lens) + 3, max_seqs=7)
    check(run(impl, case, sm_scale=0.125), case, "float32", sm_scale=0.125)


@pytest.mark.parametrize("head_dim", [32, 96, 128, 256])
def test_native_head_sizes(head_dim):
    """64 and 128 take the kernel's compile-time-width path, other multiples of 16 the generic one."""
    rng = np.random.default_rng(head_dim)
    case = make_case(rng, [20, 1, 5], [70, 33, 5], num_q_heads=8, num_kv_heads=2, head_dim=head_dim,
                     page_size=8, num_tokens=30, max_seqs=4)
    check(run("native", case, sm_scale=0.1), case, "float32", sm_scale=0.1)


@pytest.mark.parametrize("kv_len", [127, 128, 301])
@pytest.mark.parametrize("attn", [{}, dict(sliding_window=200, soft_cap=4.0), dict(sliding_window=100)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_lone_decode_split_over_its_keys(kv_len, attn, dtype):
    """A batch of one decode row: from 128 keys the native kernel splits them in two parts on two
    threads and merges the parts' softmax sums; fewer keys (or a window of fewer) stay whole."""
    if not native.available():
        pytest.skip(f"native CPU kernel unavailable: {native.unavailable_reason()}")
    rng = np.random.default_rng(kv_len)
    case = make_case(rng, [1], [kv_len], num_q_heads=9, num_kv_heads=3, head_dim=64, page_size=16,
                     num_tokens=2, max_seqs=2, dtype=dtype, scale=2.0)
    check(_jit_native(tuple(sorted(attn.items())))(*case.args()), case, dtype, sm_scale=0.3, **attn)


# name -> (q_lens, kv_lens, make_case kwargs) for bf16 on AMX tiles: prefill chunks of several rows
# (the tiles' items) beside decode rows, kv heads sharing a block of 16 columns or taking several
# (groups of 16 and 32), pages of 16 and 32 rows, every head size the tiles take, lengths off the
# 16-key chunks.
TILE_SHAPES = {
    "smollm2": ([1, 1, 9, 40, 1], [1, 300, 16, 40, 17], dict(page_size=16, num_q_heads=9, num_kv_heads=3, head_dim=64)),
    "chunked": ([5, 12, 1, 7], [21, 12, 40, 8], dict(page_size=32, num_q_heads=8, num_kv_heads=2, head_dim=128)),
    "mha": ([3, 1, 20], [50, 33, 20], dict(page_size=16, num_q_heads=4, num_kv_heads=4, head_dim=96)),
    "group8": ([2, 1, 17], [70, 129, 17], dict(page_size=16, num_q_heads=16, num_kv_heads=2, head_dim=256)),
    "group16": ([2, 1, 33], [70, 40, 33], dict(page_size=16, num_q_heads=16, num_kv_heads=1, head_dim=64)),
    "group32": ([5, 1, 40], [60, 33, 40], dict(page_size=16, num_q_heads=32, num_kv_heads=1, head_dim=64)),
    "padded": ([1, 1, 6, 1, 10], [17, 3, 30, 64, 10],
               dict(page_size=16, num_q_heads=12, num_kv_heads=4, head_dim=128, num_tokens=32, max_seqs=8, width=6)),
}


@functools.lru_cache(maxsize=None)
def _jit_native_tiles(tiles: bool, sm_scale: float, sliding_window):
    return jax.jit(functools.partial(native.ragged_paged_attention_native, tiles=tiles, sm_scale=sm_scale,
                                     sliding_window=sliding_window))


@pytest.mark.parametrize("shape", list(TILE_SHAPES))
@pytest.mark.parametrize("sliding_window", [None, 5, 37])
def test_native_bf16_on_amx_tiles(shape, sliding_window):
    """bf16 queries and pages on AMX-BF16 tiles (``cpu/attention_amx.h``), where the build has them
    and the OS grants AMX, within the bf16 tolerance of the float64 answer, as the AVX-512 path is;
    poisoned slots past each sequence (NaN) stay out of every row. Elsewhere ``tiles`` changes
    nothing."""
    if not native.available():
        pytest.skip(f"native CPU kernel unavailable: {native.unavailable_reason()}")
    q_lens, kv_lens, kw = TILE_SHAPES[shape]
    case = make_case(np.random.default_rng(len(shape)), q_lens, kv_lens, dtype="bfloat16", **kw)
    sm_scale = kw["head_dim"] ** -0.5
    on_tiles = np.asarray(_jit_native_tiles(True, sm_scale, sliding_window)(*case.args()))
    avx512 = np.asarray(_jit_native_tiles(False, sm_scale, sliding_window)(*case.args()))
    check(on_tiles, case, "bfloat16", sm_scale=sm_scale, sliding_window=sliding_window)
    check(avx512, case, "bfloat16", sm_scale=sm_scale, sliding_window=sliding_window)
    assert (on_tiles[case.num_live_tokens:] == 0).all()
    if native.attention_tiles_ready():  # the chunks' rows took another path: not bit for bit
        assert not np.array_equal(on_tiles, avx512)
    else:
        np.testing.assert_array_equal(on_tiles, avx512)


def test_native_attention_tiles_where_the_cpu_has_amx_bf16():
    if not native.available():
        pytest.skip(f"native CPU kernel unavailable: {native.unavailable_reason()}")
    assert native.attention_tiles_ready() == ("amx_bf16" in native.cpu_features() and native.w8a8_matmul_ready())


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("group,page_size,head_dim", [(3, 16, 64), (8, 8, 128), (1, 32, 64)])
def test_pallas_gqa_and_pages(impl, group, page_size, head_dim):
    rng = np.random.default_rng(group * 7 + page_size)
    case = make_case(rng, [1, 5, 2], [page_size + 1, 2 * page_size, 3], num_q_heads=2 * group,
                     num_kv_heads=2, head_dim=head_dim, page_size=page_size, num_tokens=10,
                     max_seqs=4)
    check(run(impl, case, sm_scale=0.1), case, "float32", sm_scale=0.1)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_pallas_split_kv(num_splits):
    """Split-KV (grid segments merged by log-sum-exp) on a ragged batch with NaN-poisoned unowned
    slots: segments that see no kv at all (short sequences, padded sequences, a window that
    starts late) must merge to the same result."""
    rng = np.random.default_rng(num_splits)
    case = make_case(rng, [1, 1, 6, 1], [150, 3, 70, 33], num_q_heads=8, num_kv_heads=2,
                     head_dim=64, page_size=8, num_tokens=12, max_seqs=6)
    for attn in ({}, dict(sliding_window=20, soft_cap=5.0)):
        fn = functools.partial(ragged_paged_attention_pallas, variant="gpu", interpret=True,
                               block_k=16, num_splits=num_splits)
        out = jax.jit(functools.partial(fn, sm_scale=0.1, **attn))(*case.args())
        check(out, case, "float32", sm_scale=0.1, **attn)


def test_pallas_split_kv_chosen_from_shapes_random_batches():
    """Few programs and long page tables: the default picks a split; fuzzed ragged batches
    (bf16 and float32, poisoned pages) still match the oracle."""
    from jaxrunner.kernels.pallas_kernel import choose_num_splits
    from jaxrunner.kernels.tolerance import attention_tolerance

    assert choose_num_splits(2 * 2, 640 // 16) > 1
    for seed in range(3):
        rng = np.random.default_rng(100 + seed)
        n = int(rng.integers(1, 4))
        kv_lens = rng.integers(1, 640, n)
        q_lens = [int(rng.integers(1, min(k, 9) + 1)) for k in kv_lens]
        dtype = ("float32", "bfloat16")[seed % 2]
        case = make_case(rng, q_lens, kv_lens, num_q_heads=4, num_kv_heads=2, head_dim=32,
                         page_size=16, width=40, num_tokens=sum(q_lens) + 2, max_seqs=n + 1,
                         dtype=dtype)
        fn = functools.partial(ragged_paged_attention_pallas, variant="gpu", interpret=True,
                               block_k=16, sm_scale=0.2)
        out = jax.jit(fn)(*case.args())
        check(out, case, dtype, sm_scale=0.2)
        # and against kernels/reference.py, within the tolerance the self-check uses
        ref = ragged_paged_attention_reference(*[jnp.asarray(a) for a in case.args()], sm_scale=0.2)
        n = case.num_live_tokens
        err = np.abs(np.asarray(out, np.float32)[:n] - np.asarray(ref, np.float32)[:n]).max()
        tol = attention_tolerance("pallas", dtype, max_abs_v=np.nanmax(np.abs(np.asarray(
            case.v_pages, np.float32))), max_kv_len=int(max(kv_lens)))
        assert err <= tol, (err, tol)


def test_merge_splits_matches_one_softmax():
    from jaxrunner.kernels.pallas_kernel import merge_splits

    rng = np.random.default_rng(3)
    s = rng.standard_normal((3, 40))                 # 3 rows x 40 scores, split 4 x 10
    v = rng.standard_normal((40, 5))
    p = np.exp(s - s.max(1, keepdims=True))
    want = (p / p.sum(1, keepdims=True)) @ v
    segs = s.reshape(3, 4, 10).transpose(1, 0, 2)    # [S, R, 10]
    lse = np.log2(np.exp(segs).sum(-1))               # [S, R]
    o = np.einsum("srk,skd->srd", np.exp(segs) / np.exp(segs).sum(-1, keepdims=True),
                  v.reshape(4, 10, 5))
    lse[1, 0] = -np.inf                               # an empty segment for row 0 ...
    o[1, 0] = 0.0
    got = np.asarray(merge_splits(jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32)))
    keep = np.r_[0:10, 20:40]                         # ... drops its scores from row 0
    p0 = np.exp(s[0, keep] - s[0, keep].max())
    want[0] = (p0 / p0.sum()) @ v[keep]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    all_empty = merge_splits(jnp.zeros((2, 1, 4)), jnp.full((2, 1), -jnp.inf))
    assert np.all(np.asarray(all_empty) == 0)


def test_jax_tpu_layout_adapter():
    """jax's TPU kernel reads one K/V-interleaved pool: the batch's pages gathered into it, with
    the page table renumbered, give the same attention (checked through jax's own reference for
    that kernel; the kernel itself runs only on a TPU and is covered by lowering tests)."""
    from jaxrunner.kernels import jax_tpu

    if jax_tpu.available() is not None:
        pytest.skip(jax_tpu.available())
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    rng = np.random.default_rng(8)
    case = make_case(rng, [1, 5, 2], [33, 16, 40], num_q_heads=8, num_kv_heads=2, head_dim=128,
                     page_size=8, num_tokens=10, max_seqs=5, poison=False)
    pool, local = jax_tpu.combined_pages(jnp.asarray(case.k_pages), jnp.asarray(case.v_pages),
                                         case.page_indices)
    assert pool.shape == (5 * case.page_indices.shape[1], 8, 4, 128)
    out = ref_ragged_paged_attention(jnp.asarray(case.q), pool, jnp.asarray(case.kv_lens), local,
                                     jnp.asarray(case.cu_q_lens), jnp.asarray([3], jnp.int32),
                                     sm_scale=0.1)
    want = dense_attention_f64(case, sm_scale=0.1)
    n = case.num_live_tokens
    np.testing.assert_allclose(np.asarray(out)[:n], want[:n], rtol=1e-5, atol=1e-5)


def test_auto_on_tpu_avoids_kv_heads_jax_refuses():
    """jax's TPU kernel tiles 1, 2, 4 or a multiple of 8 bf16 KV heads; float32 pools also take
    multiples of 4, though not 8+ KV heads with one query head each (tests/test_kernel_lowering.py
    lowers the kernel for all of them). Elsewhere ``auto`` takes our Mosaic kernel, and says why."""
    from jaxrunner.kernels import jax_tpu

    if jax_tpu.available() is not None:
        pytest.skip(jax_tpu.available())

    def choose(kv_heads, group=4, kv_dtype="bfloat16", page_size=16):
        return kernels.choose_impl("auto", "tpu", 128, page_size, num_kv_heads=kv_heads,
                                   num_q_heads=group * kv_heads, kv_dtype=kv_dtype)

    for kv_heads in (1, 2, 4, 8, 16, 32):
        assert choose(kv_heads)[0] == "jax_tpu"
    for kv_heads in (3, 6, 12):
        impl, why = choose(kv_heads)
        assert impl == "pallas" and f"{kv_heads} KV heads" in why and "multiple of 8" in why
    assert choose(12, kv_dtype="float32")[0] == "jax_tpu"
    assert choose(8, group=1, kv_dtype="float32")[0] == "pallas"      # MHA: query blocks of 4 rows
    assert choose(8, group=1, kv_dtype="bfloat16")[0] == "jax_tpu"
    assert choose(12, kv_dtype=None)[0] == "pallas"                   # unknown dtype: what both take
    assert choose(6, page_size=1)[0] == "xla"                         # nor Mosaic: one-row pages
    assert kernels.resolve_impl("auto", "tpu", head_dim=128, num_kv_heads=8) == "pallas"  # unknown Hq, dtype
    assert kernels.resolve_impl("auto", "tpu", head_dim=128, num_kv_heads=4) == "jax_tpu"


def test_kv_pool_shapes_follow_the_implementation():
    assert kernels.kv_pool_shapes("jax_tpu", 9, 16, 3, 128) == ((9, 16, 6, 128),)
    for impl in ("xla", "native", "pallas", "reference"):
        assert kernels.kv_pool_shapes(impl, 9, 16, 3, 128) == ((9, 16, 3, 128),) * 2
    with pytest.raises(ValueError, match="impl must be one of"):
        kernels.kv_pool_shapes("auto", 9, 16, 3, 128)


@pytest.mark.parametrize("num_tokens,poison", [(1, False), (10, True)])
def test_jax_tpu_combined_pool_like_the_engine(monkeypatch, num_tokens, poison):
    """The engine's ``jax_tpu`` layer over its one combined pool: the step's K/V land at K's even
    and V's odd heads (the pool two written pools would combine into), and the kernel reads it
    through the page table as given. jax's kernel runs on TPU only; its own reference stands in for
    it, so everything around the kernel runs here: the write, the metadata sanitising, the zeroed
    padding rows."""
    from jaxrunner.kernels import jax_tpu

    if jax_tpu.available() is not None:
        pytest.skip(jax_tpu.available())
    import jax.experimental.pallas.ops.tpu.ragged_paged_attention as jax_rpa

    def reference_kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, num_kv_pages_per_block,
                         num_queries_per_block, **kw):
        out = jax_rpa.ref_ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kw)
        return jnp.full_like(q, jnp.nan).at[:out.shape[0]].set(out)  # rows past the live ones: garbage

    monkeypatch.setattr(jax_rpa, "ragged_paged_attention", reference_kernel)
    rng = np.random.default_rng(num_tokens)
    q_lens, kv_lens = ([1], [30]) if num_tokens == 1 else ([1, 5, 2], [33, 16, 40])
    case = make_case(rng, q_lens, kv_lens, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=8,
                     num_tokens=num_tokens, max_seqs=len(q_lens) + 2, poison=poison)
    slots = np.full(num_tokens, kernels.SCRATCH_PAGE * 8 + 3, np.int32)  # padding: the scratch page
    row = 0
    for s, (q_len, kv_len) in enumerate(zip(case.q_lens, case.live_kv_lens)):
        for pos in range(kv_len - q_len, kv_len):
            slots[row] = case.page_indices[s, pos // 8] * 8 + pos % 8
            row += 1
    k_new = rng.standard_normal((num_tokens, 2, 128)).astype(np.float32)
    v_new = rng.standard_normal((num_tokens, 2, 128)).astype(np.float32)
    kv_pages = np.stack([case.k_pages, case.v_pages], axis=3).reshape(*case.k_pages.shape[:2], 4, 128)

    out, (kv_written,) = kernels.write_kv_and_attend(
        case.q, k_new, v_new, (jnp.asarray(kv_pages),), slots, *case.args()[3:], sm_scale=0.1, impl="jax_tpu")
    k_written, v_written = kernels.write_kv_pages(jnp.asarray(case.k_pages), jnp.asarray(case.v_pages), k_new,
                                                  v_new, slots)
    np.testing.assert_array_equal(np.asarray(kv_written)[:, :, 0::2], np.asarray(k_written))
    np.testing.assert_array_equal(np.asarray(kv_written)[:, :, 1::2], np.asarray(v_written))
    case.k_pages, case.v_pages = np.asarray(k_written), np.asarray(v_written)
    check(out, case, "float32", sm_scale=0.1)
    assert not np.asarray(out)[case.num_live_tokens:].any()  # padding rows: zeros
    with pytest.raises(ValueError, match="combined pool"):
        kernels.write_kv_and_attend(case.q, k_new, v_new, (jnp.asarray(kv_pages),), slots, *case.args()[3:],
                                    sm_scale=0.1, impl="xla")


def test_xla_chunks_sized_for_the_platform():
    """CPU: chunks that fit a core's L2; GPU/TPU: far fewer, larger loop steps."""
    from jaxrunner.kernels.xla import _chunk_rows

    assert _chunk_rows(64, 8 * 128, "dot", "cpu") == 8          # 64 blocks x 8 heads x 128: 2 MB
    assert _chunk_rows(1, 8 * 128, "blockdiag", "cpu") == 64
    assert _chunk_rows(64, 8 * 128, "dot", "gpu") == 256        # 64 MB
    assert _chunk_rows(1, 8 * 128, "blockdiag", "tpu") == 1024


def test_tolerance_follows_the_dot_precision():
    """The self-check tolerance for a float32 cache admits full-precision kernels and refuses
    TF32-rounded inputs (what the GPU kernel did before it asked for HIGHEST dots)."""
    from jaxrunner.kernels.tolerance import attention_tolerance

    rng = np.random.default_rng(4)
    case = make_case(rng, [1, 6], [300, 200], num_q_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=16, num_tokens=8, max_seqs=3)
    want = dense_attention_f64(case, sm_scale=0.125)[:7]
    tol = attention_tolerance("xla", jnp.float32, max_abs_v=float(np.nanmax(np.abs(case.v_pages))),
                              max_kv_len=300, platform="gpu")
    got = np.asarray(run("xla", case, sm_scale=0.125))[:7]
    assert np.abs(got - want).max() <= tol

    def tf32(x):  # round to TF32's 10 explicit mantissa bits
        bits = np.asarray(x, np.float32).view(np.uint32)
        return ((bits + 0x1000) & 0xFFFFE000).view(np.float32)

    rounded = make_case(np.random.default_rng(4), [1, 6], [300, 200], num_q_heads=8,
                        num_kv_heads=2, head_dim=64, page_size=16, num_tokens=8, max_seqs=3)
    rounded.q, rounded.k_pages, rounded.v_pages = (tf32(rounded.q), tf32(rounded.k_pages),
                                                   tf32(rounded.v_pages))
    assert np.abs(dense_attention_f64(rounded, sm_scale=0.125)[:7] - want).max() > tol
    bf16 = attention_tolerance("pallas", jnp.bfloat16, max_abs_v=4.0, max_kv_len=300)
    assert 1e-2 < bf16 < 0.1


def test_tolerance_follows_the_cases_scores():
    """Scores far past unit-normal ones (inputs scaled by 3, as the device check's window case)
    widen the tolerance by what they do to exp, and a soft cap bounds them; the XLA path stays
    inside the tolerance derived from the case while the float64 truth is compared."""
    from jaxrunner.kernels.tolerance import ASSUMED_MAX_ABS_SCORE, attention_tolerance

    shape = dict(num_q_heads=6, num_kv_heads=3, head_dim=64, page_size=8, num_tokens=16, max_seqs=5)
    plain = make_case(np.random.default_rng(9), [1, 7, 1, 3], [30, 19, 5, 24], **shape)
    scaled = make_case(np.random.default_rng(9), [1, 7, 1, 3], [30, 19, 5, 24], scale=3.0, **shape)
    score = scaled.max_abs_score(0.125)
    assert score == pytest.approx(9 * plain.max_abs_score(0.125), rel=1e-5) and score > 4 * ASSUMED_MAX_ABS_SCORE
    assert scaled.max_abs_score(0.125, soft_cap=2.0) == 2.0
    v_max = float(np.nanmax(np.abs(scaled.v_pages)))
    tol = attention_tolerance("xla", jnp.float32, max_abs_v=v_max, max_kv_len=30, max_abs_score=score)
    assert tol > attention_tolerance("xla", jnp.float32, max_abs_v=v_max, max_kv_len=30)
    got = np.asarray(run("xla", scaled, sm_scale=0.125))[:scaled.num_live_tokens]
    assert np.abs(got - dense_attention_f64(scaled, sm_scale=0.125)[:scaled.num_live_tokens]).max() <= tol


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_start_up_self_check_passes_the_pallas_kernel(dtype):
    """The warm-up self-check's tolerance (from dtype and dot precision) admits the GPU kernel,
    split-KV included, on a random bucket-shaped batch (interpreted here)."""
    from jaxrunner.runner.buckets import Bucket
    from jaxrunner.runner.warmup import attention_self_check

    error = attention_self_check("pallas", Bucket(16, 4, 8), 8, 4, 2, 64, dtype, jax.random.key(3), 2)
    assert error <= (1e-5 if dtype == jnp.float32 else 3e-2)


@pytest.mark.parametrize("block_q", [1, 4, 32])
def test_xla_any_block_and_chunk_size(block_q):
    """Every (block_q, formulation, page-chunk) combination, incl. loops that start late
    (sliding window) and stop early (short sequences in a wide page table)."""
    rng = np.random.default_rng(block_q)
    case = make_case(rng, [1, 9, 17, 2, 1], [8, 9, 33, 41, 2], num_q_heads=6, num_kv_heads=3,
                     head_dim=64, page_size=8, num_tokens=36, max_seqs=7, width=9)
    for form in ("dot", "blockdiag"):
        for chunk_rows, attn in ((8, dict(sliding_window=9)), (1024, {})):
            out = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=0.2,
                                            block_q=block_q, formulation=form,
                                            chunk_rows=chunk_rows, **attn))(*case.args())
            check(out, case, "float32", sm_scale=0.2, **attn)


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_xla_random_batches(data):
    """Random raggedness under one fixed bucket (one compile): T=24, S=5, W=5, page 4."""
    q_lens = data.draw(st.lists(st.integers(1, 8), min_size=1, max_size=5))
    while sum(q_lens) > 24:
        q_lens.pop()
    kv_lens = [ql + data.draw(st.integers(0, 20 - ql)) for ql in q_lens]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    case = make_case(rng, q_lens, kv_lens, num_q_heads=4, num_kv_heads=2, head_dim=64,
                     page_size=4, num_pages=30, width=5, num_tokens=24, max_seqs=5)
    check(_jit_xla(*case.args()), case, "float32", sm_scale=0.3)


_jit_xla = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=0.3))


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_native_random_batches(data):
    """The native kernel on random raggedness, windows and soft caps (one compile per option set):
    long prefill chunks cross its 16-row work items and several pages."""
    if not native.available():
        pytest.skip(f"native CPU kernel unavailable: {native.unavailable_reason()}")
    q_lens = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    while sum(q_lens) > 64:
        q_lens.pop()
    kv_lens = [ql + data.draw(st.integers(0, 60 - ql)) for ql in q_lens]
    attn = data.draw(st.sampled_from([{}, dict(sliding_window=7), dict(soft_cap=3.0)]))
    dtype = data.draw(st.sampled_from(["float32", "bfloat16"]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    case = make_case(rng, q_lens, kv_lens, num_q_heads=6, num_kv_heads=2, head_dim=64,
                     page_size=8, num_pages=64, width=8, num_tokens=64, max_seqs=6, dtype=dtype, scale=2.0)
    out = _jit_native(tuple(sorted(attn.items())))(*case.args())
    check(out, case, dtype, sm_scale=0.3, **attn)


@functools.cache
def _jit_native(attn):
    return jax.jit(functools.partial(native.ragged_paged_attention_native, sm_scale=0.3, **dict(attn)))


def test_native_kernel_build_errors_say_why(tmp_path):
    """A compiler that fails is reported with its command line; unsupported head sizes are refused
    at trace time, before XLA runs anything."""
    with pytest.raises(native.NativeKernelUnavailable, match="failed"):
        native.build_library("false", tmp_path / "lib.so")
    assert not list(tmp_path.iterdir())  # no half-written library left behind
    if native.available():
        rng = np.random.default_rng(0)
        case = make_case(rng, [2], [5], num_q_heads=2, num_kv_heads=1, head_dim=24, page_size=4)
        with pytest.raises(ValueError, match="head_dim"):
            native.ragged_paged_attention_native(*case.args(), sm_scale=0.1)
# two_pass_min_seqs=1: the test bucket has only 6 sequences
_jit_xla_two_pass = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=0.3, max_prefill_seqs=2,
                                              two_pass_min_seqs=1))
_jit_xla_two_pass_window = jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=0.3, max_prefill_seqs=2,
                                                     sliding_window=6, two_pass_min_seqs=1))


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_xla_two_pass_random_batches(data):
    """With the scheduler's promise of at most 2 prefill chunks, decodes and prefills run as two
    passes (T=24 > S=6); any mix within the promise matches the oracle, windowed too."""
    num_decodes = data.draw(st.integers(0, 6))
    prefills = data.draw(st.lists(st.integers(2, 9), max_size=min(2, 6 - num_decodes)))
    q_lens = [1] * num_decodes + prefills
    if not q_lens:
        q_lens = [1]
    data.draw(st.randoms()).shuffle(q_lens)
    kv_lens = [ql + data.draw(st.integers(0, 20 - ql)) for ql in q_lens]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    case = make_case(rng, q_lens, kv_lens, num_q_heads=4, num_kv_heads=2, head_dim=64,
                     page_size=4, num_pages=40, width=5, num_tokens=24, max_seqs=6)
    check(_jit_xla_two_pass(*case.args()), case, "float32", sm_scale=0.3)
    check(_jit_xla_two_pass_window(*case.args()), case, "float32", sm_scale=0.3, sliding_window=6)


def pool_sized_ops(hlo: str, pool_shape) -> list:
    """Top-level (unfused) HLO instructions producing a pool-sized array: copies/converts of
    the whole KV pool. Parameters, bitcasts and tuple plumbing do not count."""
    size = math.prod(pool_shape)
    found = []
    for comp in re.split(r"\n(?=\S)", hlo):
        header = comp.split("\n", 1)[0]
        if header.startswith(("%fused", "%wrapped", "HloModule")):
            continue
        for line in comp.split("\n")[1:]:
            m = re.match(r"\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* (\S+?)\(", line)
            if not m or m.group(3) in ("parameter", "bitcast", "get-tuple-element", "tuple"):
                continue
            dims = [int(x) for x in m.group(2).split(",") if x]
            if math.prod(dims) == size:
                found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", FAST)
def test_attention_never_touches_the_whole_pool(impl, dtype):
    """Cost must not scale with the pool: no pool-sized copy/convert in the compiled program
    (XLA:CPU upcasts 16-bit gathers; a hoisted convert would touch the entire pool)."""
    rng = np.random.default_rng(4)
    # page tables several loop chunks wide (a 1-chunk loop is simplified away)
    for q_lens, kv_lens in (([1] * 6, [9, 30, 17, 200, 1, 40]), ([1, 12, 1], [250, 12, 3])):
        case = make_case(rng, q_lens, kv_lens, num_q_heads=6, num_kv_heads=3, head_dim=64,
                         page_size=8, num_pages=96, dtype=dtype)
        fn = jax.jit(functools.partial(_impl(impl), sm_scale=0.125))
        hlo = fn.lower(*case.args()).compile().as_text()
        assert not pool_sized_ops(hlo, case.k_pages.shape), pool_sized_ops(hlo, case.k_pages.shape)


def test_oracle_comparison_can_fail():
    """The checks are not vacuous: an off-by-one window or a wrong scale is caught."""
    rng = np.random.default_rng(3)
    case = make_case(rng, [1, 4], [19, 12], num_q_heads=4, num_kv_heads=2, head_dim=64,
                     page_size=8, num_tokens=7)
    out = run("xla", case, sm_scale=0.125, sliding_window=6)
    with pytest.raises(AssertionError):
        check(out, case, "float32", sm_scale=0.125, sliding_window=7)
    with pytest.raises(AssertionError):
        check(out, case, "float32", sm_scale=0.126, sliding_window=6)
    out = np.asarray(out).copy()
    out[case.num_live_tokens] = np.nan  # a padding row left unwritten
    with pytest.raises(AssertionError):
        check(out, case, "float32", sm_scale=0.125, sliding_window=6)


def test_public_entry_point():
    rng = np.random.default_rng(21)
    case = make_case(rng, [3, 1], [9, 30], num_q_heads=4, num_kv_heads=2, head_dim=64,
                     page_size=8, num_tokens=8, max_seqs=3)
    args = [jnp.asarray(a) for a in case.args()]
    for impl in ("auto", "reference", "xla", "native", "pallas"):
        if impl == "native" and not native.available():
            continue
        out = jax.jit(functools.partial(kernels.ragged_paged_attention, sm_scale=0.125,
                                        impl=impl))(*args)
        check(out, case, "float32", sm_scale=0.125)
    with pytest.raises(ValueError):
        kernels.ragged_paged_attention(*args, sm_scale=0.1, impl="cuda")
    with pytest.raises(ValueError, match="multiple"):
        kernels.ragged_paged_attention(args[0][:, :3], *args[1:], sm_scale=0.1)


def test_auto_falls_back_for_heads_the_native_kernel_does_not_take():
    """impl="auto" on CPU picks per head size: head_dim 72 goes to the XLA path (write and
    attention alike) instead of failing in the native kernel."""
    rng = np.random.default_rng(72)
    case = make_case(rng, [3, 1], [9, 30], num_q_heads=4, num_kv_heads=2, head_dim=72, page_size=8,
                     num_tokens=8, max_seqs=3)
    args = [jnp.asarray(a) for a in case.args()]
    out = jax.jit(functools.partial(kernels.ragged_paged_attention, sm_scale=0.1))(*args)
    check(out, case, "float32", sm_scale=0.1)
    k_new = jnp.zeros((8, 2, 72))
    slots = jnp.full((8,), kernels.SCRATCH_PAGE * 8, jnp.int32)  # writes only the scratch page
    out, _ = jax.jit(functools.partial(kernels.write_kv_and_attend, sm_scale=0.1))(
        args[0], k_new, k_new, (args[1], args[2]), slots, *args[3:])
    check(out, case, "float32", sm_scale=0.1)


def test_resolve_impl():
    cpu_choice = "native" if native.available() else "xla"
    assert kernels.resolve_impl() == cpu_choice  # this test machine is CPU-only
    assert kernels.resolve_impl("auto", "cpu") == cpu_choice
    assert kernels.resolve_impl("auto", "cpu", head_dim=72) == "xla"  # native needs head_dim % 16 == 0
    for plat in ("gpu", "cuda"):
        assert kernels.resolve_impl("auto", plat) == "pallas"
        assert kernels.resolve_impl("auto", plat, head_dim=128) == "pallas"
        impl, why = kernels.choose_impl("auto", plat, head_dim=96)  # Triton tiles: powers of two
        assert impl == "xla" and "96" in why
    assert kernels.resolve_impl("auto", "tpu", head_dim=128) == "jax_tpu"
    impl, why = kernels.choose_impl("auto", "tpu", head_dim=64)  # jax's TPU kernel: D % 128 == 0
    assert impl == "pallas" and "64" in why
    for impl in kernels.ATTENTION_IMPLS:
        assert kernels.resolve_impl(impl, "tpu") == impl
        assert kernels.resolve_impl(impl, "tpu", head_dim=128, num_kv_heads=3) == impl  # asked for: kept
    with pytest.raises(ValueError):
        kernels.resolve_impl("triton")
    assert kernels.SCRATCH_PAGE == 0


def test_block_choice():
    assert blocks.choose_block_q(64, 64, 3) == 1          # decode-only: one block per sequence
    assert blocks.choose_block_q(512, 4, 3, kv_weight=32.0) >= 16
    for t, s, bq in [(10, 3, 4), (512, 64, 16), (7, 7, 1), (1, 8, 2)]:
        assert blocks.num_query_blocks(t, s, bq) * bq >= t


def test_query_blocks_cover_every_token_once():
    cu = jnp.asarray([0, 3, 3, 12, 13, 13], jnp.int32)
    kv = jnp.asarray([5, 0, 20, 1, 9], jnp.int32)

    @jax.jit
    def view(kv, cu):
        cu_s, q_lens, _, _ = blocks.sanitize(kv, cu, jnp.int32(4))
        qb = blocks.query_blocks(cu_s, q_lens, 16, 4)
        return qb.block_rows, qb.token_row, qb.row_token

    rows, token_row, row_token = (np.asarray(a) for a in view(kv, cu))
    assert rows.sum() == 13
    token_row = token_row[:13]
    assert len(set(token_row)) == 13
    assert (row_token[token_row] == np.arange(13)).all()


# ------------------------------------------------------------------------------------------
# write_kv_pages
# ------------------------------------------------------------------------------------------

def _write_case(rng, num_pages=12, page_size=8, hkv=2, d=64, n_live=11, n_pad=5):
    kp = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
    vp = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
    live_slots = rng.choice(np.arange(page_size, num_pages * page_size), n_live, replace=False)
    pad_slots = kernels.SCRATCH_PAGE * page_size + rng.integers(0, page_size, n_pad)
    slots = np.concatenate([live_slots, pad_slots]).astype(np.int32)
    kn = rng.standard_normal((n_live + n_pad, hkv, d)).astype(np.float32)
    vn = rng.standard_normal((n_live + n_pad, hkv, d)).astype(np.float32)
    return kp, vp, kn, vn, slots, n_live


def test_write_kv_pages_values():
    rng = np.random.default_rng(0)
    kp, vp, kn, vn, slots, n_live = _write_case(rng)
    k2, v2 = jax.jit(kernels.write_kv_pages)(kp, vp, kn, vn, slots)
    k2, v2 = np.asarray(k2), np.asarray(v2)
    page_size = kp.shape[1]
    for new, old, got in ((kn, kp, k2), (vn, vp, v2)):
        flat_old = old.reshape(-1, *old.shape[2:])
        flat_got = got.reshape(-1, *got.shape[2:])
        np.testing.assert_array_equal(flat_got[slots[:n_live]], new[:n_live])
        untouched = np.ones(len(flat_old), bool)
        untouched[slots[:n_live]] = False
        untouched[kernels.SCRATCH_PAGE * page_size:(kernels.SCRATCH_PAGE + 1) * page_size] = False
        # padding tokens never touch a live page; everything else is bit-identical
        np.testing.assert_array_equal(flat_got[untouched], flat_old[untouched])


def test_write_kv_pages_bf16_and_shape_errors():
    rng = np.random.default_rng(1)
    kp, vp, kn, vn, slots, n_live = _write_case(rng, n_live=4, n_pad=0)
    kp, vp = jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16)
    k2, _ = kernels.write_kv_pages(kp, vp, jnp.asarray(kn), jnp.asarray(vn), jnp.asarray(slots))
    assert k2.dtype == jnp.bfloat16
    got = np.asarray(k2.astype(jnp.float32)).reshape(-1, *kn.shape[1:])[slots]
    np.testing.assert_array_equal(got, np.asarray(jnp.asarray(kn, jnp.bfloat16)
                                                  .astype(jnp.float32)))
    with pytest.raises(ValueError):
        kernels.write_kv_pages(kp, vp, kn[:, :1], vn[:, :1], slots)


def test_write_kv_pages_in_place_under_donation():
    rng = np.random.default_rng(2)
    kp, vp, kn, vn, slots, _ = _write_case(rng, num_pages=512)
    fn = jax.jit(kernels.write_kv_pages, donate_argnums=(0, 1))
    # .copy(): jnp.asarray may alias a suitably aligned numpy buffer on CPU, and a buffer numpy
    # still owns cannot be donated (XLA then copies, and the pointer check would be flaky)
    kp_d, vp_d = jnp.asarray(kp).copy(), jnp.asarray(vp).copy()
    hlo = fn.lower(kp_d, vp_d, kn, vn, slots).compile().as_text()
    pool = "f32[%d" % (kp.shape[0] * kp.shape[1])
    copies = [ln for ln in hlo.splitlines() if " copy(" in ln and pool in ln]
    assert not copies, copies
    ptrs = (kp_d.unsafe_buffer_pointer(), vp_d.unsafe_buffer_pointer())
    k2, v2 = fn(kp_d, vp_d, kn, vn, slots)
    assert (k2.unsafe_buffer_pointer(), v2.unsafe_buffer_pointer()) == ptrs  # same buffers
    assert kp_d.is_deleted()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_native_write_kv_pages_in_place_any_dtype(dtype):
    """The native write equals the XLA scatter on every live slot, and under donation it returns
    the same buffers with no pool-sized copy or convert -- bf16 pools included (XLA:CPU's own bf16
    scatter converts the whole pool)."""
    if not native.available():
        pytest.skip(f"native CPU kernel unavailable: {native.unavailable_reason()}")
    rng = np.random.default_rng(3)
    kp, vp, kn, vn, slots, n_live = _write_case(rng, num_pages=64)
    kp, vp = jnp.asarray(kp, dtype).copy(), jnp.asarray(vp, dtype).copy()  # XLA-owned: donatable
    if jnp.dtype(dtype).itemsize > 1:
        want = jax.jit(kernels.write_kv_pages)(kp, vp, kn, vn, slots)
    else:  # ml_dtypes' rounding (the XLA write's, test_fp8_xla_write_rounds_like_ml_dtypes)
        want = [numpy_write(pool, new, slots) for pool, new in ((kp, kn), (vp, vn))]
    got = jax.jit(native.write_kv_pages_native)(kp, vp, kn, vn, slots)
    page_size = kp.shape[1]
    for w, g in zip(want, got):
        w = np.asarray(w).astype(np.float32).reshape(-1, *kn.shape[1:])
        g = np.asarray(g).astype(np.float32).reshape(-1, *kn.shape[1:])
        np.testing.assert_array_equal(g[page_size:], w[page_size:])  # all but the scratch page
    fn = jax.jit(native.write_kv_pages_native, donate_argnums=(0, 1))
    hlo = fn.lower(kp, vp, kn, vn, slots).compile().as_text()
    assert not pool_sized_ops(hlo, kp.shape), pool_sized_ops(hlo, kp.shape)
    ptrs = (kp.unsafe_buffer_pointer(), vp.unsafe_buffer_pointer())
    k2, v2 = fn(kp, vp, kn, vn, slots)
    assert (k2.unsafe_buffer_pointer(), v2.unsafe_buffer_pointer()) == ptrs
    with pytest.raises(ValueError):
        native.write_kv_pages_native(kp, vp, kn[:, :1], vn[:, :1], slots)


@pytest.mark.parametrize("impl,dtype", [("xla", "float32"), ("native", "float32"), ("native", "bfloat16"),
                                        ("native", "float8_e4m3fn")])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_model_step_shape_keeps_pools_in_place(num_tokens, impl, dtype):
    """Two layers of write + attend in one donated jit, as in a model step: no pool-sized copy.

    Regression: returning the written pool while the attention loop carried another version of
    it, and the one-row scatter that XLA turns into a dynamic-update-slice, each made XLA copy
    the whole pool at every layer (60 copies per SmolLM2 decode step)."""
    if impl == "native" and not native.available():
        pytest.skip(f"native CPU kernel unavailable: {native.unavailable_reason()}")
    pool_shape = (33, 16, 3, 64)
    rng = np.random.default_rng(num_tokens)
    case = make_case(rng, [num_tokens], [num_tokens + 20], num_q_heads=9, num_kv_heads=3, head_dim=64,
                     page_size=16, num_pages=33, width=32, poison=False)

    def step(cache, q, k, v, slots, *meta):
        outs, new = [], []
        for kp, vp in cache:
            out, (kp, vp) = kernels.write_kv_and_attend(q, k, v, (kp, vp), slots, *meta, sm_scale=0.1, impl=impl)
            outs.append(out)
            new.append((kp, vp))
        return sum(outs), new

    cache = [(jnp.zeros(pool_shape, dtype), jnp.zeros(pool_shape, dtype)) for _ in range(2)]
    k_new = rng.standard_normal((num_tokens, 3, 64)).astype(np.float32)
    slots = np.arange(40, 40 + num_tokens, dtype=np.int32)
    args = (case.q, k_new, k_new, slots, case.kv_lens, case.page_indices, case.cu_q_lens, case.num_seqs)
    hlo = jax.jit(step, donate_argnums=0).lower(cache, *args).compile().as_text()
    copies = [m for m in re.finditer(r"= (?:f32|bf16|f8e4m3fn)\[([\d,]+)\]\S* (?:copy|convert)\(", hlo)
              if math.prod(int(x) for x in m.group(1).split(",")) == math.prod(pool_shape)]
    assert not copies, [m.group(0) for m in copies]


FP8 = ["float8_e4m3fn", "float8_e5m2"]


def fp8_case(case, dtype):
    """``case`` with its pools rounded to the 8-bit float ``dtype`` as the page write rounds them
    (saturating): the oracle then reads the same values the kernels do."""
    to_pool = jax.jit(functools.partial(to_pool_dtype, dtype=dtype))
    return dataclasses.replace(case, k_pages=np.asarray(to_pool(case.k_pages)), v_pages=np.asarray(to_pool(case.v_pages)))


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("shape", ["decode", "chunked", "mixed_padded"])
def test_fp8_pools_read_exactly(impl, dtype, shape):
    """8-bit float pages (kv_cache_dtype "fp8*") are widened exactly: over float32 queries the
    output is the float64 oracle's over the rounded pages, to float32's tolerance."""
    q_lens, kv_lens, kw = SHAPES[shape]
    case = fp8_case(make_case(np.random.default_rng(zlib.crc32(shape.encode())), q_lens, kv_lens, **kw), dtype)
    assert case.k_pages.dtype == jnp.dtype(dtype)
    check(run(impl, case, sm_scale=0.125), case, "float32", sm_scale=0.125)


def rounded_to_pool(values, dtype) -> np.ndarray:
    """``values`` as an 8-bit float pool stores them, by ml_dtypes in numpy: saturated at the
    largest finite value, then rounded to nearest even (XLA's convert on a CPU without F16C needs a
    runtime helper its JIT does not link, so the native write's tests under
    ``JAXRUNNER_CPU_MAX_ISA=sse4_2`` compare with numpy)."""
    dtype = jnp.dtype(dtype)
    largest = float(jnp.finfo(dtype).max)
    return np.clip(np.asarray(values, np.float32), -largest, largest).astype(dtype)


def numpy_write(pool, rows, slots) -> np.ndarray:
    flat = np.array(pool).reshape(-1, *pool.shape[2:])
    flat[np.asarray(slots)] = rounded_to_pool(rows, pool.dtype)
    return flat.reshape(pool.shape)


FP8_SPECIAL_VALUES = [0.0, -0.0, 1e30, -1e30, np.inf, -np.inf, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11,
                      2.0 ** -17, 2.0 ** -16 * 1.5, 0.3, -1.0625, 1.1875, 17.5, 449.0, 465.0, -60000.0]


def fp8_write_case(dtype):
    """8 rows of 64: the special values (past the largest finite value, subnormals, ties), then
    normal samples over twelve decades."""
    rng = np.random.default_rng(5)
    n = 8 * 64 - len(FP8_SPECIAL_VALUES)
    values = np.concatenate([FP8_SPECIAL_VALUES, rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n)])
    return (jnp.asarray(values.reshape(8, 1, 64), jnp.float32), jnp.asarray(np.zeros((3, 8, 1, 64), jnp.dtype(dtype))),
            jnp.arange(8, 16, dtype=jnp.int32))


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_native_page_write_saturates_and_rounds_like_ml_dtypes(dtype):
    """Values past the format's largest finite one (e4m3fn has no infinity: a plain cast would
    write NaN) saturate; the rest round to nearest even, subnormals included."""
    if not native.available():
        pytest.skip(f"native CPU kernel unavailable: {native.unavailable_reason()}")
    rows, pool, slots = fp8_write_case(dtype)
    got = np.asarray(jax.jit(native.write_kv_pages_native)(pool, pool, rows, rows, slots)[0])
    want = numpy_write(pool, rows, slots)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    written = got[1].astype(np.float32).ravel()
    largest = float(jnp.finfo(dtype).max)
    assert np.isfinite(written).all() and written[2] == largest and written[5] == -largest


@pytest.mark.parametrize("dtype", FP8)
def test_fp8_xla_write_rounds_like_ml_dtypes(dtype):
    rows, pool, slots = fp8_write_case(dtype)
    got = np.asarray(jax.jit(kernels.write_kv_pages)(pool, pool, rows, rows, slots)[0])
    assert np.array_equal(got.view(np.uint8), numpy_write(pool, rows, slots).view(np.uint8))


def test_fp8_pools_refused_by_the_kernels_that_cannot_read_them():
    for impl in ("pallas", "jax_tpu"):
        with pytest.raises(ValueError, match=f"attention_impl='{impl}' does not read float8_e5m2 KV pages"):
            kernels.choose_impl(impl, "cpu", kv_dtype="float8_e5m2")
    for plat in ("gpu", "tpu"):
        impl, why = kernels.choose_impl("auto", plat, head_dim=128, num_kv_heads=8, kv_dtype="float8_e4m3fn")
        assert impl == "xla" and "8-bit" in why
    assert kernels.resolve_impl("auto", "cpu", head_dim=64, kv_dtype="float8_e4m3fn") == kernels.resolve_impl("auto", "cpu")


def test_write_then_attend_like_the_engine():
    """Write a step's K/V with write_kv_pages, then attend: equals the oracle over the result."""
    rng = np.random.default_rng(9)
    case = make_case(rng, [1, 6], [12, 6], num_q_heads=4, num_kv_heads=2, head_dim=64,
                     page_size=4, num_tokens=8, max_seqs=2)
    # the newest token rows of each sequence come from k_new/v_new
    slots = []
    for s, (ql, kvl) in enumerate(zip(case.q_lens, case.live_kv_lens)):
        for pos in range(kvl - ql, kvl):
            slots.append(case.page_indices[s, pos // 4] * 4 + pos % 4)
    slots += [kernels.SCRATCH_PAGE * 4 + 1] * (8 - len(slots))
    slots = np.asarray(slots, np.int32)
    kn = rng.standard_normal((8, 2, 64)).astype(np.float32)
    vn = rng.standard_normal((8, 2, 64)).astype(np.float32)

    @jax.jit
    def step(kp, vp, kn, vn, slots, *meta):
        kp, vp = kernels.write_kv_pages(kp, vp, kn, vn, slots)
        return kernels.ragged_paged_attention(meta[0], kp, vp, *meta[1:], sm_scale=0.125), kp, vp

    out, kp2, vp2 = step(case.k_pages, case.v_pages, kn, vn, slots, case.q, *case.args()[3:])
    case.k_pages, case.v_pages = np.asarray(kp2), np.asarray(vp2)
    check(out, case, "float32", sm_scale=0.125)
