"""What the kernels can do on a platform: the one question start-up asks before it picks anything.

:func:`capabilities` says which attention implementations run there (and why the others do not),
which KV dtypes each one's page write updates in place, whether the native CPU library builds and
loads on this machine, and where the model's linear products run (:class:`MatmulKernels`). The
runner asks once and hands the answer down (the attention implementation to ``PagedAttention``,
the matmul choice to the model's architecture), so no model code asks JAX which devices it runs on
while it is traced.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Mapping

import jax

from jaxrunner.kernels import cpu_isa, jax_tpu, native, onednn
from jaxrunner.kernels.names import ATTENTION_IMPLS, CPU_MATMUL_CHOICES

GPU_PLATFORMS = ("gpu", "cuda", "rocm")
XLA, NATIVE, ONEDNN = "xla", "native", "onednn"
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_ONLY_ACTIVATIONS = ("float", "int8")  # MatmulKernels.weight_only_activations
# XLA:CPU routes a one-row 16-bit dot to a GEMV that measured 9x slower than the same dot with
# four rows (tied LM head [1, 576] x [49152, 576]: 37 vs 4.8 ms), so such dots are padded to four.
CPU_MIN_16BIT_ROWS = 4
# Where oneDNN's matmul beat XLA's dot, per CPU kind: (the CPU flag, the dtypes of the weights
# packed for it, the smallest such weight in bytes, the activation dtypes whose weight-only int4/int8
# products of many rows it takes); the first row whose flag the CPU has applies. Read off
# scripts/bench_matmul.py (both in one process, alternating) and checked end to end with the
# throughput and latency benchmarks; a CPU kind not listed keeps XLA's dot until measured.
# * AVX512-BF16 without AMX (AMD Zen 4): weight-only int4 products of bf16 rows, oneDNN on tiles
#   unpacked in cache 1.9-2.5x XLA's dot after dequantizing at 64 rows and 1.8-4.5x the native
#   kernel from 8 rows (int8 weights: 1.1-4.0x XLA's dot at 8-64 rows). Its float matmul on packed
#   weights was faster too at batch (1.1-1.2x SmolLM2's bf16 and float32 throughput) but took
#   batch-1 products from the native one-row kernel (bf16 TPOT 1.3x slower), so float weights stay
#   unpacked there.
ONEDNN_FASTER = (
    ("amx_bf16", ("bfloat16", "float32"), 8 << 20, ("bfloat16",)),
    ("avx512_bf16", (), 0, ("bfloat16",)),
)
NOT_FASTER = ((), 0, ())
# Where XLA's dot multiplied [N, K] weights faster than [K, N] ones, per CPU kind: (a CPU flag it
# has, one it lacks or None, the weight dtypes then held transposed, the fewest inputs K); the first
# row that matches applies (scripts/bench_matmul.py --orientations, checked end to end):
# * the Xeon with AMX: SmolLM2's projections at 64 rows 1.04-1.52x in bf16, 1.05-1.23x in float32;
# * an AVX2 CPU without AVX-512 (EPYC family 23): float32 weights of 2048+ inputs (the 1B model's)
#   1.6-3.9x from 4 to 48 rows, 1.1-1.2x at 64, 1.0-1.2x at 512; SmolLM2's of 576 inputs ran up
#   to 2x slower below 32 rows that way, so they stay [K, N].
XLA_WEIGHTS_NK = (
    ("amx_bf16", None, FLOAT_DTYPES, 0),
    ("avx2", "avx512f", ("float32",), 2048),
)
# From how many float32 rows weight-only products leave the native panel GEMMs (where the build
# has them) for XLA's dot on a weight the kernel unpacks first, per CPU kind: (a CPU flag it has,
# whether it splits 256-bit instructions in halves (cpu_isa.splits_256bit_vectors) or None for
# either, the rows; 0: never); the first row that matches applies (scripts/bench_matmul.py
# --quantization int4 --dtypes float32, "native" against "unpacked"):
# * AVX512-VNNI (EPYC Zen 4): the integer panels (cpu/quant_gemm_vnni.h) ran 1.07-1.41x XLA's
#   dot on the float weight itself at 1024 rows of SmolLM2's products (1.65-2.27x at 16), and
#   1.11-1.35x XLA's dot on the unpacked weight, so never;
# * AVX2 on halves (EPYC Zen 1): XLA's dot ran about an eighth faster than the eight-wide panels
#   at 512 rows (SmolLM2's gate_up), even with them at 128 and 256, and unpacking costs a few
#   percent of such a product;
# * AVX2 run whole (the Xeon with AMX under JAXRUNNER_CPU_MAX_ISA=avx2): the float32 panels ran
#   0.63-0.85x the unpacked weight's product at 64 rows and 0.55-0.71x at 256, about even at 16;
#   SmolLM2's int4 served 0.80x float32's throughput from 32 rows against 0.64x from 512.
DEQUANTIZE_FLOAT_ROWS = (
    ("avx512_vnni", None, 0),
    ("avx2", True, 512),
    ("avx2", False, 32),
)


@dataclasses.dataclass(frozen=True)
class MatmulKernels:
    """Where the model's linear products run (``models/linear.py``); the default is XLA everywhere,
    which every platform runs.

    * ``one_row``: ``"native"`` sends a one-row product of bf16 or float32 operands to the native
      CPU matmul (:func:`small_matmul_native`; a batch-1 decode reads every weight per token, and
      the kernel streams each once); ``"xla"`` keeps XLA's dot.
    * ``weight_only``: ``"native"`` sends weight-only int8/int4 products of few rows to the native
      kernel, which unpacks the weights in registers (:func:`quantized_matmul_native`), and for
      more float32 rows lets it unpack the weight for XLA's dot (:func:`dequantize_native`);
      ``"xla"`` dequantizes in XLA.
    * ``min_16bit_rows``: XLA dots of 16-bit operands with fewer rows are padded to this many.
    * ``onednn_dtypes``: the linear layers' weights of these dtypes holding at least
      ``onednn_min_weight_bytes`` are packed at start-up into oneDNN's layout
      (``models.packed_weights``), and their products, of every row count, run on oneDNN's matmul
      (:func:`onednn_matmul`: AMX and AVX-512 kernels, faster than XLA's dot where
      :func:`capabilities` chooses it); empty: none.
    * ``xla_weights_nk``: the linear weights of these float dtypes with at least
      ``xla_weights_nk_min_inputs`` inputs that are not packed for oneDNN are held transposed,
      [out, in], which XLA's dot multiplied faster on this CPU kind (``models.packed_weights``);
      empty: none.
    * ``onednn_weight_only``: activation dtypes (bf16 only) whose weight-only int8/int4 products
      of more rows than the native kernel takes run on oneDNN, the weights unpacked a tile at a time
      into its AMX layout (:func:`onednn_quant_matmul`); empty: XLA's dot after dequantizing.
    * ``elementwise``: ``"native"`` runs two element-wise steps around the products in the native
      kernels: a gated MLP's ``silu(gate) * up`` from the interleaved projection
      (:func:`silu_mul_native`) and RoPE with the split of the grouped q/k/v projection
      (:func:`rotary_native`), and the runner sends the sampler's top-k/top-p thresholds to
      :func:`sampling_thresholds_native` and its logprobs' normalizer and ranks to
      :func:`logprob_stats_native`; ``"xla"`` leaves them to XLA. Not products, but decided
      by the same conditions as the native ones, and handed down with them.
    * ``weight_only_activations``: ``"float"`` multiplies weight-only int8/int4 weights by the
      activations as they are; ``"int8"`` rounds them to int8 per run of 32 inputs first, on every
      path (the ``"w4a8"`` quantization, ``models/quant.py``; the runner sets it from the
      engine's quantization). Not a place but a number format, handed down with the places
      because every product reads it.
    * ``weight_only_gemm``: the native kernel takes weight-only products of every row count, as
      GEMMs over panels of outputs (:func:`native.panel_gemm`: builds for AVX2 or AVX512-VNNI,
      where they outran dequantizing for XLA's dot); False: few rows only, more dequantized for XLA.
    * ``dequantize_min_rows``: with the panel GEMMs, float32 products of this many rows or more
      still go to XLA's dot on a weight the native kernel unpacks first (0: none do), from
      :data:`DEQUANTIZE_FLOAT_ROWS`.
    * ``weight_only_panels``: activation dtypes of models whose weight-only layer weights are laid
      out once, at start-up, as panels of sixteen outputs (``kernels.quant_panels``, AVX512-VNNI
      builds), all their products then reading them in place: the native kernel's
      (:func:`panel_matmul`), and from oneDNN's rows on, for a dtype in ``onednn_weight_only``,
      oneDNN's, each tile unpacked from the panels (:func:`onednn_panel_matmul`). Set where the
      native kernel takes every row count that oneDNN does not; empty: none.
    * ``w8a8_tiles``: ``"w8a8"`` layer weights are laid out once, at start-up, as AMX-INT8 tiles
      (``kernels.w8a8_tiles``), and each of their products, of every row count, is one call of the
      native kernel (:func:`w8a8_tile_matmul`: x rounded to int8, the int8 product and the scales
      in one pass). Set where the native build has AMX-INT8 and the OS grants it.

    Frozen and hashable: it is part of the jitted step's static arguments.
    """

    one_row: str = XLA
    weight_only: str = XLA
    min_16bit_rows: int = 1
    onednn_dtypes: tuple[str, ...] = ()
    onednn_min_weight_bytes: int = 0
    onednn_weight_only: tuple[str, ...] = ()
    xla_weights_nk: tuple[str, ...] = ()
    xla_weights_nk_min_inputs: int = 0
    elementwise: str = XLA
    weight_only_activations: str = "float"
    weight_only_gemm: bool = False
    dequantize_min_rows: int = 0
    weight_only_panels: tuple[str, ...] = ()
    w8a8_tiles: bool = False

    def __post_init__(self):
        if self.weight_only_activations not in WEIGHT_ONLY_ACTIVATIONS:
            raise ValueError(f"MatmulKernels.weight_only_activations: expected one of {WEIGHT_ONLY_ACTIVATIONS}, "
                             f"got {self.weight_only_activations!r}")
        for name in ("one_row", "weight_only", "elementwise"):
            if getattr(self, name) not in (XLA, NATIVE):
                raise ValueError(f"MatmulKernels.{name}: expected {XLA!r} or {NATIVE!r}, got {getattr(self, name)!r}")
        if not isinstance(self.onednn_dtypes, tuple) or not set(self.onednn_dtypes) <= {"float32", "bfloat16"}:
            raise ValueError(f"MatmulKernels.onednn_dtypes: expected a tuple of 'float32' and 'bfloat16', "
                             f"got {self.onednn_dtypes!r}")
        if not isinstance(self.xla_weights_nk, tuple) or not set(self.xla_weights_nk) <= set(FLOAT_DTYPES):
            raise ValueError(f"MatmulKernels.xla_weights_nk: expected a tuple of {FLOAT_DTYPES}, "
                             f"got {self.xla_weights_nk!r}")
        if not isinstance(self.xla_weights_nk_min_inputs, int) or self.xla_weights_nk_min_inputs < 0:
            raise ValueError(f"MatmulKernels.xla_weights_nk_min_inputs: expected an integer >= 0, "
                             f"got {self.xla_weights_nk_min_inputs!r}")
        if not isinstance(self.onednn_weight_only, tuple) or not set(self.onednn_weight_only) <= {"bfloat16"}:
            raise ValueError(f"MatmulKernels.onednn_weight_only: expected () or ('bfloat16',), "
                             f"got {self.onednn_weight_only!r}")
        if not isinstance(self.onednn_min_weight_bytes, int) or self.onednn_min_weight_bytes < 0:
            raise ValueError(f"MatmulKernels.onednn_min_weight_bytes: expected an integer >= 0, "
                             f"got {self.onednn_min_weight_bytes!r}")
        if not isinstance(self.w8a8_tiles, bool):
            raise ValueError(f"MatmulKernels.w8a8_tiles: expected True or False, got {self.w8a8_tiles!r}")
        if not isinstance(self.weight_only_gemm, bool):
            raise ValueError(f"MatmulKernels.weight_only_gemm: expected True or False, got {self.weight_only_gemm!r}")
        if not isinstance(self.dequantize_min_rows, int) or self.dequantize_min_rows < 0:
            raise ValueError(f"MatmulKernels.dequantize_min_rows: expected an integer >= 0, "
                             f"got {self.dequantize_min_rows!r}")
        if not isinstance(self.weight_only_panels, tuple) or not set(self.weight_only_panels) <= {"float32", "bfloat16"}:
            raise ValueError(f"MatmulKernels.weight_only_panels: expected a tuple of 'float32' and 'bfloat16' "
                             f"(the activations the panel kernel takes), got {self.weight_only_panels!r}")
        if not isinstance(self.min_16bit_rows, int) or self.min_16bit_rows < 1:
            raise ValueError(f"MatmulKernels.min_16bit_rows: expected an integer >= 1, got {self.min_16bit_rows!r}")


XLA_MATMULS = MatmulKernels()


@dataclasses.dataclass(frozen=True)
class KernelCapabilities:
    """The answer of :func:`capabilities` for one platform."""

    platform: str        # "cpu", "gpu", "tpu"
    device_count: int    # the platform's devices in this process (0: not asked; see capabilities)
    attention: Mapping[str, str | None]         # every implementation -> None when it runs here, else why not
    kv_in_place: Mapping[str, tuple[str, ...]]  # each implementation that runs here -> KV dtypes its write updates in place
    native_cpu: str | None  # None: the native CPU library is built and loaded; else why it is not used here
    matmuls: MatmulKernels

    @property
    def attention_impls(self) -> tuple[str, ...]:
        """The implementations that run here."""
        return tuple(name for name, why in self.attention.items() if why is None)

    def writes_in_place(self, impl: str, dtype: str) -> bool:
        """Whether ``impl``'s KV page write updates a ``dtype`` pool in place (else it would convert the
        whole pool at every layer)."""
        return dtype in self.kv_in_place.get(impl, ())

    @property
    def native_cpu_status(self) -> str:
        """For reports: "ready", "not used on <platform>", or the XLA fallback and why."""
        if self.native_cpu is None:
            return "ready"
        if self.platform != "cpu":
            return self.native_cpu
        return f"unavailable, XLA fallback in use: {self.native_cpu}"


def capabilities(platform: str | None = None, device_count: int | None = None) -> KernelCapabilities:
    """What the kernels can do on ``platform`` (default: JAX's default backend) with ``device_count``
    devices in the process (default: asked of JAX for the CPU and the default backend; 0, "not
    asked", for another platform, e.g. one this host only lowers for).

    On CPU this builds the native library the first time (see ``native.py``: cached on disk, tried
    once per process).
    """
    platform = (platform or jax.default_backend()).lower()
    platform = "gpu" if platform in GPU_PLATFORMS else platform
    if device_count is None:
        device_count = jax.device_count(platform) if platform in ("cpu", jax.default_backend()) else 0
    native_cpu = _native_cpu(platform)
    attention = _attention(platform, native_cpu)
    kv_in_place = {name: _kv_in_place(platform, name) for name, why in attention.items() if why is None}
    return KernelCapabilities(platform, device_count, types.MappingProxyType(attention),
                              types.MappingProxyType(kv_in_place), native_cpu, _matmuls(platform, device_count, native_cpu))


def _native_cpu(platform: str) -> str | None:
    if platform != "cpu":
        return f"not used on {platform}"  # not built: nothing of it would run
    return native.unavailable_reason()


def _attention(platform: str, native_cpu: str | None) -> dict[str, str | None]:
    """Every implementation -> None when it runs on ``platform``, else why not. ``pallas`` runs
    everywhere (interpreted on CPU: tests only, orders of magnitude slower)."""
    why: dict[str, str | None] = dict.fromkeys(ATTENTION_IMPLS)
    why["native"] = native_cpu if platform == "cpu" else f"the native kernel runs on CPU only, not {platform}"
    why["jax_tpu"] = jax_tpu.available() if platform == "tpu" else f"jax's TPU kernel runs on TPU only, not {platform}"
    return why


def _kv_in_place(platform: str, impl: str) -> tuple[str, ...]:
    """KV dtypes ``impl``'s page write updates in place on ``platform``. The native write aliases
    float32, bf16 and 8-bit float pools; every other implementation writes through XLA's scatter
    (``kv_write.py``), which XLA:CPU does in place for float32 only (16-bit pools are converted
    whole, at every layer)."""
    if impl == "native":
        return ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2")
    return ("float32",) if platform == "cpu" else FLOAT_DTYPES


def _matmuls(platform: str, device_count: int, native_cpu: str | None) -> MatmulKernels:
    """The native matmuls on a process with one CPU device where the library loads, and oneDNN's
    where this CPU is in :data:`ONEDNN_FASTER`; XLA's dot otherwise (several devices: sharded or
    replicated programs, which the custom calls do not partition)."""
    if platform != "cpu":
        return XLA_MATMULS
    kernel = NATIVE if device_count == 1 and native_cpu is None else XLA
    onednn = _onednn_faster() if device_count == 1 else NOT_FASTER
    if (onednn[0] or onednn[2]) and onednn_unavailable(platform) is not None:  # built only where the table uses it
        onednn = NOT_FASTER
    nk_dtypes, nk_min_inputs = _xla_weights_nk() if device_count == 1 else ((), 0)
    gemm = kernel == NATIVE and native.panel_gemm()
    dequantize_min_rows = _dequantize_float_rows() if gemm else 0
    # panels where the native kernel takes every row count oneDNN does not: not beside XLA's dot
    panels = gemm and not dequantize_min_rows and native.stored_panels()
    w8a8_tiles = kernel == NATIVE and native.w8a8_matmul_ready()
    return MatmulKernels(one_row=kernel, weight_only=kernel, min_16bit_rows=CPU_MIN_16BIT_ROWS,
                         onednn_dtypes=onednn[0], onednn_min_weight_bytes=onednn[1], onednn_weight_only=onednn[2],
                         xla_weights_nk=nk_dtypes, xla_weights_nk_min_inputs=nk_min_inputs, elementwise=kernel,
                         weight_only_gemm=gemm, dequantize_min_rows=dequantize_min_rows,
                         weight_only_panels=("float32", "bfloat16") if panels else (), w8a8_tiles=w8a8_tiles)


def _xla_weights_nk() -> tuple[tuple[str, ...], int]:
    """(dtypes, fewest inputs) of the float weights XLA's dot multiplies faster held [N, K] on this
    CPU, from :data:`XLA_WEIGHTS_NK` (the first row whose flags match); ((), 0) elsewhere."""
    flags = set(native.cpu_features())
    for has, lacks, dtypes, min_inputs in XLA_WEIGHTS_NK:
        if has in flags and (lacks is None or lacks not in flags):
            return dtypes, min_inputs
    return (), 0


def _dequantize_float_rows() -> int:
    """:data:`DEQUANTIZE_FLOAT_ROWS` for this CPU (the first row that matches it); 0 elsewhere."""
    flags, halves = set(native.cpu_features()), cpu_isa.splits_256bit_vectors()
    return next((rows for flag, on_halves, rows in DEQUANTIZE_FLOAT_ROWS
                 if flag in flags and on_halves in (None, halves)), 0)


def onednn_unavailable(platform: str = "cpu") -> str | None:
    """None when oneDNN's matmul is built and loaded here; else why not."""
    if platform != "cpu":
        return f"oneDNN's matmul is used on CPU only, not {platform}"
    return onednn.unavailable_reason()


def _onednn_faster() -> tuple[tuple[str, ...], int, tuple[str, ...]]:
    """(dtypes, smallest weight in bytes) of the packed weights whose products oneDNN runs faster than
    XLA's dot on this CPU, and the activation dtypes of the weight-only products it runs faster,
    from :data:`ONEDNN_FASTER` (the first row whose CPU flag is present)."""
    flags = set(native.cpu_features())
    for flag, *faster in ONEDNN_FASTER:
        if flag in flags:
            return tuple(faster)
    return NOT_FASTER


def choose_matmuls(cpu_matmul: str = "auto", platform: str | None = None) -> tuple[MatmulKernels, str]:
    """(where the model's products run, why) for the engine option ``cpu_matmul``: ``"auto"``
    takes :func:`capabilities`' choice, ``"xla"`` keeps every multi-row product on XLA's dot with
    the weights as the model holds them (the plain baseline for A/B runs), ``"onednn"`` packs every
    weight of the linear layers in a dtype oneDNN has a matmul for here (float32; bf16 with
    AVX-512) for oneDNN (an error where it is unavailable). The one place the choice is made."""
    if cpu_matmul not in CPU_MATMUL_CHOICES:
        raise ValueError(f"cpu_matmul: invalid value {cpu_matmul!r}; valid: {CPU_MATMUL_CHOICES}")
    caps = capabilities(platform)
    chosen = caps.matmuls
    if caps.platform != "cpu":
        return chosen, f"{caps.platform}: XLA's dot"
    if cpu_matmul == XLA:
        return dataclasses.replace(chosen, onednn_dtypes=(), onednn_weight_only=(), xla_weights_nk=(),
                                   weight_only_gemm=False, dequantize_min_rows=0, weight_only_panels=(),
                                   w8a8_tiles=False), "asked for"
    if cpu_matmul == ONEDNN:
        why = onednn_unavailable()
        if why is not None:
            raise ValueError(f"cpu_matmul='onednn': oneDNN's matmul is unavailable here ({why}); valid here: "
                             f"'auto' or 'xla'")
        if caps.device_count != 1:
            raise ValueError(f"cpu_matmul='onednn' runs on one CPU device, not {caps.device_count}; valid here: "
                             f"'auto' or 'xla'")
        dtypes = tuple(d for d in ("float32", "bfloat16") if onednn.has_matmul(d))  # bf16 needs AVX-512
        weight_only = ("bfloat16",) if "avx512_bf16" in native.cpu_features() else ()
        return dataclasses.replace(chosen, onednn_dtypes=dtypes, onednn_min_weight_bytes=0,
                                   onednn_weight_only=weight_only), "asked for"
    if chosen.onednn_dtypes:
        return chosen, (f"CPU: oneDNN for the products of {'/'.join(chosen.onednn_dtypes)} weights of "
                        f"{chosen.onednn_min_weight_bytes >> 20}+ MiB, packed at start-up, and of int8/int4 weights "
                        f"with {'/'.join(chosen.onednn_weight_only) or 'no'} activations (measured faster than "
                        f"XLA's dot on this CPU kind)")
    if chosen.onednn_weight_only:
        return chosen, (f"CPU: XLA's dot for float weights; oneDNN for int8/int4 weights with "
                        f"{'/'.join(chosen.onednn_weight_only)} activations (measured faster on this CPU kind)")
    if caps.device_count != 1:
        return chosen, f"CPU: XLA's dot ({caps.device_count} CPU devices: the custom call is not partitioned)"
    if not any(_onednn_faster()):
        return chosen, "CPU: XLA's dot (oneDNN not measured faster on this CPU kind)"
    return chosen, f"CPU: XLA's dot (oneDNN unavailable: {onednn_unavailable()})"
