"""Output processing: what a request reports, and when its sampled tokens stop it (host side, no JAX).

For each request in the engine the processor keeps a ``RequestState``: the detokenizer (text, stop
strings, stream hold-back), the logprobs of each output token, the prompt logprobs, the cumulative
logprob and the stop reason. Progress stays on the ``Request`` (tokens, status, ``max_tokens``).
The processor's rules:

* a sampled token is appended with its logprobs, then the request may stop: on EOS (unless
  ``ignore_eos``), a ``stop_token_ids`` entry or a stop string, once ``min_tokens`` outputs exist
  (stop reason: the token id, the string, or None for EOS), when the request's structured-output
  grammar can go no further ("stop"), and at ``Request.max_tokens`` outputs ("length");
* with speculative decoding the rows verifying proposals come first: each token is kept, and the
  walk goes on only while it equals the proposal its row checked;
* prompt logprobs arrive chunk by chunk: the row of prompt position p holds those of the token at
  p + 1, and a position computed twice (after a preemption) keeps its first record;
* an output is vLLM's ``RequestOutput`` with one ``CompletionOutput``; a request's state is
  dropped with its last output, or when it is aborted.

The engine orchestrates: it fetches a step's sampled arrays (the runner's host copies, indexed by
row), hands each sampled chunk's rows here, and tells the scheduler when a request stopped.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Iterable, Sequence

from jaxrunner.engine.detokenizer import IncrementalDetokenizer
from jaxrunner.engine.request import Request
from jaxrunner.executor_protocol import SampledRows, accepted_tokens
from jaxrunner.outputs import CompletionOutput, Logprob, LogprobsDict, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from jaxrunner.engine.scheduler import ScheduledChunk

_logger = logging.getLogger("jaxrunner")


@dataclasses.dataclass
class RequestState:
    """The output side of one request: its text state and what it reports."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    logprobs: list[LogprobsDict] | None  # per output token, with SamplingParams.logprobs
    # per prompt position (None at 0 and until computed), with SamplingParams.prompt_logprobs
    prompt_logprobs: list[LogprobsDict | None] | None = None
    cumulative_logprob: float = 0.0  # reported with SamplingParams.logprobs only (the sampler computes it then)
    stop_reason: int | str | None = None


class OutputProcessor:
    """The output-side state of every request in one engine, and the rules that fill it."""

    def __init__(self, tokenizer, eos_token_ids: Iterable[int]):
        self.tokenizer = tokenizer  # None: outputs carry token ids, no text
        self.eos_token_ids = frozenset(eos_token_ids)
        self._states: dict[str, RequestState] = {}

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request, prompt: str | None = None) -> None:
        """Start tracking ``request`` (already queued in the scheduler, which refuses an id in use)."""
        params = request.sampling_params
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens,
                                             params.stop, params.include_stop_str_in_output)
        self._states[request.request_id] = RequestState(
            request, prompt, detokenizer, [] if params.logprobs is not None else None,
            [None] * request.num_prompt_tokens if params.prompt_logprobs is not None else None)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Forget the request; its final output (the text so far, ``finish_reason="abort"``), or None
        when it is not tracked."""
        state = self._states.pop(request_id, None)
        return None if state is None else self._output(state, finished=True, finish_reason="abort")

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def request_ids(self) -> list[str]:
        return list(self._states)

    # ------------------------------------------------------------------ sampled tokens
    def append_sampled(self, request: Request, sampled: SampledRows, rows: Sequence[int],
                       draft_token_ids: Sequence[int] = ()) -> tuple[int, str | None]:
        """Append the tokens of ``rows`` of ``sampled`` (the runner's host arrays): first the rows verifying ``draft_token_ids``, one
        each, then the chunk's own. The walk stops at a finish or at the first token that differs
        from the proposal its row checked. Returns how many proposals were accepted and the finish
        reason ("stop", "length") or None."""
        state = self._states[request.request_id]
        gained = accepted_tokens(draft_token_ids, sampled.tokens[list(rows)])
        for index, row in enumerate(rows[:len(gained)]):
            _, reason = self._append_token(state, sampled, row)
            if reason is not None:
                return index, reason
        return len(gained) - 1, None

    def _append_token(self, state: RequestState, sampled: SampledRows, row: int) -> tuple[int, str | None]:
        """Append the token of ``row`` with its logprobs; returns it and the finish reason (or None)."""
        request = state.request
        token = int(sampled.tokens[row])
        request.append_output(token)
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        delta_len = state.detokenizer.append(token)
        if state.logprobs is not None:
            logprob = float(sampled.logprobs[row])
            state.cumulative_logprob += logprob
            state.logprobs.append(self._logprobs_dict(
                token, logprob, int(sampled.ranks[row]), request.sampling_params.logprobs,
                sampled.top_ids[row], sampled.top_logprobs[row]))
        if request.grammar is not None and not request.grammar.consume_token(token):
            # the sampler only draws tokens the grammar allowed: this is a defect, not the user's
            _logger.error("request %r: the grammar refused sampled token %d (%s); the request is stopped",
                          request.request_id, token, request.grammar.get_error())
            return token, "abort"
        return token, self._finish_reason(state, token, delta_len)

    def _finish_reason(self, state: RequestState, token: int, delta_len: int) -> str | None:
        """"stop" (recording the stop reason), "length" or None, after ``token`` was appended."""
        request, params = state.request, state.request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if (not params.ignore_eos and token in self.eos_token_ids) or token in (params.stop_token_ids or ()):
                state.stop_reason = None if token in self.eos_token_ids else token
                return "stop"
            stop = state.detokenizer.find_stop(delta_len)
            if stop is not None:
                state.stop_reason = stop
                return "stop"
        if request.grammar is not None and request.grammar.is_stopped():
            return "stop"  # the constraint is complete: nothing but EOS could follow
        if request.num_output_tokens >= request.max_tokens:
            return "length"
        return None

    # ------------------------------------------------------------------ prompt logprobs
    def accept_prompt_logprobs(self, chunks: Iterable[ScheduledChunk], sampled: SampledRows) -> None:
        """Record the prompt logprobs a step computed for its ``chunks`` (in batch order; their query
        rows follow one another from row 0 of ``sampled``'s ``prompt_*`` arrays)."""
        cursor = 0
        for chunk in chunks:
            state = self._states.get(chunk.request.request_id)
            if state is not None and state.prompt_logprobs is not None:
                self._accept_chunk_prompt_logprobs(state, chunk, sampled, cursor)
            cursor += chunk.num_tokens

    def _accept_chunk_prompt_logprobs(self, state: RequestState, chunk: ScheduledChunk, sampled: SampledRows,
                                      cursor: int) -> None:
        prompt, k = state.request.prompt_token_ids, state.request.sampling_params.prompt_logprobs
        for position in range(chunk.start, min(chunk.end, len(prompt) - 1)):
            row = cursor + position - chunk.start
            if state.prompt_logprobs[position + 1] is None:
                state.prompt_logprobs[position + 1] = self._logprobs_dict(
                    prompt[position + 1], float(sampled.prompt_logprobs[row]), int(sampled.prompt_ranks[row]),
                    k, sampled.prompt_top_ids[row], sampled.prompt_top_logprobs[row])

    def _logprobs_dict(self, token: int, logprob: float, rank: int, k: int, top_ids, top_logprobs) -> LogprobsDict:
        """vLLM's shape: the actual token first, then the top ``k`` (ranks 1..k)."""
        entries = {token: Logprob(logprob, rank, self._decode_token(token))}
        for rank_in_top, (top, value) in enumerate(zip(top_ids[:k], top_logprobs[:k]), start=1):
            entries.setdefault(int(top), Logprob(float(value), rank_in_top, self._decode_token(int(top))))
        return entries

    def _decode_token(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])

    # ------------------------------------------------------------------ outputs
    def make_output(self, request: Request) -> RequestOutput:
        """The request's output now: its text so far (held back while a stop string may still be
        forming) and the text added since its previous output. Its state goes with its last one."""
        state = self._states[request.request_id]
        if request.is_finished:
            del self._states[request.request_id]
        return self._output(state, request.is_finished, request.finish_reason)

    def _output(self, state: RequestState, finished: bool, finish_reason: str | None) -> RequestOutput:
        request = state.request
        delta = state.detokenizer.take_delta(finished=finished)
        completion = CompletionOutput(
            index=0, text=state.detokenizer.output_text, token_ids=list(request.output_token_ids),
            cumulative_logprob=None if state.logprobs is None else state.cumulative_logprob, logprobs=state.logprobs,
            finish_reason=finish_reason, stop_reason=state.stop_reason)
        metrics = RequestMetrics(request.arrival_time, request.first_scheduled_time, request.first_token_time,
                                 time.monotonic() if finished else None)
        return RequestOutput(request.request_id, state.prompt, list(request.prompt_token_ids), [completion],
                             finished=finished, metrics=metrics, num_cached_tokens=request.num_cached_tokens,
                             delta_text=delta, prompt_logprobs=state.prompt_logprobs,
                             num_draft_tokens=request.num_draft_tokens,
                             num_accepted_draft_tokens=request.num_accepted_draft_tokens)
