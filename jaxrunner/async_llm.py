"""AsyncLLM: asyncio callers of the engine loop, each with its own stream of outputs.

The engine loop's thread runs the engine; an ``AsyncLLM`` hands each output to the caller's event loop
through ``loop.call_soon_threadsafe``. A caller that goes away (its task cancelled, its generator
closed, an HTTP client disconnected) aborts its request, and the engine loop frees its pages at once.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from jaxrunner.engine.loop import EngineLoop
from jaxrunner.outputs import RequestOutput
from jaxrunner.sampling_params import SamplingParams


class AsyncLLM:
    """``async for output in AsyncLLM(llm).generate(prompt, params): ...``

    Built on an ``LLM`` (``AsyncLLM(llm)``; both share its engine loop, so sync and async callers are
    batched together) or from a model name and engine options (``AsyncLLM.from_model(...)``)."""

    def __init__(self, llm):
        self.llm = llm
        self.engine_loop: EngineLoop = llm.engine_loop

    @classmethod
    def from_model(cls, model: str, **engine_options) -> "AsyncLLM":
        from jaxrunner.llm import LLM  # lazy: LLM loads JAX; AsyncLLM and the HTTP server do not

        return cls(LLM(model, **engine_options))

    @property
    def engine(self):
        return self.llm.engine

    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, lora_request=None) -> "RequestStream":
        """Validate and queue one request now (``ValueError`` here, before anything is queued); its
        outputs are read from the returned stream, on the running event loop. ``lora_request``: the
        adapter it runs with (``LoRARequest``; the engine needs ``enable_lora``)."""
        request = self.engine_loop.validate(prompt, sampling_params, lora_request)
        return RequestStream(self.engine_loop, request, request_id)

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, lora_request=None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they are produced (each holds the text so far and ``delta_text``)."""
        stream = self.add_request(prompt, sampling_params, request_id, lora_request)
        async with stream:
            async for output in stream:
                yield output

    async def abort(self, request_id: str) -> None:
        self.engine_loop.abort(request_id)


class RequestStream:
    """One request's outputs on an asyncio event loop; leaving it early (``async with``/``aclose``)
    aborts the request."""

    def __init__(self, engine_loop: EngineLoop, request, request_id: str | None):
        self._engine_loop = engine_loop
        event_loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.request_id = engine_loop.submit(
            request, lambda item: event_loop.call_soon_threadsafe(self._queue.put_nowait, item), request_id)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine_loop.abort(self.request_id)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.abort()
