"""LLMEngine: the serving loop — add requests, step, abort, stream outputs.

One step: the scheduler plans (host), the plan becomes a ``StepInput`` (``engine.step_input``), the
executor packs it at a bucket shape and runs one precompiled executable (device), then sampled
tokens are appended, detokenized and checked for stops, and finished requests free their pages.

Async scheduling (the default, like vLLM's ``async_scheduling``): ``step()`` plans and dispatches
step N+1 *before* it waits for step N, so the host's planning, packing and dispatch overlap the
device. Step N's sampled tokens stay on the device and feed N+1 (``feed_rows``); the scheduler
counts them as pending (``Request.expect_output``). A request that stops at step N (EOS, stop
string) has one wasted token computed in N+1, which is dropped; one that reaches ``max_tokens``
is not scheduled again. Some requests make steps synchronous (``Request.needs_host_history`` says
which, and why). Each ``step()`` still returns the outputs of exactly one step.

Speculative decoding (``speculative_method``): a plan marks the chunks whose next decode should get
guesses; after the step, ``complete_step`` hands the scheduler the guesses, from the n-gram lookup
(run here) or from the executor's draft model (made behind ``fetch``, in ``SampledRows.proposals``).
The next plan attaches them to the decodes, the step verifies them, and ``complete_step`` appends
the accepted ones plus the model's next token (several tokens in one output), then reports how many
were accepted so the scheduler rolls the rest back. Guesses follow every past token, so a step that
verifies or asks for them is followed synchronously. Requests back off from proposing
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
from typing import Sequence

from jaxrunner.config import EngineConfig
from jaxrunner.engine.adapters import AdapterRegistry, AdapterSlots
from jaxrunner.engine.output_processor import OutputProcessor
from jaxrunner.engine.page_allocator import PageAllocator
from jaxrunner.engine.request import Request, check_request_id_free
from jaxrunner.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from jaxrunner.engine.spec_decode import NgramProposer
from jaxrunner.engine.step_input import build_step_input
from jaxrunner.engine.structured_output import GrammarCompiler
from jaxrunner.executor_protocol import NO_TOKEN, Executor, SampledRows, StepHandle
from jaxrunner.lora_request import LoRARequest
from jaxrunner.outputs import RequestOutput
from jaxrunner.sampling_params import SamplingParams

logger = logging.getLogger("jaxrunner")


@dataclasses.dataclass(frozen=True)
class ValidRequest:
    """A request that passed ``LLMEngine.validate_request``: its text, its tokens, its params and
    their structured-output grammar, compiled once (None: unconstrained)."""

    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    grammar: str | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (read by validation), None: the base model


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


def check_unicode(text: str, field: str = "prompt") -> None:
    """A lone surrogate (JSON's "\\ud800") reaches no tokenizer: a ValueError naming ``field``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{field}: not valid Unicode text ({err.reason} at index {err.start})") from None


def _check_owner(engine) -> None:
    owner = engine.owner_thread
    if owner is not None and owner is not threading.current_thread():
        raise RuntimeError(f"{type(engine).__name__}: an engine loop (LLM or AsyncLLM) is serving requests on "
                           f"this engine; submit through it, or wait until its calls have returned")


@dataclasses.dataclass
class _Replica:
    """One executor and the scheduler that plans for it: a mesh row with its own KV pool. Data
    parallelism is several; the engine sends each new request to the least loaded."""

    executor: Executor
    scheduler: Scheduler
    in_flight: "_PendingStep | None" = None  # async scheduling: dispatched, not yet waited for
    adapter_slots: AdapterSlots | None = None  # LoRA: what the executor's device slots hold


@dataclasses.dataclass
class _PendingStep:
    replica: _Replica
    plan: object             # the scheduler's StepPlan
    handle: StepHandle       # the executor's dispatched step
    updated: bool = False    # the scheduler already counted its tokens as computed (async)


class LLMEngine:
    """The engine: requests in, outputs out, over one executor per data-parallel replica.

    Built by ``jaxrunner.engine_factory.create_engine`` (which loads the model and starts the
    executors); this side is host-only Python and never touches a device."""

    def __init__(self, config: EngineConfig, executors: Sequence[Executor]):
        if not executors:
            raise ValueError("executors: an engine needs at least one")
        self.config = config
        self.replicas = [_Replica(executor, self._scheduler_for(config, executor),
                                  adapter_slots=AdapterSlots(executor.max_loras, executor.load_lora_slot)
                                  if executor.max_loras else None) for executor in executors]
        # speculative decoding by n-gram lookup runs here, after each step; a draft model runs in the executor
        self.ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) \
            if config.speculative_method == "ngram" else None
        self.executor = executors[0]  # replicas serve the same model with the same limits
        self.adapters = AdapterRegistry(config.max_cpu_loras or config.max_loras, self.executor.load_adapter) \
            if self.executor.max_loras else None
        self.max_model_len = min(executor.max_model_len for executor in executors)
        self.output_processor = OutputProcessor(self.executor.tokenizer, self.executor.eos_token_ids)
        self.grammars = GrammarCompiler(self.executor.tokenizer, self.executor.vocab_size, self.executor.eos_token_ids)
        self._replica_of: dict[str, _Replica] = {}
        self._arrivals = itertools.count()
        # recent steps only: a long-running server must not grow a list per step forever
        self.tokens_per_step: collections.deque[int] = collections.deque(maxlen=10_000)
        self.num_steps = 0
        self.num_draft_tokens = 0           # speculative decoding: tokens proposed, over all requests
        self.num_accepted_draft_tokens = 0  # and those accepted
        self.owner_thread: threading.Thread | None = None  # set while an engine loop owns the engine

    def _scheduler_for(self, config: EngineConfig, executor: Executor) -> Scheduler:
        speculative = config.speculative_method == "ngram" or (config.speculative_method == "draft_model"
                                                                 and executor.drafts)
        return Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=executor.max_model_len, page_size=executor.page_size,
                            num_pages=executor.num_pages, enable_prefix_caching=config.enable_prefix_caching,
                            enable_chunked_prefill=config.enable_chunked_prefill,
                            max_num_prefill_seqs=config.max_num_prefill_seqs,
                            max_num_spec_seqs=executor.max_num_spec_seqs, max_loras=executor.max_loras),
            PageAllocator(executor.num_pages, executor.page_size, config.enable_prefix_caching),
            speculative=speculative)

    # ------------------------------------------------------------------ what the front ends read
    @property
    def scheduler(self) -> Scheduler:
        """The first replica's scheduler (the only one without data parallelism)."""
        return self.replicas[0].scheduler

    @property
    def model(self):
        """The served model as the runner side loaded it (config, tokenizer, generation config)."""
        return self.executor.model

    @property
    def tokenizer(self):
        return self.executor.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        for replica in self.replicas:
            replica.executor.tokenizer = tokenizer
        self.output_processor.tokenizer = tokenizer
        self.output_processor.eos_token_ids = self.executor.eos_token_ids
        self.grammars = GrammarCompiler(tokenizer, self.executor.vocab_size, self.executor.eos_token_ids)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.executor.eos_token_ids

    @property
    def startup_report(self) -> dict:
        if len(self.replicas) == 1:
            return self.executor.startup_report
        report = dict(self.executor.startup_report)
        report.update(data_parallel_size=len(self.replicas),
                      replica_compile_s_total=[r.executor.startup_report["compile_s_total"] for r in self.replicas])
        return report

    # ------------------------------------------------------------------ requests in
    def validate_request(self, prompt, sampling_params: SamplingParams | None = None,
                         lora_request: LoRARequest | None = None) -> ValidRequest:
        """Check and tokenize one request without touching the engine's state (safe from any thread);
        a ``lora_request`` naming an adapter not yet known reads it (into host memory only).

        Every front end (``LLM``, ``AsyncLLM``, the HTTP server) validates all the requests of a call
        with this before it adds any, so a bad one leaves nothing behind."""
        self.resolve_adapter(lora_request)
        params = sampling_params if sampling_params is not None else SamplingParams()
        self.check_sampling_params(params)
        if params.n != 1:
            raise ValueError(f"n: {params.n} samples per request is served by LLM.generate, not add_request")
        text, token_ids = self._prompt_token_ids(prompt)
        if params.truncate_prompt_tokens is not None:
            text, token_ids = self._truncated(text, token_ids, params.truncate_prompt_tokens)
        self._check_vocabulary("prompt_token_ids", token_ids)
        # the scheduler's own test of a request that could never run (empty, too long, too big)
        self.scheduler.check_fits(len(token_ids), self._output_cap(params, len(token_ids)))
        constraint = params.structured_outputs
        return ValidRequest(text, token_ids, params, None if constraint is None else self.grammars.grammar(constraint),
                            lora_request)

    # ------------------------------------------------------------------ adapters
    def resolve_adapter(self, lora_request: LoRARequest | None) -> str | None:
        """The name of the adapter ``lora_request`` names, read into host memory if it is not there
        (a ``ValueError`` when it cannot be); None for none. Safe from any thread."""
        if lora_request is None:
            return None
        if self.adapters is None:
            name = getattr(lora_request, "lora_name", lora_request)
            raise ValueError(f"lora_request {name!r}: this engine serves no adapters; start it with enable_lora=True")
        return self.adapters.resolve(lora_request, self._adapters_in_use).request.lora_name

    def _adapter_fields(self, valid: ValidRequest) -> dict:
        """A new request's adapter and prefix-cache salt. The adapter is read again if host memory
        dropped it since validation (a call's requests are all validated before any is added)."""
        if valid.lora_request is None:
            return {}
        name = self.resolve_adapter(valid.lora_request)
        return {"lora_name": name, "cache_salt": self.adapters.get(name).cache_salt}

    def _adapters_in_use(self) -> set[str]:
        return set().union(*(replica.scheduler.adapters_in_use() for replica in self.replicas))

    def add_lora(self, lora_request: LoRARequest, source=None) -> None:
        """Load an adapter before any request names it: from ``lora_request.lora_path``, or from
        ``source`` (``(tensors, rank, alpha, use_rslora)`` in memory; see ``LLM.add_lora``)."""
        if self.adapters is None:
            raise ValueError("add_lora: this engine serves no adapters; start it with enable_lora=True")
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(lora_request).__name__}")
        if source is None and not lora_request.lora_path:
            raise ValueError(f"add_lora {lora_request.lora_name!r}: give lora_path or the adapter's tensors")
        self.adapters.add(lora_request, source if source is not None else lora_request.lora_path,
                          self._adapters_in_use)

    def update_lora(self, name: str, source) -> None:
        """New weights for adapter ``name`` (a directory, or ``(tensors, rank, alpha, use_rslora)``),
        served from the next step on, compiling nothing; requests in flight go on with them. New
        requests never reuse prefixes cached with the old ones (the salt has the generation)."""
        if self.adapters is None:
            raise ValueError("update_lora: this engine serves no adapters; start it with enable_lora=True")
        self.adapters.update(name, source)

    def remove_lora(self, name: str) -> bool:
        """Forget an adapter no unfinished request uses; False when it is unknown."""
        if self.adapters is None:
            return False
        return self.adapters.remove(name, self._adapters_in_use())

    def list_loras(self) -> list[LoRARequest]:
        """The adapters in host memory, least recently used first."""
        return [] if self.adapters is None else [self.adapters.get(name).request for name in self.adapters.names()]

    def _truncated(self, text: str | None, token_ids: list[int], keep: int) -> tuple[str | None, list[int]]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: max_model_len);
        the text goes with a prompt that was cut (its tokens are what the request holds)."""
        if keep > self.max_model_len:
            raise ValueError(f"SamplingParams.truncate_prompt_tokens={keep}: must be at most max_model_len="
                             f"{self.max_model_len} (or -1)")
        keep = self.max_model_len if keep == -1 else keep
        return (text, token_ids) if len(token_ids) <= keep else (None, token_ids[-keep:])

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
        check_unicode(prompt)
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass {'prompt_token_ids': [...]}")
        return prompt, list(self.tokenizer.encode(prompt))

    def _check_vocabulary(self, name: str, token_ids) -> None:
        """Every id in ``token_ids`` (the field ``name``) is a token of this model."""
        vocab = self.executor.vocab_size
        bad = [t for t in token_ids or () if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} outside the vocabulary [0, {vocab})")

    def _output_cap(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """``Request.max_tokens``: ``params.max_tokens``, lowered to what max_model_len leaves after
        the prompt (all of it when None)."""
        room = self.max_model_len - num_prompt_tokens
        return room if params.max_tokens is None else min(params.max_tokens, room)

    # ------------------------------------------------------------------ sampling params
    @property
    def max_logprobs(self) -> int:
        """The most logprobs per token a request may ask for (the width the sampler computes)."""
        return self.executor.limits.max_logprobs

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
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                          ("logit_bias", list(params.logit_bias or ()))):
            self._check_vocabulary(f"SamplingParams.{name}", ids)
        limits = self.executor.limits
        for name, count, cap in (("logit_bias", len(params.logit_bias or ()), limits.max_logit_bias),
                                 ("allowed_token_ids", len(set(params.allowed_token_ids or ())),
                                  limits.max_allowed_token_ids)):
            if count > cap:
                raise ValueError(f"SamplingParams.{name}: {count} entries, at most {cap} are supported")
        banned = len(self._bad_words_token_ids(params))
        if params.min_tokens > 0:
            banned += len(set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(self.eos_token_ids)))
        if banned > limits.max_banned_tokens:
            raise ValueError(f"SamplingParams.bad_words: {banned} banned token sequences (bad words, with "
                             f"stop_token_ids and EOS under min_tokens), at most {limits.max_banned_tokens} are supported")

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

    def add_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request; a ``ValueError`` names what is wrong and leaves the engine untouched.

        ``prompt`` may be a ``ValidRequest`` from ``validate_request`` (its ``sampling_params`` win).
        While an engine loop (``LLM``/``AsyncLLM``) owns the engine, only the loop's thread may call
        ``add_request``/``step``/``abort_request``; others get a ``RuntimeError``."""
        self.check_caller()
        valid = prompt if isinstance(prompt, ValidRequest) else self.validate_request(prompt, sampling_params,
                                                                                      lora_request)
        request_id = str(request_id)
        check_request_id_free(request_id, self._replica_of)  # over every replica
        params, token_ids = valid.sampling_params, valid.prompt_token_ids
        arrival = next(self._arrivals)
        # Unseeded requests get a seed derived from the engine's, so a run is reproducible.
        seed = params.seed if params.seed is not None else hash((self.config.seed, arrival)) & (2**64 - 1)
        request = Request(request_id, token_ids, params, arrival_index=arrival,
                          max_tokens=self._output_cap(params, len(token_ids)), seed=seed,
                          bad_words_token_ids=self._bad_words_token_ids(params), **self._adapter_fields(valid))
        if valid.grammar is not None:
            request.grammar = self.grammars.matcher(valid.grammar)
        replica = min(self.replicas, key=lambda r: r.scheduler.num_waiting + r.scheduler.num_running)
        replica.scheduler.add(request)
        self._replica_of[request_id] = replica
        self.output_processor.add_request(request, valid.prompt)

    def check_caller(self) -> None:
        """Refuse a call from outside the engine loop's thread while a loop owns this engine."""
        _check_owner(self)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its pages; returns its final output (``finish_reason="abort"``), or
        None for an id this engine does not hold."""
        self.check_caller()
        final = self.output_processor.abort_request(str(request_id))
        if final is not None:
            replica = self._replica_of.pop(str(request_id))
            replica.scheduler.abort(str(request_id))
            replica.executor.forget(str(request_id))
        return final

    def has_unfinished_requests(self) -> bool:
        return any(replica.scheduler.has_unfinished() for replica in self.replicas)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one step on every replica and return its outputs (async scheduling: each replica's
        next step is already running). Every replica's step is dispatched before any is waited for."""
        self.check_caller()
        launched = []
        for replica in self.replicas:
            launched.append(replica.in_flight or self._launch(replica, feed_rows=None))
            replica.in_flight = None
        for replica, current in zip(self.replicas, launched):
            if current is not None and self._async_enabled() and self._can_plan_behind(replica) \
                    and not current.plan.has_drafts:
                replica.in_flight = self._launch_behind(current)
        return [output for current in launched for output in self.complete_step(current)]

    def _launch(self, replica: _Replica, feed_rows: dict[str, int] | None) -> "_PendingStep | None":
        """Plan one step and dispatch it without waiting for the device (``None``: nothing to do).
        ``feed_rows``: request id → the row of the step in flight that samples its last token."""
        plan = replica.scheduler.schedule()
        if plan.is_empty:
            return None
        slots = self._adapter_slots(replica, plan)
        step = build_step_input(plan, replica.executor.eos_token_ids, self.grammars, feed_rows, replica.executor.drafts,
                                slots)
        return _PendingStep(replica, plan, replica.executor.execute(step))

    def _adapter_slots(self, replica: _Replica, plan) -> dict[str, int] | None:
        """The device slot of each adapter the plan's requests run with, loaded now if need be."""
        if replica.adapter_slots is None:
            return None
        names = {chunk.request.lora_name for chunk in plan.chunks if chunk.request.lora_name is not None}
        return replica.adapter_slots.assign({name: self.adapters.get(name) for name in sorted(names)})

    def _async_enabled(self) -> bool:
        return self.config.async_scheduling and not self.executor.synchronous

    def _can_plan_behind(self, replica: _Replica) -> bool:
        """Whether the next step can be planned before the current step's tokens are on the host: not
        while a request ``needs_host_history``, nor with speculative decoding while a running
        request wants a proposal (made from every past token)."""
        scheduler = replica.scheduler
        if scheduler.speculative and any(r.wants_proposal for r in scheduler.running):
            return False
        return not any(request.needs_host_history for request in itertools.chain(scheduler.running, scheduler.waiting))

    def _launch_behind(self, current: _PendingStep) -> "_PendingStep | None":
        """Plan and dispatch the step after ``current`` while ``current`` runs on the device."""
        current.replica.scheduler.update(current.plan)
        current.updated = True
        feed_rows = {}
        for row, chunk in enumerate(current.plan.chunks):
            if chunk.sample and not chunk.request.is_finished:
                chunk.request.expect_output()
                feed_rows[chunk.request.request_id] = row
        return self._launch(current.replica, feed_rows)

    def complete_step(self, pending: "_PendingStep | None") -> list[RequestOutput]:
        """Wait for a launched step, then append, detokenize and finish its requests."""
        if pending is None:
            return []
        plan, scheduler = pending.plan, pending.replica.scheduler
        wants_prompt = any(chunk.request.sampling_params.prompt_logprobs is not None for chunk in plan.chunks)
        sampled = pending.replica.executor.fetch(pending.handle, wants_prompt)  # the prompt outputs only when asked
        if wants_prompt:
            self.output_processor.accept_prompt_logprobs(plan.chunks, sampled)
        if not pending.updated:
            scheduler.update(plan)
        self.tokens_per_step.append(plan.num_batched_tokens)
        self.num_steps += 1
        # chunk.sample was fixed when the plan was made, so appending tokens below cannot change it.
        # A request finished or aborted since the plan was made gets nothing (async: its stop was
        # only seen after this step had been dispatched).
        outputs, draft_row = [], pending.handle.num_seq_rows
        for row, chunk in enumerate(plan.chunks):
            if chunk.sample and not chunk.request.is_finished:
                outputs.append(self._accept_chunk(scheduler, chunk, sampled, row, draft_row))
                self._after_accept(pending.replica, chunk, sampled, row)
            draft_row += len(chunk.draft_token_ids)
        return outputs

    def _after_accept(self, replica: _Replica, chunk: ScheduledChunk, sampled: SampledRows, row: int) -> None:
        """A finished request's draft state goes; one still running gets the guesses its chunk asked
        for: the n-gram lookup's, made here from its tokens, or the draft model's, in ``sampled``."""
        request = chunk.request
        if request.is_finished:
            replica.executor.forget(request.request_id)
        elif chunk.propose:
            if self.ngram is not None:
                draft = self.ngram.propose(request.all_token_ids, chunk.propose)
            else:
                draft = [int(t) for t in sampled.proposals[row] if t != NO_TOKEN] if sampled.proposals is not None else []
            replica.scheduler.receive_proposal(request, draft)

    def num_unfinished_requests(self) -> int:
        return len(self.output_processor)

    def _accept_chunk(self, scheduler: Scheduler, chunk: ScheduledChunk, sampled: SampledRows, row: int,
                      draft_row: int) -> RequestOutput:
        """Hand the chunk's sampled rows to the output processor (with proposals, the rows verifying
        them first), then tell the scheduler of a stop and of the proposals accepted. One output
        carries every token appended."""
        request, draft = chunk.request, chunk.draft_token_ids
        rows = list(range(draft_row, draft_row + len(draft))) + [row]
        num_accepted, reason = self.output_processor.append_sampled(request, sampled, rows, draft)
        if reason is not None:
            scheduler.finish(request, reason)
        if draft:
            self.num_draft_tokens += len(draft)
            self.num_accepted_draft_tokens += num_accepted
            scheduler.accept_drafts(chunk, num_accepted)
        if request.is_finished:
            del self._replica_of[request.request_id]
        return self.output_processor.make_output(request)

    # ------------------------------------------------------------------ weights
    @property
    def params(self):
        """The params pytree being served (device arrays on the first replica's mesh)."""
        return self.executor.params

    def update_weights(self, params, abort_in_flight: bool = False) -> None:
        """Serve ``params`` from the next step on; same leaves, shapes and dtypes as ``self.params``.

        Nothing compiles: the executables take the params as an argument. Leaves on other devices
        or shardings are copied onto each replica's (device to device). Requests in flight continue
        on the new weights with the KV they already have, unless ``abort_in_flight``. The prefix
        cache is emptied: its KV was computed by the old weights. A mismatch raises ``ValueError``
        naming the leaf (every replica is checked first), and the old weights stay in service.
        """
        if self.config.quantization is not None:
            raise ValueError(f"update_weights: not supported with quantization={self.config.quantization!r} "
                             "(the served leaves are quantized; start the engine unquantized)")
        for replica in self.replicas:
            replica.executor.check_weights(params)
        if abort_in_flight:
            for request_id in self.output_processor.request_ids():
                self.abort_request(request_id)
        for replica in self.replicas:
            replica.executor.update_weights(params)
            replica.scheduler.invalidate_prefix_cache()

    # ------------------------------------------------------------------ counters
    def stats(self) -> dict:
        schedulers = [replica.scheduler for replica in self.replicas]
        stats = {
            "num_steps": self.num_steps,
            "tokens_per_step": list(self.tokens_per_step),  # the most recent 10,000 steps
            "prefix_cache_hit_tokens": sum(s.prefix_cache_hit_tokens for s in schedulers),
            "num_preemptions": sum(s.num_preemptions for s in schedulers),
            "pages_in_use": sum(s.allocator.num_used_pages for s in schedulers),
            "pages_total": sum(r.executor.num_pages for r in self.replicas),
            "num_unfinished": self.num_unfinished_requests(),
            "max_pages_per_seq": math.ceil(self.max_model_len / self.executor.page_size),
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "spec_acceptance_rate": (self.num_accepted_draft_tokens / self.num_draft_tokens
                                     if self.num_draft_tokens else None),
        }
        if len(schedulers) > 1:
            stats["pages_in_use_per_replica"] = [s.allocator.num_used_pages for s in schedulers]
        return stats
