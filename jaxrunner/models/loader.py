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

from jaxrunner.models.config import ModelConfig
from jaxrunner.models.loading.resolve import ModelSource, resolve_model
from jaxrunner.models.params import build_params, cast_params, params_count, params_nbytes

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


def _read_host(source: ModelSource) -> tuple[dict, _HostWeights, object]:
    """(hf_config, weights, tokenizer) from any source kind."""
    if source.kind == "orbax":
        from jaxrunner.models.loading.orbax_ckpt import load_checkpoint

        params, hf_config, tokenizer = load_checkpoint(source.path)
        ModelConfig.from_hf_dict(hf_config, source=source.path)  # validate before use
        return hf_config, _HostWeights(params=params), tokenizer
    if source.kind == "gguf":
        from jaxrunner.models.loading.gguf import load_gguf_tokenizer, open_gguf

        checkpoint = open_gguf(source.path)
        hf_config, state, tokenizer = checkpoint.hf_config, checkpoint.state_dict, load_gguf_tokenizer(source.path)
    else:
        from jaxrunner.models.loading.hf import load_hf_tokenizer, open_hf_state_dict, read_hf_config

        hf_config = read_hf_config(source.path)
        ModelConfig.from_hf_dict(hf_config, source=source.path)  # fail on architecture before reading weights
        state, tokenizer = open_hf_state_dict(source.path), load_hf_tokenizer(source.path)
    return hf_config, _HostWeights(state=state), tokenizer


def _orbax_config(source: ModelSource) -> ModelConfig | None:
    """The config of an orbax checkpoint, read without touching its arrays (None for other kinds)."""
    if source.kind != "orbax":
        return None
    from jaxrunner.models.loading.orbax_ckpt import CONFIG_FILE, read_checkpoint_info

    read_checkpoint_info(source.path)
    with open(os.path.join(source.path, CONFIG_FILE)) as f:
        return ModelConfig.from_hf_dict(json.load(f), source=source.path)


def _place(weights: _HostWeights, cfg: ModelConfig, dtype: str, mesh, source: str, progress: bool):
    """Host weights -> (device params, served config, KV replication), sharded over ``mesh`` if given.

    A state dict is placed a piece at a time (``build_params``): host memory never holds the whole
    model in float32. KV heads are replicated per layer when there are fewer than shards."""
    from jaxrunner.parallel import mesh as meshes, sharding

    tp = 1 if mesh is None else meshes.tensor_parallel_size(mesh)
    meshes.check_tensor_parallel(cfg, tp)
    served = sharding.served_config(cfg, tp)

    def place(piece: dict) -> dict:
        piece = sharding.replicate_kv_heads_in_layer(piece, cfg, tp)  # touches only a layer's grouped leaves
        return cast_params(piece, dtype, None if mesh is None else sharding.param_shardings(piece, mesh, served))

    if weights.state is not None:
        params = build_params(weights.state, cfg, place, source, progress)
    else:
        host = sharding.replicate_kv_heads(weights.params, cfg, tp)[0]
        params = cast_params(host, dtype, None if mesh is None else sharding.param_shardings(host, mesh, served))
    return params, served, sharding.kv_replication(cfg, tp)


def _restores_into_shards(cfg: ModelConfig, mesh) -> bool:
    """Whether a checkpoint of ``cfg`` can be restored straight into ``mesh``'s shardings: yes
    unless KV heads must be replicated first (that goes through host memory)."""
    from jaxrunner.parallel import mesh as meshes, sharding

    tp = meshes.tensor_parallel_size(mesh)
    meshes.check_tensor_parallel(cfg, tp)
    return sharding.kv_replication(cfg, tp) == 1


def _restore_sharded(source: ModelSource, cfg: ModelConfig, dtype: str, mesh):
    """An orbax checkpoint restored straight into its shardings: no full copy anywhere first."""
    from jaxrunner.models.loading.orbax_ckpt import load_checkpoint
    from jaxrunner.parallel import sharding

    params, hf_config, tokenizer = load_checkpoint(source.path, dtype=dtype,
                                                   shardings=sharding.sharding_for_path(mesh, cfg))
    return hf_config, params, tokenizer


def load_model(model: str, dtype: str = "float32", progress: bool = True, mesh=None) -> LoadedModel:
    """Load ``model`` as ``dtype``; with ``mesh`` (``("data", "model")`` axes, one data row), shard it."""
    source = resolve_model(model)
    start = time.perf_counter()
    orbax_cfg = _orbax_config(source)
    if orbax_cfg is not None and mesh is not None and _restores_into_shards(orbax_cfg, mesh):
        hf_config, params, tokenizer = _restore_sharded(source, orbax_cfg, dtype, mesh)
        config, replication = orbax_cfg, 1
    else:
        hf_config, weights, tokenizer = _read_host(source)
        params, config, replication = _place(weights, ModelConfig.from_hf_dict(hf_config, source=source.path),
                                             dtype, mesh, source.path, progress)
    loaded = LoadedModel(config, hf_config, params, tokenizer, source, dtype, time.perf_counter() - start,
                         mesh, replication)
    logger.info(loaded.summary())
    return loaded
