"""LLM: the vLLM-shaped front door (``generate``, ``chat``, ``stream``) over one engine (or data-parallel replicas)."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from typing import Iterator, Sequence

from jaxrunner.config import DEFAULT_MODEL, EngineConfig
from jaxrunner.engine.data_parallel import create_engine
from jaxrunner.engine.preflight import check_before_loading
from jaxrunner.outputs import RequestOutput
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
        self.engine = create_engine(config)
        if tokenizer_override is not None:
            _set_tokenizer(self.engine, tokenizer_override)
        self._ids = itertools.count()

    @property
    def startup_report(self) -> dict:
        return self.engine.startup_report

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults applied (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM's; plain defaults without one."""
        from jaxrunner.models.loading.hf import sampling_defaults

        return SamplingParams(**sampling_defaults(self.engine.model.generation_config))

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefix pages no request holds. True when no cached KV is left (False:
        running requests still hold some, which stay cached), as vLLM's."""
        engines = getattr(self.engine, "replicas", [self.engine])
        return all([engine.scheduler.allocator.reset_prefix_cache() for engine in engines])

    # ------------------------------------------------------------------ batch generation
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Serve every prompt to completion; outputs come back in the order of ``prompts``."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        groups = []  # per prompt: (request ids of its n samples)
        for prompt, sp in zip(prompts, params):
            base = str(next(self._ids))
            samples = [sp] if sp.n == 1 else [_sample_params(sp, i) for i in range(sp.n)]
            ids = [base] if sp.n == 1 else [f"{base}#{i}" for i in range(sp.n)]
            for request_id, child in zip(ids, samples):
                self.engine.add_request(request_id, prompt, child)
            groups.append(ids)
        finished = self._run_to_completion(sum(len(g) for g in groups), use_tqdm)
        return [self._merge([finished[i] for i in ids]) for ids in groups]

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.chat_prompt(c, add_generation_prompt) for c in conversations],
                             sampling_params, use_tqdm)

    def chat_prompt(self, conversation: list[dict], add_generation_prompt: bool = True) -> dict:
        tokenizer = self.engine.tokenizer
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text as it is generated for one prompt (other queued requests keep being served)."""
        request_id = f"stream-{next(self._ids)}"
        self.engine.add_request(request_id, prompt, sampling_params)
        try:
            while True:
                outputs = {o.request_id: o for o in self.engine.step()}
                mine = outputs.get(request_id)
                if mine is not None:
                    if mine.delta_text:
                        yield mine.delta_text
                    if mine.finished:
                        return
                elif not self.engine.has_unfinished_requests():
                    return
        finally:
            self.engine.abort_request(request_id)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _params_per_prompt(sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"sampling_params: {len(params)} given for {count} prompts")
        return params

    def _run_to_completion(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        from tqdm.auto import tqdm

        finished: dict[str, RequestOutput] = {}
        with tqdm(total=total, desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return finished

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
        return RequestOutput(first.request_id.split("#")[0], first.prompt, first.prompt_token_ids, completions,
                             finished=True, num_cached_tokens=first.num_cached_tokens)


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
    for vllm_name, name in VLLM_NAMES.items():
        if vllm_name in options:
            if name in options:
                raise ValueError(f"LLM: both {vllm_name!r} and {name!r} given; they are the same option")
            options[name] = options.pop(vllm_name)
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(EngineConfig)})
    if unknown:
        valid = sorted({f.name for f in dataclasses.fields(EngineConfig)} | set(VLLM_NAMES) | {"enforce_eager",
                                                                                               "tokenizer"})
        raise ValueError(f"LLM: unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    return options


def _load_tokenizer(path: str):
    """A tokenizer from a directory (tokenizer.json / tokenizer_config.json) or a .gguf file."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"LLM.tokenizer: invalid value {path!r}; valid: a tokenizer directory or a .gguf file")
    path = os.path.expanduser(os.fspath(path))
    if os.path.isfile(path) and path.endswith(".gguf"):
        from jaxrunner.models.loading.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    if not os.path.isdir(path):
        raise ValueError(f"LLM.tokenizer: {path!r} is neither a directory nor a .gguf file")
    from jaxrunner.models.loading.hf import load_hf_tokenizer

    return load_hf_tokenizer(path)


def _set_tokenizer(engine, tokenizer) -> None:
    """Serve with ``tokenizer`` (every replica); its EOS joins the model's."""
    for replica in getattr(engine, "replicas", [engine]):
        replica.tokenizer = tokenizer
        replica.eos_token_ids = replica._eos_token_ids()


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n samples: its own request, its own seed (seed + i when the user fixed one)."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)
