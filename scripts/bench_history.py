"""The headline figures of benchmark result files, as rows of ``benchmarks/results/history.csv``.

``benchmarks/results/`` keeps only the latest JSON of each kind; this CSV keeps the headline
figures of every run, one row per (engine, workload, metric). The benchmark scripts append to it
when they write into ``benchmarks/results/``; to add rows for other files:

    python scripts/bench_history.py RESULT.json [RESULT.json ...]
"""
from __future__ import annotations

import csv
import json
import os
import sys

from _bench_common import default_token_budget  # beside this script: its folder is on sys.path
from jaxrunner.config import DEFAULT_MODEL  # no JAX

HISTORY_CSV = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "benchmarks", "results", "history.csv")
COLUMNS = ["date", "commit", "benchmark", "dtype", "tensor_parallel", "data_parallel", "engine", "workload",
           "metric", "value", "machine"]
# Per-run figures worth a row when a result maps engine or phase names to figures (throughput,
# start-up). Row lists (latency, serving) contribute their rates and the p50 of each percentile.
HEADLINE_KEYS = ("total_tokens_per_s", "output_tokens_per_s", "process_wall_s", "load_s", "compile_s_total",
                 "warmup_s")
WORKLOAD_KEYS = ("batch_size", "input_len", "output_len", "request_rate")


def machine(doc: dict) -> str:
    """A short description of where a result was measured, e.g. ``cpu: AMD EPYC (family 23 model 49;
    avx2 fma), 2 cores``: the CPU's model number and vector features tell apart machines that share
    a name (an AMD EPYC with AVX-512 or AVX2 alone, two Xeons with AMX of different speeds)."""
    device = doc.get("device") or {}
    backend = device.get("jax_backend", "?")
    if backend == "cpu":
        detail = "; ".join(part for part in (device.get("cpu_model_id"), " ".join(device.get("cpu_features") or []))
                           if part)
        name = device.get("cpu", "?") + (f" ({detail})" if detail else "")
        text = f"cpu: {name}, {device.get('cpu_affinity') or device.get('cpu_count')} cores"
        devices = len(device.get("jax_devices") or [])
        return text + (f", {devices} devices" if devices > 1 else "")
    return f"{backend}: {device.get('jax_device_kind', '?')}"


def _engine_config(doc: dict) -> dict:
    config = doc.get("config") or {}
    return config.get("engine") if isinstance(config.get("engine"), dict) else config


def _row_figures(row: dict) -> dict:
    figures = {}
    for key, value in row.items():
        if isinstance(value, dict) and isinstance(value.get("p50"), (int, float)):
            figures[f"{key}_p50"] = value["p50"]
        elif key.endswith("_per_s") and isinstance(value, (int, float)):
            figures[key] = value
    return figures


def _figures(results) -> list[tuple[str, str, dict]]:
    """(engine, workload, {metric: value}) for each engine or phase in ``results``."""
    if isinstance(results, dict):
        return [(name, "", {k: v for k, v in fig.items() if k in HEADLINE_KEYS and isinstance(v, (int, float))})
                for name, fig in results.items() if isinstance(fig, dict)]
    out = []
    for row in results or []:
        if isinstance(row, dict):
            workload = " ".join(f"{k}={row[k]}" for k in WORKLOAD_KEYS if k in row)
            out.append((row.get("engine", "jaxrunner"), workload, _row_figures(row)))
    return out


def _config_workload(doc: dict) -> str:
    """The workload of a run whose results do not name one (throughput): requests and lengths."""
    config = doc.get("config") or {}
    keys = ("num_requests", "input_len", "output_len") if doc.get("benchmark") != "startup" else ("input_len",
                                                                                                  "output_len")
    parts = [f"{k}={config[k]}" for k in keys if config.get(k) is not None]
    if config.get("dataset") not in (None, "random"):  # prompts other than random token ids
        parts.insert(0, f"dataset={config['dataset']}")
    return " ".join(parts)


def _labelled(doc: dict, workload: str) -> str:
    """``workload`` with what sets the run apart: another model first, a throughput run's token
    budget other than the scripts' default, a forced CPU matmul, then sampled requests' settings
    (a 1B run, an A/B arm or a sampled run is not the default workload)."""
    parts = [workload] if workload else []
    model = (doc.get("config") or {}).get("model")
    if model and model != DEFAULT_MODEL:
        parts.insert(0, f"model={os.path.basename(str(model).rstrip('/'))}")
    engine = _engine_config(doc)
    budget = engine.get("max_num_batched_tokens")
    if doc.get("benchmark") == "throughput" and budget not in (
            None, default_token_budget(engine.get("max_num_seqs") or 0)):
        parts.append(f"max_num_batched_tokens={budget}")
    matmul = engine.get("cpu_matmul", "auto")
    if matmul != "auto":
        parts.append(f"cpu_matmul={matmul}")
    sampling = (doc.get("config") or {}).get("sampling") or {}
    parts.extend(f"{k}={v}" for k, v in sampling.items() if v or k == "logprobs")  # logprobs=0 is asked for
    return " ".join(parts)


def _dtype_label(engine_config: dict) -> str:
    """The dtype, with the weight quantization and a KV cache dtype other than the default when
    there are ones (``float32-int4``, ``bfloat16-kvfp8``)."""
    dtype, quantization = engine_config.get("dtype", "?"), engine_config.get("quantization")
    label = f"{dtype}-{quantization}" if quantization else dtype
    kv = engine_config.get("kv_cache_dtype")
    return f"{label}-kv{kv}" if kv not in (None, "auto") else label


def headline_rows(doc: dict) -> list[dict]:
    """One CSV row per (engine, workload, metric) of a result file's headline figures."""
    engine_config = _engine_config(doc)
    common = {"date": doc.get("date", ""), "commit": doc.get("commit", "unknown"),
              "benchmark": doc.get("benchmark", "?"), "dtype": _dtype_label(engine_config),
              "tensor_parallel": engine_config.get("tensor_parallel_size", 1),
              "data_parallel": engine_config.get("data_parallel_size", 1), "machine": machine(doc)}
    rows = []
    for engine, workload, figures in _figures(doc.get("results")):
        if common["benchmark"] == "startup":  # results are keyed by phase: cold and warm cache
            engine, workload = "jaxrunner", f"{engine} compilation cache"
        workload = _labelled(doc, workload or _config_workload(doc))
        for metric, value in figures.items():
            rows.append({**common, "engine": engine, "workload": workload, "metric": metric,
                         "value": f"{value:.6g}"})
    return rows


def append_rows(rows: list[dict], path: str | None = None) -> None:
    """Append ``rows`` to the CSV at ``path`` (default ``HISTORY_CSV``), header first when the file is new."""
    path = path or HISTORY_CSV
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerows(rows)


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for path in paths:
        with open(path, encoding="utf-8") as f:
            append_rows(headline_rows(json.load(f)))
    print(f"appended the headline figures of {len(paths)} file(s) to {HISTORY_CSV}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
