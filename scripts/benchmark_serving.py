#!/usr/bin/env python
"""Online serving over HTTP: concurrent streaming clients against an OpenAI-compatible server.

    python scripts/benchmark_serving.py --request-rate 4                  # starts `jaxrunner serve`
    python scripts/benchmark_serving.py --sweep-rates 1,2,4,inf --slo-ttft-ms 500 --slo-tpot-ms 100
    python scripts/benchmark_serving.py --base-url http://127.0.0.1:8000 --model NAME   # any server

Requests are sent to ``/v1/completions`` with ``stream: true`` (token-id prompts, ``ignore_eos``, so
every request asks for exactly its output length) at ``--request-rate`` per second: gamma-distributed
gaps with shape ``--burstiness`` (1 = Poisson; inf rate = all at once), optionally capped at
``--max-concurrency`` requests in flight. Per request: TTFT (first streamed chunk − send; a chunk
carries each step's tokens even when their text is empty: a special token, or bytes of a character
not yet complete), ITL (gaps between streamed chunks), TPOT ((E2E − TTFT) / (output tokens − 1)), E2E. Reported like ``vllm bench
serve``, with its JSON key names: request/token throughput, goodput (requests per second meeting
both SLOs) and mean/median/p90/p99 of each latency in ms. Every rate of a sweep gets distinct prompts
(no prefix-cache replay) unless ``--shared-prefix-len`` asks for a common prefix.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import _bench_common as common  # noqa: E402

KIND = "serving"
TEXT_DATASET_PROMPT_ROOM = 512
PERCENTILES = (50, 90, 99)
# `jaxrunner serve` flags for the engine options it takes; others must keep their defaults.
SERVE_FLAGS = {"dtype": "--dtype", "max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs",
               "max_num_batched_tokens": "--max-num-batched-tokens", "attention_impl": "--attention-impl",
               "cpu_matmul": "--cpu-matmul",
               "tensor_parallel_size": "--tensor-parallel-size", "data_parallel_size": "--data-parallel-size",
               "seed": "--seed"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None,
                        help="an OpenAI-compatible server to measure (default: start `jaxrunner serve`)")
    parser.add_argument("--served-model-name", default=None, help="the `model` sent (default: --model)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per rate (default 64)")
    parser.add_argument("--request-rate", default="inf", help="mean requests per second, or inf (all at once)")
    parser.add_argument("--sweep-rates", default=None, help="comma-separated rates (overrides --request-rate)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the gaps between requests: 1 = Poisson, <1 burstier, >1 steadier")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--shared-prefix-len", type=int, default=0,
                        help="random dataset: every prompt starts with the same N tokens (prefix-cache test)")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput SLO on time to first token")
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput SLO on time per output token")
    parser.add_argument("--server-timeout-s", type=float, default=900.0, help="how long the server may take to warm up")
    common.add_dataset_args(parser, input_len="32..256", output_len=128)
    common.add_engine_args(parser)
    common.add_output_args(parser, KIND)
    return parser


# ----------------------------------------------------------------------------- arrivals and requests
def parse_rate(text: str) -> float:
    text = str(text).strip().lower()
    if text in ("inf", "infinity"):
        return math.inf
    try:
        rate = float(text)
    except ValueError:
        raise common.BenchError(f"request rate: expected a positive number or inf, got {text!r}") from None
    if not rate > 0:
        raise common.BenchError(f"request rate: must be positive, got {text!r}")
    return rate


def arrival_times(num_requests: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds from the start: gamma gaps (mean 1/rate, shape ``burstiness``), first at 0."""
    if math.isinf(rate):
        return np.zeros(num_requests)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def rate_requests(args, tokenizer, rate_index: int) -> list[dict]:
    """This rate's requests: fresh random prompts (or tagged text prompts), so no rate replays another's."""
    rng = np.random.default_rng(args.seed + 1000 * (rate_index + 1))
    requests = common.dataset_requests(args, tokenizer, args.num_requests, rng, args.output_len)
    if args.dataset != "random":
        for i, r in enumerate(requests):  # a distinct first token per request and rate
            tag = tokenizer.encode(f"[{rate_index}.{i}] ", add_special_tokens=False)
            r["prompt_token_ids"] = tag + r["prompt_token_ids"]
    elif args.shared_prefix_len:
        vocab, low = common.tokenizer_vocab(tokenizer)
        prefix = np.random.default_rng(args.seed).integers(low, vocab, args.shared_prefix_len).tolist()
        for r in requests:
            r["prompt_token_ids"] = prefix + r["prompt_token_ids"]
    return requests


# ----------------------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(args, options: dict, port: int) -> list[str]:
    """``jaxrunner serve`` with the engine options; options it has no flag for must be left at default."""
    unsupported = [flag for flag, default in (("--page-size", 16), ("--num-pages", None),
                                              ("--no-prefix-caching", False), ("--no-chunked-prefill", False),
                                              ("--no-async-scheduling", False))
                   if getattr(args, flag[2:].replace("-", "_")) != default]
    if unsupported:
        raise common.BenchError(f"{', '.join(unsupported)}: `jaxrunner serve` has no such flag; start the server "
                                f"yourself and pass --base-url")
    command = [sys.executable, "-m", "jaxrunner", "serve", args.model, "--port", str(port)]
    for key, flag in SERVE_FLAGS.items():
        command += [flag, str(options[key])]
    return command


def start_server(args, options: dict) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    env = dict(os.environ)
    if args.compilation_cache_dir:
        env["JAXRUNNER_COMPILATION_CACHE"] = args.compilation_cache_dir
    start = time.perf_counter()
    proc = subprocess.Popen(serve_command(args, options, port), env=env, stdout=subprocess.DEVNULL,
                            stderr=None if common.show_progress(args) else subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    wait_for_health(base, proc, args.server_timeout_s)
    return proc, base, time.perf_counter() - start


def wait_for_health(base: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise common.BenchError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise common.BenchError(f"{base}/health did not answer 200 within {timeout_s:g} s")


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# ----------------------------------------------------------------------------- the clients
async def one_request(client, url: str, model: str, request: dict, send_at: float, start: float) -> dict:
    body = {"model": model, "prompt": request["prompt_token_ids"], "max_tokens": request["output_len"],
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    record = {"prompt_len": len(request["prompt_token_ids"]), "output_len": request["output_len"],
              "send_s": send_at, "chunk_times_s": [], "output_tokens": 0, "error": None}
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                record["error"] = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record["error"] = f"error event: {chunk['error'].get('message')}"
                if chunk.get("usage"):
                    record["output_tokens"] = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):  # a chunk per token step, its text possibly empty (held back
                    record["chunk_times_s"].append(time.perf_counter() - start)  # or a special token)
            if not done and record["error"] is None:
                record["error"] = "the stream ended without [DONE]"
    except Exception as err:  # a failed request is reported, not fatal
        record["error"] = f"{type(err).__name__}: {err}"
    return record


async def drive(base: str, model: str, api_key: str | None, requests: list[dict], arrivals,
                max_concurrency: int | None) -> tuple[list[dict], float]:
    """Send each request at its arrival time (under the concurrency cap); returns records and duration."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    url = f"{base.rstrip('/')}/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, headers=headers) as client:
        start = time.perf_counter()

        async def send(request, at):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            if gate is None:
                return await one_request(client, url, model, request, time.perf_counter() - start, start)
            async with gate:
                return await one_request(client, url, model, request, time.perf_counter() - start, start)

        records = await asyncio.gather(*(send(r, float(t)) for r, t in zip(requests, arrivals)))
        return list(records), time.perf_counter() - start


# ----------------------------------------------------------------------------- figures
def request_latencies(record: dict) -> None:
    times = record["chunk_times_s"]
    ok = record["error"] is None and times
    record["ttft_s"] = times[0] - record["send_s"] if ok else None
    record["e2el_s"] = times[-1] - record["send_s"] if ok else None
    record["itls_s"] = np.diff(times).tolist() if ok else []
    n = record["output_tokens"] or len(times)
    record["tpot_s"] = (record["e2el_s"] - record["ttft_s"]) / (n - 1) if ok and n > 1 else None


def latency_keys(name: str, values_s: list) -> dict:
    """vLLM's keys: mean_/median_/std_/p90_/p99_<name>_ms."""
    values = np.asarray([v for v in values_s if v is not None], dtype=np.float64) * 1e3
    if values.size == 0:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "std", *(f"p{q}" for q in PERCENTILES))}
    out = {f"mean_{name}_ms": float(values.mean()), f"median_{name}_ms": float(np.median(values)),
           f"std_{name}_ms": float(values.std())}
    out.update({f"p{q}_{name}_ms": float(np.percentile(values, q)) for q in PERCENTILES})
    return out


def summarize(records: list[dict], duration: float, rate: float, args) -> dict:
    for record in records:
        request_latencies(record)
    done = [r for r in records if r["error"] is None and r["chunk_times_s"]]
    good = [r for r in done if r["ttft_s"] <= args.slo_ttft_ms / 1e3
            and (r["tpot_s"] is None or r["tpot_s"] <= args.slo_tpot_ms / 1e3)]
    input_tokens = sum(r["prompt_len"] for r in done)
    output_tokens = sum(r["output_tokens"] or len(r["chunk_times_s"]) for r in done)
    summary = {
        "request_rate": "inf" if math.isinf(rate) else rate, "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "num_prompts": len(records), "duration": duration,
        "completed": len(done), "failed": len(records) - len(done),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration, "request_goodput": len(good) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "slo_attainment": len(good) / len(records),
    }
    summary.update(latency_keys("ttft", [r["ttft_s"] for r in done]))
    summary.update(latency_keys("tpot", [r["tpot_s"] for r in done]))
    summary.update(latency_keys("itl", [gap for r in done for gap in r["itls_s"]]))
    summary.update(latency_keys("e2el", [r["e2el_s"] for r in done]))
    summary["errors"] = sorted({r["error"] for r in records if r["error"]})[:5]
    return summary


TABLE_HEADERS = ["rate req/s", "done", "req/s", "out tok/s", "goodput req/s", "TTFT mean ms", "median", "p99",
                 "TPOT mean ms", "median", "p99", "ITL mean ms", "p99", "E2E mean ms", "p99"]


def table_rows(summaries: list[dict]) -> list[list]:
    return [[str(s["request_rate"]), f"{s['completed']}/{s['num_prompts']}", s["request_throughput"],
             s["output_throughput"], s["request_goodput"], s["mean_ttft_ms"], s["median_ttft_ms"], s["p99_ttft_ms"],
             s["mean_tpot_ms"], s["median_tpot_ms"], s["p99_tpot_ms"], s["mean_itl_ms"], s["p99_itl_ms"],
             s["mean_e2el_ms"], s["p99_e2el_ms"]] for s in summaries]


def plot(path: str, summaries: list[dict], title: str) -> str:
    plt = common.pyplot()
    labels = [str(s["request_rate"]) for s in summaries]
    x = np.arange(len(labels))
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for name, ax, label in (("ttft", axes[0], "TTFT"), ("tpot", axes[1], "TPOT")):
        for key, style in (("median", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(x, [s[f"{key}_{name}_ms"] or 0.0 for s in summaries], style, label=key)
        ax.set_title(f"{label} vs request rate (HTTP, streaming)")
        ax.set_ylabel("ms")
    axes[2].plot(x, [s["request_throughput"] for s in summaries], "o-", label="throughput")
    axes[2].plot(x, [s["request_goodput"] for s in summaries], "s--", label="goodput (SLO met)")
    axes[2].set_title("requests / s")
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.legend(fontsize=8)
    return common.save_figure(fig, path, title)


# ----------------------------------------------------------------------------- main
def check_args(args) -> list[float]:
    rates = [parse_rate(r) for r in args.sweep_rates.split(",") if r.strip()] if args.sweep_rates \
        else [parse_rate(args.request_rate)]
    if not rates:
        raise common.BenchError("--sweep-rates: no rates given")
    if args.num_requests < 1 or args.output_len < 1:
        raise common.BenchError("--num-requests and --output-len must be at least 1")
    if not args.burstiness > 0:
        raise common.BenchError(f"--burstiness: must be positive, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise common.BenchError(f"--max-concurrency: must be at least 1, got {args.max_concurrency}")
    if args.shared_prefix_len < 0 or args.shared_prefix_len and args.dataset != "random":
        raise common.BenchError("--shared-prefix-len: a non-negative length, with --dataset random")
    return rates


def load_tokenizer(model: str):
    """The model's tokenizer without loading weights (prompts are sent as token ids)."""
    from transformers import AutoTokenizer

    from jaxrunner.models.loading.gguf import load_gguf_tokenizer
    from jaxrunner.models.loading.resolve import resolve_model

    source = resolve_model(model)
    if source.kind == "gguf":
        return load_gguf_tokenizer(source.path)
    return AutoTokenizer.from_pretrained(source.path, local_files_only=True)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    rates = check_args(args)
    longest = common.longest_request(args, TEXT_DATASET_PROMPT_ROOM) + args.shared_prefix_len
    options = common.engine_options(args, max_total_len=longest,
                                    max_concurrency=args.max_concurrency or args.num_requests,
                                    strict=args.dataset == "random")
    tokenizer = load_tokenizer(args.model)
    proc, base, startup_s = (None, args.base_url, None) if args.base_url else start_server(args, options)
    model = args.served_model_name or args.model
    summaries, per_request = [], {}
    try:
        for index, rate in enumerate(rates):
            requests = rate_requests(args, tokenizer, index)
            arrivals = arrival_times(len(requests), rate, args.burstiness, np.random.default_rng(args.seed + index))
            records, duration = asyncio.run(drive(base, model, args.api_key, requests, arrivals,
                                                  args.max_concurrency))
            summary = summarize(records, duration, rate, args)
            summaries.append(summary)
            per_request[str(summary["request_rate"])] = [
                {k: r.get(k) for k in ("send_s", "prompt_len", "output_tokens", "ttft_s", "tpot_s", "e2el_s",
                                       "error")} for r in records]
            print(f"rate {summary['request_rate']}: {summary['completed']}/{len(records)} done in "
                  f"{duration:.1f} s", file=sys.stderr)
    finally:
        server_exit = stop_server(proc) if proc is not None else None
    config = {"model": args.model, "served_model_name": model, "base_url": args.base_url or "jaxrunner serve",
              "num_requests": args.num_requests, "rates": [s["request_rate"] for s in summaries],
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "dataset": args.dataset,
              "input_len": args.input_len if args.dataset == "random" else None, "output_len": args.output_len,
              "shared_prefix_len": args.shared_prefix_len, "slo_ttft_ms": args.slo_ttft_ms,
              "slo_tpot_ms": args.slo_tpot_ms, "seed": args.seed, "engine": None if args.base_url else options,
              "method": "streaming /v1/completions over HTTP (token-id prompts, ignore_eos, temperature 0) from "
                        "asyncio httpx clients in a separate process from the server; gamma arrivals; distinct "
                        "prompts at every rate"}
    payload = {"config": config, "server": {"startup_s": startup_s, "exit_status": server_exit},
               "results": summaries, "per_request": per_request}
    title = f"serving over HTTP: {args.num_requests} requests per rate, {model}"
    common.write_results(args, KIND, payload, plot, summaries, title)
    for summary in summaries:  # one JSON line per rate, as `vllm bench serve` reports it
        print(json.dumps({k: v for k, v in summary.items() if k != "errors"}))
    common.print_table(TABLE_HEADERS, table_rows(summaries),
                       title + f" (SLO: TTFT ≤ {args.slo_ttft_ms:g} ms, TPOT ≤ {args.slo_tpot_ms:g} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(common.run_main("benchmark_serving", main))
