"""The compute dtype ``dtype="auto"`` (and ``"float16"``) resolve to on the device at hand.

A dtype only pays when the device computes in it natively. On CPU that is float32 everywhere and
bfloat16 only where the CPU has bf16 dot products (AVX512-BF16 or AMX-BF16): without them XLA
emulates bf16 through float32 conversions and a bf16 model runs slower than a float32 one. The
flags are read from the running machine; nothing is assumed about it. float16 is not computed on
CPU at all (XLA:CPU emulates it, and the KV page write does not take it), and on TPU it is slow:
both get bfloat16 (CPU: float32 without native bf16).
"""
from __future__ import annotations

from jaxrunner import kernels

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether ``flags`` (default: the CPU's as the kernels see them, ``kernels.cpu_flags``, which
    ``JAXRUNNER_CPU_MAX_ISA`` caps) name bf16 dot products."""
    flags = kernels.cpu_flags() if flags is None else flags
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def choose_dtype(requested: str, checkpoint_dtype: str, platform: str,
                 native_bf16: bool | None = None) -> tuple[str, str]:
    """(compute dtype, why) for ``requested`` ("auto" or a dtype) and a checkpoint stored as
    ``checkpoint_dtype`` ("float32", "bfloat16", "float16" or "quantized") on ``platform``."""
    if platform == "cpu":
        bf16 = cpu_has_native_bf16() if native_bf16 is None else native_bf16
        cpu_half = "bfloat16" if bf16 else "float32"
        cpu_why = ("the CPU has native bf16 dot products (avx512_bf16/amx_bf16)" if bf16 else
                   "the CPU has no native bf16 dot products (no avx512_bf16/amx_bf16 flag)")
        if requested == "float16":
            return cpu_half, f"float16 is not computed on CPU; {cpu_half} instead: {cpu_why}"
        if requested != "auto":
            return requested, "requested"
        if checkpoint_dtype == "float32":
            return "float32", "auto: the checkpoint is float32"
        return cpu_half, f"auto: the checkpoint is {checkpoint_dtype}; {cpu_half} because {cpu_why}"
    if platform == "tpu" and (requested == "float16" or requested == "auto" and checkpoint_dtype == "float16"):
        return "bfloat16", "float16 is slow on TPU; bfloat16 instead"
    if requested != "auto":
        return requested, "requested"
    if checkpoint_dtype == "quantized":
        return "bfloat16", f"auto: a quantized checkpoint computes in bfloat16 on {platform}"
    return checkpoint_dtype, f"auto: the checkpoint's dtype ({checkpoint_dtype}), native on {platform}"
