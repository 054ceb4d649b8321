"""Weights held in memory: serve a params pytree without a checkpoint, and swap it between steps.

The compiled executables take the params as an argument, so new weights of the same shapes,
dtypes and shardings run through the same executables: a swap compiles nothing. Anything else
would, or would compute garbage, so every leaf is checked first and a mismatch is a
``ValueError`` that names the leaf (``layers[3]['wqkv']``) before anything changes.
"""
from __future__ import annotations

import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.models.config import ModelConfig
from jaxrunner.models import registry
from jaxrunner.models.flax_nnx import split_module
from jaxrunner.models.registry import config_from_hf
from jaxrunner.models.loading import LoadedModel
from jaxrunner.models.loading.resolve import ModelSource
from jaxrunner.models.params import param_shapes
from jaxrunner.parallel import mesh as meshes, sharding

IN_MEMORY = "<in-memory params>"
SERVABLE_DTYPES = ("float32", "bfloat16")


def _leaves_by_path(tree) -> dict[str, object]:
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_like(params, reference, what: str = "params") -> None:
    """Raise ``ValueError`` naming the first leaf of ``params`` missing from, unknown to, or of
    another shape or dtype than ``reference`` (a pytree of arrays or ``jax.ShapeDtypeStruct``)."""
    if not isinstance(params, Mapping):
        raise ValueError(f"{what}: expected the params pytree (a dict, as LLM.params returns), "
                         f"got {type(params).__name__}")
    given, expected = _leaves_by_path(params), _leaves_by_path(reference)
    for path in expected:
        if path not in given:
            raise ValueError(f"{what}{path}: missing (expected shape {tuple(expected[path].shape)})")
    for path, leaf in given.items():
        if path not in expected:
            raise ValueError(f"{what}{path}: unknown leaf (the model has {len(expected)} leaves, e.g. "
                             f"{', '.join(list(expected)[:3])})")
        want = expected[path]
        shape, dtype = tuple(np.shape(leaf)), getattr(leaf, "dtype", None)
        if shape != tuple(want.shape):
            raise ValueError(f"{what}{path}: shape {shape}, expected {tuple(want.shape)}")
        if dtype is None or jnp.dtype(dtype) != jnp.dtype(want.dtype):
            raise ValueError(f"{what}{path}: dtype {dtype}, expected {jnp.dtype(want.dtype).name}")


def expected_params(cfg: ModelConfig, dtype: str):
    """The params pytree ``cfg`` calls for, as ``jax.ShapeDtypeStruct`` leaves."""
    return jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), param_shapes(cfg),
                        is_leaf=lambda node: isinstance(node, tuple))


def place_like(params, shardings):
    """``params`` on ``shardings``: arrays already laid out so are used as they are (no copy);
    others are copied device to device (or host to device for numpy leaves)."""
    return jax.tree.map(lambda x, s: x if getattr(x, "sharding", None) == s else jax.device_put(x, s),
                        params, shardings)


def params_dtype(params) -> str:
    """The one dtype of every leaf, which must be one the engine serves."""
    dtypes = {jnp.dtype(leaf.dtype).name for leaf in jax.tree.leaves(params) if hasattr(leaf, "dtype")}
    if len(dtypes) != 1 or next(iter(dtypes)) not in SERVABLE_DTYPES:
        raise ValueError(f"params: every leaf must have one dtype of {', '.join(SERVABLE_DTYPES)}; "
                         f"got {', '.join(sorted(dtypes)) or 'no arrays'}")
    return dtypes.pop()


def hf_config_dict(config) -> dict:
    """An HF config as a plain dict: a ``config.json`` dict, or a ``transformers`` config object."""
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise ValueError(f"config: expected an HF config dict or a transformers config, got {type(config).__name__}")


def model_from_params(params, config, tokenizer, mesh) -> LoadedModel:
    """A ``LoadedModel`` over an in-memory params pytree, placed on ``mesh``'s shardings."""
    start = time.perf_counter()
    hf_config = hf_config_dict(config)
    cfg = config_from_hf(hf_config, source="config")
    tp = meshes.tensor_parallel_size(mesh)
    meshes.check_tensor_parallel(cfg, tp)
    if sharding.kv_replication(cfg, tp) > 1:
        raise ValueError(f"tensor_parallel_size={tp}: exceeds the model's {cfg.num_kv_heads} KV heads; in-memory "
                         f"params are served without copying KV heads, so use at most {cfg.num_kv_heads}")
    dtype = params_dtype(params)
    check_like(params, expected_params(cfg, dtype))
    placed = place_like(params, sharding.param_shardings(params, mesh, registry.partition_rules(cfg)))
    return LoadedModel(cfg, hf_config, placed, tokenizer, ModelSource("memory", IN_MEMORY), dtype,
                       time.perf_counter() - start, mesh)


def model_from_nnx(module, tokenizer, mesh) -> LoadedModel:
    """A ``LoadedModel`` over a Flax NNX module that follows ``models.flax_nnx``'s protocol."""
    start = time.perf_counter()
    architecture, state = split_module(module)
    if meshes.tensor_parallel_size(mesh) > 1:
        raise ValueError("tensor_parallel_size: a Flax NNX module is served on one device per replica "
                         "(its leaves have no partition rules); use 1, and data_parallel_size for more devices")
    placed = place_like(state, sharding.param_shardings(state, mesh, sharding.no_rules))
    return LoadedModel(architecture.cfg, {}, placed, tokenizer, ModelSource("memory", IN_MEMORY),
                       params_dtype(state), time.perf_counter() - start, mesh, architecture=architecture)
