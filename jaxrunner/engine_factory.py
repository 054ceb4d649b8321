"""``create_engine``: the runner side's started executors handed to the host-only engine.

The engine (``jaxrunner.engine``) and the runner (``jaxrunner.runner``) share only the executor
protocol (``jaxrunner.executor_protocol``); this is the one place that puts the two together.
"""
from __future__ import annotations

from jaxrunner.config import EngineConfig
from jaxrunner.engine.engine import LLMEngine
from jaxrunner.models.loading import LoadedModel
from jaxrunner.runner.builder import build_executors


def create_engine(config: EngineConfig, model: LoadedModel | None = None) -> LLMEngine:
    """The engine ``config`` asks for. ``model``: already loaded (onto the first replica's mesh)
    instead of read from ``config.model``."""
    return LLMEngine(config, build_executors(config, model))
