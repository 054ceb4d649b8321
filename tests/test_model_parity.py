"""Logits and greedy parity with transformers (torch CPU) on tiny random-weight configs of each family."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_FAMILIES, build_tiny_checkpoint
from engine_helpers import count_compilations, make_llm, random_prompts, token_ids
from jaxrunner import SamplingParams, kernels
from jaxrunner.kernels import onednn
from jaxrunner.models import packed_weights, registry
from jaxrunner.models.decoder import Decoder
from jaxrunner.models.attention import DenseAttention
from jaxrunner.models.loading import load_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def hf_logits(model_dir: str, ids: np.ndarray, dtype=torch.float32) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0].float().numpy()


def hf_greedy(model_dir: str, prompts: list[dict], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate (float32, EOS ignored) of each prompt's new tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    for prompt in prompts:
        ids = torch.tensor(prompt["prompt_token_ids"])[None]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(out[0, ids.shape[1]:].tolist())
    return outs


def our_logits(model_dir: str, ids: np.ndarray, dtype: str, rows=None, matmuls=kernels.XLA_MATMULS) -> np.ndarray:
    loaded = load_model(model_dir, dtype, progress=False)
    cfg = loaded.config
    decoder = Decoder(cfg, matmuls)
    params = packed_weights.pack(loaded.params, registry.family_for_config(cfg).quantized_leaves, matmuls)
    hidden, _ = decoder.forward(params, jnp.asarray(ids), jnp.arange(len(ids)), [None] * cfg.num_layers,
                                jnp.zeros(len(ids), jnp.int32), DenseAttention(), rows=rows)
    return np.asarray(decoder.compute_logits(params, hidden))


@pytest.mark.parametrize("rows", [[0], [3, 11, 11], [11, 2]])
def test_forward_on_selected_rows_matches_those_rows_of_the_full_forward(tiny_checkpoints, rows):
    """``rows`` cuts the last layer's output projection and MLP to the sampled rows only."""
    ids = np.random.default_rng(3).integers(0, 512, 12)
    full = our_logits(tiny_checkpoints["llama"], ids, "float32")
    picked = our_logits(tiny_checkpoints["llama"], ids, "float32", rows=jnp.asarray(rows))
    assert picked.shape == (len(rows), full.shape[1])
    np.testing.assert_allclose(picked, full[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_float32_logits_match_transformers(tiny_checkpoints, family):
    ids = np.random.default_rng(3).integers(0, 512, 96)
    ref = hf_logits(tiny_checkpoints[family], ids)
    ours = our_logits(tiny_checkpoints[family], ids, "float32")
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) <= 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bfloat16_logits_close_to_transformers(tiny_checkpoints, family):
    """bfloat16 has 8 mantissa bits: both sides round differently, so the bar is 3e-2 of the logit range."""
    ids = np.random.default_rng(4).integers(0, 512, 64)
    ref = hf_logits(tiny_checkpoints[family], ids, torch.bfloat16)
    ours = our_logits(tiny_checkpoints[family], ids, "bfloat16")
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) <= 3e-2


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bfloat16_one_token_logits_close_to_transformers(tiny_checkpoints, family, monkeypatch):
    """One token makes every projection one row, which on one CPU device the native bf16 matmul
    computes (where it was built): a decode step's path, with the matmul choice the runner makes
    here, against transformers in bfloat16."""
    here = kernels.capabilities()
    calls = []
    kernel = kernels.small_matmul_native
    monkeypatch.setattr(kernels, "small_matmul_native", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    ids = np.array([123])
    ref = hf_logits(tiny_checkpoints[family], ids, torch.bfloat16)
    ours = our_logits(tiny_checkpoints[family], ids, "bfloat16", matmuls=here.matmuls)
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) <= 3e-2
    assert bool(calls) == (here.native_cpu is None)


ONEDNN_MISSING = kernels.onednn_unavailable()
ONEDNN_ALL = kernels.MatmulKernels(onednn_dtypes=("float32", "bfloat16"))


@pytest.mark.skipif(ONEDNN_MISSING is not None, reason=f"oneDNN unavailable: {ONEDNN_MISSING}")
@pytest.mark.parametrize("dtype, bar", [("float32", 1e-4), pytest.param(
    "bfloat16", 3e-2, marks=pytest.mark.skipif(ONEDNN_MISSING is None and not onednn.has_matmul("bfloat16"),
                                               reason="oneDNN has no bf16 matmul on this CPU (AVX2 alone)"))])
def test_logits_on_onednn_matmuls_match_transformers(tmp_path, dtype, bar):
    """Every layer product through oneDNN on packed weights, against transformers."""
    path = build_tiny_checkpoint(tmp_path / "tied", "llama", seed=3, tied=True)
    ids = np.random.default_rng(4).integers(0, 512, 64)
    ref = hf_logits(path, ids, getattr(torch, dtype))
    ours = our_logits(path, ids, dtype, matmuls=ONEDNN_ALL)
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) <= bar


@pytest.mark.skipif(ONEDNN_MISSING is not None, reason=f"oneDNN unavailable: {ONEDNN_MISSING}")
def test_engine_on_onednn_matmuls_matches_transformers_and_serves_without_compiling(tiny_checkpoints):
    """``cpu_matmul="onednn"``: oneDNN's primitives are made during warm-up, and serving compiles nothing."""
    path = tiny_checkpoints["llama"]
    prompts = random_prompts(4, 512, 5, 40, seed=12)
    llm = make_llm(path, cpu_matmul="onednn")
    assert llm.startup_report["cpu_matmul"].startswith("onednn") and llm.startup_report["cpu_matmul_reason"] == "asked for"
    with count_compilations() as compiles:
        ours = token_ids(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                      use_tqdm=False))
    assert compiles == []
    assert ours == hf_greedy(path, prompts, 12)


def test_tied_embeddings(tmp_path):
    path = build_tiny_checkpoint(tmp_path / "tied", "llama", seed=3, tied=True)
    ids = np.random.default_rng(5).integers(0, 512, 32)
    ref = hf_logits(path, ids)
    assert np.max(np.abs(our_logits(path, ids, "float32") - ref)) / np.max(np.abs(ref)) <= 1e-4


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_engine_greedy_matches_transformers_generate(tiny_checkpoints, family):
    """The paged engine (chunked prefill, batching) against HF's greedy generate, token for token."""
    path = tiny_checkpoints[family]
    prompts = random_prompts(4, 512, 5, 40, seed=11)
    llm = make_llm(path)
    ours = token_ids(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                  use_tqdm=False))
    assert ours == hf_greedy(path, prompts, 12)
