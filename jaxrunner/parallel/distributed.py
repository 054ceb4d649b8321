"""Multi-host start-up: join ``jax.distributed`` from the standard settings, before any JAX work.

Settings, from arguments or the environment: ``JAX_COORDINATOR_ADDRESS`` (host:port of process 0),
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``. With only the address set, JAX's own cluster
detection (SLURM, Open MPI, TPU pods, ...) fills in the rest. On CPU, collectives go through gloo.

How the processes stay in step: JAX is multi-controller — every process must launch the same
computations in the same order. jaxrunner therefore runs the *same deterministic scheduler* in
every process, fed the same requests (each process runs the same driver script, as with any JAX
program); the sampled tokens come back replicated to every process, so every scheduler sees the
same outputs and makes the same next plan. The alternative — a scheduler on process 0 broadcasting
each step's batch — would put a host-to-host collective on every step's critical path and make
the other processes mere workers with no view of the requests. The cost of the choice: requests
must reach every process (the front end's job), and the scheduler must stay free of wall-clock or
per-process state (it is: FCFS by arrival order, seeds derived from the engine seed).
"""
from __future__ import annotations

import os

import jax

ENV_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected an integer") from None


def initialize_from_env(coordinator_address: str | None = None, num_processes: int | None = None,
                        process_id: int | None = None) -> bool:
    """Join the cluster if one is configured; returns whether this is a multi-process run.

    A no-op when nothing is configured or when the caller already ran ``jax.distributed.initialize``.
    """
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    address = coordinator_address or os.environ.get(ENV_ADDRESS)
    if not address:
        return False
    num_processes = num_processes if num_processes is not None else _int_env(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _int_env(ENV_PROCESS_ID)
    if jax.config.jax_platforms in (None, "", "cpu") and not jax.config.jax_cpu_collectives_implementation:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=address, num_processes=num_processes, process_id=process_id)
    return jax.process_count() > 1
