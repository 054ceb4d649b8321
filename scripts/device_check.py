#!/usr/bin/env python3
"""One-shot accelerator check of the attention kernels (run via scripts/device_check.sh).

(a) correctness: the Pallas kernel (compiled for the device, not interpreted) against the
    reference on the device, on the shapes the CPU tests use (decode, prefill, chunked, mixed
    with padding, GQA 1/3/4/8, page sizes 8..128, head_dim 64/128, bf16, window, soft cap), with
    NaN-poisoned unowned cache slots;
(b) timing: pallas vs xla (and reference) on a decode batch -- default 64 seqs x 2048 tokens,
    Hq 32 / Hkv 8, head_dim 128, page 16, bf16 -- with achieved bandwidth against a measured
    device-to-device copy;
(c) JSON results to $OUT/device_check.json (or --out), also printed.

Every part is guarded: a failure is recorded in the JSON and the script goes on.

    scripts/device_check.sh                 # on the GPU machine
    scripts/device_check.sh --cpu-rehearsal # here: tiny sizes, Pallas interpreted
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import pathlib
import sys
import time
import traceback
import types
import zlib

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]


def import_kernels():
    """``jaxrunner.kernels``, installed or straight from this checkout (never as ``kernels``)."""
    try:
        import jaxrunner.kernels as k
        return k
    except ImportError:
        pass
    if "jaxrunner" not in sys.modules:  # a bare package object: skip jaxrunner/__init__ imports
        pkg = types.ModuleType("jaxrunner")
        pkg.__path__ = [str(REPO / "jaxrunner")]
        sys.modules["jaxrunner"] = pkg
    spec = importlib.util.spec_from_file_location(
        "jaxrunner.kernels", REPO / "kernels" / "__init__.py",
        submodule_search_locations=[str(REPO / "kernels")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["jaxrunner.kernels"] = mod
    spec.loader.exec_module(mod)
    sys.modules["jaxrunner"].kernels = mod
    return mod


# (q_lens, kv_lens, make_case kwargs, attention kwargs) -- mirrors tests/test_kernels.py
CHECK_CASES = {
    "decode_p8_gqa4": ([1] * 7, [1, 7, 8, 9, 16, 17, 33],
                       dict(page_size=8, num_q_heads=8, num_kv_heads=2, head_dim=64), {}),
    "prefill_gqa3": ([9, 16, 3], [9, 16, 3],
                     dict(page_size=8, num_q_heads=6, num_kv_heads=2, head_dim=64), {}),
    "chunked_mha": ([5, 12, 1, 7], [21, 12, 40, 8],
                    dict(page_size=8, num_q_heads=4, num_kv_heads=4, head_dim=64), {}),
    "mixed_padded_d128": ([1, 1, 6, 1, 10], [17, 3, 30, 64, 10],
                          dict(page_size=16, num_q_heads=12, num_kv_heads=4, head_dim=128,
                               num_tokens=32, max_seqs=8, width=6), {}),
    "bf16_gqa8_d128": ([1, 4, 1, 9], [40, 20, 8, 9],
                       dict(num_q_heads=8, num_kv_heads=1, head_dim=128, page_size=16,
                            num_tokens=16, max_seqs=6, dtype="bfloat16"), {}),
    "window": ([1, 7, 1, 3], [30, 19, 5, 24],
               dict(num_q_heads=6, num_kv_heads=3, head_dim=64, page_size=8, num_tokens=16,
                    max_seqs=5, scale=3.0), dict(sliding_window=5)),
    "softcap": ([1, 7, 1, 3], [30, 19, 5, 24],
                dict(num_q_heads=6, num_kv_heads=3, head_dim=64, page_size=8, num_tokens=16,
                     max_seqs=5, scale=3.0), dict(soft_cap=2.0)),
    "page128_bf16": ([1, 100, 1], [300, 100, 129],
                     dict(num_q_heads=16, num_kv_heads=2, head_dim=128, page_size=128,
                          num_tokens=128, max_seqs=4, dtype="bfloat16"),
                     dict(sliding_window=64, soft_cap=30.0)),
    "decode_64x512_bf16": ([1] * 64, list(np.random.default_rng(7).integers(1, 513, 64)),
                           dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                dtype="bfloat16"), {}),
}
TOL = {"float32": 1e-5, "bfloat16": 1e-2}
REHEARSAL_CASES = ["decode_p8_gqa4", "mixed_padded_d128", "bf16_gqa8_d128", "window"]


def check_correctness(kernels, args, report):
    import jax
    import jax.numpy as jnp
    from jaxrunner.kernels.pallas_kernel import ragged_paged_attention_pallas
    from jaxrunner.kernels.reference import ragged_paged_attention_reference
    from jaxrunner.kernels.testing import make_case

    names = REHEARSAL_CASES if args.cpu_rehearsal else list(CHECK_CASES)
    results = []
    for name in names:
        q_lens, kv_lens, kw, attn = CHECK_CASES[name]
        rec = dict(case=name, dtype=kw.get("dtype", "float32"), **{k: v for k, v in attn.items()})
        try:
            rng = np.random.default_rng(zlib.crc32(name.encode()))
            case = make_case(rng, q_lens, kv_lens, **kw)
            dev = [jax.device_put(a) for a in case.args()]
            sm = kw["head_dim"] ** -0.5
            pal = jax.jit(functools.partial(ragged_paged_attention_pallas, sm_scale=sm,
                                            interpret=args.cpu_rehearsal, **attn))
            ref = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=sm,
                                            **attn))
            t = time.perf_counter()
            out = np.asarray(jax.block_until_ready(pal(*dev)).astype(jnp.float32))
            rec["pallas_first_call_s"] = time.perf_counter() - t
            want = np.asarray(ref(*dev).astype(jnp.float32))
            n = case.num_live_tokens
            err = np.abs(out[:n] - want[:n])
            tol = TOL[rec["dtype"]]
            within = np.all(err <= tol + tol * np.abs(want[:n]))
            rec.update(all_finite=bool(np.isfinite(out).all()),
                       max_abs_err=float(err.max()),
                       max_rel_err=float((err / (np.abs(want[:n]) + tol)).max()),
                       ok=bool(np.isfinite(out).all() and within))
        except Exception as e:  # noqa: BLE001 - record and go on
            rec.update(ok=False, error=f"{type(e).__name__}: {e}",
                       traceback=traceback.format_exc()[-3000:])
        print(f"  check {name:>22s}: {'ok' if rec.get('ok') else 'FAIL'} "
              f"{rec.get('max_abs_err', rec.get('error', ''))}", flush=True)
        results.append(rec)
    report["correctness"] = results
    report["correctness_ok"] = all(r.get("ok") for r in results)


def time_decode(kernels, args, report):
    import jax
    sys.path.insert(0, str(REPO / "scripts"))
    import bench_attention as bench
    from jaxrunner.kernels.testing import make_case

    rng = np.random.default_rng(0)
    s, kv = args.decode_seqs, args.decode_kv
    case = make_case(rng, [1] * s, [kv] * s, num_q_heads=args.q_heads, num_kv_heads=args.kv_heads,
                     head_dim=args.head_dim, page_size=args.page_size, dtype=args.dtype,
                     poison=False)
    copy_gbps = bench.copy_bandwidth(args.copy_mb << 20, iters=args.iters)
    report["copy_gbps"] = copy_gbps
    print(f"  device copy bandwidth: {copy_gbps:.1f} GB/s (read+write)", flush=True)
    records = []
    for impl in args.impls.split(","):
        extra = {}
        if impl == "pallas" and args.cpu_rehearsal:
            extra = dict(interpret=True)
        try:
            rec = bench.run_one(impl, "decode", case, iters=args.iters, copy_gbps=copy_gbps,
                                extra=extra or None, min_time=args.min_time)
        except Exception as e:  # noqa: BLE001
            rec = dict(impl=impl, shape="decode", error=f"{type(e).__name__}: {e}",
                       traceback=traceback.format_exc()[-3000:])
        print(f"  time {impl:>9s}: " + (f"{rec['time_ms']:.3f} ms, {rec['gbps']:.1f} GB/s "
                                         f"({100 * rec['frac_of_copy']:.0f}% of copy)"
                                         if "time_ms" in rec else rec["error"]), flush=True)
        records.append(rec)
    # Pallas block_k sweep on the same batch (GPU tuning data; cheap)
    if not args.cpu_rehearsal and args.sweep:
        for bk in (32, 64, 128):
            for warps in (4, 8):
                extra = dict(block_k=bk, num_warps=warps)
                try:
                    rec = bench.run_one("pallas", "decode", case, iters=args.iters,
                                        copy_gbps=copy_gbps, extra=extra)
                except Exception as e:  # noqa: BLE001
                    rec = dict(impl="pallas", options=extra, error=f"{type(e).__name__}: {e}")
                records.append(rec)
                print(f"  sweep {extra}: {rec.get('time_ms', rec.get('error'))}", flush=True)
    report["decode_timing"] = dict(num_seqs=s, kv_len=kv, q_heads=args.q_heads,
                                   kv_heads=args.kv_heads, head_dim=args.head_dim,
                                   page_size=args.page_size, dtype=args.dtype, records=records)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-rehearsal", action="store_true",
                   help="tiny sizes, Pallas interpreted: checks the script itself on CPU")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--decode-seqs", type=int, default=64)
    p.add_argument("--decode-kv", type=int, default=2048)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--impls", default="pallas,xla,reference")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--min-time", type=float, default=0.5)
    p.add_argument("--copy-mb", type=int, default=1024)
    p.add_argument("--no-sweep", dest="sweep", action="store_false")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    args = p.parse_args(argv)
    if args.cpu_rehearsal:
        args.decode_seqs, args.decode_kv = 4, 64
        args.q_heads, args.kv_heads, args.head_dim = 8, 2, 64
        args.iters, args.min_time, args.copy_mb = 2, 0.0, 16

    t0 = time.time()
    kernels = import_kernels()
    import jax
    report = dict(jax_version=jax.__version__, backend=jax.default_backend(),
                  device=str(jax.devices()[0].device_kind), python=sys.version.split()[0],
                  impl_auto=kernels.resolve_impl(), cpu_rehearsal=args.cpu_rehearsal,
                  args=vars(args))
    print(f"device_check: jax {jax.__version__} on {report['device']} "
          f"(auto impl: {report['impl_auto']})", flush=True)
    sections = [("correctness", check_correctness, args.skip_correctness), ("timing", time_decode, args.skip_timing)]
    for name, section, skip in sections:
        if skip:
            continue
        try:  # one section failing must not cost the other its figures (device time is scarce)
            section(kernels, args, report)
        except Exception as e:  # noqa: BLE001
            report[f"{name}_error"] = traceback.format_exc()[-3000:]
            print(f"{name} section failed:", e)
    report["wall_s"] = time.time() - t0
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "device_check.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: v for k, v in report.items() if k != "args"}, default=str))
    print(f"wrote {path}")
    return 0 if report.get("correctness_ok", args.skip_correctness) else 1


if __name__ == "__main__":
    sys.exit(main())
