"""LoRA adapters on the engine's side (host only): which are known, and which sit in which slot.

``AdapterRegistry`` holds the adapters requests may name: read and laid out by the executor
(``Executor.load_adapter``; opaque here), keyed by name, ``max_cpu_loras`` of them in host memory
(more only while unfinished requests use them all). An adapter that no unfinished request names
and that can be read again from its directory is dropped when room is needed, least recently used
first. A name keeps its id for as long as it is known. Every load and ``update`` gets a new generation (one counter for the registry), which
keys the slots and the prefix cache: neither ever serves weights of an older load, even of an
adapter removed and added again under the same name and id.

``AdapterSlots`` is one replica's ``max_loras`` device slots: before a step is laid out, every
adapter of the plan is given a slot, loading it (``Executor.load_lora_slot``) into a free slot or
the least recently used one that this plan does not need. The scheduler keeps the adapters of the
running requests within ``max_loras``, so a plan's always fit.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from typing import Any, Callable, Iterable

from jaxrunner.lora_request import LoRARequest


@dataclasses.dataclass
class _Adapter:
    request: LoRARequest
    data: Any         # what the executor laid out (host arrays)
    generation: int   # the registry's count at its load or last update: slots and cached pages key on it

    @property
    def cache_salt(self) -> int:
        """What keys this adapter's prefix-cache pages apart from the base model's and other loads'."""
        return hash(("lora", self.request.lora_name, self.generation)) or 1


class AdapterRegistry:
    def __init__(self, max_cpu_loras: int, load: Callable[[str, Any], Any]):
        """``load(name, source)``: the executor's ``load_adapter`` (a PEFT directory, or in-memory
        tensors); it raises ``ValueError`` for an adapter the model cannot take."""
        self.max_cpu_loras = max_cpu_loras
        self._load = load
        self._adapters: collections.OrderedDict[str, _Adapter] = collections.OrderedDict()
        self._generations = itertools.count(1)
        self._lock = threading.Lock()  # validation runs on callers' threads

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def names(self) -> list[str]:
        return list(self._adapters)

    def get(self, name: str) -> _Adapter:
        return self._adapters[name]

    def resolve(self, request: LoRARequest, in_use: Callable[[], set[str]]) -> _Adapter:
        """The adapter ``request`` names, read from its directory the first time (``ValueError``
        when it cannot be, or when its name or id clash with a known adapter's)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(request).__name__}")
        with self._lock:
            known = self._adapters.get(request.lora_name)
            if known is not None:
                _check_same(known.request, request)
                self._adapters.move_to_end(request.lora_name)
                return known
            _check_id_free(self._adapters.values(), request)
            if not request.lora_path:
                raise ValueError(f"lora_request {request.lora_name!r}: unknown adapter and no lora_path to read it "
                                 f"from (known: {', '.join(self._adapters) or 'none'})")
            return self._insert(request, self._load(request.lora_name, request.lora_path), in_use)

    def add(self, request: LoRARequest, source: Any, in_use: Callable[[], set[str]]) -> _Adapter:
        """A new adapter from ``source`` (its directory, or tensors in memory); its name must be new."""
        with self._lock:
            if request.lora_name in self._adapters:
                raise ValueError(f"add_lora: an adapter named {request.lora_name!r} is already loaded; "
                                 f"use update_lora to change its weights, or remove_lora first")
            _check_id_free(self._adapters.values(), request)
            return self._insert(request, self._load(request.lora_name, source), in_use)

    def update(self, name: str, source: Any) -> _Adapter:
        """New weights for a known adapter, served from the next step on."""
        with self._lock:
            if name not in self._adapters:
                raise ValueError(f"update_lora: no adapter named {name!r} (known: {', '.join(self._adapters) or 'none'})")
            entry = self._adapters[name]
            entry.data, entry.generation = self._load(name, source), next(self._generations)
            return entry

    def remove(self, name: str, in_use: set[str]) -> bool:
        """Forget an adapter no unfinished request names; False when it is unknown."""
        with self._lock:
            if name not in self._adapters:
                return False
            if name in in_use:
                raise ValueError(f"remove_lora: adapter {name!r} is in use by unfinished requests")
            del self._adapters[name]
            return True

    def _insert(self, request: LoRARequest, data: Any, in_use: Callable[[], set[str]]) -> _Adapter:
        if len(self._adapters) >= self.max_cpu_loras:
            self._make_room(in_use(), len(self._adapters) - self.max_cpu_loras + 1)
        entry = self._adapters[request.lora_name] = _Adapter(request, data, next(self._generations))
        return entry

    def _make_room(self, in_use: set[str], count: int) -> None:
        """Drop up to ``count`` of the least recently used adapters that can be read again and that
        nothing uses. Where too few can go (in use, or added from memory), host memory holds more
        than the cap: the requests that use them need them."""
        droppable = [name for name, entry in self._adapters.items() if name not in in_use and entry.request.lora_path]
        for name in droppable[:count]:
            del self._adapters[name]


def _check_same(known: LoRARequest, request: LoRARequest) -> None:
    if request.lora_int_id != known.lora_int_id:
        raise ValueError(f"lora_request {request.lora_name!r}: lora_int_id {request.lora_int_id}, but the adapter "
                         f"of that name has id {known.lora_int_id}")
    if request.lora_path and known.lora_path and request.lora_path != known.lora_path:
        raise ValueError(f"lora_request {request.lora_name!r}: lora_path {request.lora_path!r}, but the adapter of "
                         f"that name was read from {known.lora_path!r}")


def _check_id_free(adapters: Iterable[_Adapter], request: LoRARequest) -> None:
    for entry in adapters:
        if entry.request.lora_int_id == request.lora_int_id:
            raise ValueError(f"lora_request {request.lora_name!r}: lora_int_id {request.lora_int_id} is taken by "
                             f"adapter {entry.request.lora_name!r}")


class AdapterSlots:
    """One replica's device slots 1..max_loras: which adapter generation each holds, least recent first."""

    def __init__(self, max_loras: int, load_slot: Callable[[int, Any], None]):
        self.max_loras = max_loras
        self._load_slot = load_slot
        self._held: collections.OrderedDict[int, tuple[str, int]] = collections.OrderedDict()  # slot -> (name, generation)
        self.num_loads = 0

    def assign(self, adapters: dict[str, _Adapter]) -> dict[str, int]:
        """A slot for each of a plan's adapters (at most ``max_loras``), loading those not in one."""
        if len(adapters) > self.max_loras:
            raise RuntimeError(f"a step names {len(adapters)} adapters, the device holds {self.max_loras}")
        slots = {}
        for name, entry in adapters.items():
            slot = self._find(name, entry.generation)
            if slot is None:
                slot = self._free_slot(adapters)
                self._load_slot(slot, entry.data)
                self.num_loads += 1
                self._held.pop(slot, None)
                self._held[slot] = (name, entry.generation)
            self._held.move_to_end(slot)
            slots[name] = slot
        return slots

    def _find(self, name: str, generation: int) -> int | None:
        return next((slot for slot, held in self._held.items() if held == (name, generation)), None)

    def _free_slot(self, adapters: dict[str, _Adapter]) -> int:
        """An empty slot, else the least recently used one holding nothing the plan needs."""
        empty = [slot for slot in range(1, self.max_loras + 1) if slot not in self._held]
        if empty:
            return empty[0]
        return next(slot for slot, (name, generation) in self._held.items()
                    if name not in adapters or adapters[name].generation != generation)
