"""Small engine configurations shared by the engine tests (few buckets, so compiles stay cheap)."""
from __future__ import annotations

import contextlib
import os
import tempfile

import jax
import numpy as np

# One compilation cache for the whole test session: engines with the same shapes reuse executables.
COMPILE_CACHE = os.environ.setdefault("JAXRUNNER_COMPILATION_CACHE",
                                      os.path.join(tempfile.gettempdir(), "jaxrunner-test-xla-cache"))

# min_token_bucket=32 keeps the test engines at 6 shapes (32 and 64 tokens × 1, 4, 8 sequences):
# compiling is most of what an engine test costs. The 1- to 16-token buckets are exercised by the
# CLI, server and notebook tests, which use smaller minimums.
TINY_ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, page_size=8, num_pages=96,
                   compilation_cache_dir=COMPILE_CACHE, progress=False, seed=0, min_token_bucket=32)


def make_llm(model_dir: str, **overrides):
    from jaxrunner import LLM

    return LLM(model_dir, **{**TINY_ENGINE, **overrides})


def random_prompts(count: int, vocab: int, low: int, high: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, vocab, rng.integers(low, high + 1)).tolist()} for _ in range(count)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@contextlib.contextmanager
def count_compilations():
    """Count XLA backend compilations (through jax.monitoring, not JAX internals)."""
    events: list[str] = []

    def on_duration(event: str, duration: float, **kwargs) -> None:
        if event.startswith("/jax/core/compile"):  # tracing, lowering and backend compiles
            events.append(event)

    def on_event(event: str, **kwargs) -> None:
        if event.startswith("/jax/compilation_cache"):  # a persistent-cache hit is a compile avoided late
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)
