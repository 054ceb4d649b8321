"""The native kernels' helper thread (``kernels/cpu/helper_thread.h``) under back-to-back calls.

A C++ driver (``tests/native/helper_thread_stress.cc``) makes twenty million calls of two to nine
tiny items each and checks after every call that each item ran exactly once, the caller's items
a run from the front and the helper's a run from the back. The calls outnumber the claim word's
generations (2^24), so claims after it wraps are checked too. A helper that
arrived late to one call used to read the next call's item count before the next call's claim
word, claim an item past the old count, and run it: an item ran twice, and the next caller
either returned before its own items were done or waited forever (a batch-1 benchmark hung so).
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from jaxrunner.kernels import native

DRIVER = Path(__file__).with_name("native") / "helper_thread_stress.cc"
CALLS = 20_000_000


def test_every_item_runs_once_across_back_to_back_calls(tmp_path):
    try:
        cxx = native.compiler()
    except native.NativeKernelUnavailable as err:
        pytest.skip(str(err))
    exe = tmp_path / "helper_thread_stress"
    subprocess.run([cxx, "-O2", "-std=c++17", "-pthread", f"-I{native.CPU_DIR}", str(DRIVER), "-o", str(exe)],
                   check=True, capture_output=True)
    done = subprocess.run([str(exe), str(CALLS)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"ok {CALLS}", done.stdout
