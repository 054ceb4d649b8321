"""Mixture of experts: the MoE layer against numpy, and Mixtral / Qwen3-MoE against transformers."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrunner.models import moe


# ----------------------------------------------------------------------------- the layer
def numpy_moe(x, router, w_gate_up, w_down, top_k, normalize, valid=None):
    """Every token through its top-k experts one at a time (float64)."""
    x, router, w_gate_up, w_down = (np.asarray(a, np.float64) for a in (x, router, w_gate_up, w_down))
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    inter = w_down.shape[1]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        if valid is not None and not valid[t]:
            continue
        chosen = np.argsort(-probs[t], kind="stable")[:top_k]
        weights = probs[t, chosen] / (probs[t, chosen].sum() if normalize else 1.0)
        for e, w in zip(chosen, weights):
            gate_up = x[t] @ w_gate_up[e]
            gate, up = gate_up[:inter], gate_up[inter:]
            out[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ w_down[e])
    return out


def random_moe_weights(seed, d=32, experts=8, inter=24):
    rng = np.random.default_rng(seed)
    return (rng.normal(0, 0.5, (d, experts)).astype(np.float32),
            rng.normal(0, 0.2, (experts, d, 2 * inter)).astype(np.float32),
            rng.normal(0, 0.2, (experts, inter, d)).astype(np.float32))


@pytest.mark.parametrize("impl", moe.IMPLS)
@pytest.mark.parametrize("tokens,normalize", [(1, True), (5, False), (37, True), (200, False)])
def test_moe_layer_matches_numpy(tokens, normalize, impl):
    router, w_gate_up, w_down = random_moe_weights(tokens)
    x = np.random.default_rng(100 + tokens).normal(0, 1, (tokens, 32)).astype(np.float32)
    spec = moe.MoESpec(num_experts=8, top_k=2, intermediate_size=24, normalize_top_k=normalize)
    out = jax.jit(lambda *a: moe.moe_mlp(*a, spec, impl=impl))(x, router, w_gate_up, w_down)
    np.testing.assert_allclose(np.asarray(out), numpy_moe(x, router, w_gate_up, w_down, 2, normalize),
                               rtol=2e-5, atol=2e-5)


def test_moe_layer_all_tokens_on_one_expert():
    """A router whose logits favour expert 5 for every token (then 2): one group holds every row."""
    router, w_gate_up, w_down = random_moe_weights(7)
    x = np.abs(np.random.default_rng(8).normal(0, 1, (64, 32))).astype(np.float32) + 0.5
    router[:] = 0.0
    router[:, 5], router[:, 2] = 1.0, 0.5
    spec = moe.MoESpec(num_experts=8, top_k=2, intermediate_size=24, normalize_top_k=True)
    counts = np.asarray(moe.expert_counts(jnp.asarray(x), jnp.asarray(router), spec))
    assert counts.tolist() == [0, 0, 64, 0, 0, 64, 0, 0]
    out = jax.jit(lambda *a: moe.moe_mlp(*a, spec))(x, router, w_gate_up, w_down)
    np.testing.assert_allclose(np.asarray(out), numpy_moe(x, router, w_gate_up, w_down, 2, True),
                               rtol=2e-5, atol=2e-5)


def test_moe_layer_padding_rows_take_no_assignment():
    """Rows past ``valid`` give zeros, leave the tokens' outputs unchanged, and load no expert."""
    router, w_gate_up, w_down = random_moe_weights(3)
    x = np.random.default_rng(4).normal(0, 1, (48, 32)).astype(np.float32)
    valid = np.arange(48) < 19
    spec = moe.MoESpec(num_experts=8, top_k=2, intermediate_size=24, normalize_top_k=True)
    out = np.asarray(jax.jit(lambda *a: moe.moe_mlp(*a, spec, valid=jnp.asarray(valid)))(x, router, w_gate_up, w_down))
    np.testing.assert_allclose(out, numpy_moe(x, router, w_gate_up, w_down, 2, True, valid), rtol=2e-5, atol=2e-5)
    assert not out[19:].any()
    counts = moe.expert_counts(jnp.asarray(x), jnp.asarray(router), spec, jnp.asarray(valid))
    assert int(counts.sum()) == 19 * 2


def test_moe_layer_refuses_unknown_impl():
    router, w_gate_up, w_down = random_moe_weights(0)
    spec = moe.MoESpec(num_experts=8, top_k=2, intermediate_size=24, normalize_top_k=True)
    with pytest.raises(ValueError, match="moe impl='dense' is not one of blocks, ragged_dot"):
        moe.moe_mlp(jnp.zeros((2, 32)), router, w_gate_up, w_down, spec, impl="dense")


def test_block_layout_bounds():
    """The static block count covers the worst routing, and blocks are powers of two in [8, 256]."""
    for assignments in (1, 2, 32, 512, 4096):
        rows = moe.block_rows_for(assignments, 8)
        assert 8 <= rows <= 256 and rows & (rows - 1) == 0
        worst = sum(-(-c // rows) for c in [assignments - 7] + [1] * 7) if assignments >= 8 else assignments
        assert moe.max_blocks(assignments, 8, rows) >= worst
