"""oneDNN's matmul for XLA:CPU (``cpu/onednn_matmul.cc``), called through XLA's FFI, on weights
packed once into oneDNN's blocked layout (:class:`OnednnPackedWeight`): where oneDNN's AMX
kernels outrun XLA's dot, the model's products of every row count go there.

oneDNN comes from PyPI: ``onednn-cpu-gomp`` (the library, built with GNU OpenMP, which every Linux
with gcc has) and ``onednn-devel-cpu-gomp`` (its headers), default dependencies on x86-64 Linux.
``$JAXRUNNER_ONEDNN_DIR`` names another install instead (a prefix holding ``include/oneapi/dnnl``
and ``lib/libdnnl.so.3``). The glue is compiled on first use like the native kernels
(``native.py``: against the installed jaxlib's FFI headers, cached on disk); without oneDNN, a
compiler or a successful build, :func:`unavailable_reason` says why and the products stay on XLA.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.metadata
import logging
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxrunner.kernels import cpu_isa, native
from jaxrunner.kernels.quant_panels import PanelWeight

logger = logging.getLogger("jaxrunner")

SOURCE = native.CPU_DIR / "onednn_matmul.cc"
TARGET_NAME = "jaxrunner_cpu_onednn_matmul"
PACK_TARGET, UNPACK_TARGET = "jaxrunner_cpu_onednn_pack", "jaxrunner_cpu_onednn_unpack"
QUANT_TARGET, PANEL_TARGET = "jaxrunner_cpu_onednn_quant_matmul", "jaxrunner_cpu_onednn_panel_matmul"
SYMBOLS = {TARGET_NAME: "JaxrunnerCpuOnednnMatmul", PACK_TARGET: "JaxrunnerCpuOnednnPack",
           UNPACK_TARGET: "JaxrunnerCpuOnednnUnpack", QUANT_TARGET: "JaxrunnerCpuOnednnQuantMatmul",
           PANEL_TARGET: "JaxrunnerCpuOnednnPanelMatmul"}
LIBRARY = "libdnnl.so.3"
HEADER = "oneapi/dnnl/dnnl.hpp"
DISTRIBUTIONS = ("onednn-cpu-gomp", "onednn-devel-cpu-gomp")  # the library, its headers
# the glue only (oneDNN picks its kernels at run time); OpenMP to keep oneDNN on one thread per half;
# no contraction into fused multiply-adds, so that unpacked weights round as quant.dequantize rounds them
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off")


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


def _load() -> ctypes.CDLL:
    include, lib = find_onednn()
    capped = cpu_isa.onednn_max_isa()
    if capped is not None:  # read by oneDNN when it first dispatches; a value already set is kept
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", capped)
    cxx = native.compiler()
    flags = (*FLAGS, f"-I{include}")
    headers = (native.CPU_DIR / name for name in ("helper_thread.h", "dequantize_tile.h", "transpose.h", "work_queue.h"))
    path = native.library_path(TARGET_NAME, cxx, (SOURCE, *headers, include / HEADER),
                               (*flags, str(lib)))
    if not path.exists():
        native.build_library(cxx, path, (SOURCE,), flags, (f"-L{lib}", f"-l:{LIBRARY}", f"-Wl,-rpath,{lib}"))
    library = ctypes.cdll.LoadLibrary(str(path))
    for target, symbol in SYMBOLS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    library.JaxrunnerOnednnPackedBytes.restype = ctypes.c_int64
    library.JaxrunnerOnednnPackedBytes.argtypes = (ctypes.c_int64,) * 3
    return library


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The loaded glue, or why it could not be built or loaded (tried once per process, logged once)."""
    try:
        return _load()
    except (native.NativeKernelUnavailable, OSError, AttributeError, subprocess.SubprocessError) as err:
        logger.info("oneDNN matmul unavailable (%s); the model's products use XLA's dot", err)
        return str(err)


def unavailable_reason() -> str | None:
    """None when oneDNN's matmul is ready; otherwise why not."""
    library = _library()
    return library if isinstance(library, str) else None


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class OnednnPackedWeight:
    """A [K, N] weight in oneDNN's blocked layout: ``data`` holds the bytes, the rest is static.
    ``transposed``: the plain weight it came from was [N, K] (an embedding's orientation), which
    :func:`onednn_unpack` gives back."""
    data: jax.Array
    k: int
    n: int
    dtype: str
    transposed: bool

    def tree_flatten(self):
        return (self.data,), (self.k, self.n, self.dtype, self.transposed)

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(children[0], *static)

    @property
    def plain_shape(self) -> tuple[int, int]:
        return (self.n, self.k) if self.transposed else (self.k, self.n)


def packed_bytes(k: int, n: int, dtype) -> int:
    """Bytes of a [K, N] weight of ``dtype`` (bf16 or float32) once packed."""
    library = _library()
    if isinstance(library, str):
        raise native.NativeKernelUnavailable(library)
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"oneDNN packs bf16 or float32 weights, not {jnp.dtype(dtype).name}")
    size = library.JaxrunnerOnednnPackedBytes(k, n, int(jnp.dtype(dtype) == jnp.bfloat16))
    if size < 0:
        raise ValueError(f"oneDNN has no matmul for a [{k}, {n}] {jnp.dtype(dtype).name} weight")
    return size


def has_matmul(dtype) -> bool:
    """Whether oneDNN has a matmul for ``dtype`` (bf16 or float32) weights on this CPU: its bf16
    kernels need AVX-512 at least, so a CPU with AVX2 alone has float32 only."""
    try:
        packed_bytes(64, 64, dtype)
    except (ValueError, native.NativeKernelUnavailable):
        return False
    return True


def onednn_pack(w: jax.Array, *, transposed: bool = False) -> OnednnPackedWeight:
    """``w`` ([K, N]; [N, K] when ``transposed``, bf16 or float32) packed for :func:`onednn_matmul`."""
    if w.ndim != 2:
        raise ValueError(f"oneDNN packs 2-D weights; got shape {list(w.shape)}")
    k, n = (w.shape[1], w.shape[0]) if transposed else w.shape
    size = packed_bytes(k, n, w.dtype)
    data = _pack_call(w, size, transposed)
    return OnednnPackedWeight(data, int(k), int(n), jnp.dtype(w.dtype).name, bool(transposed))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _pack_call(w, size: int, transposed: bool):
    call = jax.ffi.ffi_call(PACK_TARGET, jax.ShapeDtypeStruct((size,), jnp.uint8))
    return call(w, transposed=np.int64(transposed))


def onednn_unpack(packed: OnednnPackedWeight) -> jax.Array:
    """The plain weight ``packed`` was made from, bit for bit."""
    return _unpack_call(packed.data, packed.plain_shape, packed.dtype, packed.transposed)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _unpack_call(data, shape, dtype: str, transposed: bool):
    call = jax.ffi.ffi_call(UNPACK_TARGET, jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)))
    return call(data, transposed=np.int64(transposed))


def onednn_matmul(x: jax.Array, w: OnednnPackedWeight) -> jax.Array:
    """``x`` [M, K] times the packed weight, float32 [M, N], on oneDNN (each half of the columns on
    one core)."""
    if x.ndim != 2 or x.shape[1] != w.k or jnp.dtype(x.dtype).name != w.dtype:
        raise ValueError(f"the oneDNN matmul takes x [M, {w.k}] {w.dtype} for this packed weight; got x "
                         f"{jnp.dtype(x.dtype).name}{list(x.shape)}")
    call = jax.ffi.ffi_call(TARGET_NAME, jax.ShapeDtypeStruct((x.shape[0], w.n), jnp.float32))
    return call(x, w.data, n=np.int64(w.n))


def onednn_quant_matmul(x: jax.Array, w: dict) -> jax.Array:
    """``x`` [M, K] bf16 times a weight-only int4/int8 leaf (``jaxrunner/models/quant.py``, [N, K]
    orientation, as it is), float32 [M, N]: each tile of the weight's columns is unpacked into
    bf16 in oneDNN's AMX layout and multiplied while in cache (``cpu/dequantize_tile.h``). Needs
    AVX512-BF16; groups must be whole runs of 32 (:func:`native.quantized_matmul_supported`)."""
    if x.dtype != jnp.bfloat16 or not native.quantized_matmul_supported(x, w):
        raise ValueError(f"the oneDNN quantized matmul takes x [rows, K] bf16 and a weight-only leaf with groups "
                         f"of whole runs of 32; got x {x.dtype}{list(x.shape)}, packed "
                         f"{w['packed'].dtype}{list(w['packed'].shape)}, scales {list(w['scales'].shape)}")
    library = _library()
    if isinstance(library, str):
        raise native.NativeKernelUnavailable(library)
    call = jax.ffi.ffi_call(QUANT_TARGET, jax.ShapeDtypeStruct((x.shape[0], w["packed"].shape[0]), jnp.float32))
    return call(x, w["packed"], w["scales"], native.offsets_or_placeholder(w),
                has_offsets=np.int64("offsets" in w))


def onednn_panel_matmul(x: jax.Array, w: PanelWeight) -> jax.Array:
    """:func:`onednn_quant_matmul` for a weight laid out as panels (``quant_panels.py``): the same
    tiles, bit for bit, so the same float32 [M, N]."""
    if x.dtype != jnp.bfloat16 or x.ndim != 2 or x.shape[1] != w.k:
        raise ValueError(f"the oneDNN panel matmul takes x [rows, {w.k}] bf16; got x {x.dtype}{list(x.shape)}")
    library = _library()
    if isinstance(library, str):
        raise native.NativeKernelUnavailable(library)
    call = jax.ffi.ffi_call(PANEL_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.n), jnp.float32))
    return call(x, w.codes, w.scales, w.offsets_operand(), has_offsets=np.int64(w.offsets is not None), int4=np.int64(w.int4))
