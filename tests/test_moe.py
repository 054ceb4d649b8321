"""Mixture of experts: the MoE layer against numpy, and Mixtral / Qwen3-MoE against transformers."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.models import moe


# ----------------------------------------------------------------------------- the layer
def numpy_moe(x, router, w_gate_up, w_down, top_k, normalize, valid=None):
    """Every token through its top-k experts one at a time (float64)."""
    x, router, w_gate_up, w_down = (np.asarray(a, np.float64) for a in (x, router, w_gate_up, w_down))
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    inter = w_down.shape[1]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        if valid is not None and not valid[t]:
            continue
        chosen = np.argsort(-probs[t], kind="stable")[:top_k]
        weights = probs[t, chosen] / (probs[t, chosen].sum() if normalize else 1.0)
        for e, w in zip(chosen, weights):
            gate_up = x[t] @ w_gate_up[e]
            gate, up = gate_up[:inter], gate_up[inter:]
            out[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ w_down[e])
    return out


def random_moe_weights(seed, d=32, experts=8, inter=24):
    rng = np.random.default_rng(seed)
    return (rng.normal(0, 0.5, (d, experts)).astype(np.float32),
            rng.normal(0, 0.2, (experts, d, 2 * inter)).astype(np.float32),
            rng.normal(0, 0.2, (experts, inter, d)).astype(np.float32))


@pytest.mark.parametrize("impl", moe.IMPLS)
@pytest.mark.parametrize("tokens,normalize", [(1, True), (5, False), (37, True), (200, False)])
def test_moe_layer_matches_numpy(tokens, normalize, impl):
    router, w_gate_up, w_down = random_moe_weights(tokens)
    x = np.random.default_rng(100 + tokens).normal(0, 1, (tokens, 32)).astype(np.float32)
    spec = moe.MoESpec(num_experts=8, top_k=2, intermediate_size=24, normalize_top_k=normalize)
    out = jax.jit(lambda *a: moe.moe_mlp(*a, spec, impl=impl))(x, router, w_gate_up, w_down)
    np.testing.assert_allclose(np.asarray(out), numpy_moe(x, router, w_gate_up, w_down, 2, normalize),
                               rtol=2e-5, atol=2e-5)


def test_moe_layer_all_tokens_on_one_expert():
    """A router whose logits favour expert 5 for every token (then 2): one group holds every row."""
    router, w_gate_up, w_down = random_moe_weights(7)
    x = np.abs(np.random.default_rng(8).normal(0, 1, (64, 32))).astype(np.float32) + 0.5
    router[:] = 0.0
    router[:, 5], router[:, 2] = 1.0, 0.5
    spec = moe.MoESpec(num_experts=8, top_k=2, intermediate_size=24, normalize_top_k=True)
    counts = np.asarray(moe.expert_counts(jnp.asarray(x), jnp.asarray(router), spec))
    assert counts.tolist() == [0, 0, 64, 0, 0, 64, 0, 0]
    out = jax.jit(lambda *a: moe.moe_mlp(*a, spec))(x, router, w_gate_up, w_down)
    np.testing.assert_allclose(np.asarray(out), numpy_moe(x, router, w_gate_up, w_down, 2, True),
                               rtol=2e-5, atol=2e-5)


def test_moe_layer_padding_rows_take_no_assignment():
    """Rows past ``valid`` give zeros, leave the tokens' outputs unchanged, and load no expert."""
    router, w_gate_up, w_down = random_moe_weights(3)
    x = np.random.default_rng(4).normal(0, 1, (48, 32)).astype(np.float32)
    valid = np.arange(48) < 19
    spec = moe.MoESpec(num_experts=8, top_k=2, intermediate_size=24, normalize_top_k=True)
    out = np.asarray(jax.jit(lambda *a: moe.moe_mlp(*a, spec, valid=jnp.asarray(valid)))(x, router, w_gate_up, w_down))
    np.testing.assert_allclose(out, numpy_moe(x, router, w_gate_up, w_down, 2, True, valid), rtol=2e-5, atol=2e-5)
    assert not out[19:].any()
    counts = moe.expert_counts(jnp.asarray(x), jnp.asarray(router), spec, jnp.asarray(valid))
    assert int(counts.sum()) == 19 * 2


def test_moe_layer_refuses_unknown_impl():
    router, w_gate_up, w_down = random_moe_weights(0)
    spec = moe.MoESpec(num_experts=8, top_k=2, intermediate_size=24, normalize_top_k=True)
    with pytest.raises(ValueError, match="moe impl='dense' is not one of blocks, ragged_dot"):
        moe.moe_mlp(jnp.zeros((2, 32)), router, w_gate_up, w_down, spec, impl="dense")


def test_block_layout_bounds():
    """The static block count covers the worst routing, and blocks are powers of two in [8, 256]."""
    for assignments in (1, 2, 32, 512, 4096):
        rows = moe.block_rows_for(assignments, 8)
        assert 8 <= rows <= 256 and rows & (rows - 1) == 0
        worst = sum(-(-c // rows) for c in [assignments - 7] + [1] * 7) if assignments >= 8 else assignments
        assert moe.max_blocks(assignments, 8, rows) >= worst


# ----------------------------------------------------------------------------- the families
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = ("mixtral", "qwen3_moe")
PARITY_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, min_token_bucket=32)


def tiny_moe_config(family: str):
    """2 layers, hidden 64, 4 query / 2 KV heads, 8 experts of width 32, top-2."""
    common = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  num_experts_per_tok=2)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=8, rms_norm_eps=1e-5)
    return transformers.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                       head_dim=16, norm_topk_prob=False, rms_norm_eps=1e-6)


def build_tiny_moe(path, family: str, seed: int = 0) -> str:
    """Random weights, norms around 1 (not 1), a router wide enough that top-2 is rarely a near tie,
    and an output head scaled so greedy choices are not near-ties."""
    from conftest import train_tiny_tokenizer

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.6, 1.4)
            elif name.endswith("gate.weight"):  # the router
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.08)
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    train_tiny_tokenizer(512).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {family: build_tiny_moe(root / family, family) for family in FAMILIES}


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-4), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_logits_match_transformers(moe_checkpoints, family, dtype, tolerance):
    """The pure forward (dense attention) against transformers, relative to the logit range. In
    bfloat16 both sides round differently (bar 3e-2), and a router near-tie then picks another
    expert for a token now and then (transformers itself routes one of these 48 tokens differently
    in bfloat16 than in float32), so one row in 24 may miss."""
    from jaxrunner.models.attention import DenseAttention
    from jaxrunner.models.loading import load_model

    ids = np.random.default_rng(3).integers(3, 512, 48)
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_checkpoints[family], dtype=getattr(torch, dtype))
    with torch.no_grad():
        ref = model(torch.tensor(ids)[None]).logits[0].float().numpy()
    loaded = load_model(moe_checkpoints[family], dtype, progress=False)
    arch = loaded.architecture if loaded.architecture is not None else _architecture(loaded.config)
    hidden, _ = arch.forward(loaded.params, jnp.asarray(ids), jnp.arange(len(ids)), [None] * loaded.config.num_layers,
                             jnp.zeros(len(ids), jnp.int32), DenseAttention())
    ours = np.asarray(arch.compute_logits(loaded.params, hidden))
    row_errors = np.max(np.abs(ours - ref), axis=1) / np.max(np.abs(ref))
    allowed_misses = 0 if dtype == "float32" else len(ids) // 24
    assert np.sum(row_errors > tolerance) <= allowed_misses, row_errors


def _architecture(cfg):
    from jaxrunner.models import registry

    return registry.architecture_for(cfg)


def prompts():
    from engine_helpers import random_prompts

    return random_prompts(4, 512, 3, 70, seed=11)


@pytest.fixture(scope="module")
def hf_greedy(moe_checkpoints):
    """family -> transformers' 24 greedy tokens for each of :func:`prompts`, and their logprobs."""
    tokens, logprobs = {}, {}
    for family, path in moe_checkpoints.items():
        model = hf_model(path)
        tokens[family], logprobs[family] = [], []
        for prompt in prompts():
            ids = torch.tensor(prompt["prompt_token_ids"])[None]
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
                full = torch.log_softmax(model(out).logits[0], -1)
            new = out[0, ids.shape[1]:]
            tokens[family].append(new.tolist())
            logprobs[family].append(full[torch.arange(ids.shape[1] - 1, out.shape[1] - 1), new].numpy())
    return {"tokens": tokens, "logprobs": logprobs}


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_engine_greedy_matches_transformers_generate(moe_checkpoints, hf_greedy, family):
    """24 greedy tokens and their logprobs through LLM: paged cache, chunked prefill (prompts past
    the 32-token step), a batch of mixed lengths; nothing compiles while serving; the warm-up's
    expert-load report."""
    from engine_helpers import count_compilations, make_llm, token_ids
    from jaxrunner import SamplingParams

    llm = make_llm(moe_checkpoints[family], **PARITY_ENGINE)
    with count_compilations() as compiles:
        outputs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1),
                               use_tqdm=False)
    assert compiles == []
    assert token_ids(outputs) == hf_greedy["tokens"][family]
    for output, expected in zip(outputs, hf_greedy["logprobs"][family]):
        got = [step[token].logprob for step, token in zip(output.outputs[0].logprobs, output.outputs[0].token_ids)]
        np.testing.assert_allclose(got, expected, atol=2e-3)
    load = llm.startup_report["expert_load"]
    assert load["random"]["tokens"] > 0 and load["random"]["expert_blocks"] > 0
    assert load["zeros"]["tokens"] == 0 and load["zeros"]["expert_blocks"] == 0
    # zero dummies all route to the same top_k experts: max/mean = experts / top_k
    assert load["zeros"]["rows_max_over_mean"] == pytest.approx(8 / 2)
    assert load["random"]["max_over_mean"] < load["zeros"]["rows_max_over_mean"]


@pytest.mark.parametrize("field,value", [("mlp_only_layers", [1]), ("decoder_sparse_step", 2),
                                         ("use_sliding_window", True)])
def test_qwen3_moe_refuses_dense_layers(field, value):
    from jaxrunner.models.config import UnsupportedModelError
    from jaxrunner.models.qwen3_moe import config_from_hf

    cfg = tiny_moe_config("qwen3_moe").to_dict()
    cfg[field] = value
    with pytest.raises(UnsupportedModelError, match=re.escape(f"{field}={value} is not supported")):
        config_from_hf(cfg)


def test_expert_parallel_size_must_divide_the_experts():
    from jaxrunner.models.mixtral import config_from_hf
    from jaxrunner.models.moe_decoder import partition_rules

    cfg = tiny_moe_config("mixtral").to_dict()
    cfg["num_local_experts"] = 6
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide num_experts=6"):
        partition_rules(config_from_hf(cfg), 4)


def test_moe_tensor_and_expert_parallel_match_transformers(moe_checkpoints, hf_greedy):
    """TP 2 on 8 forced CPU devices (attention heads split, experts split 4 + 4 over the model axis)
    serves transformers' tokens (which one device serves, above), each device holding about half
    the weights, with no compiles while serving."""
    import json
    import os
    import subprocess
    import sys

    from engine_helpers import COMPILE_CACHE

    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parallel_worker.py")
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAXRUNNER_COMPILATION_CACHE=COMPILE_CACHE,
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip())
    done = subprocess.run([sys.executable, worker, "moe", json.dumps(moe_checkpoints)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for family in FAMILIES:
        served = results[family]
        assert served["tokens"] == hf_greedy["tokens"][family]
        assert served["serving_compiles"] == 0
        assert served["weights_bytes_per_device"] < 0.6 * served["weights_bytes"]
