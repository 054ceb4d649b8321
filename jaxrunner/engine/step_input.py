"""A scheduler's plan → the ``StepInput`` the executor receives (host side, no JAX).

This is the one place where requests become the messages of the executor protocol
(``jaxrunner/executor_protocol.py``): each scheduled chunk becomes a ``SequenceInput`` holding its
token ids, pages, context length, prompt-logprob targets, proposals (and, when the next decode should
get guesses, the history a draft model guesses from) and, when it samples, the
``SamplingRow`` of its next token with the engine's rules applied (bans under ``min_tokens`` and
bad words, structured output's token bitmask).

Async scheduling: a token sampled by the step still on the device is not known here. Its slot in
``token_ids`` holds 0 and ``feed_rows`` (request id → its row in the step in flight) names the row
of that step's sampled tokens that the runner reads instead.
"""
from __future__ import annotations

import numpy as np

from jaxrunner.engine.request import Request
from jaxrunner.engine.scheduler import ScheduledChunk, StepPlan
from jaxrunner.engine.structured_output import GrammarCompiler
from jaxrunner.executor_protocol import NO_FEED, NO_LOGPROBS, NO_TOKEN, SamplingRow, SequenceInput, StepInput


def build_step_input(plan: StepPlan, eos_token_ids, grammars: GrammarCompiler | None = None,
                     feed_rows: dict[str, int] | None = None, drafts: bool = False,
                     adapter_slots: dict[str, int] | None = None) -> StepInput:
    """The plan's chunks, back to back. ``grammars`` fills the token bitmasks of constrained
    requests (their matchers have seen every past token: such requests keep steps synchronous).
    ``drafts``: the executor guesses after the step (a draft model), so a chunk asking for guesses
    carries the history to guess from; n-gram guesses are made on this side and need none.
    ``adapter_slots``: the device slot of each LoRA adapter the plan's requests run with."""
    return StepInput(tuple(_sequence_input(chunk, eos_token_ids, grammars, feed_rows, drafts, adapter_slots or {})
                           for chunk in plan.chunks))


def _sequence_input(chunk: ScheduledChunk, eos_token_ids, grammars, feed_rows, drafts: bool,
                    adapter_slots: dict[str, int]) -> SequenceInput:
    request = chunk.request
    token_ids, fed = _tokens(chunk, feed_rows)
    next_mask, draft_masks = _bitmasks(chunk, grammars)
    sampling = sampling_row(request, eos_token_ids, next_mask) if chunk.sample else None
    return SequenceInput(token_ids=token_ids, feed_rows=fed, kv_len=chunk.end,
                         pages=np.asarray(request.page_ids, np.int32), prompt_targets=_prompt_targets(chunk),
                         sampling=sampling, num_drafts=len(chunk.draft_token_ids), draft_bitmasks=draft_masks,
                         request_id=request.request_id, propose=chunk.propose,
                         history=np.asarray(request.all_token_ids, np.int32) if drafts and chunk.propose else None,
                         lora_slot=0 if request.lora_name is None else adapter_slots[request.lora_name])


def _tokens(chunk: ScheduledChunk, feed_rows) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the chunk (known ones, then its proposals) and their feed rows: a last known
    token still on the device is read from its row of the step that samples it."""
    request, known_count = chunk.request, chunk.num_known_tokens
    known = request.all_token_ids[chunk.start:chunk.start + known_count]
    token_ids = np.zeros(chunk.num_tokens, np.int32)
    token_ids[:len(known)] = known
    token_ids[known_count:] = chunk.draft_token_ids
    fed = np.full(chunk.num_tokens, NO_FEED, np.int32)
    if len(known) == known_count:
        return token_ids, fed
    if known_count - len(known) != 1 or feed_rows is None or request.request_id not in feed_rows:
        raise RuntimeError(f"request {request.request_id!r}: {known_count - len(known)} of its tokens are on the "
                           "device and no step in flight samples them")
    fed[known_count - 1] = feed_rows[request.request_id]
    return token_ids, fed


def _prompt_targets(chunk: ScheduledChunk) -> np.ndarray | None:
    """For prompt logprobs: each row of a prompt position p gets the prompt token at p + 1."""
    request, start = chunk.request, chunk.start
    prompt = request.prompt_token_ids
    stop = min(chunk.end, len(prompt) - 1)
    if request.sampling_params.prompt_logprobs is None or start >= stop:
        return None
    targets = np.full(chunk.num_tokens, NO_TOKEN, np.int32)
    targets[:stop - start] = prompt[start + 1:stop + 1]
    return targets


def _bitmasks(chunk: ScheduledChunk, grammars) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(the allowed next tokens, one row per proposal of the tokens allowed in its place) of a
    constrained request this chunk samples for; (None, None) for a free one."""
    request = chunk.request
    if request.grammar is None or not chunk.sample:
        return None, None
    if not chunk.draft_token_ids:
        return grammars.fill_bitmask(request.grammar), None
    *drafts, last = grammars.fill_bitmasks_along(request.grammar, chunk.draft_token_ids)
    return last, np.stack(drafts)


def sampling_row(request: Request, eos_token_ids=(), token_bitmask: np.ndarray | None = None) -> SamplingRow:
    """The settings of ``request``'s next token."""
    sp = request.sampling_params
    if request.needs_host_history and request.num_pending_outputs:
        raise RuntimeError(f"request {request.request_id!r}: penalties and bad words need every past token on "
                           "the host, but one is still on the device (async scheduling must wait for it)")
    bias = sp.logit_bias or {}
    return SamplingRow(temperature=0.0 if sp.greedy else sp.temperature, top_k=max(sp.top_k, 0), top_p=sp.top_p,
                       min_p=sp.min_p, repetition_penalty=sp.repetition_penalty, presence_penalty=sp.presence_penalty,
                       frequency_penalty=sp.frequency_penalty, seeds=request.seed & 0xFFFFFFFF,
                       seeds_high=request.seed >> 32, prompt_lens=request.num_prompt_tokens,
                       history=request.all_token_ids if sp.uses_penalties else (),
                       banned=banned_tokens(request, eos_token_ids), allowed_token_ids=sp.allowed_token_ids or (),
                       logit_bias_ids=list(bias), logit_bias_values=list(bias.values()),
                       num_logprobs=NO_LOGPROBS if sp.logprobs is None else sp.logprobs,
                       token_bitmask=() if token_bitmask is None else token_bitmask)


def banned_tokens(request: Request, eos_token_ids) -> list[int]:
    """Tokens the request may not sample next: EOS and stop ids before ``min_tokens``, and, as in
    vLLM, the last token of each bad word whose other tokens are the end of the output so far
    (a one-token bad word is always banned). ``LLMEngine.check_sampling_params`` keeps their
    number within the executor's ``limits.max_banned_tokens``."""
    sp = request.sampling_params
    banned = set()
    if request.num_expected_outputs < sp.min_tokens:
        banned.update(sp.stop_token_ids or ())
        if not sp.ignore_eos:
            banned.update(eos_token_ids)
    outputs = request.output_token_ids
    for word in request.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(outputs) and outputs[len(outputs) - len(prefix):] == prefix:
            banned.add(word[-1])
    return sorted(banned)
