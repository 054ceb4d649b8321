#!/usr/bin/env python3
"""Benchmark ragged paged attention implementations on decode, prefill and mixed batches.

For each (impl, shape): median time per call, live tokens/s, achieved bandwidth (bytes of the K/V
the batch must read -- live cache rows only -- plus q and out, divided by time), and that
bandwidth as a fraction of a measured device copy (read + write of one large buffer).

    python scripts/bench_attention.py                       # small CPU defaults, ~1 minute
    python scripts/bench_attention.py --num-seqs 64 --kv-min 256 --kv-max 512 --json out.json
    python scripts/bench_attention.py --impls xla --sweep-block-q   # re-fit the XLA block size
    python scripts/bench_attention.py --impls native,native_avx512 --dtype bfloat16 --layers 30

``native_avx512`` is the native kernel with bf16 kept off AMX tiles (``tiles=False``): beside
``native`` it shows what the tiles give on a CPU with AMX. ``--layers N`` chains N calls, each on
its own pools, so that K/V come from memory as in a model's step rather than from cache.

Pallas is skipped where it would only be interpreted (CPU) unless --pallas-interpret is given.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import _bench_common as common
from jaxrunner import kernels
from jaxrunner.kernels import native
from jaxrunner.kernels.testing import make_case


# ------------------------------------------------------------------------------------------
# shapes
# ------------------------------------------------------------------------------------------

def shape_batches(args, rng):
    """name -> (q_lens, kv_lens): the three batch mixes the engine produces."""
    s = args.num_seqs
    kv = lambda n: [int(x) for x in rng.integers(args.kv_min, args.kv_max + 1, n)]  # noqa: E731
    out = {}
    if "decode" in args.shapes:
        out["decode"] = ([1] * s, kv(s))
    if "prefill" in args.shapes:
        n = max(1, s // 16)
        out["prefill"] = ([args.prefill_len] * n, [args.prefill_len] * n)
    if "mixed" in args.shapes:
        n_pre = min(4, max(1, s // 8))
        chunk = args.prefill_len // 2
        kvp = [max(chunk, x) for x in kv(n_pre)]
        out["mixed"] = ([1] * (s - n_pre) + [chunk] * n_pre, kv(s - n_pre) + kvp)
    return out


def make_inputs(args, q_lens, kv_lens, rng):
    width = -(-max(max(kv_lens), 1) // args.page_size)
    case = make_case(rng, q_lens, kv_lens, num_q_heads=args.q_heads, num_kv_heads=args.kv_heads,
                     head_dim=args.head_dim, page_size=args.page_size, width=width,
                     dtype=args.dtype, poison=False)
    return case


def bytes_moved(case) -> int:
    item = np.dtype(case.k_pages.dtype).itemsize
    hkv, d = case.k_pages.shape[2], case.k_pages.shape[3]
    kv = 2 * sum(case.live_kv_lens) * hkv * d * item
    q_out = 2 * case.num_live_tokens * case.q.shape[1] * d * item
    return int(kv + q_out)


# ------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------

def time_fn(fn, args, *, iters, warmup=2, min_time=0.0):
    """Median and min seconds per call (each call synchronised)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    start = time.perf_counter()
    while len(times) < iters or (time.perf_counter() - start) < min_time:
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
        if len(times) >= 10 * iters:
            break
    return statistics.median(times), min(times)


def copy_bandwidth(nbytes: int, iters: int = 10) -> float:
    """Device copy bandwidth in GB/s: (read + write) bytes / time of ``x + 1`` on one buffer."""
    n = nbytes // 4
    x = jnp.arange(n, dtype=jnp.float32)
    fn = jax.jit(lambda a: a + 1.0)
    med, best = time_fn(fn, (x,), iters=iters)
    del x
    return 2 * n * 4 / best / 1e9


def attention_fn(impl, sm_scale, **extra):
    if impl == "native_avx512":
        return functools.partial(native.ragged_paged_attention_native, sm_scale=sm_scale, tiles=False)
    if impl == "xla" and extra:
        from jaxrunner.kernels.xla import ragged_paged_attention_xla
        return jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=sm_scale, **extra))
    if impl.startswith("pallas") and extra:
        from jaxrunner.kernels.pallas_kernel import ragged_paged_attention_pallas
        return jax.jit(functools.partial(ragged_paged_attention_pallas, sm_scale=sm_scale,
                                         **extra))
    return jax.jit(functools.partial(kernels.ragged_paged_attention, sm_scale=sm_scale,
                                     impl=impl))


def layered(fn, layers: int):
    """``fn`` called ``layers`` times in one jit, each call on its own K/V pools (the batch's q,
    page table and lengths shared), the output of one the queries of the next."""
    def chained(q, k_pools, v_pools, *batch):
        for k_pages, v_pages in zip(k_pools, v_pools):
            q = fn(q, k_pages, v_pages, *batch)
        return q
    return jax.jit(chained)


def run_one(impl, name, cases, *, iters, copy_gbps, extra=None, min_time=0.0):
    """``cases``: one per layer, the first one's batch used for all."""
    case = cases[0]
    args = [jax.device_put(a) for a in case.args()]
    fn = attention_fn(impl, case.q.shape[2] ** -0.5, **(extra or {}))
    if len(cases) > 1:
        args = [args[0], [jax.device_put(c.k_pages) for c in cases], [jax.device_put(c.v_pages) for c in cases],
                *args[3:]]
    fn = layered(fn, len(cases)) if len(cases) > 1 else jax.jit(fn)
    med, best = time_fn(fn, args, iters=iters, min_time=min_time)
    nbytes = bytes_moved(case) * len(cases)
    rec = dict(impl=impl, shape=name, num_seqs=len(case.q_lens), tokens=case.num_live_tokens,
               padded_tokens=int(case.q.shape[0]), kv_tokens=int(sum(case.live_kv_lens)),
               page_table_width=int(case.page_indices.shape[1]), layers=len(cases),
               time_ms=med * 1e3, best_ms=best * 1e3,
               tokens_per_s=case.num_live_tokens / med, bytes=nbytes,
               gbps=nbytes / med / 1e9, copy_gbps=copy_gbps,
               frac_of_copy=(nbytes / med / 1e9) / copy_gbps if copy_gbps else None)
    if extra:
        rec["options"] = {k: v for k, v in extra.items()}
    return rec


def print_table(records):
    cols = ["impl", "shape", "tokens", "kv_tokens", "time_ms", "best_ms", "tokens_per_s", "gbps",
            "frac_of_copy"]
    print(" ".join(f"{c:>13s}" for c in cols))
    for r in records:
        cells = []
        for c in cols:
            v = r.get(c)
            if isinstance(v, float):
                cells.append(f"{v:13.4g}")
            else:
                name = str(v) + (f" {r['options']}" if c == "impl" and r.get("options") else "")
                cells.append(f"{name:>13s}")
        print(" ".join(cells))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impls", default="reference,xla,native,native_avx512,pallas")
    p.add_argument("--shapes", default="decode,prefill,mixed")
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--kv-min", type=int, default=256)
    p.add_argument("--kv-max", type=int, default=512)
    p.add_argument("--prefill-len", type=int, default=256)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--layers", type=int, default=1, help="calls per timing, each on its own K/V pools")
    p.add_argument("--min-time", type=float, default=0.0, help="seconds of timing per case")
    p.add_argument("--copy-mb", type=int, default=64, help="buffer size of the copy benchmark")
    p.add_argument("--pallas-interpret", action="store_true",
                   help="also time Pallas where it is only interpreted (slow, not meaningful)")
    p.add_argument("--sweep-block-q", action="store_true",
                   help="time the xla impl at every block_q (fits blocks.choose_block_q)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the records here")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    backend = jax.default_backend()
    copy_gbps = copy_bandwidth(args.copy_mb << 20)
    print(f"backend={backend} device={jax.devices()[0].device_kind} "
          f"copy bandwidth={copy_gbps:.1f} GB/s (read+write)")
    impls = [i for i in args.impls.split(",") if i]
    records = []
    for name, (q_lens, kv_lens) in shape_batches(args, rng).items():
        cases = [make_inputs(args, q_lens, kv_lens, rng) for _ in range(max(1, args.layers))]
        for impl in impls:
            if impl == "pallas" and backend == "cpu" and not args.pallas_interpret:
                continue
            if impl.startswith("native") and backend != "cpu":  # the native kernel is a CPU custom call
                continue
            if args.sweep_block_q and impl == "xla":
                bq = 1
                while bq <= min(128, cases[0].q.shape[0]):
                    records.append(run_one(impl, name, cases, iters=args.iters,
                                           copy_gbps=copy_gbps, extra=dict(block_q=bq),
                                           min_time=args.min_time))
                    bq *= 2
                continue
            records.append(run_one(impl, name, cases, iters=args.iters, copy_gbps=copy_gbps,
                                   min_time=args.min_time))
            r = records[-1]
            print(f"  {impl:>9s} {name:>8s}: {r['time_ms']:9.3f} ms  {r['gbps']:7.2f} GB/s",
                  flush=True)
    print()
    print_table(records)
    result = dict(backend=backend, device=jax.devices()[0].device_kind, machine=common.device_info(),
                  jax_version=jax.__version__, copy_gbps=copy_gbps, args=vars(args),
                  records=records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
