#!/usr/bin/env python
"""Offline throughput: N requests served to completion, jaxrunner vs transformers' static batches.

    python scripts/benchmark_throughput.py                       # 64 random prompts, 32..256 tokens, 128 out
    python scripts/benchmark_throughput.py --compare hf          # + transformers at batch sizes 16 and 64
    python scripts/benchmark_throughput.py --compare vllm --vllm-python ~/vllm-cpu/bin/python
    python scripts/benchmark_throughput.py --dataset builtin --output-len 64
    python scripts/benchmark_throughput.py --dtype bfloat16 --compare-quantization int4 --repetitions 4
    python scripts/benchmark_throughput.py --temperature 0.8 --top-p 0.95 --compare vllm  # sampled
    python scripts/benchmark_throughput.py --temperature 1.0 --logprobs 0 --compare vllm   # RL rollouts

Every request ignores EOS, so each produces exactly its output length and both engines do the
same work. Requests are greedy unless ``--temperature`` (with ``--top-p``, ``--top-k``) samples
them, with the same settings for every engine; the result file is then named ``...-sampled-...``.
``--logprobs N`` asks every engine for each output token's logprob and rank and the N most likely
tokens' (0: the sampled token's alone, what RL rollouts take; ``...-logprobs-...``).
jaxrunner's figure excludes start-up (load + compile + warm-up, reported
separately); transformers' excludes model loading and runs in its own process (JAX's CPU threads
slow torch down when they share one). Tokens counted are the requested ones (prompt
+ output); transformers' padding is its own cost. vLLM (``--compare vllm``) serves the same token
ids through its own ``LLM.generate`` in its own Python and process (``vllm_peer.py``), with the same
``max_num_seqs``, token budget and ``max_model_len``, as many times as jaxrunner (``--repetitions``;
each engine's median run is its figure); its start-up is reported beside jaxrunner's.
``--compare-quantization`` serves the same requests with quantized weights too, in the same process,
the two engines taking turns over ``--repetitions`` runs: the ratio of one to the other is then
measured on the same machine in the same minutes, which on a noisy machine separate runs are not.
Writes JSON and a PNG bar plot, prints a table last.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import _bench_common as common  # noqa: E402

KIND = "throughput"
TEXT_DATASET_PROMPT_ROOM = 512  # default prompt room for text datasets when --max-model-len is unset


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64, help="requests to serve (default 64)")
    common.add_dataset_args(parser, input_len="32..256", output_len=128)
    parser.add_argument("--compare", choices=["none", "hf", "vllm", "hf,vllm"], default="none",
                        help="also serve the same requests with transformers' static-batch generate, vLLM, or both")
    parser.add_argument("--hf-batch-sizes", default="16,64", help="transformers batch sizes (default 16,64)")
    parser.add_argument("--compare-quantization", default=None, choices=["int8", "int4", "w4a8", "w8a8"],
                        help="also serve the requests with these weights, alternating runs with the float ones "
                             "(the result is named after the format)")
    parser.add_argument("--repetitions", type=int, default=None,
                        help="runs of each engine (jaxrunner's and a vLLM peer's); each reports its median run "
                             "(default 1, or 3 with --compare-quantization)")
    g = parser.add_argument_group("sampling (every request, every engine)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]; 1 (the default): off")
    g.add_argument("--top-k", type=int, default=0, help="0 (the default): off")
    g.add_argument("--logprobs", type=int, default=None,
                   help="each output token's logprob and rank, and the N most likely tokens' (0: the sampled "
                        "token's alone; at most jaxrunner's MAX_LOGPROBS); off by default")
    common.add_hf_args(parser)
    common.add_vllm_args(parser)
    common.add_engine_args(parser)
    common.add_output_args(parser, KIND)
    return parser


# ----------------------------------------------------------------------------- measurements
def make_requests(args, tokenizer) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    return common.dataset_requests(args, tokenizer, args.num_requests, rng, args.output_len)


def sampling_settings(args) -> dict:
    """The requests' sampling settings from the flags: ``{}`` for greedy, else temperature, top_p
    and top_k (0: off); and logprobs where asked for. Refuses what the engines would ignore or
    reject, before any start-up."""
    from jaxrunner.runner.step_batch import MAX_LOGPROBS

    if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:
        raise common.BenchError(f"--logprobs: must be in 0..{MAX_LOGPROBS}, got {args.logprobs}")
    logprobs = {} if args.logprobs is None else {"logprobs": args.logprobs}
    if args.temperature < 0:
        raise common.BenchError(f"--temperature: must be at least 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise common.BenchError(f"--top-p: must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise common.BenchError(f"--top-k: must be 0 (off) or at least 1, got {args.top_k}")
    if args.temperature == 0:
        if args.top_p < 1 or args.top_k > 0:
            raise common.BenchError("--top-p and --top-k need --temperature above 0 (greedy requests ignore them)")
        return logprobs
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, **logprobs}


def run_jaxrunner(llm, requests: list[dict], use_tqdm: bool = True, sampling: dict | None = None) -> dict:
    """Serve all requests at once through ``llm.generate``; tokens/s over the wall time.
    ``sampling``: temperature, top_p, top_k for every request (greedy without), and logprobs."""
    from jaxrunner import SamplingParams

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    settings = {"temperature": 0.0, **(sampling or {})}
    params = [SamplingParams(max_tokens=r["output_len"], ignore_eos=True, **settings) for r in requests]
    load_before = common.load_average()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    if "logprobs" in settings and any(len(o.outputs[0].logprobs or ()) != len(o.outputs[0].token_ids) for o in outputs):
        raise common.BenchError("jaxrunner returned outputs without the logprobs asked for")
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    figures = _figures(elapsed, prompt_tokens, output_tokens, len(requests),
                       expected_output_tokens=sum(r["output_len"] for r in requests))
    figures["load_average_1m"] = [load_before, common.load_average()]
    return figures


def serve_alternating(llms: dict, requests: list[dict], repetitions: int, use_tqdm: bool,
                      sampling: dict | None = None) -> dict:
    """Each engine serves ``requests`` ``repetitions`` times, the engines taking turns in an order
    that alternates, each run after emptying its prefix cache (so every run computes every prompt).
    An engine's figures are its median run's (the upper one of an even count), with every run's
    total tok/s beside them in run order."""
    runs = {name: [] for name in llms}
    for repetition in range(repetitions):
        for name in (list(llms) if repetition % 2 == 0 else list(llms)[::-1]):
            llms[name].reset_prefix_cache()
            runs[name].append(run_jaxrunner(llms[name], requests, use_tqdm=use_tqdm, sampling=sampling))
    out = {}
    for name, figures in runs.items():
        rates = [f["total_tokens_per_s"] for f in figures]
        median = figures[int(np.argsort(rates)[len(rates) // 2])]
        out[name] = dict(median, repetitions=len(rates), total_tokens_per_s_runs=rates)
    return out


def run_hf(hf_model, pad_id: int, requests: list[dict], batch_size: int, use_tqdm: bool = True) -> dict:
    """transformers' ``generate`` over static batches of ``batch_size`` (left padding), in request order.

    A batch generates its longest output length for every row; only the requested tokens count.
    """
    from tqdm.auto import tqdm

    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    padded_tokens = 0
    load_before = common.load_average()
    start = time.perf_counter()
    for batch in tqdm(batches, desc=f"transformers bs={batch_size}", disable=not use_tqdm):
        new_tokens = max(r["output_len"] for r in batch)
        out = common.hf_generate(hf_model, [r["prompt_token_ids"] for r in batch], new_tokens, pad_id)
        padded_tokens += int(out.numel())
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    output_tokens = sum(r["output_len"] for r in requests)
    figures = _figures(elapsed, prompt_tokens, output_tokens, len(requests))
    figures.update(batch_size=batch_size, num_batches=len(batches), padded_tokens_processed=padded_tokens,
                   load_average_1m=[load_before, common.load_average()])
    return figures


def hf_baseline(model: str, requests: list[dict], batch_sizes: list[int], progress: bool = False,
                threads: int | None = None) -> tuple[dict, dict]:
    """transformers on the same requests, in a separate process (see ``run_hf_worker``).

    Returns ({"hf_bs16": figures, ...}, info about the baseline: load time, threads, versions).
    """
    spec = {**common.hf_spec(model, threads), "batch_sizes": batch_sizes,
            "requests": [{"prompt_token_ids": r["prompt_token_ids"], "output_len": r["output_len"]} for r in requests]}
    out = common.run_hf_worker(__file__, spec, progress)
    info = dict(out["info"], batch_sizes=batch_sizes, padding="left",
                decoding="greedy, min_new_tokens = max_new_tokens = the batch's longest output")
    return out["result"], info


def vllm_peer(python: str, args, options: dict, requests: list[dict], progress: bool,
              repetitions: int = 1, sampling: dict | None = None) -> tuple[dict, dict]:
    """vLLM on the same requests, ``repetitions`` times like jaxrunner, with the same sampling
    settings, in its own Python and process (see ``vllm_peer.py``)."""
    spec = {**common.vllm_model_spec(args, options), "mode": "throughput", "repetitions": repetitions,
            "sampling": sampling or {},
            "requests": [{"prompt_token_ids": r["prompt_token_ids"], "output_len": r["output_len"]} for r in requests]}
    out = common.run_vllm_peer(python, spec, progress)
    return out["result"], out["info"]


def _hf_work(hf_model, pad_id: int, spec: dict) -> dict:
    return {f"hf_bs{bs}": run_hf(hf_model, pad_id, spec["requests"], bs, use_tqdm=spec["progress"])
            for bs in spec["batch_sizes"]}


def _figures(elapsed: float, prompt_tokens: int, output_tokens: int, num_requests: int,
             expected_output_tokens: int | None = None) -> dict:
    out = {"elapsed_s": elapsed, "num_requests": num_requests, "prompt_tokens": prompt_tokens,
           "output_tokens": output_tokens, "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
           "output_tokens_per_s": output_tokens / elapsed, "requests_per_s": num_requests / elapsed}
    if expected_output_tokens is not None:
        out["expected_output_tokens"] = expected_output_tokens
    return out


def ratios(results: dict) -> dict:
    """jaxrunner's throughput over each peer run's (>1: jaxrunner is faster), and over the best
    transformers batch size."""
    jr = results["jaxrunner"]
    out = {}
    for name, figures in results.items():
        if name.startswith("jaxrunner"):
            continue
        out[f"jaxrunner/{name}"] = {
            "output_tokens_per_s": jr["output_tokens_per_s"] / figures["output_tokens_per_s"],
            "total_tokens_per_s": jr["total_tokens_per_s"] / figures["total_tokens_per_s"]}
    for name in [k for k in results if k.startswith("jaxrunner+")]:  # quantized weights over the float ones
        runs = zip(results[name]["total_tokens_per_s_runs"], jr["total_tokens_per_s_runs"])
        out[f"{name}/jaxrunner"] = {
            "total_tokens_per_s": results[name]["total_tokens_per_s"] / jr["total_tokens_per_s"],
            "total_tokens_per_s_by_repetition": [quantized / float_ for quantized, float_ in runs]}
    hf_runs = [k for k in results if k.startswith("hf_")]
    if hf_runs:
        best = max(hf_runs, key=lambda k: results[k]["output_tokens_per_s"])
        out["jaxrunner/best_hf"] = dict(out[f"jaxrunner/{best}"], best=best)
    return out


def table_rows(results: dict) -> list[list]:
    return [[name, f["num_requests"], f["prompt_tokens"], f["output_tokens"], f["elapsed_s"],
             f["total_tokens_per_s"], f["output_tokens_per_s"]] for name, f in results.items()]


TABLE_HEADERS = ["engine", "requests", "prompt tok", "output tok", "elapsed s", "total tok/s", "output tok/s"]


def plot(path: str, results: dict, title: str) -> str:
    names = list(results)
    return common.bar_plot(path, names, {
        "output tok/s": [results[n]["output_tokens_per_s"] for n in names],
        "total tok/s": [results[n]["total_tokens_per_s"] for n in names]},
        title=title, ylabel="tokens / s")


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.hf_worker:
        return common.hf_worker_main(args.hf_worker, _hf_work)
    if args.num_requests < 1:
        raise common.BenchError(f"--num-requests: must be at least 1, got {args.num_requests}")
    if args.output_len < 1:
        raise common.BenchError(f"--output-len: must be at least 1, got {args.output_len}")
    repetitions = args.repetitions if args.repetitions is not None else (3 if args.compare_quantization else 1)
    if repetitions < 1:
        raise common.BenchError(f"--repetitions: must be at least 1, got {repetitions}")
    sampling = sampling_settings(args)
    if args.compare_quantization is not None and args.quantization is not None:
        raise common.BenchError(f"--compare-quantization {args.compare_quantization} runs beside float weights: "
                                f"drop --quantization {args.quantization}")
    peers = args.compare.split(",") if args.compare != "none" else []
    if "hf" in peers and sampling:
        raise common.BenchError("--compare hf: transformers' static batches here are greedy, without logprobs; "
                                "drop --temperature and --logprobs")
    hf_batch_sizes = common.parse_int_list(args.hf_batch_sizes, "--hf-batch-sizes") if "hf" in peers else []
    if "hf" in peers:
        common.hf_spec(args.model, args.hf_threads)  # fail before the long start-up if transformers can't load it
    vllm_python = common.check_vllm_python(args) if "vllm" in peers else None
    progress = common.show_progress(args)

    longest = common.longest_request(args, TEXT_DATASET_PROMPT_ROOM)
    options = common.engine_options(args, max_total_len=longest, max_concurrency=args.num_requests,
                                    strict=args.dataset == "random")
    llm, startup_s = common.start_llm(args.model, options)
    llms = {"jaxrunner": llm}
    if args.compare_quantization is not None:
        llms[f"jaxrunner+{args.compare_quantization}"] = common.start_llm(
            args.model, dict(options, quantization=args.compare_quantization))[0]
    requests = make_requests(args, llm.get_tokenizer())
    too_long = [r for r in requests if len(r["prompt_token_ids"]) + r["output_len"] > options["max_model_len"]]
    if too_long:
        raise common.BenchError(f"--max-model-len {options['max_model_len']}: {len(too_long)} requests need more "
                                f"(longest {max(len(r['prompt_token_ids']) + r['output_len'] for r in too_long)})")

    results = serve_alternating(llms, requests, repetitions, progress, sampling)
    startup = common.startup_summary(llm)
    startup["total_s"] = startup_s
    engine_stats = {k: v for k, v in llm.engine.stats().items() if k != "tokens_per_step"}
    del llm, llms

    hf_info = vllm_info = None
    if "hf" in peers:
        hf_results, hf_info = hf_baseline(args.model, requests, hf_batch_sizes, progress, args.hf_threads)
        results.update(hf_results)
    if "vllm" in peers:
        results["vllm"], vllm_info = vllm_peer(vllm_python, args, options, requests, progress, repetitions,
                                               sampling)

    config = {"model": args.model, "num_requests": args.num_requests, "dataset": args.dataset,
              "dataset_path": args.dataset_path, "input_len": args.input_len if args.dataset == "random" else None,
              "output_len": args.output_len, "seed": args.seed, "compare": args.compare, "engine": options,
              "compare_quantization": args.compare_quantization, "repetitions": repetitions,
              "sampling": sampling or None,
              "prompt_len_stats": common.percentiles([len(r["prompt_token_ids"]) for r in requests], (0, 50, 100))}
    payload = {"config": config, "startup": startup, "engine_stats": engine_stats, "transformers": hf_info,
               "vllm": vllm_info, "results": results, "ratio": ratios(results)}
    title = f"throughput: {args.num_requests} requests, {args.model}"
    # a float/quantized comparison is named after the format, like a quantized run
    named = args if args.compare_quantization is None else argparse.Namespace(
        **{**vars(args), "quantization": args.compare_quantization})
    common.write_results(named, KIND, payload, plot, results, title)
    for name in ("best_hf", "vllm"):
        ratio = payload["ratio"].get(f"jaxrunner/{name}")
        if ratio:
            title += f" — jaxrunner/{ratio.get('best', name)} total tok/s {ratio['total_tokens_per_s']:.2f}×"
    quantized = payload["ratio"].get(f"jaxrunner+{args.compare_quantization}/jaxrunner")
    if quantized:
        title += f" — {args.compare_quantization}/float total tok/s {quantized['total_tokens_per_s']:.2f}×"
    common.print_table(TABLE_HEADERS, table_rows(results), title)
    return 0


if __name__ == "__main__":
    sys.exit(common.run_main("benchmark_throughput", main))
