"""OpenAI request bodies (pydantic) and their mapping onto ``SamplingParams``.

The fields are OpenAI's (``max_tokens``/``max_completion_tokens``, ``temperature``, ``top_p``, ``n``,
``stop``, ``seed``, ``logprobs``/``top_logprobs``, the penalties, ``logit_bias``, ``stream_options``)
plus vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``skip_special_tokens``, ``allowed_token_ids``, ``bad_words``,
``include_stop_str_in_output``). A field either API defines that this server does not apply is
refused by name (``UNBUILT``), so no client gets a 200 that silently ignored what it asked for;
fields neither API defines are ignored, as OpenAI's server does, with a log line.
Every rejection is a ``RequestError`` that carries the HTTP status and the field it names.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Callable, Literal, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from jaxrunner.sampling_params import SamplingParams, StructuredOutputsParams


class RequestError(Exception):
    """A request the server refuses: OpenAI's error shape, with an HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.kind, self.headers = message, status, param, kind, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    # structured output: OpenAI's response_format, or vLLM's structured_outputs (StructuredOutputsParams)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    prompt_logprobs: int | None = None         # per prompt token, as vLLM returns them
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False  # the prompt's text (and, with logprobs, its tokens' logprobs) before the completion


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    # an agent's history: passed to the chat template as given
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self, index: int) -> str:
        """The message's text; content parts must be ``{"type": "text", "text": ...}``."""
        if isinstance(self.content, str):
            return self.content
        if self.content is None:
            raise RequestError(f"messages[{index}].content: missing", param=f"messages.{index}.content")
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{index}].content: only text parts are supported, got "
                                   f"{part.get('type')!r}", param=f"messages.{index}.content")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None

    def conversation(self) -> list[dict]:
        """The messages for the chat template; an assistant turn that only calls tools has no text."""
        turns = []
        for index, message in enumerate(self.messages):
            text = "" if message.content is None and message.tool_calls else message.text(index)
            extras = {k: v for k in _MESSAGE_EXTRAS if (v := getattr(message, k)) is not None}
            turns.append({"role": message.role, "content": text, **extras})
        return turns


_MESSAGE_EXTRAS = ("name", "tool_calls", "tool_call_id", "reasoning_content")


# Fields OpenAI's or vLLM's API defines that this server does not apply: refused when a request uses
# them (the predicate says whether the value asks for something), never silently ignored.
UNBUILT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "guided_json": (lambda v: v is not None, "use structured_outputs: {\"json\": ...} (vLLM's current name)"),
    "guided_regex": (lambda v: v is not None, "use structured_outputs: {\"regex\": ...} (vLLM's current name)"),
    "guided_choice": (lambda v: v is not None, "use structured_outputs: {\"choice\": ...} (vLLM's current name)"),
    "guided_grammar": (lambda v: v is not None, "use structured_outputs: {\"grammar\": ...} (vLLM's current name)"),
    "guided_decoding_backend": (lambda v: v is not None, "the structured-output backend is llguidance, not selectable"),
    "functions": (lambda v: bool(v), "the legacy `functions` field is not supported; use tools"),
    "function_call": (lambda v: v not in (None, "none"), "the legacy `function_call` field is not supported; use tool_choice"),
    "best_of": (lambda v: v not in (None, 1), "best_of is not supported (vLLM dropped it too); use n"),
    "use_beam_search": (lambda v: bool(v), "beam search is not supported"),
    "length_penalty": (lambda v: v not in (None, 1, 1.0), "length_penalty applies to beam search, not supported"),
    "echo": (lambda v: bool(v), "echo (prepending the last message) is not supported on chat completions"),
    "suffix": (lambda v: bool(v), "suffix (insertion) is not supported"),
    "audio": (lambda v: v is not None, "audio output is not supported"),
    "modalities": (lambda v: v not in (None, ["text"]), "only text output is supported"),
    "prediction": (lambda v: v is not None, "predicted outputs are not supported"),
}
_logger = logging.getLogger("jaxrunner.server")
_ignored_logged: set[str] = set()


def _refuse_unbuilt(model: type[BaseModel], body: dict) -> None:
    """A 400 naming the first field we do not apply; a log line for a field neither API defines."""
    for name, value in body.items():
        if name in UNBUILT and name not in model.model_fields:
            asks, why = UNBUILT[name]
            if asks(value):
                raise RequestError(f"{name}: {why}", param=name)
        elif name not in model.model_fields and name not in _ignored_logged:
            _ignored_logged.add(name)
            _logger.info("ignoring the request field %r (not an OpenAI or vLLM field); logged once", name)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def conversation(self) -> list[dict]:
        return ChatCompletionRequest(messages=self.messages).conversation()


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter: a PEFT adapter directory, served under ``lora_name``. Any other
    field is a 400 naming it; vLLM's ``load_inplace`` only as false (unload, then load)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False

    @pydantic.field_validator("load_inplace")
    @classmethod
    def _not_in_place(cls, value: bool) -> bool:
        if value:
            raise ValueError("replacing a loaded adapter in place is not supported; unload it, then load it again")
        return value


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter, by name (any other field, ``lora_int_id`` too, is a 400)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """Validate a decoded JSON body; the error names the first bad field."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    _refuse_unbuilt(model, body)
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])  # e.g. prompt.list[int].0 for a union member
        field = str(first["loc"][0]) if first["loc"] else None
        raise RequestError(f"{where}: {first['msg']}", param=field) from None


def completion_prompts(request: CompletionRequest) -> list:
    """The request's prompts as engine prompts (text or token ids)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt: empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


def sampling_params(request: _Sampling, max_tokens: int | None, logprobs: int | None,
                    max_model_len: int, defaults: dict | None = None) -> SamplingParams:
    """The request's SamplingParams (one sample; ``n`` is served as n requests). ``defaults`` (the
    model's generation config: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens)
    fill what the request leaves unset, as in vLLM's server."""
    if request.logit_bias and "logit_bias" not in _SAMPLING_FIELDS:
        raise RequestError("logit_bias: not supported by this server", param="logit_bias")
    defaults = {**_PLAIN_DEFAULTS, **(defaults or {})}
    chosen = {name: defaults[name] if getattr(request, name) is None else getattr(request, name)
              for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    room_default = max_model_len if defaults.get("max_tokens") is None else min(defaults["max_tokens"], max_model_len)
    options = dict(
        n=1, temperature=chosen["temperature"], top_p=chosen["top_p"],
        top_k=-1 if chosen["top_k"] in (None, 0, -1) else chosen["top_k"],
        min_p=chosen["min_p"], repetition_penalty=chosen["repetition_penalty"],
        presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
        seed=request.seed, max_tokens=room_default if max_tokens is None else max_tokens,
        min_tokens=request.min_tokens, stop=request.stop, stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos, logprobs=logprobs, skip_special_tokens=request.skip_special_tokens,
        allowed_token_ids=request.allowed_token_ids, bad_words=request.bad_words,
        include_stop_str_in_output=request.include_stop_str_in_output, prompt_logprobs=request.prompt_logprobs,
        truncate_prompt_tokens=request.truncate_prompt_tokens)
    if request.logit_bias:
        options["logit_bias"] = _logit_bias(request.logit_bias)
    options["structured_outputs"] = structured_outputs(request)
    if request.n < 1:
        raise RequestError(f"n: {request.n} must be at least 1", param="n")
    try:
        return SamplingParams(**options)
    except ValueError as err:
        raise RequestError(str(err), param=field_of(str(err))) from None


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def structured_outputs(request: _Sampling) -> StructuredOutputsParams | None:
    """``response_format`` (OpenAI) or ``structured_outputs`` (vLLM) as the engine's constraint; a
    400 names the field. The grammar itself is compiled when the request is validated."""
    if request.response_format is not None and request.structured_outputs is not None:
        raise RequestError("response_format: give response_format or structured_outputs, not both",
                           param="response_format")
    if request.structured_outputs is not None:
        try:
            return StructuredOutputsParams.from_dict(request.structured_outputs)
        except (ValueError, TypeError) as err:
            raise RequestError(str(err), param="structured_outputs") from None
    return _response_format(request.response_format)


def _response_format(value: dict | None) -> StructuredOutputsParams | None:
    kind = None if value is None else value.get("type")
    if kind in (None, "text"):
        if value is not None and kind is None:
            raise RequestError(f"response_format.type: missing; one of {', '.join(RESPONSE_FORMATS)}",
                               param="response_format")
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise RequestError(f"response_format.type: {kind!r} is not one of {', '.join(RESPONSE_FORMATS)}",
                           param="response_format")
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise RequestError("response_format.json_schema.schema: a JSON schema object is required",
                           param="response_format")
    return StructuredOutputsParams(json=schema)


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """JSON object keys are strings: each must spell a token id."""
    parsed = {}
    for key, value in bias.items():
        try:
            parsed[int(key)] = value
        except ValueError:
            raise RequestError(f"logit_bias: keys must be token ids (integers), got {key!r}",
                               param="logit_bias") from None
    return parsed


def check_max_tokens(field: str, max_tokens: int | None, prompt_tokens: int, max_model_len: int) -> None:
    """A prompt and the tokens asked for must fit the context, as vLLM's server checks (the Python API
    lowers max_tokens instead)."""
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        raise RequestError(f"{field}: this model's maximum context length is {max_model_len} tokens; the prompt "
                           f"has {prompt_tokens}, so {field} can be at most {max_model_len - prompt_tokens}, "
                           f"got {max_tokens}", param=field)


def check_top_logprobs(request: "ChatCompletionRequest") -> None:
    """As vLLM: top_logprobs needs logprobs=true and is at least 0."""
    top = request.top_logprobs
    if top is None:
        return
    if top < 0:
        raise RequestError(f"top_logprobs: must be at least 0, got {top}", param="top_logprobs")
    if not request.logprobs:
        raise RequestError("top_logprobs: needs logprobs set to true", param="top_logprobs")


def check_prompt_logprobs(request: _Sampling) -> None:
    """As vLLM: prompt logprobs come with a whole response, not a stream."""
    if request.prompt_logprobs is not None and request.stream:
        raise RequestError("prompt_logprobs: not available when stream is true", param="prompt_logprobs")


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n samples: seed + i when the caller fixed one."""
    return params if index == 0 else dataclasses.replace(params, seed=None if params.seed is None
                                                         else params.seed + index)


_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_PLAIN_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                   "max_tokens": None}


def field_of(message: str, renames: dict[str, str] | None = None) -> str | None:
    """The request field an engine error names: ``SamplingParams.logprobs=21: ...`` -> ``logprobs``,
    ``prompt[3]: ...`` -> ``prompt``; ``renames`` maps a SamplingParams name to this endpoint's field."""
    match = re.match(r"(?:SamplingParams\.)?([A-Za-z_]\w*)", message)
    if not match:
        return None
    return (renames or {}).get(match.group(1), match.group(1))
