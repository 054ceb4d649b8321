"""oneDNN's matmul for XLA:CPU (``cpu/onednn_matmul.cc``), called through XLA's FFI: the products
of a prefill or a batch of decodes, where oneDNN's AMX and AVX-512 kernels outrun XLA's dot.

oneDNN comes from PyPI: ``onednn-cpu-gomp`` (the library, built with GNU OpenMP, which every Linux
with gcc has) and ``onednn-devel-cpu-gomp`` (its headers), default dependencies on x86-64 Linux.
``$JAXRUNNER_ONEDNN_DIR`` names another install instead (a prefix holding ``include/oneapi/dnnl``
and ``lib/libdnnl.so.3``). The glue is compiled on first use like the native kernels
(``native.py``: against the installed jaxlib's FFI headers, cached on disk); without oneDNN, a
compiler or a successful build, :func:`unavailable_reason` says why and the products stay on XLA.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import logging
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.kernels import native

logger = logging.getLogger("jaxrunner")

SOURCE = native.CPU_DIR / "onednn_matmul.cc"
TARGET_NAME = "jaxrunner_cpu_onednn_matmul"
SYMBOL = "JaxrunnerCpuOnednnMatmul"
LIBRARY = "libdnnl.so.3"
HEADER = "oneapi/dnnl/dnnl.hpp"
DISTRIBUTIONS = ("onednn-cpu-gomp", "onednn-devel-cpu-gomp")  # the library, its headers
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC")  # the glue only: oneDNN picks its kernels at run time


def find_onednn() -> tuple[Path, Path]:
    """(include directory, library directory) of the oneDNN in use; raises
    :class:`native.NativeKernelUnavailable` saying what is missing."""
    root = os.environ.get("JAXRUNNER_ONEDNN_DIR")
    if root:
        include, lib = Path(root) / "include", Path(root) / "lib"
    else:
        include = _installed_dir(DISTRIBUTIONS[1], HEADER)
        lib = _installed_dir(DISTRIBUTIONS[0], LIBRARY)
    for path in (include / HEADER, lib / LIBRARY):
        if not path.exists():
            raise native.NativeKernelUnavailable(f"oneDNN not found: no {path} (pip install {' '.join(DISTRIBUTIONS)}, "
                                                 f"or set JAXRUNNER_ONEDNN_DIR to a prefix holding include/ and lib/)")
    return include, lib


def _installed_dir(distribution: str, suffix: str) -> Path:
    """The directory a wheel installed ``suffix`` under (its files sit in the environment's
    ``include/`` and ``lib/``, outside site-packages)."""
    try:
        files = importlib.metadata.distribution(distribution).files or ()
    except importlib.metadata.PackageNotFoundError:
        raise native.NativeKernelUnavailable(f"oneDNN not installed (pip install {' '.join(DISTRIBUTIONS)})") from None
    for file in files:
        if str(file).endswith(suffix):
            located = Path(file.locate()).resolve()
            return Path(str(located)[: -len(suffix)])
    raise native.NativeKernelUnavailable(f"{distribution} holds no {suffix}")


def _load() -> None:
    include, lib = find_onednn()
    cxx = native.compiler()
    flags = (*FLAGS, f"-I{include}")
    path = native.library_path(TARGET_NAME, cxx, (SOURCE, include / HEADER), (*flags, str(lib)))
    if not path.exists():
        native.build_library(cxx, path, (SOURCE,), flags, (f"-L{lib}", f"-l:{LIBRARY}", f"-Wl,-rpath,{lib}"))
    library = ctypes.cdll.LoadLibrary(str(path))
    jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(getattr(library, SYMBOL)), platform="cpu")


@functools.cache
def unavailable_reason() -> str | None:
    """None when oneDNN's matmul is ready; otherwise why not (tried once per process, logged once)."""
    try:
        _load()
    except (native.NativeKernelUnavailable, OSError, AttributeError, subprocess.SubprocessError) as err:
        logger.info("oneDNN matmul unavailable (%s); the model's products use XLA's dot", err)
        return str(err)
    return None


def onednn_supported(x, w, transposed: bool) -> bool:
    """Shapes and dtypes :func:`onednn_matmul` takes: ``x`` [M, K] and ``w`` [K, N] ([N, K] when
    ``transposed``), both bf16 or both float32."""
    if x.ndim != 2 or w.ndim != 2 or x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float32):
        return False
    return x.shape[1] == (w.shape[1] if transposed else w.shape[0])


def onednn_matmul(x, w, *, transposed: bool = False):
    """``x @ w`` (``x @ w.T`` when ``transposed``) with a float32 result, on oneDNN."""
    reason = unavailable_reason()
    if reason is not None:
        raise native.NativeKernelUnavailable(reason)
    if not onednn_supported(x, w, transposed):
        raise ValueError(f"the oneDNN matmul takes x [M, K] and w [K, N] (or [N, K] transposed), both bf16 or both "
                         f"float32; got x {x.dtype}{list(x.shape)}, w {w.dtype}{list(w.shape)}, transposed={transposed}")
    n = w.shape[0] if transposed else w.shape[1]
    call = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, w, transposed=np.int64(transposed))
