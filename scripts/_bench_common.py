"""Helpers shared by the benchmark scripts: engine flags, workloads, versions/device, JSON, tables,
percentiles, plots, and the transformers baseline.

The scripts use only what a user can import (``jaxrunner``'s public API, plus
``jaxrunner.models.loading.resolve`` to find the GGUF file transformers should load).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import importlib.resources
import json
import math
import os
import platform
import sys
import time

import numpy as np

from jaxrunner.config import KV_CACHE_DTYPES
from jaxrunner.kernels import cpu_isa
from jaxrunner.kernels.names import ATTENTION_IMPL_CHOICES, CPU_MATMUL_CHOICES

DEFAULT_MODEL = "smollm2-135m-instruct"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")


class BenchError(ValueError):
    """A user error in a benchmark's flags or inputs: printed as one line, exit code 2."""


# ----------------------------------------------------------------------------- flags
def add_engine_args(parser: argparse.ArgumentParser, *, max_num_seqs: int | None = None,
                    max_num_batched_tokens: int | None = None, max_model_len: int | None = None) -> None:
    """Engine flags. ``None`` defaults are derived from the workload (see ``engine_options``)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"model alias, .gguf file or directory (default {DEFAULT_MODEL})")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    g.add_argument("--quantization", default=None, choices=["int8", "int4", "w4a8", "w8a8"],
                   help="linear-layer weights (default: float, the dtype)")
    g.add_argument("--max-num-seqs", type=int, default=max_num_seqs,
                   help="most sequences in one step (default: derived from the workload)")
    g.add_argument("--max-num-batched-tokens", type=int, default=max_num_batched_tokens,
                   help=f"token budget of one step (default: max({MIN_TOKEN_BUDGET}, max-num-seqs))")
    g.add_argument("--max-model-len", type=int, default=max_model_len,
                   help="longest prompt + output (default: the workload's longest, rounded up to a page)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=[c for c in KV_CACHE_DTYPES if c],
                   help="KV cache pages (fp8*: one byte a value, unscaled; a vLLM peer gets the same)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--num-pages", type=int, default=None, help="KV pool size in pages (default: sized by memory)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    g.add_argument("--no-chunked-prefill", action="store_true", help="disable chunked prefill")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step before planning the next (no host/device overlap)")
    g.add_argument("--attention-impl", default="auto", choices=list(ATTENTION_IMPL_CHOICES))
    g.add_argument("--cpu-matmul", default="auto", choices=list(CPU_MATMUL_CHOICES),
                   help="CPU linear products: packed oneDNN or XLA's dot (auto: as measured per CPU kind)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="devices that split the model")
    g.add_argument("--data-parallel-size", type=int, default=1, help="engine replicas, each on its own devices")
    g.add_argument("--compilation-cache-dir", default=None,
                   help="persistent XLA cache (default: $JAXRUNNER_COMPILATION_CACHE or ~/.cache/jaxrunner/xla)")
    g.add_argument("--seed", type=int, default=0, help="seed of the workload and the engine")
    g.add_argument("--no-progress", action="store_true", help="hide progress bars")


def add_output_args(parser: argparse.ArgumentParser, kind: str) -> None:
    parser.add_argument("--output-json", default=None,
                        help=f"where to write results (default benchmarks/results/{kind}-<dtype>-<date>-<commit>.json, "
                             "-tpN/-dpM after the name when parallel, headline figures appended to "
                             "benchmarks/results/history.csv); the PNG goes next to it")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")


def parse_int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise BenchError(f"{name}: expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise BenchError(f"{name}: expected positive integers, got {text!r}")
    return values


def parse_range(text: str, name: str) -> tuple[int, int]:
    """``"32..256"`` (or ``"32:256"``, or one number) -> (lo, hi), inclusive."""
    for sep in ("..", ":", "-"):
        if sep in str(text):
            lo, hi = str(text).split(sep, 1)
            break
    else:
        lo = hi = str(text)
    try:
        lo, hi = int(lo), int(hi)
    except ValueError:
        raise BenchError(f"{name}: expected LO..HI, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise BenchError(f"{name}: expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def round_up(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)


MIN_TOKEN_BUDGET = 256  # the default token budget of one step, unless more sequences than that run


def default_token_budget(max_num_seqs: int) -> int:
    """The step's token budget when ``--max-num-batched-tokens`` is unset."""
    return max(MIN_TOKEN_BUDGET, max_num_seqs)


def engine_options(args, *, max_total_len: int, max_concurrency: int, strict: bool = True) -> dict:
    """``LLM(**options)`` from the flags; unset sizes fit the workload (longest request, concurrency).

    ``strict``: ``max_total_len`` is exact (else an estimate, checked once prompts are tokenized).
    """
    max_model_len = args.max_model_len or round_up(max_total_len, args.page_size)
    if strict and max_total_len > max_model_len:
        raise BenchError(f"--max-model-len {max_model_len}: the workload's longest request needs "
                         f"{max_total_len} tokens (prompt + output)")
    max_num_seqs = args.max_num_seqs or max(1, min(max_concurrency, 64))
    max_num_batched_tokens = args.max_num_batched_tokens or default_token_budget(max_num_seqs)
    options = dict(dtype=args.dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                   max_model_len=max_model_len, page_size=args.page_size,
                   enable_prefix_caching=not args.no_prefix_caching,
                   enable_chunked_prefill=not args.no_chunked_prefill, attention_impl=args.attention_impl,
                   cpu_matmul=args.cpu_matmul, async_scheduling=not args.no_async_scheduling,
                   seed=args.seed, progress=show_progress(args), tensor_parallel_size=args.tensor_parallel_size,
                   data_parallel_size=args.data_parallel_size, quantization=getattr(args, "quantization", None),
                   kv_cache_dtype=args.kv_cache_dtype)
    if args.num_pages is not None:
        options["num_pages"] = args.num_pages
    if args.compilation_cache_dir:
        options["compilation_cache_dir"] = args.compilation_cache_dir
    return options


def show_progress(args) -> bool:
    return not getattr(args, "no_progress", False) and sys.stderr.isatty()


def start_llm(model: str, options: dict):
    """Load and warm up an engine; returns (llm, seconds)."""
    from jaxrunner import LLM

    start = time.perf_counter()
    llm = LLM(model=model, **options)
    return llm, time.perf_counter() - start


def startup_summary(llm) -> dict:
    report = llm.startup_report
    keys = ("load_s", "compile_s_total", "warmup_s", "kv_alloc_s", "bucket_plan", "kv_pages", "kv_tokens",
            "attention_impl", "cpu_matmul", "max_model_len", "dtype", "quantization")
    return {k: report.get(k) for k in keys}


# ----------------------------------------------------------------------------- workloads
def builtin_dataset_path() -> str:
    return str(importlib.resources.files("jaxrunner").joinpath("data", "chat_prompts.jsonl"))


def read_jsonl(path: str) -> list[dict]:
    if not path or not os.path.isfile(path):
        raise BenchError(f"--dataset-path {path!r}: no such file")
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise BenchError(f"{path}:{number}: not JSON ({err.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise BenchError(f"{path}:{number}: expected {{\"prompt\": str, \"output_len\": int}}")
            output_len = row.get("output_len")
            if output_len is not None and (not isinstance(output_len, int) or output_len < 1):
                raise BenchError(f"{path}:{number}: output_len must be a positive integer, got {output_len!r}")
            rows.append(row)
    if not rows:
        raise BenchError(f"{path}: no requests")
    return rows


def random_prompts(rng: np.random.Generator, lengths, vocab_size: int, low: int = 0) -> list[list[int]]:
    """Uniform random token ids (skipping the ``low`` first ids, where special tokens live)."""
    return [rng.integers(low, vocab_size, int(n)).tolist() for n in lengths]


def dataset_requests(args, tokenizer, num_requests: int, rng: np.random.Generator,
                     default_output_len: int) -> list[dict]:
    """Requests from ``--dataset``: list of {"prompt_token_ids", "output_len"} (plus "prompt" for text).

    ``random``: ``num_requests`` prompts of uniform random token ids, lengths in ``--input-len``.
    ``jsonl``/``builtin``: prompts from a file, chat template applied when the tokenizer has one
    (``--no-chat-template`` to tokenize them raw); ``num_requests`` cycles through the file.
    """
    requests = _dataset_requests(args, tokenizer, num_requests, rng, default_output_len)
    cap = getattr(args, "max_output_len", None)
    if cap is not None:
        if cap < 1:
            raise BenchError(f"--max-output-len: must be at least 1, got {cap}")
        for r in requests:
            r["output_len"] = min(r["output_len"], cap)
    return requests


def longest_request(args, prompt_room: int) -> int:
    """Upper bound on prompt + output tokens of the workload, before tokenizing (sizes max_model_len)."""
    cap = getattr(args, "max_output_len", None) or float("inf")
    if args.dataset == "random":
        return parse_range(args.input_len, "--input-len")[1] + int(min(args.output_len, cap))
    if args.dataset == "jsonl" and not args.dataset_path:
        raise BenchError("--dataset jsonl needs --dataset-path")
    rows = read_jsonl(builtin_dataset_path() if args.dataset == "builtin" else args.dataset_path)
    return prompt_room + int(min(max(int(r.get("output_len") or args.output_len) for r in rows), cap))


def _dataset_requests(args, tokenizer, num_requests: int, rng: np.random.Generator,
                      default_output_len: int) -> list[dict]:
    if args.dataset == "random":
        lo, hi = parse_range(args.input_len, "--input-len")
        lengths = rng.integers(lo, hi + 1, num_requests)
        vocab, low = tokenizer_vocab(tokenizer)
        outs = [default_output_len] * num_requests
        return [{"prompt_token_ids": ids, "output_len": int(o)}
                for ids, o in zip(random_prompts(rng, lengths, vocab, low), outs)]
    path = builtin_dataset_path() if args.dataset == "builtin" else args.dataset_path
    rows = read_jsonl(path)
    if tokenizer is None:
        raise BenchError(f"--dataset {args.dataset}: the model has no tokenizer to encode text prompts")
    use_template = not getattr(args, "no_chat_template", False) and getattr(tokenizer, "chat_template", None)
    requests = []
    for i in range(num_requests):
        row = rows[i % len(rows)]
        if use_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(row["prompt"])
        output_len = int(row.get("output_len") or default_output_len)
        requests.append({"prompt": row["prompt"], "prompt_token_ids": list(ids), "output_len": output_len})
    return requests


def add_dataset_args(parser: argparse.ArgumentParser, *, input_len: str = "32..256", output_len: int = 128) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--dataset", default="random", choices=["random", "jsonl", "builtin"],
                   help="random token ids, a JSONL file of {prompt, output_len}, or the built-in chat prompts")
    g.add_argument("--dataset-path", default=None, help="JSONL file for --dataset jsonl")
    g.add_argument("--input-len", default=input_len, help="prompt length range LO..HI for --dataset random")
    g.add_argument("--output-len", type=int, default=output_len,
                   help="output tokens per request (jsonl rows without output_len use it too)")
    g.add_argument("--max-output-len", type=int, default=None,
                   help="cap every request's output length (e.g. to shorten a JSONL dataset's)")
    g.add_argument("--no-chat-template", action="store_true", help="tokenize JSONL prompts without the template")


def tokenizer_vocab(tokenizer) -> tuple[int, int]:
    """(vocab size, lowest id to sample) for random prompts: skip the special tokens at the bottom."""
    if tokenizer is None:
        return 32000, 0
    vocab = len(tokenizer)
    specials = [i for i in getattr(tokenizer, "all_special_ids", []) if i is not None]
    low = max(specials) + 1 if specials and max(specials) < vocab // 4 else 0
    return vocab, low


# ----------------------------------------------------------------------------- statistics
def percentiles(values, qs=(50, 90, 99)) -> dict:
    """{"p50": ..., "p90": ..., "p99": ..., "mean": ..., "n": ...} (None values when empty)."""
    values = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not values:
        return {**{f"p{q}": None for q in qs}, "mean": None, "n": 0}
    arr = np.asarray(values, dtype=np.float64)
    out = {f"p{q}": float(np.percentile(arr, q)) for q in qs}
    out["mean"] = float(arr.mean())
    out["n"] = len(values)
    return out


def ms(value) -> float | None:
    return None if value is None else value * 1e3


# ----------------------------------------------------------------------------- environment
def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("jaxrunner", "jax", "jaxlib", "numpy", "transformers", "torch", "tokenizers", "accelerate"):
        out[name] = _version(name)
    return out


def _cpu_model() -> str:
    return cpu_isa.first_cpu_fields().get("model name") or platform.processor() or platform.machine()


def cpu_model_id(cpuinfo: str | None = None) -> str | None:
    """``family F model M`` from ``/proc/cpuinfo`` (x86), or None. Virtual machines often name every
    CPU "Intel(R) Xeon(R) Processor" with the same vector features; on two such Xeons here vLLM's
    same build served SmolLM2 1.6x apart, and only the model number told them apart."""
    fields = cpu_isa.first_cpu_fields(cpuinfo)
    if "cpu family" not in fields or "model" not in fields:
        return None
    return f"family {fields['cpu family']} model {fields['model']}"


def load_average() -> float | None:
    """The 1-minute load average: above the core count, other processes compete for the CPUs and
    timings (torch's OpenMP threads especially) get noisy."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def device_info() -> dict:
    info = {"platform": platform.platform(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
            "load_average_1m": load_average()}
    model_id = cpu_model_id()
    if model_id is not None:
        info["cpu_model_id"] = model_id
    try:
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    from jaxrunner.kernels import cpu_flags, max_isa

    cap = max_isa()
    if cap is not None:  # the kernels were built and chosen as for an older CPU
        info["cpu_max_isa"] = cap

    # speeds differ most by these (bf16 dots, AMX tiles): results of two machines compare only with them
    info["cpu_features"] = sorted(cpu_flags() & {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16",
                                                 "avx_vnni", "amx_tile", "amx_bf16", "amx_int8"})
    try:
        import jax

        devices = jax.devices()
        info.update(jax_backend=jax.default_backend(), jax_devices=[str(d) for d in devices],
                    jax_device_kind=devices[0].device_kind)
    except Exception as err:  # noqa: BLE001 - the report must not fail on a probe
        info["jax_error"] = str(err)
    if "torch" in sys.modules:
        import torch

        info["torch_num_threads"] = torch.get_num_threads()
    return info


def git_commit() -> str:
    """Short hash of the checkout the scripts run from, or ``nogit`` outside a git checkout."""
    import subprocess

    try:
        proc = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "nogit"
    commit = proc.stdout.strip()
    return commit if proc.returncode == 0 and commit else "nogit"


def result_name(kind: str, dtype: str, *, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                date: str | None = None, commit: str | None = None) -> str:
    """``<benchmark>[-tpN][-dpM]-<dtype>-<date>-<commit>``: the stem of a result file's name.

    Only the latest result of each kind stays in ``benchmarks/results/``; older headline figures
    live on in ``history.csv`` (``scripts/bench_history.py``)."""
    parallel = (f"-tp{tensor_parallel_size}" if tensor_parallel_size > 1 else "") + \
               (f"-dp{data_parallel_size}" if data_parallel_size > 1 else "")
    date = date or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    return f"{kind}{parallel}-{dtype}-{date}-{commit or git_commit()}"


def default_output_json(kind: str, args, commit: str | None = None) -> str:
    """``benchmarks/results/<result_name>.json`` for a run with the engine flags in ``args`` (and
    ``-sampled`` for requests drawn at a temperature, whose figures are not the greedy ones', and
    ``-logprobs`` for requests that ask for logprobs)."""
    quantization, kv = getattr(args, "quantization", None), getattr(args, "kv_cache_dtype", "auto")
    dtype = f"{args.dtype}-{quantization}" if quantization else args.dtype
    dtype += f"-kv{kv}" if kv != "auto" else ""
    dtype += "-sampled" if getattr(args, "temperature", 0) > 0 else ""
    dtype += "-logprobs" if getattr(args, "logprobs", None) is not None else ""
    name = result_name(kind, dtype, tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                       data_parallel_size=getattr(args, "data_parallel_size", 1), commit=commit)
    return os.path.join(RESULTS_DIR, name + ".json")


def write_json(path: str, kind: str, payload: dict, commit: str | None = None) -> str:
    """Write ``payload`` with benchmark name, date, commit, versions and device; returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"benchmark": kind, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit or git_commit(),
           "command": " ".join([os.path.basename(sys.argv[0] or kind)] + sys.argv[1:]),
           "versions": versions(), "device": device_info(), **payload}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, default=_json_default)
        f.write("\n")
    return path


def _json_default(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def write_results(args, kind: str, payload: dict, plot, plot_data, title: str) -> str:
    """Write the JSON (and the PNG beside it unless --no-plot) and say where on stderr.

    Without --output-json the file is ``benchmarks/results/<benchmark>[-tpN][-dpM]-<dtype>-<date>-<commit>.json``
    and its headline figures are appended to ``benchmarks/results/history.csv``."""
    commit = git_commit()
    path = write_json(args.output_json or default_output_json(kind, args, commit), kind, payload, commit)
    if not args.no_plot:
        plot(png_path(path), plot_data, title)
    print(f"wrote {path}" + ("" if args.no_plot else f" and {png_path(path)}"), file=sys.stderr)
    if os.path.dirname(os.path.abspath(path)) == os.path.abspath(RESULTS_DIR):
        append_history(path)
    return path


def append_history(json_path: str) -> None:
    """Append a result file's headline figures to ``benchmarks/results/history.csv``."""
    scripts_dir = os.path.dirname(os.path.abspath(__file__))
    if scripts_dir not in sys.path:
        sys.path.insert(0, scripts_dir)
    import bench_history

    with open(json_path, encoding="utf-8") as f:
        bench_history.append_rows(bench_history.headline_rows(json.load(f)))
    print(f"appended its headline figures to {bench_history.HISTORY_CSV}", file=sys.stderr)


def png_path(json_path: str) -> str:
    return os.path.splitext(json_path)[0] + ".png"


# ----------------------------------------------------------------------------- tables
def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:,.{digits}f}"
    return str(value)


def format_table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "-|-".join("-" * w for w in widths)
    out = []
    if title:
        out.append(title)
    out.append(" | ".join(h.ljust(w) for h, w in zip(headers, widths)))
    out.append(line)
    for row in cells:
        out.append(" | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(out)


def print_table(headers: list[str], rows: list[list], title: str | None = None) -> None:
    load, cores = load_average(), os.cpu_count() or 1
    if load is not None and load > cores:
        print(f"note: load average {load:.1f} on {cores} CPUs: other processes compete for the CPUs, "
              "so these timings are noisy (transformers' OpenMP threads suffer most: see --hf-threads)",
              file=sys.stderr, flush=True)
    print(format_table(headers, rows, title), flush=True)


# ----------------------------------------------------------------------------- plots
def pyplot():
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax, labels: list[str], series: dict[str, list[float]], ylabel: str, title: str) -> None:
    width = 0.8 / max(1, len(series))
    x = np.arange(len(labels))
    for i, (name, values) in enumerate(series.items()):
        vals = [0.0 if v is None else float(v) for v in values]
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(x, labels, rotation=30 if len(labels) > 4 else 0, ha="right" if len(labels) > 4 else "center")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if len(series) > 1:
        ax.legend(fontsize=8)


def bar_plot(path: str, labels: list[str], series: dict[str, list[float]], *, title: str, ylabel: str) -> str:
    """Grouped bars: one group per label, one bar per series."""
    return panel_bar_plot(path, labels, {title: (ylabel, series)}, title=None)


def panel_bar_plot(path: str, labels: list[str], panels: dict[str, tuple[str, dict[str, list[float]]]], *,
                   title: str | None) -> str:
    """One grouped-bar panel per entry of ``panels`` ({panel title: (ylabel, {series: values})})."""
    plt = pyplot()
    width = max(5.5, 0.9 * len(labels) * max(1, max(len(s) for _, s in panels.values())) + 1.5)
    fig, axes = plt.subplots(len(panels), 1, figsize=(min(width, 18), 3.4 * len(panels)), squeeze=False)
    for ax, (panel_title, (ylabel, series)) in zip(axes[:, 0], panels.items()):
        _bars(ax, labels, series, ylabel, panel_title)
    return save_figure(fig, path, title)


def save_figure(fig, path: str, title: str | None) -> str:
    """Title, lay out, write the PNG and free the figure (every benchmark plot ends this way)."""
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


# ----------------------------------------------------------------------------- transformers baseline
def hf_model_files(model: str) -> tuple[str, str | None]:
    """(directory, gguf file name or None) of a model transformers can load, without a hub."""
    from jaxrunner.models.loading.resolve import resolve_model

    source = resolve_model(model)
    path = os.path.abspath(source.path)  # peers run in a directory of their own
    if source.kind == "gguf":
        directory, name = os.path.split(path)
        return directory, name
    if source.kind == "hf":
        return path, None
    raise BenchError(f"--compare hf: transformers cannot load a {source.kind} checkpoint ({source.path}); "
                     "pass the .gguf file or the HF directory")


def load_hf(directory: str, gguf_file: str | None = None, progress: bool = False):
    """transformers' ``AutoModelForCausalLM`` in float32 on torch CPU, and its tokenizer; (model, tok, seconds).
    A GGUF file is read through :func:`hf_copy_of_gguf`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    start = time.perf_counter()
    if gguf_file:
        directory = hf_copy_of_gguf(directory, gguf_file)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    hf_model.eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return hf_model, tokenizer, time.perf_counter() - start


def hf_copy_of_gguf_path(directory: str, gguf_file: str) -> str:
    """Where :func:`hf_copy_of_gguf` keeps its copy of ``directory/gguf_file``: under
    ``$JAXRUNNER_HF_GGUF_CACHE`` (default ``~/.cache/jaxrunner/hf-from-gguf``), keyed by the file's
    name, size and mtime and by transformers' version (read without importing it)."""
    stat = os.stat(os.path.join(directory, gguf_file))
    root = os.environ.get("JAXRUNNER_HF_GGUF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxrunner",
                                                                     "hf-from-gguf")
    version = importlib.metadata.version("transformers")
    return os.path.join(root, f"{gguf_file}-{stat.st_size}-{stat.st_mtime_ns}-transformers{version}")


def hf_copy_of_gguf(directory: str, gguf_file: str) -> str:
    """A float32 HF directory holding transformers' own reading of ``directory/gguf_file`` (weights,
    config, generation config, tokenizer), made on first use at :func:`hf_copy_of_gguf_path`.

    Why: transformers parses a GGUF file's metadata twice and rebuilds its tensor-name map for every
    tensor, about ten times longer than loading the same weights from a saved directory (SmolLM2:
    about 12 s against 1 s), and every baseline, oracle and vLLM peer paid it again. The weights are
    the dequantized tensors exactly: a model loaded from the copy is the one loaded from the file."""
    import shutil
    import tempfile

    import torch
    import transformers

    target = hf_copy_of_gguf_path(directory, gguf_file)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    # dequantized on loading: saved as a plain float checkpoint (transformers refuses a "quantized" one)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    os.makedirs(os.path.dirname(target), exist_ok=True)
    partial = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".partial-")
    try:
        model.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        os.rename(partial, target)  # a half-written copy is never taken for a finished one
    except OSError:
        if not os.path.isfile(os.path.join(target, "config.json")):  # not another process's copy
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target

def run_hf_worker(script: str, spec: dict, progress: bool = False, timeout: float | None = None) -> dict:
    """Run ``script --hf-worker SPEC`` in a fresh interpreter and return the JSON it writes.

    transformers runs in its own process, never next to JAX: XLA's CPU thread pool, once started,
    makes torch's OpenMP threads stall on a small machine (10-30x slower ``generate`` measured on 2
    cores), which would make the baseline look far worse than it is.
    """
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="jaxrunner-hf-") as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump({**spec, "result": result_path, "progress": progress}, f)
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        if not progress:
            env["TQDM_DISABLE"] = "1"
        proc = subprocess.run([sys.executable, os.path.abspath(script), "--hf-worker", spec_path], env=env,
                              stdout=subprocess.DEVNULL, stderr=None if progress else subprocess.PIPE, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or "").strip().splitlines()[-3:])
            raise RuntimeError(f"transformers baseline failed (exit {proc.returncode}): {tail}")
        with open(result_path, encoding="utf-8") as f:
            return json.load(f)


def add_hf_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf-threads", type=int, default=None,
                        help="torch threads for the transformers baseline (default: torch's, one per core). On a "
                             "CPU shared with other work, OpenMP threads that wait on each other at every op slow "
                             "down 10x or more; --hf-threads 1 avoids that")
    parser.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)  # internal: run the baseline


def hf_worker_main(spec_path: str, work) -> int:
    """The worker side of ``run_hf_worker``: load transformers' model, ``work(model, pad_id, spec)``, write JSON."""
    import torch

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    hf_model, tokenizer, load_s = load_hf(spec["hf_dir"], spec.get("hf_gguf"), progress=spec.get("progress", False))
    result = work(hf_model, hf_pad_id(hf_model, tokenizer), spec)
    info = {"load_s": load_s, "dtype": "float32", "device": "cpu", "torch_num_threads": torch.get_num_threads(),
            "transformers": _version("transformers"), "torch": _version("torch"), "process": "separate (no JAX)"}
    with open(spec["result"], "w", encoding="utf-8") as f:
        json.dump({"info": info, "result": result}, f, default=_json_default)
    return 0


def hf_spec(model: str, threads: int | None = None) -> dict:
    if threads is not None and threads < 1:
        raise BenchError(f"--hf-threads: must be at least 1, got {threads}")
    directory, gguf = hf_model_files(model)
    return {"hf_dir": directory, "hf_gguf": gguf, "threads": threads}


def hf_pad_id(hf_model, tokenizer) -> int:
    for candidate in (getattr(tokenizer, "pad_token_id", None), hf_model.generation_config.pad_token_id,
                      getattr(tokenizer, "eos_token_id", None)):
        if candidate is not None:
            return int(candidate[0] if isinstance(candidate, (list, tuple)) else candidate)
    return 0


def hf_generate(hf_model, prompts: list[list[int]], new_tokens: int, pad_id: int):
    """One static batch, left-padded, greedy, exactly ``new_tokens`` new tokens (EOS ignored)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        return hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
                                 num_beams=1)


# ----------------------------------------------------------------------------- vLLM, side by side
def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm-python", default=None,
                        help="for --compare vllm: the python of a virtual environment holding vLLM (e.g. its CPU "
                             "build), run in its own process on the same requests")
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=4,
                        help="for --compare vllm: its KV cache (VLLM_CPU_KVCACHE_SPACE, GiB; default 4)")


def check_vllm_python(args) -> str:
    """The vLLM peer's interpreter, checked before the long start-up."""
    return check_peer_python(args.vllm_python, "vllm", "--vllm-python", "vllm", "vLLM (e.g. its CPU build)")


def check_peer_python(path: str | None, peer: str, flag: str, module: str, what: str) -> str:
    """The interpreter of ``--compare peer`` (``flag``'s value): it must exist and import ``module``."""
    import subprocess

    if not path:
        raise BenchError(f"--compare {peer} needs {flag} PATH (the python of an environment with {what})")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise BenchError(f"{flag} {path!r}: not an executable file")
    probe = subprocess.run([path, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        tail = (probe.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise BenchError(f"{flag} {path!r}: cannot import {module} ({tail[0]})")
    return path


def run_llamacpp_peer(python: str, spec: dict, progress: bool = False, timeout: float | None = None) -> dict:
    """Run ``llamacpp_peer.py`` with the peer's Python; the JSON it writes ({"info", "result"})."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="jaxrunner-llamacpp-") as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump({**spec, "result": result_path}, f)
        _run_peer_script([python, LLAMACPP_PEER_SCRIPT, spec_path], _peer_env(), progress, timeout, "llama.cpp peer")
        with open(result_path, encoding="utf-8") as f:
            return json.load(f)


def vllm_model_spec(args, options: dict) -> dict:
    """What ``vllm_peer.py`` needs to load the benchmark's model with the same limits as jaxrunner's.

    A GGUF model is converted once to a float HF directory (:func:`hf_copy_of_gguf`)."""
    directory, gguf = hf_model_files(args.model)
    engine = {"max_num_seqs": options["max_num_seqs"], "max_num_batched_tokens": options["max_num_batched_tokens"],
              "max_model_len": options["max_model_len"], "enable_prefix_caching": options["enable_prefix_caching"],
              "seed": options["seed"]}
    if options.get("kv_cache_dtype", "auto") != "auto":  # the same pages for both engines
        engine["kv_cache_dtype"] = options["kv_cache_dtype"]
    return {"model_dir": directory, "gguf_file": gguf, "dtype": options["dtype"],
            "engine": engine, "kv_cache_gib": args.vllm_kv_cache_gib}


VLLM_PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_peer.py")
LLAMACPP_PEER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_peer.py")


def vllm_peer_model(spec: dict, progress: bool = False, timeout: float | None = None) -> dict:
    """``spec`` pointing at a float HF directory vLLM loads: a GGUF model is converted once
    (:func:`hf_copy_of_gguf`) before any timing, in a process of this Python's (its transformers
    reads GGUF; vLLM's CPU build brings no ``gguf``), so that torch never runs beside JAX here."""
    import tempfile

    if not spec.get("gguf_file"):
        return spec
    with tempfile.TemporaryDirectory(prefix="jaxrunner-vllm-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        _run_peer_script([sys.executable, VLLM_PEER_SCRIPT, "--convert", spec_path], _peer_env(), progress,
                         timeout, "conversion")
    return {**spec, "model_dir": hf_copy_of_gguf_path(spec["model_dir"], spec["gguf_file"]), "gguf_file": None}


def run_vllm_peer(python: str, spec: dict, progress: bool = False, timeout: float | None = None,
                  env: dict | None = None) -> dict:
    """Run ``vllm_peer.py`` with the peer's Python and return the JSON it writes ({"info", "result"});
    ``env``: variables added to the peer's environment."""
    import tempfile

    spec = vllm_peer_model(spec, progress, timeout)
    with tempfile.TemporaryDirectory(prefix="jaxrunner-vllm-") as tmp:
        spec_path, result_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump({**spec, "result": result_path}, f)
        _run_peer_script([python, VLLM_PEER_SCRIPT, spec_path], _peer_env(env), progress, timeout, "vLLM peer")
        with open(result_path, encoding="utf-8") as f:
            return json.load(f)


def _peer_env(extra: dict | None = None) -> dict:
    """This process's environment without JAX's and XLA's settings, offline, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX", "XLA"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(extra or {}))
    return env


def _run_peer_script(command: list[str], env: dict, progress: bool, timeout: float | None, what: str) -> None:
    """Run a peer in a neutral working directory: started from the repository's root, the `python
    -m` subprocesses a peer spawns (vLLM inspects model classes in one) put the root on their path,
    and its ``kernels/`` shadows the PyPI package transformers imports."""
    import subprocess
    import tempfile

    proc = subprocess.run(command, env=env, stdout=None if progress else subprocess.DEVNULL,
                          stderr=None if progress else subprocess.PIPE, text=True, timeout=timeout,
                          cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or "").strip().splitlines()[-3:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {tail}")


# ----------------------------------------------------------------------------- running a script
def run_main(name: str, main, argv=None) -> int:
    """Call ``main(argv)``; a user error prints one line and returns 2."""
    args = sys.argv[1:] if argv is None else argv
    if "--no-progress" in args or not sys.stderr.isatty():
        # Also silences libraries' bars (transformers' GGUF de-quantization); read when tqdm is imported.
        os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        return main(argv) or 0
    except (BenchError, ValueError, FileNotFoundError, NotImplementedError) as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
