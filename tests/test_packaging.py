"""`kernels/` is installed as `jaxrunner.kernels` only: the top-level name `kernels` belongs to another
PyPI project, which transformers 5.x depends on and imports names from.

A process started from the repository root (a script, a notebook, `python -m jaxrunner`) has the root
on sys.path, where the checkout's `kernels/` folder comes first. These tests start processes there.
`tests/test_cli.py` runs `python -m jaxrunner generate --model <tiny HF directory>` from the root and
`tests/test_device_check.py` runs `scripts/device_check.sh --smoke`, which starts there too.
"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tempfile
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, cwd: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=env)


def _kernels_distribution_installed() -> bool:
    try:
        importlib.metadata.version("kernels")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_top_level_kernels_is_never_ours_from_a_neutral_directory():
    with tempfile.TemporaryDirectory() as neutral:
        result = _run("import kernels; print(kernels.__file__)", neutral)
    if _kernels_distribution_installed():
        assert result.returncode == 0, result.stderr
        assert not os.path.realpath(result.stdout.strip()).startswith(REPO + os.sep)
    else:
        assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr


def test_transformers_imports_cleanly_from_the_repo_root():
    """With the `kernels` distribution installed (transformers 5.x brings it), `import kernels` from the
    root is that distribution, and transformers' hub-kernel integration imports its names from it."""
    code = textwrap.dedent("""
        import kernels
        import transformers.integrations.hub_kernels
        import transformers.models.llama.modeling_llama
        from transformers.utils import is_kernels_available
        import jaxrunner.kernels as ours
        print(kernels.__file__)
        print(is_kernels_available())
        assert callable(ours.ragged_paged_attention)
        assert not hasattr(kernels, "ragged_paged_attention")
    """)
    result = _run(code, REPO)
    assert result.returncode == 0, result.stderr
    where, available = result.stdout.split()
    if _kernels_distribution_installed():
        assert not os.path.realpath(where).startswith(REPO + os.sep), where
    else:  # an empty stand-in, which transformers reports as absent
        assert where == "None" and available == "False"


def _package(root: str, name: str, init: str) -> None:
    os.makedirs(os.path.join(root, name))
    with open(os.path.join(root, name, "__init__.py"), "w", encoding="utf-8") as f:
        f.write(init)


SHADOWING_INIT = textwrap.dedent("""
    import sys
    from jaxrunner._shadowed_import import load_shadowed_package
    installed = load_shadowed_package(__name__, __spec__)
    if installed is not None:
        sys.modules[__name__] = installed
    else:
        __path__ = []
        ORIGIN = "stand-in"
""")


def test_a_shadowing_folder_loads_the_installed_package_or_stands_in_empty(tmp_path):
    """The mechanism the checkout's `kernels/__init__.py` uses, on a package name of the test's own:
    the first folder on the path steps aside for a second one, and stays empty when there is none."""
    first, second = str(tmp_path / "checkout"), str(tmp_path / "site")
    _package(first, "shadowed_pkg", SHADOWING_INIT)
    _package(second, "shadowed_pkg", "ORIGIN = 'installed'\nfrom shadowed_pkg.sub import VALUE\n")
    with open(os.path.join(second, "shadowed_pkg", "sub.py"), "w", encoding="utf-8") as f:
        f.write("VALUE = 42\n")
    code = "import shadowed_pkg; from shadowed_pkg import sub; print(shadowed_pkg.ORIGIN, sub.VALUE)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([first, second]))
    found = _run(code, first, env)
    assert found.returncode == 0 and found.stdout.split() == ["installed", "42"], found.stderr
    env["PYTHONPATH"] = first
    alone = _run("import shadowed_pkg; print(shadowed_pkg.ORIGIN, shadowed_pkg.__path__)", first, env)
    assert alone.returncode == 0 and alone.stdout.split() == ["stand-in", "[]"], alone.stderr
