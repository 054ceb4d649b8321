"""The accelerator kernels lower for GPU (Triton) and TPU (Mosaic) from this CPU-only machine.

Lowering runs the whole Pallas -> Triton-IR / Mosaic-MLIR translation (shape, tiling and op
support checks); only the final device compile (Triton -> PTX, Mosaic -> TPU) needs hardware,
and that is what ``scripts/device_check.sh`` covers on a GPU machine. jax >= 0.11 needs an
abstract device to lower for a platform the host lacks: ``kernels.testing.lowering_context``.
"""
from __future__ import annotations

import functools
import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner import kernels
from jaxrunner.kernels import jax_tpu, pallas_kernel
from jaxrunner.kernels.pallas_kernel import ragged_paged_attention_pallas
from jaxrunner.kernels.testing import lowering_context, make_case
from jaxrunner.kernels.xla import ragged_paged_attention_xla

TARGETS = {"cuda": ("gpu", "triton"), "tpu": ("tpu", "tpu_custom_call")}

# (q_lens, kv_lens, kwargs): decode batches (one long enough to be split), a mixed
# prefill/decode batch and a prefill batch
SHAPES = {
    "decode_8seq_d128_p16_bf16": ([1] * 8, [33, 16, 17, 64, 100, 1, 5, 128],
                                  dict(num_q_heads=32, num_kv_heads=8, head_dim=128,
                                       page_size=16, width=8, dtype="bfloat16")),
    "decode_1seq_32k_d128_p16_bf16": ([1], [32768],
                                      dict(num_q_heads=32, num_kv_heads=8, head_dim=128,
                                           page_size=16, num_pages=2050, dtype="bfloat16")),
    "mixed_d64_p8_f32_gqa3": ([1, 1, 20, 7, 1], [40, 9, 20, 60, 3],
                              dict(num_q_heads=9, num_kv_heads=3, head_dim=64, page_size=8,
                                   num_tokens=40, max_seqs=8, width=8)),
    "prefill_d128_p128_bf16": ([64, 32], [64, 200],
                               dict(num_q_heads=16, num_kv_heads=2, head_dim=128,
                                    page_size=128, num_tokens=128, max_seqs=4, width=2,
                                    dtype="bfloat16")),
}
WINDOW_SOFTCAP = dict(sliding_window=24, soft_cap=30.0)


def lower(fn, case, platform):
    with lowering_context(platform):
        return jax.jit(fn).trace(*case.args()).lower(lowering_platforms=(platform,))


def case_of(shape):
    q_lens, kv_lens, kw = SHAPES[shape]
    return make_case(np.random.default_rng(0), q_lens, kv_lens, poison=False, **kw)


@pytest.mark.parametrize("platform", list(TARGETS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("attn", [{}, WINDOW_SOFTCAP], ids=["plain", "window+softcap"])
def test_pallas_lowers(platform, shape, attn):
    variant, custom_call = TARGETS[platform]
    case = case_of(shape)
    lowered = lower(functools.partial(ragged_paged_attention_pallas, sm_scale=0.1, variant=variant,
                                      interpret=False, **attn), case, platform)
    assert custom_call in lowered.as_text()
    assert lowered.out_info.shape == case.q.shape
    assert lowered.out_info.dtype == case.q.dtype


@pytest.mark.parametrize("shape", ["decode_8seq_d128_p16_bf16", "decode_1seq_32k_d128_p16_bf16",
                                   "prefill_d128_p128_bf16"])
@pytest.mark.parametrize("attn", [{}, WINDOW_SOFTCAP], ids=["plain", "window+softcap"])
def test_jax_tpu_kernel_lowers(shape, attn):
    if jax_tpu.available() is not None:
        pytest.skip(jax_tpu.available())
    case = case_of(shape)
    lowered = lower(functools.partial(jax_tpu.ragged_paged_attention_jax_tpu, sm_scale=0.1, **attn),
                    case, "tpu")
    assert "tpu_custom_call" in lowered.as_text()
    assert lowered.out_info.shape == case.q.shape


def lowers(fn, *args) -> bool:
    try:
        with lowering_context("tpu"):
            jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
    except Exception:  # noqa: BLE001 - the kernel refuses the shapes, whatever it raises
        return False
    return True


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_jax_tpu_kv_head_rule_is_what_the_kernel_lowers(dtype):
    """``jax_tpu.heads_refused`` (what ``auto`` reads) says yes exactly where jax's kernel lowers
    for TPU: KV heads 1..16, one or two query heads each, head_dim 128; with the query heads or the
    dtype unknown, only where it lowers."""
    if jax_tpu.available() is not None:
        pytest.skip(jax_tpu.available())
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    kernel = functools.partial(ragged_paged_attention, sm_scale=0.1, num_kv_pages_per_block=8,
                               num_queries_per_block=16)
    seqs, width, tokens = 4, 8, 16
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    meta = (i32((seqs,)), i32((seqs, width)), i32((seqs + 1,)), i32((1,)))
    for kv_heads in range(1, 17):
        for group in (1, 2):
            q = jax.ShapeDtypeStruct((tokens, group * kv_heads, 128), dtype)
            pool = jax.ShapeDtypeStruct((64, 16, 2 * kv_heads, 128), dtype)
            takes = jax_tpu.heads_refused(kv_heads, group * kv_heads, dtype) is None
            assert takes == lowers(kernel, q, pool, *meta), (kv_heads, group)
            unknowns = (jax_tpu.heads_refused(kv_heads), jax_tpu.heads_refused(kv_heads, group * kv_heads))
            assert takes or all(why is not None for why in unknowns)  # unknown: only what lowers


@pytest.mark.parametrize("kv_heads", [3, 6, 12])
def test_auto_on_tpu_lowers_for_kv_heads_jax_refuses(kv_heads):
    """Where jax's kernel refuses the KV heads, ``auto`` picks our Mosaic kernel, which lowers; asking
    for ``jax_tpu`` by name is a ValueError that names the rule, before anything runs."""
    impl, why = kernels.choose_impl("auto", "tpu", 128, 16, num_kv_heads=kv_heads, num_q_heads=2 * kv_heads,
                                    kv_dtype="bfloat16")
    assert impl == "pallas" and "KV heads" in why
    case = make_case(np.random.default_rng(kv_heads), [1, 4], [40, 20], num_q_heads=2 * kv_heads,
                     num_kv_heads=kv_heads, head_dim=128, page_size=16, num_tokens=8, max_seqs=3,
                     dtype="bfloat16", poison=False)
    lower(functools.partial(ragged_paged_attention_pallas, sm_scale=0.1, variant="tpu", interpret=False),
          case, "tpu")
    assert not lowers(functools.partial(jax_tpu.ragged_paged_attention_jax_tpu, sm_scale=0.1), *case.args())
    with pytest.raises(ValueError, match=f"attention_impl='jax_tpu'.*{kv_heads} KV heads"):  # asked for by name
        kernels.choose_impl("jax_tpu", "tpu", 128, 16, num_kv_heads=kv_heads, num_q_heads=2 * kv_heads,
                            kv_dtype="bfloat16")


# 64 sequences of 8k tokens in pages of 16, 8 KV heads of 128, 32 query heads: a decode step's layer
SEQS, CONTEXT, PAGE, KV_HEADS, Q_HEADS, HEAD_DIM = 64, 8192, 16, 8, 32, 128
WIDTH = CONTEXT // PAGE
POOL_PAGES = SEQS * WIDTH + 1


def layer_args(dtype, combined: bool):
    """A ``write_kv_and_attend`` call's arguments as shapes: the layer's pools (jax's one combined
    pool, or K and V apart) and a decode step's metadata."""
    tokens = SEQS
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    heads = jax.ShapeDtypeStruct((tokens, KV_HEADS, HEAD_DIM), dtype)
    pools = ((jax.ShapeDtypeStruct((POOL_PAGES, PAGE, 2 * KV_HEADS, HEAD_DIM), dtype),) if combined else
             (jax.ShapeDtypeStruct((POOL_PAGES, PAGE, KV_HEADS, HEAD_DIM), dtype),) * 2)
    return (jax.ShapeDtypeStruct((tokens, Q_HEADS, HEAD_DIM), dtype), heads, heads, pools, i32((tokens,)),
            i32((SEQS,)), i32((SEQS, WIDTH)), i32((SEQS + 1,)), i32(()))


def jax_tpu_layer(q, k, v, pools, *meta):
    return kernels.write_kv_and_attend(q, k, v, pools, *meta, sm_scale=0.1, impl="jax_tpu")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_combined_pool_layout_round_trips_against_two_pools(dtype):
    """``kernels.kv_pools("jax_tpu", k, v)`` is jax's layout (the one ``kv_pool_shapes`` gives,
    K at even heads), ``kv_from_pools`` undoes it, and the step's write into the combined pool
    is the two-pool write, interleaved (on this CPU; the kernel reading it needs a TPU)."""
    from jaxrunner.kernels.kv_write import write_kv_pages_combined

    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((9, 8, 2, 128)), dtype) for _ in range(2))
    (pool,) = kernels.kv_pools("jax_tpu", k, v)
    assert pool.shape == kernels.kv_pool_shapes("jax_tpu", 9, 8, 2, 128)[0]
    assert np.array_equal(pool[:, :, 0::2], k) and np.array_equal(pool[:, :, 1::2], v)
    assert all(np.array_equal(a, b) for a, b in zip(kernels.kv_from_pools((pool,)), (k, v)))
    assert kernels.kv_pools("xla", k, v) == (k, v) and kernels.kv_from_pools((k, v)) == (k, v)
    k_new, v_new = (jnp.asarray(rng.standard_normal((5, 2, 128)), dtype) for _ in range(2))
    slots = jnp.asarray([8, 9, 30, 71, 40], jnp.int32)
    combined = kernels.kv_from_pools((write_kv_pages_combined(pool, k_new, v_new, slots),))
    two_pools = kernels.write_kv_pages(k, v, k_new, v_new, slots)
    assert all(np.array_equal(a, b) for a, b in zip(combined, two_pools))


def pool_sized_ops(lowered, pool_elements: int) -> set[str]:
    """The ops of a lowered module (its StableHLO, nested regions included) with a result of at
    least a quarter of a pool: any copy of the batch's pages has one."""
    from jax.extend.mlir import ir

    names = set()

    def visit(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    sizes = [math.prod(r.type.shape) for r in inner.results if isinstance(r.type, ir.RankedTensorType)]
                    if sizes and 4 * max(sizes) >= pool_elements:
                        names.add(inner.operation.name)
                    visit(inner.operation)

    visit(lowered.compiler_ir("stablehlo").operation)
    return names


def test_jax_tpu_layer_at_64x8k_copies_no_pages():
    """The engine's ``jax_tpu`` layer at 64 sequences x 8k context (bf16: a 2 GiB pool per layer)
    hands XLA:TPU a program whose only pool-sized ops are free views (reshapes that merge leading
    dims), the scatter of the step's rows into the donated pool (in place) and jax's kernel reading
    the pool where it lies. The two-pool path, for contrast, gathers the batch's pages into a pool
    of their own, the per-layer copy the combined layout removes."""
    if jax_tpu.available() is not None:
        pytest.skip(jax_tpu.available())
    pool_elements = POOL_PAGES * PAGE * 2 * KV_HEADS * HEAD_DIM
    with lowering_context("tpu"):
        lowered = jax.jit(jax_tpu_layer, donate_argnums=3).trace(*layer_args(jnp.bfloat16, True)).lower(
            lowering_platforms=("tpu",))
        two_pools = jax.jit(jax_tpu_layer, donate_argnums=3).trace(*layer_args(jnp.bfloat16, False)).lower(
            lowering_platforms=("tpu",))
    text = lowered.as_text()
    assert "tpu_custom_call" in text and "tf.aliasing_output" in text  # the pool is donated into its output
    ops = pool_sized_ops(lowered, pool_elements) - {"sdy.sharding_constraint"}  # the abstract mesh's notes
    assert ops == {"stablehlo.reshape", "stablehlo.scatter"}
    assert {"stablehlo.gather", "stablehlo.concatenate"} <= pool_sized_ops(two_pools, pool_elements)


def test_jax_tpu_layer_at_64x8k_plans_temporaries_far_under_the_pool(monkeypatch):
    """XLA's own plan for the same layer: compiled for this CPU with jax's kernel stood in for by
    an opaque call that reads the pool where it lies (on TPU the kernel's working set is its VMEM
    scratch, not an XLA temporary), the temporaries XLA plans are a few hundred KB beside a 4 GiB
    pool: the page table reaches the kernel as it is, and nothing is copied per layer. float32
    pools: XLA:CPU has no bf16 scatter and would convert the whole pool (``kv_write.py``), which
    XLA:TPU does not. The two-pool path plans temporaries as large as the pool itself."""
    if jax_tpu.available() is not None:
        pytest.skip(jax_tpu.available())
    import jax.experimental.pallas.ops.tpu.ragged_paged_attention as jax_rpa

    def opaque_kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **_):
        return jax.pure_callback(lambda *_: np.zeros(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape, q.dtype),
                                 q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)

    monkeypatch.setattr(jax_rpa, "ragged_paged_attention", opaque_kernel)
    pool_bytes = POOL_PAGES * PAGE * 2 * KV_HEADS * HEAD_DIM * 4

    def temp_bytes(combined: bool) -> int:
        compiled = jax.jit(jax_tpu_layer, donate_argnums=3).trace(*layer_args(jnp.float32, combined)).lower().compile()
        analysis = compiled.memory_analysis()
        assert analysis.alias_size_in_bytes == pool_bytes  # the pools are updated in place
        return analysis.temp_size_in_bytes

    assert temp_bytes(combined=True) < pool_bytes // 1000
    assert temp_bytes(combined=False) >= pool_bytes // 2  # the batch's pages, gathered


def test_split_kv_is_chosen_for_few_long_sequences():
    """Batch-1 decode of 32k tokens over 8 kv heads is 8 programs without a split: the grid gets
    a segment axis (and the wrapper a log-sum-exp merge); 64 sequences need none."""
    splits = -(-pallas_kernel.FILL_PROGRAMS // 8)
    assert pallas_kernel.choose_num_splits(8, 32768 // 64) == splits
    assert pallas_kernel.choose_num_splits(64 * 8, 2048 // 64) == 1
    assert pallas_kernel.choose_num_splits(8, 3) == 1                 # too short to split
    text = lower(functools.partial(ragged_paged_attention_pallas, sm_scale=0.1, variant="gpu",
                                   interpret=False), case_of("decode_1seq_32k_d128_p16_bf16"),
                 "cuda").as_text()
    grid = dict(re.findall(r"grid_([xyz]) = (\d+)", text))
    assert grid == {"x": "1", "y": "8", "z": str(splits)}
    text = lower(functools.partial(ragged_paged_attention_pallas, sm_scale=0.1, variant="gpu",
                                   interpret=False), case_of("decode_8seq_d128_p16_bf16"),
                 "cuda").as_text()
    assert dict(re.findall(r"grid_([xyz]) = (\d+)", text))["z"] == "1"  # 64 programs, 8 tiles


def triton_module_text(case, monkeypatch, capfd, **kw):
    """The Triton IR of the GPU kernel for ``case`` (pallas_call's debug print)."""
    debug_pl = types.SimpleNamespace(**{n: getattr(pallas_kernel.pl, n) for n in dir(pallas_kernel.pl)
                                        if not n.startswith("__")})
    debug_pl.pallas_call = functools.partial(pallas_kernel.pl.pallas_call, debug=True)
    monkeypatch.setattr(pallas_kernel, "pl", debug_pl)
    capfd.readouterr()
    lower(functools.partial(ragged_paged_attention_pallas, sm_scale=0.1, variant="gpu",
                            interpret=False, **kw), case, "cuda")
    return capfd.readouterr().out


def test_triton_ir_reads_as_text_from_the_lowering():
    """``testing.triton_modules`` prints the Triton module Pallas serializes into the custom call
    XLA compiles (what the device check writes next to its JSON): the kernel function, its two
    dots, the same module pallas_call's debug print shows."""
    from jaxrunner.kernels.testing import triton_modules

    case = case_of("mixed_d64_p8_f32_gqa3")
    lowered = lower(functools.partial(ragged_paged_attention_pallas, sm_scale=0.1, variant="gpu",
                                      interpret=False), case, "cuda")
    (text,) = triton_modules(lowered)
    assert "tt.func public @ragged_paged_attention_triton" in text
    assert len([line for line in text.splitlines() if "tt.dot " in line]) == 2
    assert "pallas_kernel.py" in text  # source locations kept


@pytest.mark.parametrize("num_splits", [1, 4])
def test_float32_triton_dots_are_full_precision(monkeypatch, capfd, num_splits):
    """A float32 cache's dots carry no TF32: Triton's default for f32 ``tt.dot`` is TF32 unless
    the dot asks for IEEE, which ``Precision.HIGHEST`` does."""
    case = make_case(np.random.default_rng(1), [1, 3], [70, 40], num_q_heads=8, num_kv_heads=2,
                     head_dim=64, page_size=16, num_tokens=8, max_seqs=3)
    text = triton_module_text(case, monkeypatch, capfd, num_splits=num_splits)
    dots = [line for line in text.splitlines() if "tt.dot " in line]
    assert len(dots) == 2, text[-2000:]                               # QK^T and PV
    assert all("xf32> *" in line and "tf32" not in line for line in dots), dots
    assert "math.exp2" in text or "exp2" in text                      # log2(e) folded in


def test_bf16_triton_dots_take_bf16_operands(monkeypatch, capfd):
    case = make_case(np.random.default_rng(1), [1, 3], [70, 40], num_q_heads=8, num_kv_heads=2,
                     head_dim=64, page_size=16, num_tokens=8, max_seqs=3, dtype="bfloat16")
    dots = [line for line in triton_module_text(case, monkeypatch, capfd).splitlines()
            if "tt.dot " in line]
    assert len(dots) == 2 and all("xbf16> *" in line for line in dots), dots


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("head_dim,page_size", [(64, 16), (96, 16), (128, 8), (80, 32), (64, 1),
                                                (128, 1)])
def test_auto_picks_an_impl_that_lowers(platform, head_dim, page_size):
    """``auto`` never picks an implementation that cannot lower for the shapes; where it falls
    back, it says why, and the kernel it avoided does fail to lower."""
    impl, why = kernels.choose_impl("auto", platform, head_dim, page_size)
    case = make_case(np.random.default_rng(head_dim), [1, 4], [40, 20], num_q_heads=4,
                     num_kv_heads=2, head_dim=head_dim, page_size=page_size, num_tokens=8,
                     max_seqs=3, dtype="bfloat16", poison=False)
    variant = TARGETS[platform][0]
    fns = {"pallas": functools.partial(ragged_paged_attention_pallas, variant=variant, interpret=False),
           "jax_tpu": jax_tpu.ragged_paged_attention_jax_tpu,
           "xla": ragged_paged_attention_xla}
    lower(functools.partial(fns[impl], sm_scale=0.1), case, platform)
    if platform == "cuda" and impl != "pallas":
        assert "power of two" in why
        with pytest.raises(Exception):
            lower(functools.partial(fns["pallas"], sm_scale=0.1), case, platform)
    if platform == "tpu" and impl != "jax_tpu":
        assert "128" in why or "no jax" in why
    if platform == "tpu" and impl == "xla":
        assert "2+ rows" in why
        with pytest.raises(Exception):
            lower(functools.partial(fns["pallas"], sm_scale=0.1), case, platform)


H200_SHARED_MEMORY = pallas_kernel.SHARED_MEMORY_BYTES[(9, 0)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_auto_lowers_within_shared_memory(head_dim, group, dtype):
    """For every head size and GQA group, ``auto``'s GPU choice lowers for a prefill chunk (the
    largest query tiles); where it is the Triton kernel, the tiles it got fit an H200's shared
    memory by the estimate, with the budget's stages and warps."""
    impl, why = kernels.choose_impl("auto", "gpu", head_dim, 16)
    case = make_case(np.random.default_rng(head_dim), [96, 1], [96, 300], num_q_heads=2 * group,
                     num_kv_heads=2, head_dim=head_dim, page_size=16, num_tokens=128, max_seqs=3,
                     dtype=dtype, poison=False)
    if impl != "pallas":
        assert head_dim in (80, 96) and "power of two" in why
        lower(functools.partial(ragged_paged_attention_xla, sm_scale=0.1), case, "cuda")
        return
    text = lower(functools.partial(ragged_paged_attention_pallas, sm_scale=0.1, variant="gpu", interpret=False,
                                   shared_memory_bytes=H200_SHARED_MEMORY), case, "cuda").as_text()
    itemsize = np.dtype(case.k_pages.dtype).itemsize
    call = next(line for line in text.splitlines() if "xla.gpu.triton" in line)
    operands = re.findall(r"tensor<([\dx]+)x[a-z]+\d+>", call.rsplit(" : (", 1)[1])
    rows = int(operands[5].split("x")[2])                 # the query tiles [blocks, Hkv, rows, D]
    stages = {int(s) for s in re.findall(r"num_stages = (\d+)", text)}
    warps = {int(w) for w in re.findall(r"num_warps = (\d+)", text)}
    assert warps == {pallas_kernel.gpu_num_warps(rows, head_dim)}
    assert rows <= pallas_kernel.gpu_max_rows(head_dim, itemsize, H200_SHARED_MEMORY)
    block_k, want_stages = pallas_kernel.choose_gpu_tiles(head_dim, itemsize, rows, H200_SHARED_MEMORY)
    assert stages == {want_stages}
    assert pallas_kernel.shared_memory_estimate(head_dim, itemsize, rows, block_k, want_stages) <= H200_SHARED_MEMORY


def test_shared_memory_budget_shortens_kv_tiles_to_fit():
    """The estimate is one buffer per dot operand (measured: Triton asked an H200 for 295,680
    bytes for head_dim 256, float32, 128 rows, block_k 64, and refused it); the budget keeps the
    longest K/V tile that fits, keeps a fixed option, and names the sizes when nothing fits.
    Limits come from the device's compute capability."""
    est = pallas_kernel.shared_memory_estimate
    assert est(256, 4, 128, 64) - pallas_kernel.SHARED_MEMORY_SLACK + 768 == 295680
    assert est(256, 4, 128, 64, num_stages=3) == est(256, 4, 128, 64, num_stages=1)
    assert pallas_kernel.choose_gpu_tiles(128, 2, 128, H200_SHARED_MEMORY) == (64, 3)
    assert pallas_kernel.choose_gpu_tiles(256, 4, 128, H200_SHARED_MEMORY) == (32, 3)
    assert pallas_kernel.choose_gpu_tiles(256, 4, 128, H200_SHARED_MEMORY, num_stages=2) == (32, 2)
    assert pallas_kernel.choose_gpu_tiles(128, 2, 16, H200_SHARED_MEMORY, block_k=128) == (128, 3)
    assert pallas_kernel.gpu_max_rows(256, 4, H200_SHARED_MEMORY) == 128
    assert pallas_kernel.gpu_max_rows(256, 4, 99 << 10) == 16
    with pytest.raises(ValueError, match="head_dim 256.*block_k 64; the device allows 65536"):
        pallas_kernel.choose_gpu_tiles(256, 4, 128, 64 << 10, block_k=64)
    assert pallas_kernel.shared_memory_limit(types.SimpleNamespace(compute_capability="9.0")) == H200_SHARED_MEMORY
    assert pallas_kernel.shared_memory_limit(types.SimpleNamespace(compute_capability="8.6")) == 99 << 10
    assert pallas_kernel.shared_memory_limit(types.SimpleNamespace()) == pallas_kernel.DEFAULT_SHARED_MEMORY_BYTES
