"""The native CPU kernels (``cpu/*.cc``: paged attention, the KV page write, the few-row
matmuls, "w8a8" products on AMX-INT8, the gated MLP's SiLU product, RoPE, the sampler's
top-k/top-p thresholds and logprob statistics): built on first use into one library, called
through XLA's FFI.

Why built at run time rather than at install time: the kernel is compiled with
``-march=native`` for the machine it runs on (AVX-512 where there is one; ``cpu_isa.py`` says how
``JAXRUNNER_CPU_MAX_ISA`` lowers that), against the FFI headers of the jaxlib that is installed;
neither is known when the package is built. The shared library is cached under
``$JAXRUNNER_CACHE_DIR/kernels`` (default ``~/.cache/jaxrunner``), keyed by the source, the
jaxlib version, the compiler, its flags and the CPU's feature flags, so a start-up after
the first costs one ``dlopen``. Without a C++ compiler (or if the build fails) :func:`available`
says why, and ``impl="auto"`` stays on the XLA path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxrunner.kernels import cpu_isa
from jaxrunner.kernels.kv_write import check_write_shapes

logger = logging.getLogger("jaxrunner")

CPU_DIR = Path(__file__).with_name("cpu")
SOURCES = (CPU_DIR / "paged_attention.cc", CPU_DIR / "small_matmul.cc", CPU_DIR / "quant_matmul.cc",
           CPU_DIR / "quant_panels.cc", CPU_DIR / "gated_activation.cc", CPU_DIR / "rotary.cc",
           CPU_DIR / "sampling_thresholds.cc", CPU_DIR / "logprob_stats.cc", CPU_DIR / "w8a8_matmul.cc")
HEADERS = (CPU_DIR / "vec.h", CPU_DIR / "fp8.h", CPU_DIR / "work_queue.h", CPU_DIR / "helper_thread.h", CPU_DIR / "quant_dot.h",
           CPU_DIR / "quant_dot8.h", CPU_DIR / "quant_gemm8.h",
           CPU_DIR / "quant_gemm_f32.h", CPU_DIR / "quant_gemm_vnni.h", CPU_DIR / "transpose.h",
           CPU_DIR / "amx.h", CPU_DIR / "attention_problem.h", CPU_DIR / "attention_amx.h")
TARGET_NAME = "jaxrunner_cpu_paged_attention"
SYMBOL = "JaxrunnerCpuPagedAttention"
WRITE_TARGET_NAME = "jaxrunner_cpu_write_kv"
WRITE_SYMBOL = "JaxrunnerCpuWriteKv"
MATMUL_TARGET_NAME = "jaxrunner_cpu_small_matmul"
MATMUL_SYMBOL = "JaxrunnerCpuSmallMatmul"
MATMUL_MAX_ROWS = 4
QUANT_MATMUL_TARGET_NAME = "jaxrunner_cpu_quant_matmul"
QUANT_MATMUL_SYMBOL = "JaxrunnerCpuQuantMatmul"
PANEL_MATMUL_TARGET_NAME = "jaxrunner_cpu_quant_matmul_panels"
PANEL_MATMUL_SYMBOL = "JaxrunnerCpuQuantMatmulPanels"
DEQUANTIZE_TARGET_NAME = "jaxrunner_cpu_dequantize"
DEQUANTIZE_SYMBOL = "JaxrunnerCpuDequantize"
SILU_MUL_TARGET_NAME = "jaxrunner_cpu_silu_mul"
SILU_MUL_SYMBOL = "JaxrunnerCpuSiluMul"
ROTARY_TARGET_NAME = "jaxrunner_cpu_rotary"
ROTARY_SYMBOL = "JaxrunnerCpuRotary"
THRESHOLDS_TARGET_NAME = "jaxrunner_cpu_sampling_thresholds"
THRESHOLDS_SYMBOL = "JaxrunnerCpuSamplingThresholds"
LOGPROB_STATS_TARGET_NAME = "jaxrunner_cpu_logprob_stats"
LOGPROB_STATS_SYMBOL = "JaxrunnerCpuLogprobStats"
W8A8_MATMUL_TARGET_NAME = "jaxrunner_cpu_w8a8_matmul"
W8A8_MATMUL_SYMBOL = "JaxrunnerCpuW8a8Matmul"
# [K, N] weights: work items, each a contiguous block of K rows (partial sums). Two measured best
# for bf16 batch-1 TPOT (medians of alternating runs: 2 -> 15.0-17.0 ms, 1 -> 15.7-16.5, 3 -> 17.3-18.2,
# 4 -> 16.3-17.6, 8 -> 19.1-20.6): each item costs a hand-off to another thread, and the weights
# of one layer are small (0.7-3.5 MB).
MATMUL_K_SPLITS = 2
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")  # with the -march of cpu_isa.march()


class NativeKernelUnavailable(RuntimeError):
    """The native CPU kernel cannot be built or loaded here (the message says why)."""


def compile_flags() -> tuple[str, ...]:
    """The flags the kernels are built with: :data:`FLAGS` and the ``-march`` for this CPU."""
    return (*FLAGS, cpu_isa.march())


def _cache_dir() -> Path:
    """``$JAXRUNNER_CACHE_DIR/kernels``, else ``~/.cache/jaxrunner/kernels`` if it can be created,
    else a folder in the temporary directory."""
    root = os.environ.get("JAXRUNNER_CACHE_DIR")
    if root:
        return Path(root) / "kernels"
    home = Path.home() / ".cache" / "jaxrunner" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        return home
    except OSError:
        return Path(tempfile.gettempdir()) / "jaxrunner-kernels"


def library_path(name: str, compiler: str, files, flags=None) -> Path:
    """Where the library ``name`` built from ``files`` lives in the cache: keyed by their bytes, the
    jaxlib version, the compiler, the flags and the CPU's feature flags."""
    key = hashlib.sha256()
    sources = [Path(path).read_bytes() for path in files]
    flags = compile_flags() if flags is None else flags
    for part in (*sources, jaxlib.__version__.encode(), compiler.encode(), " ".join(flags).encode(),
                 platform.machine().encode(), " ".join(sorted(cpu_isa.cpu_flags())).encode()):
        key.update(part)
        key.update(b"\0")
    return _cache_dir() / f"lib{name}-{key.hexdigest()[:16]}.so"


def build_library(compiler: str, target: Path, sources=SOURCES, flags=None, link=()) -> None:
    """Compile ``sources`` (with :func:`compile_flags` unless ``flags`` are given) into a temporary
    file beside ``target`` and rename it into place (atomic)."""
    flags = compile_flags() if flags is None else flags
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, *flags, f"-I{jax.ffi.include_dir()}", *map(str, sources), "-o", tmp, *link]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise NativeKernelUnavailable(f"building the native CPU kernels failed (exit {proc.returncode}): "
                                          f"{' '.join(cmd)}\n{proc.stderr[-2000:]}".strip())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def compiler() -> str:
    """The C++ compiler the kernels are built with (``$CXX`` first); raises when there is none."""
    if platform.system() != "Linux":
        raise NativeKernelUnavailable(f"the native CPU kernel is built for Linux only, not {platform.system()}")
    found = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if found is None:
        raise NativeKernelUnavailable("no C++ compiler found (set CXX, or install g++)")
    return found


def _load() -> ctypes.CDLL:
    """Build (or find) the library and register its handlers with XLA."""
    cxx = compiler()
    path = library_path(TARGET_NAME, cxx, (*SOURCES, *HEADERS))
    if not path.exists():
        build_library(cxx, path)
    library = ctypes.cdll.LoadLibrary(str(path))
    jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(getattr(library, SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(WRITE_TARGET_NAME, jax.ffi.pycapsule(getattr(library, WRITE_SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(MATMUL_TARGET_NAME, jax.ffi.pycapsule(getattr(library, MATMUL_SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(QUANT_MATMUL_TARGET_NAME, jax.ffi.pycapsule(getattr(library, QUANT_MATMUL_SYMBOL)),
                                platform="cpu")
    jax.ffi.register_ffi_target(PANEL_MATMUL_TARGET_NAME, jax.ffi.pycapsule(getattr(library, PANEL_MATMUL_SYMBOL)),
                                platform="cpu")
    jax.ffi.register_ffi_target(DEQUANTIZE_TARGET_NAME, jax.ffi.pycapsule(getattr(library, DEQUANTIZE_SYMBOL)),
                                platform="cpu")
    jax.ffi.register_ffi_target(SILU_MUL_TARGET_NAME, jax.ffi.pycapsule(getattr(library, SILU_MUL_SYMBOL)),
                                platform="cpu")
    jax.ffi.register_ffi_target(ROTARY_TARGET_NAME, jax.ffi.pycapsule(getattr(library, ROTARY_SYMBOL)),
                                platform="cpu")
    jax.ffi.register_ffi_target(THRESHOLDS_TARGET_NAME, jax.ffi.pycapsule(getattr(library, THRESHOLDS_SYMBOL)),
                                platform="cpu")
    jax.ffi.register_ffi_target(LOGPROB_STATS_TARGET_NAME, jax.ffi.pycapsule(getattr(library, LOGPROB_STATS_SYMBOL)),
                                platform="cpu")
    jax.ffi.register_ffi_target(W8A8_MATMUL_TARGET_NAME, jax.ffi.pycapsule(getattr(library, W8A8_MATMUL_SYMBOL)),
                                platform="cpu")
    return library


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None) once it is built and registered; (None, why not) otherwise.

    The build is tried once per process: a failure is remembered (a compiler that failed once
    fails again, and each try costs a compile) and logged once, as a warning naming the fallback.
    """
    try:
        return _load(), None
    except (NativeKernelUnavailable, OSError, AttributeError, subprocess.SubprocessError) as err:
        logger.warning("native CPU kernel unavailable (%s); attention and the KV write use the XLA path "
                       "(attention_impl='xla'), one-row matmuls use XLA's dot", err)
        return None, str(err)


def unavailable_reason() -> str | None:
    """None when the kernel is ready; otherwise why it cannot be used here."""
    return _loaded()[1]


def panel_gemm() -> bool:
    """Whether the build for this CPU takes weight-only products of every row count as GEMMs over
    panels of outputs, as the library itself reports. AVX512-VNNI: the codes times activations
    rounded to 16-bit integers per run (``cpu/quant_gemm_vnni.h``, one int8 plane of them for
    ``"w4a8"``); AVX2 without AVX-512: int4 codes times activations rounded to int8 for ``"w4a8"``
    (``cpu/quant_gemm8.h``), float32 otherwise (``cpu/quant_gemm_f32.h``)."""
    library = _loaded()[0]
    return library is not None and bool(library.JaxrunnerCpuPanelGemm())


def stored_panels() -> bool:
    """Whether the build for this CPU multiplies weight-only weights laid out once as panels of
    sixteen outputs (``cpu/quant_panels.cc``: AVX512-VNNI), as the library itself reports."""
    library = _loaded()[0]
    return library is not None and bool(library.JaxrunnerCpuStoredPanels())


def w8a8_matmul_ready() -> bool:
    """Whether the build for this CPU runs ``"w8a8"`` products on AMX-INT8 tiles
    (``cpu/w8a8_matmul.cc``) and the OS grants AMX to this process, as the library itself reports."""
    library = _loaded()[0]
    return library is not None and bool(library.JaxrunnerCpuW8a8MatmulReady())


def attention_tiles_ready() -> bool:
    """Whether the build for this CPU runs bf16 paged attention on AMX-BF16 tiles
    (``cpu/attention_amx.h``) and the OS grants AMX to this process, as the library itself reports."""
    library = _loaded()[0]
    return library is not None and bool(library.JaxrunnerCpuAttentionTilesReady())


def available() -> bool:
    return unavailable_reason() is None


def _require() -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise NativeKernelUnavailable(reason)


def supports(head_dim: int) -> bool:
    """Head sizes the kernel takes: whole 16-float vectors, at most 256."""
    return head_dim % 16 == 0 and 0 < head_dim <= 256


def ragged_paged_attention_native(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                                  sm_scale, sliding_window=None, soft_cap=None, tiles=True):
    """Same contract as :func:`jaxrunner.kernels.reference.ragged_paged_attention_reference`.

    Runs on CPU only (the custom call is registered for the CPU platform). ``tiles``: bf16 queries
    and pages multiply on AMX-BF16 tiles where :func:`attention_tiles_ready` and the shapes allow
    (``cpu/attention_amx.h``); False keeps them on the AVX-512 path."""
    _require()
    if not supports(q.shape[-1]):
        raise ValueError(f"the native CPU kernel needs head_dim a multiple of 16 and at most 256, got {q.shape[-1]}")
    call = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct(q.shape, q.dtype))
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return call(q, k_pages, v_pages, i32(kv_lens), i32(page_indices), i32(cu_q_lens),
                i32(num_seqs).reshape(1), sm_scale=np.float32(sm_scale),
                soft_cap=np.float32(0.0 if soft_cap is None else soft_cap),
                sliding_window=np.int64(0 if sliding_window is None else sliding_window),
                tiles=np.int64(bool(tiles)))


def write_kv_pages_native(k_pages, v_pages, k_new, v_new, slot_mapping):
    """Same contract as :func:`jaxrunner.kernels.kv_write.write_kv_pages`, for float32 and bfloat16
    pools alike: the outputs alias the input pools, so under donation the write is in place and
    touches only the T new rows (XLA:CPU's own bf16 scatter converts the whole pool)."""
    _require()
    check_write_shapes(k_pages, v_pages, k_new, v_new, slot_mapping)
    pools = (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype), jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype))
    call = jax.ffi.ffi_call(WRITE_TARGET_NAME, pools, input_output_aliases={0: 0, 1: 1})
    return tuple(call(k_pages, v_pages, k_new, v_new, jnp.asarray(slot_mapping, jnp.int32)))


def small_matmul_supported(x, w, transposed: bool) -> bool:
    """Shapes and dtypes :func:`small_matmul_native` takes: ``x`` [1..4, K] and ``w`` both bf16 or
    both float32, with N a multiple of 16 for ``w`` [K, N], or K a whole number of 64-byte
    vectors (32 bf16 or 16 float32) for ``w`` [N, K]."""
    if x.ndim != 2 or w.ndim != 2 or x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float32):
        return False
    k, n = (w.shape[1], w.shape[0]) if transposed else w.shape
    fits = k % (64 // x.dtype.itemsize) == 0 if transposed else n % 16 == 0
    return 1 <= x.shape[0] <= MATMUL_MAX_ROWS and x.shape[1] == k and fits


def small_matmul_native(x, w, *, transposed: bool = False):
    """``x @ w`` (``x @ w.T`` when ``transposed``) with a float32 result, for bf16 or float32
    operands and 1 to 4 rows: each weight is read once, on all threads (see ``cpu/small_matmul.cc``)."""
    _require()
    if not small_matmul_supported(x, w, transposed):
        raise ValueError(f"the native small matmul takes x [1..{MATMUL_MAX_ROWS}, K] and w, both bf16 or both "
                         f"float32; got x {x.dtype}{list(x.shape)}, w {w.dtype}{list(w.shape)}, "
                         f"transposed={transposed}")
    rows = x.shape[0]
    if transposed:
        call = jax.ffi.ffi_call(MATMUL_TARGET_NAME, jax.ShapeDtypeStruct((rows, w.shape[0]), jnp.float32))
        return call(x, w, transposed=np.int64(1))
    splits = min(MATMUL_K_SPLITS, w.shape[0])
    call = jax.ffi.ffi_call(MATMUL_TARGET_NAME, jax.ShapeDtypeStruct((splits, rows, w.shape[1]), jnp.float32))
    return call(x, w, transposed=np.int64(0)).sum(axis=0)  # XLA fuses the sum into what follows


def silu_mul_supported(gate_up, dtype) -> bool:
    """Whether :func:`silu_mul_native` takes ``gate_up``: float32 [T, 2I] with I a multiple of 16,
    rounded to bf16 or float32."""
    return (gate_up.ndim == 2 and gate_up.dtype == jnp.float32 and gate_up.shape[1] % 32 == 0
            and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float32))


def silu_mul_native(gate_up, dtype):
    """``silu(gate) * up`` in ``dtype`` [T, I] from the float32 projection ``gate_up`` [T, 2I] with
    gate and up interleaved column by column (``models/params.py``), as
    ``(jax.nn.silu(g[..., 0]) * g[..., 1]).astype(dtype)`` of ``g = gate_up.reshape(T, I, 2)``
    computes it, to within float32 rounding (see ``cpu/gated_activation.cc``)."""
    _require()
    if not silu_mul_supported(gate_up, dtype):
        raise ValueError(f"the native SiLU product takes gate_up float32 [T, 2I] with I a multiple of 16 and a "
                         f"bf16 or float32 result; got {gate_up.dtype}{list(gate_up.shape)} -> {jnp.dtype(dtype)}")
    out = jax.ShapeDtypeStruct((gate_up.shape[0], gate_up.shape[1] // 2), dtype)
    call = jax.ffi.ffi_call(SILU_MUL_TARGET_NAME, out)
    return call(gate_up)


def rotary_supported(qkv, cos) -> bool:
    """Whether :func:`rotary_native` takes ``qkv`` float32 [T, Hkv, G + 2, D] with ``cos`` [T, D]:
    RoPE over the whole head (not a partial rotary), D a multiple of 32."""
    return (qkv.ndim == 4 and qkv.dtype == jnp.float32 and qkv.shape[2] >= 3 and qkv.shape[3] % 32 == 0
            and cos.shape == (qkv.shape[0], qkv.shape[3]) and cos.dtype == jnp.float32)


def rotary_native(qkv, cos, sin):
    """(q [T, Hkv * G, D], k [T, Hkv, D], v [T, Hkv, D]) float32 of the grouped projection ``qkv``
    [T, Hkv, G + 2, D], q and k rotated by ``cos``/``sin`` [T, D] (HF's rotate-half layout): bit for
    bit ``models.layers.split_rotated`` under optimizing XLA (see ``cpu/rotary.cc``)."""
    _require()
    if not rotary_supported(qkv, cos) or sin.shape != cos.shape or sin.dtype != cos.dtype:
        raise ValueError(f"the native RoPE takes qkv float32 [T, Hkv, G + 2, D] with D a multiple of 32 and cos, "
                         f"sin float32 [T, D]; got qkv {qkv.dtype}{list(qkv.shape)}, cos {cos.dtype}{list(cos.shape)}, "
                         f"sin {sin.dtype}{list(sin.shape)}")
    tokens, kv_heads, group, dim = qkv.shape[0], qkv.shape[1], qkv.shape[2] - 2, qkv.shape[3]
    shapes = (jax.ShapeDtypeStruct((tokens, kv_heads * group, dim), jnp.float32),
              jax.ShapeDtypeStruct((tokens, kv_heads, dim), jnp.float32),
              jax.ShapeDtypeStruct((tokens, kv_heads, dim), jnp.float32))
    return tuple(jax.ffi.ffi_call(ROTARY_TARGET_NAME, shapes)(qkv, cos, sin))


def sampling_thresholds_native(logits, top_k, top_p):
    """Per row of float32 ``logits`` [S, V], the smallest logit that top-k (``top_k`` [S] int32, 0
    off) and top-p (``top_p`` [S] float32, 1 off) keep, -inf where neither is on: the thresholds of
    ``runner.sampler``'s ``_exact_thresholds``, from a histogram and one bin's sort per row rather
    than XLA's TopK and bisections (see ``cpu/sampling_thresholds.cc``)."""
    _require()
    rows = logits.shape[0]
    if (logits.ndim != 2 or logits.dtype != jnp.float32 or top_k.shape != (rows,) or top_k.dtype != jnp.int32
            or top_p.shape != (rows,) or top_p.dtype != jnp.float32):
        raise ValueError(f"the native sampling thresholds take logits float32 [S, V], top_k int32 [S] and top_p "
                         f"float32 [S]; got logits {logits.dtype}{list(logits.shape)}, top_k "
                         f"{top_k.dtype}{list(top_k.shape)}, top_p {top_p.dtype}{list(top_p.shape)}")
    call = jax.ffi.ffi_call(THRESHOLDS_TARGET_NAME, jax.ShapeDtypeStruct((rows,), jnp.float32))
    return call(logits, top_k, top_p)


def logprob_stats_native(logits, chosen):
    """Per row of float32 ``logits`` [S, V], (its log normalizer, ``jax.nn.logsumexp``'s to within
    float32 rounding of the sum; the rank of token ``chosen`` [S] int32, 1 + the logits strictly
    above it): what ``runner.sampler`` reports a sampled token's logprob with, in one native pass
    per row rather than XLA's three reductions (see ``cpu/logprob_stats.cc``)."""
    _require()
    rows = logits.shape[0]
    if logits.ndim != 2 or logits.dtype != jnp.float32 or chosen.shape != (rows,) or chosen.dtype != jnp.int32:
        raise ValueError(f"the native logprob statistics take logits float32 [S, V] and chosen int32 [S]; got "
                         f"logits {logits.dtype}{list(logits.shape)}, chosen {chosen.dtype}{list(chosen.shape)}")
    call = jax.ffi.ffi_call(LOGPROB_STATS_TARGET_NAME, (jax.ShapeDtypeStruct((rows,), jnp.float32),
                                                        jax.ShapeDtypeStruct((rows,), jnp.int32)))
    return call(logits, chosen)


def cpu_features() -> list[str]:
    """The vector and matrix extensions this CPU reports (less those ``JAXRUNNER_CPU_MAX_ISA``
    hides): what the kernels are built for, and the flags ``platform_support`` chooses by."""
    flags = cpu_isa.cpu_flags()
    names = ("amx_bf16", "amx_int8", "avx512f", "avx512_vnni", "avx512_bf16", "avx2", "avx_vnni", "fma")
    return [name for name in names if name in flags]


def quantized_matmul_supported(x, w: dict) -> bool:
    """Whether :func:`quantized_matmul_native` takes ``x`` [rows, K] (bf16 or float32) and the
    weight-only leaf ``w`` (``jaxrunner/models/quant.py``): groups must be whole runs of 32."""
    packed, scales = w["packed"], w["scales"]
    if x.ndim != 2 or packed.ndim != 2 or scales.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float32):
        return False
    if scales.dtype not in (jnp.float16, jnp.float32) or w.get("offsets", scales).dtype != scales.dtype:
        return False
    int4 = packed.dtype == jnp.uint8
    if not int4 and packed.dtype != jnp.int8:
        return False
    k, groups = x.shape[1], scales.shape[1]
    return (x.shape[0] >= 1 and packed.shape[1] * (2 if int4 else 1) == k
            and scales.shape[0] == packed.shape[0] and k % groups == 0 and (k // groups) % 32 == 0)


def quantized_matmul_native(x, w: dict, int8_activations: bool = False):
    """``x @ dequantize(w).T`` with a float32 result: the packed weights are read once and
    unpacked in registers, four outputs at a time for many rows (see ``cpu/quant_matmul.cc``).
    ``int8_activations``: ``x`` is first rounded to int8 per run of 32 inputs, as
    ``models.quant.round_activations_int8`` rounds it (the ``"w4a8"`` quantization)."""
    _require()
    if not quantized_matmul_supported(x, w):
        raise ValueError(f"the native quantized matmul takes x [rows, K] bf16 or float32 and a "
                         f"weight-only leaf with groups of whole runs of 32; got x {x.dtype}{list(x.shape)}, "
                         f"packed {w['packed'].dtype}{list(w['packed'].shape)}, scales {list(w['scales'].shape)}")
    offsets = w.get("offsets")
    call = jax.ffi.ffi_call(QUANT_MATMUL_TARGET_NAME,
                            jax.ShapeDtypeStruct((x.shape[0], w["packed"].shape[0]), jnp.float32))
    return call(x, w["packed"], w["scales"], offsets_or_placeholder(w), has_offsets=np.int64(offsets is not None),
                x_int8=np.int64(int8_activations))


def dequantize_native(w: dict, after=None):
    """The float32 [N, K] a weight-only leaf stands for, unpacked on all threads (for products
    that XLA's dot takes; see ``cpu/quant_matmul.cc``). Groups must be whole runs of 32, scales
    and offsets both float32 or both float16.

    ``after``: an array the call takes but never reads, so that XLA runs it once ``after`` exists
    (pass the product's activations). Without it, nothing tied the call to its layer, and XLA ran
    every layer's dequantization at the start of the step, holding all the float weights at once."""
    _require()
    packed, offsets = w["packed"], w.get("offsets")
    k = packed.shape[1] * (2 if packed.dtype == jnp.uint8 else 1)
    call = jax.ffi.ffi_call(DEQUANTIZE_TARGET_NAME, jax.ShapeDtypeStruct((packed.shape[0], k), jnp.float32))
    return call(jnp.zeros((1,), jnp.float32) if after is None else after, packed, w["scales"],
                offsets_or_placeholder(w), has_offsets=np.int64(offsets is not None))


def offsets_or_placeholder(w: dict):
    """The leaf's offsets, or an unread array of its scales' dtype (the kernel takes both typed alike)."""
    offsets = w.get("offsets")
    return jnp.zeros((1, 1), w["scales"].dtype) if offsets is None else offsets
