"""Build the runner side: devices, mesh, loading, quantization, then one started executor per mesh row.

The engine (``jaxrunner.engine``) only receives the executors (``jaxrunner.engine_factory``). Data
parallelism is one executor per row of the ``("data", "model")`` mesh, each with a copy of the
weights and its own KV pool: the rows share nothing at run time.
"""
from __future__ import annotations

import dataclasses

import jax

from jaxrunner.config import EngineConfig
from jaxrunner.models.loading import LoadedModel, load_model
from jaxrunner.models.loading.quantize import quantize_model
from jaxrunner.models import registry
from jaxrunner.parallel import distributed, mesh as meshes, sharding
from jaxrunner.runner.executor import Executor
from jaxrunner.runner.preflight import check_draft_vocabulary


def build_executors(config: EngineConfig, model: LoadedModel | None = None) -> list[Executor]:
    """Load (unless given) and start one executor per data-parallel replica."""
    distributed.initialize_from_env()  # before any device is touched; a no-op unless configured
    rows = _replica_meshes(config, model)
    base = model if model is not None else load_model(config.model, config.dtype, progress=config.progress,
                                                      mesh=rows[0])
    draft = None
    if config.speculative_method == "draft_model":
        draft = load_model(config.speculative_model, config.dtype, progress=config.progress, mesh=rows[0])
        check_draft_vocabulary(base.config, draft.config)
    executors = []
    for row in rows:
        replica = _quantized(_on_mesh(base, row), config.quantization, config)
        draft_replica = None if draft is None else _quantized(_on_mesh(draft, row), config.speculative_quantization,
                                                              config)
        executors.append(Executor(config, replica, draft_replica))
    if len(rows) > 1:
        for executor in executors:
            executor.startup_report["global_mesh"] = meshes.describe(meshes.build_mesh(
                config.tensor_parallel_size, config.data_parallel_size))
    return executors


def _quantized(model: LoadedModel, quantization: str | None, config: EngineConfig) -> LoadedModel:
    if quantization is None:
        return model
    return quantize_model(model, quantization, config.quantization_group_size)


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
    rules = registry.partition_rules(model.config)
    params = jax.device_put(model.params, sharding.param_shardings(model.params, mesh, rules))
    return dataclasses.replace(model, params=params, mesh=mesh)
