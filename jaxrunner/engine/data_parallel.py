"""Data parallelism: independent engine replicas, one per row of the ``("data", "model")`` mesh.

Replicas share nothing at run time (each has its own scheduler, page pool and executables), so
they need no communication; the front end sends each new request to the replica with the fewest
unfinished requests, and one ``step`` launches every replica's step before waiting for any, so
replicas on different devices compute at the same time.
"""
from __future__ import annotations

import dataclasses

import jax

from jaxrunner.config import EngineConfig
from jaxrunner.engine.engine import LLMEngine, ValidRequest, _check_owner
from jaxrunner.models.loading import LoadedModel, load_model
from jaxrunner.outputs import RequestOutput
from jaxrunner.parallel import distributed, mesh as meshes, sharding
from jaxrunner.runner import weights


def create_engine(config: EngineConfig, model: LoadedModel | None = None):
    """The engine a config asks for: one ``LLMEngine``, or a ``DataParallelEngine`` of several.
    ``model``: already loaded (onto the first replica's mesh) instead of read from ``config.model``."""
    if config.data_parallel_size == 1:
        return LLMEngine(config, model, None if model is None else model.mesh)
    return DataParallelEngine(config, model)


def _on_mesh(model: LoadedModel, mesh) -> LoadedModel:
    """``model`` with its params copied onto another replica's mesh (device to device)."""
    if mesh is model.mesh:
        return model
    params = jax.device_put(model.params, sharding.param_shardings(model.params, mesh, model.config))
    return dataclasses.replace(model, params=params, mesh=mesh)


class DataParallelEngine:
    """``data_parallel_size`` LLMEngines behind the engine API (add_request / step / abort)."""

    def __init__(self, config: EngineConfig, model: LoadedModel | None = None):
        tp, dp = config.tensor_parallel_size, config.data_parallel_size
        distributed.initialize_from_env()  # before any device is touched, as in LLMEngine
        meshes.check_device_count(tp, dp)
        if jax.process_count() > 1:
            raise ValueError(f"data_parallel_size={dp} with {jax.process_count()} processes: a replica would be "
                             f"driven by one host only; run one engine per host for data parallelism and use "
                             f"jax.distributed for tensor parallelism across hosts")
        self.config = config
        self.mesh = meshes.build_mesh(tp, dp)
        rows = meshes.replica_meshes(self.mesh)
        base = model if model is not None else load_model(config.model, config.dtype, progress=config.progress,
                                                          mesh=rows[0])
        self.replicas = [LLMEngine(config, _on_mesh(base, row), row) for row in rows]
        self._replica_of: dict[str, LLMEngine] = {}
        self.owner_thread = None  # set while an engine loop owns the engine (see LLMEngine.check_caller)

    # the single-engine attributes front ends read, from the first replica (all are alike)
    @property
    def model(self) -> LoadedModel:
        return self.replicas[0].model

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def startup_report(self) -> dict:
        report = dict(self.replicas[0].startup_report)
        report.update(data_parallel_size=len(self.replicas), global_mesh=meshes.describe(self.mesh),
                      replica_compile_s_total=[r.startup_report["compile_s_total"] for r in self.replicas])
        return report

    def validate_request(self, prompt, sampling_params=None) -> ValidRequest:
        return self.replicas[0].validate_request(prompt, sampling_params)  # replicas share model and limits

    def check_caller(self) -> None:
        _check_owner(self)

    def add_request(self, request_id: str, prompt, sampling_params=None) -> None:
        """Queue on the least-loaded replica (fewest unfinished requests; ties to the lowest index)."""
        self.check_caller()
        request_id = str(request_id)
        if request_id in self._replica_of:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        replica = min(self.replicas, key=LLMEngine.num_unfinished_requests)
        replica.add_request(request_id, prompt, sampling_params)
        self._replica_of[request_id] = replica

    def abort_request(self, request_id: str) -> None:
        self.check_caller()
        replica = self._replica_of.pop(str(request_id), None)
        if replica is not None:
            replica.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def num_unfinished_requests(self) -> int:
        return sum(r.num_unfinished_requests() for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        self.check_caller()
        pending = [replica.launch_step() for replica in self.replicas]  # all dispatched before any wait
        outputs = []
        for replica, launched in zip(self.replicas, pending):
            outputs.extend(replica.complete_step(launched))
        for output in outputs:
            if output.finished:
                self._replica_of.pop(output.request_id, None)
        return outputs

    @property
    def params(self):
        return self.replicas[0].params

    def update_weights(self, params, abort_in_flight: bool = False) -> None:
        """Every replica serves ``params`` (see ``LLMEngine.update_weights``); all are checked first."""
        for replica in self.replicas:
            weights.check_like(params, replica.params)
        for replica in self.replicas:
            replica.update_weights(params, abort_in_flight)
        if abort_in_flight:
            self._replica_of.clear()

    def stats(self) -> dict:
        per_replica = [r.stats() for r in self.replicas]
        summed = ("num_steps", "prefix_cache_hit_tokens", "num_preemptions", "pages_in_use", "pages_total",
                  "num_unfinished", "num_draft_tokens", "num_accepted_draft_tokens")
        stats = {key: sum(s[key] for s in per_replica) for key in summed}
        stats["spec_acceptance_rate"] = (stats["num_accepted_draft_tokens"] / stats["num_draft_tokens"]
                                         if stats["num_draft_tokens"] else None)
        stats.update(tokens_per_step=[t for s in per_replica for t in s["tokens_per_step"]],
                     max_pages_per_seq=per_replica[0]["max_pages_per_seq"], replicas=per_replica)
        return stats
