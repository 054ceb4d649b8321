#!/usr/bin/env python
"""Start-up: a cold start (empty compilation cache) and a warm start (same cache again), broken down.

    python scripts/benchmark_startup.py                          # the `jaxrunner generate` engine defaults
    python scripts/benchmark_startup.py --max-num-seqs 4 --max-num-batched-tokens 64 --max-model-len 256

Each start runs in its own Python process, so nothing in memory (JAX's in-process executable
cache, imported modules) carries over: the cold start gets a fresh empty persistent compilation
cache directory, the warm start reuses it. From ``llm.startup_report``: model load, compile (sum
over buckets), warm-up (which includes compiling; its run-only part is reported too), KV
allocation (warm-up's wall time covers lowering, compiling on a thread pool and one run per bucket;
Σ per-bucket lower/compile/run are reported too); plus the process's import time and total. Then ``--num-ttft-requests`` (default 10)
requests of the same shape are served one after the other, and the time to first token of the
first is compared with the tenth's. The OS file cache is not dropped: the GGUF file is read from
memory by the second process.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

_T0 = time.perf_counter()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench_common as common  # noqa: E402

KIND = "startup"
REPORT_KEYS = ("load_s", "compile_s_total", "warmup_s", "kv_alloc_s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens of the TTFT requests")
    parser.add_argument("--output-len", type=int, default=8, help="output tokens of the TTFT requests")
    parser.add_argument("--num-ttft-requests", type=int, default=10, help="requests served after start-up")
    parser.add_argument("--keep-cache", action="store_true", help="keep the temporary compilation cache dir")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per start")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: JSON options of one start
    common.add_engine_args(parser, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048)
    common.add_output_args(parser, KIND)
    return parser


# ----------------------------------------------------------------------------- one start (child process)
def child(spec: dict) -> dict:
    """Start an engine, read its report, then time TTFT of sequential same-shape requests."""
    import numpy as np

    t_import = time.perf_counter()
    from jaxrunner import LLM, SamplingParams

    import_s = time.perf_counter() - t_import
    start = time.perf_counter()
    llm = LLM(model=spec["model"], **spec["options"])
    construct_s = time.perf_counter() - start
    report = llm.startup_report

    engine = llm.engine
    vocab, low = common.tokenizer_vocab(llm.get_tokenizer())
    rng = np.random.default_rng(spec["seed"])
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    ttft = []
    for i in range(spec["num_ttft_requests"]):
        prompt = common.random_prompts(rng, [spec["input_len"]], vocab, low)[0]  # fresh: no prefix-cache hit
        request_id = f"startup-{i}"
        submitted = time.perf_counter()
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request_id and first is None:
                    first = time.perf_counter() - submitted
        ttft.append(first)
    breakdown = {k: report.get(k) for k in REPORT_KEYS}
    buckets = report.get("buckets", {}).values()
    # Buckets are lowered one by one, then compiled on a thread pool: Σ compile can exceed warm-up's wall time.
    breakdown["lower_s_total"] = sum(b.get("lower_s", 0.0) for b in buckets)
    breakdown["run_s_total"] = sum(b.get("run_s", 0.0) for b in buckets)
    breakdown["other_s"] = construct_s - sum(report.get(k) or 0.0 for k in ("load_s", "kv_alloc_s", "warmup_s"))
    return {"import_s": import_s, "construct_s": construct_s, "since_process_start_s": time.perf_counter() - _T0,
            **breakdown, "num_buckets": len(report.get("buckets", {})), "bucket_plan": report.get("bucket_plan"),
            "compilation_cache_dir": report.get("compilation_cache_dir"),
            "ttft_s": ttft, "ttft_first_s": ttft[0] if ttft else None,
            "ttft_tenth_s": ttft[9] if len(ttft) >= 10 else None, "ttft_last_s": ttft[-1] if ttft else None}


# ----------------------------------------------------------------------------- parent
def run_start(label: str, spec: dict, timeout: float, progress: bool) -> dict:
    """One start in a fresh interpreter; returns the child's measurements plus process wall time."""
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as handle:
        result_path = handle.name
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps({**spec, "result": result_path})]
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    print(f"[{label} start] {spec['options'].get('compilation_cache_dir')}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout, stdout=subprocess.PIPE,
                              stderr=None if progress else subprocess.PIPE, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            tail = (proc.stderr or "").strip().splitlines()[-5:]
            raise RuntimeError(f"{label} start failed (exit {proc.returncode}): {' | '.join(tail)}")
        with open(result_path, encoding="utf-8") as f:
            result = json.load(f)
    finally:
        os.unlink(result_path)
    result["process_wall_s"] = wall
    return result


TABLE_HEADERS = ["start", "process s", "import s", "engine s", "load s", "KV alloc s", "warm-up s", "Σ lower s",
                 "Σ compile s", "Σ run s", "other s", "buckets", "TTFT #1 ms", "TTFT #10 ms"]


def table_rows(results: dict) -> list[list]:
    return [[label, r["process_wall_s"], r["import_s"], r["construct_s"], r["load_s"], r["kv_alloc_s"], r["warmup_s"],
             r["lower_s_total"], r["compile_s_total"], r["run_s_total"], r["other_s"], r["num_buckets"],
             common.ms(r["ttft_first_s"]),
             common.ms(r["ttft_tenth_s"])] for label, r in results.items()]


def plot(path: str, results: dict, title: str) -> str:
    plt = common.pyplot()
    labels = list(results)
    parts = [("import_s", "import"), ("load_s", "load"), ("kv_alloc_s", "KV alloc"),
             ("warmup_s", "warm-up (lower + compile + run)"), ("other_s", "other")]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    bottom = [0.0] * len(labels)
    for key, name in parts:
        values = [max(0.0, results[label][key] or 0.0) for label in labels]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("s")
    ax.set_title("start-up breakdown (wall time)")
    for i, label in enumerate(labels):
        ax.annotate(f"Σ compile {results[label]['compile_s_total']:.1f} s", (i, bottom[i]), ha="center",
                    va="bottom", fontsize=8)
    ax.legend(fontsize=8)
    for label in labels:
        ttft = [common.ms(v) for v in results[label]["ttft_s"]]
        ax2.plot(range(1, len(ttft) + 1), ttft, "o-", label=label)
    ax2.set_xlabel("request # after start-up")
    ax2.set_ylabel("TTFT ms")
    ax2.set_title("time to first token, sequential same-shape requests")
    ax2.legend(fontsize=8)
    return common.save_figure(fig, path, title)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.child is not None:
        spec = json.loads(args.child)
        result = child(spec)
        with open(spec["result"], "w", encoding="utf-8") as f:
            json.dump(result, f)
        return 0
    if args.input_len < 1 or args.output_len < 1 or args.num_ttft_requests < 1:
        raise common.BenchError("--input-len, --output-len and --num-ttft-requests must be at least 1")
    if args.compilation_cache_dir:
        raise common.BenchError("--compilation-cache-dir: the start-up benchmark makes its own empty cache dir")
    progress = common.show_progress(args)
    options = common.engine_options(args, max_total_len=args.input_len + args.output_len, max_concurrency=1)
    cache_dir = tempfile.mkdtemp(prefix="jaxrunner-startup-cache-")
    options["compilation_cache_dir"] = cache_dir
    spec = {"model": args.model, "options": options, "seed": args.seed, "input_len": args.input_len,
            "output_len": args.output_len, "num_ttft_requests": args.num_ttft_requests}
    results = {}
    try:
        for label in ("cold", "warm"):
            results[label] = run_start(label, spec, args.timeout, progress)
        cache_files = sum(len(files) for _, _, files in os.walk(cache_dir))
    finally:
        if not args.keep_cache:
            shutil.rmtree(cache_dir, ignore_errors=True)
    cold, warm = results["cold"], results["warm"]
    speedup = {"process_wall": cold["process_wall_s"] / warm["process_wall_s"],
               "compile": cold["compile_s_total"] / max(warm["compile_s_total"], 1e-9),
               "engine": cold["construct_s"] / warm["construct_s"]}
    config = {"model": args.model, "engine": options, "input_len": args.input_len, "output_len": args.output_len,
              "num_ttft_requests": args.num_ttft_requests, "seed": args.seed,
              "cache_files_after_warm": cache_files, "cache_kept": args.keep_cache,
              "method": "each start in a fresh subprocess; cold = empty persistent compilation cache dir, "
                        "warm = the same dir again; OS file cache not dropped"}
    payload = {"config": config, "results": results, "cold_over_warm": speedup}
    title = f"start-up: {args.model}, {cold['num_buckets']} buckets"
    common.write_results(args, KIND, payload, plot, results, title)
    common.print_table(TABLE_HEADERS, table_rows(results),
                       title + f" — cold/warm: process {speedup['process_wall']:.2f}×, compile {speedup['compile']:.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(common.run_main("benchmark_startup", main))
