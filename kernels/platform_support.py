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

from jaxrunner.kernels.names import ATTENTION_IMPLS

GPU_PLATFORMS = ("gpu", "cuda", "rocm")
XLA, NATIVE = "xla", "native"
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# XLA:CPU routes a one-row 16-bit dot to a GEMV that measured 9x slower than the same dot with
# four rows (tied LM head [1, 576] x [49152, 576]: 37 vs 4.8 ms), so such dots are padded to four.
CPU_MIN_16BIT_ROWS = 4


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

    Frozen and hashable: it is part of the jitted step's static arguments.
    """

    one_row: str = XLA
    weight_only: str = XLA
    min_16bit_rows: int = 1

    def __post_init__(self):
        for name in ("one_row", "weight_only"):
            if getattr(self, name) not in (XLA, NATIVE):
                raise ValueError(f"MatmulKernels.{name}: expected {XLA!r} or {NATIVE!r}, got {getattr(self, name)!r}")
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
    from jaxrunner.kernels import native

    return native.unavailable_reason()


def _attention(platform: str, native_cpu: str | None) -> dict[str, str | None]:
    """Every implementation -> None when it runs on ``platform``, else why not. ``pallas`` runs
    everywhere (interpreted on CPU: tests only, orders of magnitude slower)."""
    from jaxrunner.kernels import jax_tpu

    why: dict[str, str | None] = dict.fromkeys(ATTENTION_IMPLS)
    why["native"] = native_cpu if platform == "cpu" else f"the native kernel runs on CPU only, not {platform}"
    why["jax_tpu"] = jax_tpu.available() if platform == "tpu" else f"jax's TPU kernel runs on TPU only, not {platform}"
    return why


def _kv_in_place(platform: str, impl: str) -> tuple[str, ...]:
    """KV dtypes ``impl``'s page write updates in place on ``platform``. The native write aliases
    float32 and bf16 pools; every other implementation writes through XLA's scatter
    (``kv_write.py``), which XLA:CPU does in place for float32 only (16-bit pools are converted
    whole, at every layer)."""
    if impl == "native":
        return ("float32", "bfloat16")
    return ("float32",) if platform == "cpu" else FLOAT_DTYPES


def _matmuls(platform: str, device_count: int, native_cpu: str | None) -> MatmulKernels:
    """The native matmuls on a process with one CPU device where the library loads; XLA's dot
    otherwise (several devices: sharded or replicated programs, which the custom calls do not
    partition)."""
    if platform != "cpu":
        return XLA_MATMULS
    kernel = NATIVE if device_count == 1 and native_cpu is None else XLA
    return MatmulKernels(one_row=kernel, weight_only=kernel, min_16bit_rows=CPU_MIN_16BIT_ROWS)
