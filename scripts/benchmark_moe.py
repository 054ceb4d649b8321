#!/usr/bin/env python
"""Mixture-of-experts throughput: a random-weight Mixtral served by jaxrunner and by transformers.

    python scripts/benchmark_moe.py                       # hidden 512, 8 experts top-2, 4 layers
    python scripts/benchmark_moe.py --family qwen3_moe --experts 16 --top-k 4

Builds the checkpoint with transformers (random weights, a word-level tokenizer; nothing is
downloaded), then runs ``benchmark_throughput``'s workload on it: N greedy requests, EOS ignored,
jaxrunner's continuous batching against transformers' static batches in their own process. Also
records the start-up report's expert load on the largest warm-up bucket, random against zero
dummy inputs. Writes JSON (``moe-<dtype>-<date>-<commit>.json``) and a PNG; prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import _bench_common as common  # noqa: E402
import benchmark_throughput as throughput  # noqa: E402

KIND = "moe"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="mixtral", choices=["mixtral", "qwen3_moe"])
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--expert-size", type=int, default=1024, help="each expert's intermediate size (default 1024)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default 8192)")
    parser.add_argument("--num-requests", type=int, default=16, help="requests to serve (default 16)")
    parser.add_argument("--input-len", default="32..128", help="prompt lengths LO..HI (default 32..128)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per request (default 64)")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="transformers' static batch (default 16)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    common.add_hf_args(parser)
    common.add_output_args(parser, KIND)
    return parser


def hf_config(args):
    import transformers

    common_fields = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         num_experts_per_tok=args.top_k, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if args.family == "mixtral":
        return transformers.MixtralConfig(**common_fields, intermediate_size=args.expert_size,
                                          num_local_experts=args.experts)
    return transformers.Qwen3MoeConfig(**common_fields, intermediate_size=4 * args.hidden, head_dim=args.hidden // 8,
                                       moe_intermediate_size=args.expert_size, num_experts=args.experts,
                                       norm_topk_prob=True)


def build_checkpoint(args, directory: str) -> dict:
    """Random weights (std 0.05, router 0.5, norms 1) and a word-level tokenizer; returns the config."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(args.seed)
    config = hf_config(args)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.5 if name.endswith("gate.weight") else 0.05)
    model.save_pretrained(directory, safe_serialization=True)
    words = {f"w{i}": i for i in range(args.vocab)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="w1", eos_token="w2",
                                         pad_token="w0").save_pretrained(directory)
    return {k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool))}


def make_requests(args) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    lo, hi = common.parse_range(args.input_len, "--input-len")
    lengths = rng.integers(lo, hi + 1, args.num_requests)
    return [{"prompt_token_ids": rng.integers(3, args.vocab, n).tolist(), "output_len": args.output_len}
            for n in lengths]


def engine_options(args, requests) -> dict:
    longest = max(len(r["prompt_token_ids"]) for r in requests) + args.output_len
    return dict(dtype=args.dtype, max_num_seqs=min(args.num_requests, 64), max_num_batched_tokens=256,
                min_token_bucket=16, max_model_len=common.round_up(longest, 16), page_size=16, seed=args.seed,
                progress=False)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.hf_worker:
        return common.hf_worker_main(args.hf_worker, throughput._hf_work)
    if not 0 < args.top_k <= args.experts:
        raise common.BenchError(f"--top-k: must be in [1, --experts={args.experts}], got {args.top_k}")
    requests = make_requests(args)
    with tempfile.TemporaryDirectory(prefix="jaxrunner-moe-") as directory:
        model_config = build_checkpoint(args, directory)
        options = engine_options(args, requests)
        llm, startup_s = common.start_llm(directory, options)
        results = {"jaxrunner": throughput.run_jaxrunner(llm, requests, use_tqdm=False)}
        startup = dict(common.startup_summary(llm), total_s=startup_s)
        expert_load = llm.startup_report["expert_load"]
        del llm
        hf_results, hf_info = throughput.hf_baseline(directory, requests, [args.hf_batch_size], False, args.hf_threads)
        results.update(hf_results)
    config = {"family": args.family, "model": model_config, "num_requests": args.num_requests,
              "input_len": args.input_len, "output_len": args.output_len, "seed": args.seed, "engine": options}
    payload = {"config": config, "startup": startup, "expert_load": expert_load, "transformers": hf_info,
               "results": results, "ratio": throughput.ratios(results)}
    title = (f"{args.family} {args.layers}x{args.hidden}, {args.experts} experts top-{args.top_k}: "
             f"{args.num_requests} requests")
    common.write_results(args, KIND, payload, throughput.plot, results, title)
    print(json.dumps({"results": results, "expert_load": expert_load}, default=str))
    common.print_table(throughput.TABLE_HEADERS, throughput.table_rows(results), title)
    common.print_table(["warm-up inputs", "tokens", "max/mean", "cv", "every row max/mean", "expert blocks", "step s"],
                       [[name, load["tokens"], load["max_over_mean"], load["cv"], load["rows_max_over_mean"],
                         load["expert_blocks"], load["step_s"]] for name, load in
                        ((n, expert_load[n]) for n in ("random", "zeros"))],
                       f"expert load on bucket {expert_load['bucket']} (peak activation bytes "
                       f"{expert_load['peak_activation_bytes']} for both: one executable)")
    return 0


if __name__ == "__main__":
    sys.exit(common.run_main("benchmark_moe", main))
