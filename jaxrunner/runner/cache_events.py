"""Persistent compilation cache outcomes, counted from ``jax.monitoring`` events.

JAX records ``/jax/compilation_cache/cache_hits`` or ``.../cache_misses`` on the thread that asks
for the executable, so counting per thread tells each bucket's outcome even while several buckets
compile on a thread pool. A compile that records neither did not consult the persistent cache:
the cache is off, or the executable came from this process's own memory.
"""
from __future__ import annotations

import collections
import contextlib
import threading

import jax

HIT = "/jax/compilation_cache/cache_hits"
MISS = "/jax/compilation_cache/cache_misses"


class Watch:
    """Hits and misses seen while it is registered, per thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    def on_event(self, event: str, **kwargs) -> None:
        if event in (HIT, MISS):
            with self._lock:
                self._counts[threading.get_ident()][event] += 1

    def this_thread(self) -> tuple[int, int]:
        """(hits, misses) seen so far on the calling thread."""
        with self._lock:
            counts = self._counts[threading.get_ident()]
            return counts[HIT], counts[MISS]

    def totals(self) -> dict[str, int]:
        with self._lock:
            return {"hits": sum(c[HIT] for c in self._counts.values()),
                    "misses": sum(c[MISS] for c in self._counts.values())}


@contextlib.contextmanager
def watch():
    """Count persistent-cache hits and misses until the block ends."""
    counter = Watch()
    jax.monitoring.register_event_listener(counter.on_event)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_listener(counter.on_event)


def outcome(before: tuple[int, int], after: tuple[int, int]) -> str:
    """"hit", "miss", or "unused" (no persistent-cache lookup) between two ``this_thread`` readings."""
    if after[1] > before[1]:
        return "miss"
    if after[0] > before[0]:
        return "hit"
    return "unused"
