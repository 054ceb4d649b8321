"""Every registered family beyond Llama against transformers, on tiny random-weight checkpoints.

Per family: the pure forward's logits against transformers', and the paged engine (chunked
prefill, a batch of mixed lengths, prompts longer than any sliding window) against transformers'
greedy ``generate``, token for token, with each sampled token's logprob checked too and nothing
compiled while serving. Tensor parallelism 2 on 8 forced CPU devices gives the same tokens (one
subprocess for all families).
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import train_tiny_tokenizer
from engine_helpers import COMPILE_CACHE, count_compilations, make_llm, token_ids
from jaxrunner import SamplingParams
from jaxrunner.models import registry
from jaxrunner.models.attention import AttentionMetadata, DenseAttention
from jaxrunner.models.config import UnsupportedModelError
from jaxrunner.models.registry import config_from_hf
from jaxrunner.models.loading import load_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FAMILIES = ("qwen3", "gemma2", "gemma3", "phi3", "phi3-longrope")
WINDOW = 8  # sliding window of the windowed families: every prompt below is longer
NEW_TOKENS = 24
# one token bucket of 32: the 45-token prompt is prefilled in chunks, decode batches pad to it
FAMILY_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, min_token_bucket=32, max_model_len=96,
                     page_size=8, num_pages=64)
PROMPT_LENGTHS = (9, 20, 33, 45)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "families_worker.py")


def tiny_family_config(family: str):
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=False)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, rms_norm_eps=1e-6, rope_theta=1e6)
    if family == "gemma2":
        # caps small enough that they bend these tiny models' scores and logits
        return transformers.Gemma2Config(**common, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                         attn_logit_softcapping=1.0, final_logit_softcapping=6.0)
    if family == "gemma3":
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
        return transformers.Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, query_pre_attn_scalar=16,
                                             sliding_window=WINDOW, rope_parameters=rope,
                                             layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    if family == "phi3":
        return transformers.Phi3Config(**common, sliding_window=12,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                        "partial_rotary_factor": 0.5})
    if family == "phi3-longrope":  # served up to original_max_position_embeddings (128 >= max_model_len)
        rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                "original_max_position_embeddings": 128, "short_factor": [1.0, 1.7, 3.1, 5.3],
                "long_factor": [2.0, 4.0, 8.0, 16.0]}
        return transformers.Phi3Config(**{**common, "max_position_embeddings": 512},
                                       original_max_position_embeddings=128, rope_parameters=rope)
    raise ValueError(family)


def build_family_checkpoint(path, family: str, seed: int = 0) -> str:
    """Random weights, norms and head set so that every quirk shows: norm weights away from their
    neutral value, the output head scaled up so greedy choices are not near-ties."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_family_config(family), dtype=torch.float32)
    offset_norms = family.startswith("gemma")  # Gemma scales by 1 + w
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if offset_norms else 1.0, 0.3)
            else:
                p.normal_(0.0, 0.08)
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    train_tiny_tokenizer(512).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: build_family_checkpoint(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [{"prompt_token_ids": rng.integers(3, 512, n).tolist()} for n in PROMPT_LENGTHS]


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(checkpoints, prompts):
    """family -> (greedy tokens per prompt, log-softmax of each generated token) from transformers."""
    result = {}
    for family, path in checkpoints.items():
        model, tokens, logprobs = hf_model(path), [], []
        for prompt in prompts:
            ids = torch.tensor(prompt["prompt_token_ids"])[None]
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)
                full = torch.log_softmax(model(out).logits[0].float(), -1)
            new = out[0, ids.shape[1]:]
            tokens.append(new.tolist())
            positions = torch.arange(ids.shape[1] - 1, out.shape[1] - 1)
            logprobs.append(full[positions, new].numpy())
        result[family] = (tokens, logprobs)
    return result


# ----------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-4), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoints, family, dtype, tolerance):
    """The family's pure forward (dense attention, every row) against transformers' logits; in
    bfloat16 both sides round differently, so the bar is 3e-2 of the logit range."""
    ids = np.random.default_rng(3).integers(0, 512, 40)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=getattr(torch, dtype))
    with torch.no_grad():
        ref = model(torch.tensor(ids)[None]).logits[0].float().numpy()
    loaded = load_model(checkpoints[family], dtype, progress=False)
    cfg, arch = loaded.config, loaded.architecture or registry.architecture_for(loaded.config)
    hidden, _ = arch.forward(loaded.params, jnp.asarray(ids), jnp.arange(len(ids)), [None] * cfg.num_layers,
                             jnp.zeros(len(ids), jnp.int32), DenseAttention())
    ours = np.asarray(arch.compute_logits(loaded.params, hidden))
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) <= tolerance


def _paged_meta(start: int, stop: int, page_size: int = 8, pages_per_seq: int = 6) -> AttentionMetadata:
    """One sequence's tokens [start, stop) as one step over pages 1, 2, ... (page 0 is scratch)."""
    positions = np.arange(start, stop)
    pages = np.arange(1, pages_per_seq + 1, dtype=np.int32)
    return AttentionMetadata(
        slot_mapping=jnp.asarray(pages[positions // page_size] * page_size + positions % page_size, jnp.int32),
        kv_lens=jnp.asarray([stop], jnp.int32), page_indices=jnp.asarray(pages[None]),
        cu_q_lens=jnp.asarray([0, stop - start], jnp.int32), num_seqs=jnp.asarray(1, jnp.int32))


@pytest.mark.parametrize("impl", ["xla", "native", "pallas"])
def test_gemma_windows_and_caps_reach_every_kernel(checkpoints, impl):
    """Gemma 2's per-layer windows and attention caps through each paged kernel (pallas interprets
    on CPU): a 40-token prompt prefilled in two chunks gives the dense forward's logits."""
    from jaxrunner.kernels import native
    from jaxrunner.models.attention import PagedAttention
    from jaxrunner.runner.model_runner import KVCacheSpec

    if impl == "native" and not native.available():
        pytest.skip(native.unavailable_reason())
    loaded = load_model(checkpoints["gemma2"], "float32", progress=False)
    cfg, arch = loaded.config, registry.architecture_for(loaded.config)
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 512, 40))
    dense, _ = arch.forward(loaded.params, ids, jnp.arange(40), [None] * cfg.num_layers, jnp.zeros(40, jnp.int32),
                            DenseAttention())
    cache = KVCacheSpec(8, 8, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float32").allocate()
    step = jax.jit(functools.partial(arch.forward, attention=PagedAttention(impl)))
    chunks = []
    for start, stop in ((0, 24), (24, 40)):
        hidden, cache = step(loaded.params, ids[start:stop], jnp.arange(start, stop), cache, _paged_meta(start, stop))
        chunks.append(arch.compute_logits(loaded.params, hidden))
    np.testing.assert_allclose(np.concatenate(chunks), arch.compute_logits(loaded.params, dense), atol=2e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_matches_transformers_generate(checkpoints, prompts, reference, family):
    """Paged cache, chunked prefill, a mixed batch: the tokens and their logprobs of transformers."""
    llm = make_llm(checkpoints[family], **FAMILY_ENGINE)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    with count_compilations() as compiles:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert compiles == []
    assert llm.startup_report["model_family"] == family.split("-")[0]
    ref_tokens, ref_logprobs = reference[family]
    assert token_ids(outputs) == ref_tokens
    for output, expected in zip(outputs, ref_logprobs):
        got = [step[token].logprob for step, token in zip(output.outputs[0].logprobs, output.outputs[0].token_ids)]
        np.testing.assert_allclose(got, expected, atol=2e-3)


def test_tensor_parallel_2_gives_the_single_device_tokens(checkpoints, prompts, reference, tmp_path):
    """TP 2 on 8 forced CPU devices, every family in one subprocess: transformers' tokens again."""
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"models": checkpoints, "prompts": prompts, "max_tokens": NEW_TOKENS,
                               "engine": FAMILY_ENGINE, "tensor_parallel_size": 2}))
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAXRUNNER_COMPILATION_CACHE=COMPILE_CACHE,
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip())
    done = subprocess.run([sys.executable, WORKER, str(job)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for family in FAMILIES:
        assert results[family]["tokens"] == reference[family][0], family
        assert results[family]["serving_compiles"] == 0, family
        assert results[family]["sharded_devices"] == 2, family


def _write_qwen3_gguf(model_dir: str, path) -> str:
    """The tiny Qwen3 checkpoint as llama.cpp's converter names it (float32 tensors, no permutation:
    llama.cpp runs Qwen models in rotate-half mode)."""
    import gguf
    from jaxrunner.models.loading.hf import load_hf_state_dict, read_hf_config

    hf, state = read_hf_config(model_dir), load_hf_state_dict(model_dir)
    layer_names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                   "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                   "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                   "post_attention_layernorm": "ffn_norm"}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(hf["num_attention_heads"])
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_rope_freq_base(1e6)
    for name, array in state.items():
        if name not in top:
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
        writer.add_tensor(top.get(name) or f"blk.{i}.{layer_names[module]}.{kind}", np.asarray(array, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_qwen3_gguf_loads_to_transformers_logits(checkpoints, tmp_path):
    """llama.cpp's Qwen3 tensor names (q/k norms included) map onto the family's params."""
    from jaxrunner.models.loading.gguf import open_gguf
    from jaxrunner.models.params import params_from_state_dict

    gguf_file = _write_qwen3_gguf(checkpoints["qwen3"], tmp_path / "qwen3.gguf")
    checkpoint = open_gguf(gguf_file)
    cfg = config_from_hf(checkpoint.hf_config)
    params = params_from_state_dict(checkpoint.state_dict, cfg)
    ids = np.random.default_rng(3).integers(0, 512, 24)
    arch = registry.architecture_for(cfg)
    hidden, _ = arch.forward(params, jnp.asarray(ids), jnp.arange(len(ids)), [None] * cfg.num_layers,
                             jnp.zeros(len(ids), jnp.int32), DenseAttention())
    with torch.no_grad():
        ref = hf_model(checkpoints["qwen3"])(torch.tensor(ids)[None]).logits[0].numpy()
    ours = np.asarray(arch.compute_logits(params, hidden))
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) <= 1e-4


# ----------------------------------------------------------------------------- configs and the seam
def _hf_dict(family: str, **overrides) -> dict:
    return {**tiny_family_config(family).to_dict(), **overrides}


def test_gemma3_layer_pattern_five_to_one():
    d = _hf_dict("gemma3", num_hidden_layers=12)
    d.pop("layer_types")
    d["sliding_window_pattern"] = 6
    cfg = config_from_hf(d)
    assert [cfg.layer_sliding_window(i) for i in range(12)] == ([WINDOW] * 5 + [None]) * 2
    assert cfg.local_rope_theta == 1e4 and cfg.rope_theta == 1e6 and dict(cfg.rope_scaling)["factor"] == 2.0


def test_gemma2_alternates_and_reads_its_caps():
    cfg = config_from_hf(_hf_dict("gemma2", num_hidden_layers=4, layer_types=None))
    assert [cfg.layer_sliding_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.query_pre_attn_scalar) == (1.0, 6.0, 24.0)


def test_phi3_long_rope_serves_up_to_its_original_length(checkpoints):
    """Long-RoPE's short factors hold up to original_max_position_embeddings; past it transformers
    switches frequencies with the sequence length, so the engine refuses a longer max_model_len."""
    cfg = config_from_hf(_hf_dict("phi3-longrope"))
    assert cfg.max_position_embeddings == 128 and cfg.rope_short_factor == (1.0, 1.7, 3.1, 5.3)
    assert cfg.rope_attention_factor == pytest.approx((1 + np.log(4) / np.log(128)) ** 0.5)
    with pytest.raises(ValueError, match=r"max_model_len: 256 exceeds the model's max_position_embeddings \(128\)"):
        make_llm(checkpoints["phi3-longrope"], **{**FAMILY_ENGINE, "max_model_len": 256})
    with pytest.raises(UnsupportedModelError, match="rope_scaling type 'yarn' is not supported for phi3"):
        config_from_hf(_hf_dict("phi3", rope_parameters={"rope_type": "yarn", "factor": 2.0}))


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="supported architectures: .*Gemma2ForCausalLM.*Qwen3ForCausalLM"):
        config_from_hf({"architectures": ["FalconForCausalLM"], "model_type": "falcon"})


@pytest.mark.parametrize("family", ("llama",) + FAMILIES)
def test_partition_rules_cover_every_leaf_and_refuse_unknown_ones(family):
    """Sharding asks the family for every leaf; a leaf it does not name is an error, not replicated."""
    from jaxrunner.parallel import mesh as meshes, sharding

    hf = _hf_dict(family) if family != "llama" else transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2).to_dict()
    cfg = config_from_hf(hf)
    rules = registry.partition_rules(cfg)(2)
    shapes = registry.family_for_config(cfg).param_shapes(cfg)
    tree = jax.tree.map(np.zeros, shapes, is_leaf=lambda node: isinstance(node, tuple))
    specs = jax.tree_util.tree_map_with_path(lambda path, _: sharding.leaf_spec(path, rules), tree)
    assert specs["layers"][0]["wqkv"] == sharding.COLUMN and specs["layers"][0]["w_down"] == sharding.ROW
    int8 = {"layers": [{"wqkv": {"q": 0, "scale": 0}, "w_down": {"q": 0, "scale": 0}}]}
    int8_specs = jax.tree_util.tree_map_with_path(lambda path, _: sharding.leaf_spec(path, rules), int8)["layers"][0]
    assert int8_specs["wqkv"] == {"q": sharding.COLUMN, "scale": sharding.SPLIT}
    assert int8_specs["w_down"] == {"q": sharding.ROW, "scale": sharding.REPLICATED}
    tree["layers"][0]["mystery"] = np.zeros(3)
    with pytest.raises(sharding.PartitionRuleError, match="no partition rule for 'mystery'"):
        jax.tree_util.tree_map_with_path(lambda path, _: sharding.leaf_spec(path, rules), tree)
    # one shard: nothing to split, no rule needed
    assert sharding.param_shardings(tree, meshes.build_mesh(1, 1), registry.partition_rules(cfg))
