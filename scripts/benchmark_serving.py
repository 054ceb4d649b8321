#!/usr/bin/env python
"""Online serving: requests arrive as a Poisson process and are served by continuous batching.

    python scripts/benchmark_serving.py --request-rate 4                # 64 requests, ~4 per second
    python scripts/benchmark_serving.py --sweep-rates 1,2,4,inf --slo-ttft-ms 500 --slo-tpot-ms 100

The driver plays both client and server in one process: at each turn it submits every request
whose arrival time has passed (``engine.add_request``), runs one ``engine.step()``, and stamps
each output token. ``--request-rate inf`` submits everything at once. Per request: TTFT (first
token − arrival), TPOT ((last − first) / (n − 1)), inter-token latencies (gaps between
consecutive tokens); p50/p90/p99 over requests (ITL over all gaps); request and token throughput
over the run; goodput = requests per second that met both SLOs. One engine serves every rate
of a sweep (start-up is paid once).
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import _bench_common as common  # noqa: E402

KIND = "serving"
TEXT_DATASET_PROMPT_ROOM = 512
HF_UNSUPPORTED = ("transformers has no request-level serving API comparable to engine.add_request/step: "
                  "generate() is one blocking static batch, so requests arriving over time cannot join a "
                  "running batch, and timing a queue of static batches would measure the queueing policy of "
                  "this script rather than transformers. Compare offline with benchmark_throughput.py "
                  "--compare hf and benchmark_latency.py --compare hf instead.")
_ids = itertools.count()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64, help="requests per rate (default 64)")
    parser.add_argument("--request-rate", default="inf", help="mean arrivals per second, or inf (all at once)")
    parser.add_argument("--sweep-rates", default=None, help="comma-separated rates (overrides --request-rate)")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput SLO on time to first token")
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput SLO on time per output token")
    common.add_dataset_args(parser, input_len="32..256", output_len=128)
    parser.add_argument("--compare", choices=["none", "hf"], default="none",
                        help="hf is reported as unsupported for serving (see the JSON for why)")
    common.add_engine_args(parser)
    common.add_output_args(parser, KIND)
    return parser


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


def arrival_times(num_requests: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds after the start: a Poisson process (exponential gaps, first at 0), or all 0 for inf."""
    if math.isinf(rate):
        return np.zeros(num_requests)
    gaps = rng.exponential(1.0 / rate, num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def serve(engine, requests: list[dict], arrivals, *, use_tqdm: bool = True, desc: str = "serving") -> list[dict]:
    """Submit each request at its arrival time, step the engine, and stamp every output token.

    Returns per request: arrival, token timestamps (seconds since the start), and lengths.
    """
    from tqdm.auto import tqdm

    from jaxrunner import SamplingParams

    order = np.argsort(arrivals, kind="stable")
    records = []
    for index in order:
        r = requests[index]
        records.append({"request_id": f"serving-{next(_ids)}", "arrival_s": float(arrivals[index]),
                        "prompt_len": len(r["prompt_token_ids"]), "output_len": r["output_len"],
                        "prompt_token_ids": r["prompt_token_ids"], "token_times_s": [], "num_tokens": 0})
    by_id = {rec["request_id"]: rec for rec in records}
    next_arrival = 0
    unfinished = 0
    start = time.perf_counter()
    with tqdm(total=len(records), desc=desc, disable=not use_tqdm) as bar:
        while next_arrival < len(records) or unfinished:
            now = time.perf_counter() - start
            while next_arrival < len(records) and records[next_arrival]["arrival_s"] <= now:
                rec = records[next_arrival]
                params = SamplingParams(temperature=0.0, max_tokens=rec["output_len"], ignore_eos=True)
                engine.add_request(rec["request_id"], {"prompt_token_ids": rec["prompt_token_ids"]}, params)
                rec["submitted_s"] = time.perf_counter() - start
                next_arrival += 1
                unfinished += 1
            if not unfinished:  # idle: wait for the next arrival
                time.sleep(max(0.0, records[next_arrival]["arrival_s"] - (time.perf_counter() - start)))
                continue
            outputs = engine.step()
            stamp = time.perf_counter() - start
            for out in outputs:
                rec = by_id.get(out.request_id)
                if rec is None:
                    continue
                new = len(out.outputs[0].token_ids) - rec["num_tokens"]
                rec["token_times_s"].extend([stamp] * max(new, 0))
                rec["num_tokens"] = len(out.outputs[0].token_ids)
                if out.finished:
                    rec["finish_reason"] = out.outputs[0].finish_reason
                    unfinished -= 1
                    bar.update(1)
    for rec in records:
        del rec["prompt_token_ids"]
    return records


def summarize(records: list[dict], rate: float, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    ttft, tpot, itl, e2e, good = [], [], [], [], 0
    for rec in records:
        times = rec["token_times_s"]
        rec["ttft_s"] = times[0] - rec["arrival_s"] if times else None
        rec["e2e_s"] = times[-1] - rec["arrival_s"] if times else None
        rec["tpot_s"] = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        gaps = np.diff(times).tolist() if len(times) > 1 else []
        ttft.append(rec["ttft_s"])
        e2e.append(rec["e2e_s"])
        if rec["tpot_s"] is not None:
            tpot.append(rec["tpot_s"])
        itl.extend(gaps)
        ok = rec["ttft_s"] is not None and rec["ttft_s"] <= slo_ttft_s and \
            (rec["tpot_s"] is None or rec["tpot_s"] <= slo_tpot_s)
        rec["met_slo"] = bool(ok)
        good += ok
    first_arrival = min(rec["arrival_s"] for rec in records)
    last_token = max((rec["token_times_s"][-1] for rec in records if rec["token_times_s"]), default=first_arrival)
    duration = max(last_token - first_arrival, 1e-9)
    prompt_tokens = sum(rec["prompt_len"] for rec in records)
    output_tokens = sum(rec["num_tokens"] for rec in records)
    return {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "num_requests": len(records),
        "duration_s": duration,
        "completed": sum(1 for rec in records if rec.get("finish_reason")),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(records) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "goodput_requests_per_s": good / duration,
        "slo_attainment": good / len(records),
        "ttft_s": common.percentiles(ttft),
        "tpot_s": common.percentiles(tpot),
        "itl_s": common.percentiles(itl),
        "e2e_s": common.percentiles(e2e),
        "load_average_1m": common.load_average(),
    }


TABLE_HEADERS = ["rate req/s", "req/s", "out tok/s", "goodput req/s", "SLO met", "TTFT p50 ms", "p90", "p99",
                 "TPOT p50 ms", "p90", "p99", "ITL p50 ms", "p90", "p99"]


def table_rows(summaries: list[dict]) -> list[list]:
    rows = []
    for s in summaries:
        t, p, i = s["ttft_s"], s["tpot_s"], s["itl_s"]
        rows.append([str(s["request_rate"]), s["request_throughput"], s["output_token_throughput"],
                     s["goodput_requests_per_s"], f"{100 * s['slo_attainment']:.0f}%",
                     common.ms(t["p50"]), common.ms(t["p90"]), common.ms(t["p99"]),
                     common.ms(p["p50"]), common.ms(p["p90"]), common.ms(p["p99"]),
                     common.ms(i["p50"]), common.ms(i["p90"]), common.ms(i["p99"])])
    return rows


def plot(path: str, summaries: list[dict], title: str) -> str:
    plt = common.pyplot()
    labels = [str(s["request_rate"]) for s in summaries]
    x = np.arange(len(labels))
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for metric, ax, name in (("ttft_s", axes[0], "TTFT"), ("tpot_s", axes[1], "TPOT")):
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(x, [common.ms(s[metric][q]) or 0.0 for s in summaries], style, label=q)
        ax.set_title(f"{name} vs request rate")
        ax.set_ylabel("ms")
    axes[2].plot(x, [s["request_throughput"] for s in summaries], "o-", label="throughput")
    axes[2].plot(x, [s["goodput_requests_per_s"] for s in summaries], "s--", label="goodput (SLO met)")
    axes[2].set_title("requests / s")
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.legend(fontsize=8)
    return common.save_figure(fig, path, title)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    rates = [parse_rate(r) for r in args.sweep_rates.split(",") if r.strip()] if args.sweep_rates \
        else [parse_rate(args.request_rate)]
    if not rates:
        raise common.BenchError("--sweep-rates: no rates given")
    if args.num_requests < 1 or args.output_len < 1:
        raise common.BenchError("--num-requests and --output-len must be at least 1")
    compare = None
    if args.compare == "hf":
        compare = {"hf": {"supported": False, "reason": HF_UNSUPPORTED}}
        print(f"benchmark_serving: --compare hf is not supported: {HF_UNSUPPORTED}", file=sys.stderr)
    progress = common.show_progress(args)

    longest = common.longest_request(args, TEXT_DATASET_PROMPT_ROOM)
    options = common.engine_options(args, max_total_len=longest, max_concurrency=args.num_requests,
                                    strict=args.dataset == "random")
    llm, startup_s = common.start_llm(args.model, options)
    rng = np.random.default_rng(args.seed)
    requests = common.dataset_requests(args, llm.get_tokenizer(), args.num_requests, rng, args.output_len)
    too_long = [r for r in requests if len(r["prompt_token_ids"]) + r["output_len"] > options["max_model_len"]]
    if too_long:
        raise common.BenchError(f"--max-model-len {options['max_model_len']}: {len(too_long)} requests need more")

    summaries, per_request = [], {}
    for rate in rates:
        arrivals = arrival_times(len(requests), rate, np.random.default_rng(args.seed + 1))
        records = serve(llm.engine, requests, arrivals, use_tqdm=progress, desc=f"rate {rate}")
        summary = summarize(records, rate, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
        summaries.append(summary)
        per_request[str(summary["request_rate"])] = [
            {k: rec.get(k) for k in ("arrival_s", "prompt_len", "output_len", "num_tokens", "ttft_s", "tpot_s",
                                     "e2e_s", "met_slo", "finish_reason")} for rec in records]
    startup = dict(common.startup_summary(llm), total_s=startup_s)
    engine_stats = {k: v for k, v in llm.engine.stats().items() if k != "tokens_per_step"}

    config = {"model": args.model, "num_requests": args.num_requests, "rates": [s["request_rate"] for s in summaries],
              "dataset": args.dataset, "dataset_path": args.dataset_path,
              "input_len": args.input_len if args.dataset == "random" else None, "output_len": args.output_len,
              "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "seed": args.seed,
              "compare": args.compare, "engine": options,
              "method": "one process: submit arrivals, engine.step(), timestamp outputs; Poisson arrivals "
                        "(exponential gaps), inf = all at t=0; the same requests at every rate of a sweep, so text "
                        "datasets may hit the prefix cache after the first rate (see engine_stats)"}
    payload = {"config": config, "startup": startup, "engine_stats": engine_stats, "compare": compare,
               "results": summaries, "per_request": per_request}
    title = f"serving: {args.num_requests} requests per rate, {args.model}"
    common.write_results(args, KIND, payload, plot, summaries, title)
    common.print_table(TABLE_HEADERS, table_rows(summaries),
                       title + f" (SLO: TTFT ≤ {args.slo_ttft_ms:g} ms, TPOT ≤ {args.slo_tpot_ms:g} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(common.run_main("benchmark_serving", main))
