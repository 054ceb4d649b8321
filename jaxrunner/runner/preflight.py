"""Checks of an EngineConfig against the model's files and the machine, before any weight is read.

``EngineConfig`` checks values alone. What needs the model (its length limit, its head counts)
or the machine (the memory a user-sized KV pool would take) is checked here, from the model's
config file (config.json, the GGUF metadata, a checkpoint's marker), in about a second: a wrong
option fails before minutes of loading, with nothing allocated. Start-up checks the same bounds
again with the exact numbers (``runner/startup.py``).
"""
from __future__ import annotations

import math

import jax
import numpy as np

from jaxrunner.config import EngineConfig
from jaxrunner.runner.startup import (choose_attention, choose_matmuls, default_kv_cache_dtype, model_max_len,
                                      resolve_max_model_len)
from jaxrunner.models import registry
from jaxrunner.models.config import ModelConfig
from jaxrunner.models.loading import peek_model
from jaxrunner.models.loading.precision import choose_dtype
from jaxrunner.parallel import distributed, mesh as meshes
from jaxrunner.runner import memory
from jaxrunner.runner.model_runner import KVCacheSpec


def check_before_loading(config: EngineConfig) -> None:
    """Raise ``ValueError`` (naming the option and its valid values) for what cannot work with
    this model on this machine."""
    distributed.initialize_from_env()  # before any device is touched; a no-op unless configured
    meshes.check_device_count(config.tensor_parallel_size, config.data_parallel_size)
    draft = _peek_draft(config)  # first: the target's GGUF, parsed last, stays cached for its load
    peek = peek_model(config.model)
    cfg = peek.config
    if config.cpu_matmul != "auto":  # oneDNN missing here, or several devices: refused before any weight is read
        _check_cpu_matmul(config, peek.checkpoint_dtype)
    max_model_len, _ = resolve_max_model_len(config, cfg)
    meshes.check_tensor_parallel(cfg, config.tensor_parallel_size)
    if draft is not None:
        _check_draft(config, cfg, draft, max_model_len)
    device = jax.local_devices()[0]
    if config.kv_pool_dtype is not None:  # an attention_impl that cannot read such pages: refused here
        choose_attention(config, device.platform, cfg, config.kv_pool_dtype)
    if config.num_pages is None and config.kv_cache_memory_bytes is None:
        return
    dtype, _ = choose_dtype(config.dtype, peek.checkpoint_dtype, device.platform)
    impl, _ = choose_attention(config, device.platform, cfg)
    kv_dtype = config.kv_pool_dtype or default_kv_cache_dtype(dtype, device.platform, impl)
    tp = config.tensor_parallel_size
    budget = memory.memory_budget(device, config.memory_utilization)
    memory.check_pool_fits(budget, estimated_weights_bytes(cfg, dtype, config.quantization) // tp,
                           kv_bytes_per_page(cfg, config.page_size, kv_dtype) // tp,
                           config.num_pages, config.kv_cache_memory_bytes)


def _check_cpu_matmul(config: EngineConfig, checkpoint_dtype: str) -> None:
    """``cpu_matmul`` resolves here, and ``"onednn"`` has a matmul for the model's compute dtype:
    oneDNN's bf16 kernels need AVX-512, so a CPU with AVX2 alone packs float32 only."""
    platform = jax.local_devices()[0].platform
    matmuls, _ = choose_matmuls(config, platform)
    if config.cpu_matmul != "onednn" or platform != "cpu":
        return
    dtype, _ = choose_dtype(config.dtype, checkpoint_dtype, platform)
    if dtype not in matmuls.onednn_dtypes:
        raise ValueError(f"EngineConfig.cpu_matmul='onednn': oneDNN has no {dtype} matmul on this CPU (its bf16 "
                         f"kernels need AVX-512); valid here: cpu_matmul 'auto' or 'xla', or dtype in "
                         f"{list(matmuls.onednn_dtypes)}")


def _peek_draft(config: EngineConfig) -> ModelConfig | None:
    """The draft model's config (speculative_method="draft_model"), its source named on failure."""
    if config.speculative_method != "draft_model":
        return None
    try:
        return peek_model(config.speculative_model).config
    except (ValueError, OSError) as err:
        raise ValueError(f"EngineConfig.speculative_model: {err}") from None


def _check_draft(config: EngineConfig, cfg: ModelConfig, draft: ModelConfig, max_model_len: int) -> None:
    """The draft proposes target token ids, for sequences as long as the target's, on its devices."""
    check_draft_vocabulary(cfg, draft)
    limit, field = model_max_len(draft)
    if limit < max_model_len:
        raise ValueError(f"EngineConfig.speculative_model: the draft takes at most {limit} tokens (its {field}), "
                         f"the engine serves up to max_model_len={max_model_len}; valid: a draft whose limit is at "
                         f"least max_model_len, or max_model_len <= {limit}")
    try:
        meshes.check_tensor_parallel(draft, config.tensor_parallel_size)
    except ValueError as err:
        raise ValueError(f"EngineConfig.speculative_model: {err}") from None


def check_draft_vocabulary(target_config, draft_config) -> None:
    """A draft model's proposals are target token ids: its vocabulary must be the target's."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"EngineConfig.speculative_model: the draft's vocabulary has {draft_config.vocab_size} "
                         f"tokens, the model's {target_config.vocab_size}; valid: a draft model sharing the "
                         "model's tokenizer")


def estimated_weights_bytes(cfg: ModelConfig, dtype: str, quantization: str | None) -> int:
    """The served weights' size (int8: one byte per parameter, scales left out)."""
    itemsize = 1 if quantization == "int8" else np.dtype(jax.numpy.dtype(dtype)).itemsize
    shapes = registry.family_for_config(cfg).param_shapes(cfg)
    num_params = sum(math.prod(shape) for shape in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))
    return num_params * itemsize


def kv_bytes_per_page(cfg: ModelConfig, page_size: int, kv_dtype: str) -> int:
    """Keys and values of every layer for one page."""
    return KVCacheSpec(0, page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype).bytes_per_page
