"""A GGUF's quantized blocks repacked into weight-only leaves without going through float
(``loading/gguf_blocks.py``): each type against ``gguf.quants.dequantize`` (numpy reference), and
an engine serving a 4-bit GGUF from the file's own blocks."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine_helpers import TINY_ENGINE
from jaxrunner.models import quant
from jaxrunner.models.loading import gguf_blocks
from test_gguf import TINY, hf_weights, write_gguf

Q = gguf.GGMLQuantizationType


def _raw_q4_k(rows: int, k: int, rng) -> np.ndarray:
    """Random but valid Q4_K bytes (gguf-py can dequantize Q4_K but not quantize it)."""
    blocks = rng.integers(0, 256, (rows, k // 256, 144)).astype(np.uint8)
    d = (rng.random((rows, k // 256, 2)) * 0.01).astype(np.float16)
    blocks[..., 0:4] = d.view(np.uint8).reshape(rows, k // 256, 4)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_blocks_repack_exactly(qtype):
    rng = np.random.default_rng(0)
    rows, k = 6, 512
    if qtype == Q.Q4_K:
        raw = _raw_q4_k(rows, k, rng)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((rows, k)).astype(np.float32), qtype)
    want = gguf.quants.dequantize(raw, qtype).reshape(rows, k)
    leaf = gguf_blocks.weight_only_leaf(qtype.name, raw)
    int8 = qtype == Q.Q8_0
    assert leaf["packed"].dtype == (np.int8 if int8 else np.uint8)
    assert leaf["packed"].shape == (rows, k if int8 else k // 2) and leaf["scales"].shape == (rows, k // 32)
    assert ("offsets" in leaf) == (not int8)
    got = quant.dequantize(leaf, np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=1e-7 * np.abs(want).max())


def test_types_without_an_exact_form_are_left_to_float():
    assert gguf_blocks.weight_only_leaf("Q6_K", np.zeros((1, 210), np.uint8)) is None
    assert gguf_blocks.weight_only_leaf("F32", np.zeros((1, 4), np.uint8)) is None


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_engine_serves_the_files_own_blocks(tmp_path, qtype):
    """LLM(gguf, quantization="int4"): every linear leaf dequantizes to what gguf-py dequantizes
    the file's tensors to (Q/K rows un-permuted, q/k/v and gate/up fused), and it generates."""
    from jaxrunner import LLM, SamplingParams
    from jaxrunner.models.loading.gguf import open_gguf
    from jaxrunner.models.params import host_params_from_state_dict

    path = write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", "llama", hf_weights("llama", tied=False), qtype)
    llm = LLM(path, quantization="int4", **TINY_ENGINE)
    checkpoint = open_gguf(path)
    from jaxrunner.models.registry import config_from_hf
    floats = host_params_from_state_dict(checkpoint.state_dict, config_from_hf(checkpoint.hf_config))
    for i, layer in enumerate(llm.engine.executor.runner.plain_params()["layers"]):  # as loaded, not laid out
        for name in quant.QUANTIZED_WEIGHTS:
            leaf = {key: np.asarray(part) for key, part in layer[name].items()}
            assert leaf["packed"].dtype == (np.int8 if qtype == Q.Q8_0 else np.uint8)
            assert leaf["scales"].shape[1] == leaf["packed"].shape[1] * (1 if qtype == Q.Q8_0 else 2) // 32
            np.testing.assert_allclose(quant.dequantize(leaf, np.float32), floats["layers"][i][name].T,
                                       rtol=2e-7, atol=1e-7, err_msg=f"layer {i} {name}")
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert TINY["inter"] % 32 == 0
