"""The host-side state of one generation request.

A ``Request`` is the one record of a request's progress; each piece has one writer:

* the scheduler owns progress: the status (WAITING, RUNNING, FINISHED), ``num_computed_tokens``,
  ``page_ids`` and ``num_cached_tokens`` (from what the page allocator hands it; the allocator
  only reads a request), preemptions and the speculative back-off;
* the engine sets the request up (``max_tokens``, ``seed``, ``bad_words_token_ids``, the
  structured-output ``grammar``) and, with async scheduling, counts a token that a dispatched
  step will sample (``expect_output``), so the next step can be planned before that token
  reaches the host;
* the output processor (``engine.output_processor``) appends sampled tokens (``append_output``)
  and decides when the request stops; its text, logprobs and stop reason live there, not here.

Tokens only ever grow, so ``all_token_ids`` is a stable prefix over the request's life. That is
what lets a preempted request drop its KV pages and later recompute prompt + outputs from scratch
(or from the prefix cache).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from jaxrunner.sampling_params import SamplingParams


def check_request_id_free(request_id: str, live_ids) -> None:
    """The rule for ids: one names at most one live request (free again once it finished or was
    aborted). ``live_ids``: the ids the caller holds requests under (a set or a dict)."""
    if request_id in live_ids:
        raise ValueError(f"request_id: {request_id!r} is already in use")


class RequestStatus(enum.Enum):
    WAITING = "waiting"    # queued: new, or preempted and holding no pages
    RUNNING = "running"    # holds KV pages and is scheduled step after step
    FINISHED = "finished"  # done (stop, length, abort); its pages are released


# eq=False: requests are compared by identity (they sit in queues; field-wise equality would be
# both slow and wrong for two requests that happen to hold the same tokens).
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_index: int = 0  # set by the engine: the order requests came in (outputs keep it)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    # Tokens whose KV is in the cache. The next step computes from here.
    num_computed_tokens: int = 0
    # KV pages holding this request's tokens, in order: token i lives in page_ids[i // page_size].
    page_ids: list[int] = field(default_factory=list)
    # Tokens served by the prefix cache at the latest admission (not recomputed).
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # The output cap, the one the scheduler sizes the request by and the output processor stops it
    # at ("length"): sampling_params.max_tokens unless the engine lowers it (e.g. to what is left of
    # max_model_len after the prompt).
    max_tokens: int | None = None
    seed: int | None = None  # the sampler's 64-bit seed for this request, chosen by the engine
    # SamplingParams.bad_words as token sequences (the engine tokenizes them, as vLLM does).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # LoRA: the adapter it runs with (None: the base model), and what keys its prefix-cache pages apart
    # from other adapters' and the base model's (0: the base model's pages).
    lora_name: str | None = None
    cache_salt: int = 0
    # Structured output (``engine.structured_output``): the llguidance matcher, fed every output
    # token; the step input asks it for the tokens allowed next (``engine.step_input``).
    grammar: Any = None
    # Tokens sampled by a step still on the device: counted in num_tokens, not yet in
    # output_token_ids (the next step reads them on the device). At most one under async scheduling.
    num_pending_outputs: int = 0
    # Speculative decoding: tokens proposed for this request, and those the model accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # Decode steps to skip before proposing again, after a proposal that found or got nothing,
    # and how many such proposals came in a row (the back-off doubles with each).
    spec_backoff: int = 0
    num_failed_proposals: int = 0
    # Guesses for its next decode, made after the step that sampled its last token (the scheduler
    # takes them when it plans that decode).
    proposal: list[int] | None = None
    # When it arrived, was first scheduled and got its first token (time.monotonic(); None: not yet),
    # for the per-request latencies servers report (queue, prefill and decode time).
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        # Own the list: the caller's prompt must not change under the prefix-cache hashes.
        self.prompt_token_ids = list(self.prompt_token_ids)
        if self.max_tokens is None:
            self.max_tokens = self.sampling_params.max_tokens
        if self.max_tokens is None:  # SamplingParams.max_tokens=None: the engine resolves it
            raise ValueError(f"request {self.request_id!r}: max_tokens is None; pass the output cap "
                             "(LLMEngine.add_request sets it to what max_model_len leaves)")

    @property
    def needs_host_history(self) -> bool:
        """Whether sampling this request's next token reads its past tokens on the host: penalties,
        bad words of several tokens (their prefix is matched against the output), and structured
        output (the grammar matcher has consumed every past token).

        The rule that follows, stated here only: while such a request is queued, steps run
        synchronously (async scheduling waits for the step in flight, so no token of it is still
        on the device when the next step is packed)."""
        return self.grammar is not None or self._samples_from_outputs

    @property
    def _samples_from_outputs(self) -> bool:
        """Penalties and bad words of several tokens: sampling counts the outputs on the host."""
        return self.sampling_params.uses_penalties or any(len(word) > 1 for word in self.bad_words_token_ids)

    @property
    def may_speculate(self) -> bool:
        """Whether proposals may be verified for this request: not when its sampling depends on
        outputs counted on the host (penalties, bad words, ``min_tokens`` bans) or it wants prompt
        logprobs. Structured output may: each proposal is checked under the grammar's mask at its place."""
        sp = self.sampling_params
        return not self._samples_from_outputs and sp.prompt_logprobs is None and self.num_expected_outputs >= sp.min_tokens

    @property
    def wants_proposal(self) -> bool:
        """It may speculate and is not backing off: its next decode should be proposed for, which
        needs every past token on the host (the engine then waits for the step in flight)."""
        return self.may_speculate and self.spec_backoff == 0

    @property
    def can_speculate(self) -> bool:
        """It wants a proposal and every past token is on the host (the proposer reads them)."""
        return self.wants_proposal and self.num_pending_outputs == 0

    @property
    def skips_prefix_cache(self) -> bool:
        """Prompt logprobs need every prompt token computed, so (as in vLLM) no cache hit."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the outputs known on the host (a fresh list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt + outputs, counting outputs still on the device."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_outputs

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def num_expected_outputs(self) -> int:
        """Outputs known on the host plus those still on the device."""
        return len(self.output_token_ids) + self.num_pending_outputs

    def expect_output(self) -> None:
        """A dispatched step samples this request's next token; it arrives via ``append_output``."""
        self.num_pending_outputs += 1

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))
        self.num_pending_outputs = max(0, self.num_pending_outputs - 1)
