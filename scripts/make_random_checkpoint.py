#!/usr/bin/env python3
"""Write a random-weight Llama checkpoint of a realistic size (HF layout, bf16 safetensors) with
SmolLM2's tokenizer, for speed benchmarks: speed does not depend on the values, and nothing is
downloaded.

    python scripts/make_random_checkpoint.py llama-1b ~/models/random-llama-1b
    python scripts/benchmark_throughput.py --model ~/models/random-llama-1b --dtype bfloat16 \\
        --compare vllm --vllm-python ~/vllm-cpu/bin/python

Weights ~ N(0, 0.02) and norms 1, as HF initializes them. Needs torch (a benchmark dependency).
"""
from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import shutil
import sys

ASSETS = pathlib.Path(__file__).resolve().parent / "device_assets"  # SmolLM2's config and tokenizer
SHAPES = {
    "smollm2": {},  # the committed config as it is: SmolLM2-135M
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64),
    "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                     num_key_value_heads=8, head_dim=128),
}


def write_assets(directory: pathlib.Path, overrides: dict) -> dict:
    """The committed config with ``overrides``, the tokenizer and the chat template, written into
    ``directory``; returns the config."""
    config = {**json.loads((ASSETS / "config.json").read_text()), **overrides}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ASSETS / name, directory / name)
    with gzip.open(ASSETS / "tokenizer.json.gz", "rb") as src, open(directory / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    return config


def llama_tensors(config: dict, normal, ones) -> dict:
    """HF Llama parameter names -> tensors: ``normal(*shape)`` for the weights, ``ones(n)`` for the
    norms (the caller's array library and dtype)."""
    h, inter, v, dh = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["head_dim"]
    nq, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = {"model.embed_tokens.weight": normal(v, h), "model.norm.weight": ones(h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": normal(nq * dh, h), p + "self_attn.k_proj.weight": normal(nkv * dh, h),
            p + "self_attn.v_proj.weight": normal(nkv * dh, h), p + "self_attn.o_proj.weight": normal(h, nq * dh),
            p + "mlp.gate_proj.weight": normal(inter, h), p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter)})
    return tensors


def write_checkpoint(shape: str, directory: pathlib.Path, seed: int = 0) -> dict:
    """A bf16 checkpoint of ``shape`` (torch writes bf16; weights ~ N(0, 0.02), norms 1)."""
    import torch
    from safetensors.torch import save_file

    config = write_assets(directory, SHAPES[shape])
    generator = torch.Generator().manual_seed(seed)
    tensors = llama_tensors(config, lambda *shape: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16),
                            lambda n: torch.ones(n, dtype=torch.bfloat16))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("directory", type=pathlib.Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = write_checkpoint(args.shape, args.directory, args.seed)
    params = sum(p.stat().st_size for p in args.directory.glob("*.safetensors")) // 2
    print(json.dumps({"directory": str(args.directory), "shape": args.shape, "parameters": params,
                      "hidden_size": config["hidden_size"], "layers": config["num_hidden_layers"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
