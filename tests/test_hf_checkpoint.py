"""HF checkpoint directories: safetensors read lazily, sharded and bfloat16 files, damaged files."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import build_tiny_checkpoint
from safetensors.torch import load_file

from jaxrunner.models.loading import load_model
from jaxrunner.models.loading.hf import (
    CheckpointFormatError,
    SafetensorsTensors,
    load_hf_state_dict,
    open_hf_state_dict,
    safetensors_files,
)


def _torch_state(model_dir: str) -> dict[str, np.ndarray]:
    state = {}
    for path in safetensors_files(model_dir):
        state.update({k: v.float().numpy() for k, v in load_file(path).items()})
    return state


@pytest.fixture(scope="module")
def sharded_bf16(tmp_path_factory):
    """A tiny llama saved in bfloat16, split over several safetensors shards."""
    import transformers

    src = build_tiny_checkpoint(tmp_path_factory.mktemp("src") / "llama", "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16)
    dst = tmp_path_factory.mktemp("sharded") / "llama-bf16"
    model.save_pretrained(dst, safe_serialization=True, max_shard_size="100KB")
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens")):
            with open(os.path.join(src, name), "rb") as f, open(dst / name, "wb") as g:
                g.write(f.read())
    return str(dst)


def test_lazy_state_dict_reads_every_shard_like_safetensors(sharded_bf16):
    assert len(safetensors_files(sharded_bf16)) > 1
    lazy, ref = open_hf_state_dict(sharded_bf16), _torch_state(sharded_bf16)
    assert isinstance(lazy, SafetensorsTensors)
    assert set(lazy) == set(ref) and len(lazy) == len(ref)
    assert "model.norm.weight" in lazy and "model.nope.weight" not in lazy
    for name, value in ref.items():
        got = lazy[name]
        assert got.dtype.name == "bfloat16", name  # read as stored, cast when placed
        np.testing.assert_array_equal(got.astype(np.float32), value, err_msg=name)
    eager = load_hf_state_dict(sharded_bf16)
    assert set(eager) == set(ref)


def test_sharded_bf16_checkpoint_loads_into_the_engine(sharded_bf16):
    model = load_model(sharded_bf16, dtype="float32", progress=False)
    ref = _torch_state(sharded_bf16)
    np.testing.assert_array_equal(np.asarray(model.params["embed"]), ref["model.embed_tokens.weight"])
    np.testing.assert_array_equal(np.asarray(model.params["layers"][1]["w_down"]),
                                  ref["model.layers.1.mlp.down_proj.weight"].T)


@pytest.mark.parametrize("damage", ["truncated", "garbage_header", "missing_shard"])
def test_damaged_safetensors_name_the_file(sharded_bf16, tmp_path, damage):
    dst = tmp_path / "damaged"
    dst.mkdir()
    for name in os.listdir(sharded_bf16):
        with open(os.path.join(sharded_bf16, name), "rb") as f, open(dst / name, "wb") as g:
            g.write(f.read())
    victim = os.path.basename(safetensors_files(str(dst))[-1])
    blob = (dst / victim).read_bytes()
    if damage == "truncated":
        (dst / victim).write_bytes(blob[: len(blob) // 2])
    elif damage == "garbage_header":
        (dst / victim).write_bytes(b"\xff" * 64 + blob[64:])
    else:
        (dst / victim).unlink()
    with pytest.raises(CheckpointFormatError, match=victim):
        load_model(str(dst), progress=False)


def test_bf16_tensors_stay_bf16_on_the_host_and_load_exactly(sharded_bf16):
    """Half-precision tensors are regrouped on the host as stored and cast on the device: served as
    bfloat16 the params are the stored values, as float32 (above) their exact widening."""
    from jaxrunner.models.params import take

    state, ref = open_hf_state_dict(sharded_bf16), _torch_state(sharded_bf16)
    norm = ref["model.norm.weight"]
    assert take(state, "model.norm.weight", norm.shape, sharded_bf16).dtype.name == "bfloat16"
    model = load_model(sharded_bf16, dtype="bfloat16", progress=False)
    layer = model.params["layers"][1]
    assert layer["w_down"].dtype.name == "bfloat16"
    np.testing.assert_array_equal(np.asarray(model.params["final_norm"]).astype(np.float32), norm)
    np.testing.assert_array_equal(np.asarray(layer["w_down"]).astype(np.float32),
                                  ref["model.layers.1.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(layer["wo"]).astype(np.float32),
                                  ref["model.layers.1.self_attn.o_proj.weight"].T)
