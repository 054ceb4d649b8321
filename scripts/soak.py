#!/usr/bin/env python
"""Soak a server: a fixed number of mixed requests over a fixed time, and an account of every one.

    python scripts/soak.py --num-requests 2000 --duration-s 1200     # starts `jaxrunner serve`
    jaxrunner bench soak --num-requests 200 --duration-s 60
    python scripts/soak.py --base-url http://127.0.0.1:8000 --model NAME  # any server (no RSS figures)

Requests arrive at uniform random times over ``--duration-s`` from one asyncio client process, to both
``/v1/completions`` and ``/v1/chat/completions``: mixed prompt and output lengths, streaming and not,
``n`` of 1 or 2, stop strings; ``--disconnect-share`` of the streams leave after their first chunks (the
server must abort them) and ``--invalid-share`` of the requests are malformed (each must get a 4xx).

Every request ends as exactly one of: completed (200 and a finish reason for every choice, or a stream
that ended with ``[DONE]``), refused (a 4xx or 503 status, by status), aborted (the client left on
purpose), failed (a 5xx, a broken connection, or an error event in a stream) or lost (no answer
within ``--request-timeout-s``). Reported per minute and in total, with the server's KV pages held
once the load is gone, its resident memory at the start and end (when the script started it), and
p50/p99 TTFT and inter-token latency of the streams. Exit status 1 when anything failed or was lost,
or pages stayed held.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import _bench_common as common  # noqa: E402
import benchmark_serving as serving  # noqa: E402

KIND = "soak"
OUTCOMES = ("completed", "refused", "aborted", "failed", "lost")
STOP_WORDS = [".", "\n\n", " the"]
# Malformed bodies a client sends by mistake: each must be refused with a 4xx naming what is wrong.
INVALID_BODIES = [
    {"temperature": -1.0}, {"max_tokens": 0}, {"top_p": 7}, {"logit_bias": {"abc": 1}}, {"n": 0},
    {"model": "no-such-model"}, {"stop_token_ids": ["x"]}, {"logprobs": 10_000}, {"top_k": -7},
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="a server to soak (default: start `jaxrunner serve`)")
    parser.add_argument("--served-model-name", default=None, help="the `model` sent (default: --model)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--num-requests", type=int, default=600, help="requests in all (default 600)")
    parser.add_argument("--duration-s", type=float, default=300.0, help="spread over this many seconds")
    parser.add_argument("--disconnect-share", type=float, default=0.1, help="streams whose client leaves early")
    parser.add_argument("--invalid-share", type=float, default=0.1, help="malformed requests (each must get a 4xx)")
    parser.add_argument("--max-output-len", type=int, default=64, help="most tokens a request asks for")
    parser.add_argument("--request-timeout-s", type=float, default=120.0, help="no answer by then: lost")
    parser.add_argument("--server-timeout-s", type=float, default=900.0, help="how long the server may take to warm up")
    common.add_engine_args(parser, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512)
    common.add_output_args(parser, KIND)
    return parser


# ----------------------------------------------------------------------------- the workload
def plan_requests(args, rng: np.random.Generator) -> list[dict]:
    """Each request's send time and body; the kind says what the client does with it."""
    texts = [row["prompt"] for row in common.read_jsonl(common.builtin_dataset_path())]
    sends = np.sort(rng.uniform(0.0, args.duration_s, args.num_requests))
    plan = []
    for index, at in enumerate(sends):
        chat = bool(rng.random() < 0.5)
        words = texts[int(rng.integers(len(texts)))].split()
        text = f"[{index}] " + " ".join(words[:int(rng.integers(4, 64))])  # mixed prompt lengths
        body = {"max_tokens": int(rng.integers(1, args.max_output_len + 1)), "temperature": float(rng.choice([0.0, 0.8])),
                "seed": index, "n": 2 if rng.random() < 0.2 else 1}
        body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
        if rng.random() < 0.3:
            body["stop"] = [str(rng.choice(STOP_WORDS))]
        draw = rng.random()
        if draw < args.invalid_share:
            kind = "invalid"
            body.update(INVALID_BODIES[index % len(INVALID_BODIES)])
        elif draw < args.invalid_share + args.disconnect_share:
            kind, body["stream"], body["max_tokens"] = "disconnect", True, args.max_output_len
        else:
            kind = "stream" if rng.random() < 0.5 else "plain"
            body["stream"] = kind == "stream"
        plan.append({"index": index, "send_s": float(at), "kind": kind, "chat": chat, "body": body})
    return plan


# ----------------------------------------------------------------------------- the clients
async def one_request(client, model: str, item: dict, start: float, timeout_s: float) -> dict:
    record = {"index": item["index"], "kind": item["kind"], "send_s": item["send_s"], "status": None,
              "outcome": None, "detail": None, "chunk_times_s": []}
    url = "/v1/chat/completions" if item["chat"] else "/v1/completions"
    body = {"model": model, **item["body"]}
    try:
        await asyncio.wait_for(_exchange(client, url, body, item, record, start), timeout_s)
    except asyncio.TimeoutError:
        record["outcome"], record["detail"] = "lost", f"no answer within {timeout_s:g} s"
    except Exception as err:  # a broken connection or a malformed answer
        record["outcome"], record["detail"] = "failed", f"{type(err).__name__}: {err}"
    return record


async def _exchange(client, url: str, body: dict, item: dict, record: dict, start: float) -> None:
    if not body.get("stream"):
        response = await client.post(url, json=body)
        record["status"] = response.status_code
        record["outcome"] = _status_outcome(response.status_code, item, record, response.text)
        if record["outcome"] is None:
            choices = response.json()["choices"]
            finished = len(choices) == body["n"] and all(c["finish_reason"] for c in choices)
            record["outcome"] = "completed" if finished else "failed"
        return
    async with client.stream("POST", url, json=body) as response:
        record["status"] = response.status_code
        if response.status_code != 200:
            record["outcome"] = _status_outcome(response.status_code, item, record, (await response.aread()).decode())
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                record["outcome"] = record["outcome"] or "completed"
                return
            chunk = json.loads(line[6:])
            if "error" in chunk:
                record["outcome"], record["detail"] = "failed", chunk["error"]["message"]
            elif chunk["choices"] and _has_text(chunk["choices"][0]):
                record["chunk_times_s"].append(time.perf_counter() - start)
                if item["kind"] == "disconnect" and len(record["chunk_times_s"]) >= 2:
                    record["outcome"] = "aborted"
                    return  # leaving the block closes the connection mid-stream
        record["outcome"] = record["outcome"] or "failed"
        record["detail"] = record["detail"] or "the stream ended without [DONE]"


def _has_text(choice: dict) -> bool:
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


def _status_outcome(status: int, item: dict, record: dict, text: str) -> str | None:
    """None for a 200 (the body decides); refused for 4xx and 503; failed otherwise. A malformed
    request that is not refused is a failure too."""
    if status == 200:
        if item["kind"] == "invalid":
            record["detail"] = "a malformed request was answered 200"
            return "failed"
        return None
    record["detail"] = text[:200]
    return "refused" if 400 <= status < 500 or status == 503 else "failed"


async def drive(base: str, model: str, api_key: str | None, plan: list[dict], timeout_s: float, on_minute):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(None), limits=limits,
                                 headers=headers) as client:
        start = time.perf_counter()

        async def send(item):
            await asyncio.sleep(max(0.0, item["send_s"] - (time.perf_counter() - start)))
            return await one_request(client, model, item, start, timeout_s)

        sampler = asyncio.ensure_future(_every_minute(on_minute, start))
        try:
            records = await asyncio.gather(*(send(item) for item in plan))
        finally:
            sampler.cancel()
        return list(records), time.perf_counter() - start


async def _every_minute(on_minute, start: float) -> None:
    minute = 0
    while True:
        minute += 1
        await asyncio.sleep(max(0.0, 60.0 * minute - (time.perf_counter() - start)))
        on_minute(minute)


# ----------------------------------------------------------------------------- the server's side
def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            match = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(match.group(1)) / 1024 if match else None


def pages_held(base: str, api_key: str | None, settle_s: float = 30.0) -> float | None:
    """KV pages still held once the load is gone (aborts are freed by the next step: allow a moment)."""
    import httpx

    deadline = time.monotonic() + settle_s
    while True:
        text = httpx.get(f"{base}/metrics", timeout=10).text
        match = re.search(r"^jaxrunner:kv_cache_pages_used(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.M)
        if match is None:
            return None  # not a jaxrunner server
        held = float(match.group(1))
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


# ----------------------------------------------------------------------------- figures
def tally(records: list[dict]) -> dict:
    counts = {outcome: sum(r["outcome"] == outcome for r in records) for outcome in OUTCOMES}
    streams = [r for r in records if r["outcome"] == "completed" and r["chunk_times_s"]]
    ttft = [(r["chunk_times_s"][0] - r["send_s"]) * 1e3 for r in streams]
    itl = [gap * 1e3 for r in streams for gap in np.diff(r["chunk_times_s"])]
    refused = {}
    for r in records:
        if r["outcome"] == "refused":
            refused[str(r["status"])] = refused.get(str(r["status"]), 0) + 1
    return {"sent": len(records), **counts, "refused_by_status": refused,
            "server_errors_5xx": sum(r["status"] is not None and r["status"] >= 500 and r["status"] != 503
                                     for r in records),
            "ttft_ms": common.percentiles(ttft, (50, 99)), "itl_ms": common.percentiles(itl, (50, 99))}


def per_minute(records: list[dict], rss_samples: dict, rss_end: float | None) -> list[dict]:
    """Figures by the minute requests were sent in; RSS as sampled at each minute's end (the last
    minute's is the end of the run)."""
    rows = []
    last = int(max((r["send_s"] for r in records), default=0) // 60)
    for minute in range(last + 1):
        sent = [r for r in records if minute * 60 <= r["send_s"] < (minute + 1) * 60]
        rss = rss_samples.get(minute + 1, rss_end if minute == last else None)
        rows.append({"minute": minute + 1, **tally(sent), "rss_mib": rss})
    return rows


TABLE_HEADERS = ["minute", "sent", "completed", "refused", "aborted", "failed", "lost", "TTFT p50 ms", "p99",
                 "ITL p50 ms", "p99", "RSS MiB"]


def table_rows(rows: list[dict], total: dict) -> list[list]:
    def row(label, t, rss):
        return [label, t["sent"], t["completed"], t["refused"], t["aborted"], t["failed"], t["lost"],
                t["ttft_ms"]["p50"], t["ttft_ms"]["p99"], t["itl_ms"]["p50"], t["itl_ms"]["p99"], rss]
    return [row(str(r["minute"]), r, r["rss_mib"]) for r in rows] + [row("total", total, total["rss_mib_end"])]


def plot(path: str, rows: list[dict], title: str) -> str:
    plt = common.pyplot()
    minutes = [r["minute"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for outcome, style in (("completed", "o-"), ("refused", "s--"), ("aborted", "^:"), ("lost", "x-")):
        axes[0].plot(minutes, [r[outcome] for r in rows], style, label=outcome)
    axes[0].set_title("requests per minute (by when sent)")
    for key, style in (("p50", "o-"), ("p99", "^:")):
        axes[1].plot(minutes, [_or_nan(r["ttft_ms"][key]) for r in rows], style, label=f"TTFT {key}")
        axes[1].plot(minutes, [_or_nan(r["itl_ms"][key]) for r in rows], style, label=f"ITL {key}", alpha=0.6)
    axes[1].set_title("latency (ms)")
    axes[2].plot(minutes, [_or_nan(r["rss_mib"]) for r in rows], "o-")
    axes[2].set_title("server RSS (MiB)")
    for ax in axes:
        ax.set_xlabel("minute")
    for ax in axes[:2]:
        ax.legend(fontsize=8)
    return common.save_figure(fig, path, title)


def _or_nan(value) -> float:
    return float("nan") if value is None else value  # a gap in the plot, not a drop to zero


# ----------------------------------------------------------------------------- main
def check_args(args) -> None:
    if args.num_requests < 1 or not args.duration_s > 0:
        raise common.BenchError("--num-requests must be at least 1 and --duration-s positive")
    for name in ("disconnect_share", "invalid_share"):
        if not 0 <= getattr(args, name) <= 1:
            raise common.BenchError(f"--{name.replace('_', '-')}: a share in [0, 1], got {getattr(args, name)}")
    if args.disconnect_share + args.invalid_share > 1:
        raise common.BenchError("--disconnect-share + --invalid-share: must be at most 1")
    if args.max_output_len < 2:
        raise common.BenchError(f"--max-output-len: at least 2 (a leaving stream reads two chunks), got "
                                f"{args.max_output_len}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    options = common.engine_options(args, max_total_len=args.max_model_len, max_concurrency=args.max_num_seqs)
    plan = plan_requests(args, np.random.default_rng(args.seed))
    proc, base, _ = (None, args.base_url, None) if args.base_url else serving.start_server(args, options)
    pid = None if proc is None else proc.pid
    rss_start, rss_samples = rss_mib(pid), {}
    try:
        records, duration = asyncio.run(drive(base, args.served_model_name or args.model, args.api_key, plan,
                                              args.request_timeout_s,
                                              lambda minute: rss_samples.__setitem__(minute, rss_mib(pid))))
        held = pages_held(base, args.api_key)
        rss_end = rss_mib(pid)
    finally:
        server_exit = serving.stop_server(proc) if proc is not None else None
    total = {**tally(records), "pages_held_at_end": held, "rss_mib_start": rss_start, "rss_mib_end": rss_end,
             "duration_s": duration}
    rows = per_minute(records, rss_samples, rss_end)
    config = {"model": args.model, "base_url": args.base_url or "jaxrunner serve", "num_requests": args.num_requests,
              "duration_s": args.duration_s, "disconnect_share": args.disconnect_share,
              "invalid_share": args.invalid_share, "max_output_len": args.max_output_len,
              "request_timeout_s": args.request_timeout_s, "seed": args.seed,
              "engine": None if args.base_url else options}
    payload = {"config": config, "server": {"exit_status": server_exit}, "total": total, "per_minute": rows,
               "problems": [{k: r[k] for k in ("index", "kind", "status", "outcome", "detail")} for r in records
                            if r["outcome"] in ("failed", "lost")][:20]}
    title = f"soak: {args.num_requests} requests over {args.duration_s:g} s, {args.model}"
    common.write_results(args, KIND, payload, plot, rows, title)
    print(json.dumps(total))
    common.print_table(TABLE_HEADERS, table_rows(rows, total), title)
    clean = total["failed"] == 0 and total["lost"] == 0 and held in (0, None) and server_exit in (0, None)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(common.run_main("soak", main))
