"""``JAXRUNNER_CPU_MAX_ISA`` (``kernels/cpu_isa.py``): the native kernels built and chosen as for an
older CPU, so that the branches an AVX2-only CPU or the portable vector code (ARM's) take are
tested on whatever machine runs the suite, not only on a machine of that kind."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrunner.kernels import cpu_isa, native
from jaxrunner.models.loading import precision

TESTS = Path(__file__).parent
# The kernels' own tests against their oracles; oneDNN's products are not the native kernels'.
KERNEL_TESTS = ("test_quant_matmul.py", "test_quant_panels.py", "test_small_matmul.py",
                "test_elementwise_kernels.py", "test_kernels.py", "test_sampler.py")
SELECTION = "not onednn and (native or not test_kernels)"
# and, for an AVX2 CPU, the engine on the weight-only routes its products take only there (the int8
# panel GEMM of w4a8, float32 panels, XLA's dot on unpacked weights from 512 rows): tokens agree
# with float weights and serving compiles nothing
ENGINE_TEST = "test_quant.py::test_quantized_engine_agrees_with_float_and_never_compiles_while_serving"
ENGINE_TESTS = {"avx2": [f"{ENGINE_TEST}[int4-auto-0.5]", f"{ENGINE_TEST}[w4a8-auto-0.5]"], "sse4_2": []}
# cap -> (XLA's name for it, a flag the machine must have to run the capped build, one it must have
# for the cap to lower anything: without it the uncapped run already takes that build's branches)
CAPS = {"avx2": ("AVX2", "avx2", "avx512f"), "sse4_2": ("SSE4_2", "sse4_2", "avx2")}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the caps are x86-64 levels")
def test_the_cap_hides_the_newer_flags_and_lowers_the_build(monkeypatch):
    uncapped_path = native.library_path("probe", "c++", ())
    monkeypatch.setenv(cpu_isa.MAX_ISA_ENV, "avx2")
    flags = cpu_isa.cpu_flags()
    assert not any(flag.startswith(("avx512", "amx")) for flag in flags)
    assert flags <= cpu_isa.machine_flags() and ("avx2" in flags) == ("avx2" in cpu_isa.machine_flags())
    assert native.compile_flags()[-1] == "-march=x86-64-v3" and cpu_isa.onednn_max_isa() == "AVX2"
    assert not precision.cpu_has_native_bf16()  # dtype="auto" resolves as on an AVX2 CPU: float32
    assert native.library_path("probe", "c++", ()) != uncapped_path  # a build of its own in the cache
    monkeypatch.setenv(cpu_isa.MAX_ISA_ENV, "SSE4_2")
    assert not any(flag.startswith(("avx", "fma", "f16c")) for flag in cpu_isa.cpu_flags())
    assert native.cpu_features() == [] and native.compile_flags()[-1] == "-march=x86-64-v2"
    monkeypatch.setenv(cpu_isa.MAX_ISA_ENV, "")
    assert cpu_isa.max_isa() is None and native.compile_flags()[-1] == "-march=native"


def test_an_unknown_cap_is_refused_naming_the_variable_and_the_values(monkeypatch):
    monkeypatch.setenv(cpu_isa.MAX_ISA_ENV, "avx512")
    with pytest.raises(ValueError, match=r"JAXRUNNER_CPU_MAX_ISA: invalid value 'avx512'; valid: avx2, sse4_2"):
        native.cpu_features()
    with pytest.raises(ValueError, match="JAXRUNNER_CPU_MAX_ISA"):
        precision.cpu_has_native_bf16()


def _why_not(cap: str) -> str | None:
    """Why this machine does not run the kernels capped at ``cap``; None when it does."""
    _, needs, lowers = CAPS[cap]
    machine = cpu_isa.machine_flags()
    if needs not in machine:
        return f"this CPU lacks {needs}: it cannot run a build capped at {cap}"
    if lowers not in machine:
        return f"this CPU lacks {lowers}: the suite's own run already takes the {cap} build's branches"
    return None


def _start(cap: str) -> subprocess.Popen:
    """The kernels' tests under ``cap`` in a process of their own (the cap must be set before
    anything reads the CPU's flags or builds the kernels)."""
    env = {**os.environ, cpu_isa.MAX_ISA_ENV: cap,
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_max_isa={CAPS[cap][0]}".strip()}
    runner = ("import sys, pytest\n"
              "from jaxrunner.kernels import native\n"
              "assert native.available(), native.unavailable_reason()  # built under the cap, or why not\n"
              "print('cpu_features', native.cpu_features(), native.compile_flags()[-1], flush=True)\n"
              "sys.exit(pytest.main(sys.argv[1:]))\n")
    files = [str(TESTS / name) for name in KERNEL_TESTS] + [str(TESTS / node) for node in ENGINE_TESTS[cap]]
    return subprocess.Popen([sys.executable, "-c", runner, "-q", "-p", "no:cacheprovider", "-k", SELECTION, *files],
                            env=env, cwd=TESTS, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def capped_runs():
    """Every cap this machine runs, started together: each spends much of its time compiling the
    kernels on one core, so two take little longer than one."""
    runs = {cap: _start(cap) for cap in CAPS if _why_not(cap) is None}
    yield runs
    for proc in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("cap", list(CAPS))
def test_the_kernels_pass_their_tests_built_for_an_older_cpu(cap, capped_runs):
    if _why_not(cap) is not None:
        pytest.skip(_why_not(cap))
    stdout, stderr = capped_runs[cap].communicate(timeout=900)
    assert capped_runs[cap].returncode == 0, stdout[-6000:] + stderr[-3000:]
    first = stdout.splitlines()[0]
    assert first.startswith("cpu_features") and "avx512f" not in first
    assert first.endswith(f"-march={cpu_isa.MAX_ISAS[cap][0]}"), first
    assert " passed" in stdout.splitlines()[-1]
