"""The door between the engine and the runner: nothing under ``jaxrunner/engine/`` imports JAX, the
runner, the models or the kernels; nothing under ``jaxrunner/runner/`` imports the engine (no
``Request`` crosses); the protocol both sides share (``jaxrunner/executor_protocol.py``) imports
neither, nor JAX."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import jaxrunner

PACKAGE = pathlib.Path(jaxrunner.__file__).parent
DEVICE_CODE = ("jax", "jaxlib", "jaxrunner.runner", "jaxrunner.models", "jaxrunner.kernels", "jaxrunner.parallel",
               "kernels", "flax", "torch")
# what each side of the door may not import, and the files of each side
RULES = {
    "engine": (sorted((PACKAGE / "engine").glob("*.py")), DEVICE_CODE),
    "runner": (sorted((PACKAGE / "runner").glob("*.py")), ("jaxrunner.engine", "jaxrunner.engine_factory",
                                                          "jaxrunner.llm", "jaxrunner.async_llm")),
    "protocol": ([PACKAGE / "executor_protocol.py"], DEVICE_CODE + ("jaxrunner.engine",)),
    # parallelism is a leaf: head counts and rules come from its callers
    "parallel": (sorted((PACKAGE / "parallel").glob("*.py")), ("jaxrunner.models", "jaxrunner.runner",
                                                               "jaxrunner.engine", "jaxrunner.kernels")),
}


def _imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every module an ``import`` or ``from ... import`` names, anywhere in the file (also inside
    functions: a deferred import is still an import)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the engine package
                base = "jaxrunner.engine" if node.level == 1 else "jaxrunner"
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found += [(node.lineno, module)] + [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _is_forbidden(module: str, forbidden=DEVICE_CODE) -> bool:
    return any(module == name or module.startswith(name + ".") for name in forbidden)


@pytest.mark.parametrize("side", sorted(RULES))
def test_each_side_of_the_door_imports_only_the_protocol(side):
    modules, forbidden = RULES[side]
    assert len(modules) >= {"protocol": 1, "parallel": 3}.get(side, 8), modules  # the walk sees the package
    offending = [f"{path.name}:{line}: {module}" for path in modules
                 for line, module in _imported_modules(path) if _is_forbidden(module, forbidden)]
    assert offending == []


def test_no_request_object_reaches_the_runner():
    """Not even by name: the runner reads messages, never the engine's live objects."""
    modules, _ = RULES["runner"]
    offending = [f"{path.name}:{node.lineno}" for path in modules for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, (ast.Name, ast.Attribute)) and
                 (getattr(node, "id", None) == "Request" or getattr(node, "attr", None) == "request")]
    assert offending == []


def test_the_walk_catches_a_deferred_import(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from jaxrunner.runner import batch\n    import jax.numpy as jnp\n")
    assert [m for _, m in _imported_modules(sample) if _is_forbidden(m)] == [
        "jaxrunner.runner", "jaxrunner.runner.batch", "jax.numpy"]


def test_importing_the_engine_loads_no_jax():
    code = ("import sys, jaxrunner.engine.engine, jaxrunner.engine.loop, jaxrunner.sampling_params; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
