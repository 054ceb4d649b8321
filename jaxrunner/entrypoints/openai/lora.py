"""LoRA adapters as the server serves them, as vLLM's OpenAI server does: each has a name that a
request's ``model`` may give instead of the base model's, a card in ``/v1/models``, and it is loaded
at start-up (``--lora-modules``) or while serving (``POST /v1/load_lora_adapter``,
``/v1/unload_lora_adapter``).

The server's list is the one clients see; the engine may drop an idle adapter from host memory
(``max_cpu_loras``) and read it again from its directory when a request names it. Ids are never
reused: a name unloaded and loaded again gets a new id, so no prefix-cache page of its old weights
serves it.
"""
from __future__ import annotations

import asyncio
import dataclasses

from jaxrunner.entrypoints.openai.protocol import RequestError
from jaxrunner.lora_request import LoRARequest


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` item (vLLM's name): ``base_model_name`` is the card's ``parent``."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclasses.dataclass(frozen=True)
class _Served:
    request: LoRARequest
    parent: str | None  # None: the server's model name


class ServedAdapters:
    """The adapters clients may name, in the order they were loaded. Loads and unloads take turns
    (one lock), so ids are handed out in order and a name is never half loaded."""

    def __init__(self):
        self._served: dict[str, _Served] = {}
        self._next_id = 1
        self._lock = asyncio.Lock()

    def get(self, name: str) -> LoRARequest | None:
        served = self._served.get(name)
        return None if served is None else served.request

    def names(self) -> list[str]:
        return list(self._served)

    def cards(self, parent: str, created: int) -> list[dict]:
        """``/v1/models`` entries, as vLLM's: the adapter's directory is its ``root``."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "jaxrunner",
                 "root": served.request.lora_path, "parent": served.parent or parent}
                for name, served in self._served.items()]

    def load_at_start(self, llm, modules: tuple[LoRAModulePath, ...]) -> None:
        """``--lora-modules``, ids 1, 2, ... in order; a bad adapter stops the start (ValueError)."""
        for module in modules:
            request = LoRARequest(module.name, self._next_id, module.path)
            llm.add_lora(request)
            self._add(request, module.base_model_name)

    async def load(self, llm, name: str, path: str, base_names: list[str]) -> LoRARequest:
        """Read an adapter off the event loop and serve it under the next id; a 400 names the field."""
        async with self._lock:
            if name in base_names:
                raise RequestError(f"lora_name: {name!r} is the base model's name", param="lora_name")
            if name in self._served:
                raise RequestError(f"lora_name: the adapter {name!r} is already loaded; unload it first",
                                   param="lora_name")
            request = LoRARequest(name, self._next_id, path)
            try:
                await asyncio.to_thread(llm.add_lora, request)
            except (ValueError, OSError) as err:  # a missing directory, a rank or shapes the model cannot take
                raise RequestError(str(err), param="lora_path") from None
            self._add(request, None)
            return request

    async def unload(self, llm, name: str) -> None:
        """Stop serving an adapter: 404 when no adapter has that name, 400 while requests use it. The
        name goes from the list first, so no new request picks it while the engine removes it."""
        async with self._lock:
            if name not in self._served:
                raise RequestError(f"lora_name: no adapter named {name!r} is loaded (loaded: "
                                   f"{', '.join(self._served) or 'none'})", status=404, param="lora_name",
                                   kind="not_found_error")
            before = dict(self._served)
            del self._served[name]
            try:
                await asyncio.to_thread(llm.remove_lora, name)  # False: the engine had dropped it already
            except BaseException as err:
                self._served = before
                if isinstance(err, ValueError):  # unfinished requests use it
                    raise RequestError(str(err), param="lora_name") from None
                raise

    def _add(self, request: LoRARequest, parent: str | None) -> None:
        self._served[request.lora_name] = _Served(request, parent)
        self._next_id = request.lora_int_id + 1
