"""Start-up cost: nothing compiles twice, the persistent cache serves every executable, and the
report says where the time went."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import build_tiny_checkpoint
from engine_helpers import count_compilations, make_llm, random_prompts, token_ids
from jaxrunner import SamplingParams

# Options that change no shape: a second engine with them must reuse every executable.
SHAPE_PRESERVING = dict(seed=7, enable_prefix_caching=False, async_scheduling=False, memory_utilization=0.5,
                        enable_chunked_prefill=False)


def test_shape_preserving_options_compile_nothing(tiny_checkpoints):
    first = make_llm(tiny_checkpoints["llama"])
    prompts = random_prompts(3, 512, 4, 20)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = token_ids(first.generate(prompts, params))
    with count_compilations() as events:
        second = make_llm(tiny_checkpoints["llama"], **SHAPE_PRESERVING)
        assert token_ids(second.generate(prompts, params)) == expected
    assert events == []
    assert second.startup_report["persistent_cache"] == {"hits": 0, "misses": 0}  # all from this process's memory


def test_a_shape_change_compiles_again(tiny_checkpoints):
    """The sharing is by shape: a different pool size is a different program."""
    make_llm(tiny_checkpoints["llama"])
    with count_compilations() as events:
        make_llm(tiny_checkpoints["llama"], num_pages=80)
    assert "/jax/core/compile/jaxpr_trace_duration" in events


def _code_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts the process's memory mappings")
def test_a_dropped_engine_releases_its_executables(tmp_path):
    """JAX keeps what a jitted function compiled on the function: the shared step must die with the
    last engine using it, or every engine built and dropped leaves its code mapped (and a process
    building a few dozen reaches the kernel's mapping limit inside a compile). The model is one no
    other test serves: an engine of an earlier test, still held by its idle loop for a moment,
    would otherwise share the step being watched."""
    from jaxrunner.runner import model_runner

    model = build_tiny_checkpoint(tmp_path / "llama-vocab384", "llama", vocab_size=384)
    gc.collect()
    before_keys, before_maps = set(model_runner._SHARED_STEPS.keys()), _code_mappings()
    llm = make_llm(model, num_pages=72)
    llm.generate(random_prompts(2, 384, 4, 12), SamplingParams(max_tokens=3))
    added = _code_mappings() - before_maps
    assert set(model_runner._SHARED_STEPS.keys()) - before_keys
    del llm
    deadline = time.monotonic() + 30  # the engine loop lets go of the engine once idle
    while set(model_runner._SHARED_STEPS.keys()) - before_keys and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.2)
    assert not set(model_runner._SHARED_STEPS.keys()) - before_keys
    assert _code_mappings() - before_maps < added / 2


_SECOND_START = """
import json, sys
from engine_helpers import make_llm
report = make_llm(sys.argv[1], seed=3, compilation_cache_dir=sys.argv[2]).startup_report
print(json.dumps({"persistent_cache": report["persistent_cache"],
                  "buckets": {name: info["persistent_cache"] for name, info in report["buckets"].items()}}))
"""


def test_second_process_reads_every_executable_from_the_persistent_cache(tiny_checkpoints):
    """No executable of a start-up may miss the cache on a second start (no seeds or other
    run-to-run values baked into a program), even with a different engine seed."""
    report = make_llm(tiny_checkpoints["llama"]).startup_report
    cache_dir = report["compilation_cache_dir"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _SECOND_START, tiny_checkpoints["llama"], cache_dir],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert second["persistent_cache"]["misses"] == 0, second
    assert second["persistent_cache"]["hits"] >= len(report["buckets"])
    assert set(second["buckets"].values()) == {"hit"}


def test_startup_report_breakdown_adds_up(tiny_checkpoints):
    report = make_llm(tiny_checkpoints["llama"]).startup_report
    parts = report["breakdown_s"]
    assert set(parts) == {"load", "kv_sizing", "kv_alloc", "dummy_batches", "trace", "lower", "compile", "run",
                          "self_check", "other"}
    assert all(seconds >= -1e-6 for seconds in parts.values()), parts
    assert sum(parts.values()) == pytest.approx(report["startup_s"])
    assert parts["load"] == report["load_s"]
    buckets = report["buckets"].values()
    for part in ("trace", "lower", "run"):
        assert report[f"{part}_s_total"] == pytest.approx(sum(b[f"{part}_s"] for b in buckets))
    assert parts["trace"] == pytest.approx(report["trace_s_total"])
    assert parts["lower"] == pytest.approx(report["lower_s_total"])
    assert parts["run"] >= report["run_s_total"]
    assert all(b["persistent_cache"] in ("hit", "miss", "unused") for b in buckets)


def test_auto_falls_back_to_xla_when_its_kernel_fails_to_compile():
    """A Pallas kernel can fail where only the accelerator compiles it (Triton over the shared
    memory): under ``auto`` the engine falls back to XLA, runs the real self-check for it, and
    says why; a kernel the user named, a CPU engine and a wrong answer still stop the start."""
    import jax

    from jaxrunner.config import EngineConfig
    from jaxrunner.runner import startup, warmup
    from jaxrunner.runner.buckets import Bucket
    from jaxrunner.runner.memory import StartupError

    refusal = "out of resource: shared memory, Required: 262144, Hardware limit: 232448"

    def self_check(impl):
        if impl == "pallas":
            raise RuntimeError(refusal)
        return warmup.attention_self_check(impl, Bucket(16, 2, 4), 16, 4, 2, 64, "float32", jax.random.key(0))

    impl, why, error = startup.check_attention(EngineConfig(), "gpu", "pallas", "GPU: the Pallas Triton kernel",
                                               self_check)
    assert impl == "xla" and error < 1e-5
    assert why.startswith("GPU: the Pallas Triton kernel, but it failed to compile here") and "262144" in why
    with pytest.raises(RuntimeError, match="shared memory"):
        startup.check_attention(EngineConfig(attention_impl="pallas"), "gpu", "pallas", "asked for", self_check)
    with pytest.raises(RuntimeError):
        startup.check_attention(EngineConfig(), "cpu", "pallas", "CPU", self_check)

    def wrong(impl):
        raise StartupError("attention self-check failed")

    with pytest.raises(StartupError):
        startup.check_attention(EngineConfig(), "gpu", "pallas", "GPU", wrong)
