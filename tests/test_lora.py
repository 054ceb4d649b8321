"""LoRA adapters against transformers + PEFT: each adapter alone, several in one batch (more
adapters than device slots), adapters given from memory and swapped, quantized bases, bad
adapters refused by name, and nothing compiled or leaked while adapters load, evict and switch."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from conftest import build_tiny_checkpoint, train_tiny_tokenizer
from engine_helpers import count_compilations, make_llm, token_ids
from jaxrunner import LoRARequest, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, targets, rank, alpha, rsLoRA)
ADAPTERS = {"all": (1, ALL_TARGETS, 8, 16, False), "qv": (2, ["q_proj", "v_proj"], 4, 8, False),
            "mlp_rs": (3, ["o_proj", "gate_proj", "down_proj"], 8, 4, True)}
PROMPTS = [[5, 17, 33, 9, 100, 200, 7], [44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54], [300, 301, 302]]
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
LORA_ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=4)


def save_adapter(base: str, path, seed: int, targets, rank: int, alpha: float, rslora: bool = False):
    """A PEFT adapter with random (non-zero) A and B saved at ``path``; returns the merged model."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                             use_rslora=rslora)
    adapted = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.1)
    adapted.save_pretrained(path)
    return adapted.merge_and_unload()


def greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def family_references(root, family: str, base: str) -> dict:
    """Adapter directories and transformers' greedy tokens: {name: (LoRARequest, [tokens per prompt],
    merged model)}, None for the base model."""
    plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    refs = {None: (None, [greedy(plain, p) for p in PROMPTS], plain)}
    for index, (name, (seed, targets, rank, alpha, rslora)) in enumerate(ADAPTERS.items(), start=1):
        path = os.path.join(root, f"{family}-{name}")
        merged = save_adapter(base, path, seed, targets, rank, alpha, rslora)
        refs[name] = (LoRARequest(name, index, path), [greedy(merged, p) for p in PROMPTS], merged)
    return refs


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_checkpoint(root / "base", "llama")
    return base, family_references(str(root), "llama", base)


@pytest.fixture(scope="module")
def llm(llama):
    return make_llm(llama[0], **LORA_ENGINE)


def prompts(count: int = 1) -> list[dict]:
    return [{"prompt_token_ids": p} for p in PROMPTS] * count


def test_each_adapter_gives_transformers_peft_merged_tokens(llm, llama):
    for name, (request, want, _) in llama[1].items():
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False, lora_request=request)) == want, name


def test_one_batch_mixes_more_adapters_than_slots_compiles_nothing_and_frees_every_page(llm, llama):
    refs = llama[1]
    order = [None, "all", "qv", "mlp_rs", "qv", None, "all"]
    requests = [refs[name][0] for name in order for _ in PROMPTS]
    with count_compilations() as compiles:
        got = token_ids(llm.generate(prompts(len(order)), GREEDY, use_tqdm=False, lora_request=requests))
    assert got == [tokens for name in order for tokens in refs[name][1]]
    assert compiles == []
    allocator = llm.engine.scheduler.allocator
    assert allocator.num_used_pages == 0
    assert llm.engine.replicas[0].adapter_slots.num_loads >= 3  # three adapters through two slots


def test_prefix_cache_keeps_adapters_apart(llm, llama):
    refs = llama[1]
    long_prompt = list(range(3, 43))  # 5 full pages: cached after the first request
    seen = set()
    for name in (None, "all", None, "all", "qv"):
        out = llm.generate({"prompt_token_ids": long_prompt}, GREEDY, use_tqdm=False, lora_request=refs[name][0])[0]
        assert out.outputs[0].token_ids == greedy(refs[name][2], long_prompt), name
        assert (out.num_cached_tokens > 0) == (name in seen), name
        seen.add(name)


def peft_tensors(path: str) -> dict:
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors"))


def test_adapters_from_memory_and_swapped_between_steps(llm, llama):
    refs = llama[1]
    mem = LoRARequest("in-memory", 40)
    llm.add_lora(mem, peft_tensors(refs["all"][0].lora_path), rank=8, alpha=16)
    assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False, lora_request=mem)) == refs["all"][1]
    with count_compilations() as compiles:
        llm.update_lora("in-memory", peft_tensors(refs["qv"][0].lora_path), rank=4, alpha=8)
        after = token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False, lora_request=mem))
    assert after == refs["qv"][1]
    assert compiles == []
    assert "in-memory" in [r.lora_name for r in llm.list_loras()]
    assert llm.remove_lora("in-memory") and "in-memory" not in [r.lora_name for r in llm.list_loras()]


def test_bad_adapters_are_refused_by_name_and_leave_nothing_behind(llm, llama, tmp_path):
    refs = llama[1]
    good = refs["all"][0]

    def broken(name: str, edit_config=None, edit_tensors=None) -> str:
        path = tmp_path / name
        shutil.copytree(good.lora_path, path)
        if edit_config:
            config = json.loads((path / "adapter_config.json").read_text())
            edit_config(config)
            (path / "adapter_config.json").write_text(json.dumps(config))
        if edit_tensors:
            from safetensors.numpy import save_file

            save_file(edit_tensors(peft_tensors(str(path))), str(path / "adapter_model.safetensors"))
        return str(path)

    def renamed(tensors):
        return {k.replace("q_proj", "q_proj_x"): v for k, v in tensors.items()}

    def reshaped(tensors):
        return {k: v[:, :-1] if "q_proj.lora_A" in k else v for k, v in tensors.items()}

    cases = {
        "max_lora_rank=8": broken("rank", lambda c: c.update(r=16)),
        "cannot adapt": broken("module", edit_tensors=renamed),
        "do not match the base model": broken("shape", edit_tensors=reshaped),
        "use_dora": broken("dora", lambda c: c.update(use_dora=True)),
        "fan_in_fan_out": broken("fifo", lambda c: c.update(fan_in_fan_out=True)),
        "no adapter_config.json": str(tmp_path / "missing"),
    }
    for index, (message, path) in enumerate(cases.items(), start=100):
        with pytest.raises(ValueError, match=message):
            llm.generate(prompts(), GREEDY, use_tqdm=False, lora_request=LoRARequest(f"bad{index}", index, path))
    with pytest.raises(ValueError, match="lora_int_id 1 is taken"):
        llm.add_lora(LoRARequest("other-name", 1, good.lora_path))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("zero", 0, good.lora_path)
    assert not [r for r in llm.list_loras() if r.lora_name.startswith("bad")]
    assert llm.engine.scheduler.allocator.num_used_pages == 0
    assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False, lora_request=good)) == refs["all"][1]


def test_an_engine_without_lora_refuses_adapters(llama):
    plain = make_llm(llama[0])
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate(prompts(), GREEDY, use_tqdm=False, lora_request=llama[1]["all"][0])
    with pytest.raises(ValueError, match="max_lora_rank"):
        make_llm(llama[0], enable_lora=True, max_lora_rank=0)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_adapters_on_a_quantized_base(llama, quantization):
    """Packed weights with float adapters beside them: the adapter's tokens, as on the float base."""
    quantized = make_llm(llama[0], quantization=quantization, **LORA_ENGINE)
    request, want, _ = llama[1]["all"]
    got = token_ids(quantized.generate(prompts(), GREEDY, use_tqdm=False, lora_request=request))
    base = token_ids(quantized.generate(prompts(), GREEDY, use_tqdm=False))
    assert [g[:4] for g in got] == [w[:4] for w in want]
    assert got != base


def tiny_qwen3(path) -> str:
    config = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.08)
    model.save_pretrained(path, safe_serialization=True)
    train_tiny_tokenizer(config.vocab_size).save_pretrained(path)
    return str(path)


def test_qwen3_adapters_in_one_batch_match_transformers_peft(tmp_path):
    base = tiny_qwen3(tmp_path / "qwen3")
    refs = family_references(str(tmp_path), "qwen3", base)
    engine = make_llm(base, **LORA_ENGINE)
    order = ["all", None, "qv"]
    got = token_ids(engine.generate(prompts(len(order)), GREEDY, use_tqdm=False,
                                    lora_request=[refs[name][0] for name in order for _ in PROMPTS]))
    assert got == [tokens for name in order for tokens in refs[name][1]]


def test_tensor_and_data_parallel_adapters_give_one_devices_tokens(llama):
    """TP 2 and DP 2 on 8 forced CPU devices serve each adapter's tokens, B split by columns of
    q/k/v and A by rows of the output projection under TP, compiling nothing while serving."""
    from test_parallel import _run_worker

    spec = {"base": llama[0], "adapters": {name: llama[1][name][0].lora_path for name in ("all", "mlp_rs")}}
    result = _run_worker("lora", json.dumps(spec))
    tokens = result["tp1_dp1"]["tokens"]
    assert tokens[:3] != tokens[3:6] and tokens[3:6] != tokens[6:]  # base, then each adapter's rows
    assert result["tp2_dp1"]["tokens"] == result["tp1_dp2"]["tokens"] == tokens
    assert result["tp2_dp1"]["split"] == {"wqkv/a": [], "wqkv/b": [None, "model"], "wo/a": ["model", None],
                                          "wo/b": []}
    assert all(run["serving_compiles"] == 0 for run in result.values())


def test_an_adapter_trained_in_jax_is_served_as_the_training_forward_computes_it(llm):
    """``new_adapter``'s layout (rank 4, padded to the slots' 8) through ``add_lora``: each served
    token's logprob is what ``rollouts.sequence_logprobs`` computes with the adapter, which has
    gradients for every factor."""
    import jax
    import jax.numpy as jnp

    from jaxrunner.models import lora
    from jaxrunner.models.params import param_shapes
    from jaxrunner.rollouts import sequence_logprobs

    cfg = llm.engine.model.config
    adapter = lora.new_adapter(cfg, param_shapes(cfg)["layers"], 4, jax.random.key(0))
    adapter = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape), adapter)
    request = LoRARequest("trained", 50)
    llm.add_lora(request, adapter)
    prompt = PROMPTS[0]
    tokens = token_ids(llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=request))[0]
    sequence = jnp.asarray([prompt + tokens])
    per_token = sequence_logprobs(llm.params, cfg, sequence, adapter)[0, len(prompt):]
    outputs = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                        ignore_eos=True, logprobs=0),
                           use_tqdm=False, lora_request=request)[0].outputs[0]
    served = [entry[token].logprob for token, entry in zip(outputs.token_ids, outputs.logprobs)]
    np.testing.assert_allclose(np.asarray(per_token), served, atol=2e-4)
    grads = jax.grad(lambda a: sequence_logprobs(llm.params, cfg, sequence, a).sum())(adapter)
    assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads))
    assert llm.remove_lora("trained")


def test_an_adapter_removed_and_added_again_under_its_name_serves_its_new_weights(llm, llama):
    """The slot and the prefix cache key on each load, not on the name and id."""
    refs = llama[1]
    again = LoRARequest("again", 60)
    for name, rank, alpha in (("all", 8, 16), ("qv", 4, 8)):
        llm.add_lora(again, peft_tensors(refs[name][0].lora_path), rank=rank, alpha=alpha)
        assert token_ids(llm.generate(prompts(), GREEDY, use_tqdm=False, lora_request=again)) == refs[name][1]
        assert llm.remove_lora("again")


def test_host_memory_holds_max_cpu_loras_and_reads_dropped_adapters_again(llama):
    """One slot and one adapter in host memory: a call naming three adapters reads each again as
    it needs it, and every row still gets its own adapter's tokens."""
    refs = llama[1]
    small = make_llm(llama[0], enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    order = ["all", "qv", "all", "mlp_rs", None]
    got = token_ids(small.generate(prompts(len(order)), GREEDY, use_tqdm=False,
                                   lora_request=[refs[name][0] for name in order for _ in PROMPTS]))
    assert got == [tokens for name in order for tokens in refs[name][1]]
    assert small.engine.scheduler.allocator.num_used_pages == 0
    small.add_lora(LoRARequest("mem", 9), peft_tensors(refs["qv"][0].lora_path), rank=4, alpha=8)
    assert [r.lora_name for r in small.list_loras()] == ["mem"]  # back to the cap once nothing uses the others


@pytest.mark.parametrize("family,targets", [("gemma2", ALL_TARGETS),
                                            ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])])
def test_other_families_adapters_match_transformers_peft(tmp_path, family, targets):
    """Gemma 2 (soft caps, windows, pre+post norms) and Phi-3, whose checkpoints fuse q/k/v and
    gate/up into one module each: PEFT adapts the fused modules, which are split into our parts."""
    from test_model_families import build_family_checkpoint

    base = build_family_checkpoint(tmp_path / family, family)
    merged = save_adapter(base, tmp_path / "adapter", 5, targets, 8, 16)
    request = LoRARequest("fam", 1, str(tmp_path / "adapter"))
    engine = make_llm(base, **LORA_ENGINE)
    got = token_ids(engine.generate(prompts(), GREEDY, use_tqdm=False, lora_request=request))
    assert got == [greedy(merged, p) for p in PROMPTS]
    assert got != token_ids(engine.generate(prompts(), GREEDY, use_tqdm=False))
