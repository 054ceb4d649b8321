"""The step batch: a registered pytree, laid out by one function for serving and for warm-up's dummies
(same structure, shapes and dtypes per bucket, so nothing compiles while serving)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.engine.request import Request
from jaxrunner.engine.scheduler import ScheduledChunk, StepPlan
from jaxrunner.engine.step_input import build_step_input
from jaxrunner.executor_protocol import NO_TOKEN, SamplingRow, SequenceInput
from jaxrunner.runner.batch import pack_step
from jaxrunner.runner.buckets import Bucket
from jaxrunner.runner.step_batch import AttentionMetadata, DraftRows, SamplingMetadata, StepBatch, lay_out
from jaxrunner.runner.warmup import random_dummy_batch, zeros_dummy_batch
from jaxrunner.sampling_params import SamplingParams

PAGE_SIZE = 8
VOCAB = 512  # the vocabulary the dummy batches draw from (the token bitmask's width)
PLAIN, SPECULATIVE = Bucket(32, 4, 4), Bucket(32, 4, 4, num_draft_rows=6)


def _running(request_id: str, prompt: list[int], computed: int, pages: list[int], **params) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=8, **params), seed=7)
    request.num_computed_tokens, request.page_ids = computed, pages
    return request


def _served(bucket: Bucket) -> StepBatch:
    """A served step: a decode, a prefill chunk with prompt logprobs and penalties, and (in a
    speculative bucket) a decode with two proposals."""
    decode = _running("decode", list(range(3, 12)), 9, [1, 2], temperature=0.7, logit_bias={5: 1.0})
    decode.append_output(40)
    prefill = _running("prefill", list(range(20, 40)), 8, [3, 4, 5], prompt_logprobs=2, repetition_penalty=1.2)
    decode_chunk = ScheduledChunk(decode, 9, 3, [41, 42]) if bucket.num_draft_rows else ScheduledChunk(decode, 9, 1)
    chunks = [decode_chunk, ScheduledChunk(prefill, 8, 10)]
    return pack_step(build_step_input(StepPlan(chunks), eos_token_ids=(2,)), bucket, PAGE_SIZE, VOCAB)


def _signature(batch) -> tuple:
    return jax.tree.structure(batch), [(np.shape(x), np.asarray(x).dtype) for x in jax.tree.leaves(batch)]


def test_step_batch_is_a_registered_pytree():
    batch = _served(SPECULATIVE)
    leaves, tree = jax.tree.flatten(batch)
    assert all(isinstance(x, np.ndarray) for x in leaves)
    assert len(leaves) == 5 + 5 + 18 + 5  # own arrays, attention, sampling (draft_tokens None), draft rows
    rebuilt = jax.tree.unflatten(tree, leaves)
    assert isinstance(rebuilt, StepBatch) and isinstance(rebuilt.attention, AttentionMetadata)
    assert isinstance(rebuilt.sampling, SamplingMetadata) and isinstance(rebuilt.draft_rows, DraftRows)
    plain = _served(PLAIN)
    assert plain.draft_rows is None and len(jax.tree.leaves(plain)) == len(leaves) - 5  # None: an empty subtree
    assert jax.tree.structure(plain) != tree
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.token_ids = None


@pytest.mark.parametrize("bucket", [PLAIN, SPECULATIVE], ids=["plain", "speculative"])
def test_served_and_dummy_batches_of_a_bucket_match(bucket):
    served = _served(bucket)
    for seed in range(5):
        dummy = random_dummy_batch(jax.random.key(seed), bucket, PAGE_SIZE, 64, VOCAB, 32)
        assert _signature(dummy) == _signature(served)
    assert _signature(zeros_dummy_batch(bucket, PAGE_SIZE, VOCAB)) == _signature(served)


def test_one_trace_serves_dummy_and_served_batches():
    """What warm-up traced is what serving calls: a jitted function of the batch traces once."""
    traces = []

    @jax.jit
    def step(batch: StepBatch):
        traces.append(1)
        return jnp.sum(batch.token_ids) + jnp.sum(batch.attention.kv_lens) + jnp.sum(batch.draft_rows.tokens)

    step(random_dummy_batch(jax.random.key(0), SPECULATIVE, PAGE_SIZE, 64, 512, 32))
    step(_served(SPECULATIVE))
    assert len(traces) == 1


def test_pack_step_lays_out_sequences_and_proposals():
    batch = _served(SPECULATIVE)
    meta = batch.attention
    assert batch.num_seqs == 2 and meta.cu_q_lens.tolist() == [0, 3, 13, 13, 13]
    assert batch.token_ids[:3].tolist() == [40, 41, 42] and batch.positions[:3].tolist() == [9, 10, 11]
    assert meta.slot_mapping[:3].tolist() == [2 * 8 + 1, 2 * 8 + 2, 2 * 8 + 3]
    assert meta.kv_lens.tolist() == [12, 18, 0, 0] and meta.page_indices[1].tolist() == [3, 4, 5, 0]
    assert batch.logits_indices[:2].tolist() == [2, 12]
    # the known token's row verifies 41, 41's row verifies 42; the sequence's own row samples position 12
    spec = batch.draft_rows
    assert spec.logits_indices[:2].tolist() == [0, 1] and spec.seqs[:2].tolist() == [0, 0]
    assert spec.positions[:2].tolist() == [10, 11] and spec.tokens.tolist() == [41, 42] + [NO_TOKEN] * 4
    sampling = batch.sampling
    assert sampling.positions[:2].tolist() == [12, 0]  # the prefill chunk samples nothing yet
    assert sampling.temperature[0] == pytest.approx(0.7) and sampling.logit_bias_ids[0, :2].tolist() == [5, NO_TOKEN]
    assert sampling.seeds[0] == 7 and sampling.num_logprobs[0] == -1
    assert batch.prompt_targets[3:13].tolist() == list(range(29, 39))
    assert np.all(batch.prompt_targets[:3] == NO_TOKEN) and np.all(batch.prompt_targets[13:] == NO_TOKEN)


def test_dummy_proposals_are_laid_out_like_served_ones():
    """A random dummy's draft rows read rows of their own sequence, check the token of the row
    after, and sample the position after the row they read."""
    seen = 0
    for seed in range(20):
        batch = random_dummy_batch(jax.random.key(seed), SPECULATIVE, PAGE_SIZE, 64, 512, 32)
        spec, cu = batch.draft_rows, batch.attention.cu_q_lens
        for r in np.flatnonzero(spec.tokens != NO_TOKEN):
            row, seq = spec.logits_indices[r], spec.seqs[r]
            assert cu[seq] <= row < cu[seq + 1] - 1
            assert spec.tokens[r] == batch.token_ids[row + 1] and spec.positions[r] == batch.positions[row] + 1
            seen += 1
    assert seen > 0


def test_layout_refuses_what_does_not_fit():
    rows = SequenceInput(token_ids=np.arange(3), feed_rows=np.full(3, -1), kv_len=3, pages=np.array([1]),
                         sampling=SamplingRow(), num_drafts=2)
    with pytest.raises(RuntimeError, match="draft rows"):
        lay_out(PLAIN, PAGE_SIZE, VOCAB, [rows])
    with pytest.raises(RuntimeError, match="do not fit bucket"):
        lay_out(PLAIN, PAGE_SIZE, VOCAB, [dataclasses.replace(rows, num_drafts=0)] * 5)
    with pytest.raises(RuntimeError, match="logit_bias_ids: 65 entries"):
        lay_out(PLAIN, PAGE_SIZE, VOCAB, [dataclasses.replace(rows, num_drafts=0,
                                                       sampling=SamplingRow(logit_bias_ids=list(range(65))))])


def test_the_sampling_columns_table_rules_the_metadata_and_the_rows():
    """One table names every sampling column, its dtype, width and "off" value: the metadata's
    fields, its padding rows and the engine's SamplingRow defaults all agree with it."""
    from jaxrunner.runner.step_batch import SAMPLING_COLUMNS

    assert [f.name for f in dataclasses.fields(SamplingMetadata)] == [*SAMPLING_COLUMNS, "draft_tokens"]
    assert {f.name for f in dataclasses.fields(SamplingRow)} == set(SAMPLING_COLUMNS) - {"positions"}
    row, empty = SamplingRow(), SamplingMetadata.empty(2, 16, VOCAB)
    for name, (dtype, width, off) in SAMPLING_COLUMNS.items():
        column = getattr(empty, name)
        assert column.dtype == dtype and column.shape[0] == 2 and np.all(column == np.asarray(off, dtype)), name
        if name != "positions":
            default = getattr(row, name)
            assert (default == off) if width is None else len(default) == 0, name


def test_warm_up_turns_every_sampling_option_on():
    """Across warm-up's random rows every column leaves its "off" value somewhere, so every branch
    of the sampler is compiled and run before serving."""
    from jaxrunner.runner.step_batch import SAMPLING_COLUMNS

    seen = set()
    for seed in range(20):
        batch = random_dummy_batch(jax.random.key(seed), PLAIN, PAGE_SIZE, 64, VOCAB, 32)
        for name, (dtype, _, off) in SAMPLING_COLUMNS.items():
            live = getattr(batch.sampling, name)[:batch.num_seqs]
            if np.any(live != np.asarray(off, dtype)):
                seen.add(name)
    assert seen == set(SAMPLING_COLUMNS)
