#!/usr/bin/env python
"""Structured output: TPOT with and without a JSON-schema constraint, in one run, alternating.

    python scripts/benchmark_structured.py                     # batch 1 and 16, 128 output tokens
    python scripts/benchmark_structured.py --batch-sizes 1,4,16 --repetitions 8

Three configurations on the same model and shapes, repetition by repetition in turn:

* ``free``: the chat prompt asks for the JSON, nothing constrains it (EOS ignored), async scheduling;
* ``free, sync``: the same on an engine without async scheduling, which is what a constrained
  request costs the pipeline (its grammar needs the last token on the host before the next step);
* ``json schema``: the same prompt under a JSON schema (``StructuredOutputsParams(json=...)``).

``json schema`` against ``free`` is what a user pays for the constraint; ``free, sync`` against
``free`` splits that into the lost overlap and the rest (filling masks on the host, applying them
in the step). The grammar's host cost is also timed alone: llguidance's mask fill per token, over
the constrained outputs. Timing is ``benchmark_latency.run_batch``'s: TPOT = (last token − first
token) / (n − 1) per request, percentiles over every request of every repetition.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import _bench_common as common  # noqa: E402
from benchmark_latency import run_batch  # noqa: E402

KIND = "structured"
PROMPT = "List four products of a small hardware shop as JSON, with a name, a price and whether it is in stock."
SCHEMA = {"type": "object", "properties": {"products": {
    "type": "array", "minItems": 4, "maxItems": 4,
    "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "price": {"type": "number", "minimum": 0, "maximum": 1000,
                                                         "multipleOf": 0.01},
                                               "in_stock": {"type": "boolean"}},
              "required": ["name", "price", "in_stock"], "additionalProperties": False}}},
    "required": ["products"], "additionalProperties": False}
CONFIGS = ("free", "free, sync", "json schema")
TABLE_HEADERS = ["config", "batch", "TPOT p50 ms", "TPOT p90 ms", "p50 vs free", "TPOT samples"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16", help="concurrent requests per measurement")
    parser.add_argument("--output-len", type=int, default=128, help="most output tokens per request")
    parser.add_argument("--repetitions", type=int, default=5, help="measured repetitions per batch size")
    parser.add_argument("--warmup-repetitions", type=int, default=1, help="unmeasured repetitions first")
    common.add_engine_args(parser)
    common.add_output_args(parser, KIND)
    return parser


def _params(config: str, output_len: int, seed: int):
    from jaxrunner import SamplingParams
    from jaxrunner.sampling_params import StructuredOutputsParams

    if config == "json schema":
        return SamplingParams(temperature=0.7, seed=seed, max_tokens=output_len,
                              structured_outputs=StructuredOutputsParams(json=SCHEMA))
    return SamplingParams(temperature=0.7, seed=seed, max_tokens=output_len, ignore_eos=True)


def measure(engines: dict, prompt: list[int], batch_size: int, args) -> dict:
    """TPOTs and output lengths per configuration, the configurations alternating each repetition."""
    samples = {config: {"tpot": [], "tokens": []} for config in CONFIGS}
    for rep in range(args.warmup_repetitions + args.repetitions):
        for config in CONFIGS:
            engine = engines["sync" if config == "free, sync" else "async"]
            engine.scheduler.allocator.reset_prefix_cache()  # measure computing the prompt, not the cache
            before = {r for r in engine.output_processor.request_ids()}
            _, tpot, _, _ = run_batch(engine, [prompt] * batch_size, _params(config, args.output_len, rep))
            assert not set(engine.output_processor.request_ids()) - before
            if rep >= args.warmup_repetitions:
                samples[config]["tpot"].extend(tpot)
    return samples


def mask_fill_cost(llm, prompt: list[int], args) -> dict:
    """llguidance's host work per constrained token, timed alone: consume the token, fill the mask."""
    from jaxrunner.sampling_params import StructuredOutputsParams

    out = llm.generate([{"prompt_token_ids": prompt}] * 4,
                       [_params("json schema", args.output_len, seed) for seed in range(4)], use_tqdm=False)
    grammars = llm.engine.grammars
    grammar = grammars.grammar(StructuredOutputsParams(json=SCHEMA))
    per_token, lengths = [], []
    for output in out:
        tokens = output.outputs[0].token_ids
        matcher = grammars.matcher(grammar)
        start = time.perf_counter()
        for token in tokens:
            grammars.fill_bitmask(matcher)
            matcher.consume_token(token)
        per_token.append((time.perf_counter() - start) / max(1, len(tokens)))
        lengths.append(len(tokens))
    return {"mask_fill_us_per_token": float(np.mean(per_token) * 1e6), "constrained_output_tokens": lengths,
            "finish_reasons": [o.outputs[0].finish_reason for o in out]}


def table_rows(rows: list[dict]) -> list[list]:
    return [[r["config"], r["batch_size"], common.ms(r["tpot"]["p50"]), common.ms(r["tpot"]["p90"]),
             r["tpot_ratio_vs_free"], r["num_tpot_samples"]] for r in rows]


def plot(path: str, rows: list[dict], title: str) -> str:
    labels = [f"batch {b}" for b in sorted({r["batch_size"] for r in rows})]
    series = {config: [common.ms(r["tpot"]["p50"]) for r in rows if r["config"] == config] for config in CONFIGS}
    return common.bar_plot(path, labels, series, title=title, ylabel="TPOT p50 (ms)")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    batch_sizes = common.parse_int_list(args.batch_sizes, "--batch-sizes")
    options = common.engine_options(args, max_total_len=96 + args.output_len, max_concurrency=max(batch_sizes))
    llm, startup_s = common.start_llm(args.model, options)
    sync_llm, _ = common.start_llm(args.model, dict(options, async_scheduling=False))
    tokenizer = llm.get_tokenizer()
    prompt = llm.chat_prompt([{"role": "user", "content": PROMPT}])["prompt_token_ids"]
    engines = {"async": llm.engine, "sync": sync_llm.engine}
    rows = []
    for batch_size in batch_sizes:
        samples = measure(engines, prompt, batch_size, args)
        free = common.percentiles(samples["free"]["tpot"])["p50"]
        for config in CONFIGS:
            tpot = common.percentiles(samples[config]["tpot"])
            rows.append({"engine": f"jaxrunner ({config})", "config": config, "batch_size": batch_size, "tpot": tpot,
                         "tpot_ratio_vs_free": round(tpot["p50"] / free, 3),
                         "num_tpot_samples": len(samples[config]["tpot"])})
    host = mask_fill_cost(llm, prompt, args)
    config = {"model": args.model, "prompt_tokens": len(prompt), "output_len": args.output_len,
              "repetitions": args.repetitions, "schema": SCHEMA, "sampling": "temperature 0.7, seeded",
              "engine": {k: v for k, v in options.items() if k != "progress"}, "device": common.device_info(),
              "versions": common.versions(), "tokenizer_vocab": len(tokenizer)}
    payload = {"config": config, "startup_s": startup_s, "host_grammar_cost": host, "results": rows}
    title = f"TPOT with and without a JSON schema ({args.model}, {args.dtype})"
    common.write_results(args, KIND, payload, plot, rows, title)
    common.print_table(TABLE_HEADERS, table_rows(rows), title)
    print(f"llguidance mask fill: {host['mask_fill_us_per_token']:.0f} us per constrained token", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(common.run_main("benchmark_structured", main))
