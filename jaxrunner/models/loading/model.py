"""One entry point from a model name to (config, params, tokenizer), whatever the source format.

With a ``mesh``, every tensor goes straight to its shards: host arrays are sliced per device, and
an orbax checkpoint is restored directly into the target shardings.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Mapping

import jax

from jaxrunner.models.config import ModelConfig
from jaxrunner.models.registry import config_from_hf, kv_grouped_leaves, partition_rules
from jaxrunner.models.loading.gguf import load_gguf_tokenizer, open_gguf
from jaxrunner.models.loading.hf import load_hf_tokenizer, open_hf_state_dict, read_hf_config
from jaxrunner.models.loading.hf import read_generation_config as read_hf_generation_config
from jaxrunner.models.loading.orbax_ckpt import CONFIG_FILE, load_checkpoint, read_checkpoint_info
from jaxrunner.models.loading.precision import choose_dtype
from jaxrunner.models.loading.resolve import ModelSource, resolve_model
from jaxrunner.models.params import build_params, cast_params, params_count, params_nbytes
from jaxrunner.parallel import mesh as meshes, sharding

logger = logging.getLogger("jaxrunner")


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig          # as served: KV heads already replicated for tensor parallelism
    hf_config: dict
    params: dict
    tokenizer: object
    source: ModelSource
    dtype: str
    load_seconds: float
    mesh: object = None          # the jax.sharding.Mesh the params live on (None: default device)
    kv_head_replication: int = 1  # >1: each KV head was copied onto this many tensor-parallel shards
    dtype_reason: str = "requested"  # why ``dtype`` was chosen (``dtype="auto"`` resolves per device)
    generation_config: dict | None = None  # an HF directory's generation_config.json, when present
    architecture: object = None   # forward/compute_logits over params; None: ``config``'s registered family

    @property
    def num_params(self) -> int:
        return params_count(self.params)

    @property
    def nbytes(self) -> int:
        return params_nbytes(self.params)

    def summary(self) -> str:
        return (f"loaded {self.source.path} ({self.source.kind}) as {self.dtype}: "
                f"{self.num_params / 1e6:.1f}M params, {self.nbytes / 2**20:.1f} MiB, {self.load_seconds:.2f} s")


@dataclasses.dataclass
class _HostWeights:
    """A source's weights before placement: a params tree (orbax) or an HF-named state dict (lazy:
    each tensor is read, and a GGUF's dequantized, when accessed)."""
    params: dict | None = None
    state: Mapping | None = None


@dataclasses.dataclass
class ModelPeek:
    """What a model's files say before any weight is read: enough to check options against."""
    source: ModelSource
    config: ModelConfig
    checkpoint_dtype: str        # "float32" | "bfloat16" | "float16" | "quantized"


def peek_model(model: str) -> ModelPeek:
    """Read ``model``'s config (config.json, the GGUF metadata and tensor table, or the checkpoint
    marker) and stored dtype, without reading any weight."""
    source = resolve_model(model)
    if source.kind == "orbax":
        stored = read_checkpoint_info(source.path).get("dtype", "float32")
        return ModelPeek(source, _orbax_config(source), stored if stored in _FLOAT_DTYPES else "float32")
    if source.kind == "gguf":
        checkpoint = _open_gguf(source.path, keep=True)
        return ModelPeek(source, config_from_hf(checkpoint.hf_config, source=source.path),
                         _gguf_dtype(checkpoint.tensor_types))
    hf_config = read_hf_config(source.path)
    stored = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
    return ModelPeek(source, config_from_hf(hf_config, source=source.path),
                     stored if stored in _FLOAT_DTYPES else "float32")


_peeked_gguf: dict = {}  # (path, size, mtime) -> the GGUFCheckpoint peek_model opened, for the load that follows


def _open_gguf(path: str, keep: bool):
    """``open_gguf``, parsed once for a peek and the load after it (the metadata takes ~1 s to parse);
    ``keep=False`` (the load) hands the cached one over and forgets it."""
    stat = os.stat(path)
    key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    checkpoint = _peeked_gguf.get(key) or open_gguf(path)
    _peeked_gguf.clear()
    if keep:
        _peeked_gguf[key] = checkpoint
    return checkpoint


_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
_GGUF_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _gguf_dtype(tensor_types: dict[str, str]) -> str:
    """A GGUF's stored dtype: that of its matrices (norms are F32 in every file), else "quantized"."""
    kinds = {kind for name, kind in tensor_types.items() if not name.endswith("norm.weight")}
    kinds = {_GGUF_FLOAT_TYPES.get(kind, "quantized") for kind in kinds}
    return kinds.pop() if len(kinds) == 1 else "quantized"


def resolve_dtype(requested: str, checkpoint_dtype: str, platform: str) -> tuple[str, str]:
    """(compute dtype, why), logged: ``"auto"`` and ``"float16"`` depend on the device."""
    dtype, why = choose_dtype(requested, checkpoint_dtype, platform)
    if requested in ("auto", dtype):
        logger.info("dtype %s: %s", dtype, why)
    else:
        logger.warning("dtype %s instead of %s: %s", dtype, requested, why)
    return dtype, why


def read_generation_config(source: ModelSource) -> dict | None:
    """generation_config.json of an HF directory or a jaxrunner checkpoint converted from one
    (GGUF files carry none)."""
    if source.kind == "gguf":
        return None
    return read_hf_generation_config(source.path)


def _with_generation_eos(config: ModelConfig, generation_config: dict | None) -> ModelConfig:
    """The generation config's EOS ids stop generation too (Llama 3 lists <|eot_id|> there)."""
    extra = (generation_config or {}).get("eos_token_id")
    if extra is None:
        return config
    extra = extra if isinstance(extra, list) else [extra]
    return dataclasses.replace(config, eos_token_ids=tuple(sorted({*config.eos_token_ids, *map(int, extra)})))


def _platform(mesh) -> str:
    return mesh.devices.flat[0].platform if mesh is not None else jax.devices()[0].platform


def _read_host(source: ModelSource) -> tuple[dict, _HostWeights, object]:
    """(hf_config, weights, tokenizer) from any source kind."""
    if source.kind == "orbax":
        params, hf_config, tokenizer = load_checkpoint(source.path)
        config_from_hf(hf_config, source=source.path)  # validate before use
        return hf_config, _HostWeights(params=params), tokenizer
    if source.kind == "gguf":
        checkpoint = _open_gguf(source.path, keep=False)
        hf_config, state = checkpoint.hf_config, checkpoint.state_dict
        tokenizer = load_gguf_tokenizer(source.path, checkpoint.reader)
    else:
        hf_config = read_hf_config(source.path)
        config_from_hf(hf_config, source=source.path)  # fail on architecture before reading weights
        state, tokenizer = open_hf_state_dict(source.path), load_hf_tokenizer(source.path)
    return hf_config, _HostWeights(state=state), tokenizer


def _orbax_config(source: ModelSource) -> ModelConfig | None:
    """The config of an orbax checkpoint, read without touching its arrays (None for other kinds)."""
    if source.kind != "orbax":
        return None
    read_checkpoint_info(source.path)
    with open(os.path.join(source.path, CONFIG_FILE)) as f:
        return config_from_hf(json.load(f), source=source.path)


def _place(weights: _HostWeights, cfg: ModelConfig, dtype: str, mesh, source: str, progress: bool):
    """Host weights -> (device params, served config, KV replication), sharded over ``mesh`` if given.

    A state dict is placed a piece at a time (``build_params``): host memory never holds the whole
    model in float32. KV heads are replicated per layer when there are fewer than shards."""
    tp = 1 if mesh is None else meshes.tensor_parallel_size(mesh)
    meshes.check_tensor_parallel(cfg, tp)
    served = sharding.served_config(cfg, tp)
    rules, grouped = partition_rules(served), kv_grouped_leaves(cfg)

    def place(piece: dict) -> dict:
        piece = sharding.replicate_kv_heads_in_layer(piece, cfg, tp, grouped)  # only a layer's grouped leaves
        return cast_params(piece, dtype, None if mesh is None else sharding.param_shardings(piece, mesh, rules))

    if weights.state is not None:
        params = build_params(weights.state, cfg, place, source, progress)
    else:
        host = sharding.replicate_kv_heads(weights.params, cfg, tp, grouped)[0]
        params = cast_params(host, dtype, None if mesh is None else sharding.param_shardings(host, mesh, rules))
    return params, served, sharding.kv_replication(cfg, tp)


def _restores_into_shards(cfg: ModelConfig, mesh) -> bool:
    """Whether a checkpoint of ``cfg`` can be restored straight into ``mesh``'s shardings: yes
    unless KV heads must be replicated first (that goes through host memory)."""
    tp = meshes.tensor_parallel_size(mesh)
    meshes.check_tensor_parallel(cfg, tp)
    return sharding.kv_replication(cfg, tp) == 1


def _restore_sharded(source: ModelSource, cfg: ModelConfig, dtype: str, mesh):
    """An orbax checkpoint restored straight into its shardings: no full copy anywhere first."""
    params, hf_config, tokenizer = load_checkpoint(source.path, dtype=dtype,
                                                   shardings=sharding.sharding_for_path(mesh, partition_rules(cfg)))
    return hf_config, params, tokenizer


def load_model(model: str, dtype: str = "float32", progress: bool = True, mesh=None) -> LoadedModel:
    """Load ``model`` as ``dtype`` ("auto": see ``models/loading/precision.py``); with ``mesh``
    (``("data", "model")`` axes, one data row), shard it."""
    start = time.perf_counter()
    source, reason = resolve_model(model), "requested"
    if dtype in ("auto", "float16"):
        dtype, reason = resolve_dtype(dtype, peek_model(model).checkpoint_dtype, _platform(mesh))
    orbax_cfg = _orbax_config(source)
    if orbax_cfg is not None and mesh is not None and _restores_into_shards(orbax_cfg, mesh):
        hf_config, params, tokenizer = _restore_sharded(source, orbax_cfg, dtype, mesh)
        config, replication = orbax_cfg, 1
    else:
        hf_config, weights, tokenizer = _read_host(source)
        params, config, replication = _place(weights, config_from_hf(hf_config, source=source.path),
                                             dtype, mesh, source.path, progress)
    generation_config = read_generation_config(source)
    config = _with_generation_eos(config, generation_config)
    loaded = LoadedModel(config, hf_config, params, tokenizer, source, dtype, time.perf_counter() - start,
                         mesh, replication, reason, generation_config)
    logger.info(loaded.summary())
    return loaded
