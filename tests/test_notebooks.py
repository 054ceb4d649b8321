"""The notebooks run headless, top to bottom, at tiny sizes (JAXRUNNER_NOTEBOOK_SMALL=1).

Each loads the real SmolLM2 model and starts an engine, so they are marked slow. They share one
persistent compilation cache with the CLI tests (JAXRUNNER_COMPILATION_CACHE, default
``$TMPDIR/jaxrunner-test-xla-cache``, set in conftest), so only the first run on a machine compiles from scratch.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import requires_smollm2
from engine_helpers import COMPILE_CACHE

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 900


def test_notebooks_exist_and_are_clean():
    """Three notebooks, committed without outputs (so diffs stay readable)."""
    nbformat = pytest.importorskip("nbformat")
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_paged_kv_cache.ipynb", "03_benchmarks.ipynb",
                                            "04_rl_weight_updates.ipynb"]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name}: outputs not cleared"
        assert "JAXRUNNER_NOTEBOOK_SMALL" in nb.cells[1].source, f"{path.name}: must honour JAXRUNNER_NOTEBOOK_SMALL"


@pytest.mark.slow
@requires_smollm2
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    # The kernel inherits this process's environment.
    monkeypatch.setenv("JAXRUNNER_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("JAXRUNNER_COMPILATION_CACHE", COMPILE_CACHE)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("TQDM_DISABLE", "1")

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()  # raises CellExecutionError naming the failing cell
    finally:
        keep = os.environ.get("JAXRUNNER_NOTEBOOK_OUTPUT_DIR")  # to look at the executed notebooks
        if keep:
            os.makedirs(keep, exist_ok=True)
            nbformat.write(nb, os.path.join(keep, path.name))

    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = sum(1 for c in nb.cells if c.cell_type == "code" for o in c.outputs
                 if o.output_type == "display_data" and "image/png" in o.get("data", {}))
    assert images >= 1, f"{path.name}: expected at least one figure"
