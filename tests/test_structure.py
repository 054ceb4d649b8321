"""The package's import graph has no circle: every ``import`` of a ``jaxrunner`` module counts,
at module level, inside functions and under ``TYPE_CHECKING`` alike (a deferred import that closes a
circle still ties the two modules together). And an import inside a function says why it is not at the
top of its module, in a ``# lazy: <reason>`` comment."""
from __future__ import annotations

import ast
import io
import pathlib
import tokenize

import jaxrunner

PACKAGE = pathlib.Path(jaxrunner.__file__).parent
KERNELS = PACKAGE.parent / "kernels"  # installed as jaxrunner.kernels


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for root, prefix in ((PACKAGE, "jaxrunner"), (KERNELS, "jaxrunner.kernels")):
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


def _imports(path: pathlib.Path, modules: dict) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in modules}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def test_no_import_circles():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def _reason_lines(source: str) -> set[int]:
    """The lines holding a ``# lazy: <reason>`` comment (with a reason after the colon)."""
    return {token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT and token.string.startswith("# lazy:")
            and token.string[len("# lazy:"):].strip()}


def unreasoned_imports(source: str) -> list[int]:
    """The lines of the imports inside functions that give no reason: a ``# lazy:`` comment on the
    import's own lines, on the line just above it, or heading its run of consecutive imports."""
    tree, reasons = ast.parse(source), _reason_lines(source)
    head = {}  # each import -> the first import of its run of consecutive statements
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            previous = None
            statements = getattr(node, field, None)
            for stmt in statements if isinstance(statements, list) else []:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    head[stmt] = head[previous] if previous is not None else stmt
                    previous = stmt
                else:
                    previous = None

    def reasoned(node: ast.stmt) -> bool:
        return bool(reasons & set(range(node.lineno - 1, node.end_lineno + 1)))

    def inside_functions(node: ast.AST, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            yield from inside_functions(child, in_function or isinstance(child, (ast.FunctionDef,
                                                                                 ast.AsyncFunctionDef)))

    return sorted(node.lineno for node in inside_functions(tree, False)
                  if not reasoned(node) and not reasoned(head[node]))


def test_imports_inside_functions_give_a_reason():
    """Imports go at the top of their module; one inside a function is there for a reason (JAX kept
    out of ``import jaxrunner`` and ``jaxrunner --help``, an optional or heavy dependency), which a
    ``# lazy: <reason>`` comment gives."""
    root = PACKAGE.parent
    missing = []
    for path in sorted(_modules().values()):
        source = path.read_text()
        lines = source.splitlines()
        missing += [f"{path.relative_to(root)}:{line}: {lines[line - 1].strip()}"
                    for line in unreasoned_imports(source)]
    assert not missing, ("imports inside functions without a `# lazy: <reason>` comment (move them to the top of "
                         "the module, or say why they cannot be):\n" + "\n".join(missing))


def test_the_reason_finder_finds_an_import_without_one():
    source = """import os


def f():
    import json
    import re  # lazy: a reason on its own line


def g():
    # lazy: one reason heads the run of imports below it
    import json
    from typing import (Any,
                        List)

    import re
    x = "# lazy: not a comment"
    import ast
    import io  # lazy:
    if x:  # lazy: the line just above
        import sys
    lambda: sys
"""
    assert unreasoned_imports(source) == [5, 17, 18]
