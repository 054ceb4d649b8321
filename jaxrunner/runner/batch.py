"""StepPlan (host objects) → the step's ``StepBatch`` at a bucket's shape.

Each scheduled chunk becomes one ``step_batch.SequenceRows`` (its tokens, positions' end, pages,
prompt-logprob targets, sampling settings and proposals) and ``step_batch.lay_out`` places them;
warm-up's dummies go through the same layout, so what serving sends is what warm-up compiled.

Async scheduling: a token sampled by the step still on the device is not known here. Its slot in
``token_ids`` holds 0 and ``feed_rows`` names the row of the previous step's sampled tokens that the
jitted step reads instead (``NO_FEED`` everywhere else).

Speculative decoding: a chunk's proposed tokens follow its known ones; ``lay_out`` gives each a
draft row (the token row it reads, its sequence, the position it samples, the proposal it checks).
The sampled outputs hold the sequences' own rows first, then the draft rows in chunk order.
"""
from __future__ import annotations

import numpy as np

from jaxrunner.runner.buckets import Bucket
from jaxrunner.runner.sampler import NO_TOKEN
from jaxrunner.runner.step_batch import NO_FEED, SamplingRow, SequenceRows, StepBatch, lay_out


def pack_step(chunks, bucket: Bucket, page_size: int, vocab_size: int, eos_token_ids=(),
              max_prefill_seqs: int | None = None, feed_rows: dict | None = None) -> StepBatch:
    """Lay out the scheduled chunks (decodes and prefill chunks alike) back to back.

    ``max_prefill_seqs`` is the bound the executables were compiled with: a plan that breaks it
    would silently drop attention blocks, so it is refused here. ``feed_rows`` maps a request whose
    last token is still on the device to its row in the step that samples it (async scheduling).
    """
    prefills = sum(chunk.num_tokens > 1 for chunk in chunks)
    if max_prefill_seqs is not None and prefills > max_prefill_seqs:
        raise RuntimeError(f"step plan has {prefills} prefill chunks, the executables allow {max_prefill_seqs}")
    return lay_out(bucket, page_size, vocab_size, [_sequence_rows(chunk, eos_token_ids, feed_rows) for chunk in chunks])


def _sequence_rows(chunk, eos_token_ids, feed_rows) -> SequenceRows:
    request = chunk.request
    token_ids, fed = _tokens(chunk, feed_rows)
    return SequenceRows(token_ids=token_ids, feed_rows=fed, kv_len=chunk.end,
                        pages=np.asarray(request.page_ids, np.int32), prompt_targets=_prompt_targets(chunk),
                        sampling=SamplingRow.from_request(request, eos_token_ids) if chunk.sample else None,
                        num_drafts=len(chunk.draft_token_ids),
                        draft_bitmasks=request.draft_token_bitmasks if chunk.draft_token_ids else None)


def _tokens(chunk, feed_rows) -> tuple[np.ndarray, np.ndarray]:
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
    if known_count - len(known) != 1 or feed_rows is None or request not in feed_rows:
        raise RuntimeError(f"request {request.request_id!r}: {known_count - len(known)} of its tokens are on the "
                           "device and no step in flight samples them")
    fed[known_count - 1] = feed_rows[request]
    return token_ids, fed


def _prompt_targets(chunk) -> np.ndarray | None:
    """For prompt logprobs: each row of a prompt position p gets the prompt token at p + 1."""
    request, start = chunk.request, chunk.start
    prompt = request.prompt_token_ids
    stop = min(chunk.end, len(prompt) - 1)
    if request.sampling_params.prompt_logprobs is None or start >= stop:
        return None
    targets = np.full(chunk.num_tokens, NO_TOKEN, np.int32)
    targets[:stop - start] = prompt[start + 1:stop + 1]
    return targets
