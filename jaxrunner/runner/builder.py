"""Build an engine: devices, mesh, loading, quantization, then one started executor per mesh row.

This is where the runner side is put together; the engine (``jaxrunner.engine``) only receives
the executors. Data parallelism is one executor per row of the ``("data", "model")`` mesh, each
with a copy of the weights and its own KV pool: the rows share nothing at run time.
"""
from __future__ import annotations

import dataclasses

import jax

from jaxrunner.config import EngineConfig
from jaxrunner.engine.engine import LLMEngine
from jaxrunner.models.loading import LoadedModel, load_model
from jaxrunner.models.quant import quantize_model
from jaxrunner.parallel import distributed, mesh as meshes, sharding
from jaxrunner.runner.executor import Executor


def create_engine(config: EngineConfig, model: LoadedModel | None = None) -> LLMEngine:
    """The engine ``config`` asks for. ``model``: already loaded (onto the first replica's mesh)
    instead of read from ``config.model``."""
    return LLMEngine(config, build_executors(config, model))


def build_executors(config: EngineConfig, model: LoadedModel | None = None) -> list[Executor]:
    """Load (unless given) and start one executor per data-parallel replica."""
    distributed.initialize_from_env()  # before any device is touched; a no-op unless configured
    rows = _replica_meshes(config, model)
    base = model if model is not None else load_model(config.model, config.dtype, progress=config.progress,
                                                      mesh=rows[0])
    executors = []
    for row in rows:
        replica = _on_mesh(base, row)
        if config.quantization is not None:
            replica = quantize_model(replica, config.quantization, config.quantization_group_size)
        executors.append(Executor(config, replica))
    if len(rows) > 1:
        for executor in executors:
            executor.startup_report["global_mesh"] = meshes.describe(meshes.build_mesh(
                config.tensor_parallel_size, config.data_parallel_size))
    return executors


def _replica_meshes(config: EngineConfig, model: LoadedModel | None) -> list:
    tp, dp = config.tensor_parallel_size, config.data_parallel_size
    if dp == 1:
        if model is not None:
            return [model.mesh]
        meshes.check_device_count(tp, 1)
        return [meshes.build_mesh(tp, 1)]
    meshes.check_device_count(tp, dp)
    if jax.process_count() > 1:
        raise ValueError(f"data_parallel_size={dp} with {jax.process_count()} processes: a replica would be "
                         f"driven by one host only; run one engine per host for data parallelism and use "
                         f"jax.distributed for tensor parallelism across hosts")
    return meshes.replica_meshes(meshes.build_mesh(tp, dp))


def _on_mesh(model: LoadedModel, mesh) -> LoadedModel:
    """``model`` with its params copied onto another replica's mesh (device to device)."""
    if mesh is model.mesh:
        return model
    params = jax.device_put(model.params, sharding.param_shardings(model.params, mesh, model.config))
    return dataclasses.replace(model, params=params, mesh=mesh)
