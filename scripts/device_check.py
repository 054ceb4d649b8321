#!/usr/bin/env python3
"""One prepared accelerator run: ceilings, kernel correctness, kernel speed, the engine end to end.

Sections, in order; the JSON (``$OUT/device_check.json``) is rewritten after every one, so a run
cut short still leaves what it measured, and a section that fails is recorded and skipped:

* ``ceilings``: HBM copy bandwidth (an elementwise op over a 2 GiB buffer, 20 back-to-back calls,
  one sync) and bf16 matmul TFLOP/s, measured in the same run as everything they scale;
* ``correctness``: the auto-chosen kernel (compiled, not interpreted), forced split-KV and the
  XLA path against the reference on the device: fixed cases (GQA 1..8, pages 8..128, head_dim
  64/128, window, soft cap) and fuzzed ragged batches whose unowned cache slots hold NaN; errors
  judged by ``kernels.tolerance.attention_tolerance`` (dtype and dot precision);
* ``decode``: bf16, 32 query / 8 KV heads, head_dim 128, page 16: 64 x 2048, 8 x 8192 and
  1 x 32768 tokens, as achieved bandwidth / copy bandwidth, timed as many back-to-back calls
  over one sync; a small sweep of ``num_stages``, warps, ``block_k`` and split count;
* ``prefill``: 4 x 2048 causal, as TFLOP/s / matmul ceiling; ``mixed``: 60 decodes and 4
  chunks of 512;
* ``engine``: a SmolLM2-shaped random bfloat16 checkpoint built here from the config and
  tokenizer in ``scripts/device_assets/`` (no hub), start-up with the warm-up self-check, zero
  compiles while serving, throughput of 64 requests against transformers on the same device.

``--smoke`` runs every section on CPU with tiny shapes and the Pallas kernel interpreted, to
prove the script itself end to end (tests/test_device_check.py).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback
import zlib

import numpy as np

from make_random_checkpoint import llama_tensors, write_assets  # scripts/ is this script's folder

REPO = pathlib.Path(__file__).resolve().parents[1]

# name -> (q_lens, kv_lens, make_case kwargs, attention kwargs)
CHECK_CASES = {
    "decode_p8_gqa4": ([1] * 7, [1, 7, 8, 9, 16, 17, 33],
                       dict(page_size=8, num_q_heads=8, num_kv_heads=2, head_dim=64), {}),
    "prefill_gqa3": ([9, 16, 3], [9, 16, 3],
                     dict(page_size=8, num_q_heads=6, num_kv_heads=2, head_dim=64), {}),
    "chunked_mha": ([5, 12, 1, 7], [21, 12, 40, 8],
                    dict(page_size=8, num_q_heads=4, num_kv_heads=4, head_dim=64), {}),
    "mixed_padded_d128": ([1, 1, 6, 1, 10], [17, 3, 30, 64, 10],
                          dict(page_size=16, num_q_heads=12, num_kv_heads=4, head_dim=128,
                               num_tokens=32, max_seqs=8, width=6), {}),
    "bf16_gqa8_d128": ([1, 4, 1, 9], [40, 20, 8, 9],
                       dict(num_q_heads=8, num_kv_heads=1, head_dim=128, page_size=16,
                            num_tokens=16, max_seqs=6, dtype="bfloat16"), {}),
    "window": ([1, 7, 1, 3], [30, 19, 5, 24],
               dict(num_q_heads=6, num_kv_heads=3, head_dim=64, page_size=8, num_tokens=16,
                    max_seqs=5, scale=3.0), dict(sliding_window=5)),
    "softcap": ([1, 7, 1, 3], [30, 19, 5, 24],
                dict(num_q_heads=6, num_kv_heads=3, head_dim=64, page_size=8, num_tokens=16,
                     max_seqs=5, scale=3.0), dict(soft_cap=2.0)),
    "page128_bf16": ([1, 100, 1], [300, 100, 129],
                     dict(num_q_heads=16, num_kv_heads=2, head_dim=128, page_size=128,
                          num_tokens=128, max_seqs=4, dtype="bfloat16"),
                     dict(sliding_window=64, soft_cap=30.0)),
    "decode_64x512_bf16": ([1] * 64, list(np.random.default_rng(7).integers(1, 513, 64)),
                           dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                dtype="bfloat16"), {}),
    "decode_1x4096_f32_split": ([1], [4096], dict(num_q_heads=32, num_kv_heads=8, head_dim=128,
                                                  page_size=16), {}),
}
SMOKE_CASES = ["mixed_padded_d128", "bf16_gqa8_d128"]

# name -> (num_seqs, kv_len)
DECODE_SHAPES = {"decode_64x2048": (64, 2048), "decode_8x8192": (8, 8192),
                 "decode_1x32768": (1, 32768)}
SMOKE_DECODE_SHAPES = {"decode_4x64": (4, 64), "decode_1x256": (1, 256)}
HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16")
SMOKE_HEADS = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype="bfloat16")


def ensure_importable() -> None:
    """Import ``jaxrunner`` (and ``kernels/`` as ``jaxrunner.kernels``) from THIS checkout, whether
    or not a package is installed: the device machine gets the working tree, and an installed
    copy elsewhere would be measured instead of it."""
    sys.path.insert(0, str(REPO))
    import jaxrunner

    jaxrunner.__path__.append(str(REPO))  # kernels/ is installed as jaxrunner.kernels
    import jaxrunner.kernels

    for module in (jaxrunner, jaxrunner.kernels):
        if not pathlib.Path(module.__file__).resolve().is_relative_to(REPO):
            raise ImportError(f"{module.__name__} comes from {module.__file__}, not from {REPO}")


# ------------------------------------------------------------------------------------------
# report and timing
# ------------------------------------------------------------------------------------------

class Report(dict):
    """The results so far; ``save`` rewrites the JSON file."""

    def __init__(self, path: pathlib.Path, **fields):
        super().__init__(**fields)
        self.path = path

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self, indent=1, default=str))
        tmp.replace(self.path)


def time_calls(fn, args, *, target_s: float, max_calls: int = 500) -> dict:
    """Seconds per call of ``fn(*args)``, from back-to-back calls over ONE sync (the steady state
    a serving loop sees: launch overhead overlaps the previous call), after a synced warm-up."""
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = max(time.perf_counter() - start, 1e-6)
    calls = int(min(max_calls, max(3, target_s / once)))
    start = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    per_call = (time.perf_counter() - start) / calls
    return dict(s_per_call=per_call, calls=calls, first_synced_s=once)


def logged(name, rec):
    shown = {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in rec.items()
             if k not in ("traceback", "case", "impl", "shape", "options", "q_lens", "kv_lens")}
    print(f"  {name}: {shown}", flush=True)
    return rec


def guarded(fn):
    """Run one measurement; an exception becomes a record instead of ending the section."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - device time is scarce: record and go on
        return dict(ok=False, error=f"{type(e).__name__}: {e}"[:2000],
                    traceback=traceback.format_exc()[-3000:])


# ------------------------------------------------------------------------------------------
# sections
# ------------------------------------------------------------------------------------------

def ceilings(args, report):
    import jax
    import jax.numpy as jnp

    n = (args.copy_bytes // 4)
    x = jnp.zeros((n,), jnp.float32)
    t = time_calls(jax.jit(lambda a: a + 1.0), (x,), target_s=0, max_calls=args.copy_calls)
    del x
    copy_gbps = 2 * n * 4 / t["s_per_call"] / 1e9
    m = args.matmul_n
    a = jax.random.normal(jax.random.key(0), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    t2 = time_calls(jax.jit(lambda a, b: a @ b), (a, b), target_s=0, max_calls=args.copy_calls)
    tflops = 2 * m ** 3 / t2["s_per_call"] / 1e12
    return logged("ceilings", dict(copy_gbps=copy_gbps, copy_bytes=2 * n * 4, copy_calls=t["calls"],
                matmul_bf16_tflops=tflops, matmul_n=m, matmul_calls=t2["calls"]))


def _attention(impl, sm_scale, args, **options):
    """A jitted attention call: ``impl`` through the public entry point, or ``pallas`` /
    ``xla`` with explicit tuning options."""
    import jax

    from jaxrunner import kernels

    if impl == "pallas":
        from jaxrunner.kernels.pallas_kernel import ragged_paged_attention_pallas

        if args.smoke:
            options.setdefault("interpret", True)
        return jax.jit(functools.partial(ragged_paged_attention_pallas, sm_scale=sm_scale, **options))
    if impl == "xla" and options:
        from jaxrunner.kernels.xla import ragged_paged_attention_xla

        return jax.jit(functools.partial(ragged_paged_attention_xla, sm_scale=sm_scale, **options))
    return jax.jit(functools.partial(kernels.ragged_paged_attention, sm_scale=sm_scale, impl=impl,
                                     **options))


def _compare(impl, case, attn, args, **options) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxrunner.kernels.tolerance import attention_tolerance, dot_format

    dev = [jax.device_put(a) for a in case.args()]
    sm = case.q.shape[-1] ** -0.5
    got = _attention(impl, sm, args, **options, **attn)(*dev)
    want = _attention("reference", sm, args, **attn)(*dev)
    n = case.num_live_tokens
    got = np.asarray(got.astype(jnp.float32))
    err = float(np.max(np.abs(got[:n] - np.asarray(want.astype(jnp.float32))[:n]), initial=0.0))
    v_max = float(np.nanmax(np.abs(np.asarray(case.v_pages, np.float32))))
    dtype = case.q.dtype
    tol = attention_tolerance("pallas" if impl == "pallas" else impl, dtype, max_abs_v=v_max,
                              max_kv_len=max(case.live_kv_lens))
    finite = bool(np.isfinite(got).all())
    return dict(dtype=str(dtype), dot_format=dot_format(impl, dtype), max_abs_err=err,
                tolerance=tol, all_finite=finite, ok=finite and err <= tol)


def fuzz_case(rng, smoke: bool):
    """A random ragged batch: decodes and chunks, GQA 1..8, pages 8..64, poisoned slots."""
    from jaxrunner.kernels.testing import make_case

    n = int(rng.integers(1, 5 if smoke else 12))
    page = int(rng.choice([8, 16, 32, 64]))
    kv_lens = rng.integers(1, (200 if smoke else 3000), n)
    q_lens = [int(rng.integers(1, min(k, 64) + 1)) if rng.random() < 0.3 else 1 for k in kv_lens]
    group = int(rng.choice([1, 2, 4, 8]))
    kv_heads = int(rng.choice([1, 2, 4]))
    attn = {}
    if rng.random() < 0.3:
        attn["sliding_window"] = int(rng.integers(1, 256))
    if rng.random() < 0.3:
        attn["soft_cap"] = float(rng.uniform(5, 50))
    case = make_case(rng, q_lens, kv_lens, num_q_heads=group * kv_heads, num_kv_heads=kv_heads,
                     head_dim=int(rng.choice([64, 128])), page_size=page,
                     num_tokens=sum(q_lens) + int(rng.integers(0, 8)), max_seqs=n + 2,
                     dtype=str(rng.choice(["float32", "bfloat16"])))
    return case, attn


def correctness(args, report):
    from jaxrunner.kernels.testing import make_case

    impls = [("pallas", {}), ("pallas", dict(num_splits=4)), ("xla", {})]
    records = []
    for name in (SMOKE_CASES if args.smoke else list(CHECK_CASES)):
        q_lens, kv_lens, kw, attn = CHECK_CASES[name]
        case = make_case(np.random.default_rng(zlib.crc32(name.encode())), q_lens, kv_lens, **kw)
        for impl, options in impls:
            rec = guarded(lambda: _compare(impl, case, attn, args, **options))
            records.append(logged(f"{name} {impl} {options}", dict(case=name, impl=impl,
                                                                   options=options, **rec)))
    rng = np.random.default_rng(2026)
    for i in range(args.fuzz):
        case, attn = fuzz_case(rng, args.smoke)
        for impl, options in impls[:2]:
            rec = guarded(lambda: _compare(impl, case, attn, args, **options))
            records.append(logged(f"fuzz{i} {impl} {options}", dict(
                case=f"fuzz{i}", impl=impl, options=options, attn=attn,
                q_lens=case.q_lens, kv_lens=case.live_kv_lens, **rec)))
    return dict(ok=all(r.get("ok") for r in records), records=records)


def _bandwidth_record(case, timing, copy_gbps):
    item = np.dtype(case.k_pages.dtype).itemsize
    hkv, d = case.k_pages.shape[2], case.k_pages.shape[3]
    nbytes = 2 * sum(case.live_kv_lens) * hkv * d * item + 2 * case.num_live_tokens * case.q.shape[1] * d * item
    gbps = nbytes / timing["s_per_call"] / 1e9
    return dict(ms=timing["s_per_call"] * 1e3, calls=timing["calls"], bytes=nbytes, gbps=gbps,
                frac_of_copy=gbps / copy_gbps if copy_gbps else None)


def _timed(impl, case, args, copy_gbps, **options):
    import jax

    dev = [jax.device_put(a) for a in case.args()]
    fn = _attention(impl, case.q.shape[-1] ** -0.5, args, **options)
    return _bandwidth_record(case, time_calls(fn, dev, target_s=args.target_s), copy_gbps)


def decode(args, report):
    from jaxrunner.kernels.testing import make_case

    copy_gbps = report.get("ceilings", {}).get("copy_gbps")
    heads = SMOKE_HEADS if args.smoke else HEADS
    shapes = SMOKE_DECODE_SHAPES if args.smoke else DECODE_SHAPES
    out = dict(heads=heads, records=[])
    for name, (seqs, kv) in shapes.items():
        case = make_case(np.random.default_rng(seqs), [1] * seqs, [kv] * seqs, poison=False, **heads)
        for impl, options in [("pallas", {}), ("xla", {})]:
            rec = guarded(lambda: _timed(impl, case, args, copy_gbps, **options))
            out["records"].append(logged(f"{name} {impl}", dict(shape=name, impl=impl, **rec)))
        for options in _sweep(name, args):
            if time.time() - args.t0 > args.sweep_until * args.budget_s:
                out["records"].append(dict(shape=name, options=options, skipped="time budget"))
                continue
            rec = guarded(lambda: _timed("pallas", case, args, copy_gbps, **options))
            out["records"].append(logged(f"{name} sweep {options}", dict(
                shape=name, impl="pallas", options=options, **rec)))
    return out


def _sweep(shape, args):
    """Tuning points around the defaults (block_k 64, num_stages 3, 4 warps for decode)."""
    if args.smoke:
        return [dict(num_splits=2)] if shape == "decode_1x256" else [dict(block_k=32)]
    if shape == "decode_64x2048":
        return ([dict(num_stages=s, num_warps=w) for s in (2, 3, 4) for w in (4, 8)]
                + [dict(block_k=32), dict(block_k=128), dict(masked_loads=False)])
    if shape == "decode_1x32768":
        return [dict(num_splits=s) for s in (1, 8, 16, 64)] + [dict(block_k=128)]
    return [dict(num_splits=1), dict(num_splits=16)]


def prefill(args, report):
    import jax

    from jaxrunner.kernels.testing import make_case

    tflops_ceiling = report.get("ceilings", {}).get("matmul_bf16_tflops")
    heads = SMOKE_HEADS if args.smoke else HEADS
    seqs, length = (2, 64) if args.smoke else (4, 2048)
    case = make_case(np.random.default_rng(5), [length] * seqs, [length] * seqs, poison=False, **heads)
    flops = seqs * 2 * 2 * heads["num_q_heads"] * heads["head_dim"] * (length * (length + 1) // 2)
    out = dict(num_seqs=seqs, length=length, causal_flops=flops, records=[])
    for impl, options in [("pallas", {}), ("xla", {}), ("pallas", dict(num_warps=4))]:
        def run():
            dev = [jax.device_put(a) for a in case.args()]
            fn = _attention(impl, heads["head_dim"] ** -0.5, args, **options)
            t = time_calls(fn, dev, target_s=args.target_s)
            tflops = flops / t["s_per_call"] / 1e12
            return dict(ms=t["s_per_call"] * 1e3, calls=t["calls"], tflops=tflops,
                        frac_of_matmul=tflops / tflops_ceiling if tflops_ceiling else None)
        out["records"].append(logged(f"prefill {impl} {options}", dict(impl=impl, options=options,
                                                                       **guarded(run))))
    return out


def mixed(args, report):
    from jaxrunner.kernels.testing import make_case

    copy_gbps = report.get("ceilings", {}).get("copy_gbps")
    heads = SMOKE_HEADS if args.smoke else HEADS
    decodes, chunks, chunk, kv = (6, 2, 32, 128) if args.smoke else (60, 4, 512, 2048)
    rng = np.random.default_rng(6)
    q_lens = [1] * decodes + [chunk] * chunks
    kv_lens = list(rng.integers(kv // 4, kv + 1, decodes)) + [kv] * chunks
    case = make_case(rng, q_lens, kv_lens, poison=False, **heads)
    out = dict(decodes=decodes, chunks=chunks, chunk=chunk, records=[])
    for impl in ("pallas", "xla"):
        rec = guarded(lambda: _timed(impl, case, args, copy_gbps))
        out["records"].append(logged(f"mixed {impl}", dict(impl=impl, **rec)))
    return out


# ------------------------------------------------------------------------------------------
# engine end to end
# ------------------------------------------------------------------------------------------

SMOKE_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def build_checkpoint(directory: pathlib.Path, smoke: bool, seed: int = 0) -> dict:
    """A random-weight SmolLM2-shaped checkpoint (HF llama layout, float32 safetensors) with the
    committed config and tokenizer: nothing downloaded. Weights ~ N(0, 0.02), norms 1 (HF's init)."""
    from safetensors.numpy import save_file

    config = write_assets(directory, SMOKE_CONFIG if smoke else {})
    rng = np.random.default_rng(seed)
    tensors = llama_tensors(config, lambda *shape: rng.standard_normal(shape, dtype=np.float32) * 0.02,
                            lambda n: np.ones(n, np.float32))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return config


@contextlib.contextmanager
def count_compilations():
    """XLA compiles (and persistent-cache lookups) seen through jax.monitoring."""
    import jax

    events: list[str] = []

    def on_duration(event: str, duration: float, **kwargs) -> None:
        if event.startswith("/jax/core/compile"):
            events.append(event)

    def on_event(event: str, **kwargs) -> None:
        if event.startswith("/jax/compilation_cache"):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)


def _prompts(tokenizer, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, tokenizer.vocab_size - 100, length).tolist() for _ in range(count)]


def engine(args, report):
    import jax

    from jaxrunner import LLM, SamplingParams

    count, prompt_len, new_tokens = (8, 16, 8) if args.smoke else (64, 128, 128)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = pathlib.Path(tmp) / "smollm2-shaped"
        start = time.perf_counter()
        build_checkpoint(ckpt, args.smoke)
        out = dict(checkpoint_build_s=time.perf_counter() - start, requests=count,
                   prompt_len=prompt_len, new_tokens=new_tokens)
        start = time.perf_counter()
        # few buckets (tokens 64..1024, or 16..64 in smoke mode): start-up compiles stay short.
        # Smoke mode serves through the (interpreted) Pallas kernel too, not CPU's native one.
        llm = LLM(str(ckpt), dtype="bfloat16", max_num_seqs=count,
                  max_num_batched_tokens=64 if args.smoke else 1024,
                  min_token_bucket=16 if args.smoke else 64, max_num_prefill_seqs=4,
                  max_model_len=prompt_len + new_tokens + 16, progress=False, compilation_cache_dir=None,
                  attention_impl="pallas" if args.smoke else "auto")
        out["startup_s"] = time.perf_counter() - start
        rep = llm.startup_report
        out.update({k: rep.get(k) for k in ("attention_impl", "attention_self_check_max_abs_error",
                                               "compile_s_total", "warmup_s", "kv_cache_dtype",
                                               "bucket_plan")})
        print(f"  engine up in {out['startup_s']:.1f} s, attention {out['attention_impl']}", flush=True)
        prompts = [{"prompt_token_ids": p} for p in _prompts(llm.get_tokenizer(), count, prompt_len)]
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        llm.generate(prompts[:2], params, use_tqdm=False)                 # first dispatches
        with count_compilations() as compiles:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        out.update(serving_compiles=len(compiles), serving_s=wall, generated_tokens=generated,
                   tokens_per_s=generated / wall, backend=jax.default_backend())
        logged("jaxrunner", {k: out[k] for k in ("serving_compiles", "serving_s", "tokens_per_s")})
        llm.engine_loop.close()  # no engine thread left running beside torch's, nor at exit
        del llm
        out["transformers"] = guarded(lambda: transformers_baseline(ckpt, prompts, new_tokens))
        logged("transformers", out["transformers"])
        hf = out["transformers"].get("tokens_per_s")
        out["speedup_vs_transformers"] = out["tokens_per_s"] / hf if hf else None
        out["ok"] = out["serving_compiles"] == 0 and generated == count * new_tokens
    return out


def transformers_baseline(ckpt, prompts, new_tokens) -> dict:
    """transformers' ``generate`` on the same weights and device (greedy, one padded batch)."""
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), **{dtype_kw: torch.bfloat16})
    model = model.to(device)
    ids = torch.tensor([p["prompt_token_ids"] for p in prompts], device=device)
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=2)
    model.generate(ids[:2, :8], attention_mask=mask[:2, :8], max_new_tokens=2, do_sample=False,
                   pad_token_id=2)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, **kw)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    generated = int((out.shape[1] - ids.shape[1]) * ids.shape[0])
    return dict(device=device, torch=torch.__version__, transformers=transformers.__version__,
                serving_s=wall, generated_tokens=generated, tokens_per_s=generated / wall)


# ------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------

SECTIONS = {"ceilings": ceilings, "correctness": correctness, "decode": decode,
            "prefill": prefill, "mixed": mixed, "engine": engine}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="CPU: tiny shapes, Pallas interpreted, tiny engine (checks the script)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--target-s", type=float, default=0.3, help="seconds of back-to-back calls per timing")
    p.add_argument("--fuzz", type=int, default=6, help="fuzzed ragged batches in the correctness section")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="the run's time budget: sweep points past --sweep-until of it are skipped")
    p.add_argument("--sweep-until", type=float, default=0.6)
    p.add_argument("--copy-bytes", type=int, default=2 << 30)
    p.add_argument("--copy-calls", type=int, default=20)
    p.add_argument("--matmul-n", type=int, default=8192)
    args = p.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"--sections: unknown {sorted(unknown)}; valid: {list(SECTIONS)}")
    if args.smoke:
        args.copy_bytes, args.copy_calls, args.matmul_n = 16 << 20, 3, 256
        args.target_s, args.fuzz = 0.0, min(args.fuzz, 1)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    ensure_importable()
    import jax

    from jaxrunner import kernels

    t0 = args.t0 = time.time()
    report = Report(pathlib.Path(args.out) / "device_check.json",
                    jax_version=jax.__version__, backend=jax.default_backend(),
                    device=str(jax.devices()[0].device_kind), python=sys.version.split()[0],
                    impl_auto=kernels.choose_impl("auto", head_dim=128), smoke=args.smoke,
                    args=vars(args))
    report.save()
    print(f"device_check: jax {jax.__version__} on {report['device']} "
          f"(auto impl for head_dim 128: {report['impl_auto']})", flush=True)
    for name in args.sections.split(","):
        start = time.time()
        print(f"[{name}]", flush=True)
        try:
            report[name] = SECTIONS[name](args, report)
        except Exception:  # noqa: BLE001 - one section failing must not cost the others
            report[name] = dict(ok=False, error=traceback.format_exc()[-3000:])
            print(report[name]["error"], flush=True)
        report[name]["wall_s"] = time.time() - start
        report["wall_s"] = time.time() - t0
        report.save()
    print(f"wrote {report.path} ({report['wall_s']:.0f} s)")
    failed = [n for n in args.sections.split(",") if report[n].get("ok") is False]
    if failed:
        print(f"FAILED sections: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
