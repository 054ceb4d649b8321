#!/usr/bin/env python
"""Start-up: cold (empty compilation cache) and cached (the same cache again), broken down.

    python scripts/benchmark_startup.py                          # the CLI's and the README's configurations
    python scripts/benchmark_startup.py --configs cli --repeats 3
    python scripts/benchmark_startup.py --max-num-seqs 4 --max-num-batched-tokens 64 --max-model-len 256

Configurations: ``cli`` is what ``jaxrunner generate "a prompt"`` starts by default (dtype auto,
the model's max_model_len, 256-token steps, one sequence: the command narrows ``max_num_seqs`` to
its prompts), ``readme`` the Python example of the README
(float32, 64 sequences, 512-token steps, max_model_len 2048); engine flags make a ``custom`` one.
Each start runs in its own Python process, so nothing in memory (JAX's in-process executable
cache, imported modules) carries over: a cold start gets a fresh empty persistent compilation
cache directory, the cached start right after it reuses that directory. Starts alternate between
configurations, ``--repeats`` times; the figures are medians, every run is kept under ``runs``.

From ``llm.startup_report``: ``breakdown_s``, consecutive wall-time phases that add up to the
engine's start-up (load, KV sizing and allocation, dummy batches, tracing, lowering, the wait for
XLA's compile threads, warm-up runs, the attention self-check), Σ per-bucket seconds (compiles
overlap on a thread pool, so Σ compile exceeds its phase), and the persistent cache's hits and
misses; plus the process's import time and total. Then ``--num-ttft-requests`` requests of the
same shape are served one after the other (time to first token of the first and the tenth). The
OS file cache is not dropped: the GGUF file is read from memory after the first start.

``--compare vllm --vllm-python PATH`` starts vLLM too, in its own Python, right after each jaxrunner
pair, with the same model (the GGUF converted once to float), dtype and limits: cold with an empty
``VLLM_CACHE_ROOT``, cached with the same directory again. Its figures are the import of vllm, the
``LLM(...)`` construction and one request's time to first token.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

_T0 = time.perf_counter()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench_common as common  # noqa: E402

KIND = "startup"
REPORT_KEYS = ("startup_s", "load_s", "compile_s_total", "trace_s_total", "lower_s_total", "run_s_total",
               "warmup_s", "kv_alloc_s")
PHASES = ("cold", "cached")
# `jaxrunner generate`'s engine defaults (jaxrunner/cli.py) and the README's Python example.
CONFIGS = {
    "cli": dict(dtype="auto", max_model_len=None, max_num_seqs=1, max_num_batched_tokens=256),
    "readme": dict(dtype="float32", seed=0, page_size=16, max_num_seqs=64, max_num_batched_tokens=512,
                   max_model_len=2048),
}
MEDIAN_KEYS = ("process_wall_s", "import_s", "construct_s", "startup_s", "load_s", "warmup_s", "kv_alloc_s",
               "compile_s_total", "trace_s_total", "lower_s_total", "run_s_total", "ttft_first_s", "ttft_tenth_s")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=None,
                        help="comma-separated: cli, readme, custom (default: cli,readme; custom when engine "
                             "sizes are given)")
    parser.add_argument("--repeats", type=int, default=2, help="cold + cached pairs per configuration")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens of the TTFT requests")
    parser.add_argument("--output-len", type=int, default=8, help="output tokens of the TTFT requests")
    parser.add_argument("--num-ttft-requests", type=int, default=10, help="requests served after start-up")
    parser.add_argument("--keep-cache", action="store_true", help="keep the temporary compilation cache dirs")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed per start")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: JSON options of one start
    parser.add_argument("--compare", choices=["none", "vllm"], default="none",
                        help="also start vLLM, cold and cached, with the same model and limits")
    common.add_vllm_args(parser)
    common.add_engine_args(parser)
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
    buckets = {name: {k: v for k, v in info.items() if k in ("trace_s", "lower_s", "compile_s", "run_s",
                                                               "persistent_cache")}
               for name, info in report.get("buckets", {}).items()}
    return {"import_s": import_s, "construct_s": construct_s, "since_process_start_s": time.perf_counter() - _T0,
            **{k: report.get(k) for k in REPORT_KEYS}, "breakdown_s": report.get("breakdown_s"),
            "persistent_cache": report.get("persistent_cache"), "buckets": buckets,
            "num_buckets": len(buckets), "bucket_plan": report.get("bucket_plan"), "dtype": report.get("dtype"),
            "max_model_len": report.get("max_model_len"), "kv_pages": report.get("kv_pages"),
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


def vllm_start(python: str, args, options: dict, served: dict, cache_root: str, label: str, progress: bool) -> dict:
    """One vLLM start in its own process (``vllm_peer.py``, mode ``startup``) with ``cache_root`` as
    its cache, the dtype and max_model_len that jaxrunner's start ``served``; returns its import,
    construction and first-token seconds."""
    import numpy as np

    peer_options = {"dtype": served["dtype"], "max_num_seqs": options["max_num_seqs"],
                    "max_num_batched_tokens": options["max_num_batched_tokens"], "max_model_len": served["max_model_len"],
                    "enable_prefix_caching": True, "seed": args.seed}
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(10, 1000, args.input_len).tolist()
    spec = {**common.vllm_model_spec(args, peer_options), "mode": "startup", "prompt_token_ids": prompt}
    spec = common.vllm_peer_model(spec, progress, args.timeout)  # a GGUF's conversion is not the peer's start
    print(f"[{label} start] VLLM_CACHE_ROOT={cache_root}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    out = common.run_vllm_peer(python, spec, progress, timeout=args.timeout, env={"VLLM_CACHE_ROOT": cache_root})
    info = out["info"]
    return {"process_wall_s": time.perf_counter() - start, "import_s": info["import_s"],
            "construct_s": info["startup_s"], "ttft_first_s": out["result"]["ttft_first_s"],
            "dtype": served["dtype"], "max_model_len": served["max_model_len"], "vllm": info.get("vllm"),
            "torch": info.get("torch")}


def vllm_pair(python: str, args, options: dict, served: dict, name: str, repeat: int, progress: bool) -> dict:
    """vLLM cold (empty cache root) then cached (the same root again)."""
    cache_root = tempfile.mkdtemp(prefix="jaxrunner-vllm-cache-")
    try:
        return {phase: vllm_start(python, args, options, served, cache_root, f"vllm {name} {phase} #{repeat + 1}",
                                  progress)
                for phase in PHASES}
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)


def summarize(runs: list[dict]) -> dict:
    """Medians over runs (breakdown phases too), the cache counts of every run, and the runs."""
    def median(values):
        values = sorted(v for v in values if v is not None)
        return statistics.median(values) if values else None

    summary = {key: median(r.get(key) for r in runs) for key in MEDIAN_KEYS}
    summary["breakdown_s"] = {part: median(r["breakdown_s"].get(part) for r in runs)
                              for part in runs[0].get("breakdown_s") or {}}
    summary["persistent_cache"] = [r.get("persistent_cache") for r in runs]
    summary.update(num_buckets=runs[0]["num_buckets"], bucket_plan=runs[0]["bucket_plan"], dtype=runs[0]["dtype"],
                   max_model_len=runs[0]["max_model_len"], ttft_s=runs[0]["ttft_s"], runs=runs)
    return summary


VLLM_KEYS = ("process_wall_s", "import_s", "construct_s", "ttft_first_s")
VLLM_HEADERS = ["start", "engine", "process s", "import s", "construct s", "TTFT #1 ms"]


def summarize_vllm(runs: list[dict]) -> dict:
    summary = {key: statistics.median(r[key] for r in runs) for key in VLLM_KEYS}
    return {**summary, "dtype": runs[0]["dtype"], "max_model_len": runs[0]["max_model_len"],
            "vllm": runs[0]["vllm"], "torch": runs[0]["torch"], "runs": runs}


def vllm_ratios(results: dict, vllm: dict, names: list[str]) -> dict:
    """jaxrunner over vLLM per start (below 1: jaxrunner starts faster)."""
    return {f"{name} {phase}": {"process_wall": results[f"{name} {phase}"]["process_wall_s"]
                                / vllm[f"vllm {name} {phase}"]["process_wall_s"]}
            for name in names for phase in PHASES}


def vllm_rows(results: dict, vllm: dict) -> list[list]:
    rows = []
    for label, r in results.items():
        peer = vllm[f"vllm {label}"]
        rows.append([label, "jaxrunner", r["process_wall_s"], r["import_s"], r["construct_s"],
                     common.ms(r["ttft_first_s"])])
        rows.append([label, "vllm", peer["process_wall_s"], peer["import_s"], peer["construct_s"],
                     common.ms(peer["ttft_first_s"])])
    return rows


def config_options(name: str, args) -> dict:
    if name == "custom":
        return common.engine_options(args, max_total_len=args.input_len + args.output_len, max_concurrency=1)
    return {**CONFIGS[name], "progress": False}


def chosen_configs(args) -> list[str]:
    custom = any(getattr(args, k) is not None for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"))
    names = [n.strip() for n in (args.configs or ("custom" if custom else "cli,readme")).split(",") if n.strip()]
    unknown = [n for n in names if n not in (*CONFIGS, "custom")]
    if unknown or not names:
        raise common.BenchError(f"--configs {args.configs!r}: valid names are {', '.join((*CONFIGS, 'custom'))}")
    return names


TABLE_HEADERS = ["start", "process s", "import s", "start-up s", "load s", "KV s", "trace s", "lower s",
                 "compile wait s", "runs s", "self-check s", "Σ compile s", "cache hits/misses", "buckets",
                 "TTFT #1 ms", "TTFT #10 ms"]


def table_rows(results: dict) -> list[list]:
    rows = []
    for label, r in results.items():
        parts = r["breakdown_s"]
        cache = r["persistent_cache"][-1] or {}
        rows.append([label, r["process_wall_s"], r["import_s"], r["startup_s"], parts.get("load"),
                     (parts.get("kv_sizing") or 0) + (parts.get("kv_alloc") or 0), parts.get("trace"),
                     parts.get("lower"), parts.get("compile"), parts.get("run"), parts.get("self_check"),
                     r["compile_s_total"], f"{cache.get('hits')}/{cache.get('misses')}", r["num_buckets"],
                     common.ms(r["ttft_first_s"]), common.ms(r["ttft_tenth_s"])])
    return rows


BREAKDOWN_PARTS = (("load", "load"), ("kv_sizing", "KV sizing"), ("kv_alloc", "KV alloc"),
                   ("dummy_batches", "dummy batches"), ("trace", "trace"), ("lower", "lower"),
                   ("compile", "compile wait"), ("run", "warm-up runs"), ("self_check", "self-check"),
                   ("other", "other"))


def plot(path: str, results: dict, title: str) -> str:
    plt = common.pyplot()
    labels = list(results)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    bottom = [0.0] * len(labels)
    for key, name in (("import_s", "import"),) + BREAKDOWN_PARTS:
        values = [max(0.0, (results[label]["breakdown_s"].get(key) if key != "import_s"
                            else results[label]["import_s"]) or 0.0) for label in labels]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("s (median)")
    ax.set_title("start-up breakdown (wall time)")
    ax.tick_params(axis="x", labelrotation=20)
    ax.legend(fontsize=7)
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
    if args.input_len < 1 or args.output_len < 1 or args.num_ttft_requests < 1 or args.repeats < 1:
        raise common.BenchError("--input-len, --output-len, --num-ttft-requests and --repeats must be at least 1")
    if args.compilation_cache_dir:
        raise common.BenchError("--compilation-cache-dir: the start-up benchmark makes its own empty cache dirs")
    progress = common.show_progress(args)
    names = chosen_configs(args)
    vllm_python = common.check_vllm_python(args) if args.compare == "vllm" else None
    options = {name: config_options(name, args) for name in names}
    runs: dict[str, list[dict]] = {f"{name} {phase}": [] for name in names for phase in PHASES}
    vllm_runs: dict[str, list[dict]] = {f"vllm {name} {phase}": [] for name in names for phase in PHASES}
    cache_files = {}
    for repeat in range(args.repeats):
        for name in names:  # alternate configurations: the machine's drift spreads over all of them
            cache_dir = tempfile.mkdtemp(prefix="jaxrunner-startup-cache-")
            spec = {"model": args.model, "options": {**options[name], "compilation_cache_dir": cache_dir},
                    "seed": args.seed, "input_len": args.input_len, "output_len": args.output_len,
                    "num_ttft_requests": args.num_ttft_requests}
            try:
                for phase in PHASES:
                    runs[f"{name} {phase}"].append(run_start(f"{name} {phase} #{repeat + 1}", spec, args.timeout,
                                                             progress))
                cache_files[name] = sum(len(files) for _, _, files in os.walk(cache_dir))
            finally:
                if not args.keep_cache:
                    shutil.rmtree(cache_dir, ignore_errors=True)
            if vllm_python:
                pair = vllm_pair(vllm_python, args, options[name], runs[f"{name} cold"][-1], name, repeat, progress)
                for phase in PHASES:
                    vllm_runs[f"vllm {name} {phase}"].append(pair[phase])
    results = {label: summarize(r) for label, r in runs.items()}
    cold_over_cached = {name: results[f"{name} cold"]["process_wall_s"] / results[f"{name} cached"]["process_wall_s"]
                        for name in names}
    config = {"model": args.model, "configs": options, "repeats": args.repeats, "input_len": args.input_len,
              "output_len": args.output_len, "num_ttft_requests": args.num_ttft_requests, "seed": args.seed,
              "cache_files_after_cached": cache_files, "cache_kept": args.keep_cache,
              "engine": options[names[0]],
              "method": "each start in a fresh subprocess; cold = empty persistent compilation cache dir, "
                        "cached = the same dir again right after; configurations alternate; medians over "
                        "repeats; OS file cache not dropped"}
    payload = {"config": config, "results": results, "cold_over_cached_process_wall": cold_over_cached}
    if vllm_python:
        payload["vllm"] = {label: summarize_vllm(r) for label, r in vllm_runs.items()}
        payload["ratio"] = vllm_ratios(results, payload["vllm"], names)
    title = f"start-up: {args.model}, " + ", ".join(f"{n} {results[n + ' cold']['num_buckets']} buckets" for n in names)
    common.write_results(args, KIND, payload, plot, results, title)
    common.print_table(TABLE_HEADERS, table_rows(results), title + " — cold/cached process: " +
                       ", ".join(f"{n} {v:.2f}×" for n, v in cold_over_cached.items()))
    if vllm_python:
        common.print_table(VLLM_HEADERS, vllm_rows(results, payload["vllm"]),
                           "side by side (medians), jaxrunner / vLLM process wall: " +
                           ", ".join(f"{label} {v['process_wall']:.2f}×" for label, v in payload["ratio"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(common.run_main("benchmark_startup", main))
