"""LLM: the vLLM-shaped front door (``generate``, ``chat``, ``stream``) over one engine (or data-parallel replicas)."""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
from typing import Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from jaxrunner.config import DEFAULT_MODEL, EngineConfig
from jaxrunner.engine.engine import check_unicode
from jaxrunner.engine.loop import EngineLoop
from jaxrunner.engine_factory import create_engine
from jaxrunner.models.flax_nnx import check_protocol
from jaxrunner.models.loading.gguf import load_gguf_tokenizer
from jaxrunner.models.loading.hf import load_hf_tokenizer, sampling_defaults
from jaxrunner.lora_request import LoRARequest
from jaxrunner.outputs import RequestOutput
from jaxrunner.parallel import mesh as meshes
from jaxrunner.runner import weights
from jaxrunner.runner.preflight import check_before_loading
from jaxrunner.sampling_params import SamplingParams

logger = logging.getLogger("jaxrunner")


class LLM:
    """Load a model, warm it up, and serve batches of prompts.

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, tokenizer: str | None = None, **engine_options):
        """``engine_options`` are EngineConfig's fields, e.g. ``dtype``, ``max_num_seqs``,
        ``tensor_parallel_size`` (devices splitting the model) and ``data_parallel_size`` (replicas),
        or vLLM's names for the same knobs (``gpu_memory_utilization``, ``block_size``,
        ``enforce_eager``; see ``VLLM_NAMES``). ``tokenizer``: a directory to load the tokenizer
        from instead of the model's. Every option is checked before any weight is read."""
        config = EngineConfig(model=model, **_engine_options(engine_options))
        tokenizer_override = _load_tokenizer(tokenizer) if tokenizer is not None else None
        check_before_loading(config)
        self._attach(create_engine(config))
        if tokenizer_override is not None:
            _set_tokenizer(self.engine, tokenizer_override)

    def _attach(self, engine) -> None:
        self.engine = engine

    @classmethod
    def from_params(cls, params, config, tokenizer=None, **engine_options) -> "LLM":
        """Serve an in-memory params pytree (the leaves ``LLM.params`` returns) with no checkpoint.

        ``config``: the model's HF config (a ``config.json`` dict or a ``transformers`` config);
        ``tokenizer``: a tokenizer object, a directory to load one from, or None (prompts are then
        given as ``{"prompt_token_ids": [...]}``). Arrays already on the engine's devices and
        shardings are served in place, with no copy; others are copied device to device. The
        dtype is the params' own (float32 or bfloat16)."""
        return cls._in_memory(lambda mesh, tok: weights.model_from_params(params, config, tok, mesh),
                              weights.params_dtype(params), tokenizer, engine_options)

    @classmethod
    def from_nnx(cls, module, tokenizer=None, **engine_options) -> "LLM":
        """Serve a Flax NNX module that follows the protocol of ``jaxrunner.models.flax_nnx``
        (``config``, ``embed``, ``layers`` called with the engine's ``attend``, ``norm``, ``logits``),
        with the paged cache, kernels and warm-up of the built-in models. ``LLM.params`` is then the
        module's ``nnx.State``."""
        from flax import nnx  # lazy: flax is heavy, and only NNX modules need it

        check_protocol(module)
        dtype = weights.params_dtype(nnx.state(module))
        return cls._in_memory(lambda mesh, tok: weights.model_from_nnx(module, tok, mesh), dtype, tokenizer,
                              engine_options)

    @classmethod
    def _in_memory(cls, build_model, dtype: str, tokenizer, engine_options: dict) -> "LLM":
        """An LLM over a model built in memory by ``build_model(mesh of the first replica, tokenizer)``;
        the engine options are checked before it is built."""
        if engine_options.setdefault("dtype", dtype) != dtype:
            raise ValueError(f"dtype={engine_options['dtype']!r}: the params are {dtype}; cast them, or leave dtype out")
        config = EngineConfig(model=weights.IN_MEMORY, **_engine_options(engine_options))
        meshes.check_device_count(config.tensor_parallel_size, config.data_parallel_size)
        first_row = meshes.replica_meshes(meshes.build_mesh(config.tensor_parallel_size,
                                                            config.data_parallel_size))[0]
        if isinstance(tokenizer, str):
            tokenizer = load_hf_tokenizer(tokenizer)
        model = build_model(first_row, tokenizer)
        llm = cls.__new__(cls)
        llm._attach(create_engine(config, model))
        return llm

    @property
    def params(self):
        """The params pytree being served: read it, change it, hand it to ``update_weights``."""
        return self.engine.params

    def update_weights(self, params, abort_in_flight: bool = False) -> None:
        """Serve ``params`` from the next step on, compiling nothing (same leaves, shapes and dtypes
        as ``LLM.params``; a mismatch is a ``ValueError`` naming the leaf, and the old weights stay).
        Requests in flight continue on the new weights unless ``abort_in_flight``; the prefix cache
        is emptied. Thread-safe: while other threads' calls are being served, the swap happens on the
        engine loop's thread between two steps."""
        self.engine_loop.run_on_engine(lambda engine: engine.update_weights(params, abort_in_flight))

    @property
    def startup_report(self) -> dict:
        return self.engine.startup_report

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults applied (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM's; plain defaults without one."""
        return SamplingParams(**sampling_defaults(self.engine.model.generation_config))

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefix pages no request holds. True when no cached KV is left (False:
        running requests still hold some, which stay cached), as vLLM's."""
        return all([replica.scheduler.allocator.reset_prefix_cache() for replica in self.engine.replicas])

    # ------------------------------------------------------------------ batch generation
    @property
    def engine_loop(self) -> EngineLoop:
        """The loop thread that serves every call of this LLM (and of an ``AsyncLLM`` built on it)."""
        with _LOOP_LOCK:
            if getattr(self, "_engine_loop", None) is None:
                self._engine_loop = EngineLoop(self.engine)
            return self._engine_loop

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Serve every prompt to completion; outputs come back in the order of ``prompts``.
        ``lora_request``: the adapter every prompt runs with, or one per prompt (None: the base
        model), as vLLM's; one batch mixes them (``enable_lora``).

        Thread-safe: calls from several threads (and ``chat``/``stream``) are batched together by the
        engine loop, each getting its own outputs. Every prompt and SamplingParams of the call is
        checked before any is queued, so a ``ValueError`` leaves nothing behind. Requests added with
        ``llm.engine.add_request`` are not consumed: while they are unfinished this raises
        ``RuntimeError``, and while this call runs, direct engine calls from other threads raise."""
        prompts = _prompt_list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        adapters = _adapters_per_prompt(lora_request, len(prompts))
        loop = self.engine_loop
        groups = []  # per prompt: the validated requests of its n samples
        for index, (prompt, sp, adapter) in enumerate(zip(prompts, params, adapters)):
            samples = [sp] if sp.n == 1 else [_sample_params(sp, i) for i in range(sp.n)]
            groups.append([_validate_at(loop, index, prompt, child, adapter) for child in samples])
        outputs = _Collector()
        ids = [[loop.new_request_id() for _ in group] for group in groups]
        share_prompt = self.engine.config.enable_prefix_caching
        with loop.together():
            for group, group_ids in zip(groups, ids):
                if share_prompt and len(group) > 1:
                    outputs.submit_after_first(loop, group, group_ids)
                else:
                    for request, request_id in zip(group, group_ids):
                        loop.submit(request, outputs.put, request_id)
        finished = outputs.wait_all(loop, [i for group in ids for i in group], use_tqdm)
        return [self._merge([finished[i] for i in group]) for group in ids]

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, *, tools: list[dict] | None = None,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             continue_final_message: bool = False, lora_request=None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.
        ``tools`` (OpenAI function specs), ``chat_template`` and ``chat_template_kwargs`` go to the
        template, as in vLLM's ``LLM.chat``; the output is text (the server parses tool calls).
        ``lora_request``: as in ``generate``."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages: expected a conversation (a list of {{'role', 'content'}} dicts) or a "
                             f"list of them, got {type(messages).__name__ if messages else messages!r}")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        template = dict(tools=tools, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                        continue_final_message=continue_final_message)
        return self.generate([self.chat_prompt(c, add_generation_prompt, **template) for c in conversations],
                             sampling_params, use_tqdm, lora_request)

    def chat_prompt(self, conversation: list[dict], add_generation_prompt: bool = True, *,
                    tools: list[dict] | None = None, chat_template: str | None = None,
                    chat_template_kwargs: dict | None = None, continue_final_message: bool = False) -> dict:
        """The conversation through the chat template (the model's, or ``chat_template``), as text
        and token ids. ``continue_final_message`` leaves the last (assistant) message open for the
        model to go on with, instead of starting a new turn."""
        check_conversation(conversation)
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
            raise ValueError("messages: this model has no chat template; pass chat_template or use generate")
        extra = _template_kwargs(chat_template_kwargs, add_generation_prompt, continue_final_message)
        try:
            text = tokenizer.apply_chat_template(conversation, tools=tools, chat_template=chat_template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, **extra)
        except ValueError:
            raise
        except Exception as err:  # a template that raises or does not parse: the caller's template or input
            raise ValueError(f"chat_template: rendering failed: {type(err).__name__}: {err}") from None
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

    # ------------------------------------------------------------------ adapters
    def add_lora(self, lora_request: LoRARequest, tensors=None, *, rank: int | None = None,
                 alpha: float | None = None, use_rslora: bool = False) -> None:
        """Load a LoRA adapter before requests name it: from ``lora_request.lora_path`` (a PEFT
        directory), or from ``tensors`` in memory: PEFT-named arrays (numpy or JAX:
        ``...layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in], ``lora_B.weight`` [out, r]) of
        ``rank`` scaled by ``alpha / rank`` (``alpha / sqrt(rank)`` with ``use_rslora``), or the
        list of per-layer factors that ``jaxrunner.models.lora.new_adapter`` makes and
        ``jaxrunner.rollouts`` trains (no rank or alpha: the scaling is in ``b``)."""
        self.engine.add_lora(lora_request, None if tensors is None else _adapter_source(tensors, rank, alpha,
                                                                                         use_rslora))

    def update_lora(self, name: str, tensors, *, rank: int | None = None, alpha: float | None = None,
                    use_rslora: bool = False) -> None:
        """New weights for adapter ``name`` (``tensors`` as in ``add_lora``, or a PEFT directory),
        served from the next step on; nothing compiles. Between steps, on the engine loop's thread."""
        source = tensors if isinstance(tensors, (str, os.PathLike)) else _adapter_source(tensors, rank, alpha,
                                                                                          use_rslora)
        self.engine_loop.run_on_engine(lambda engine: engine.update_lora(name, source))

    def remove_lora(self, name: str) -> bool:
        """Forget an adapter that no unfinished request uses (False: none of that name)."""
        return self.engine_loop.run_on_engine(lambda engine: engine.remove_lora(name))

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text as it is generated for one prompt.

        Served by the engine loop beside every other call: other requests in flight keep running and
        go to their own callers, and a stream that is not read from keeps its text until it is.
        Closing the generator early aborts the request and frees its pages."""
        loop = self.engine_loop
        request = loop.validate(prompt, sampling_params)  # raises here, before the first next()
        return _stream(loop, request)

    # ------------------------------------------------------------------ helpers
    def _params_per_prompt(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if not isinstance(sampling_params, (list, tuple)):
            raise ValueError(f"sampling_params: expected SamplingParams or a list of them, "
                             f"got {type(sampling_params).__name__}")
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"sampling_params: {len(params)} given for {count} prompts")
        for index, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params[{index}]: expected SamplingParams, got {type(sp).__name__}")
        return params

    @staticmethod
    def _merge(outputs: list[RequestOutput]) -> RequestOutput:
        """One RequestOutput per prompt; n samples become outputs[0..n-1]."""
        first = outputs[0]
        if len(outputs) == 1:
            return first
        completions = []
        for index, output in enumerate(outputs):
            completion = output.outputs[0]
            completion.index = index
            completions.append(completion)
        return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, completions,
                             finished=True, num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=first.prompt_logprobs)


_LOOP_LOCK = threading.Lock()


class _Collector:
    """The outputs of one call's requests, put by the loop thread and read by the caller's thread."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False  # wait_all returned: submit nothing more

    def put(self, item) -> None:
        self._queue.put(item)

    def submit_after_first(self, loop: EngineLoop, group: list, request_ids: list[str]) -> None:
        """The n samples of one prompt: the first alone, the others once its first output is out. By
        then the prompt's full pages are in the prefix cache, so the others compute only the rest
        of the prompt instead of all of it n - 1 more times."""
        rest = list(zip(group[1:], request_ids[1:]))

        def first_sink(item) -> None:
            with self._lock:
                if rest and not self._closed:
                    for request, request_id in rest:
                        loop.submit(request, self.put, request_id)
                rest.clear()
            self.put(item)

        loop.submit(group[0], first_sink, request_ids[0])

    def wait_all(self, loop: EngineLoop, request_ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        """Block until every request finished; any error (or an interrupt) aborts the rest and raises."""
        finished: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm) as bar:
                while len(finished) < len(request_ids):
                    item = self._queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    if item.finished:
                        finished[item.request_id] = item
                        bar.update(1)
        finally:
            with self._lock:
                self._closed = True
            for request_id in request_ids:
                if request_id not in finished:
                    loop.abort(request_id)
        return finished


def _stream(loop: EngineLoop, request) -> Iterator[str]:
    outputs: queue.Queue = queue.Queue()
    request_id = loop.submit(request, outputs.put)
    finished = False
    try:
        while not finished:
            item = outputs.get()
            if isinstance(item, BaseException):
                raise item
            finished = item.finished
            if item.delta_text:
                yield item.delta_text
    finally:
        if not finished:
            loop.abort(request_id)


def _adapters_per_prompt(lora_request, count: int) -> list:
    """``lora_request`` for each of ``count`` prompts: one for all, or a list of one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if not isinstance(lora_request, (list, tuple)):
        raise ValueError(f"lora_request: expected a LoRARequest, a list of them (one per prompt) or None, "
                         f"got {type(lora_request).__name__}")
    if len(lora_request) != count:
        raise ValueError(f"lora_request: {len(lora_request)} given for {count} prompts")
    return list(lora_request)


def _prompt_list(prompts) -> list:
    """``prompts`` as a list: one prompt (string or dict) or a list/tuple of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts: expected a string, a prompt dict ({{'prompt': ...}} or "
                         f"{{'prompt_token_ids': [...]}}) or a list of them, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts: the list is empty")
    return list(prompts)


def _validate_at(loop: EngineLoop, index: int, prompt, params: SamplingParams, lora_request=None):
    """The engine's checks for prompt ``index``; the error says which prompt of the call was bad."""
    try:
        return loop.validate(prompt, params, lora_request)
    except ValueError as err:
        raise ValueError(f"prompts[{index}]: {err}") from None


# chat_template_kwargs may not set what apply_chat_template takes as its own arguments
_TEMPLATE_ARGUMENTS = {"conversation", "tools", "chat_template", "tokenize", "add_generation_prompt",
                       "continue_final_message", "documents", "return_dict", "return_tensors"}


def _template_kwargs(kwargs: dict | None, add_generation_prompt: bool, continue_final_message: bool) -> dict:
    """``chat_template_kwargs`` checked: a dict of extra template variables (Qwen3's ``enable_thinking``)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=True")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"chat_template_kwargs: expected an object of template variables, got {type(kwargs).__name__}")
    reserved = sorted(_TEMPLATE_ARGUMENTS & set(kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs: {reserved} are arguments of their own, not template variables")
    return dict(kwargs)


def check_conversation(conversation) -> None:
    """A chat is a list of messages, each a dict with a string ``role`` and a string ``content``."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"messages: expected a non-empty list of {{'role', 'content'}} dicts, "
                         f"got {type(conversation).__name__}")
    for index, message in enumerate(conversation):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}]: expected a dict with 'role' and 'content', "
                             f"got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{index}].role: expected a string such as 'system', 'user' or "
                             f"'assistant', got {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{index}].content: expected a string, got "
                             f"{type(message.get('content')).__name__}")
        check_unicode(message["content"], f"messages[{index}].content")


# vLLM's LLM(...) name -> jaxrunner's EngineConfig field for the same knob
VLLM_NAMES = {"gpu_memory_utilization": "memory_utilization", "block_size": "page_size"}


def _engine_options(options: dict) -> dict:
    """``options`` with vLLM's names mapped to EngineConfig's; ``enforce_eager`` is accepted and
    logged (jaxrunner always runs compiled executables, warmed up before serving)."""
    options = dict(options)
    if "enforce_eager" in options:
        eager = options.pop("enforce_eager")
        if not isinstance(eager, bool):
            raise ValueError(f"LLM.enforce_eager: invalid value {eager!r}; valid: True or False")
        if eager:
            logger.info("enforce_eager=True has no effect: jaxrunner compiles every bucket at start-up "
                        "and never compiles while serving")
    if "speculative_config" in options:
        options.update(speculative_config_options(options.pop("speculative_config"), options))
    for vllm_name, name in VLLM_NAMES.items():
        if vllm_name in options:
            if name in options:
                raise ValueError(f"LLM: both {vllm_name!r} and {name!r} given; they are the same option")
            options[name] = options.pop(vllm_name)
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(EngineConfig)})
    if unknown:
        valid = sorted({f.name for f in dataclasses.fields(EngineConfig)} | set(VLLM_NAMES) | {
            "enforce_eager", "tokenizer", "speculative_config"})
        raise ValueError(f"LLM: unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    return options


# vLLM's speculative_config keys -> EngineConfig fields
SPECULATIVE_CONFIG_KEYS = {"method": "speculative_method", "num_speculative_tokens": "num_speculative_tokens",
                           "prompt_lookup_max": "prompt_lookup_max", "prompt_lookup_min": "prompt_lookup_min",
                           "model": "speculative_model", "quantization": "speculative_quantization"}


def speculative_config_options(config, options: dict) -> dict:
    """vLLM's ``speculative_config`` dict as EngineConfig fields (their values are checked there);
    ``{"model": ...}`` alone means ``method="draft_model"``."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(f"LLM.speculative_config: invalid value {config!r}; valid: a dict with keys "
                         f"{', '.join(SPECULATIVE_CONFIG_KEYS)}, or None")
    unknown = sorted(set(config) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"LLM.speculative_config: unknown key(s) {', '.join(map(str, unknown))}; valid: "
                         f"{', '.join(SPECULATIVE_CONFIG_KEYS)}")
    mapped = {SPECULATIVE_CONFIG_KEYS[key]: value for key, value in config.items()}
    if mapped.get("speculative_model") is not None and "speculative_method" not in mapped:
        mapped["speculative_method"] = "draft_model"  # as vLLM: a draft model without a method is one
    both = sorted(set(mapped) & set(options))
    if both:
        raise ValueError(f"LLM: {both[0]!r} given both directly and in speculative_config")
    return mapped


def _adapter_source(tensors, rank, alpha, use_rslora: bool) -> tuple:
    """In-memory adapter tensors as the executor takes them: (host arrays, rank, alpha, rsLoRA), or
    a list of one slot's factors per layer as it is."""
    if isinstance(tensors, list):
        return tensors
    if not isinstance(tensors, dict):
        raise ValueError(f"tensors: expected a dict of PEFT-named arrays or a list of per-layer factors "
                         f"(models.lora.new_adapter), got {type(tensors).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank: invalid value {rank!r}; valid: the adapter's rank, an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"alpha: invalid value {alpha!r}; valid: the adapter's lora_alpha, a number")
    return {str(name): np.asarray(value, np.float32) for name, value in tensors.items()}, rank, float(alpha), \
        bool(use_rslora)


def _load_tokenizer(path: str):
    """A tokenizer from a directory (tokenizer.json / tokenizer_config.json) or a .gguf file."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"LLM.tokenizer: invalid value {path!r}; valid: a tokenizer directory or a .gguf file")
    path = os.path.expanduser(os.fspath(path))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return load_gguf_tokenizer(path)
    if not os.path.isdir(path):
        raise ValueError(f"LLM.tokenizer: {path!r} is neither a directory nor a .gguf file")
    return load_hf_tokenizer(path)


def _set_tokenizer(engine, tokenizer) -> None:
    """Serve with ``tokenizer`` (every replica); its EOS joins the model's."""
    engine.tokenizer = tokenizer


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n samples: its own request, its own seed (seed + i when the user fixed one)."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)
