#!/usr/bin/env python3
"""XLA's dot against oneDNN's matmul on packed weights (``jaxrunner.kernels.onednn_matmul``, the
weights packed once by ``kernels.onednn_pack``) on the products of a model's linear layers, in one
process, alternating, on this CPU. With ``--quantization int4`` or ``int8``, weight-only leaves
instead: XLA's dot after dequantizing in the activations' dtype, the native kernel
(``quantized_matmul_native``) and XLA's dot on the float weight the leaf stands for ("dense"), each
at every row count; bf16 activations also on oneDNN on tiles unpacked in cache
(``onednn_quant_matmul``), float32 ones also on XLA's dot after the native kernel unpacks the
weight ("unpacked", the route ``models/linear.py`` takes many float32 rows on without the panel
GEMMs). With
``--eigen``, float products also run XLA's dot compiled with YNNPACK's fusions off (Eigen's dot:
the option applies to a whole executable, so it is measured per product here first).

Each timed call chains the product over distinct weights (``--layers``, as a step walks the
layers), so the weights come from memory as they do when serving, not from a warm cache. Prints a table and
writes one JSON per dtype with the CPU's flags (``benchmarks/results/matmul-<dtype>-<date>-<commit>.json``
unless ``--output-dir`` says elsewhere): the table in ``kernels/platform_support.py``
(``ONEDNN_FASTER``) is read off these figures, per CPU kind.

    python scripts/bench_matmul.py                                  # SmolLM2's and a 1B Llama's shapes
    python scripts/bench_matmul.py --dtypes float32 --rows 16,64,256 --output-dir /tmp
    python scripts/bench_matmul.py --quantization int4 --dtypes bfloat16 --rows 4,8,16,32,64,256
    python scripts/bench_matmul.py --quantization int4 --dtypes float32 --rows 8,16,64,256,512,1024
    python scripts/bench_matmul.py --orientations --models smollm2   # XLA_WEIGHTS_NK: [K, N] vs [N, K]
    python scripts/bench_matmul.py --eigen --dtypes float32 --rows 8,16,32,64   # YNNPACK vs Eigen
    XLA_FLAGS=--xla_cpu_use_onednn=true python scripts/bench_matmul.py   # XLA's own oneDNN flag on its side
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_common as common  # noqa: E402

from jaxrunner import kernels  # noqa: E402
from jaxrunner.kernels import onednn  # noqa: E402
from jaxrunner.models import quant  # noqa: E402

FLOAT_IMPLS = ("xla", "onednn")
# weight-only leaves, by activation dtype: (implementations, the pair the last column compares)
WEIGHT_ONLY_IMPLS = {"bfloat16": (("xla", "native", "onednn", "dense"), ("xla", "onednn")),
                     "float32": (("xla", "native", "unpacked", "dense"), ("unpacked", "native"))}
EIGEN = "eigen"  # XLA's dot with YNNPACK's fusions off (--eigen)
YNN_FUSION_OPTION = "xla_cpu_experimental_ynn_fusion_type"  # XLA's option; empty: no YNNPACK fusions
# (name, K, N, weight is [N, K]): the products of one layer and the LM head
SHAPES = {
    "smollm2": [("qkv", 576, 960, False), ("o", 576, 576, False), ("gate_up", 576, 3072, False),
                ("down", 1536, 576, False), ("lm_head", 576, 49152, True)],
    "llama-1b": [("qkv", 2048, 3072, False), ("o", 2048, 2048, False), ("gate_up", 2048, 16384, False),
                 ("down", 8192, 2048, False), ("lm_head", 2048, 49152, True)],
}


def shapes(model: str, orientations: bool) -> list[tuple[str, int, int, bool]]:
    """The model's products; with ``orientations``, each twice: weight [K, N] ("_kn") and [N, K] ("_nk")."""
    if not orientations:
        return SHAPES[model]
    return [(f"{name}_{'nk' if nk else 'kn'}", k, n, nk) for name, k, n, _ in SHAPES[model] for nk in (False, True)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,llama-1b", help=f"shape sets: {', '.join(SHAPES)}")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rows", default="4,16,32,64,128,256,512", help="rows of the activations")
    parser.add_argument("--layers", type=int, default=4, help="distinct weights each timed call walks")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; the median is reported")
    parser.add_argument("--orientations", action="store_true",
                        help="each float product with its weight held both [K, N] and [N, K]")
    parser.add_argument("--quantization", choices=("int4", "int8"), default=None,
                        help="weight-only leaves (bf16 or float32 activations) instead of float weights")
    parser.add_argument("--eigen", action="store_true",
                        help="float products also on XLA's dot with YNNPACK's fusions off (Eigen's dot)")
    parser.add_argument("--output-dir", default=common.RESULTS_DIR, help="where the JSON files go")
    return parser


def float_product(transposed: bool, impl: str):
    def product(x, w):
        if impl == "onednn":
            return kernels.onednn_matmul(x, w)
        dims = (((1,), (1 if transposed else 0,)), ((), ()))
        return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    return product


def weight_only_product(impl: str):
    def product(x, w):
        if impl == "onednn":
            return kernels.onednn_quant_matmul(x, w)
        if impl == "native":
            return kernels.quantized_matmul_native(x, w)
        if impl == "dense":  # w: the float [N, K] weight itself
            return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if impl == "unpacked":
            unpacked = kernels.dequantize_native(w, after=x)
        else:
            unpacked = quant.dequantize(w, x.dtype)  # what models/linear.py does without the kernels
        return jax.lax.dot_general(x, unpacked, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return product


def chained_products(product):
    """x times each of a tuple of weights, one after the other (each product waits for the last, as
    a model's layers do; unrolled: an XLA loop would copy the stacked weights every iteration)."""

    def run(x, ws):
        total = None
        for w in ws:
            out = product(x, w)
            x = x + (out[:, :1] * 0).astype(x.dtype)  # the next product depends on this one
            total = out if total is None else total + out
        return total

    return jax.jit(run)


def seconds_per_call(fn, x, ws, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(x, ws)
    out.block_until_ready()
    return (time.perf_counter() - start) / calls / len(ws)


def contenders(k: int, n: int, transposed: bool, dtype, rows: int, args) -> tuple[jax.Array, dict, dict]:
    """(x, implementation -> chained products, implementation -> its weights)."""
    key = jax.random.key(rows)
    ws = tuple(jax.random.normal(jax.random.fold_in(key, i + 2), (n, k) if transposed else (k, n), dtype)
               for i in range(args.layers))
    x = jax.random.normal(jax.random.fold_in(key, 1), (rows, k), dtype)
    if args.quantization:
        leaves = tuple(quant.quantize_weight_only(w.T if transposed else w, args.quantization) for w in ws)
        leaves = tuple({name: jnp.asarray(part) for name, part in leaf.items()} for leaf in leaves)
        impls = impls_of(args, dtype)
        weights = {impl: tuple(w if transposed else w.T for w in ws) if impl == "dense" else leaves for impl in impls}
        return x, {impl: chained_products(weight_only_product(impl)) for impl in impls}, weights
    fns = {impl: chained_products(float_product(transposed, impl)) for impl in ("xla", "onednn")}
    weights = {"xla": ws, "onednn": tuple(kernels.onednn_pack(w, transposed=transposed) for w in ws)}
    if args.eigen:
        fns[EIGEN] = fns["xla"].lower(x, ws).compile(compiler_options={YNN_FUSION_OPTION: ""})
        weights[EIGEN] = ws
    return x, fns, weights


def impls_of(args, dtype) -> tuple[str, ...]:
    if args.quantization:
        return WEIGHT_ONLY_IMPLS[jnp.dtype(dtype).name][0]
    return FLOAT_IMPLS + ((EIGEN,) if args.eigen else ())


def compared(args, dtype) -> tuple[str, str]:
    """(baseline, contender) of the speedup column: oneDNN against XLA, or for float32 weight-only
    leaves the native kernel against unpacking for XLA's dot."""
    return WEIGHT_ONLY_IMPLS[jnp.dtype(dtype).name][1] if args.quantization else ("xla", "onednn")


def measure(model: str, name: str, k: int, n: int, transposed: bool, dtype, rows: int, args) -> dict:
    x, fns, weights = contenders(k, n, transposed, dtype, rows, args)
    outs = {impl: fn(x, weights[impl]) for impl, fn in fns.items()}
    base, contender = compared(args, dtype)
    error = float(jnp.max(jnp.abs(outs[base] - outs[contender])) / (jnp.max(jnp.abs(outs[base])) + 1e-30))
    calls = max(3, int(2e9 // (2 * rows * k * n * args.layers)))
    times = {impl: [] for impl in fns}
    for _ in range(args.rounds):
        for impl, fn in fns.items():
            times[impl].append(seconds_per_call(fn, x, weights[impl], calls))
    flops = 2 * rows * k * n
    result = {"model": model, "product": name, "dtype": jnp.dtype(dtype).name, "rows": rows, "k": k, "n": n,
              "weight_nk": transposed, "quantization": args.quantization, "max_rel_diff": error}
    for impl, values in times.items():
        result[f"{impl}_us"] = statistics.median(values) * 1e6
        result[f"{impl}_gflops"] = flops / statistics.median(values) / 1e9
    result[f"{contender}_speedup"] = result[f"{base}_us"] / result[f"{contender}_us"]
    if EIGEN in times:
        result["eigen_speedup"] = result["xla_us"] / result["eigen_us"]
    return result


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    why = kernels.onednn_unavailable()
    if why is not None:
        print(f"oneDNN's matmul is unavailable: {why}", file=sys.stderr)
        return 1
    for dtype in args.dtypes.split(","):
        if args.quantization and jnp.dtype(dtype).name not in WEIGHT_ONLY_IMPLS:
            print(f"skipping {dtype}: weight-only products take {', '.join(WEIGHT_ONLY_IMPLS)} activations",
                  file=sys.stderr)
            continue
        if not args.quantization and not onednn.has_matmul(dtype):
            print(f"skipping {dtype}: oneDNN has no {dtype} matmul on this CPU (bf16 needs AVX-512)", file=sys.stderr)
            continue
        results = []
        base, contender = compared(args, dtype)
        for model in args.models.split(","):
            for rows in common.parse_int_list(args.rows, "--rows"):
                for name, k, n, transposed in shapes(model, args.orientations):
                    results.append(measure(model, name, k, n, transposed, jnp.dtype(dtype), rows, args))
                    r = results[-1]
                    rates = ", ".join(f"{impl} {r[impl + '_gflops']:.0f}" for impl in impls_of(args, dtype))
                    print(f"{model} {dtype} {name} rows {rows}: {rates} GFLOP/s ({r[contender + '_speedup']:.2f}x)",
                          file=sys.stderr, flush=True)
        impls = impls_of(args, dtype)
        table = [[r["model"], r["product"], r["rows"], *(f"{r[impl + '_gflops']:.0f}" for impl in impls),
                  f"{r[contender + '_speedup']:.2f}"] for r in results]
        common.print_table(["model", "product", "rows", *(f"{impl} GFLOP/s" for impl in impls),
                            f"{contender} / {base}"], table,
                           title=f"{dtype}{' ' + args.quantization if args.quantization else ''}: products by "
                                 f"implementation (median of alternating rounds)")
        kind = f"{dtype}-{args.quantization}" if args.quantization else dtype
        path = os.path.join(args.output_dir, common.result_name("matmul", kind) + ".json")
        common.write_json(path, "matmul", {"xla_flags": os.environ.get("XLA_FLAGS", ""), "layers": args.layers,
                                           "rounds": args.rounds, "results": results})
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
