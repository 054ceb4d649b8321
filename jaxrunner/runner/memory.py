"""The memory budget and the KV pool's size: what start-up may use, and how many pages fit.

The budget is the device's memory where the backend reports it, else the host's RAM (CPU). The
pool takes what the weights (and, on accelerators, the largest bucket's activations) leave; a pool
the user sized is refused, with the numbers, before anything is allocated. Nothing here imports
JAX: ``runner/preflight.py`` runs these checks before any weight is read.
"""
from __future__ import annotations

import dataclasses
import os

CPU_DEFAULT_KV_FRACTION = 0.25   # of available host RAM, when no accelerator reports its memory
CPU_DEFAULT_KV_CAP_BYTES = 4 << 30
SAFETY_MARGIN_FRACTION = 0.05


class StartupError(RuntimeError):
    """Start-up cannot go on: memory budget exceeded, or the warm-up self-check failed."""


def total_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclasses.dataclass
class MemoryBudget:
    device_bytes: int | None   # what the device reports (None on CPU)
    budget_bytes: int          # what jaxrunner may use in all
    source: str                # where the budget came from
    host_total_bytes: int | None = None  # the host's RAM × memory_utilization (CPU): steadier than what is available now


def memory_budget(device, memory_utilization: float) -> MemoryBudget:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        limit = int(stats["bytes_limit"])
        return MemoryBudget(limit, int(limit * memory_utilization), "device.memory_stats()['bytes_limit']")
    host = available_host_bytes()
    return MemoryBudget(None, int(host * memory_utilization), "available host RAM (CPU reports no memory stats)",
                        host_total_bytes=int(total_host_bytes() * memory_utilization))


def check_weights_fit(budget: MemoryBudget, weights_bytes: int) -> None:
    if weights_bytes > budget.budget_bytes:
        raise StartupError(
            f"the weights alone ({weights_bytes / 2**20:.1f} MiB) exceed the memory budget "
            f"({budget.budget_bytes / 2**20:.1f} MiB from {budget.source}) by "
            f"{(weights_bytes - budget.budget_bytes) / 2**20:.1f} MiB")


def check_pool_fits(budget: MemoryBudget, weights_bytes: int, bytes_per_page: int, num_pages: int | None,
                    kv_cache_memory_bytes: int | None) -> None:
    """A pool sized by the user (``num_pages`` or ``kv_cache_memory_bytes``) must fit beside the
    weights: refused with the numbers before anything is allocated (allocating it layer by layer
    would run until the process is killed)."""
    check_weights_fit(budget, weights_bytes)
    left = budget.budget_bytes - weights_bytes
    asked = [("num_pages", num_pages, None if num_pages is None else num_pages * bytes_per_page),
             ("kv_cache_memory_bytes", kv_cache_memory_bytes, kv_cache_memory_bytes)]
    for name, value, pool_bytes in asked:
        if pool_bytes is not None and pool_bytes > left:
            valid = (f"num_pages <= {left // bytes_per_page}" if name == "num_pages" else
                     f"kv_cache_memory_bytes <= {left}")
            raise ValueError(
                f"EngineConfig.{name}={value}: the KV pool needs {pool_bytes / 2**30:.2f} GiB "
                f"({bytes_per_page} bytes per page) but {left / 2**30:.2f} GiB is left of the "
                f"{budget.budget_bytes / 2**30:.2f} GiB budget ({budget.source}) after "
                f"{weights_bytes / 2**30:.2f} GiB of weights; valid: {valid}")


def size_kv_pool(*, budget: MemoryBudget, weights_bytes: int, activation_bytes: int, bytes_per_page: int,
                 max_useful_pages: int, kv_cache_memory_bytes: int | None) -> tuple[int, str]:
    """Number of KV pages, and a sentence saying how it was chosen."""
    check_weights_fit(budget, weights_bytes)
    if kv_cache_memory_bytes is not None:
        kv_bytes, how = kv_cache_memory_bytes, "kv_cache_memory_bytes"
    elif budget.device_bytes is not None:
        margin = int(SAFETY_MARGIN_FRACTION * budget.device_bytes)
        kv_bytes = budget.budget_bytes - weights_bytes - activation_bytes - margin
        how = "memory_utilization × device memory − weights − peak activations − margin"
    else:
        total = budget.host_total_bytes or budget.budget_bytes
        kv_bytes = min(int(CPU_DEFAULT_KV_FRACTION * (total - weights_bytes)), CPU_DEFAULT_KV_CAP_BYTES,
                       (budget.budget_bytes - weights_bytes) // 2)
        how = (f"{CPU_DEFAULT_KV_FRACTION:.0%} of the host's RAM after weights (cap 4 GiB, at most half of "
               f"what is available)")
    pages = min(kv_bytes // bytes_per_page, max_useful_pages)
    if pages < 2:
        raise StartupError(f"no room for the KV cache: {kv_bytes / 2**20:.1f} MiB left ({how}), "
                           f"{bytes_per_page / 2**20:.2f} MiB per page")
    if pages == max_useful_pages:
        how += f", capped at max_num_seqs × pages per sequence + scratch ({max_useful_pages})"
    elif budget.device_bytes is None and kv_cache_memory_bytes is None:
        pages = steady_page_count(pages)
        how += ", rounded down to 4 steps per power of two"
    return int(pages), how


def steady_page_count(pages: int) -> int:
    """``pages`` rounded down to one of 4 values per power of two (at most 20 % fewer).

    The pool's size is in every executable's signature: a pool sized from host RAM that moves by
    a few pages between processes would miss the persistent compilation cache at every start."""
    if pages < 8:
        return pages
    step = 1 << (pages.bit_length() - 3)
    return pages // step * step
