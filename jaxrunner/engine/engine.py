"""LLMEngine: the serving loop — add requests, step, abort, stream outputs.

One step: the scheduler plans (host), the batch is packed at a bucket shape, the runner runs one
precompiled executable (device), then sampled tokens are appended, detokenized and checked for
stops, and finished requests free their pages.

Async scheduling (the default, like vLLM's ``async_scheduling``): ``step()`` plans and dispatches
step N+1 *before* it waits for step N, so the host's planning, packing and dispatch overlap the
device. Step N's sampled tokens stay on the device and feed N+1 (``feed_rows``); the scheduler
counts them as pending (``Request.expect_output``). A request that stops at step N (EOS, stop
string) has one wasted token computed in N+1, which is dropped; one that reaches ``max_tokens``
is not scheduled again. Steps whose requests use penalties (which need every past token on the
host) run synchronously. Each ``step()`` still returns the outputs of exactly one step.

Speculative decoding (``speculative_method``): the scheduler attaches proposals to decodes, the
step verifies them, and ``complete_step`` appends the accepted ones plus the model's next token
(several tokens in one output), then reports how many were accepted so the scheduler rolls the
rest back. A proposal is made from every past token, so a step that proposes is planned only
after the step before it is back on the host (synchronously). Requests back off from proposing
after a lookup found nothing or every proposal was rejected; while every running request is
backing off, steps overlap as usual.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import numbers
import threading

import jax

from jaxrunner.config import EngineConfig
from jaxrunner.engine.detokenizer import IncrementalDetokenizer
from jaxrunner.engine.page_allocator import PageAllocator
from jaxrunner.engine.request import Request
from jaxrunner.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from jaxrunner.engine.spec_decode import NgramProposer
from jaxrunner.engine.startup import start_runner
from jaxrunner.models.loading import LoadedModel, load_model
from jaxrunner.models.quant import quantize_model
from jaxrunner.outputs import CompletionOutput, Logprob, LogprobsDict, RequestOutput
from jaxrunner.parallel import distributed, mesh as meshes
from jaxrunner.runner import weights
from jaxrunner.runner.batch import MAX_ALLOWED_TOKEN_IDS, MAX_BANNED_TOKENS, MAX_LOGIT_BIAS, pack_step
from jaxrunner.runner.buckets import MAX_SPEC_SEQS
from jaxrunner.runner.sampler import MAX_LOGPROBS
from jaxrunner.sampling_params import SamplingParams

logger = logging.getLogger("jaxrunner")


@dataclasses.dataclass
class _Tracked:
    """Engine-side companions of a request: its text state and what it reports."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    max_tokens: int
    logprobs: list[LogprobsDict] | None
    # per prompt position (None at 0 and until computed), with SamplingParams.prompt_logprobs
    prompt_logprobs: list[LogprobsDict | None] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None


@dataclasses.dataclass(frozen=True)
class ValidRequest:
    """A request that passed ``LLMEngine.validate_request``: its text, its tokens and its params."""

    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


def _token_id_list(token_ids) -> list[int]:
    """``prompt_token_ids`` as a list of ints (a list, tuple or 1-D integer array); floats, bools,
    strings and scalars are refused."""
    if hasattr(token_ids, "tolist"):  # numpy / jax arrays
        token_ids = token_ids.tolist()
    if not isinstance(token_ids, (list, tuple)):
        raise ValueError(f"prompt_token_ids: expected a list of ints, got {type(token_ids).__name__}")
    for index, token in enumerate(token_ids):
        if not isinstance(token, numbers.Integral) or isinstance(token, bool):
            raise ValueError(f"prompt_token_ids: element {index} is {token!r} ({type(token).__name__}); "
                             f"token ids must be ints")
    return [int(t) for t in token_ids]


def _check_unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"prompt: not valid Unicode text ({err.reason} at index {err.start})") from None


def _check_owner(engine) -> None:
    owner = engine.owner_thread
    if owner is not None and owner is not threading.current_thread():
        raise RuntimeError(f"{type(engine).__name__}: an engine loop (LLM or AsyncLLM) is serving requests on "
                           f"this engine; submit through it, or wait until its calls have returned")


@dataclasses.dataclass
class _PendingStep:
    plan: object             # the scheduler's StepPlan
    device_outputs: dict     # the runner's sampled arrays, possibly still being computed
    updated: bool = False    # the scheduler already counted its tokens as computed (async)
    num_seq_rows: int = 0    # the bucket's sequences: draft rows' outputs follow theirs


class LLMEngine:
    """One engine: a scheduler and a runner on one mesh row (a device, or ``tensor_parallel_size``
    devices). Data parallelism is several of these (``jaxrunner.engine.data_parallel``)."""

    def __init__(self, config: EngineConfig, model: LoadedModel | None = None, mesh=None):
        self.config = config
        distributed.initialize_from_env()  # before any device is touched; a no-op unless configured
        if model is None:
            if mesh is None:
                meshes.check_device_count(config.tensor_parallel_size, 1)
                mesh = meshes.build_mesh(config.tensor_parallel_size, 1)
            model = load_model(config.model, config.dtype, progress=config.progress, mesh=mesh)
        if config.quantization is not None:
            model = quantize_model(model, config.quantization, config.quantization_group_size)
        self.model = model
        self.tokenizer = self.model.tokenizer
        self.runner, self.bucket_plan, self.max_model_len, self.startup_report = start_runner(config, self.model)
        spec = self.runner.cache_spec
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=self.max_model_len, page_size=spec.page_size, num_pages=spec.num_pages,
                            enable_prefix_caching=config.enable_prefix_caching,
                            enable_chunked_prefill=config.enable_chunked_prefill,
                            max_num_prefill_seqs=config.max_num_prefill_seqs, max_num_spec_seqs=MAX_SPEC_SEQS),
            PageAllocator(spec.num_pages, spec.page_size, config.enable_prefix_caching),
            proposer=self._proposer(config))
        self.eos_token_ids = self._eos_token_ids()
        self._tracked: dict[str, _Tracked] = {}
        self._arrivals = itertools.count()
        # recent steps only: a long-running server must not grow a list per step forever
        self.tokens_per_step: collections.deque[int] = collections.deque(maxlen=10_000)
        self.num_steps = 0
        self.num_draft_tokens = 0           # speculative decoding: tokens proposed, over all requests
        self.num_accepted_draft_tokens = 0  # and those accepted
        self._in_flight: _PendingStep | None = None  # async scheduling: dispatched, not yet waited for
        self.owner_thread: threading.Thread | None = None  # set while an engine loop owns the engine

    @staticmethod
    def _proposer(config: EngineConfig) -> NgramProposer | None:
        if config.speculative_method == "ngram":
            return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        return None

    @classmethod
    def from_config(cls, **kwargs) -> "LLMEngine":
        return cls(EngineConfig(**kwargs))

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    # ------------------------------------------------------------------ requests in
    def validate_request(self, prompt, sampling_params: SamplingParams | None = None) -> ValidRequest:
        """Check and tokenize one request without touching the engine's state (safe from any thread).

        Every front end (``LLM``, ``AsyncLLM``, the HTTP server) validates all the requests of a call
        with this before it adds any, so a bad one leaves nothing behind."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        self.check_sampling_params(params)
        if params.n != 1:
            raise ValueError(f"n: {params.n} samples per request is served by LLM.generate, not add_request")
        text, token_ids = self._prompt_token_ids(prompt)
        self._validate_prompt(token_ids)
        return ValidRequest(text, token_ids, params)

    def _prompt_token_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_id_list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError(f"prompt: a prompt dict needs 'prompt' or 'prompt_token_ids', got keys "
                                 f"{sorted(map(str, prompt))}")
            prompt = prompt["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: expected a string, {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}, "
                             f"got {type(prompt).__name__}")
        _check_unicode(prompt)
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass {'prompt_token_ids': [...]}")
        return prompt, list(self.tokenizer.encode(prompt))

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt: empty prompt (no tokens)")
        vocab = self.model.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: token id {bad[0]} outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(token_ids)} tokens leave no room to generate within "
                             f"max_model_len={self.max_model_len}")

    # ------------------------------------------------------------------ sampling params
    @property
    def max_logprobs(self) -> int:
        """The most logprobs per token a request may ask for (the width the sampler computes)."""
        return MAX_LOGPROBS

    def check_sampling_params(self, params: SamplingParams) -> None:
        """What ``SamplingParams`` cannot check alone: token ids against this model's vocabulary,
        logprobs against ``max_logprobs``, and the caps of the sampler's per-row arrays
        (``runner.batch``). A ``ValueError`` names the field and the valid values."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"SamplingParams.{name}={value!r}: must be in [0, max_logprobs="
                                 f"{self.max_logprobs}] (or None)")
        vocab = self.model.config.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", list(params.logit_bias or ()))):
            bad = [t for t in ids or () if t >= vocab]
            if bad:
                raise ValueError(f"SamplingParams.{name}: token id {bad[0]} outside the vocabulary [0, {vocab})")
        for name, count, cap in (("logit_bias", len(params.logit_bias or ()), MAX_LOGIT_BIAS),
                                 ("allowed_token_ids", len(set(params.allowed_token_ids or ())), MAX_ALLOWED_TOKEN_IDS)):
            if count > cap:
                raise ValueError(f"SamplingParams.{name}: {count} entries, at most {cap} are supported")
        banned = len(self._bad_words_token_ids(params))
        if params.min_tokens > 0:
            banned += len(set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(self.eos_token_ids)))
        if banned > MAX_BANNED_TOKENS:
            raise ValueError(f"SamplingParams.bad_words: {banned} banned token sequences (bad words, with "
                             f"stop_token_ids and EOS under min_tokens), at most {MAX_BANNED_TOKENS} are supported")

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word's token ids, as vLLM tokenizes them: the word as given (left-stripped),
        and with a leading space when that is another tokenization of the same length."""
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words: this model has no tokenizer to encode them")
        sequences: list[list[int]] = []
        for word in params.bad_words:
            plain = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            sequences.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        return sequences

    def add_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None) -> None:
        """Queue a request; a ``ValueError`` names what is wrong and leaves the engine untouched.

        ``prompt`` may be a ``ValidRequest`` from ``validate_request`` (its ``sampling_params`` win).
        While an engine loop (``LLM``/``AsyncLLM``) owns the engine, only the loop's thread may call
        ``add_request``/``step``/``abort_request``; others get a ``RuntimeError``."""
        self.check_caller()
        valid = prompt if isinstance(prompt, ValidRequest) else self.validate_request(prompt, sampling_params)
        request_id = str(request_id)
        if request_id in self._tracked:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        params, token_ids = valid.sampling_params, valid.prompt_token_ids
        arrival = next(self._arrivals)
        # Unseeded requests get a seed derived from the engine's, so a run is reproducible.
        seed = params.seed if params.seed is not None else hash((self.config.seed, arrival)) & (2**64 - 1)
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(request_id, token_ids, params, arrival_index=arrival, max_tokens=max_tokens, seed=seed,
                          bad_words_token_ids=self._bad_words_token_ids(params))
        self.scheduler.add(request)
        self._tracked[request_id] = _Tracked(
            request, valid.prompt, IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens,
                                                          params.stop,
                                                          params.include_stop_str_in_output),
            max_tokens, [] if params.logprobs is not None else None,
            [None] * len(token_ids) if params.prompt_logprobs is not None else None)

    def check_caller(self) -> None:
        """Refuse a call from outside the engine loop's thread while a loop owns this engine."""
        _check_owner(self)

    def abort_request(self, request_id: str) -> None:
        self.check_caller()
        if self._tracked.pop(str(request_id), None) is not None:
            self.scheduler.abort(str(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one step and return its outputs (async scheduling: the next one is already running)."""
        self.check_caller()
        current = self._in_flight or self.launch_step()
        self._in_flight = None
        if current is not None and self._async_enabled() and self._can_plan_behind() and not current.plan.has_drafts:
            self._in_flight = self._launch_behind(current)
        return self.complete_step(current)

    def launch_step(self) -> "_PendingStep | None":
        """Schedule and dispatch one step without waiting for the device (``None``: nothing to do).

        Split from ``complete_step`` so a front end driving several replicas can start all of them
        before it waits for any."""
        return self._launch(feed_rows=None)

    def _launch(self, feed_rows: dict | None) -> "_PendingStep | None":
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return None
        widest = max(len(chunk.request.page_ids) for chunk in plan.chunks)
        bucket = self.bucket_plan.select(plan.num_batched_tokens, len(plan.chunks), widest)
        batch = pack_step(plan.chunks, bucket, self.runner.cache_spec.page_size, self.eos_token_ids,
                          self.config.max_num_prefill_seqs, feed_rows)
        return _PendingStep(plan, self.runner.dispatch(bucket, batch), num_seq_rows=bucket.num_seqs)

    def _async_enabled(self) -> bool:
        # several processes run one deterministic schedule each; keep them in lockstep, synchronously
        return self.config.async_scheduling and jax.process_count() == 1

    def _can_plan_behind(self) -> bool:
        """Whether the next step can be planned before the current step's tokens are on the host: not
        when a request's sampling needs its whole history (penalties) on the host, nor with
        speculative decoding while a running request wants a proposal (made from every past token)."""
        if self.scheduler.proposer is not None and any(r.wants_proposal for r in self.scheduler.running):
            return False
        return not any(request.needs_host_history
                       for request in itertools.chain(self.scheduler.running, self.scheduler.waiting))

    def _launch_behind(self, current: _PendingStep) -> "_PendingStep | None":
        """Plan and dispatch the step after ``current`` while ``current`` runs on the device."""
        self.scheduler.update(current.plan)
        current.updated = True
        feed_rows = {}
        for row, chunk in enumerate(current.plan.chunks):
            if chunk.sample and not chunk.request.is_finished:
                chunk.request.expect_output()
                feed_rows[chunk.request] = row
        return self._launch(feed_rows)

    def complete_step(self, pending: "_PendingStep | None") -> list[RequestOutput]:
        """Wait for a launched step, then append, detokenize and finish its requests."""
        if pending is None:
            return []
        plan = pending.plan
        wants_prompt = any(chunk.request.sampling_params.prompt_logprobs is not None for chunk in plan.chunks)
        sampled = self.runner.fetch(pending.device_outputs, wants_prompt)  # the prompt outputs only when asked
        if wants_prompt:
            self._accept_prompt_logprobs(plan, sampled)
        if not pending.updated:
            self.scheduler.update(plan)
        self.tokens_per_step.append(plan.num_batched_tokens)
        self.num_steps += 1
        # chunk.sample was fixed when the plan was made, so appending tokens below cannot change it.
        # A request finished or aborted since the plan was made gets nothing (async: its stop was
        # only seen after this step had been dispatched).
        outputs, draft_row = [], pending.num_seq_rows
        for row, chunk in enumerate(plan.chunks):
            if chunk.sample and not chunk.request.is_finished:
                outputs.append(self._accept_chunk(chunk, sampled, row, draft_row))
            draft_row += len(chunk.draft_token_ids)
        return outputs

    def num_unfinished_requests(self) -> int:
        return len(self._tracked)

    def _accept_chunk(self, chunk: ScheduledChunk, sampled, row: int, draft_row: int) -> RequestOutput:
        """Append the chunk's sampled token; with proposals, the rows verifying them first: each
        token is kept, and the walk goes on only while it equals the proposal it checked (then the
        proposal's KV is right). One output carries every token appended."""
        request, draft = chunk.request, chunk.draft_token_ids
        tracked = self._tracked[request.request_id]
        rows = list(range(draft_row, draft_row + len(draft))) + [row]
        num_accepted = 0
        for index, sampled_row in enumerate(rows):
            token, reason = self._append_token(tracked, sampled, sampled_row)
            if reason is not None:
                self.scheduler.finish(request, reason)
                break
            if index == len(draft) or token != draft[index]:
                break
            num_accepted += 1
        if draft:
            self.num_draft_tokens += len(draft)
            self.num_accepted_draft_tokens += num_accepted
            self.scheduler.accept_drafts(chunk, num_accepted)
        return self._output_of(tracked)

    def _output_of(self, tracked: _Tracked) -> RequestOutput:
        finished = tracked.request.is_finished
        output = self._output(tracked, tracked.detokenizer.take_delta(finished=finished))
        if finished:
            del self._tracked[tracked.request.request_id]
        return output

    def _append_token(self, tracked: _Tracked, sampled, row: int) -> tuple[int, str | None]:
        """Append the token of ``row`` with its logprobs; returns it and the finish reason (or None)."""
        request = tracked.request
        token = int(sampled["tokens"][row])
        request.append_output(token)
        delta_len = tracked.detokenizer.append(token)
        logprob = float(sampled["logprobs"][row])
        tracked.cumulative_logprob += logprob
        if tracked.logprobs is not None:
            tracked.logprobs.append(self._logprobs_dict(
                token, logprob, int(sampled["ranks"][row]), request.sampling_params.logprobs,
                sampled["top_ids"][row], sampled["top_logprobs"][row]))
        return token, self._finish_reason(tracked, token, delta_len)

    def _accept_prompt_logprobs(self, plan, sampled) -> None:
        """Record the prompt logprobs a step computed: the row of prompt position p holds those of
        the token at p + 1. Chunks accumulate; a position computed twice (after a preemption)
        keeps its first record."""
        cursor = 0
        for chunk in plan.chunks:
            tracked = self._tracked.get(chunk.request.request_id)
            if tracked is not None and tracked.prompt_logprobs is not None:
                prompt, k = chunk.request.prompt_token_ids, chunk.request.sampling_params.prompt_logprobs
                for position in range(chunk.start, min(chunk.end, len(prompt) - 1)):
                    row = cursor + position - chunk.start
                    if tracked.prompt_logprobs[position + 1] is None:
                        tracked.prompt_logprobs[position + 1] = self._logprobs_dict(
                            prompt[position + 1], float(sampled["prompt_logprobs"][row]),
                            int(sampled["prompt_ranks"][row]), k, sampled["prompt_top_ids"][row],
                            sampled["prompt_top_logprobs"][row])
            cursor += chunk.num_tokens

    def _logprobs_dict(self, token: int, logprob: float, rank: int, k: int, top_ids, top_logprobs) -> LogprobsDict:
        """vLLM's shape: the actual token first, then the top ``k`` (ranks 1..k)."""
        entries = {token: Logprob(logprob, rank, self._decode_token(token))}
        for rank_in_top, (top, value) in enumerate(zip(top_ids[:k], top_logprobs[:k]), start=1):
            entries.setdefault(int(top), Logprob(float(value), rank_in_top, self._decode_token(int(top))))
        return entries

    def _decode_token(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])

    def _finish_reason(self, tracked: _Tracked, token: int, delta_len: int) -> str | None:
        request, params = tracked.request, tracked.request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if (not params.ignore_eos and token in self.eos_token_ids) or token in (params.stop_token_ids or ()):
                tracked.stop_reason = None if token in self.eos_token_ids else token
                return "stop"
            stop = tracked.detokenizer.find_stop(delta_len)
            if stop is not None:
                tracked.stop_reason = stop
                return "stop"
        if request.num_output_tokens >= tracked.max_tokens:
            return "length"
        return None

    def _output(self, tracked: _Tracked, delta: str) -> RequestOutput:
        request = tracked.request
        completion = CompletionOutput(
            index=0, text=tracked.detokenizer.output_text, token_ids=list(request.output_token_ids),
            cumulative_logprob=tracked.cumulative_logprob, logprobs=tracked.logprobs,
            finish_reason=request.finish_reason, stop_reason=tracked.stop_reason)
        return RequestOutput(request.request_id, tracked.prompt, list(request.prompt_token_ids), [completion],
                             finished=request.is_finished, num_cached_tokens=request.num_cached_tokens,
                             delta_text=delta, prompt_logprobs=tracked.prompt_logprobs,
                             num_draft_tokens=request.num_draft_tokens,
                             num_accepted_draft_tokens=request.num_accepted_draft_tokens)

    # ------------------------------------------------------------------ weights
    @property
    def params(self):
        """The params pytree being served (device arrays on the engine's mesh)."""
        return self.runner.params

    def update_weights(self, params, abort_in_flight: bool = False) -> None:
        """Serve ``params`` from the next step on; same leaves, shapes and dtypes as ``self.params``.

        Nothing compiles: the executables take the params as an argument. Leaves on other devices
        or shardings are copied onto the engine's (device to device). Requests in flight continue
        on the new weights with the KV they already have, unless ``abort_in_flight``. The prefix
        cache is emptied: its KV was computed by the old weights. A mismatch raises ``ValueError``
        naming the leaf, and the old weights stay in service.
        """
        if self.config.quantization is not None:
            raise ValueError(f"update_weights: not supported with quantization={self.config.quantization!r} "
                             "(the served leaves are quantized; start the engine unquantized)")
        weights.check_like(params, self.runner.params)
        placed = weights.place_like(params, jax.tree.map(lambda leaf: leaf.sharding, self.runner.params))
        if abort_in_flight:
            for request_id in list(self._tracked):
                self.abort_request(request_id)
        self.runner.params = placed
        self.model = dataclasses.replace(self.model, params=placed)
        self.scheduler.invalidate_prefix_cache()

    # ------------------------------------------------------------------ counters
    def stats(self) -> dict:
        allocator = self.scheduler.allocator
        return {
            "num_steps": self.num_steps,
            "tokens_per_step": list(self.tokens_per_step),  # the most recent 10,000 steps
            "prefix_cache_hit_tokens": self.scheduler.prefix_cache_hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "pages_in_use": allocator.num_used_pages,
            "pages_total": self.runner.cache_spec.num_pages,
            "num_unfinished": sum(1 for t in self._tracked.values() if not t.request.is_finished),
            "max_pages_per_seq": math.ceil(self.max_model_len / self.runner.cache_spec.page_size),
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "spec_acceptance_rate": (self.num_accepted_draft_tokens / self.num_draft_tokens
                                     if self.num_draft_tokens else None),
        }
