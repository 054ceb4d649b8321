"""Attention callables the model is handed (see ``models.decoder``): ``(q, k, v, layer_cache,
meta, *, sm_scale, sliding_window=None, soft_cap=None) -> (out, layer_cache)``; a family passes its
per-layer window and attention-logit cap (``cap * tanh(s / cap)``) through them to the kernels.

``DenseAttention`` is the cache-free reference (tests, parity; ``meta`` is the tokens' segment
ids); ``PagedAttention`` writes the new keys/values into the paged KV cache and attends through
``jaxrunner.kernels`` (``meta`` is the step's ``AttentionMetadata``). ``AttentionMetadata`` is
defined here, beside the attention that reads it, so that models never import the runner; the
runner's ``StepBatch`` holds one (``runner.step_batch``).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrunner import kernels
from jaxrunner.parallel.mesh import MODEL_AXIS
from jaxrunner.parallel.sharding import KV_POOL_SPEC


def dense_causal_attention(q, k, v, segment_ids, *, sm_scale, sliding_window=None, soft_cap=None):
    """Causal attention over packed tokens; tokens attend only within their own segment."""
    tokens, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    k = jnp.repeat(k, group, axis=1).astype(jnp.float32)
    v = jnp.repeat(v, group, axis=1).astype(jnp.float32)
    scores = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    idx = jnp.arange(tokens)
    mask = (idx[None, :] <= idx[:, None]) & (segment_ids[None, :] == segment_ids[:, None])
    if sliding_window is not None:
        mask &= idx[:, None] - idx[None, :] < sliding_window
    scores = jnp.where(mask[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("hqk,khd->qhd", probs, v).astype(q.dtype)


class DenseAttention:
    """No cache: ``meta`` is the [T] array of segment ids (one id per sequence, tokens in order)."""

    def __call__(self, q, k, v, layer_cache, segment_ids, *, sm_scale, sliding_window=None, soft_cap=None):
        out = dense_causal_attention(q, k, v, segment_ids, sm_scale=sm_scale, sliding_window=sliding_window,
                                     soft_cap=soft_cap)
        return out, layer_cache


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("slot_mapping", "page_indices", "cu_q_lens", "kv_lens", "num_seqs"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """What the KV write and ragged paged attention read: the arguments of
    ``kernels.write_kv_and_attend`` that describe the step. Every field is traced data, so one
    executable serves every step of a bucket; padding is inert (see ``runner.step_batch``)."""

    # T token rows, S sequence slots, a page table W pages wide
    slot_mapping: jax.Array  # [T] int32: pool slot (page * page_size + offset) a token's K/V goes to; scratch: padding
    page_indices: jax.Array  # [S, W] int32: each sequence's pages in position order, SCRATCH_PAGE past its last
    cu_q_lens: jax.Array     # [S + 1] int32: sequence s owns rows cu_q_lens[s]:cu_q_lens[s + 1]; flat past the last
    kv_lens: jax.Array       # [S] int32: the sequence's cached tokens once the step is done (context + query); 0: none
    num_seqs: jax.Array      # [] int32: live sequences; token rows from cu_q_lens[num_seqs] on are padding

    def token_mask(self, num_rows: int) -> jax.Array:
        """[num_rows] true for the rows that are tokens of the step's sequences (not padding)."""
        return jnp.arange(num_rows) < self.cu_q_lens[self.num_seqs]


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """Write K/V into the page pool, then ragged paged attention over it.

    ``layer_cache`` is the layer's tuple of pools in ``kernels.kv_pool_shapes(impl)``'s layout
    (``(k_pages, v_pages)``, or jax's combined ``(kv_pages,)`` for ``jax_tpu``); ``meta`` is the
    step's ``AttentionMetadata``. With a ``mesh``, heads and the pools are split over its
    ``"model"`` axis and the kernels run per shard (``shard_map``) on their local heads: attention
    needs no communication, since each shard owns whole KV-head groups (a combined pool alternates
    K and V head by head, so a shard's slice of it holds the K and V of its own KV heads).
    """

    impl: str = "auto"
    mesh: object = None
    max_prefill_seqs: int | None = None  # the scheduler's per-step bound (see kernels.dispatch)
    query_dtype: object = None  # the queries' and the output's dtype; None: the pool's

    def __call__(self, q, k, v, layer_cache, meta: AttentionMetadata, *, sm_scale, sliding_window=None,
                 soft_cap=None):
        local = functools.partial(self._local, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
        if self.mesh is None:
            return local(q, k, v, layer_cache, meta)
        heads, pool = P(None, MODEL_AXIS, None), KV_POOL_SPEC
        pools = tuple(pool for _ in layer_cache)
        sharded = jax.shard_map(local, mesh=self.mesh, in_specs=(heads, heads, heads, pools, P()),
                                out_specs=(heads, pools), check_vma=False)
        return sharded(q, k, v, layer_cache, meta)

    def _local(self, q, k, v, layer_cache, meta: AttentionMetadata, *, sm_scale, sliding_window, soft_cap):
        # the model hands float32 q; kernels take the cache's dtype, or bf16/f32 beside 8-bit pages
        q = q.astype(self.query_dtype or layer_cache[0].dtype)
        # one fused call, so the pools handed back are the ones the kernel's loops carried (no copy)
        return kernels.write_kv_and_attend(
            q, k, v, tuple(layer_cache), meta.slot_mapping, meta.kv_lens, meta.page_indices, meta.cu_q_lens,
            meta.num_seqs, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, impl=self.impl,
            max_prefill_seqs=self.max_prefill_seqs)
