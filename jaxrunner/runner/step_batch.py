"""The step's input: one typed pytree at a bucket's shape, and the one function that fills it.

``StepBatch`` is all the jitted step reads (``model_runner.model_step``). Its parts are frozen
dataclasses registered with ``jax.tree_util.register_dataclass``: ``AttentionMetadata`` (what the
KV write and ragged paged attention read; defined in ``models.attention`` beside the attention
that reads it, since models never import the runner), ``SamplingMetadata`` (one row of sampling
settings per sequence) and ``DraftRows`` (speculative verification; ``None``, an empty subtree, in
buckets without draft rows). Every field is a data field: a meta field is part of the
executable's signature, so a new value of it would compile while serving. Two batches of one
bucket therefore differ in values only.

One layout for serving and warm-up: a step from the engine (``executor_protocol.StepInput``, through
``runner.batch.pack_step``) and ``runner.warmup.random_dummy_batch`` (random lengths, contexts,
pages and ``random_sampling_rows``) both describe each sequence as a ``SequenceInput`` and hand
them to ``lay_out``, which alone knows where a sequence's tokens, positions, slots, page-table row,
query and KV lengths, logits row, sampling row and draft rows go.

Padding is inert by construction: padded tokens write their K/V into the scratch page, padded
sequences have no query rows and ``kv_len`` 0, page-table entries past a sequence's pages point at
the scratch page, and padded sampling rows hold the values that turn every option off.

Per-row token-id options (banned tokens, ``allowed_token_ids``, ``logit_bias``) are fixed-width
arrays padded with ``NO_TOKEN``; their widths below are the caps ``LLMEngine.check_sampling_params``
enforces, so a request that would not fit is refused when it is added, never cut here.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import numpy as np

from jaxrunner.executor_protocol import (FREE_ROW, NO_FEED, NO_LOGPROBS, NO_TOKEN, SamplingRow, SequenceInput,
                                         bitmask_words)
from jaxrunner.kernels import SCRATCH_PAGE
from jaxrunner.models.attention import AttentionMetadata
from jaxrunner.runner.buckets import Bucket

__all__ = ["AttentionMetadata", "SamplingMetadata", "DraftRows", "StepBatch", "lay_out", "random_sampling_rows",
           "SCRATCH_PAGE", "MAX_BANNED_TOKENS", "MAX_LOGIT_BIAS", "MAX_ALLOWED_TOKEN_IDS", "MAX_LOGPROBS"]

MAX_LOGPROBS = 20  # like vLLM's default max_logprobs: top-k logprobs the sampler returns per token, k <= this

# Banned per row and step: EOS + stop_token_ids while min_tokens is not reached, and the last
# token of each bad word whose other tokens end the output.
MAX_BANNED_TOKENS = 64
MAX_LOGIT_BIAS = 64          # logit_bias entries per request
MAX_ALLOWED_TOKEN_IDS = 128  # allowed_token_ids per request


def _pytree(*data_fields: str):
    """Register a dataclass as a pytree whose fields are all data (traced), none static."""
    return functools.partial(jax.tree_util.register_dataclass, data_fields=data_fields, meta_fields=())


# ----------------------------------------------------------------------------- the batch
# Shapes: T token rows, S sequence slots, W page-table columns (a bucket's), H = W * page_size
# history columns, R draft rows.
#
# The sampling columns, in one table: (dtype, width per row (None: one value), the value that turns
# the option off). ``SamplingMetadata`` has one field of each name (and ``draft_tokens``) and builds
# its padding rows from it; ``SamplingRow`` (executor_protocol) has a field of each name but
# ``positions`` (set by the layout), defaulting to the same "off" (a test holds the three together).
SAMPLING_COLUMNS = {
    "temperature": (np.float32, None, 0.0),
    "top_k": (np.int32, None, 0),
    "top_p": (np.float32, None, 1.0),
    "min_p": (np.float32, None, 0.0),
    "repetition_penalty": (np.float32, None, 1.0),
    "presence_penalty": (np.float32, None, 0.0),
    "frequency_penalty": (np.float32, None, 0.0),
    "seeds": (np.uint32, None, 0),
    "seeds_high": (np.uint32, None, 0),
    "positions": (np.int32, None, 0),
    "history": (np.int32, "history", NO_TOKEN),
    "prompt_lens": (np.int32, None, 0),
    "banned": (np.int32, "banned", NO_TOKEN),
    "allowed_token_ids": (np.int32, "allowed", NO_TOKEN),
    "logit_bias_ids": (np.int32, "bias", NO_TOKEN),
    "logit_bias_values": (np.float32, "bias", 0.0),
    "num_logprobs": (np.int32, None, NO_LOGPROBS),
    "token_bitmask": (np.int32, "bitmask", FREE_ROW),
}


@_pytree(*SAMPLING_COLUMNS, "draft_tokens")
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Each sampled row's settings (``runner.sampler.sample``). A padding row's values turn every
    option off; a row's settings come from ``SamplingRow`` (same field names)."""

    temperature: np.ndarray         # [S] float32: 0 is greedy
    top_k: np.ndarray               # [S] int32: 0 is off
    top_p: np.ndarray               # [S] float32: 1 is off
    min_p: np.ndarray               # [S] float32: 0 is off
    repetition_penalty: np.ndarray  # [S] float32: 1 is off; over prompt and output tokens
    presence_penalty: np.ndarray    # [S] float32: 0 is off; over output tokens
    frequency_penalty: np.ndarray   # [S] float32: 0 is off; over output tokens
    seeds: np.ndarray               # [S] uint32: low half of the request's 64-bit seed
    seeds_high: np.ndarray          # [S] uint32: its high half
    positions: np.ndarray           # [S] int32: position of the token sampled (keys the row's randomness)
    history: np.ndarray             # [S, H] int32: prompt + output ids for penalties, NO_TOKEN after
    prompt_lens: np.ndarray         # [S] int32: history's first prompt_lens ids are the prompt
    banned: np.ndarray              # [S, MAX_BANNED_TOKENS] int32: ids that may not be sampled, NO_TOKEN padded
    allowed_token_ids: np.ndarray   # [S, MAX_ALLOWED_TOKEN_IDS] int32: the only ids allowed (none: all)
    logit_bias_ids: np.ndarray      # [S, MAX_LOGIT_BIAS] int32: ids whose logit gets a bias, NO_TOKEN padded
    logit_bias_values: np.ndarray   # [S, MAX_LOGIT_BIAS] float32: the bias added to each
    num_logprobs: np.ndarray        # [S] int32: top logprobs wanted (0: the sampled token's only), NO_LOGPROBS: none
    token_bitmask: np.ndarray       # [S, ceil(V / 32)] int32: bit t % 32 of word t // 32 allows token t (-1: all)
    # [S + R] int32: the proposal each row verifies, NO_TOKEN for none. Only in the sampler's view of
    # a batch with draft rows (``sampler.with_draft_rows``); None in every StepBatch.
    draft_tokens: np.ndarray | None = None

    @classmethod
    def empty(cls, rows: int, history_width: int, vocab_size: int) -> SamplingMetadata:
        """``rows`` padding rows: every column at its "off" value (``SAMPLING_COLUMNS``)."""
        widths = {None: (), "history": (history_width,), "banned": (MAX_BANNED_TOKENS,),
                  "allowed": (MAX_ALLOWED_TOKEN_IDS,), "bias": (MAX_LOGIT_BIAS,),
                  "bitmask": (bitmask_words(vocab_size),)}
        return cls(**{name: np.full((rows, *widths[width]), off, dtype)
                      for name, (dtype, width, off) in SAMPLING_COLUMNS.items()})


@_pytree("logits_indices", "seqs", "positions", "tokens", "token_bitmask")
@dataclasses.dataclass(frozen=True)
class DraftRows:
    """Speculative verification: extra sampled rows, after the sequences' own, in chunk order. The
    row of a chunk's last known token and of each proposal but the last verifies the next proposal."""

    logits_indices: np.ndarray  # [R] int32: the token row whose logits the draft row samples
    seqs: np.ndarray            # [R] int32: the sequence whose sampling settings it takes
    positions: np.ndarray       # [R] int32: the position it samples
    tokens: np.ndarray          # [R] int32: the proposal it checks; NO_TOKEN in unused rows
    # [R, ceil(V / 32)] int32: the tokens allowed at its position (structured output after the
    # proposals before it), FREE_ROW words for none: its own, since each row's grammar state differs
    token_bitmask: np.ndarray

    @classmethod
    def empty(cls, rows: int, vocab_size: int) -> DraftRows:
        return cls(logits_indices=np.zeros(rows, np.int32), seqs=np.zeros(rows, np.int32),
                   positions=np.zeros(rows, np.int32), tokens=np.full(rows, NO_TOKEN, np.int32),
                   token_bitmask=np.full((rows, bitmask_words(vocab_size)), FREE_ROW, np.int32))


@_pytree("token_ids", "feed_rows", "positions", "logits_indices", "prompt_targets", "attention", "sampling",
         "draft_rows", "lora_slots")
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step's input at a bucket's shape: numpy arrays on the host, traced in the jitted step."""

    token_ids: np.ndarray       # [T] int32: the tokens computed, sequence after sequence; 0 where fed
    feed_rows: np.ndarray       # [T] int32: the previous step's sampled row whose id replaces the token, or NO_FEED
    positions: np.ndarray       # [T] int32: each token's position in its sequence (RoPE)
    logits_indices: np.ndarray  # [S] int32: the token row each sequence samples from (its last)
    prompt_targets: np.ndarray  # [T] int32: next prompt token of a row whose request wants prompt logprobs, NO_TOKEN
    attention: AttentionMetadata  # what the KV write and attention read
    sampling: SamplingMetadata    # one sampling row per sequence slot
    draft_rows: DraftRows | None  # speculative verification rows; None in buckets without them
    lora_slots: np.ndarray | None = None  # [T] int32: each row's adapter slot, 0 for none; None without LoRA

    @classmethod
    def empty(cls, bucket: Bucket, page_size: int, vocab_size: int, lora: bool = False) -> StepBatch:
        """A batch of ``bucket``'s shape with nothing in it (every row padding)."""
        t, s, w = bucket.num_tokens, bucket.num_seqs, bucket.num_pages
        attention = AttentionMetadata(slot_mapping=np.full(t, SCRATCH_PAGE * page_size, np.int32),
                                      page_indices=np.full((s, w), SCRATCH_PAGE, np.int32),
                                      cu_q_lens=np.zeros(s + 1, np.int32), kv_lens=np.zeros(s, np.int32),
                                      num_seqs=np.zeros((), np.int32))
        return cls(token_ids=np.zeros(t, np.int32), feed_rows=np.full(t, NO_FEED, np.int32),
                   positions=np.zeros(t, np.int32), logits_indices=np.zeros(s, np.int32),
                   prompt_targets=np.full(t, NO_TOKEN, np.int32), attention=attention,
                   sampling=SamplingMetadata.empty(s, w * page_size, vocab_size),
                   draft_rows=DraftRows.empty(bucket.num_draft_rows, vocab_size) if bucket.num_draft_rows else None,
                   lora_slots=np.zeros(t, np.int32) if lora else None)

    @property
    def num_seqs(self) -> int:
        """Live sequences (host side)."""
        return int(self.attention.num_seqs)

    @property
    def num_live_tokens(self) -> int:
        """Token rows of the live sequences; the rest are padding (host side)."""
        return int(self.attention.cu_q_lens[self.num_seqs])


# ----------------------------------------------------------------------------- warm-up rows
def random_sampling_rows(rng: np.random.Generator, prompt_lens: Sequence[int], vocab: int,
                         history_width: int) -> list[SamplingRow]:
    """Random, valid settings for sequences whose prompts are ``prompt_lens`` long (warm-up). Each
    option is on for the whole batch or for none of it, so that across buckets both sides of every
    ``lax.cond`` in the sampler execute."""
    rows = len(prompt_lens)
    on = lambda: rng.random() < 0.5  # noqa: E731
    columns = {
        "temperature": np.where(rng.random(rows) < 0.5, 0.0, rng.uniform(0.3, 1.5, rows)),
        "seeds": rng.integers(0, 2**32, rows, dtype=np.uint64),
        "seeds_high": rng.integers(0, 2**32, rows, dtype=np.uint64),
        "prompt_lens": prompt_lens,
    }
    if on():
        columns.update(top_k=rng.integers(0, 64, rows), top_p=rng.uniform(0.3, 1.0, rows),
                       min_p=np.where(rng.random(rows) < 0.5, 0.0, rng.uniform(0, 0.2, rows)))
    if on():
        columns.update(repetition_penalty=rng.uniform(0.8, 1.5, rows), presence_penalty=rng.uniform(-1, 1, rows),
                       frequency_penalty=rng.uniform(-1, 1, rows),
                       history=rng.integers(0, vocab, (rows, history_width)))
    if on():
        columns.update(banned=rng.integers(0, vocab, (rows, MAX_BANNED_TOKENS // 2)))
    if on():
        columns.update(num_logprobs=rng.integers(NO_LOGPROBS, MAX_LOGPROBS + 1, rows))
    if on():  # some rows restricted to a few tokens, the others free
        restricted = rng.random(rows) < 0.5
        width = int(rng.integers(1, MAX_ALLOWED_TOKEN_IDS + 1))
        ids = iter(rng.integers(0, vocab, (int(np.sum(restricted)), width)))
        columns.update(allowed_token_ids=[next(ids) if r else () for r in restricted])
    if on():  # some rows constrained to random tokens (at least one each), the others free
        words = bitmask_words(vocab)
        masks = rng.integers(np.iinfo(np.int32).min, np.iinfo(np.int32).max, (rows, words), dtype=np.int32, endpoint=True)
        masks[:, 0] |= 1
        columns.update(token_bitmask=[m if c else () for m, c in zip(masks, rng.random(rows) < 0.5)])
    if on():
        width = int(rng.integers(1, MAX_LOGIT_BIAS + 1))
        columns.update(logit_bias_ids=rng.integers(0, vocab, (rows, width)),
                       logit_bias_values=rng.uniform(-100, 100, (rows, width)))
    return [SamplingRow(**{name: values[i] for name, values in columns.items()}) for i in range(rows)]


# ----------------------------------------------------------------------------- the layout
def lay_out(bucket: Bucket, page_size: int, vocab_size: int, sequences: Sequence[SequenceInput],
            lora: bool = False) -> StepBatch:
    """The batch of ``bucket``'s shape holding ``sequences`` back to back, the rest padding
    (``vocab_size``: the model's logits, which the token bitmask covers; ``lora``: the runner has
    adapter slots, so every row names one)."""
    if len(sequences) > bucket.num_seqs or sum(len(seq.token_ids) for seq in sequences) > bucket.num_tokens:
        raise RuntimeError(f"{len(sequences)} sequences of {sum(len(seq.token_ids) for seq in sequences)} tokens "
                           f"do not fit bucket {bucket}")
    batch = StepBatch.empty(bucket, page_size, vocab_size, lora)
    cursor, draft_row = 0, 0
    for slot, seq in enumerate(sequences):
        _lay_out_tokens(batch, slot, seq, cursor, page_size)
        cursor += len(seq.token_ids)
        if seq.sampling is not None:
            _lay_out_sampling(batch.sampling, slot, seq)
        if seq.num_drafts:
            draft_row = _lay_out_drafts(batch, slot, seq, cursor, draft_row)
    batch.attention.cu_q_lens[len(sequences) + 1:] = cursor
    batch.attention.num_seqs[...] = len(sequences)
    return batch


def _lay_out_tokens(batch: StepBatch, slot: int, seq: SequenceInput, cursor: int, page_size: int) -> None:
    """Token rows ``[cursor, cursor + q)`` and sequence slot ``slot``."""
    q = len(seq.token_ids)
    rows = slice(cursor, cursor + q)
    positions = np.arange(seq.kv_len - q, seq.kv_len, dtype=np.int32)
    pages = np.asarray(seq.pages, np.int32)
    batch.token_ids[rows] = seq.token_ids
    batch.feed_rows[rows] = seq.feed_rows
    if batch.lora_slots is not None:
        batch.lora_slots[rows] = seq.lora_slot
    elif seq.lora_slot:
        raise RuntimeError(f"{_who(seq, slot)}: adapter slot {seq.lora_slot}, and the runner has no LoRA slots")
    batch.positions[rows] = positions
    if seq.prompt_targets is not None:
        batch.prompt_targets[rows] = seq.prompt_targets
    batch.logits_indices[slot] = cursor + q - 1
    meta = batch.attention
    meta.slot_mapping[rows] = pages[positions // page_size] * page_size + positions % page_size
    meta.page_indices[slot, :len(pages)] = pages
    meta.kv_lens[slot] = seq.kv_len
    meta.cu_q_lens[slot + 1] = cursor + q


def _who(seq: SequenceInput, slot: int) -> str:
    return f"request {seq.request_id!r}" if seq.request_id else f"sequence {slot}"


def _lay_out_sampling(sampling: SamplingMetadata, slot: int, seq: SequenceInput) -> None:
    """Row ``slot`` of every sampling column; it samples the token after the query (at ``kv_len``)."""
    for field in dataclasses.fields(SamplingRow):
        column, value = getattr(sampling, field.name), getattr(seq.sampling, field.name)
        if column.ndim == 1:
            column[slot] = value
        elif len(value) > column.shape[1]:
            raise RuntimeError(f"{_who(seq, slot)}: sampling {field.name}: {len(value)} entries, the batch holds "
                               f"{column.shape[1]}")
        else:
            column[slot, :len(value)] = value
    sampling.positions[slot] = seq.kv_len


def _lay_out_drafts(batch: StepBatch, slot: int, seq: SequenceInput, end: int, draft_row: int) -> int:
    """Draft rows of ``seq``'s proposals (its tokens end at row ``end``); returns the next free one."""
    k, spec = seq.num_drafts, batch.draft_rows
    if spec is None or draft_row + k > len(spec.tokens):
        raise RuntimeError(f"{_who(seq, slot)}: {k} proposals do not fit the bucket's draft rows")
    rows = slice(draft_row, draft_row + k)
    first_sampled = seq.kv_len - k  # the position the first verifying row samples
    spec.logits_indices[rows] = np.arange(end - k - 1, end - 1)
    spec.seqs[rows] = slot
    spec.positions[rows] = np.arange(first_sampled, seq.kv_len)
    spec.tokens[rows] = seq.token_ids[-k:]
    if seq.draft_bitmasks is not None:
        spec.token_bitmask[rows] = seq.draft_bitmasks
    return draft_row + k
