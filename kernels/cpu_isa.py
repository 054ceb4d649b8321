"""The CPU's feature flags as jaxrunner's CPU code sees them, and the one setting that lowers them.

Every choice made for the CPU at hand reads its flags here: the ``-march`` the native kernels are
built with (``native.py``), which products go to which kernel (``platform_support.py``), the dtype
``"auto"`` resolves to (``models/loading/precision.py``) and the benchmarks' record of the machine.

``JAXRUNNER_CPU_MAX_ISA`` caps them, as XLA's ``--xla_cpu_max_isa`` and oneDNN's
``ONEDNN_MAX_CPU_ISA`` cap their own code: ``avx2`` builds and chooses as for a CPU without AVX-512
or AMX (``-march=x86-64-v3``), ``sse4_2`` as for one without AVX either (``-march=x86-64-v2``: the
kernels' portable vector code, which ARM CPUs run too). Why: each CPU kind runs its own branch of
the kernels, and a machine runs only the branch of its kind. With the cap, a newer machine runs
and tests the branches an older one takes. XLA's own code keeps the machine's instructions unless
``XLA_FLAGS`` caps it as well; oneDNN is capped with it (``onednn.py``).
"""
from __future__ import annotations

import functools
import os
import platform

MAX_ISA_ENV = "JAXRUNNER_CPU_MAX_ISA"
# cap -> (the -march the kernels are built for, prefixes of the flags the cap hides, oneDNN's name)
MAX_ISAS = {
    "avx2": ("x86-64-v3", ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert"), "AVX2"),
    "sse4_2": ("x86-64-v2", ("avx", "amx", "fma", "f16c"), "SSE41"),
}


def max_isa() -> str | None:
    """The cap ``JAXRUNNER_CPU_MAX_ISA`` sets (None when unset or empty); a ValueError naming the
    variable and the valid values for any other value, or on a CPU that is not x86-64."""
    value = os.environ.get(MAX_ISA_ENV, "").strip().lower()
    if not value:
        return None
    if value not in MAX_ISAS:
        raise ValueError(f"{MAX_ISA_ENV}: invalid value {value!r}; valid: {', '.join(MAX_ISAS)} (or unset)")
    if platform.machine() not in ("x86_64", "AMD64"):
        raise ValueError(f"{MAX_ISA_ENV}={value} caps x86-64 CPUs; this one is {platform.machine()} (unset it)")
    return value


def first_cpu_fields(cpuinfo: str | None = None) -> dict[str, str]:
    """The ``key: value`` lines of the first processor in ``/proc/cpuinfo`` (or in ``cpuinfo``);
    empty where it is not readable."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                cpuinfo = f.read(16384)
        except OSError:
            return {}
    fields = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor is enough
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


@functools.cache
def machine_flags() -> frozenset[str]:
    """The feature flags the kernel reports for this CPU (empty where /proc/cpuinfo is not readable)."""
    fields = first_cpu_fields()
    return frozenset((fields.get("flags") or fields.get("Features") or "").split())


# AMD families whose 256-bit vector instructions run as two 128-bit halves: 0x15 (Bulldozer to
# Excavator), 0x16 (Jaguar, Puma), 0x17 below model 0x30 (Zen, Zen+; Zen 2 runs them whole) and
# 0x18 (Hygon's Dhyana, a Zen).
HALF_WIDTH_AMD = {0x15: 0x100, 0x16: 0x100, 0x17: 0x30, 0x18: 0x100}  # family -> the first model that is not


@functools.cache
def machine_model() -> tuple[str, int, int]:
    """(vendor, family, model) of this CPU from /proc/cpuinfo; -1 for what it does not say (Arm)."""
    fields = first_cpu_fields()
    family, model = (fields.get(key, "") for key in ("cpu family", "model"))
    return fields.get("vendor_id", ""), int(family) if family.isdigit() else -1, int(model) if model.isdigit() else -1


def splits_256bit_vectors() -> bool:
    """Whether this CPU runs each 256-bit vector instruction as two 128-bit halves (HALF_WIDTH_AMD):
    a property of the machine, which ``JAXRUNNER_CPU_MAX_ISA`` does not change."""
    vendor, family, model = machine_model()
    return vendor in ("AuthenticAMD", "HygonGenuine") and 0 <= model < HALF_WIDTH_AMD.get(family, 0)


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags, less those ``JAXRUNNER_CPU_MAX_ISA`` hides."""
    cap = max_isa()
    if cap is None:
        return machine_flags()
    hidden = MAX_ISAS[cap][1]
    return frozenset(flag for flag in machine_flags() if not flag.startswith(hidden))


def march() -> str:
    """The ``-march`` the native kernels are built with: the machine's own, or the cap's level."""
    cap = max_isa()
    return "-march=native" if cap is None else f"-march={MAX_ISAS[cap][0]}"


def onednn_max_isa() -> str | None:
    """oneDNN's name for the cap (its ``ONEDNN_MAX_CPU_ISA``), None without one."""
    cap = max_isa()
    return None if cap is None else MAX_ISAS[cap][2]
