"""Continuous batching: which tokens of which requests the next step computes.

Each step gets a token budget (``max_num_batched_tokens``) and at most ``max_num_seqs`` requests.
A running request needs ``num_tokens - num_computed_tokens`` new tokens: 1 for a decode, more
for a prompt (or a recompute) still being prefilled. The order is:

1. running decodes, so generation keeps flowing while long prompts are prefilled;
2. running requests still prefilling, in chunks that fit the budget left;
3. waiting requests, first come first served, each starting from its cached prefix.

When a running request needs a page and none is left, the most recently admitted running request
is preempted: it drops its pages and goes back to the front of the queue with its output tokens,
to be recomputed later (often mostly from the prefix cache). The oldest request never has to
yield, which is why scheduling always makes progress, and ``add`` refuses requests that could not
fit even alone.

The scheduler counts tokens and owns each request's progress: its status, ``num_computed_tokens``
and page list. The page allocator hands pages out (or says None when it has too few) and the
scheduler records them on the request. The engine's output processor appends sampled tokens and
checks stop conditions; the engine then calls ``finish``. Under async scheduling a request's last sampled token may still be on the device
(``Request.num_pending_outputs``): it counts as a token to compute like any other, and a request
whose pending token is its last (``max_tokens``) is not scheduled again.

Speculative decoding (``speculative``): planning a step also picks, among its chunks that sample,
the requests that should get guesses for their next decode (``ScheduledChunk.propose``: at most
``max_num_spec_seqs``, in admission order, none while backing off). The guesses are made after
the step, by whoever proposes (the engine's n-gram lookup, or the runner's draft model behind
``Executor.fetch``), and handed back with ``receive_proposal``; the scheduler runs no proposer.
The next plan gives a decode its guesses as ``ScheduledChunk.draft_token_ids``, computed in the
same chunk (1 + k query tokens, a small prefill chunk, so it takes a prefill slot), and they count
against the token budget. Pages are only taken for them when free ones are there (no preemption
for a guess). ``update`` counts only the known tokens as computed; the engine reports the accepted
guesses with ``accept_drafts``, which also hands back the pages of rejected positions.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from jaxrunner.engine.page_allocator import PageAllocator, cdiv
from jaxrunner.engine.request import Request, RequestStatus, check_request_id_free

# Decodes a request skips proposals for after a lookup found nothing or every proposal was
# rejected; doubled after each further failure in a row, up to the maximum.
SPEC_BACKOFF_STEPS = 8
MAX_SPEC_BACKOFF_STEPS = 32


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    page_size: int
    num_pages: int  # including the scratch page
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # Most chunks of more than one token in a step (None: no limit). The CPU attention runs
    # decodes and prefill chunks in separate passes and sizes the prefill pass by this bound.
    max_num_prefill_seqs: int | None = None
    # Most requests whose proposals are verified in one step (their rows are a fixed bucket width).
    max_num_spec_seqs: int = 0
    # LoRA: most distinct adapters among the running requests (the device's slots); 0: no adapters.
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"SchedulerConfig.{name}={value!r}: must be at least 1")
        if self.max_num_prefill_seqs is not None and self.max_num_prefill_seqs < 1:
            raise ValueError(f"SchedulerConfig.max_num_prefill_seqs={self.max_num_prefill_seqs!r}: must be at "
                             "least 1 (or None for no limit)")
        if self.num_pages < 2:
            raise ValueError(f"SchedulerConfig.num_pages={self.num_pages!r}: must be at least 2 "
                             "(page 0 is the scratch page)")


@dataclass
class ScheduledChunk:
    """Compute tokens ``[start, start + num_tokens)`` of ``request`` in this step.

    ``sample`` is true when the chunk reaches the end of the request's known tokens, so the row of
    its last token is sampled. It is fixed when the chunk is planned: it stays right after the
    engine appends the sampled token. ``draft_token_ids`` are proposed tokens computed after the
    known ones (counted in ``num_tokens``); each of their rows is sampled too, to verify them.
    """
    request: Request
    start: int
    num_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)
    sample: bool = field(init=False)
    propose: int = 0  # guesses wanted after this step for the request's next decode (at most)

    def __post_init__(self) -> None:
        self.sample = self.start + self.num_known_tokens == self.request.num_tokens

    @property
    def num_known_tokens(self) -> int:
        return self.num_tokens - len(self.draft_token_ids)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # preempted while planning this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def has_drafts(self) -> bool:
        """Some chunk verifies proposals: how many are accepted is known only once it ran."""
        return any(chunk.draft_token_ids for chunk in self.chunks)


class _StepBuilder:
    """A step being planned: its chunks (one per request) and the token budget left."""

    def __init__(self, token_budget: int, max_prefills: int | None, max_spec_seqs: int = 0):
        self.token_budget = token_budget
        self.max_prefills = max_prefills
        self.num_prefills = 0  # chunks of more than one token
        self.spec_seqs_left = max_spec_seqs
        self.chunks: dict[Request, ScheduledChunk] = {}  # insertion order is batch order
        self.preempted: list[Request] = []

    def has_prefill_slot(self, num_tokens: int) -> bool:
        return num_tokens <= 1 or self.max_prefills is None or self.num_prefills < self.max_prefills

    def add(self, request: Request, num_tokens: int, draft_token_ids: list[int] | None = None) -> None:
        draft = list(draft_token_ids or ())
        num_tokens += len(draft)
        self.chunks[request] = ScheduledChunk(request, request.num_computed_tokens, num_tokens, draft)
        self.token_budget -= num_tokens
        self.num_prefills += num_tokens > 1
        self.spec_seqs_left -= bool(draft)

    def remove(self, request: Request) -> None:
        chunk = self.chunks.pop(request, None)
        if chunk is not None:
            self.token_budget += chunk.num_tokens
            self.num_prefills -= chunk.num_tokens > 1
            self.spec_seqs_left += bool(chunk.draft_token_ids)

    def build(self) -> StepPlan:
        return StepPlan(list(self.chunks.values()), self.preempted)


def _back_off(request: Request) -> None:
    """No proposals for the request's next decodes: 8, 16, ... after each failure in a row."""
    request.spec_backoff = min(SPEC_BACKOFF_STEPS << request.num_failed_proposals, MAX_SPEC_BACKOFF_STEPS)
    request.num_failed_proposals += 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator | None = None, speculative: bool = False):
        """``speculative``: plan guesses for decodes (speculative decoding; see the module docstring)."""
        if allocator is None:
            allocator = PageAllocator(config.num_pages, config.page_size,
                                      config.enable_prefix_caching)
        if (allocator.num_pages, allocator.page_size) != (config.num_pages, config.page_size):
            raise ValueError(
                f"allocator has {allocator.num_pages} pages of {allocator.page_size} tokens, "
                f"config says {config.num_pages} of {config.page_size}")
        self.config = config
        self.allocator = allocator
        self.speculative = speculative
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self._unfinished: dict[str, Request] = {}

        self.num_steps = 0
        self.num_preemptions = 0
        self.prefix_cache_hit_tokens = 0      # tokens served from the cache, over all admissions
        self.prefix_cache_queried_tokens = 0  # tokens looked up, over all admissions
        self.last_step_num_tokens = 0

    # -- requests in and out ------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request; ValueError when it could never be scheduled."""
        self._check_can_ever_run(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self._unfinished[request.request_id] = request

    def finish(self, request: Request, reason: str) -> None:
        """Mark the request finished and free its pages now (its full pages stay cached)."""
        if request.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._free_pages(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._unfinished[request.request_id]
        request.proposal = None

    def abort(self, request_id: str) -> Request | None:
        """Finish the request with reason "abort", wherever it is; None when it is unknown."""
        request = self._unfinished.get(request_id)
        if request is not None:
            self.finish(request, "abort")
        return request

    def invalidate_prefix_cache(self) -> None:
        """New weights: no cached page may be reused (see ``PageAllocator.invalidate_prefix_cache``)."""
        self.allocator.invalidate_prefix_cache(request.request_id for request in self.running)

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def get_request(self, request_id: str) -> Request | None:
        return self._unfinished.get(request_id)

    # -- planning a step ----------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        step = _StepBuilder(self.config.max_num_batched_tokens, self.config.max_num_prefill_seqs,
                            self.config.max_num_spec_seqs if self.speculative else 0)
        self._schedule_running(step)
        if not step.preempted:  # pages are short: don't let newcomers take what was just freed
            self._admit_waiting(step)
        plan = step.build()
        if self.speculative:
            self._ask_for_proposals(plan)
        if not plan.is_empty:
            self.num_steps += 1
        self.last_step_num_tokens = plan.num_batched_tokens
        return plan

    def update(self, plan: StepPlan) -> None:
        """The step ran: its chunks' tokens are computed. Register pages that became full."""
        for chunk in plan.chunks:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue  # finished or aborted after the plan was made
            if chunk.start != request.num_computed_tokens:
                raise RuntimeError(f"plan for {request.request_id!r} is stale "
                                   "(update called twice, or out of order?)")
            request.num_computed_tokens += chunk.num_known_tokens
            self.allocator.commit_full_pages(request)

    def accept_drafts(self, chunk: ScheduledChunk, num_accepted: int) -> None:
        """The first ``num_accepted`` proposals of ``chunk`` were right (the engine appended them as
        outputs): their KV is computed. The rest are rolled back: not computed, their pages freed."""
        request = chunk.request
        if not 0 <= num_accepted <= len(chunk.draft_token_ids):
            raise ValueError(f"num_accepted={num_accepted}: valid 0..{len(chunk.draft_token_ids)}")
        request.num_draft_tokens += len(chunk.draft_token_ids)
        request.num_accepted_draft_tokens += num_accepted
        if num_accepted == 0:
            _back_off(request)
        else:
            request.num_failed_proposals = 0
        if request.status is not RequestStatus.RUNNING:
            return  # finished on one of this step's tokens: its pages are already freed
        request.num_computed_tokens += num_accepted
        self.allocator.commit_full_pages(request)
        request.page_ids = self.allocator.release_tail(request, request.num_tokens)

    def receive_proposal(self, request: Request, draft: list[int]) -> None:
        """The guesses asked for by a chunk's ``propose``, made after its step: for the request's next
        decode. None found backs it off for ``SPEC_BACKOFF_STEPS`` decodes (more after repeated
        failures), so that text with nothing to copy runs like non-speculative decoding (async
        scheduling included) most of the time."""
        if draft:
            request.proposal = list(draft)
        else:
            request.proposal = None
            _back_off(request)

    def _schedule_running(self, step: _StepBuilder) -> None:
        # sorted() is stable: decodes first, each group in admission order.
        for request in sorted(self.running, key=self._is_prefilling):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop to make room
            if request.num_expected_outputs >= request.max_tokens:
                continue  # its last token is still on the device: it finishes by length on arrival
            num_new = self._chunk_size(self._num_new_tokens(request), step.token_budget)
            if num_new == 0 or not step.has_prefill_slot(num_new) or not self._make_room(request, num_new, step):
                continue
            draft = self._take_proposal(request, step) if num_new == 1 else []
            request.proposal = None  # made for this decode only: the next one gets fresh guesses
            step.add(request, num_new, draft)

    def _ask_for_proposals(self, plan: StepPlan) -> None:
        """Mark the chunks whose requests should get guesses for their next decode (``propose``):
        those that sample and can speculate, at most ``max_num_spec_seqs`` in admission order,
        skipping (and counting down) those backing off. Each guesses at most what the output cap
        leaves after this step's token."""
        sampling = {chunk.request: chunk for chunk in plan.chunks if chunk.sample}
        asked = 0
        for request in self.running:
            chunk = sampling.get(request)
            if chunk is None or asked == self.config.max_num_spec_seqs:
                continue
            if request.spec_backoff > 0:
                request.spec_backoff -= 1
                continue
            limit = min(self.config.max_num_batched_tokens - 1,
                        request.max_tokens - request.num_expected_outputs - 2)
            if request.can_speculate and limit > 0:
                chunk.propose = limit
                asked += 1

    def _take_proposal(self, request: Request, step: _StepBuilder) -> list[int]:
        """As much of the request's proposal as its output cap, the budget, a prefill slot and free
        pages allow (none when any of them is short; their pages are taken here)."""
        draft = request.proposal
        if not draft or step.spec_seqs_left <= 0 or not step.has_prefill_slot(2):
            return []
        draft = draft[:min(step.token_budget, request.max_tokens - request.num_expected_outputs) - 1]
        if not draft:
            return []
        pages = self.allocator.allocate(request, 1 + len(draft))
        if pages is None:
            return []
        request.page_ids += pages
        return draft

    def _admit_waiting(self, step: _StepBuilder) -> None:
        page_size = self.config.page_size
        while len(self.running) < self.config.max_num_seqs and step.token_budget > 0:
            request = self._next_admissible()
            if request is None:
                break
            cached_pages = self.allocator.find_cached_prefix(request)
            num_cached = len(cached_pages) * page_size
            num_new = self._chunk_size(request.num_tokens - num_cached, step.token_budget)
            pages = None
            if num_new > 0 and step.has_prefill_slot(num_new):
                pages = self.allocator.admit(request, cached_pages, num_cached + num_new)
            if pages is None:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.remove(request)
            request.page_ids = pages
            request.num_cached_tokens = request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            step.add(request, num_new)
            self.prefix_cache_hit_tokens += num_cached
            self.prefix_cache_queried_tokens += request.num_tokens

    def _next_admissible(self) -> Request | None:
        """The first waiting request whose adapter fits beside the running ones' (at most
        ``max_loras`` distinct adapters run at once); those whose adapter does not wait, as vLLM's."""
        running = {request.lora_name for request in self.running if request.lora_name is not None}
        for request in self.waiting:
            if request.lora_name is None or request.lora_name in running or len(running) < self.config.max_loras:
                return request
        return None

    def adapters_in_use(self) -> set[str]:
        """The adapters of the unfinished requests (running or waiting)."""
        requests = list(self._unfinished.values())  # one C-level copy: callers' threads validate while the loop runs
        return {request.lora_name for request in requests if request.lora_name is not None}

    def _make_room(self, request: Request, num_new: int, step: _StepBuilder) -> bool:
        """Give ``request`` pages for ``num_new`` more tokens, preempting the newest running requests
        until the pool has them.

        False when ``request`` itself had to go (it was the newest one left).
        """
        while (pages := self.allocator.allocate(request, num_new)) is None:
            victim = self.running[-1]
            self._preempt(victim, step)
            if victim is request:
                return False
        request.page_ids += pages
        return True

    def _preempt(self, request: Request, step: _StepBuilder) -> None:
        """Drop the request's pages and queue it first; its outputs are kept and recomputed."""
        step.remove(request)
        step.preempted.append(request)
        self.running.remove(request)
        self._free_pages(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.proposal = None
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _free_pages(self, request: Request) -> None:
        self.allocator.free(request)
        request.page_ids = []

    def _chunk_size(self, num_remaining: int, token_budget: int) -> int:
        """How many of ``num_remaining`` tokens to compute now (0: wait for a later step).

        Without chunked prefill all of them go in one step or none do. The one exception is the
        recompute of a preempted request whose prompt + outputs outgrew the whole budget: it could
        never run otherwise, so it is split like a chunked prefill.
        """
        chunking = (self.config.enable_chunked_prefill
                    or num_remaining > self.config.max_num_batched_tokens)
        if chunking:
            return min(num_remaining, token_budget)
        return num_remaining if num_remaining <= token_budget else 0

    @staticmethod
    def _num_new_tokens(request: Request) -> int:
        return request.num_tokens - request.num_computed_tokens

    def _is_prefilling(self, request: Request) -> bool:
        return self._num_new_tokens(request) > 1

    # -- admission checks ---------------------------------------------------------------------

    def _check_can_ever_run(self, request: Request) -> None:
        """Reject requests whose id is taken or that could not be scheduled even alone."""
        check_request_id_free(request.request_id, self._unfinished)
        if request.is_finished:
            raise ValueError(f"request {request.request_id!r} is already finished")
        try:
            self.check_fits(request.num_prompt_tokens, request.max_tokens)
        except ValueError as err:
            raise ValueError(f"request {request.request_id!r}: {err}") from None

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """ValueError when a request with this many prompt tokens and this output cap could never be
        scheduled, even with the engine to itself. Reads only the configuration, so front ends call
        it (through ``LLMEngine.validate_request``) from any thread before they queue anything."""
        max_model_len = self.config.max_model_len
        if num_prompt_tokens == 0:
            raise ValueError("prompt: empty prompt (no tokens)")
        if num_prompt_tokens >= max_model_len:
            raise ValueError(f"prompt: {num_prompt_tokens} tokens leave no room to generate within "
                             f"max_model_len={max_model_len}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens: {max_tokens} leaves nothing to generate "
                             f"(prompt {num_prompt_tokens} tokens, max_model_len={max_model_len})")
        max_len = num_prompt_tokens + max_tokens
        if max_len > max_model_len:
            raise ValueError(f"max_tokens: {max_tokens} after a prompt of {num_prompt_tokens} tokens makes "
                             f"{max_len}, beyond max_model_len={max_model_len}")
        # The last sampled token is never fed back, so at most max_len - 1 tokens need KV.
        pages = cdiv(max_len - 1, self.config.page_size)
        if pages > self.allocator.num_usable_pages:
            raise ValueError(f"prompt: {num_prompt_tokens} tokens and up to {max_tokens} outputs need {pages} "
                             f"KV pages, the cache has {self.allocator.num_usable_pages}")
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and num_prompt_tokens > budget:
            raise ValueError(f"prompt: {num_prompt_tokens} tokens exceed max_num_batched_tokens={budget} "
                             "and chunked prefill is off")

    # -- introspection ------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_used_pages(self) -> int:
        return self.allocator.num_used_pages

    def check_invariants(self) -> None:
        """Raise AssertionError when queues, statuses and pages disagree (used by tests)."""
        self.allocator.check_invariants(owners=self.running)
        _check(len(self.running) <= self.config.max_num_seqs, "more running than max_num_seqs")
        for request in self.running:
            _check(request.status is RequestStatus.RUNNING, f"{request.request_id} not RUNNING")
        for request in self.waiting:
            _check(request.status is RequestStatus.WAITING, f"{request.request_id} not WAITING")
            _check(not request.page_ids, f"waiting {request.request_id} holds pages")
            _check(request.num_computed_tokens == 0, f"waiting {request.request_id} computed")
        queued = [*self.running, *self.waiting]
        _check(len({id(r) for r in queued}) == len(queued), "a request is queued twice")
        _check({r.request_id for r in queued} == set(self._unfinished),
               "the unfinished set disagrees with the queues")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)
