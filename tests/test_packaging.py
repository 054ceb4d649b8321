"""`kernels/` is installed as `jaxrunner.kernels` only: the top-level name belongs to another project."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_top_level_kernels_is_not_installed():
    with tempfile.TemporaryDirectory() as neutral:
        result = _run("import kernels", neutral)
    assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr


def test_transformers_sees_no_kernels_package_from_the_repo_root():
    code = ("import transformers.models.llama.modeling_llama\n"
            "from transformers.utils import is_kernels_available\n"
            "import jaxrunner.kernels as k\n"
            "assert not is_kernels_available()\n"
            "assert callable(k.ragged_paged_attention)\n")
    result = _run(code, REPO)
    assert result.returncode == 0, result.stderr
