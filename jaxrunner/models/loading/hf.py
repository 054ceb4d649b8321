"""Hugging Face checkpoint directories: config.json, (sharded) safetensors, tokenizer files."""
from __future__ import annotations

import json
import os
from typing import Mapping

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


class SafetensorsTensors(Mapping):
    """Every tensor of some safetensors files by name, read from disk when accessed (not kept).

    Lazy for the same reason as the GGUF loader's ``DequantizedTensors``: the engine places a model
    a layer at a time, so only one layer's host copy exists at once. Headers are read (and checked)
    up front; a bad file fails here with :class:`CheckpointFormatError`, not half-way through.
    """

    def __init__(self, files: list[str]):
        self._handles, self._file_of = {}, {}
        self._flax_handles = {}  # files holding bfloat16, which numpy cannot read: opened once, on need
        for path in files:
            try:
                self._handles[path] = handle = safe_open(path, framework="numpy")
                names = list(handle.keys())
            except Exception as err:  # safetensors raises its own SafetensorError on bad headers/sizes
                raise CheckpointFormatError(f"{path}: truncated or corrupt safetensors file ({err})") from None
            self._file_of.update(dict.fromkeys(names, path))

    def __getitem__(self, name: str) -> np.ndarray:
        path = self._file_of[name]
        try:
            if path not in self._flax_handles:
                try:
                    return self._handles[path].get_tensor(name)
                except TypeError:  # numpy has no bfloat16: read through JAX, which has (ml_dtypes)
                    self._flax_handles[path] = safe_open(path, framework="flax")
            return np.asarray(self._flax_handles[path].get_tensor(name))
        except Exception as err:
            raise CheckpointFormatError(f"{path}: cannot read tensor {name!r} ({err})") from None

    def __contains__(self, name) -> bool:
        return name in self._file_of

    def __iter__(self):
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def open_hf_state_dict(model_dir: str) -> SafetensorsTensors:
    """The directory's weights by HF name, each read when accessed."""
    return SafetensorsTensors(safetensors_files(model_dir))


def load_hf_state_dict(model_dir: str, progress: bool = False) -> dict[str, np.ndarray]:
    """The directory's weights by HF name, all read now (bfloat16 through ml_dtypes)."""
    lazy = open_hf_state_dict(model_dir)
    return {name: lazy[name] for name in tqdm(lazy, desc=os.path.basename(model_dir), disable=not progress,
                                               leave=False)}


def load_hf_tokenizer(model_dir: str):
    from transformers import AutoTokenizer  # lazy: transformers is heavy; reading weights needs none

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


# generation_config.json key -> SamplingParams field, the keys vLLM takes as sampling defaults
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(model_dir: str) -> dict | None:
    """The directory's generation_config.json (None when absent)."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as err:
        raise CheckpointFormatError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise CheckpointFormatError(f"{path}: expected a JSON object")
    return config


def sampling_defaults(generation_config: dict | None) -> dict:
    """SamplingParams overrides from a generation config, as vLLM applies them by default."""
    if not generation_config:
        return {}
    return {field: generation_config[key] for key, field in GENERATION_DEFAULTS.items()
            if generation_config.get(key) is not None}
