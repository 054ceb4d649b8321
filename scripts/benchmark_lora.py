#!/usr/bin/env python
"""LoRA: TPOT and throughput with every request on an adapter, against the base model, in one run.

    python scripts/benchmark_lora.py                         # batch 1 and 16, rank 16, 4 slots
    python scripts/benchmark_lora.py --dtype bfloat16 --batch-sizes 1,16,64 --repetitions 6

Three configurations on the same model and prompts, repetition by repetition in turn:

* ``base``: an engine without LoRA;
* ``lora on, no adapter``: an engine with ``enable_lora`` whose requests name no adapter (what
  the slots cost a deployment that serves base-model traffic beside adapters);
* ``rank R adapters``: the same engine, every request on one of ``--max-loras`` random adapters
  of rank ``R`` targeting every projection, round-robin (a batch mixes them).

Adapters are random PEFT directories written by this script (no torch needed). Also reported:
reading and laying out one adapter on the host, and writing it into a device slot. TPOT is
``benchmark_latency.run_batch``'s; throughput is a batch's output tokens over its wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import _bench_common as common  # noqa: E402
from benchmark_latency import run_batch  # noqa: E402

KIND = "lora"
CONFIGS = ("base", "lora on, no adapter", "adapters")
TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
TABLE_HEADERS = ["config", "batch", "TPOT p50 ms", "TPOT p90 ms", "output tok/s", "TPOT vs base", "tok/s vs base"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16", help="concurrent requests per measurement")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank (max_lora_rank)")
    parser.add_argument("--max-loras", type=int, default=4, help="adapter slots, and adapters served")
    parser.add_argument("--repetitions", type=int, default=4, help="measured repetitions per batch size")
    parser.add_argument("--warmup-repetitions", type=int, default=1, help="unmeasured repetitions first")
    common.add_engine_args(parser)
    common.add_output_args(parser, KIND)
    return parser


def module_shapes(cfg) -> dict:
    """HF module -> (out, in) of a Llama-shaped model."""
    d, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q), "gate_proj": (inter, d),
            "up_proj": (inter, d), "down_proj": (d, inter)}


def write_adapter(path: str, cfg, rank: int, seed: int) -> str:
    """A random PEFT adapter of ``rank`` on every projection of every layer."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    shapes, tensors = module_shapes(cfg), {}
    for layer in range(cfg.num_layers):
        for block, modules in TARGETS.items():
            for module in modules:
                out, fan_in = shapes[module]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) / np.sqrt(fan_in)).astype(np.float32)
                tensors[f"{prefix}.lora_B.weight"] = (0.01 * rng.standard_normal((out, rank))).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sum(map(list, TARGETS.values()), []),
                   "lora_dropout": 0.0, "bias": "none"}, f)
    return path


def measure(engines: dict, adapters: list, prompts: list[list[int]], batch_size: int, args) -> dict:
    """Per configuration: TPOTs and batch throughputs, the configurations alternating each repetition."""
    from jaxrunner import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    samples = {config: {"tpot": [], "tok_s": []} for config in CONFIGS}
    for rep in range(args.warmup_repetitions + args.repetitions):
        batch = prompts[rep % len(prompts)][:batch_size]
        for config in CONFIGS:
            engine = engines["base" if config == "base" else "lora"]
            engine.scheduler.allocator.reset_prefix_cache()
            requests = [adapters[i % len(adapters)] for i in range(batch_size)] if config == "adapters" else None
            start = time.perf_counter()
            _, tpot, _, _ = run_batch(engine, batch, params, requests)
            if rep >= args.warmup_repetitions:
                samples[config]["tpot"].extend(tpot)
                samples[config]["tok_s"].append(batch_size * args.output_len / (time.perf_counter() - start))
    return samples


def adapter_load_cost(llm, adapters: list) -> dict:
    """Host: read and lay out one adapter; device: write it into a slot (median of each)."""
    import jax

    executor = llm.engine.executor
    host, device = [], []
    for index, request in enumerate(adapters):
        start = time.perf_counter()
        adapter = executor.load_adapter(request.lora_name, request.lora_path)
        host.append(time.perf_counter() - start)
        start = time.perf_counter()
        executor.load_lora_slot(1 + index % executor.max_loras, adapter)
        jax.block_until_ready(executor.runner.lora_slots)
        device.append(time.perf_counter() - start)
    return {"host_read_ms": round(1e3 * float(np.median(host)), 2), "slot_write_ms": round(1e3 * float(np.median(device)), 2),
            "adapter_bytes": adapter.nbytes}


def table_rows(rows: list[dict]) -> list[list]:
    return [[r["config"], r["batch_size"], common.ms(r["tpot"]["p50"]), common.ms(r["tpot"]["p90"]),
             round(r["output_tok_s"], 1), r["tpot_ratio_vs_base"], r["tok_s_ratio_vs_base"]] for r in rows]


def plot(path: str, rows: list[dict], title: str) -> str:
    labels = [f"batch {b}" for b in sorted({r["batch_size"] for r in rows})]
    series = {config: [round(r["output_tok_s"], 1) for r in rows if r["config"] == config] for config in CONFIGS}
    return common.bar_plot(path, labels, series, title=title, ylabel="output tok/s")


def main(argv=None) -> int:
    from jaxrunner import LoRARequest

    args = build_parser().parse_args(argv)
    batch_sizes = common.parse_int_list(args.batch_sizes, "--batch-sizes")
    options = common.engine_options(args, max_total_len=args.input_len + args.output_len,
                                    max_concurrency=max(batch_sizes))
    base, base_startup_s = common.start_llm(args.model, options)
    lora, lora_startup_s = common.start_llm(args.model, dict(options, enable_lora=True, max_loras=args.max_loras,
                                                             max_lora_rank=args.rank))
    cfg = lora.engine.model.config
    root = tempfile.mkdtemp(prefix="jaxrunner-lora-bench-")
    adapters = [LoRARequest(f"adapter{i}", i + 1, write_adapter(os.path.join(root, f"a{i}"), cfg, args.rank, i))
                for i in range(args.max_loras)]
    load = adapter_load_cost(lora, adapters)
    for request in adapters:
        lora.engine.add_lora(request)
    rng = np.random.default_rng(args.seed)
    vocab = lora.get_tokenizer().vocab_size
    prompts = [common.random_prompts(rng, [args.input_len] * max(batch_sizes), vocab, low=3)
               for _ in range(args.warmup_repetitions + args.repetitions)]
    rows = []
    for batch_size in batch_sizes:
        samples = measure({"base": base.engine, "lora": lora.engine}, adapters, prompts, batch_size, args)
        base_tpot = common.percentiles(samples["base"]["tpot"])["p50"]
        base_tok_s = float(np.median(samples["base"]["tok_s"]))
        for config in CONFIGS:
            tpot, tok_s = common.percentiles(samples[config]["tpot"]), float(np.median(samples[config]["tok_s"]))
            rows.append({"engine": f"jaxrunner ({config})", "config": config, "batch_size": batch_size, "tpot": tpot,
                         "output_tok_s": tok_s, "tpot_ratio_vs_base": round(tpot["p50"] / base_tpot, 3),
                         "tok_s_ratio_vs_base": round(tok_s / base_tok_s, 3)})
    config = {"model": args.model, "input_len": args.input_len, "output_len": args.output_len, "rank": args.rank,
              "max_loras": args.max_loras, "repetitions": args.repetitions, "targets": "every projection",
              "engine": {k: v for k, v in options.items() if k != "progress"}, "device": common.device_info(),
              "versions": common.versions(), "startup_s": {"base": base_startup_s, "lora": lora_startup_s},
              "lora_startup": lora.startup_report.get("lora")}
    payload = {"config": config, "adapter_load": load, "results": rows}
    title = f"LoRA rank {args.rank} × {args.max_loras} adapters ({args.dtype}, {common.device_info().get('cpu', '')})"
    common.print_table(TABLE_HEADERS, table_rows(rows), title)
    print(f"adapter load: host {load['host_read_ms']} ms, slot write {load['slot_write_ms']} ms "
          f"({load['adapter_bytes'] / 2**20:.1f} MiB)")
    common.write_results(args, KIND, payload, plot, rows, title)
    return 0


if __name__ == "__main__":
    sys.exit(common.run_main("benchmark_lora", main))
