"""The device check runs end to end as the GPU run starts it: ``scripts/device_check.sh --smoke`` (from
the repository root; CPU, tiny shapes, Pallas interpreted, a tiny engine from the committed assets)
writes every section's results; a section past its budget is killed and recorded, and the others
still run."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tarfile

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_device_check_smoke(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "device_check.sh"), "--smoke"], env=env,
                          capture_output=True, text=True, timeout=900)
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["smoke"] and report["backend"] == "cpu"
    assert report["ceilings"]["copy_gbps"] > 0 and report["ceilings"]["matmul_bf16_tflops"] > 0
    checks = report["correctness"]["records"]
    assert report["correctness"]["ok"] and {r["impl"] for r in checks} == {"pallas", "xla"}
    assert any(r["options"].get("num_splits") for r in checks)          # split-KV checked too
    assert any(r["case"].startswith("fuzz") for r in checks)
    assert all(r["ok"] and r["tolerance"] > 0 and r["max_abs_score"] > 0 for r in checks)
    assert report["smem"]["ok"] and all(r["lowered"] and r["estimate_bytes"] > 0
                                        for r in report["smem"]["records"])
    with tarfile.open(tmp_path / "kernel_ir.tar.gz") as tar:  # each kernel's Triton IR, as text
        for record in report["smem"]["records"]:
            (name,) = record["triton_ir"]
            assert "tt.func public" in tar.extractfile(name).read().decode()
    for section in ("decode", "prefill", "mixed"):
        records = report[section]["records"]
        assert records and all("ms" in r for r in records), records
        assert all("kernel_ms" in r and "wrapper_ms" in r for r in records if r["impl"] == "pallas")
    for section in ("ceilings", "smem", "correctness", "decode", "prefill", "mixed", "engine"):
        assert report[section]["ended"] == "exit 0" and report[section]["wall_s"] <= report[section]["budget_s"]
    engine = report["engine"]
    assert engine["ok"] and engine["serving_compiles"] == 0
    assert engine["generated_tokens"] == engine["requests"] * engine["new_tokens"]
    assert engine["attention_impl"] == "pallas" and engine["attention_self_check_max_abs_error"] < 1e-5
    assert engine["transformers"]["tokens_per_s"] > 0


def test_a_section_past_its_budget_is_killed_and_the_next_still_runs(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    script = REPO / "scripts" / "device_check.py"
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(tmp_path),
                           "--sections", "ceilings,smem", "--budget-scale", "0.005"],
                          env=env, capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert proc.returncode == 1 and "FAILED sections" in proc.stdout
    for section in ("ceilings", "smem"):   # budgets of 0.05 and 0.18 s: killed while importing JAX
        assert report[section]["ended"].startswith("killed after its budget") and report[section]["ok"] is False
