"""Device meshes for tensor and data parallelism, and the checks that say which sizes work.

One global mesh with axes ``("data", "model")``: row ``i`` holds the ``tensor_parallel_size``
devices of data-parallel replica ``i``. Each replica is an independent engine on its own row (its
sub-mesh), so replicas never communicate; within a row, XLA's SPMD partitioner inserts the
collectives tensor parallelism needs.
"""
from __future__ import annotations

from typing import Protocol

import jax
import numpy as np
from jax.sharding import Mesh

DATA_AXIS = "data"
MODEL_AXIS = "model"


class ModelShape(Protocol):
    """What parallelism reads of a model's config (``models.config.ModelConfig`` has it): head
    counts and widths. ``parallel/`` imports nothing of the models; the rules come from the caller."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int


def tensor_parallel_problem(cfg: ModelShape, tp: int) -> str | None:
    """Why ``tp`` cannot split this model, or ``None`` when it can."""
    if cfg.num_heads % tp:
        return f"it does not divide the {cfg.num_heads} query heads"
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        return (f"the {cfg.num_kv_heads} KV heads can neither be split {tp} ways nor replicated "
                f"evenly onto {tp} shards")
    if cfg.intermediate_size % tp:
        return f"it does not divide the MLP's intermediate size {cfg.intermediate_size}"
    return None


def valid_tensor_parallel_sizes(cfg: ModelShape) -> list[int]:
    return [tp for tp in range(1, cfg.num_heads + 1) if tensor_parallel_problem(cfg, tp) is None]


def check_tensor_parallel(cfg: ModelShape, tp: int) -> None:
    problem = tensor_parallel_problem(cfg, tp)
    if problem:
        raise ValueError(f"tensor_parallel_size={tp}: {problem}; sizes that work for this model: "
                         f"{valid_tensor_parallel_sizes(cfg)}")


def check_device_count(tp: int, dp: int, devices=None) -> None:
    """Fail early, before any weight is read, when the mesh asks for more devices than exist."""
    for name, size in (("tensor_parallel_size", tp), ("data_parallel_size", dp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}: expected a positive integer, got {size!r}")
    devices = list(devices if devices is not None else jax.devices())
    if tp * dp > len(devices):
        platform = devices[0].platform if devices else "?"
        raise ValueError(
            f"tensor_parallel_size={tp} × data_parallel_size={dp} asks for {tp * dp} devices, but only "
            f"{len(devices)} {platform} device(s) exist; choose sizes whose product is at most {len(devices)}"
            + (" (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N devices)"
               if platform == "cpu" else ""))


def build_mesh(tp: int = 1, dp: int = 1, devices=None) -> Mesh:
    """The ``(dp, tp)`` mesh over the first ``dp × tp`` devices (``jax.devices()`` by default)."""
    check_device_count(tp, dp, devices)
    devices = list(devices if devices is not None else jax.devices())[: tp * dp]
    if len(devices) == 1:
        return Mesh(np.array(devices).reshape(1, 1), (DATA_AXIS, MODEL_AXIS))
    # Auto axes: XLA's SPMD partitioner propagates shardings (newer jax defaults to Explicit axes,
    # which would make every gather from the vocabulary-split embedding spell out its sharding).
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((dp, tp), (DATA_AXIS, MODEL_AXIS), axis_types=auto, devices=devices)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One ``(1, tp)`` sub-mesh per data-parallel replica."""
    return [Mesh(mesh.devices[i:i + 1], mesh.axis_names) for i in range(mesh.shape[DATA_AXIS])]


def local_device(mesh: Mesh):
    """The first device of ``mesh`` this process can address (for memory stats and the platform)."""
    for device in mesh.devices.flat:
        if device.process_index == jax.process_index():
            return device
    raise ValueError(f"mesh {describe(mesh)} holds no device of process {jax.process_index()}")


def tensor_parallel_size(mesh: Mesh) -> int:
    return int(mesh.shape[MODEL_AXIS])


def describe(mesh: Mesh) -> str:
    return f"{dict(mesh.shape)} over {mesh.devices.size} {mesh.devices.flat[0].platform} device(s)"
