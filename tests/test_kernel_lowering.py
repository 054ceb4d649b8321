"""The accelerator kernels lower for GPU (Triton) and TPU (Mosaic) from this CPU-only machine.

Lowering runs the whole Pallas -> Triton-IR / Mosaic-MLIR translation (shape, tiling and op
support checks); only the final device compile (Triton -> PTX, Mosaic -> TPU) needs hardware,
and that is what ``scripts/device_check.sh`` covers on a GPU machine. jax >= 0.11 needs an
abstract device to lower for a platform the host lacks: ``kernels.testing.lowering_context``.
"""
from __future__ import annotations

import functools
import re
import types

import jax
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
