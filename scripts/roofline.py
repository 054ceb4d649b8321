"""Where a latency row sits against this machine's ceilings, measured in the same process.

Batch-1 decoding is bound by memory: each step reads every weight once (an untied input embedding
only by the rows it gathers) and each sequence's K/V so far, so its achieved GB/s are set against
the copy bandwidth measured here (an elementwise pass over a buffer far larger than the caches,
bytes read and written both counted, as copy benchmarks count them). Prefill is products of the
model's shapes, so its achieved GFLOP/s are set against the matmul rate measured here on the
model's MLP product at the prompt's rows, in the served dtype, through the same path the model's
products take (XLA's dot, or oneDNN where the engine routes them there).
"""
from __future__ import annotations

import time

import numpy as np

COPY_BYTES = 1 << 30  # per direction: far past any CPU's caches


def _per_call(fn, args, calls: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def copy_gbps(nbytes: int = COPY_BYTES, calls: int = 5) -> float:
    """GB/s of an elementwise float32 pass (read + write) over ``nbytes``, in place (the buffer is
    donated back each call: a fresh output would time the kernel's first touch of its pages)."""
    import jax
    import jax.numpy as jnp

    step = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    x = jax.block_until_ready(step(jnp.zeros((nbytes // 4,), jnp.float32)))
    start = time.perf_counter()
    for _ in range(calls):
        x = step(x)
    jax.block_until_ready(x)
    return 2 * nbytes * calls / (time.perf_counter() - start) / 1e9


def matmul_gflops(dtype: str, rows: int, k: int, n: int, matmuls, calls: int = 5) -> float:
    """GFLOP/s of ``[rows, k] x [k, n]`` in ``dtype`` through the model's own product
    (``models.linear.linear_f32`` with the engine's ``MatmulKernels``)."""
    import jax
    import jax.numpy as jnp

    from jaxrunner.models.linear import linear_f32

    x = jax.random.normal(jax.random.key(0), (rows, k), jnp.float32).astype(dtype)
    w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)
    seconds = _per_call(jax.jit(lambda a, b: linear_f32(a, b, matmuls)), (x, w), calls)
    return 2 * rows * k * n / seconds / 1e9


def model_traffic(llm) -> dict:
    """What one decode step reads and what a prefill token computes, from the served model."""
    import jax

    executor = llm.engine.executor
    cfg = executor.model.config
    params = executor.params
    leaves = jax.tree.leaves(params)
    weight_bytes = sum(leaf.nbytes for leaf in leaves)
    embed_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params["embed"]))
    if not cfg.tie_word_embeddings:  # the untied input table is only gathered from
        weight_bytes -= embed_bytes
    layer_params = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params["layers"]) if leaf.ndim >= 2)
    kv_itemsize = np.dtype(executor.runner.cache_spec.dtype).itemsize
    return dict(weight_bytes=int(weight_bytes),
                kv_bytes_per_context_token=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_itemsize,
                layer_matmul_params=layer_params, lm_head_params=cfg.vocab_size * cfg.hidden_size,
                num_layers=cfg.num_layers, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
                hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size)


def matmul_ceiling(llm, rows: int) -> dict:
    """The matmul rate of the served model's MLP product at ``rows`` rows, in its dtype and
    through its own product path."""
    executor = llm.engine.executor
    cfg = executor.model.config
    dtype = str(executor.model.dtype)
    return dict(matmul_gflops=matmul_gflops(dtype, rows, cfg.hidden_size, cfg.intermediate_size,
                                            executor.runner.matmuls),
                shape=[rows, cfg.hidden_size, cfg.intermediate_size], dtype=dtype)


def annotate(row: dict, traffic: dict, limits: dict) -> dict:
    """``row`` (a latency row: batch_size, input_len, output_len, ttft_s / tpot_s percentiles) with
    decode GB/s and prefill GFLOP/s, and their fractions of ``limits``."""
    batch, prompt, out = row["batch_size"], row["input_len"], row["output_len"]
    mean_context = prompt + out / 2
    step_bytes = traffic["weight_bytes"] + batch * mean_context * traffic["kv_bytes_per_context_token"]
    decode_gbps = step_bytes / row["tpot_s"]["p50"] / 1e9 if row["tpot_s"]["p50"] else None
    attention = 2 * 2 * traffic["num_layers"] * traffic["num_heads"] * traffic["head_dim"] * prompt * (prompt + 1) / 2
    flops = batch * (2 * traffic["layer_matmul_params"] * prompt + 2 * traffic["lm_head_params"] + attention)
    prefill_gflops = flops / row["ttft_s"]["p50"] / 1e9
    return dict(row, decode_gbps=decode_gbps,
                decode_frac_of_copy=decode_gbps / limits["copy_gbps"] if decode_gbps else None,
                prefill_gflops=prefill_gflops, prefill_frac_of_matmul=prefill_gflops / limits["matmul_gflops"])
