"""Hugging Face checkpoint directories: config.json, (sharded) safetensors, tokenizer files."""
from __future__ import annotations

import json
import os

import numpy as np
from safetensors import safe_open
from tqdm.auto import tqdm


class CheckpointFormatError(ValueError):
    """A checkpoint file is missing, truncated or not what it claims to be."""


def read_hf_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointFormatError(f"{model_dir}: no config.json in this directory")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise CheckpointFormatError(f"{path}: not valid JSON ({err})") from None


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files of a directory: the shards named by the index, or the single file."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, name) for name in shards]
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise CheckpointFormatError(f"{index}: shard(s) missing: {', '.join(missing)}")
        return files
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise CheckpointFormatError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def _read_all(path: str, framework: str, progress: bool) -> dict:
    with safe_open(path, framework=framework) as handle:
        names = list(handle.keys())
        bar = tqdm(names, desc=os.path.basename(path), disable=not progress, leave=False)
        return {name: handle.get_tensor(name) for name in bar}


def read_safetensors(path: str, progress: bool = False) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file as a numpy array (bfloat16 through ml_dtypes)."""
    try:
        try:
            return _read_all(path, "numpy", progress)
        except TypeError:  # numpy has no bfloat16: read through JAX arrays, which do
            return {k: np.asarray(v) for k, v in _read_all(path, "flax", progress).items()}
    except Exception as err:  # safetensors raises its own SafetensorError on bad headers/sizes
        raise CheckpointFormatError(f"{path}: truncated or corrupt safetensors file ({err})") from None


def load_hf_state_dict(model_dir: str, progress: bool = False) -> dict[str, np.ndarray]:
    state: dict[str, np.ndarray] = {}
    for path in safetensors_files(model_dir):
        state.update(read_safetensors(path, progress=progress))
    return state


def load_hf_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
