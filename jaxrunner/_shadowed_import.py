"""Load the installed package that a same-named folder of this checkout shadows on sys.path.

The repository keeps the kernels in a top-level folder `kernels/` (installed as ``jaxrunner.kernels``).
A process started from the repository root has the root on sys.path, so ``import kernels`` would find
that folder before the PyPI project of the same name, which transformers imports. This module finds
where the import would have gone without the checkout and loads that instead.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType


def _shadowing_root(spec: importlib.machinery.ModuleSpec) -> str:
    """The sys.path entry that holds the shadowing package (the folder above its ``__init__.py``)."""
    return os.path.realpath(os.path.dirname(os.path.dirname(spec.origin)))


def _entries_without(root: str) -> list[str]:
    return [entry for entry in sys.path if os.path.realpath(entry or os.getcwd()) != root]


def load_shadowed_package(name: str, shadowing: importlib.machinery.ModuleSpec) -> ModuleType | None:
    """Execute and return the package ``name`` as it is installed apart from the shadowing folder, or
    None when nothing else provides it. The caller puts the result in ``sys.modules``."""
    root = _shadowing_root(shadowing)
    spec = None
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            spec = finder.find_spec(name, _entries_without(root))
        elif hasattr(finder, "find_spec"):
            spec = finder.find_spec(name, None)
        if spec is not None and spec.origin and os.path.realpath(spec.origin).startswith(root + os.sep + name):
            spec = None  # the shadowing folder itself, found by another finder
        if spec is not None:
            break
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its own submodule imports find their parent while it executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
