"""Speculative decoding with a draft model: a smaller model sharing the tokenizer proposes greedily.

The draft runs on a ``ModelRunner`` of its own (its own KV pool and buckets, compiled and warmed up
at start-up like the target's) on the same devices. For each request it keeps the tokens whose KV
its pool holds. A proposal first computes the tokens the draft has not seen (after a rejection,
those past the agreed prefix: their KV slots are written again), samples its argmax, then runs
k - 1 greedy decodes. Every request the scheduler asks for in one step runs in one batch: catch-up
steps, then decodes that read the previous proposal from the device (``feed_rows``), then one
fetch. Greedy proposals are a one-hot draft distribution, which the target's rejection sampler
(``runner.sampler``) verifies exactly: the output distribution stays the target's.

Pages: a free list over the draft pool. A request keeps its pages until it finishes (``forget``);
when the pool runs short, the requests proposed for least recently (and not in this batch) are
dropped and catch up from their first token when next asked; a request that still does not fit
gets no proposal.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math

import numpy as np

from jaxrunner.config import EngineConfig
from jaxrunner.models.loading import LoadedModel
from jaxrunner.runner.buckets import MAX_SPEC_SEQS, BucketPlan
from jaxrunner.runner.model_runner import ModelRunner
from jaxrunner.runner.startup import start_runner
from jaxrunner.executor_protocol import NO_FEED, SamplingRow, SequenceInput
from jaxrunner.runner.step_batch import lay_out

logger = logging.getLogger("jaxrunner")

# The draft's largest step: its steady steps hold at most MAX_SPEC_SEQS × (k + 1) tokens, so a
# longer prompt is caught up in chunks of this size rather than compiling the target's largest shapes.
DRAFT_MAX_STEP_TOKENS = 256
GREEDY = SamplingRow()


@dataclasses.dataclass
class _DraftSeq:
    token_ids: list[int]  # the tokens whose KV the draft pool holds, from position 0
    pages: list[int]
    num_confirmed: int = 0  # how many of them are the request's own (the rest: proposals fed back)


@dataclasses.dataclass
class _Query:
    index: int             # its place in the proposer's answer
    seq: _DraftSeq
    pending: list[int]     # tokens of the request the draft has not computed yet (at least one)
    num_proposals: int


class DraftModelProposer:
    """``executor_protocol.Proposer`` over a started draft runner."""

    def __init__(self, runner: ModelRunner, bucket_plan: BucketPlan, num_speculative_tokens: int,
                 max_prefill_seqs: int | None):
        self.runner = runner
        self.bucket_plan = bucket_plan
        self.num_speculative_tokens = num_speculative_tokens
        self.max_prefill_seqs = max_prefill_seqs
        self.page_size = runner.cache_spec.page_size
        self.max_step_tokens = max(bucket_plan.token_buckets)
        self._free_pages = list(range(runner.cache_spec.num_pages - 1, 0, -1))  # page 0 is the scratch page
        self._seqs: collections.OrderedDict[str, _DraftSeq] = collections.OrderedDict()  # least recent first

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self._free_pages += seq.pages

    def propose_many(self, queries) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in queries]
        asked = {request_id for request_id, _, _ in queries}
        batch = []
        for index, (request_id, token_ids, limit) in enumerate(queries):
            k = min(limit, self.num_speculative_tokens)
            if k > 0 and (seq := self._place(request_id, token_ids, k, asked)) is not None:
                batch.append(_Query(index, seq, list(token_ids[len(seq.token_ids):]), k))
        if batch:
            batch.sort(key=lambda query: -query.num_proposals)  # decode j runs a prefix: slots stay put
            for query, tokens in zip(batch, self._run(batch)):
                proposals[query.index] = tokens
        return proposals

    # ------------------------------------------------------------------ pages
    def _place(self, request_id: str, token_ids: list[int], k: int, asked: set) -> _DraftSeq | None:
        """The request's draft state, cut back to the prefix it shares with ``token_ids`` (leaving at
        least one token to compute) and with pages for k - 1 proposals after them; None when the
        pool cannot hold it."""
        seq = self._seqs.pop(request_id, None) or _DraftSeq([], [])
        self._seqs[request_id] = seq  # now the most recent
        agreed = _common_prefix(seq.token_ids, token_ids, seq.num_confirmed, len(token_ids) - 1)
        del seq.token_ids[agreed:]
        seq.num_confirmed = min(seq.num_confirmed, agreed)
        needed = math.ceil((len(token_ids) + k - 1) / self.page_size) - len(seq.pages)
        while needed > len(self._free_pages):
            victim = next((other for other in self._seqs if other not in asked), None)
            if victim is None:
                return None
            self.forget(victim)
        seq.pages += [self._free_pages.pop() for _ in range(max(needed, 0))]
        return seq

    # ------------------------------------------------------------------ steps
    def _run(self, batch: list[_Query]) -> list[list[int]]:
        """Catch up, propose, and return each query's proposals (in ``batch`` order)."""
        while not self._fits_one_step([query.pending for query in batch]):
            self.runner.dispatch(*self._packed(self._catch_up_rows(batch)))
        outputs = [self.runner.dispatch(*self._packed([self._rows(query.seq, query.pending, sample=True)
                                                        for query in batch]))]
        for query in batch:
            query.seq.token_ids += query.pending
            query.seq.num_confirmed = len(query.seq.token_ids)
        for j in range(1, batch[0].num_proposals):
            live = [query for query in batch if query.num_proposals > j]
            outputs.append(self.runner.dispatch(*self._packed([self._fed_row(query.seq, slot, j)
                                                                for slot, query in enumerate(live)])))
        sampled = [self.runner.fetch(output, prompt_logprobs=False)["tokens"] for output in outputs]
        proposals = []
        for slot, query in enumerate(batch):
            tokens = [int(sampled[j][slot]) for j in range(query.num_proposals)]
            query.seq.token_ids += tokens[:-1]  # fed back above: their KV is in the pool
            proposals.append(tokens)
        return proposals

    def _fits_one_step(self, pending: list[list[int]]) -> bool:
        prefills = sum(len(tokens) > 1 for tokens in pending)
        return (sum(map(len, pending)) <= self.max_step_tokens
                and (self.max_prefill_seqs is None or prefills <= self.max_prefill_seqs))

    def _catch_up_rows(self, batch: list[_Query]) -> list[SequenceInput]:
        """One unsampled step over the oldest pending tokens, each query keeping at least its last."""
        rows, budget = [], self.max_step_tokens
        for query in batch:
            count = min(len(query.pending) - 1, budget)
            if count <= 0 or (self.max_prefill_seqs is not None and len(rows) == self.max_prefill_seqs):
                continue
            chunk, query.pending = query.pending[:count], query.pending[count:]
            rows.append(self._rows(query.seq, chunk, sample=False))
            query.seq.token_ids += chunk
            budget -= count
        return rows

    def _rows(self, seq: _DraftSeq, tokens: list[int], sample: bool) -> SequenceInput:
        kv_len = len(seq.token_ids) + len(tokens)
        return SequenceInput(token_ids=np.asarray(tokens, np.int32), feed_rows=np.full(len(tokens), NO_FEED, np.int32),
                             kv_len=kv_len, pages=self._pages(seq, kv_len), sampling=GREEDY if sample else None)

    def _fed_row(self, seq: _DraftSeq, slot: int, j: int) -> SequenceInput:
        """Decode j: the proposal the step before sampled in ``slot``, read from the device feed."""
        kv_len = len(seq.token_ids) + j
        return SequenceInput(token_ids=np.zeros(1, np.int32), feed_rows=np.full(1, slot, np.int32), kv_len=kv_len,
                             pages=self._pages(seq, kv_len), sampling=GREEDY)

    def _pages(self, seq: _DraftSeq, kv_len: int) -> np.ndarray:
        return np.asarray(seq.pages[:math.ceil(kv_len / self.page_size)], np.int32)

    def _packed(self, rows: list[SequenceInput]):
        widest = max(len(row.pages) for row in rows)
        bucket = self.bucket_plan.select(sum(len(row.token_ids) for row in rows), len(rows), widest)
        return bucket, lay_out(bucket, self.page_size, self.runner.cfg.vocab_size, rows)


def _common_prefix(a: list[int], b: list[int], start: int, most: int) -> int:
    """Length of the prefix ``a`` and ``b`` share (at most ``most``), known to hold up to ``start``:
    only the proposals a request's draft state ends with are compared, not its whole history."""
    n = min(len(a), len(b), most)
    if start >= n:
        return n
    differ = np.flatnonzero(np.asarray(a[start:n]) != np.asarray(b[start:n]))
    return start + int(differ[0]) if len(differ) else n


def start_draft_proposer(config: EngineConfig, draft: LoadedModel, max_model_len: int,
                         target_num_pages: int) -> tuple[DraftModelProposer, dict]:
    """Start ``draft`` (already loaded on the target's mesh) for ``config``'s speculative decoding:
    its pool holds as many pages as the target's, at most what ``MAX_SPEC_SEQS`` sequences of
    ``max_model_len`` need. Returns the proposer and the draft runner's start-up report."""
    max_seqs = min(config.max_num_seqs, MAX_SPEC_SEQS)
    pages_per_seq = math.ceil(max_model_len / config.page_size)
    draft_config = dataclasses.replace(
        config, model=config.speculative_model, quantization=config.speculative_quantization,
        speculative_method=None, num_speculative_tokens=None, speculative_model=None, speculative_quantization=None,
        max_num_seqs=max_seqs, max_num_batched_tokens=max(max_seqs, min(config.max_num_batched_tokens,
                                                                        DRAFT_MAX_STEP_TOKENS)),
        max_model_len=max_model_len, num_pages=min(target_num_pages, max_seqs * pages_per_seq + 1),
        kv_cache_memory_bytes=None)
    runner, plan, _, report = start_runner(draft_config, draft)
    logger.info("draft model %s: %d buckets, KV pool %d pages", config.speculative_model, len(plan.buckets()),
                runner.cache_spec.num_pages)
    return DraftModelProposer(runner, plan, config.num_speculative_tokens, config.max_num_prefill_seqs), report
