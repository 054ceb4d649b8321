#!/usr/bin/env python
"""Quality of the weight and KV cache formats against float32: logit error, next-token agreement, perplexity.

    python scripts/quant_quality.py                      # the default model, every format
    python scripts/quant_quality.py --model PATH --formats float32,int4

Each format's logits are computed teacher-forced (the whole sequence in one forward, dense causal
attention) on the built-in chat prompts (chat template applied) and on a public-domain paragraph
(``scripts/quant_quality.txt``, the opening of A Tale of Two Cities). Against float32, per format:
the largest logit error relative to the largest float32 logit, the mean absolute logit error,
and how often the argmax (the greedy next token) agrees; per format, the paragraph's perplexity.

Formats: ``float32``; ``bfloat16`` (every weight and the activations); ``int8`` and ``int4``
(weight-only, quantized from the float32 weights, group 32; a tied embedding int8 per row);
``int4-gguf`` (the GGUF file's own blocks, kept as they are); ``w4a8`` and ``w4a8-gguf``, the same
weights with the activations of their products rounded to int8 per run of 32 inputs (the rounding
llama.cpp applies before its 4-bit dot products); ``w8a8``, int8 weights per output channel with
the activations of every layer product rounded to int8 per token (a tied embedding int8 per row,
weight-only); ``kv-fp8_e4m3`` and ``kv-fp8_e5m2``, float32 weights
with every layer's keys and values rounded as an 8-bit float KV cache stores them
(``kv_cache_dtype="fp8"`` / ``"fp8_e5m2"``: unscaled, saturating). From a 4-bit GGUF, "float32" is the file dequantized, so
``int4-gguf`` differs from it only by the order of float32 additions. Prints a JSON object, then
a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

FORMATS = ("float32", "bfloat16", "int8", "int4", "int4-gguf", "w4a8", "w4a8-gguf", "w8a8", "kv-fp8_e4m3",
           "kv-fp8_e5m2")
KV_FORMATS = {"kv-fp8_e4m3": "float8_e4m3fn", "kv-fp8_e5m2": "float8_e5m2"}  # -> the pages' dtype
TEXT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quant_quality.txt")
PAD_TO = 256  # every sequence is padded to this many tokens: one compile per format


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="alias, .gguf file or directory")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, from {FORMATS}")
    parser.add_argument("--output-json", default=None,
                        help="also write the JSON here (default benchmarks/results/quality-float32-<date>-<commit>.json)")
    return parser


def sequences(tokenizer) -> tuple[list[list[int]], list[int]]:
    """(the chat prompts' token ids, the paragraph's token ids)."""
    import importlib.resources

    path = importlib.resources.files("jaxrunner").joinpath("data", "chat_prompts.jsonl")
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    chats = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                     tokenize=False), add_special_tokens=False)["input_ids"]
             for p in prompts]
    with open(TEXT_PATH) as f:
        text = tokenizer(f.read().strip())["input_ids"]
    return [list(map(int, c)) for c in chats], [int(t) for t in text][:PAD_TO]


def format_params(name: str, model):
    import jax
    import jax.numpy as jnp

    from jaxrunner.models import quant
    from jaxrunner.models.loading import quantize

    if name == "float32" or name in KV_FORMATS:
        return model.params
    if name == "bfloat16":
        return jax.tree.map(lambda x: x.astype(jnp.bfloat16), model.params)
    if name in ("int8", "int4", "w4a8", "w8a8"):
        return quant.quantize_params(model.params, name, 32)
    if name in ("int4-gguf", "w4a8-gguf"):
        if model.source.kind != "gguf":
            raise SystemExit(f"{name}: the model is not a GGUF file")
        quantization = name.removesuffix("-gguf")
        replace = quantize._gguf_leaves(model.source.path, model.config, quantization)
        return quant.quantize_params(model.params, quantization, 32, replace)
    raise SystemExit(f"--formats: unknown format {name!r} (valid: {', '.join(FORMATS)})")


def logits_fn(model, int8_activations: bool = False, kv_dtype=None):
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxrunner import kernels
    from jaxrunner.models.decoder import Decoder
    from jaxrunner.models.attention import DenseAttention
    from jaxrunner.kernels.kv_write import to_pool_dtype

    class RoundedKV(DenseAttention):
        """Dense attention over keys and values as a ``kv_dtype`` page pool holds them."""

        def __call__(self, q, k, v, *args, **kwargs):
            k, v = (to_pool_dtype(x, kv_dtype).astype(x.dtype) for x in (k, v))
            return super().__call__(q, k, v, *args, **kwargs)

    cfg = model.config
    matmuls = kernels.capabilities().matmuls  # the products run where the engine would run them
    if int8_activations:  # "w4a8", as runner.startup.choose_matmuls sets it
        matmuls = dataclasses.replace(matmuls, weight_only_activations="int8")

    @jax.jit
    def run(params, ids):
        decoder = Decoder(cfg, matmuls)
        hidden, _ = decoder.forward(params, ids, jnp.arange(ids.shape[0]), [None] * cfg.num_layers,
                                    jnp.zeros(ids.shape[0], jnp.int32),
                                    DenseAttention() if kv_dtype is None else RoundedKV())
        return decoder.compute_logits(params, hidden).astype(jnp.float32)

    def logits(params, ids: list[int]) -> np.ndarray:
        padded = np.zeros(PAD_TO, np.int32)
        padded[:len(ids)] = ids
        return np.asarray(run(params, jnp.asarray(padded)))[:len(ids)]

    return logits


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    z = logits[:-1].astype(np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(np.exp(-np.mean(logp[np.arange(len(ids) - 1), ids[1:]])))


def compare(ref: list[np.ndarray], got: list[np.ndarray]) -> dict:
    r, g = np.concatenate(ref), np.concatenate(got)
    return {"max_rel_logit_error": float(np.max(np.abs(g - r)) / np.max(np.abs(r))),
            "mean_abs_logit_error": float(np.mean(np.abs(g - r))),
            "next_token_agreement": float(np.mean(np.argmax(g, -1) == np.argmax(r, -1))),
            "positions": int(r.shape[0])}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    import jax
    from jaxrunner.models.loading import load_model

    model = load_model(args.model, "float32", progress=False)
    chats, text = sequences(model.tokenizer)
    logits_of = {"float": logits_fn(model), "w4a8": logits_fn(model, int8_activations=True),
                 **{name: logits_fn(model, kv_dtype=dtype) for name, dtype in KV_FORMATS.items()}}
    results, reference = {}, None
    for name in ["float32"] + [f for f in formats if f != "float32"]:
        params = format_params(name, model)
        logits = logits_of["w4a8" if name.startswith("w4a8") else name if name in KV_FORMATS else "float"]
        chat_logits = [logits(params, ids) for ids in chats]
        text_logits = logits(params, text)
        if reference is None:
            reference = (chat_logits, text_logits)
        results[name] = {"weights_mib": sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20,
                         "chat": compare(reference[0], chat_logits), "text": compare([reference[1]], [text_logits]),
                         "perplexity": perplexity(text_logits, text)}
        print(f"{name}: done", file=sys.stderr, flush=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _bench_common as common

    commit = common.git_commit()
    payload = {"model": model.source.path, "chat_prompts": len(chats), "text_tokens": len(text), "formats": results}
    path = args.output_json or os.path.join(common.RESULTS_DIR, common.result_name("quality", "float32", commit=commit)
                                            + ".json")
    common.write_json(path, "quality", payload, commit=commit)  # with the versions and the CPU
    print(json.dumps(payload, indent=1))
    print(table(results))
    return 0


def table(results: dict) -> str:
    rows = ["| format | weights MiB | chat: max rel. logit err. | chat: next-token agreement | "
            "text: max rel. logit err. | text: agreement | perplexity |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        rows.append(f"| {name} | {r['weights_mib']:.0f} | {r['chat']['max_rel_logit_error']:.4f} | "
                    f"{r['chat']['next_token_agreement']:.3f} | {r['text']['max_rel_logit_error']:.4f} | "
                    f"{r['text']['next_token_agreement']:.3f} | {r['perplexity']:.2f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
