#!/usr/bin/env python3
"""One prepared accelerator run: ceilings, shared memory, kernel correctness, kernel speed, the
engine end to end.

Each section runs in a process of its own under a time budget (``SECTION_BUDGET_S``): a hang
costs its section only, and a sticky CUDA error cannot break the sections after it. The driver
never touches the device itself; it merges every section's records into
``$OUT/device_check.json`` as soon as the section ends (a section writes its part after every
record, so one cut short by its budget still keeps what it measured).

* ``ceilings``: HBM copy bandwidth (an elementwise op over a 2 GiB buffer, back-to-back calls,
  one sync) and bf16 matmul TFLOP/s, measured in the same run as everything they scale;
* ``smem``: the Triton kernel compiled alone for head_dim 64/128/256, bf16 and float32, decode
  and prefill tiles, both as the shared-memory budget chooses its tiles and with the unbudgeted
  defaults: compile success against ``pallas_kernel.shared_memory_estimate``, the bytes Triton
  asks for when it refuses, and, for any PTX XLA dumps, registers and spills from ``ptxas``. To
  ``$OUT/kernel_ir.tar.gz`` go each kernel's Triton IR as MLIR text (``triton_ir/``, taken from
  the lowering: ``kernels.testing.triton_modules``, checked on CPU too), its StableHLO and
  optimized HLO, and what the XLA flags of ``_child_env`` make XLA dump. On the H200 (jax
  0.11.2) XLA dumped no PTX with ``--xla_dump_to`` alone: its sources show Pallas kernels
  compiled one by one outside the module's PTX dump. ``--xla_dump_emitter_re=triton-to-llvm``
  (XLA's log of the Triton pipeline's IR, pass by pass) and ``--xla_gpu_dump_llvmir`` are set
  for the next run; whether they yield the PTX is unverified until a device runs them;
* ``correctness``: the auto-chosen kernel (compiled, not interpreted), forced split-KV and the
  XLA path against the reference on the device: fixed cases (GQA 1..8, pages 8..128, head_dim
  64/128, window, soft cap) and fuzzed ragged batches whose unowned cache slots hold NaN; errors
  judged by ``kernels.tolerance.attention_tolerance`` from each case's largest score. Every
  distinct program compiles once, ahead, in a thread pool; the reference runs once per case;
* ``decode``: bf16, 32 query / 8 KV heads, head_dim 128, page 16: 64 x 2048, 8 x 8192 and
  1 x 32768 tokens, as achieved bandwidth / copy bandwidth, for the whole call and for the
  Triton kernel alone on prepared inputs (the wrapper's share is the difference), timed as many
  back-to-back calls over one sync; a small sweep of ``num_stages``, warps, ``block_k`` and
  split count;
* ``prefill``: 4 x 2048 causal, as TFLOP/s / matmul ceiling; ``mixed``: 60 decodes and 4
  chunks of 512;
* ``engine``: a SmolLM2-shaped random bfloat16 checkpoint built here from the config and
  tokenizer in ``scripts/device_assets/`` (no hub), start-up with the warm-up self-check, zero
  compiles while serving, throughput of 64 requests against transformers on the same device.

Budgets, 295 s in all (at most 5 minutes on one H200), from the section wall times of the last
two H200 runs (``benchmarks/device/nvidia-h200-2026-12-04-*.json``, ``wall_s``):

* unchanged sections, the larger measured time plus about 20%: ``decode`` 37-40 s -> 48,
  ``prefill`` 10-22 s -> 27, ``mixed`` 10 s -> 15, ``ceilings`` 6-7 s -> 10 (its process start
  and JAX import are most of it);
* ``smem`` measured 42-53 s, nearly all of it ~27 kernel compiles one after another (the
  records' ``compile_s``: 0.4-7.5 s each, ~50 s together). They now compile in a thread pool,
  one thread per core (16 on the device machine): the section should take its start-up plus
  about its longest compile (< 20 s); 35 s leaves ~2x headroom for a compile time measured only
  one at a time;
* ``correctness`` measured 60-89 s (cut by its 60 s budget once), mostly ~84 Triton and XLA
  compiles (float32 Triton ones the slowest) one after another. All compile ahead in the pool;
  the cases then run one after another as their programs are ready: a sixth of the compile
  time plus start-up and runs, ~25 s; 60 s leaves ~2x headroom;
* ``engine`` measured 96 s: start-up 72 s, of which warm-up 47 s compiling 20 buckets (tokens
  64..1024 x sequences 1..64). Token buckets 64..256 now hold the 64 x 128/128 workload (a
  decode step of 64 sequences fills the smallest unpadded), so warm-up compiles 12 programs
  and not the largest ones, which should cut start-up by about half; 100 s still covers the
  measured 96 s.

The pooled compiles and the smaller bucket plan are not yet measured on a device: the next H200
run's ``wall_s`` should confirm the budgets or replace them.

``--smoke`` runs every section on CPU with tiny shapes and the Pallas kernel interpreted (the
``smem`` section lowers instead of compiling), to prove the script itself end to end
(tests/test_device_check.py).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tarfile
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


# section -> seconds it may take (derivation in the module docstring), smoke mode scaled by
# SMOKE_BUDGET_SCALE (CPU, Pallas interpreted)
SECTION_BUDGET_S = {"ceilings": 10, "smem": 35, "correctness": 60, "decode": 48, "prefill": 27,
                    "mixed": 15, "engine": 100}
SMOKE_BUDGET_SCALE = 8
SWEEP_SHARE = 0.7  # sweep points that would start past this share of the section's budget are skipped


def ensure_importable() -> None:
    """Import ``jaxrunner`` (and ``kernels/`` as ``jaxrunner.kernels``) from THIS checkout, whether
    or not a package is installed: the device machine gets the working tree, and an installed
    copy elsewhere would be measured instead of it. The checkout's root is never put on
    ``sys.path``: its ``kernels/`` would shadow the PyPI package transformers imports."""
    if "jaxrunner" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "jaxrunner", REPO / "jaxrunner" / "__init__.py",
            submodule_search_locations=[str(REPO / "jaxrunner"), str(REPO)])  # REPO: kernels/
        module = importlib.util.module_from_spec(spec)
        sys.modules["jaxrunner"] = module
        spec.loader.exec_module(module)
    import jaxrunner
    import jaxrunner.kernels

    for module in (jaxrunner, jaxrunner.kernels):
        if not pathlib.Path(module.__file__).resolve().is_relative_to(REPO):
            raise ImportError(f"{module.__name__} comes from {module.__file__}, not from {REPO}")


# ------------------------------------------------------------------------------------------
# results and timing
# ------------------------------------------------------------------------------------------

class JsonFile(dict):
    """Results so far; ``save`` rewrites the JSON file (atomically)."""

    def __init__(self, path: pathlib.Path, **fields):
        super().__init__(**fields)
        self.path = pathlib.Path(path)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self, indent=1, default=str))
        tmp.replace(self.path)

    def add(self, name: str, record: dict) -> dict:
        """Log one record, append it to ``records`` and save: a section killed later keeps it."""
        self.setdefault("records", []).append(logged(name, record))
        self.save()
        return record


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


def past_share(args, share: float = SWEEP_SHARE) -> bool:
    """Whether this section has used ``share`` of its budget (optional work is then skipped)."""
    return time.time() - args.section_t0 > share * args.section_budget_s


def compile_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for compiling ahead of running: XLA's compile releases the GIL, so the machine's
    cores (16 on the device machine) compile that many programs at once."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1,
                                                 thread_name_prefix="compile")


def compile_ahead(pool, calls: dict) -> dict:
    """``calls``: key -> (jitted function, its device arguments). Submits one
    ``lower(...).compile()`` per distinct (function, argument shapes and dtypes) to ``pool`` and
    returns key -> the future of its executable, so the caller can run each call, one after
    another, as soon as its program is ready."""
    futures, programs = {}, {}
    for key, (fn, fn_args) in calls.items():
        program = (fn, tuple((a.shape, str(a.dtype)) for a in fn_args))
        if program not in programs:
            programs[program] = pool.submit(lambda fn=fn, fn_args=fn_args: fn.lower(*fn_args).compile())
        futures[key] = programs[program]
    return futures


# ------------------------------------------------------------------------------------------
# sections
# ------------------------------------------------------------------------------------------

def ceilings(args, report, part):
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
    part.update(logged("ceilings", dict(
        copy_gbps=copy_gbps, copy_bytes=2 * n * 4, copy_calls=t["calls"], matmul_bf16_tflops=tflops,
        matmul_n=m, matmul_calls=t2["calls"])))


# -------------------------------------------------------------------------------- shared memory

SMEM_HEAD_DIMS = (256, 128, 64)  # the largest first: they are the ones a budget cut would lose
# past every default: (head_dim, dtype, tile, block_k, num_stages), to see where Triton refuses
SMEM_STRESS = ((256, "float32", "prefill", 128, 3), (256, "bfloat16", "prefill", 128, 4),
               (128, "float32", "prefill", 128, 4))
SMEM_TILES = {"decode": ([1] * 8, [300] * 8), "prefill": ([128, 128], [128, 300])}  # GQA 4: 16 / 128 rows
UNBUDGETED = 1 << 30  # shared_memory_bytes that lets any tile through: what Triton itself says


def smem(args, report, part):
    """Compile the Triton kernel alone, budgeted and unbudgeted, and compare with the estimate.
    The points compile concurrently (``compile_pool``); each is recorded as it finishes."""
    import jax

    from jaxrunner.kernels import pallas_kernel

    limit = pallas_kernel.shared_memory_limit()
    part.update(limit_bytes=limit, compute_capability=str(getattr(jax.devices()[0], "compute_capability", None)))
    with compile_pool() as pool:
        pending = {pool.submit(guarded, functools.partial(_compile_point, point, limit, args)): point
                   for point in _smem_points(args.smoke)}
        for done in concurrent.futures.as_completed(pending):
            head_dim, dtype, tile, budget, tiles = pending[done]
            part.add(f"d{head_dim} {dtype} {tile} {budget} {tiles or ''}",
                     dict(head_dim=head_dim, dtype=dtype, tile=tile, budget=budget, **done.result()))
    records = [r for r in part["records"] if "budget" in r]
    part["ok"] = all(r.get("compiled", r.get("lowered")) for r in records if r["budget"] == "budgeted")
    part["estimate_agrees"] = all(
        (r["estimate_bytes"] <= limit) == bool(r.get("compiled")) for r in records if "compiled" in r)
    part["ptxas"] = guarded(lambda: _ptxas_stats(args))
    part.save()


def _smem_points(smoke: bool) -> list[tuple]:
    """(head_dim, dtype, tile, budgeted or not, fixed tiles) of every kernel the section compiles."""
    points = [(d, dtype, tile, budget, {}) for d in (SMEM_HEAD_DIMS[-1:] if smoke else SMEM_HEAD_DIMS)
              for dtype in ("float32", "bfloat16") for tile in SMEM_TILES for budget in ("budgeted", "unbudgeted")]
    return points + [(d, dtype, tile, "unbudgeted", dict(block_k=bk, num_stages=st))
                     for d, dtype, tile, bk, st in ([] if smoke else SMEM_STRESS)]


def _compile_point(point, limit, args) -> dict:
    """One ``_smem_points`` point: its case, and the kernel compiled alone for it."""
    from jaxrunner.kernels.testing import make_case

    head_dim, dtype, tile, budget, tiles = point
    q_lens, kv_lens = SMEM_TILES[tile]
    case = make_case(np.random.default_rng(head_dim), q_lens, kv_lens, num_q_heads=8,
                     num_kv_heads=2, head_dim=head_dim, page_size=16, dtype=dtype, poison=False)
    shared = limit if budget == "budgeted" else UNBUDGETED
    ir_name = "_".join([f"d{head_dim}", dtype, tile, budget] + [f"{k}{v}" for k, v in tiles.items()])
    return _compile_kernel(case, shared, limit, args, ir_name, **tiles)


def _compile_kernel(case, shared, limit, args, ir_name: str, **tiles) -> dict:
    """Compile (smoke: lower for cuda) the kernel alone for ``case``; the tiles it got, the
    estimate, the files its Triton IR went to (``_write_triton_ir``), and what Triton said if it
    refused. ``compile_s`` is wall time, with other points compiling beside it."""
    import jax
    import jax.numpy as jnp

    from jaxrunner.kernels import pallas_kernel
    from jaxrunner.kernels.testing import lowering_context

    dev = [jax.device_put(a) for a in case.args()]
    kernel, inputs = pallas_kernel.gpu_kernel_alone(dev, sm_scale=case.q.shape[-1] ** -0.5,
                                                    shared_memory_bytes=shared, interpret=False, **tiles)
    rows, head_dim = inputs[2].shape[2:]
    itemsize = jnp.dtype(case.k_pages.dtype).itemsize
    block_k, stages = pallas_kernel.choose_gpu_tiles(head_dim, itemsize, rows, shared, **tiles)
    rec = dict(rows=rows, block_k=block_k, num_stages=stages, limit_bytes=limit,
               estimate_bytes=pallas_kernel.shared_memory_estimate(head_dim, itemsize, rows, block_k, stages))
    if args.smoke:  # no GPU: lowering is what can be checked
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), inputs)
        with lowering_context("cuda"):
            lowered = kernel.trace(*shapes).lower(lowering_platforms=("cuda",))
        return dict(rec, lowered=True, triton_ir=guarded(lambda: _write_triton_ir(lowered, ir_name, args)))
    lowered = kernel.lower(*inputs)
    rec["triton_ir"] = guarded(lambda: _write_triton_ir(lowered, ir_name, args))
    start = time.perf_counter()
    try:
        lowered.compile()
    except Exception as e:  # noqa: BLE001 - a refusal is the measurement
        text = str(e)
        asked = [int(n) for n in re.findall(r"(?:[Rr]equired|requested|[Rr]equest)[^0-9]{0,20}(\d{4,})", text)]
        return dict(rec, compiled=False, triton_asked_bytes=asked[0] if asked else None,
                    error=text[:600], compile_s=time.perf_counter() - start)
    return dict(rec, compiled=True, compile_s=time.perf_counter() - start)


def _write_triton_ir(lowered, name: str, args) -> list[str]:
    """The Triton IR of the kernels in ``lowered`` (``kernels.testing.triton_modules``) as text
    files under the dump folder, for ``kernel_ir.tar.gz``; their paths there."""
    from jaxrunner.kernels.testing import triton_modules

    folder = pathlib.Path(args.dump_dir) / "triton_ir"
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for i, text in enumerate(triton_modules(lowered)):
        path = folder / f"{name}.{i}.ttir.mlir"
        path.write_text(text)
        written.append(str(path.relative_to(args.dump_dir)))
    return written


def _ptxas_stats(args) -> dict:
    """Registers, spills and static shared memory per dumped kernel (``ptxas -v``), and the
    kernels' Triton IR, StableHLO, optimized HLO, XLA's Triton pass log and any PTX as
    ``$OUT/kernel_ir.tar.gz``."""
    dump = pathlib.Path(args.dump_dir) if args.dump_dir else None
    if dump is None or not dump.is_dir():
        return dict(skipped="no XLA dump")
    files = sorted(p for p in dump.rglob("*") if p.is_file())
    kinds = sorted({re.sub(r"^module_\d+\.", "", f.name) for f in files})
    with tarfile.open(pathlib.Path(args.out) / "kernel_ir.tar.gz", "w:gz") as tar:
        for f in files:
            pass_log = f.name.endswith(TRITON_PASS_LOG)  # the IR before each pass: large, and compresses well
            wanted = (f.suffix in (".ptx", ".ll", ".mlir", ".ttir", ".ttgir") or pass_log
                      or f.name.endswith("after_optimizations.txt"))
            if wanted and f.stat().st_size < (16 << 20 if pass_log else 1 << 20):
                tar.add(f, arcname=f.relative_to(dump))
    ptxas = shutil.which("ptxas") or next((str(p) for p in pathlib.Path("/usr/local").glob("cuda*/bin/ptxas")), None)
    stats = {}
    for f in [f for f in files if f.suffix == ".ptx"][:24]:
        if ptxas is None:
            break
        proc = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(f), "-o", os.devnull],
                              capture_output=True, text=True, timeout=30)
        lines = [ln.split("info    : ")[-1] for ln in (proc.stdout + proc.stderr).splitlines()
                 if "triton" in ln.lower() or "registers" in ln or "spill" in ln or "smem" in ln]
        stats[f.name] = lines[-12:]
    return dict(ptxas=ptxas, files=len(files), file_kinds=kinds[:60], stats=stats)


# ------------------------------------------------------------------------------ correctness

@functools.lru_cache(maxsize=None)
def _attention(impl, sm_scale, smoke, options=(), attn=()):
    """One jitted attention function per (impl, options): jit then compiles once per shape.
    ``impl``: a public implementation name, or ``pallas`` / ``xla`` with explicit tuning options."""
    import jax

    from jaxrunner import kernels

    options, attn = dict(options), dict(attn)
    if impl == "pallas":
        from jaxrunner.kernels.pallas_kernel import ragged_paged_attention_pallas

        if smoke:
            options.setdefault("interpret", True)
        fn = ragged_paged_attention_pallas
    elif impl == "xla" and options:
        from jaxrunner.kernels.xla import ragged_paged_attention_xla as fn
    else:
        fn, options = functools.partial(kernels.ragged_paged_attention, impl=impl), options
    return jax.jit(functools.partial(fn, sm_scale=sm_scale, **options, **attn))


def _frozen(d: dict) -> tuple:
    return tuple(sorted(d.items()))


def _compare(impl, case, attn, got, want) -> dict:
    """``got`` (impl's output for ``case``) against ``want`` (the reference's, float32) over the
    live tokens, judged by ``kernels.tolerance``."""
    import jax.numpy as jnp

    from jaxrunner.kernels.tolerance import attention_tolerance, dot_format

    sm = case.q.shape[-1] ** -0.5
    n = case.num_live_tokens
    got = np.asarray(got.astype(jnp.float32))
    err = float(np.max(np.abs(got[:n] - want[:n]), initial=0.0))
    v_max = float(np.nanmax(np.abs(np.asarray(case.v_pages, np.float32))))
    dtype = case.q.dtype
    score = case.max_abs_score(sm, attn.get("soft_cap"))
    tol = attention_tolerance(impl, dtype, max_abs_v=v_max, max_kv_len=max(case.live_kv_lens),
                              max_abs_score=score)
    finite = bool(np.isfinite(got).all())
    return dict(dtype=str(dtype), dot_format=dot_format(impl, dtype), max_abs_err=err,
                max_abs_score=score, tolerance=tol, all_finite=finite, ok=finite and err <= tol)


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


def correctness(args, report, part):
    """Every case's reference and implementations compile ahead, concurrently (``compile_ahead``);
    the cases then run one after another, each as soon as its programs are ready."""
    import jax
    import jax.numpy as jnp

    cases = _correctness_cases(args)
    calls, inputs = {}, {}
    for name, case, attn, impls in cases:
        inputs[name] = [jax.device_put(a) for a in case.args()]
        sm = case.q.shape[-1] ** -0.5
        for impl, options in [("reference", {})] + impls:
            calls[name, impl, _frozen(options)] = (
                _attention(impl, sm, args.smoke, _frozen(options), _frozen(attn)), inputs[name])
    with compile_pool() as pool:
        programs = compile_ahead(pool, calls)

        def run(name, impl, options=()):
            return programs[name, impl, options].result()(*inputs[name])

        for name, case, attn, impls in cases:
            want = guarded(lambda: np.asarray(run(name, "reference").astype(jnp.float32)))
            for impl, options in impls:
                rec = want if isinstance(want, dict) else guarded(
                    lambda: _compare(impl, case, attn, run(name, impl, _frozen(options)), want))
                part.add(f"{name} {impl} {options}", dict(
                    case=name, impl=impl, options=options, attn=attn, q_lens=case.q_lens,
                    kv_lens=case.live_kv_lens, **rec))
    part["ok"] = all(r.get("ok") for r in part["records"])
    part.save()


def _correctness_cases(args) -> list[tuple]:
    """(name, case, attention options, [(impl, tuning options)]): the fixed cases, then the fuzzed."""
    from jaxrunner.kernels.testing import make_case

    impls = [("pallas", {}), ("pallas", dict(num_splits=4)), ("xla", {})]
    cases = []
    for name in (SMOKE_CASES if args.smoke else list(CHECK_CASES)):
        q_lens, kv_lens, kw, attn = CHECK_CASES[name]
        cases.append((name, make_case(np.random.default_rng(zlib.crc32(name.encode())), q_lens, kv_lens, **kw),
                      attn, impls))
    rng = np.random.default_rng(2026)
    for i in range(args.fuzz):
        case, attn = fuzz_case(rng, args.smoke)
        cases.append((f"fuzz{i}", case, attn, impls[:2]))
    return cases


# ------------------------------------------------------------------------------------ speed

def _bandwidth_record(case, timing, copy_gbps, prefix=""):
    item = np.dtype(case.k_pages.dtype).itemsize
    hkv, d = case.k_pages.shape[2], case.k_pages.shape[3]
    nbytes = 2 * sum(case.live_kv_lens) * hkv * d * item + 2 * case.num_live_tokens * case.q.shape[1] * d * item
    gbps = nbytes / timing["s_per_call"] / 1e9
    rec = {"ms": timing["s_per_call"] * 1e3, "calls": timing["calls"], "gbps": gbps,
           "frac_of_copy": gbps / copy_gbps if copy_gbps else None}
    return {"bytes": nbytes, **{prefix + k: v for k, v in rec.items()}}


def _timed(impl, case, args, copy_gbps, **options):
    """The whole call; for ``pallas`` also the Triton kernel alone on the wrapper's prepared
    inputs (``kernel_ms``), so the wrapper's share is ``ms - kernel_ms``."""
    import jax

    from jaxrunner.kernels.pallas_kernel import gpu_kernel_alone

    dev = [jax.device_put(a) for a in case.args()]
    sm = case.q.shape[-1] ** -0.5
    fn = _attention(impl, sm, args.smoke, _frozen(options))
    rec = _bandwidth_record(case, time_calls(fn, dev, target_s=args.target_s), copy_gbps)
    if impl == "pallas":
        kernel, inputs = gpu_kernel_alone(dev, sm_scale=sm, **options)
        rec.update(_bandwidth_record(case, time_calls(kernel, inputs, target_s=args.target_s),
                                     copy_gbps, prefix="kernel_"))
        rec["wrapper_ms"] = rec["ms"] - rec["kernel_ms"]
    return rec


def decode(args, report, part):
    from jaxrunner.kernels.testing import make_case

    copy_gbps = report.get("ceilings", {}).get("copy_gbps")
    heads = SMOKE_HEADS if args.smoke else HEADS
    shapes = SMOKE_DECODE_SHAPES if args.smoke else DECODE_SHAPES
    part["heads"] = heads
    for name, (seqs, kv) in shapes.items():
        case = make_case(np.random.default_rng(seqs), [1] * seqs, [kv] * seqs, poison=False, **heads)
        for impl, options in [("pallas", {}), ("xla", {})]:
            rec = guarded(lambda: _timed(impl, case, args, copy_gbps, **options))
            part.add(f"{name} {impl}", dict(shape=name, impl=impl, **rec))
        for options in _sweep(name, args):
            if past_share(args):
                part.add(f"{name} sweep {options}", dict(shape=name, options=options, skipped="time budget"))
                continue
            rec = guarded(lambda: _timed("pallas", case, args, copy_gbps, **options))
            part.add(f"{name} sweep {options}", dict(shape=name, impl="pallas", options=options, **rec))


def _sweep(shape, args):
    """Tuning points around the defaults (block_k 64, num_stages 3, 4 warps for decode)."""
    if args.smoke:
        return [dict(num_splits=2)] if shape == "decode_1x256" else [dict(block_k=32)]
    if shape == "decode_64x2048":
        return ([dict(num_stages=s, num_warps=w) for s in (2, 3) for w in (4, 8)]
                + [dict(block_k=32, num_stages=2), dict(block_k=32), dict(block_k=128, num_stages=2)])
    if shape == "decode_1x32768":
        return [dict(num_stages=2)] + [dict(num_splits=s) for s in (16, 64)]
    return [dict(num_stages=2), dict(num_splits=16, num_stages=2)]


def prefill(args, report, part):
    import jax

    from jaxrunner.kernels.pallas_kernel import gpu_kernel_alone
    from jaxrunner.kernels.testing import make_case

    tflops_ceiling = report.get("ceilings", {}).get("matmul_bf16_tflops")
    heads = SMOKE_HEADS if args.smoke else HEADS
    seqs, length = (2, 64) if args.smoke else (4, 2048)
    case = make_case(np.random.default_rng(5), [length] * seqs, [length] * seqs, poison=False, **heads)
    flops = seqs * 2 * 2 * heads["num_q_heads"] * heads["head_dim"] * (length * (length + 1) // 2)
    part.update(num_seqs=seqs, length=length, causal_flops=flops)

    def rate(t):
        tflops = flops / t["s_per_call"] / 1e12
        return t["s_per_call"] * 1e3, tflops, tflops / tflops_ceiling if tflops_ceiling else None

    sweep = [] if args.smoke else [dict(num_warps=4, num_stages=2), dict(num_warps=8, num_stages=2),
                                   dict(num_warps=4, block_k=32), dict(num_warps=4, block_k=128, num_stages=2)]
    for impl, options in [("pallas", {}), ("xla", {}), ("pallas", dict(num_warps=4))] + [("pallas", o) for o in sweep]:
        if past_share(args):
            part.add(f"prefill {impl} {options}", dict(impl=impl, options=options, skipped="time budget"))
            continue

        def run():
            dev = [jax.device_put(a) for a in case.args()]
            sm = heads["head_dim"] ** -0.5
            ms, tflops, frac = rate(time_calls(_attention(impl, sm, args.smoke, _frozen(options)), dev,
                                               target_s=args.target_s))
            rec = dict(ms=ms, tflops=tflops, frac_of_matmul=frac)
            if impl == "pallas":
                kernel, inputs = gpu_kernel_alone(dev, sm_scale=sm, **options)
                kms, ktflops, kfrac = rate(time_calls(kernel, inputs, target_s=args.target_s))
                rec.update(kernel_ms=kms, kernel_tflops=ktflops, kernel_frac_of_matmul=kfrac,
                           wrapper_ms=ms - kms)
            return rec
        part.add(f"prefill {impl} {options}", dict(impl=impl, options=options, **guarded(run)))


def mixed(args, report, part):
    from jaxrunner.kernels.testing import make_case

    copy_gbps = report.get("ceilings", {}).get("copy_gbps")
    heads = SMOKE_HEADS if args.smoke else HEADS
    decodes, chunks, chunk, kv = (6, 2, 32, 128) if args.smoke else (60, 4, 512, 2048)
    rng = np.random.default_rng(6)
    q_lens = [1] * decodes + [chunk] * chunks
    kv_lens = list(rng.integers(kv // 4, kv + 1, decodes)) + [kv] * chunks
    case = make_case(rng, q_lens, kv_lens, poison=False, **heads)
    part.update(decodes=decodes, chunks=chunks, chunk=chunk)
    for impl in ("pallas", "xla"):
        part.add(f"mixed {impl}", dict(impl=impl, **guarded(lambda: _timed(impl, case, args, copy_gbps))))


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


def engine(args, report, part):
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
        # Token buckets 64, 128 and 256 under the sequence buckets 1, 4, 16, 64: start-up
        # compiles 12 programs, not 20, and none of the largest. A decode step of the 64
        # sequences fills the smallest bucket unpadded; chunked prefill spreads the prompts over
        # steps of 256. Smoke mode serves through the (interpreted, slow to compile) Pallas
        # kernel too, not CPU's native one, from one token bucket of 32: 3 programs.
        llm = LLM(str(ckpt), dtype="bfloat16", max_num_seqs=count, max_num_batched_tokens=32 if args.smoke else 256,
                  min_token_bucket=32 if args.smoke else 64, max_num_prefill_seqs=4,
                  max_model_len=prompt_len + new_tokens + 16, progress=False, compilation_cache_dir=None,
                  attention_impl="pallas" if args.smoke else "auto")
        out["startup_s"] = time.perf_counter() - start
        rep = llm.startup_report
        out.update({k: rep.get(k) for k in ("attention_impl", "attention_impl_reason",
                                               "attention_self_check_max_abs_error",
                                               "compile_s_total", "warmup_s", "kv_cache_dtype",
                                               "bucket_plan")})
        print(f"  engine up in {out['startup_s']:.1f} s, attention {out['attention_impl']}", flush=True)
        part.update(out)
        part.save()
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
    part.update(out)
    part.save()


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
# driver: one process per section
# ------------------------------------------------------------------------------------------

SECTIONS = {"ceilings": ceilings, "smem": smem, "correctness": correctness, "decode": decode,
            "prefill": prefill, "mixed": mixed, "engine": engine}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="CPU: tiny shapes, Pallas interpreted, tiny engine (checks the script)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--budget-scale", type=float, default=None,
                   help=f"multiply every section's budget (default 1, --smoke {SMOKE_BUDGET_SCALE})")
    p.add_argument("--target-s", type=float, default=0.3, help="seconds of back-to-back calls per timing")
    p.add_argument("--fuzz", type=int, default=6, help="fuzzed ragged batches in the correctness section")
    p.add_argument("--copy-bytes", type=int, default=2 << 30)
    p.add_argument("--copy-calls", type=int, default=20)
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--section", help=argparse.SUPPRESS)      # set by the driver for its children
    p.add_argument("--part-file", help=argparse.SUPPRESS)
    p.add_argument("--dump-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"--sections: unknown {sorted(unknown)}; valid: {list(SECTIONS)}")
    if args.budget_scale is None:
        args.budget_scale = SMOKE_BUDGET_SCALE if args.smoke else 1.0
    if args.smoke:
        args.copy_bytes, args.copy_calls, args.matmul_n = 16 << 20, 3, 256
        args.target_s, args.fuzz = 0.0, min(args.fuzz, 1)
    return args


def run_section(args) -> int:
    """In a child process: one section, its records written to ``--part-file`` as they come."""
    if args.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    ensure_importable()
    import jax

    from jaxrunner import kernels

    args.section_t0 = time.time()
    args.section_budget_s = SECTION_BUDGET_S[args.section] * args.budget_scale
    report = json.loads((pathlib.Path(args.out) / "device_check.json").read_text())
    device = jax.devices()[0]
    part = JsonFile(args.part_file, backend=jax.default_backend(), device=str(device.device_kind),
                    jax_version=jax.__version__, impl_auto=kernels.choose_impl("auto", head_dim=128))
    part.save()
    SECTIONS[args.section](args, report, part)
    part.save()
    return 0


TRITON_PASS_LOG = "triton-to-llvm.txt"  # XLA's log of the IR before each pass of its Triton pipeline


def _child_env(name: str, dump_dir: pathlib.Path) -> dict:
    """The section's environment. ``smem`` gets XLA dump flags, for kernel_ir.tar.gz: the kernels'
    StableHLO and optimized HLO (``--xla_dump_to``, limited to them), XLA's Triton pass log
    (``--xla_dump_emitter_re``: XLA compiles each Pallas kernel through its ``triton-to-llvm``
    pipeline and logs the IR before every pass) and its LLVM IR and PTX (``--xla_gpu_dump_llvmir``)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if name == "smem":
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir}"
                            " --xla_dump_hlo_module_re=.*gpu_call.* --xla_dump_emitter_re=triton-to-llvm"
                            " --xla_gpu_dump_llvmir=true").strip()
    return env


def run_child(name: str, argv: list[str], args, scratch: pathlib.Path) -> dict:
    """Run section ``name`` in its own process group under its budget; its part, plus how it ended."""
    budget = SECTION_BUDGET_S[name] * args.budget_scale
    part_file, dump_dir = scratch / f"{name}.json", scratch / "xla_dump"
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), *argv, "--section", name,
           "--part-file", str(part_file), "--dump-dir", str(dump_dir)]
    start = time.time()
    proc = subprocess.Popen(cmd, env=_child_env(name, dump_dir), start_new_session=True)
    try:
        code = proc.wait(timeout=budget)
        ended = f"exit {code}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code, ended = None, f"killed after its budget of {budget:.0f} s"
    part = json.loads(part_file.read_text()) if part_file.exists() else {}
    part.update(wall_s=time.time() - start, budget_s=budget, ended=ended)
    if code != 0:
        part["ok"] = False
    return part


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.section:
        return run_section(args)
    t0 = time.time()
    report = JsonFile(pathlib.Path(args.out) / "device_check.json", smoke=args.smoke, args=vars(args),
                      python=sys.version.split()[0], budgets_s={n: SECTION_BUDGET_S[n] * args.budget_scale
                                                                for n in args.sections.split(",")})
    report.save()
    print(f"device_check: sections {args.sections}, each in its own process under its budget", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.sections.split(","):
            print(f"[{name}] budget {SECTION_BUDGET_S[name] * args.budget_scale:.0f} s", flush=True)
            part = run_child(name, argv, args, pathlib.Path(scratch))
            for key in ("backend", "device", "jax_version", "impl_auto"):  # where it ran, once at the top
                if key in part:
                    report.setdefault(key, part.pop(key))
            report[name] = part
            report["wall_s"] = time.time() - t0
            report.save()
            print(f"[{name}] {part['ended']} after {part['wall_s']:.0f} s", flush=True)
    print(f"wrote {report.path} ({report['wall_s']:.0f} s)")
    failed = [n for n in args.sections.split(",") if report[n].get("ok") is False]
    if failed:
        print(f"FAILED sections: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
