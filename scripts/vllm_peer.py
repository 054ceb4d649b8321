"""The vLLM side of a side-by-side benchmark, run by the peer's own Python (``--vllm-python PATH``).

    PATH/python scripts/vllm_peer.py SPEC.json
    python scripts/vllm_peer.py --convert SPEC.json

Run as the peer it imports vLLM and the standard library only (no jaxrunner, no JAX): the benchmark scripts write
the workload (token ids) to SPEC.json, run this in its own process, and read the figures back
from the file SPEC names. vLLM loads an HF directory; a GGUF file is first written out once as a
float HF checkpoint (``_bench_common.hf_copy_of_gguf``), so both engines serve the same weights.
The conversion runs with ``--convert`` under the benchmark's own Python, whose transformers reads
GGUF (the ``gguf`` package comes with jaxrunner; vLLM's CPU build does not bring it).

SPEC: ``{"mode": "throughput" | "latency" | "startup", "model_dir", "gguf_file" (or null),
"dtype", "engine": {vLLM LLM(...) options}, "result": path, ...}``; throughput adds ``requests``
(``[{"prompt_token_ids", "output_len"}]``) and ``sampling`` (temperature, top_p, top_k; greedy
when absent), latency adds ``batches`` (``[{"batch_size",
"input_len", "output_len", "repetitions": [[prompt ids, ...], ...], "warmup"}]``), startup
``prompt_token_ids`` (one request after start-up).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time


def start_engine(spec: dict):
    """(vLLM's LLM, seconds to import vllm, seconds to construct the LLM)."""
    start = time.perf_counter()
    from vllm import LLM

    imported = time.perf_counter()
    llm = LLM(model=spec["model_dir"], dtype=spec["dtype"], disable_log_stats=True, **spec["engine"])
    return llm, imported - start, time.perf_counter() - imported


def greedy(max_tokens: int):
    return sampled(max_tokens, {})


def sampled(max_tokens: int, sampling: dict):
    """EOS ignored; ``sampling``: temperature, top_p, top_k (0: off), logprobs; greedy when empty."""
    from vllm import SamplingParams

    settings = {"temperature": 0.0, **sampling}
    if not settings.get("top_k"):
        settings.pop("top_k", None)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **settings)


def token_prompts(batch: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": ids} for ids in batch]


def throughput(llm, spec: dict) -> dict:
    """Every request at once through ``generate``, as ``vllm bench throughput`` serves them,
    ``spec["repetitions"]`` times (default 1), each after emptying the prefix cache: the median
    run's figures, with every run's total tok/s beside them in run order (as jaxrunner's)."""
    runs = []
    for _ in range(int(spec.get("repetitions", 1))):
        llm.reset_prefix_cache()
        runs.append(throughput_once(llm, spec))
    rates = [run["total_tokens_per_s"] for run in runs]
    median = runs[sorted(range(len(rates)), key=rates.__getitem__)[len(rates) // 2]]
    return dict(median, repetitions=len(rates), total_tokens_per_s_runs=rates)


def throughput_once(llm, spec: dict) -> dict:
    requests = spec["requests"]
    params = [sampled(r["output_len"], spec.get("sampling") or {}) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(token_prompts([r["prompt_token_ids"] for r in requests]), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"elapsed_s": elapsed, "num_requests": len(requests), "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed, "requests_per_s": len(requests) / elapsed,
            "expected_output_tokens": sum(r["output_len"] for r in requests)}


def timed_generate(llm, batch: list[list[int]], max_tokens: int) -> float:
    start = time.perf_counter()
    llm.generate(token_prompts(batch), greedy(max_tokens), use_tqdm=False)
    return time.perf_counter() - start


def latency(llm, spec: dict) -> list[dict]:
    """Per batch: TTFT = generate(max_tokens=1), end-to-end = generate(max_tokens=n), TPOT from both."""
    rows = []
    for batch in spec["batches"]:
        n = batch["output_len"]
        ttft, tpot, e2e = [], [], []
        for index, prompts in enumerate(batch["repetitions"]):
            first = timed_generate(llm, prompts, 1)
            total = timed_generate(llm, prompts, n)
            if index < batch["warmup"]:
                continue
            ttft.append(first)
            e2e.append(total)
            if n > 1:
                tpot.append((total - first) / (n - 1))
        rows.append({"batch_size": batch["batch_size"], "input_len": batch["input_len"], "output_len": n,
                     "ttft": ttft, "tpot": tpot, "e2e": e2e})
    return rows


def first_token(llm, spec: dict) -> dict:
    """After start-up (``startup`` mode): one request's time to its first token."""
    return {"ttft_first_s": timed_generate(llm, [spec["prompt_token_ids"]], 1)}


def version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(spec_path: str) -> int:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(spec.get("kv_cache_gib", 4))))  # whole GiB
    llm, import_s, startup_s = start_engine(spec)
    result = {"throughput": throughput, "latency": latency, "startup": first_token}[spec["mode"]](llm, spec)
    info = {"import_s": import_s, "startup_s": startup_s, "dtype": spec["dtype"], "engine": spec["engine"],
            "kv_cache_gib": os.environ["VLLM_CPU_KVCACHE_SPACE"], "python": sys.version.split()[0],
            "vllm": version("vllm") or version("vllm-cpu"), "torch": version("torch"),
            "process": "separate (its own Python, no JAX)"}
    with open(spec["result"], "w", encoding="utf-8") as f:
        json.dump({"info": info, "result": result}, f)
    return 0


def convert(spec_path: str) -> int:
    """The spec's GGUF file as a float HF directory (the benchmark's Python only: it needs jaxrunner's
    ``_bench_common`` and transformers)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _bench_common

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    _bench_common.hf_copy_of_gguf(spec["model_dir"], spec["gguf_file"])
    return 0


if __name__ == "__main__":
    sys.exit(convert(sys.argv[2]) if sys.argv[1] == "--convert" else main(sys.argv[1]))
