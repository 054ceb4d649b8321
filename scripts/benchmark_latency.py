#!/usr/bin/env python
"""Latency: batch sizes × input lengths × output lengths; TTFT, TPOT and end-to-end, p50/p90/p99.

    python scripts/benchmark_latency.py                         # batch 1,4,16 × input 32,128 × output 32,128
    python scripts/benchmark_latency.py --compare hf --repetitions 3

jaxrunner is timed through the streaming engine API: the batch's requests are added at once, then
``engine.step()`` runs until they finish, with a timestamp per output token. Per request:
TTFT = first token − submission, TPOT = (last token − first token) / (n − 1), end-to-end = last
token − submission; percentiles are over every request of every repetition.

transformers (``--compare hf``) runs the same batch as one static ``generate`` call: TTFT is the
time of ``generate(max_new_tokens=1)``, end-to-end that of ``generate(max_new_tokens=n)``, TPOT =
(e2e − TTFT) / (n − 1); percentiles are over repetitions. It runs in its own process (JAX's CPU
threads slow torch down when they share one). vLLM (``--compare vllm --vllm-python PATH``) is
timed the same way through its own ``LLM.generate``, in its own Python and process
(``vllm_peer.py``). llama.cpp (``--compare llamacpp --llamacpp-python PATH``, batch 1, a GGUF model:
the same file) streams each prompt through llama-cpp-python in its own process
(``llamacpp_peer.py``). Greedy, EOS ignored, random token prompts.

Each jaxrunner row also says where it sits against this machine's ceilings, measured in the same
run (``roofline.py``; ``--no-roofline`` skips it): decoding's GB/s (the weights and K/V a step
reads, per TPOT) against the copy bandwidth, and prefill's GFLOP/s (per TTFT) against the matmul
rate of the model's MLP product at the prompt's rows.

Speculative decoding: ``--speculative-method ngram`` serves with n-gram proposals, ``draft_model``
with a draft model's (``--speculative-model``, optionally ``--speculative-quantization``), and
``ngram,draft_model`` starts one engine for each; ``--compare-speculation`` also starts an engine
without them, and the engines alternate repetition by repetition. ``--prompt-kind repeat`` asks
the model (chat template) to repeat a list given in the prompt, where proposals from the prompt
pay; ``free`` asks for new text, where they rarely do (both ignore ``--input-lens``: the prompt is
the text's length). Rows report the acceptance rate.

    python scripts/benchmark_latency.py --batch-sizes 1 --output-lens 128 --prompt-kind repeat \
        --speculative-method ngram --compare-speculation
    python scripts/benchmark_latency.py --batch-sizes 1 --output-lens 128 --prompt-kind repeat,free \
        --speculative-method ngram,draft_model --speculative-model smollm2-135m-instruct \
        --speculative-quantization int4 --compare-speculation
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import _bench_common as common  # noqa: E402

KIND = "latency"
PEERS = ("hf", "vllm", "llamacpp")
_ids = itertools.count()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,4,16", help="concurrent requests per measurement")
    parser.add_argument("--input-lens", default="32,128", help="prompt lengths in tokens")
    parser.add_argument("--output-lens", default="32,128", help="output lengths in tokens")
    parser.add_argument("--repetitions", type=int, default=5, help="measured repetitions per combination")
    parser.add_argument("--warmup-repetitions", type=int, default=1, help="unmeasured repetitions first")
    parser.add_argument("--compare", default="none",
                        help=f"also measure these peers on batches of the same shapes, comma-separated: "
                             f"{', '.join(PEERS)} (or none)")
    parser.add_argument("--llamacpp-python", default=None,
                        help="for --compare llamacpp: the python of an environment with llama-cpp-python")
    parser.add_argument("--llamacpp-no-extra-bufts", action="store_true",
                        help="for --compare llamacpp: load without llama.cpp's repacked/AMX weight layouts "
                             "(its --no-repack), where that path fails on the machine")
    parser.add_argument("--no-roofline", action="store_true",
                        help="skip measuring the copy bandwidth and matmul rate the rows are set against")
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-method", default=None,
                      help="propose tokens this way: ngram, draft_model, or both comma-separated (an engine each)")
    spec.add_argument("--speculative-model", default=None,
                      help="draft_model: the draft (an alias, a .gguf file or a model directory)")
    spec.add_argument("--speculative-quantization", default=None, help="draft_model: the draft's quantization")
    spec.add_argument("--num-speculative-tokens", type=int, default=None, help="tokens proposed per step")
    spec.add_argument("--prompt-lookup-max", type=int, default=None, help="longest n-gram looked up")
    spec.add_argument("--prompt-lookup-min", type=int, default=None, help="shortest n-gram looked up")
    spec.add_argument("--compare-speculation", action="store_true",
                      help="also run without speculation, alternating repetitions with the speculative engine")
    parser.add_argument("--compare-quantization", default=None, choices=["int8", "int4", "w4a8", "w8a8"],
                        help="also run an engine with these weights, alternating repetitions with the float one "
                             "(the result is named after the format)")
    parser.add_argument("--prompt-kind", default="random",
                        help="random (token prompts), repeat (a chat prompt asking to repeat a list), free (one "
                             "asking for new text), or several, comma-separated")
    common.add_hf_args(parser)
    common.add_vllm_args(parser)
    common.add_engine_args(parser)
    common.add_output_args(parser, KIND)
    return parser


def combinations(batch_sizes, input_lens, output_lens) -> list[tuple[int, int, int]]:
    return [(b, i, o) for b in batch_sizes for i in input_lens for o in output_lens]


def _summary(ttft: list[float], tpot: list[float], e2e: list[float]) -> dict:
    return {"ttft_s": common.percentiles(ttft), "tpot_s": common.percentiles(tpot), "e2e_s": common.percentiles(e2e),
            "load_average_1m": common.load_average()}


# ----------------------------------------------------------------------------- jaxrunner
# capitalized as the model writes list items, so that a faithful copy is token-identical
REPEAT_ITEMS = ["Apples", "Bread", "Milk", "Eggs", "Butter", "Cheese", "Tomatoes", "Onions", "Rice", "Pasta",
                "Coffee", "Tea", "Sugar", "Salt", "Pepper", "Olive oil", "Lemons", "Garlic", "Carrots", "Potatoes",
                "Chicken", "Yogurt", "Honey", "Oranges", "Spinach", "Beans", "Flour", "Cereal", "Juice", "Soap"]
CHAT_PROMPTS = {
    "repeat": "Repeat the following shopping list exactly, one item per line, numbered:\n"
              + "\n".join(f"{i}. {item}" for i, item in enumerate(REPEAT_ITEMS, start=1)),
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
PROMPT_KINDS = ("random", *CHAT_PROMPTS)


def make_prompts(kind: str, tokenizer, rng: np.random.Generator, batch_size: int, input_len: int) -> list[list[int]]:
    """``batch_size`` prompts of ``kind``: fresh random tokens (no prefix-cache hits), or a chat text."""
    if kind == "random":
        vocab, low = common.tokenizer_vocab(tokenizer)
        return common.random_prompts(rng, [input_len] * batch_size, vocab, low)
    text = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[kind]}], tokenize=False,
                                         add_generation_prompt=True)
    return [list(tokenizer.encode(text, add_special_tokens=False))] * batch_size


def run_batch(engine, prompts: list[list[int]], params, lora_requests=None) -> tuple[list, list, list, list]:
    """Submit the prompts together and step until they finish: per request TTFT, TPOT, e2e, and
    the (proposed, accepted) speculative tokens. ``lora_requests``: each prompt's adapter."""
    ids = [f"latency-{next(_ids)}" for _ in prompts]
    first, last, count, drafts = {}, {}, {}, {}
    submitted = time.perf_counter()
    for index, (request_id, prompt) in enumerate(zip(ids, prompts)):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params,
                           None if lora_requests is None else lora_requests[index])
    pending = set(ids)
    while pending:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id not in pending:
                continue
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            count[out.request_id] = len(out.outputs[0].token_ids)
            drafts[out.request_id] = (out.num_draft_tokens, out.num_accepted_draft_tokens)
            if out.finished:
                pending.discard(out.request_id)
        if not outputs and not engine.has_unfinished_requests():
            raise RuntimeError(f"requests {sorted(pending)} vanished without finishing")
    ttft = [first[i] - submitted for i in ids]
    e2e = [last[i] - submitted for i in ids]
    tpot = [(last[i] - first[i]) / (count[i] - 1) for i in ids if count[i] > 1]
    return ttft, tpot, e2e, [drafts[i] for i in ids]


def measure_jaxrunner(engines: dict, batch_size: int, input_len: int, output_len: int, repetitions: int,
                      rng: np.random.Generator, warmup_repetitions: int = 1, prompt_kind: str = "random") -> dict:
    """TTFT/TPOT/e2e of ``batch_size`` requests submitted together, over ``repetitions`` runs, per
    engine (``{name: engine}``); several engines alternate, each running the same prompts in turn."""
    from jaxrunner import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    tokenizer = next(iter(engines.values())).tokenizer
    times = {name: ([], [], [], []) for name in engines}
    prompt_len = input_len
    for rep in range(warmup_repetitions + repetitions):
        prompts = make_prompts(prompt_kind, tokenizer, rng, batch_size, input_len)
        prompt_len = len(prompts[0])
        for name, engine in engines.items():
            if prompt_kind != "random":  # the same text each time: measure computing it, not the cache
                engine.scheduler.allocator.reset_prefix_cache()
            measured = run_batch(engine, prompts, params)
            if rep >= warmup_repetitions:
                for into, values in zip(times[name], measured):
                    into.extend(values)
    summaries = {}
    for name, (ttft, tpot, e2e, drafts) in times.items():
        proposed, accepted = sum(d for d, _ in drafts), sum(a for _, a in drafts)
        summaries[name] = dict(_summary(ttft, tpot, e2e), prompt_len=prompt_len, num_draft_tokens=proposed,
                               num_accepted_draft_tokens=accepted,
                               spec_acceptance_rate=accepted / proposed if proposed else None)
    return summaries


# ----------------------------------------------------------------------------- ceilings
def with_roofline(rows: list[dict], llms: dict, progress: bool) -> tuple[list[dict], dict]:
    """Every jaxrunner row set against the copy bandwidth and the matmul rate at its prefill rows,
    both measured now, in this process (``roofline.py``)."""
    import roofline

    llm = next(iter(llms.values()))[0]
    limits = {"copy_gbps": roofline.copy_gbps(), "matmul_gflops": {}}
    traffic = {name: roofline.model_traffic(each) for name, (each, _) in llms.items()}
    annotated = []
    for row in rows:
        prefill_rows = row["batch_size"] * row["input_len"]
        if prefill_rows not in limits["matmul_gflops"]:
            limits["matmul_gflops"][prefill_rows] = roofline.matmul_ceiling(llm, prefill_rows)
        rate = limits["matmul_gflops"][prefill_rows]["matmul_gflops"]
        annotated.append(roofline.annotate(row, traffic[row["engine"]], {"copy_gbps": limits["copy_gbps"],
                                                                          "matmul_gflops": rate}))
    if progress:
        print(f"ceilings: copy {limits['copy_gbps']:.1f} GB/s; matmul {limits['matmul_gflops']}", file=sys.stderr)
    return annotated, dict(limits, traffic=traffic)


# ----------------------------------------------------------------------------- llama.cpp
def check_llamacpp(args, batch_sizes: list[int]) -> str:
    if batch_sizes != [1]:
        raise common.BenchError(f"--compare llamacpp: --batch-sizes {args.batch_sizes}: llama-cpp-python serves one "
                                "sequence at a time; pass --batch-sizes 1")
    if not args.model.endswith(".gguf") and args.model != common.DEFAULT_MODEL:
        raise common.BenchError(f"--compare llamacpp: --model {args.model!r}: llama.cpp reads GGUF files; pass one")
    return common.check_peer_python(args.llamacpp_python, "llamacpp", "--llamacpp-python", "llama_cpp",
                                    "llama-cpp-python (CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python)")


def llamacpp_peer(python: str, args, combos: list[tuple[int, int, int]], vocab: int, low: int,
                  progress: bool) -> tuple[list[dict], dict]:
    """llama.cpp on the same GGUF file, batch 1, the same prompt lengths (``llamacpp_peer.py``)."""
    from jaxrunner.models.loading.resolve import resolve_model

    rng = np.random.default_rng(args.seed + 2)
    count = args.warmup_repetitions + args.repetitions
    batches = [{"batch_size": b, "input_len": i, "output_len": o,
                "prompts": common.random_prompts(rng, [i] * count, vocab, low)} for b, i, o in combos]
    spec = {"gguf": resolve_model(args.model).path, "threads": os.cpu_count(),
            "n_ctx": max(i + o for _, i, o in combos) + 8, "warmup_repetitions": args.warmup_repetitions,
            "extra_bufts": not args.llamacpp_no_extra_bufts, "batches": batches}
    out = common.run_llamacpp_peer(python, spec, progress)
    rows = [{"engine": "llama.cpp", "batch_size": r["batch_size"], "input_len": r["input_len"],
             "output_len": r["output_len"], **_summary(r["ttft"], r["tpot"], r["e2e"])} for r in out["result"]]
    return rows, out["info"]


# ----------------------------------------------------------------------------- transformers
def measure_hf(hf_model, pad_id: int, vocab: int, low: int, batch_size: int, input_len: int, output_len: int,
               repetitions: int, rng: np.random.Generator, warmup_repetitions: int = 1) -> dict:
    ttft, tpot, e2e = [], [], []
    for rep in range(warmup_repetitions + repetitions):
        prompts = common.random_prompts(rng, [input_len] * batch_size, vocab, low)
        start = time.perf_counter()
        common.hf_generate(hf_model, prompts, 1, pad_id)
        first = time.perf_counter() - start
        start = time.perf_counter()
        common.hf_generate(hf_model, prompts, output_len, pad_id)
        total = time.perf_counter() - start
        if rep < warmup_repetitions:
            continue
        ttft.append(first)
        e2e.append(total)
        if output_len > 1:
            tpot.append((total - first) / (output_len - 1))
    return _summary(ttft, tpot, e2e)


def hf_baseline(model: str, combos: list[tuple[int, int, int]], repetitions: int, warmup_repetitions: int,
                seed: int, vocab: int, low: int, progress: bool = False,
                threads: int | None = None) -> tuple[list[dict], dict]:
    """``measure_hf`` over every combination, in a separate process (see ``run_hf_worker``)."""
    spec = {**common.hf_spec(model, threads), "combos": combos, "repetitions": repetitions,
            "warmup_repetitions": warmup_repetitions, "seed": seed, "vocab": vocab, "low": low}
    out = common.run_hf_worker(__file__, spec, progress)
    info = dict(out["info"], method="TTFT = generate(max_new_tokens=1); TPOT = (e2e - TTFT) / (n - 1); "
                                    "one static batch of equal-length prompts (no padding)")
    return out["result"], info


def vllm_peer(python: str, args, options: dict, combos: list[tuple[int, int, int]], vocab: int, low: int,
              progress: bool) -> tuple[list[dict], dict]:
    """vLLM timed like transformers (TTFT from max_tokens=1), in its own Python (see ``vllm_peer.py``)."""
    rng = np.random.default_rng(args.seed)
    runs = args.warmup_repetitions + args.repetitions
    batches = [{"batch_size": b, "input_len": i, "output_len": o, "warmup": args.warmup_repetitions,
                "repetitions": [common.random_prompts(rng, [i] * b, vocab, low) for _ in range(runs)]}
               for b, i, o in combos]
    spec = {**common.vllm_model_spec(args, options), "mode": "latency", "batches": batches}
    out = common.run_vllm_peer(python, spec, progress)
    rows = [{"engine": "vllm", "batch_size": r["batch_size"], "input_len": r["input_len"],
             "output_len": r["output_len"], **_summary(r["ttft"], r["tpot"], r["e2e"])} for r in out["result"]]
    return rows, out["info"]


def _hf_work(hf_model, pad_id: int, spec: dict) -> list[dict]:
    from tqdm.auto import tqdm

    rng = np.random.default_rng(spec["seed"])
    rows = []
    for b, i, o in tqdm(spec["combos"], desc="transformers latency", disable=not spec["progress"]):
        summary = measure_hf(hf_model, pad_id, spec["vocab"], spec["low"], b, i, o, spec["repetitions"], rng,
                             spec["warmup_repetitions"])
        rows.append({"engine": "hf", "batch_size": b, "input_len": i, "output_len": o, **summary})
    return rows


# ----------------------------------------------------------------------------- report
TABLE_HEADERS = ["engine", "prompt", "accepted", "batch", "in", "out", "TTFT p50 ms", "p90", "p99", "TPOT p50 ms", "p90", "p99",
                 "E2E p50 s", "p90", "p99", "decode GB/s (of copy)", "prefill GFLOP/s (of matmul)"]


def table_rows(rows: list[dict]) -> list[list]:
    out = []
    for r in rows:
        t, p, e = r["ttft_s"], r["tpot_s"], r["e2e_s"]
        rate = r.get("spec_acceptance_rate")
        out.append([r["engine"], r.get("prompt_kind", "random"), "-" if rate is None else f"{rate:.0%}", r["batch_size"], r["input_len"], r["output_len"],
                    common.ms(t["p50"]), common.ms(t["p90"]), common.ms(t["p99"]),
                    common.ms(p["p50"]), common.ms(p["p90"]), common.ms(p["p99"]),
                    e["p50"], e["p90"], e["p99"], _against(r, "decode_gbps", "decode_frac_of_copy"),
                    _against(r, "prefill_gflops", "prefill_frac_of_matmul")])
    return out


def _against(row: dict, value: str, fraction: str) -> str:
    if row.get(value) is None:
        return "-"
    return f"{row[value]:.1f} ({row[fraction]:.0%})"


def _label(row: dict) -> str:
    kind = row.get("prompt_kind", "random")
    return ("" if kind == "random" else f"{kind} ") + f"b{row['batch_size']} in{row['input_len']} out{row['output_len']}"


def plot(path: str, rows: list[dict], title: str) -> str:
    labels, seen = [], set()
    for r in rows:
        label = _label(r)
        if label not in seen:
            seen.add(label)
            labels.append(label)
    engines = list(dict.fromkeys(r["engine"] for r in rows))

    def series(metric: str, scale: float):
        values = {e: [None] * len(labels) for e in engines}
        for r in rows:
            v = r[metric]["p50"]
            values[r["engine"]][labels.index(_label(r))] = \
                None if v is None else v * scale
        return values

    return common.panel_bar_plot(path, labels, {
        "time to first token (p50)": ("ms", series("ttft_s", 1e3)),
        "time per output token (p50)": ("ms", series("tpot_s", 1e3)),
        "end-to-end (p50)": ("s", series("e2e_s", 1.0))}, title=title)


SPECULATIVE_FLAGS = {"ngram": ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"),
                     "draft_model": ("num_speculative_tokens", "speculative_model", "speculative_quantization")}


def speculative_engines(args) -> tuple[list[str], dict[str, dict]]:
    """The speculative methods asked for, and each one's engine options (the flags it uses)."""
    methods = args.speculative_method.split(",") if args.speculative_method else []
    unknown = [method for method in methods if method not in SPECULATIVE_FLAGS]
    if unknown or len(set(methods)) != len(methods):
        raise common.BenchError(f"--speculative-method {args.speculative_method!r}: valid: "
                                f"{', '.join(SPECULATIVE_FLAGS)}, comma-separated, each once")
    given = {name for flags in SPECULATIVE_FLAGS.values() for name in flags if getattr(args, name) is not None}
    unused = sorted(given - {name for method in methods for name in SPECULATIVE_FLAGS[method]})
    if unused or (args.compare_speculation and not methods):
        flags = [f"--{name.replace('_', '-')}" for name in unused] or ["--compare-speculation"]
        raise common.BenchError(f"{', '.join(flags)}: no --speculative-method given uses it")
    return methods, {method: {"speculative_method": method, **{name: getattr(args, name) for name in
                                                               SPECULATIVE_FLAGS[method] if getattr(args, name) is not None}}
                     for method in methods}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.hf_worker:
        return common.hf_worker_main(args.hf_worker, _hf_work)
    batch_sizes = common.parse_int_list(args.batch_sizes, "--batch-sizes")
    input_lens = common.parse_int_list(args.input_lens, "--input-lens")
    prompt_kinds = args.prompt_kind.split(",")
    for kind in prompt_kinds:
        if kind not in PROMPT_KINDS:
            raise common.BenchError(f"--prompt-kind {kind!r}: valid: {', '.join(PROMPT_KINDS)} (comma-separated)")
    output_lens = common.parse_int_list(args.output_lens, "--output-lens")
    if args.repetitions < 1 or args.warmup_repetitions < 0:
        raise common.BenchError("--repetitions must be >= 1 and --warmup-repetitions >= 0")
    peers = args.compare.split(",") if args.compare != "none" else []
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise common.BenchError(f"--compare {args.compare}: unknown {unknown}; valid: {', '.join(PEERS)} or none")
    if peers and prompt_kinds != ["random"]:
        raise common.BenchError(f"--compare {args.compare} measures random token prompts only (--prompt-kind random)")
    if "hf" in peers:
        common.hf_spec(args.model, args.hf_threads)
    vllm_python = common.check_vllm_python(args) if "vllm" in peers else None
    llamacpp_python = check_llamacpp(args, batch_sizes) if "llamacpp" in peers else None
    progress = common.show_progress(args)
    prompt_room = max(input_lens + [512] * any(kind != "random" for kind in prompt_kinds))
    options = common.engine_options(args, max_total_len=prompt_room + max(output_lens),
                                    max_concurrency=max(batch_sizes))
    methods, spec_options = speculative_engines(args)
    if args.compare_quantization is not None and args.quantization is not None:
        raise common.BenchError(f"--compare-quantization {args.compare_quantization} runs beside float weights: "
                                f"drop --quantization {args.quantization}")
    if max(batch_sizes) > options["max_num_seqs"]:
        print(f"note: batch sizes above --max-num-seqs {options['max_num_seqs']} queue inside the engine",
              file=sys.stderr)

    from tqdm.auto import tqdm

    llms = {}
    if not methods or args.compare_speculation:
        llms["jaxrunner"] = common.start_llm(args.model, options)
    if args.compare_quantization is not None:
        llms[f"jaxrunner+{args.compare_quantization}"] = common.start_llm(
            args.model, dict(options, quantization=args.compare_quantization))
    for method in methods:
        llms[f"jaxrunner+{method}"] = common.start_llm(args.model, dict(options, **spec_options[method]))
    # a chat text sets the prompt's length: one input length for it
    workloads = [(kind, combo) for kind in prompt_kinds
                 for combo in combinations(batch_sizes, input_lens if kind == "random" else input_lens[:1], output_lens)]
    combos = combinations(batch_sizes, input_lens, output_lens)
    rng = np.random.default_rng(args.seed)
    rows = []
    for kind, (b, i, o) in tqdm(workloads, desc="jaxrunner latency", disable=not progress):
        summaries = measure_jaxrunner({name: llm.engine for name, (llm, _) in llms.items()}, b, i, o,
                                      args.repetitions, rng, args.warmup_repetitions, kind)
        rows.extend({"engine": name, "prompt_kind": kind, "batch_size": b, "input_len": summary.pop("prompt_len"),
                     "output_len": o, **summary} for name, summary in summaries.items())
    ceilings = None
    if not args.no_roofline:
        rows, ceilings = with_roofline(rows, llms, progress)
    name, (llm, startup_s) = next(iter(llms.items()))
    startup = dict(common.startup_summary(llm), total_s=startup_s)
    vocab, low = common.tokenizer_vocab(llm.get_tokenizer())
    engine_options = {name: llm.engine.config.__dict__ for name, (llm, _) in llms.items()}
    del llm, llms

    hf_info = vllm_info = llamacpp_info = None
    if "hf" in peers:
        hf_rows, hf_info = hf_baseline(args.model, combos, args.repetitions, args.warmup_repetitions, args.seed,
                                       vocab, low, progress, args.hf_threads)
        rows.extend(hf_rows)
    if "vllm" in peers:
        vllm_rows, vllm_info = vllm_peer(vllm_python, args, options, combos, vocab, low, progress)
        rows.extend(vllm_rows)
    if "llamacpp" in peers:
        llamacpp_rows, llamacpp_info = llamacpp_peer(llamacpp_python, args, combos, vocab, low, progress)
        rows.extend(llamacpp_rows)

    config = {"model": args.model, "batch_sizes": batch_sizes, "input_lens": input_lens, "output_lens": output_lens,
              "repetitions": args.repetitions, "warmup_repetitions": args.warmup_repetitions, "seed": args.seed,
              "compare": args.compare, "engine": options, "prompt_kind": args.prompt_kind,
              "speculative": {"methods": spec_options, "compare_speculation": args.compare_speculation},
              "compare_quantization": args.compare_quantization,
              "engines": engine_options,
              "method": {"jaxrunner": "engine.add_request × batch, then engine.step() with a timestamp per output; "
                                      "percentiles over all requests of all repetitions",
                         "hf": "one static generate per batch; percentiles over repetitions",
                         "vllm": "LLM.generate per batch, max_tokens=1 then n; percentiles over repetitions",
                         "llamacpp": "one streamed create_completion per prompt (batch 1); percentiles over "
                                     "repetitions"}}
    payload = {"config": config, "startup": startup, "ceilings": ceilings,
               "transformers": hf_info, "vllm": vllm_info, "llamacpp": llamacpp_info, "results": rows}
    title = f"latency: {args.model}, {args.repetitions} repetitions"
    # a with/without-speculation comparison is its own kind of result, beside the plain latency one;
    # a float/quantized comparison is named after the format, like a quantized run
    named = args if args.compare_quantization is None else argparse.Namespace(
        **{**vars(args), "quantization": args.compare_quantization})
    common.write_results(named, "speculative" if args.compare_speculation else KIND, payload, plot, rows, title)
    common.print_table(TABLE_HEADERS, table_rows(rows), title)
    return 0


if __name__ == "__main__":
    sys.exit(common.run_main("benchmark_latency", main))
