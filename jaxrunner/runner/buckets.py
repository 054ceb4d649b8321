"""The finite set of step shapes: token buckets × sequence buckets.

Every step is padded up to one bucket, so only these shapes are ever compiled (all of them during
warm-up). The spacing trades padding waste against compile count:

* tokens 1, 4, then ×2 from 16 to max_num_batched_tokens: matmul cost grows with padded tokens, so
  keep waste < 2× where it is large, and give single-sequence decodes a 1-token shape;
* sequences ×4 (1, 4, 16, … and the token bucket's own size, capped by max_num_seqs): padded
  sequences only cost sampler rows (the last layer's MLP, the logits, sampling) and empty
  attention blocks;
* but under a token bucket T, of that ladder only 1, those of at least T / 8 and the largest:
  a bucket costs a compile and a warm-up run of the step's full size, while padding a few
  sequences up to T / 2 rows costs a T-token step little. The lone sequence, the batch-1 prefill,
  keeps its own bucket: 63 padded rows cost it most (SmolLM2 in float32: a 128-token step 12-17 %
  slower, a 512-token one 2-9 %; the 1B Llama's steps did not differ). At the defaults (512
  tokens, 64 sequences) that is 20 buckets instead of 26.

The page table always has the full width (max_model_len / page_size pages): the attention paths
loop only up to the longest live sequence, so a width bucket would multiply compiles for nothing
(measured: the xla path's cost follows the real kv lengths). ``page_buckets`` stays a plan field so
an implementation whose cost does follow the width could bucket it again.

Speculative decoding adds sampled rows, not shapes: with ``num_speculative_tokens`` k, every bucket
also samples ``num_draft_rows`` = min(T - 1, k * min(S,
MAX_SPEC_SEQS)) rows that verify proposals. A step of s sequences and t tokens has at most t - s
<= T - 1 proposals, from at most min(s, MAX_SPEC_SEQS) sequences, so they always fit.
"""
from __future__ import annotations

import dataclasses
import math

MAX_SPEC_SEQS = 8  # most sequences whose proposals one step verifies
SEQ_BUCKET_MIN_SHARE = 8  # a token bucket T keeps the sequence buckets of at least T / this (and 1)


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    num_tokens: int
    num_seqs: int
    num_pages: int  # page-table width W
    num_draft_rows: int = 0  # sampled rows that verify speculative proposals

    def __str__(self) -> str:
        drafts = f"xR{self.num_draft_rows}" if self.num_draft_rows else ""
        return f"T{self.num_tokens}xS{self.num_seqs}xW{self.num_pages}{drafts}"


def _geometric(smallest: int, largest: int, ratio: int) -> tuple[int, ...]:
    """smallest, smallest*ratio, ... capped by largest, which is always included."""
    values, v = [], max(1, min(smallest, largest))
    while v < largest:
        values.append(v)
        v *= ratio
    values.append(largest)
    return tuple(values)


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    page_buckets: tuple[int, ...]
    num_speculative_tokens: int = 0

    @classmethod
    def from_limits(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                    page_size: int, min_tokens: int = 1, num_speculative_tokens: int = 0) -> "BucketPlan":
        return cls(token_buckets=_token_buckets(min_tokens, max_num_batched_tokens),
                   seq_buckets=_geometric(1, max_num_seqs, 4),
                   page_buckets=(math.ceil(max_model_len / page_size),),
                   num_speculative_tokens=num_speculative_tokens)

    def _bucket(self, t: int, s: int, w: int) -> Bucket:
        drafts = min(t - 1, self.num_speculative_tokens * min(s, MAX_SPEC_SEQS))
        return Bucket(t, s, w, drafts)

    def seqs_for(self, num_tokens: int) -> tuple[int, ...]:
        """Sequence buckets under a token bucket: one sequence, the ladder's buckets of at least
        ``num_tokens / SEQ_BUCKET_MIN_SHARE``, and the largest (a step never has more sequences
        than tokens)."""
        ladder = {s for s in self.seq_buckets if s < num_tokens and s * SEQ_BUCKET_MIN_SHARE >= num_tokens}
        return tuple(sorted({1, min(num_tokens, max(self.seq_buckets))} | ladder))

    def buckets(self) -> list[Bucket]:
        """Every shape warm-up compiles."""
        return [self._bucket(t, s, w) for t in self.token_buckets for s in self.seqs_for(t) for w in self.page_buckets]

    def select(self, num_tokens: int, num_seqs: int, num_pages: int) -> Bucket:
        """The smallest bucket holding a step of this size."""
        t = _smallest_at_least(self.token_buckets, num_tokens, "tokens")
        s = _smallest_at_least(self.seqs_for(t), num_seqs, "sequences")
        w = _smallest_at_least(self.page_buckets, num_pages, "pages per sequence")
        return self._bucket(t, s, w)

    def describe(self) -> str:
        pairs = ", ".join(f"{t}:{list(self.seqs_for(t))}" for t in self.token_buckets)
        return f"{len(self.buckets())} buckets (tokens:[sequences]) {pairs}; page table {list(self.page_buckets)} pages"


def _token_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """×4 below 16 tokens, ×2 from there: a batch-1 decode must not pay for 16 padded tokens
    (measured: 60 ms per token at T=16 on CPU), while large steps keep padding waste under 2×."""
    values, t = [], max(1, smallest)
    while t < largest:
        values.append(t)
        t = t * 4 if t < 16 else t * 2
    values.append(largest)
    return tuple(values)


def _smallest_at_least(options, needed: int, what: str) -> int:
    for option in sorted(options):
        if option >= needed:
            return option
    raise ValueError(f"a step of {needed} {what} exceeds the largest bucket ({max(options)})")
