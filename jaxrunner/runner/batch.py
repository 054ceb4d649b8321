"""StepPlan (host objects) → one padded batch of numpy arrays at a bucket's shape.

The batch is the only thing the jitted step sees. Padding is inert by construction: padded tokens
write their K/V into the scratch page, padded sequences have no query rows and ``kv_len`` 0, and
page-table entries past a sequence's pages point at the scratch page.

Per-row token-id options (banned tokens, ``allowed_token_ids``, ``logit_bias``) are fixed-width
arrays padded with ``NO_TOKEN``; their widths below are the caps ``LLMEngine.check_sampling_params``
enforces, so a request that would not fit is refused when it is added, never cut here.

Async scheduling: a token sampled by the step still on the device is not known here. Its slot in
``token_ids`` holds 0 and ``feed_rows`` names the row of the previous step's sampled tokens that the
jitted step reads instead (-1 everywhere else).

Speculative decoding: a chunk's proposed tokens follow its known ones, and buckets with
``num_draft_rows`` carry ``draft_rows``: per verifying row, the token row it reads
(``logits_indices``), its sequence, the position it samples and the proposal it checks (``tokens``).
The sampled outputs hold the sequences' own rows first, then the draft rows in chunk order.
"""
from __future__ import annotations

import numpy as np

from jaxrunner.runner.buckets import Bucket
from jaxrunner.runner.sampler import NO_LOGPROBS, NO_TOKEN

SCRATCH_PAGE = 0
# Banned per row and step: EOS + stop_token_ids while min_tokens is not reached, and the last
# token of each bad word whose other tokens end the output.
MAX_BANNED_TOKENS = 64
MAX_LOGIT_BIAS = 64          # logit_bias entries per request
MAX_ALLOWED_TOKEN_IDS = 128  # allowed_token_ids per request
NO_FEED = -1            # feed_rows entry of a token known on the host


def empty_batch(bucket: Bucket, page_size: int) -> dict[str, np.ndarray]:
    """A batch of the bucket's shape with nothing in it (every row padding)."""
    batch = _empty_batch(bucket, page_size)
    if bucket.num_draft_rows:
        r = bucket.num_draft_rows
        batch["draft_rows"] = {"logits_indices": np.zeros(r, np.int32), "seqs": np.zeros(r, np.int32),
                               "positions": np.zeros(r, np.int32), "tokens": np.full(r, NO_TOKEN, np.int32)}
    return batch


def _empty_batch(bucket: Bucket, page_size: int) -> dict[str, np.ndarray]:
    t, s, w = bucket.num_tokens, bucket.num_seqs, bucket.num_pages
    return {
        "token_ids": np.zeros(t, np.int32),
        "feed_rows": np.full(t, NO_FEED, np.int32),
        "positions": np.zeros(t, np.int32),
        "slot_mapping": np.full(t, SCRATCH_PAGE * page_size, np.int32),
        "page_indices": np.full((s, w), SCRATCH_PAGE, np.int32),
        "cu_q_lens": np.zeros(s + 1, np.int32),
        "kv_lens": np.zeros(s, np.int32),
        "num_seqs": np.zeros((), np.int32),
        "logits_indices": np.zeros(s, np.int32),
        "prompt_targets": np.full(t, NO_TOKEN, np.int32),  # next prompt token, for prompt logprobs
        "sampling": {
            "temperature": np.zeros(s, np.float32),
            "top_k": np.zeros(s, np.int32),
            "top_p": np.ones(s, np.float32),
            "min_p": np.zeros(s, np.float32),
            "repetition_penalty": np.ones(s, np.float32),
            "presence_penalty": np.zeros(s, np.float32),
            "frequency_penalty": np.zeros(s, np.float32),
            "seeds": np.zeros(s, np.uint32),       # low half of the 64-bit seed
            "seeds_high": np.zeros(s, np.uint32),  # high half
            "positions": np.zeros(s, np.int32),
            "history": np.full((s, w * page_size), NO_TOKEN, np.int32),
            "prompt_lens": np.zeros(s, np.int32),
            "banned": np.full((s, MAX_BANNED_TOKENS), NO_TOKEN, np.int32),
            "allowed_token_ids": np.full((s, MAX_ALLOWED_TOKEN_IDS), NO_TOKEN, np.int32),
            "logit_bias_ids": np.full((s, MAX_LOGIT_BIAS), NO_TOKEN, np.int32),
            "logit_bias_values": np.zeros((s, MAX_LOGIT_BIAS), np.float32),
            "num_logprobs": np.full(s, NO_LOGPROBS, np.int32),
        },
    }


def _fill_sampling(sampling: dict, row: int, request, eos_token_ids) -> None:
    sp = request.sampling_params
    sampling["temperature"][row] = sp.temperature if not sp.greedy else 0.0
    sampling["top_k"][row] = max(sp.top_k, 0)
    sampling["top_p"][row] = sp.top_p
    sampling["min_p"][row] = sp.min_p
    sampling["repetition_penalty"][row] = sp.repetition_penalty
    sampling["presence_penalty"][row] = sp.presence_penalty
    sampling["frequency_penalty"][row] = sp.frequency_penalty
    sampling["seeds"][row] = request.seed & 0xFFFFFFFF
    sampling["seeds_high"][row] = request.seed >> 32
    sampling["positions"][row] = request.num_tokens
    sampling["prompt_lens"][row] = request.num_prompt_tokens
    sampling["num_logprobs"][row] = NO_LOGPROBS if sp.logprobs is None else sp.logprobs
    if request.needs_host_history and request.num_pending_outputs:
        raise RuntimeError(f"request {request.request_id!r}: penalties and bad words need every past token on "
                           "the host, but one is still on the device (async scheduling must wait for it)")
    if sp.uses_penalties:
        history = request.all_token_ids
        sampling["history"][row, :len(history)] = history
    banned = banned_tokens(request, eos_token_ids)
    sampling["banned"][row, :len(banned)] = banned
    if sp.allowed_token_ids:
        sampling["allowed_token_ids"][row, :len(sp.allowed_token_ids)] = sp.allowed_token_ids
    if sp.logit_bias:
        sampling["logit_bias_ids"][row, :len(sp.logit_bias)] = list(sp.logit_bias)
        sampling["logit_bias_values"][row, :len(sp.logit_bias)] = list(sp.logit_bias.values())


def banned_tokens(request, eos_token_ids) -> list[int]:
    """Tokens the request may not sample next: EOS and stop ids before ``min_tokens``, and, as in
    vLLM, the last token of each bad word whose other tokens are the end of the output so far
    (a one-token bad word is always banned)."""
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
    if len(banned) > MAX_BANNED_TOKENS:  # check_sampling_params keeps requests under it
        raise RuntimeError(f"request {request.request_id!r}: {len(banned)} banned tokens, at most "
                           f"{MAX_BANNED_TOKENS} fit")
    return sorted(banned)


def _fill_prompt_targets(batch: dict, cursor: int, request, start: int, count: int) -> None:
    """For prompt logprobs: each row of a prompt position p gets the prompt token at p + 1."""
    prompt = request.prompt_token_ids
    stop = min(start + count, len(prompt) - 1)
    if request.sampling_params.prompt_logprobs is not None and start < stop:
        batch["prompt_targets"][cursor:cursor + stop - start] = prompt[start + 1:stop + 1]


def _fill_tokens(batch: dict, cursor: int, request, start: int, count: int, feed_rows) -> None:
    """Token ids of ``[start, start + count)`` (known ones only); one still on the device is fed
    from its row."""
    known = request.all_token_ids[start:start + count]
    batch["token_ids"][cursor:cursor + len(known)] = known
    if len(known) == count:
        return
    if count - len(known) != 1 or feed_rows is None or request not in feed_rows:
        raise RuntimeError(f"request {request.request_id!r}: {count - len(known)} of its tokens are on the "
                           "device and no step in flight samples them")
    batch["feed_rows"][cursor + count - 1] = feed_rows[request]


def _fill_draft_rows(batch: dict, row: int, cursor: int, chunk, draft_row: int) -> int:
    """Proposals of ``chunk`` (its tokens end at ``cursor``): they follow its known tokens, and the
    rows of the known last token and of each proposal but the last verify the next proposal; the
    sequence's own row (the last) samples the token after them all. Returns the next free draft row."""
    draft = chunk.draft_token_ids
    k = len(draft)
    if "draft_rows" not in batch or draft_row + k > len(batch["draft_rows"]["tokens"]):
        raise RuntimeError(f"request {chunk.request.request_id!r}: {k} proposals do not fit the bucket's draft rows")
    batch["token_ids"][cursor - k:cursor] = draft
    rows = slice(draft_row, draft_row + k)
    first_sampled = chunk.request.num_tokens  # the position the first verifying row samples
    spec = batch["draft_rows"]
    spec["logits_indices"][rows] = np.arange(cursor - k - 1, cursor - 1)
    spec["seqs"][rows] = row
    spec["positions"][rows] = np.arange(first_sampled, first_sampled + k)
    spec["tokens"][rows] = draft
    batch["sampling"]["positions"][row] = first_sampled + k
    return draft_row + k


def pack_step(chunks, bucket: Bucket, page_size: int, eos_token_ids=(),
              max_prefill_seqs: int | None = None, feed_rows: dict | None = None) -> dict[str, np.ndarray]:
    """Lay out the scheduled chunks (decodes and prefill chunks alike) back to back.

    ``max_prefill_seqs`` is the bound the executables were compiled with: a plan that breaks it
    would silently drop attention blocks, so it is refused here. ``feed_rows`` maps a request whose
    last token is still on the device to its row in the step that samples it (async scheduling).
    """
    prefills = sum(chunk.num_tokens > 1 for chunk in chunks)
    if max_prefill_seqs is not None and prefills > max_prefill_seqs:
        raise RuntimeError(f"step plan has {prefills} prefill chunks, the executables allow {max_prefill_seqs}")
    batch = empty_batch(bucket, page_size)
    cursor, draft_row = 0, 0
    for row, chunk in enumerate(chunks):
        request, start, count = chunk.request, chunk.start, chunk.num_tokens
        stop = start + count
        positions = np.arange(start, stop, dtype=np.int32)
        pages = np.asarray(request.page_ids, np.int32)
        _fill_tokens(batch, cursor, request, start, chunk.num_known_tokens, feed_rows)
        _fill_prompt_targets(batch, cursor, request, start, count)
        batch["positions"][cursor:cursor + count] = positions
        batch["slot_mapping"][cursor:cursor + count] = pages[positions // page_size] * page_size + positions % page_size
        batch["page_indices"][row, :len(pages)] = pages
        batch["kv_lens"][row] = stop
        cursor += count
        batch["cu_q_lens"][row + 1] = cursor
        batch["logits_indices"][row] = cursor - 1
        if chunk.sample:
            _fill_sampling(batch["sampling"], row, request, eos_token_ids)
        if chunk.draft_token_ids:
            draft_row = _fill_draft_rows(batch, row, cursor, chunk, draft_row)
    batch["cu_q_lens"][len(chunks) + 1:] = cursor
    batch["num_seqs"][...] = len(chunks)
    return batch
