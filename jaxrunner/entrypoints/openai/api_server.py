"""The OpenAI-compatible HTTP app over ``AsyncLLM``: its endpoints and the path of a request.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (server-sent events when
``stream``), ``GET /v1/models``, ``POST /tokenize`` and ``/detokenize`` (vLLM's), ``GET /version``,
``GET /health`` (503 until warm-up is done, or once the engine failed), ``GET /metrics``
(Prometheus, vLLM's names), ``/openapi.json`` and, with LoRA, vLLM's ``POST /v1/load_lora_adapter``
and ``/v1/unload_lora_adapter``; a request's ``model`` may name an adapter (``lora``). Errors use
OpenAI's JSON shape: 400 names the request's field, 401 a missing or wrong key, 404 an unknown model
(or adapter), 413 a body over the size limit, 503 (with ``Retry-After``) when more requests would wait
than ``max_queue``. A request's error never stops the engine loop or other requests; a client that
disconnects aborts its requests, which frees their pages at once. The process around the app (signals,
shutdown, exit status) is ``server_process``; the request bodies and their mapping onto SamplingParams
are ``protocol``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import time
import uuid

import pydantic.json_schema
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxrunner
from jaxrunner.async_llm import AsyncLLM, RequestStream
from jaxrunner.engine.engine import check_unicode
from jaxrunner.engine.loop import EngineLoopClosed, EngineLoopDied
from jaxrunner.entrypoints.openai import protocol
from jaxrunner.entrypoints.openai.logprobs import (chat_logprobs, completion_logprobs, echo_completion_logprobs, joined,
                                                   prompt_logprobs_json)
from jaxrunner.entrypoints.openai.lora import LoRAModulePath, ServedAdapters
from jaxrunner.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from jaxrunner.entrypoints.openai.protocol import RequestError
from jaxrunner.entrypoints.openai.tool_calls import ToolDeltas, ToolPlan, plan_tools, reply
from jaxrunner.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from jaxrunner.lora_request import LoRARequest
from jaxrunner.models.loading.hf import read_generation_config, sampling_defaults

logger = logging.getLogger("jaxrunner.server")


@dataclasses.dataclass
class ServerConfig:
    model: str
    # the names clients may pass as `model` (default: `model`); the first is the one reported
    served_model_name: str | list[str] | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 4096                  # waiting requests beyond this get 503
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413
    shutdown_timeout_s: float = 10.0       # in-flight requests get this long after SIGINT/SIGTERM
    # sampling defaults: "auto" = the model's generation_config.json, "vllm" = none, or a directory's
    generation_config: str = "auto"
    allowed_origins: tuple[str, ...] = ("*",)  # CORS, as vLLM's --allowed-origins (and methods, headers)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    uvicorn_log_level: str = "warning"
    log_requests: bool = False  # one INFO line per request: id, prompt lengths, sampling params
    chat_template: str | None = None  # --chat-template: a Jinja template (text) for requests that give none
    enable_auto_tool_choice: bool = False  # tool_choice "auto" reads calls with tool_call_parser
    tool_call_parser: str | None = None    # hermes, llama3_json, mistral, qwen3_xml
    lora_modules: tuple[LoRAModulePath, ...] = ()  # adapters loaded at start-up, ids 1, 2, ... (the engine
                                                   # needs enable_lora)

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice: needs --tool-call-parser "
                             f"({', '.join(TOOL_PARSERS)})")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # a ValueError lists the valid names
        self.lora_modules = tuple(self.lora_modules)
        names = [module.name for module in self.lora_modules]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"--lora-modules: the name {name!r} is given twice; each adapter needs its own")
            if name in self.model_names:
                raise ValueError(f"--lora-modules: {name!r} is the served model's name; an adapter needs its own")

    @property
    def model_names(self) -> list[str]:
        names = self.served_model_name
        return [names] if isinstance(names, str) else list(names or [self.model])

    @property
    def model_name(self) -> str:
        return self.model_names[0]


class ServerState:
    """What the endpoints share: the config, the metrics and, once warm, the AsyncLLM."""

    def __init__(self, config: ServerConfig, llm=None):
        self.config = config
        self.metrics = ServerMetrics(config.model_name)
        self.async_llm: AsyncLLM | None = None
        self.sampling_defaults: dict = {}  # SamplingParams fields a request leaves unset
        self.created = int(time.time())
        self.tool_parser = get_tool_parser(config.tool_call_parser) if config.enable_auto_tool_choice else None
        self.adapters = ServedAdapters()
        if llm is not None:
            self.set_llm(llm)

    def set_llm(self, llm) -> None:
        """Serve ``llm``, once the --lora-modules adapters are loaded (ValueError: one cannot be)."""
        self.sampling_defaults = _sampling_defaults(self.config.generation_config, llm)
        self.adapters.load_at_start(llm, self.config.lora_modules)
        self.async_llm = AsyncLLM(llm)
        self.metrics.attach(self.async_llm.engine_loop)

    @property
    def engine_failure(self) -> BaseException | None:
        """Why the engine loop died, or None while it serves."""
        return None if self.async_llm is None else self.async_llm.engine_loop.failure

    def ready(self) -> AsyncLLM:
        if self.engine_failure is not None:
            raise RequestError("the engine failed; the server is exiting", status=503, kind="service_unavailable")
        if self.async_llm is None:
            raise RequestError("the model is still loading", status=503, kind="service_unavailable",
                               headers={"Retry-After": "5"})
        return self.async_llm


# ---------------------------------------------------------------------------------------- the app
class _JSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a body that echoes a client's lone surrogate (``"\\ud800"``) still
    encodes, where Starlette's UTF-8 rendering would fail and turn a 400 or 404 into a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _answering_errors(endpoint):
    """Turn every failure of ``endpoint`` into a response here. Starlette re-raises what reaches its
    catch-all handler after answering, and uvicorn then closes the connection: a client reusing it
    for its next request would see a reset."""
    @functools.wraps(endpoint)
    async def answered(*args, **kwargs):
        try:
            return await endpoint(*args, **kwargs)
        except RequestError as err:
            return _http_error_response(err)
        except (EngineLoopClosed, EngineLoopDied) as err:
            return _http_error_response(_unavailable(err))
        except Exception as err:  # an engine failure: this request only
            logger.exception("request failed")
            return _http_error_response(RequestError(f"{type(err).__name__}: {err}", status=500, kind="internal_error"))
    return answered


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="jaxrunner OpenAI-compatible server", docs_url=None, redoc_url=None,
                  default_response_class=_JSONResponse)
    app.state.server = state
    config = state.config
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                       allow_credentials=config.allow_credentials)

    @app.exception_handler(RequestError)
    async def _request_error(_, err: RequestError):
        return _http_error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return _http_error_response(RequestError(str(err.detail), status=err.status_code, kind=kind))

    @app.exception_handler(Exception)
    async def _internal_error(_, err: Exception):  # an engine failure: this request only
        logger.exception("request failed")
        return _http_error_response(RequestError(f"{type(err).__name__}: {err}", status=500, kind="internal_error"))

    @app.get("/health")
    async def health():
        return Response(status_code=200 if state.async_llm is not None and state.engine_failure is None else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        _check_key(state, request)
        cards = [{"id": name, "object": "model", "created": state.created, "owned_by": "jaxrunner",
                  "root": state.config.model, "parent": None} for name in state.config.model_names]
        cards += state.adapters.cards(state.config.model_name, state.created)
        if state.async_llm is not None:
            for card in cards:
                card["max_model_len"] = state.async_llm.engine.max_model_len
        return {"object": "list", "data": cards}

    @app.get("/version")
    async def version():
        return {"version": jaxrunner.__version__}

    @app.post("/tokenize")
    @_answering_errors
    async def tokenize(request: Request):
        body = protocol.parse(protocol.TokenizeRequest, await _read_body(state, request))
        _check_model(state, body.model)
        return _tokenize(state, body)

    @app.post("/detokenize")
    @_answering_errors
    async def detokenize(request: Request):
        body = protocol.parse(protocol.DetokenizeRequest, await _read_body(state, request))
        _check_model(state, body.model)
        engine = state.ready().engine
        bad = [t for t in body.tokens if not 0 <= t < engine.executor.vocab_size]
        if bad:
            raise RequestError(f"tokens: token id {bad[0]} outside the vocabulary [0, {engine.executor.vocab_size})",
                               param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions", openapi_extra=_body_schema(protocol.CompletionRequest))
    @_answering_errors
    async def completions(request: Request):
        body = await _read_body(state, request)
        return await _completions(state, request, protocol.parse(protocol.CompletionRequest, body))

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(protocol.ChatCompletionRequest))
    @_answering_errors
    async def chat_completions(request: Request):
        body = await _read_body(state, request)
        return await _chat_completions(state, request, protocol.parse(protocol.ChatCompletionRequest, body))

    @app.post("/v1/load_lora_adapter", openapi_extra=_body_schema(protocol.LoadLoRAAdapterRequest))
    @_answering_errors
    async def load_lora_adapter(request: Request):
        body = protocol.parse(protocol.LoadLoRAAdapterRequest, await _read_body(state, request))
        llm = _lora_llm(state)
        await state.adapters.load(llm, body.lora_name, body.lora_path, state.config.model_names)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", openapi_extra=_body_schema(protocol.UnloadLoRAAdapterRequest))
    @_answering_errors
    async def unload_lora_adapter(request: Request):
        body = protocol.parse(protocol.UnloadLoRAAdapterRequest, await _read_body(state, request))
        await state.adapters.unload(_lora_llm(state), body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    app.openapi = functools.partial(_openapi_with_bodies, app)
    return app


def _body_schema(model) -> dict:
    """The endpoint's documented body: the endpoints read the body themselves (our errors, not
    FastAPI's 422s), so FastAPI cannot see it; clients and fuzzers read it from /openapi.json."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _openapi_with_bodies(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, definitions = pydantic.json_schema.models_json_schema(
            [(model, "validation") for model in (protocol.CompletionRequest, protocol.ChatCompletionRequest,
                                                 protocol.LoadLoRAAdapterRequest, protocol.UnloadLoRAAdapterRequest)],
            ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions["$defs"])
        app.openapi_schema = schema
    return app.openapi_schema


def _unavailable(err: EngineLoopClosed | EngineLoopDied) -> RequestError:
    return RequestError(str(err), status=503, kind="service_unavailable")


def _http_error_response(err: RequestError) -> JSONResponse:
    return _JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _check_key(state: ServerState, request: Request) -> None:
    key = state.config.api_key
    sent = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
    if key is not None and not hmac.compare_digest(sent, f"Bearer {key}".encode()):  # constant time
        raise RequestError("missing or wrong API key (send 'Authorization: Bearer <key>')", status=401,
                           kind="authentication_error")


async def _read_body(state: ServerState, request: Request):
    """The JSON body, after the key check; 413 over the size limit (read to the end, never stored,
    so the client sees the answer rather than a broken pipe), 400 when it is not JSON."""
    _check_key(state, request)
    limit, size, chunks = state.config.max_body_bytes, 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise RequestError(f"request body of {size} bytes exceeds the limit of {limit} bytes", status=413)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON ({err})") from None
    except RecursionError:
        raise RequestError("the request body nests JSON too deeply") from None


def _check_model(state: ServerState, model: str | None) -> LoRARequest | None:
    """The adapter a request's ``model`` names (None: the base model); 404 for a name not served."""
    if model is None or model in state.config.model_names:
        return None
    adapter = state.adapters.get(model)
    if adapter is None:
        served = ", ".join(f"`{name}`" for name in state.config.model_names + state.adapters.names())
        raise RequestError(f"model: the model `{model}` does not exist; this server serves {served}", status=404,
                           param="model", kind="not_found_error")
    return adapter


def _lora_llm(state: ServerState):
    """The LLM whose adapters the load/unload endpoints change; 400 when it serves none."""
    llm = state.ready().llm
    if llm.engine.adapters is None:
        raise RequestError("LoRA adapters are not enabled on this server; start it with --enable-lora")
    return llm


def _tokenize(state: ServerState, body) -> dict:
    """vLLM's /tokenize: a prompt, or messages through the chat template."""
    async_llm = state.ready()
    engine = async_llm.engine
    if engine.tokenizer is None:
        raise RequestError("this model has no tokenizer", param="prompt")
    if body.messages is not None:
        tokens = _chat_prompt(state, async_llm, body)["prompt_token_ids"]
    elif body.prompt is not None:
        try:
            check_unicode(body.prompt)
        except ValueError as err:
            raise RequestError(str(err), param="prompt") from None
        tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise RequestError("prompt: give `prompt` or `messages`", param="prompt")
    return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": list(tokens)}


def _chat_prompt(state: ServerState, async_llm: AsyncLLM, body, continue_final_message: bool = False) -> dict:
    """The messages of a chat or /tokenize body through the chat template (the request's, else
    --chat-template's, else the model's); a 400 names the field at fault."""
    try:
        return async_llm.llm.chat_prompt(
            body.conversation(), body.add_generation_prompt, tools=body.tools,
            chat_template=body.chat_template or state.config.chat_template,
            chat_template_kwargs=body.chat_template_kwargs, continue_final_message=continue_final_message)
    except ValueError as err:
        raise RequestError(str(err), param=protocol.field_of(str(err), {"prompt": "messages"})) from None


def _sampling_defaults(source: str, llm) -> dict:
    """SamplingParams fields the model's generation config sets ("auto"), none ("vllm"), or those of the
    generation_config.json in a directory, as vLLM's --generation-config."""
    if source == "vllm":
        return {}
    if source == "auto":
        return sampling_defaults(llm.engine.model.generation_config)
    return sampling_defaults(read_generation_config(source))


# ---------------------------------------------------------------------------------------- requests
@dataclasses.dataclass
class _Call:
    """One HTTP request's engine requests: ``streams[i]`` is choice ``i`` (prompt-major, then sample)."""

    streams: list[RequestStream]
    timers: list[RequestTimer]
    prompt_lengths: list[int]  # one per prompt, not per sample
    request_id: str
    created: int
    model: str

    def abort(self) -> None:
        """Stop every choice still running; each counts as finished with reason "abort"."""
        for stream, timer in zip(self.streams, self.timers):
            if not stream.finished:
                timer.aborted()
            stream.abort()


def _start(state: ServerState, prompts: list, params, n: int, prefix: str, max_tokens_field: str,
           max_tokens: int | None, renames: dict | None = None, lora_request: LoRARequest | None = None) -> _Call:
    """Validate every prompt, check the queue, then queue every sample of every prompt (with the
    adapter ``lora_request``, None: the base model). ``max_tokens`` is what the client asked for
    under ``max_tokens_field`` (None: not given)."""
    async_llm = state.ready()
    loop = async_llm.engine_loop
    renames = {**(renames or {}), "lora_request": "model"}
    valid = []
    for prompt in prompts:
        try:
            request = loop.validate(prompt, params, lora_request)
        except ValueError as err:
            raise RequestError(str(err), param=protocol.field_of(str(err), renames)) from None
        protocol.check_max_tokens(max_tokens_field, max_tokens, len(request.prompt_token_ids),
                                  async_llm.engine.max_model_len)
        valid.append(request)
    _admit(state, loop, len(valid) * n)
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    if state.config.log_requests:
        logger.info("request %s: prompt tokens %s, n=%d, %s%s", request_id, [len(r.prompt_token_ids) for r in valid],
                    n, params, "" if lora_request is None else f", adapter {lora_request.lora_name}")
    streams, timers = [], []
    for request in valid:
        for index in range(n):
            sample = dataclasses.replace(request, sampling_params=protocol.sample_params(params, index))
            timers.append(RequestTimer(state.metrics, len(request.prompt_token_ids),
                                       min(params.max_tokens, async_llm.engine.max_model_len)))
            streams.append(RequestStream(loop, sample, None))
    return _Call(streams, timers, [len(r.prompt_token_ids) for r in valid], request_id, int(time.time()),
                 state.config.model_name)


def _admit(state: ServerState, loop, new_requests: int) -> None:
    """Requests beyond the engine's sequence slots wait; more than ``max_queue`` waiting is a 503 (try
    again), and a call that could not be taken even by an idle server is a 400 (retrying never helps).
    Counted from the loop's own request count, which is current when a burst arrives, not from the
    step statistics, which lag until the next step."""
    slots, limit = loop.sequence_slots(), state.config.max_queue
    if new_requests > slots + limit:
        raise RequestError(f"n: this request needs {new_requests} sequences (prompts x n); the server takes at "
                           f"most {slots + limit} at once (max_num_seqs {slots} + --max-queue {limit})", param="n")
    in_engine = loop.num_requests()
    if in_engine + new_requests - slots > limit:
        raise RequestError(f"server busy: {max(0, in_engine - slots)} requests waiting (--max-queue {limit})",
                           status=503, kind="service_unavailable", headers={"Retry-After": "1"})


async def _adapter_in_memory(state: ServerState, adapter: LoRARequest | None) -> None:
    """Read an adapter the engine dropped from host memory (``--max-cpu-loras``) on a thread, so
    that validating the request, on the event loop, finds it there."""
    if adapter is None:
        return
    try:
        await asyncio.to_thread(state.ready().engine.resolve_adapter, adapter)
    except ValueError as err:
        raise RequestError(str(err), param="model") from None


async def _completions(state: ServerState, request: Request, body: protocol.CompletionRequest):
    adapter = _check_model(state, body.model)
    await _adapter_in_memory(state, adapter)
    max_model_len = state.ready().engine.max_model_len
    protocol.check_prompt_logprobs(body)
    params = protocol.sampling_params(body, body.max_tokens, body.logprobs, max_model_len, state.sampling_defaults)
    if body.echo and body.logprobs is not None:  # the echoed prompt's logprobs are its prompt logprobs
        params = dataclasses.replace(params, prompt_logprobs=max(body.logprobs, params.prompt_logprobs or 0))
    renames = {"prompt_token_ids": "prompt"}
    if body.response_format is not None:
        renames["structured_outputs"] = "response_format"
    call = _start(state, protocol.completion_prompts(body), params, body.n, "cmpl", "max_tokens", body.max_tokens,
                  renames=renames, lora_request=adapter)
    call.model = body.model or call.model  # the name the client used, of those served
    tokenizer = state.async_llm.engine.tokenizer
    if body.stream:
        return _event_stream(call, _completion_chunks(call, body, tokenizer))
    finals = await _final_outputs(call, request)
    choices = []
    for i, out in enumerate(finals):
        completion = out.outputs[0]
        echo_text, echo_logprobs = _echo(body, out, tokenizer)
        choices.append({"index": i, "text": echo_text + completion.text, "finish_reason": completion.finish_reason,
                        "stop_reason": completion.stop_reason,
                        "logprobs": joined(echo_logprobs,
                                           completion_logprobs(completion.logprobs, body.logprobs, tokenizer)),
                        "prompt_logprobs": _prompt_logprobs(body, out, tokenizer)})
    return {"id": call.request_id, "object": "text_completion", "created": call.created, "model": call.model,
            "choices": choices, "usage": _usage(call, finals)}


def _echo(body: protocol.CompletionRequest, out, tokenizer) -> tuple[str, dict | None]:
    """What ``echo`` puts before the completion: the prompt's text and, with logprobs, its tokens'."""
    if not body.echo:
        return "", None
    text = out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)
    if body.logprobs is None:
        return text, None
    return text, echo_completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, body.logprobs, tokenizer)


def _prompt_logprobs(body, out, tokenizer):
    return prompt_logprobs_json(out.prompt_logprobs, tokenizer) if body.prompt_logprobs is not None else None


async def _chat_completions(state: ServerState, request: Request, body: protocol.ChatCompletionRequest):
    adapter = _check_model(state, body.model)
    await _adapter_in_memory(state, adapter)
    async_llm = state.ready()
    protocol.check_prompt_logprobs(body)
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, state.tool_parser)
    prompt = _chat_prompt(state, async_llm, body, body.continue_final_message)
    max_tokens_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(body, max_tokens_field)
    protocol.check_top_logprobs(body)
    top = body.top_logprobs or 0
    params = protocol.sampling_params(body, max_tokens, max(top, 1) if body.logprobs else None,
                                      async_llm.engine.max_model_len, state.sampling_defaults)
    params, renames = _with_tool_constraint(params, tools, body)
    call = _start(state, [prompt], params, body.n, "chatcmpl", max_tokens_field, max_tokens, renames=renames,
                  lora_request=adapter)
    call.model = body.model or call.model
    tokenizer = async_llm.engine.tokenizer
    top = top if body.logprobs else None
    if body.stream:
        return _event_stream(call, _chat_chunks(call, body.include_usage, top, tokenizer, tools))
    finals = await _final_outputs(call, request)
    choices = []
    for i, out in enumerate(finals):
        message, finish_reason = reply(tools, out.outputs[0].text, out.outputs[0].finish_reason)
        choices.append({"index": i, "message": message, "finish_reason": finish_reason,
                        "stop_reason": out.outputs[0].stop_reason,
                        "logprobs": chat_logprobs(out.outputs[0].logprobs, top, tokenizer),
                        "prompt_logprobs": _prompt_logprobs(body, out, tokenizer)})
    return {"id": call.request_id, "object": "chat.completion", "created": call.created, "model": call.model,
            "choices": choices, "usage": _usage(call, finals)}


# the parsers whose call markers are special tokens: their text is decoded with special tokens kept
_PARSERS_READING_SPECIAL_TOKENS = ("llama3_json", "mistral")


def _with_tool_constraint(params, tools: ToolPlan | None, body) -> tuple:
    """The request's SamplingParams with what its tool choice needs, and the renames that make an
    engine error name the request's own field."""
    renames = {"logprobs": "top_logprobs", "prompt": "messages", "prompt_token_ids": "messages"}
    if body.response_format is not None:
        renames["structured_outputs"] = "response_format"
    if tools is None:
        return params, renames
    constraint = tools.constraint
    if constraint is not None:
        if params.structured_outputs is not None:
            raise RequestError(f"tool_choice: {body.tool_choice!r} is served by structured output, so it cannot be "
                               "combined with response_format or structured_outputs", param="tool_choice")
        params = dataclasses.replace(params, structured_outputs=constraint)
        renames["structured_outputs"] = "tools"
    if tools.parser is not None and tools.parser.name in _PARSERS_READING_SPECIAL_TOKENS:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params, renames


async def _final_outputs(call: _Call, request: Request) -> list:
    """Every choice's last output; a client that disconnects first aborts them all."""
    finals: list = [None] * len(call.streams)
    gone = asyncio.ensure_future(_disconnected(request))
    work = asyncio.ensure_future(_drain(call, finals))
    try:
        await asyncio.wait({gone, work}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise RequestError("client closed the request", status=499)
        return _engine_result(work)
    finally:
        gone.cancel()
        work.cancel()
        call.abort()


async def _drain(call: _Call, finals: list) -> list:
    async for index, output in _merged(call):
        finals[index] = output
    return finals


def _engine_result(work: asyncio.Future):
    try:
        return work.result()
    except ValueError as err:  # refused by the engine when added (e.g. can never fit the KV pool)
        raise RequestError(str(err)) from None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _merged(call: _Call):
    """``(choice index, output)`` from every stream of the call as outputs arrive; metrics recorded."""
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(call.streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                output = task.result()
                call.timers[index].output(len(output.outputs[0].token_ids))
                if output.finished:
                    call.timers[index].finished(output)
                else:
                    pending[asyncio.ensure_future(anext(call.streams[index]))] = index
                yield index, output
    finally:
        for task in pending:
            task.cancel()


def _usage(call: _Call, finals: list) -> dict:
    prompt = sum(call.prompt_lengths)
    completion = sum(len(out.outputs[0].token_ids) for out in finals if out is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ---------------------------------------------------------------------------------------- streaming
def _event_stream(call: _Call, chunks) -> StreamingResponse:
    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except RequestError as err:
            yield f"data: {json.dumps(err.body())}\n\n"
        except (EngineLoopClosed, EngineLoopDied) as err:  # shutting down, or the engine failed
            yield f"data: {json.dumps(_unavailable(err).body())}\n\n"
        except Exception as err:  # an engine error mid-stream: tell this client, keep serving others
            yield f"data: {json.dumps(RequestError(str(err), status=500, kind='internal_error').body())}\n\n"
        finally:
            call.abort()  # a disconnected client lands here too (the response task is cancelled)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _completion_chunks(call: _Call, body: protocol.CompletionRequest, tokenizer):
    finals: list = [None] * len(call.streams)
    seen = [0] * len(call.streams)
    logprobs = body.logprobs
    async for index, output in _merged(call):
        echo_text, echo_logprobs = _echo(body, output, tokenizer) if finals[index] is None else ("", None)
        finals[index] = output
        completion = output.outputs[0]
        new = (completion.logprobs or [])[seen[index]:]
        new_ids = completion.token_ids[seen[index]:]
        seen[index] = len(completion.token_ids)
        yield _chunk(call, "text_completion", [{
            "index": index, "text": echo_text + output.delta_text, "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
            "logprobs": joined(echo_logprobs, completion_logprobs(new, logprobs, tokenizer, new_ids))
            if logprobs is not None else None}])
    if body.include_usage:
        yield {**_chunk(call, "text_completion", []), "usage": _usage(call, finals)}


async def _chat_chunks(call: _Call, include_usage: bool, top: int | None, tokenizer, tools: ToolPlan | None):
    finals: list = [None] * len(call.streams)
    seen = [0] * len(call.streams)
    deltas = [ToolDeltas(tools) for _ in call.streams]
    async for index, output in _merged(call):
        if finals[index] is None:  # the role goes with the first token, as vLLM's: a client's TTFT is honest
            yield _chunk(call, "chat.completion.chunk", [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                           "logprobs": None, "finish_reason": None}])
        finals[index] = output
        completion = output.outputs[0]
        new = (completion.logprobs or [])[seen[index]:]
        new_ids = completion.token_ids[seen[index]:]
        seen[index] = len(completion.token_ids)
        pieces = deltas[index].feed(output.delta_text, output.finished) or [{}]
        for number, delta in enumerate(pieces):
            last = number == len(pieces) - 1
            yield _chunk(call, "chat.completion.chunk", [{
                "index": index, "delta": delta,
                "logprobs": chat_logprobs(new, top, tokenizer, new_ids) if number == 0 else None,
                "finish_reason": deltas[index].finish_reason(completion.finish_reason) if last else None}])
    if include_usage:
        yield {**_chunk(call, "chat.completion.chunk", []), "usage": _usage(call, finals)}


def _chunk(call: _Call, kind: str, choices: list) -> dict:
    return {"id": call.request_id, "object": kind, "created": call.created, "model": call.model, "choices": choices}
