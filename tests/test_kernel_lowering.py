"""The Pallas kernels lower for GPU (Triton) and TPU (Mosaic) from this CPU-only machine.

Lowering runs the whole Pallas -> Triton-IR / Mosaic-MLIR translation (shape, tiling and op
support checks); only the final device compile (Triton -> PTX, Mosaic -> TPU) needs hardware,
and that is what ``scripts/device_check.sh`` covers on a GPU machine.
"""
from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxrunner.kernels.pallas_kernel import ragged_paged_attention_pallas
from jaxrunner.kernels.testing import make_case

TARGETS = {"cuda": ("gpu", "__gpu$xla.gpu.triton"), "tpu": ("tpu", "tpu_custom_call")}

# (q_lens, kv_lens, kwargs): a representative decode batch and a mixed prefill/decode batch
SHAPES = {
    "decode_8seq_d128_p16_bf16": ([1] * 8, [33, 16, 17, 64, 100, 1, 5, 128],
                                  dict(num_q_heads=32, num_kv_heads=8, head_dim=128,
                                       page_size=16, width=8, dtype="bfloat16")),
    "mixed_d64_p8_f32_gqa3": ([1, 1, 20, 7, 1], [40, 9, 20, 60, 3],
                              dict(num_q_heads=9, num_kv_heads=3, head_dim=64, page_size=8,
                                   num_tokens=40, max_seqs=8, width=8)),
    "prefill_d128_p128_bf16": ([64, 32], [64, 200],
                               dict(num_q_heads=16, num_kv_heads=2, head_dim=128,
                                    page_size=128, num_tokens=128, max_seqs=4, width=2,
                                    dtype="bfloat16")),
}


@pytest.mark.parametrize("platform", list(TARGETS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("attn", [{}, dict(sliding_window=24, soft_cap=30.0)],
                         ids=["plain", "window+softcap"])
def test_pallas_lowers(platform, shape, attn):
    variant, custom_call = TARGETS[platform]
    q_lens, kv_lens, kw = SHAPES[shape]
    case = make_case(np.random.default_rng(0), q_lens, kv_lens, **kw)
    fn = jax.jit(functools.partial(ragged_paged_attention_pallas, sm_scale=0.1, variant=variant,
                                   interpret=False, **attn))
    lowered = fn.trace(*case.args()).lower(lowering_platforms=(platform,))
    text = lowered.as_text()
    assert custom_call in text
    assert lowered.out_info.shape == case.q.shape
    assert lowered.out_info.dtype == case.q.dtype
