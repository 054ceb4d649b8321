"""A sparse mixture-of-experts MLP: a top-k router and the expert FFNs as a grouped matmul.

Each token picks ``top_k`` experts from a softmax over the router's logits (renormalized over the
chosen k where the family says so: Mixtral always, Qwen3-MoE with ``norm_topk_prob``). Its k
assignments are sorted by expert; each expert's group is padded to whole blocks of
``block_rows`` rows; a loop runs one ``[block_rows, D] @ [D, 2I]`` and ``[block_rows, I] @ [I, D]``
per *used* block, with that block's expert's weights; each token then gathers its k outputs and
sums them with the router's weights. Every shape is static (the loop's bound is the static most
blocks ``T * k`` assignments can fill); only the trip count depends on the routing.

Why blocks and not ``jax.lax.ragged_dot``: XLA:CPU lowers ``ragged_dot`` to a dense product of
every expert with every row plus a mask, i.e. all experts on all tokens. Measured on this repo's
2-core CPU (float32, 8 experts, top-2, hidden 512, expert width 1024: ``scripts/benchmark_moe.py``'s
shape), ``moe_mlp`` with each impl, other jobs loading the machine (load average 9): 16 tokens
10 ms with blocks against 72 with ``ragged_dot``, 256 tokens 36 against 448. A variant that
gathers every block's weights for one batched einsum was as slow as ``ragged_dot`` (the weight
copies dominate). The engine runs the block loop everywhere; ``impl="ragged_dot"``
(same layout, checked against numpy too) is kept for accelerators, where XLA may lower grouped
matmuls natively; no accelerator has measured either yet.

Rows that are not tokens (``valid`` false: a bucket's padding) take no assignment: they neither
count in an expert's load nor fill a block, and their output is zero.

Expert parallelism: with a ``mesh``, experts are split over its ``"model"`` axis. Tokens are
replicated (as after any row-parallel projection), every shard routes them all, runs only the
assignments of its own experts, and one ``psum`` adds the shards' partial sums.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrunner.parallel.mesh import MODEL_AXIS, tensor_parallel_size

IMPLS = ("blocks", "ragged_dot")


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """The static shape of one family's MoE MLP."""

    num_experts: int
    top_k: int
    intermediate_size: int   # per expert
    normalize_top_k: bool    # renormalize the chosen k probabilities to sum to one


def route(x: jax.Array, router: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] float32, expert ids [T, k] int32): softmax over experts in float32, top-k."""
    logits = jax.lax.dot_general(x, router, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def block_rows_for(num_assignments: int, num_experts: int) -> int:
    """Rows per block: about twice an expert's even share, a power of two in [8, 256].

    Each block reads its expert's whole weights, so fewer, fuller blocks win while the padding
    they add stays small; measured near-best at 16 and 256 tokens (8 experts, top-2).
    """
    share = max(1, -(-2 * num_assignments // num_experts))
    return int(min(256, max(8, 1 << (share - 1).bit_length())))


def max_blocks(num_assignments: int, num_experts: int, block_rows: int) -> int:
    """The most blocks ``num_assignments`` can fill: each expert wastes at most one partial block,
    and no block is empty."""
    return max(1, min(num_assignments, num_assignments // block_rows + num_experts))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every assignment sits once sorted by expert and padded to whole blocks."""

    group_sizes: jax.Array    # [E] assignments per expert
    num_blocks: jax.Array     # [] blocks in use
    block_expert: jax.Array   # [max_blocks] the expert of each block
    source_token: jax.Array   # [max_blocks * block_rows] token feeding each padded row
    row_used: jax.Array       # [max_blocks * block_rows] whether that row holds an assignment
    padded_row: jax.Array     # [T, k] the padded row of each assignment
    kept: jax.Array           # [T, k] assignments that run here (valid token, local expert)


def expert_layout(experts: jax.Array, num_experts: int, block_rows: int, keep: jax.Array) -> Layout:
    """Sort the ``keep``-ed assignments ``experts`` [T, k] (ids in ``[0, num_experts)``) by expert
    and give each a row of a block-padded buffer; dropped assignments sort last and get no row.

    Counts come from a one-hot [T * k, E], ranks from the inverse of the sort, and the running
    sums over experts from a triangular matmul: XLA:CPU compiles scatters, ``searchsorted`` and
    ``cumsum`` far more slowly (0.2, 0.5 and 0.2 s each, measured) than these, and the layout is
    compiled once per layer and bucket."""
    tokens, k = experts.shape
    flat = jnp.where(keep, experts, num_experts).reshape(-1)
    one_hot = flat[:, None] == jnp.arange(num_experts)[None, :]  # dropped assignments: all false
    sizes = jnp.sum(one_hot, axis=0, dtype=jnp.int32)
    order = jnp.argsort(flat, stable=True)   # sorted position -> assignment
    position = jnp.argsort(order)            # assignment -> sorted position
    group_start = _exclusive_sum(sizes)
    blocks = (sizes + block_rows - 1) // block_rows
    block_start = _exclusive_sum(blocks)
    used_blocks = jnp.sum(blocks)
    nb = max_blocks(tokens * k, num_experts, block_rows)
    block_expert = jnp.minimum(jnp.sum(block_start[None, :] + blocks[None, :] <= jnp.arange(nb)[:, None], axis=1),
                               num_experts - 1)
    expert = jnp.minimum(flat, num_experts - 1)
    padded_row = block_start[expert] * block_rows + position - group_start[expert]
    # padded row -> the assignment it holds
    row = jnp.arange(nb * block_rows)
    expert_of_row = block_expert[row // block_rows]
    row_rank = row - block_start[expert_of_row] * block_rows
    row_used = (row // block_rows < used_blocks) & (row_rank < sizes[expert_of_row])
    source = order[jnp.clip(group_start[expert_of_row] + row_rank, 0, tokens * k - 1)]
    return Layout(sizes, used_blocks, block_expert, source // k, row_used,
                  padded_row.reshape(tokens, k).astype(jnp.int32), keep)


def _exclusive_sum(counts: jax.Array) -> jax.Array:
    """Sums of the counts before each one: [E] through a strictly triangular [E, E] product."""
    n = counts.shape[0]
    before = (jnp.arange(n)[:, None] < jnp.arange(n)[None, :]).astype(jnp.int32)
    return jnp.sum(counts[:, None] * before, axis=0)


def _blocks_ffn(x, layout: Layout, w_gate_up, w_down, block_rows: int) -> jax.Array:
    """Each used block through its expert's SwiGLU FFN; [max_blocks * block_rows, D] float32."""
    inter = w_down.shape[1]
    rows = jnp.where(layout.row_used[:, None], jnp.take(x, layout.source_token, axis=0), 0).astype(x.dtype)

    def block(b, out):
        e = layout.block_expert[b]
        xb = jax.lax.dynamic_slice_in_dim(rows, b * block_rows, block_rows)
        gate_up = jax.lax.dot_general(xb, w_gate_up[e], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        h = (jax.nn.silu(gate_up[:, :inter]) * gate_up[:, inter:]).astype(x.dtype)
        yb = jax.lax.dot_general(h, w_down[e], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(out, yb, b * block_rows, 0)

    out = jnp.zeros((rows.shape[0], x.shape[1]), jnp.float32)
    return jax.lax.fori_loop(0, layout.num_blocks, block, out)


def _ragged_ffn(x, layout: Layout, w_gate_up, w_down) -> jax.Array:
    """The same FFN over the block-padded rows through ``jax.lax.ragged_dot`` (groups of whole blocks)."""
    inter = w_down.shape[1]
    block_rows = layout.row_used.shape[0] // layout.block_expert.shape[0]
    rows = jnp.where(layout.row_used[:, None], jnp.take(x, layout.source_token, axis=0), 0).astype(x.dtype)
    groups = ((layout.group_sizes + block_rows - 1) // block_rows * block_rows).astype(jnp.int32)
    gate_up = jax.lax.ragged_dot(rows, w_gate_up, groups, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(gate_up[:, :inter]) * gate_up[:, inter:]).astype(x.dtype)
    return jax.lax.ragged_dot(h, w_down, groups, preferred_element_type=jnp.float32)


def _local_moe(x, weights, experts, keep, w_gate_up, w_down, *, first_expert, impl):
    """The contribution of experts ``first_expert ..`` (those in ``w_gate_up`` [E_local, D, 2I])."""
    local_experts = w_gate_up.shape[0]
    local = experts - first_expert
    keep = keep & (local >= 0) & (local < local_experts)
    block_rows = block_rows_for(experts.size, local_experts)
    layout = expert_layout(jnp.clip(local, 0, local_experts - 1), local_experts, block_rows, keep)
    if impl == "ragged_dot":
        out_rows = _ragged_ffn(x, layout, w_gate_up, w_down)
    else:
        out_rows = _blocks_ffn(x, layout, w_gate_up, w_down, block_rows)
    gathered = jnp.take(out_rows, layout.padded_row, axis=0)  # [T, k, D]
    gathered = jnp.where(layout.kept[..., None], gathered, 0.0)
    return jnp.einsum("tkd,tk->td", gathered, weights)


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"moe impl={impl!r} is not one of {', '.join(IMPLS)}")


def moe_mlp(x: jax.Array, router: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, spec: MoESpec, *,
            valid: jax.Array | None = None, mesh=None, impl: str = "blocks") -> jax.Array:
    """The MoE MLP of ``x`` [T, D] (no residual): ``router`` [D, E], ``w_gate_up`` [E, D, 2I]
    (gate columns, then up), ``w_down`` [E, I, D]; ``valid`` [T] marks the rows that are tokens.
    Returns [T, D] in ``x``'s dtype."""
    check_impl(impl)
    weights, experts = route(x, router, spec.top_k, spec.normalize_top_k)
    keep = jnp.ones(experts.shape, bool) if valid is None else jnp.broadcast_to(valid[:, None], experts.shape)
    tp = 1 if mesh is None else tensor_parallel_size(mesh)
    if tp == 1:
        out = _local_moe(x, weights, experts, keep, w_gate_up, w_down, first_expert=0, impl=impl)
        return out.astype(x.dtype)
    per_shard = spec.num_experts // tp

    def shard(x, weights, experts, keep, w_gate_up, w_down):
        first = jax.lax.axis_index(MODEL_AXIS) * per_shard
        part = _local_moe(x, weights, experts, keep, w_gate_up, w_down, first_expert=first, impl=impl)
        return jax.lax.psum(part, MODEL_AXIS)

    experts_spec = P(MODEL_AXIS, None, None)
    sharded = jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(), P(), P(), experts_spec, experts_spec),
                            out_specs=P(), check_vma=False)
    return sharded(x, weights, experts, keep, w_gate_up, w_down).astype(x.dtype)


def expert_counts(x: jax.Array, router: jax.Array, spec: MoESpec, valid: jax.Array | None = None) -> jax.Array:
    """Assignments per expert [E] of the ``valid`` rows of ``x`` (the router's load)."""
    _, experts = route(x, router, spec.top_k, spec.normalize_top_k)
    keep = jnp.ones(experts.shape, bool) if valid is None else jnp.broadcast_to(valid[:, None], experts.shape)
    one_hot = experts.reshape(-1)[:, None] == jnp.arange(spec.num_experts)[None, :]
    return jnp.sum(one_hot & keep.reshape(-1)[:, None], axis=0, dtype=jnp.int32)


def blocks_for_counts(counts, num_tokens: int, top_k: int) -> int:
    """Blocks the loop runs for these per-expert ``counts`` in a step of ``num_tokens`` rows (host)."""
    rows = block_rows_for(num_tokens * top_k, len(counts))
    return int(sum(-(-int(c) // rows) for c in counts))


def check_expert_parallel(num_experts: int, tp: int) -> None:
    """Experts split evenly over the model axis, or a clear error before any weight is read."""
    if num_experts % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_experts={num_experts} "
                         "(experts are split over the model axis)")
