"""LLM: the vLLM-shaped front door (``generate``, ``chat``, ``stream``) over one engine (or data-parallel replicas)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, Sequence

from jaxrunner.config import DEFAULT_MODEL, EngineConfig
from jaxrunner.engine.data_parallel import create_engine
from jaxrunner.outputs import RequestOutput
from jaxrunner.sampling_params import SamplingParams


class LLM:
    """Load a model, warm it up, and serve batches of prompts.

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_options):
        """``engine_options`` are EngineConfig's fields, e.g. ``dtype``, ``max_num_seqs``,
        ``tensor_parallel_size`` (devices splitting the model) and ``data_parallel_size`` (replicas)."""
        self._attach(create_engine(EngineConfig(model=model, **engine_options)))

    def _attach(self, engine) -> None:
        self.engine = engine
        self._ids = itertools.count()

    @classmethod
    def from_params(cls, params, config, tokenizer=None, **engine_options) -> "LLM":
        """Serve an in-memory params pytree (the leaves ``LLM.params`` returns) with no checkpoint.

        ``config``: the model's HF config (a ``config.json`` dict or a ``transformers`` config);
        ``tokenizer``: a tokenizer object, a directory to load one from, or None (prompts are then
        given as ``{"prompt_token_ids": [...]}``). Arrays already on the engine's devices and
        shardings are served in place, with no copy; others are copied device to device. The
        dtype is the params' own (float32 or bfloat16)."""
        from jaxrunner.runner import weights

        return cls._in_memory(lambda mesh, tok: weights.model_from_params(params, config, tok, mesh),
                              weights.params_dtype(params), tokenizer, engine_options)

    @classmethod
    def from_nnx(cls, module, tokenizer=None, **engine_options) -> "LLM":
        """Serve a Flax NNX module that follows the protocol of ``jaxrunner.models.flax_nnx``
        (``config``, ``embed``, ``layers`` called with the engine's ``attend``, ``norm``, ``logits``),
        with the paged cache, kernels and warm-up of the built-in models. ``LLM.params`` is then the
        module's ``nnx.State``."""
        from flax import nnx

        from jaxrunner.models.flax_nnx import check_protocol
        from jaxrunner.runner import weights

        check_protocol(module)
        dtype = weights.params_dtype(nnx.state(module))
        return cls._in_memory(lambda mesh, tok: weights.model_from_nnx(module, tok, mesh), dtype, tokenizer,
                              engine_options)

    @classmethod
    def _in_memory(cls, build_model, dtype: str, tokenizer, engine_options: dict) -> "LLM":
        """An LLM over a model built in memory by ``build_model(mesh of the first replica, tokenizer)``;
        the engine options are checked before it is built."""
        from jaxrunner.parallel import mesh as meshes
        from jaxrunner.runner import weights

        if engine_options.setdefault("dtype", dtype) != dtype:
            raise ValueError(f"dtype={engine_options['dtype']!r}: the params are {dtype}; cast them, or leave dtype out")
        config = EngineConfig(model=weights.IN_MEMORY, **engine_options)
        meshes.check_device_count(config.tensor_parallel_size, config.data_parallel_size)
        first_row = meshes.replica_meshes(meshes.build_mesh(config.tensor_parallel_size,
                                                            config.data_parallel_size))[0]
        if isinstance(tokenizer, str):
            from jaxrunner.models.loading.hf import load_hf_tokenizer

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
        is emptied."""
        self.engine.update_weights(params, abort_in_flight)

    @property
    def startup_report(self) -> dict:
        return self.engine.startup_report

    def get_tokenizer(self):
        return self.engine.tokenizer

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


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n samples: its own request, its own seed (seed + i when the user fixed one)."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)
