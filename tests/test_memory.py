"""The memory budget and KV-pool sizing (``runner.memory``)."""
from __future__ import annotations

from jaxrunner.runner.memory import MemoryBudget, size_kv_pool


def test_kv_pool_sizing_from_device_memory():
    budget = MemoryBudget(device_bytes=1000 << 20, budget_bytes=900 << 20, source="test")
    pages, how = size_kv_pool(budget=budget, weights_bytes=300 << 20, activation_bytes=100 << 20,
                              bytes_per_page=1 << 20, max_useful_pages=10_000, kv_cache_memory_bytes=None)
    assert pages == 900 - 300 - 100 - 50  # minus the 5% safety margin
    assert "activations" in how


def test_cpu_pool_size_stays_when_available_ram_moves():
    """The pool's shape is in every executable: RAM that other processes take or free between two
    starts must not change it, or the second start misses the persistent compilation cache."""
    sizes = set()
    for available in (16 << 30, 17 << 30, 19 << 30, 21 << 30):
        budget = MemoryBudget(device_bytes=None, budget_bytes=int(0.9 * available), source="test",
                              host_total_bytes=int(0.9 * (23 << 30)))
        pages, how = size_kv_pool(budget=budget, weights_bytes=540 << 20, activation_bytes=0,
                                  bytes_per_page=737_280, max_useful_pages=8193, kv_cache_memory_bytes=None)
        sizes.add(pages)
    assert sizes == {5120} and "host's RAM" in how
    tight = MemoryBudget(device_bytes=None, budget_bytes=2 << 30, source="test", host_total_bytes=20 << 30)
    pages, _ = size_kv_pool(budget=tight, weights_bytes=540 << 20, activation_bytes=0, bytes_per_page=737_280,
                            max_useful_pages=8193, kv_cache_memory_bytes=None)
    assert pages * 737_280 <= ((2 << 30) - (540 << 20)) // 2  # never more than half of what is available
