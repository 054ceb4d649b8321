"""The ``jaxrunner`` command and the benchmark scripts, each run in a subprocess like a user would.

Fast tests: ``--help``, ``info``, and user errors (one clear line, exit code 2, caught before the
model loads). Slow tests load the real SmolLM2 model with small engine settings and share one
persistent compilation cache (JAXRUNNER_COMPILATION_CACHE, default
``$TMPDIR/jaxrunner-test-xla-cache`` as set in conftest) so repeated starts reuse executables.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import requires_smollm2
from engine_helpers import COMPILE_CACHE
from jaxrunner import kernels
from jaxrunner.kernels import native
from jaxrunner.runner.buckets import BucketPlan

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
SMALL_ENGINE = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "256"]
# The start-up benchmark compiles from an empty cache on purpose: one bucket keeps that short.
TINY_ENGINE = ["--max-num-seqs", "1", "--max-num-batched-tokens", "16", "--max-model-len", "32"]
TINY_PLAN = BucketPlan.from_limits(max_num_batched_tokens=16, max_num_seqs=1, max_model_len=32, page_size=16)
TINY_WORKLOAD = ["--num-requests", "4", "--input-len", "8..16", "--output-len", "4"]
TIMEOUT_S = 900


def _env() -> dict:
    env = dict(os.environ, JAXRUNNER_COMPILATION_CACHE=COMPILE_CACHE, HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", MPLBACKEND="Agg", TQDM_DISABLE="1")
    env.pop("JAXRUNNER_NOTEBOOK_SMALL", None)
    return env


def run(args: list[str], stdin: str | None = None, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)


def jaxrunner(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "jaxrunner", *args], stdin=stdin)


def jaxrunner_side_by_side(*commands: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """Independent CLI runs at the same time: each spends most of its time on one core (imports,
    tracing, loading executables from the cache), so two finish in little more than one."""
    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: jaxrunner(*args), commands))


def script(name: str, *args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, str(SCRIPTS / f"benchmark_{name}.py"), *args])


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def _one_error_line(proc: subprocess.CompletedProcess, prefix: str) -> str:
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(prefix), proc.stderr
    return errors[0]


# ----------------------------------------------------------------------------- fast
@pytest.mark.parametrize("sub", [[], ["generate"], ["chat"], ["serve"], ["bench"], ["convert"], ["info"]],
                         ids=lambda s: s[0] if s else "top")
def test_help(sub):
    proc = _ok(jaxrunner(*sub, "--help"))
    assert proc.stdout.startswith("usage: jaxrunner")
    if sub == ["generate"]:  # generate's flags are a stable interface
        for flag in ("--max-tokens", "--temperature", "--seed", "--json", "--raw", "--model", "--dtype",
                     "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--attention-impl"):
            assert flag in proc.stdout, flag


@pytest.mark.parametrize("kind", ["throughput", "latency", "serving", "startup", "soak"])
def test_benchmark_help(kind):
    path = SCRIPTS / ("soak.py" if kind == "soak" else f"benchmark_{kind}.py")
    direct = _ok(run([sys.executable, str(path), "--help"]))
    assert "--output-json" in direct.stdout and "--max-num-seqs" in direct.stdout
    assert "--tensor-parallel-size" in direct.stdout
    via_cli = _ok(jaxrunner("bench", kind, "--help"))
    assert via_cli.stdout == direct.stdout


def test_info():
    proc = _ok(jaxrunner("info"))
    for field in ("jaxrunner:", "jax:", "backend:", "devices:", "attention_impl:", "compilation_cache_dir:"):
        assert field in proc.stdout
    info = json.loads(_ok(jaxrunner("info", "--json")).stdout)
    assert info["backend"] == "cpu" and info["attention_impl"] in ("native", "xla")
    assert info["native_cpu_kernel"] == "ready" or info["attention_impl"] == "xla"
    assert info["native_attention_tiles"].startswith("bf16") == native.attention_tiles_ready()
    assert info["compilation_cache_dir"] == COMPILE_CACHE
    assert info["cpu_features"].split(" (capped")[0] == (", ".join(kernels.cpu_features()) or
                                                         "none of those the kernels use")


@pytest.mark.parametrize("args, prefix", [
    (["generate", "--model", "/nonexistent", "hi"], "jaxrunner generate: error: model '/nonexistent' not found"),
    (["generate", "--temperature", "-1", "hi"], "jaxrunner generate: error:"),
    (["generate", "--max-tokens", "0", "hi"], "jaxrunner generate: error:"),
    (["generate", "--max-num-seqs", "0", "hi"],
     "jaxrunner generate: error: EngineConfig.max_num_seqs: invalid value 0; valid: an integer >= 1"),
    (["generate", "--max-model-len", "0", "hi"], "jaxrunner generate: error: EngineConfig.max_model_len"),
    (["generate", "--speculative-config", "{method: ngram}", "hi"], "jaxrunner generate: error: --speculative-config"),
    (["serve", "--speculative-config", '{"method": "draft_model"}'],
     "jaxrunner serve: error: EngineConfig.speculative_model"),
    (["chat", "--temperature", "-1"], "jaxrunner chat: error:"),
    (["chat", "--model", "/nonexistent"], "jaxrunner chat: error: model '/nonexistent' not found"),
    (["bench", "throughput", "--tensor-parallel-size", "2"],
     "benchmark_throughput: error: tensor_parallel_size=2 × data_parallel_size=1 asks for 2 devices"),
    (["bench", "latency", "--batch-sizes", "1,x"], "benchmark_latency: error: --batch-sizes"),
    (["bench", "serving", "--request-rate", "-3"], "benchmark_serving: error: request rate"),
    (["bench", "throughput", "--dataset", "jsonl"], "benchmark_throughput: error: --dataset jsonl needs"),
    (["bench", "throughput", "--input-len", "9..3"], "benchmark_throughput: error: --input-len"),
    (["bench", "throughput", "--compare", "hf", "--model", "/nonexistent"], "benchmark_throughput: error: model"),
    (["bench", "latency", "--compare", "hf", "--hf-threads", "0"], "benchmark_latency: error: --hf-threads"),
    (["bench", "throughput", "--compare", "vllm"], "benchmark_throughput: error: --compare vllm needs --vllm-python"),
    (["bench", "throughput", "--compare-quantization", "int4", "--quantization", "int4"],
     "benchmark_throughput: error: --compare-quantization int4 runs beside float weights"),
    (["bench", "throughput", "--repetitions", "0"], "benchmark_throughput: error: --repetitions"),
    (["bench", "throughput", "--top-p", "0.9"], "benchmark_throughput: error: --top-p and --top-k need --temperature"),
    (["bench", "throughput", "--temperature", "1", "--top-p", "1.5"], "benchmark_throughput: error: --top-p: must be"),
    (["bench", "throughput", "--temperature", "0.8", "--compare", "hf"],
     "benchmark_throughput: error: --compare hf: transformers' static batches here are greedy"),
    (["bench", "throughput", "--logprobs", "0", "--compare", "hf"],
     "benchmark_throughput: error: --compare hf: transformers' static batches here are greedy, without logprobs"),
    (["bench", "throughput", "--logprobs", "21"], "benchmark_throughput: error: --logprobs: must be in 0..20, got 21"),
    (["bench", "latency", "--compare", "vllm", "--vllm-python", sys.executable],
     f"benchmark_latency: error: --vllm-python {sys.executable!r}: cannot import vllm"),
    (["bench", "startup", "--compare", "vllm"], "benchmark_startup: error: --compare vllm needs --vllm-python"),
    (["bench", "latency", "--compare", "llamacpp", "--batch-sizes", "1,4"],
     "benchmark_latency: error: --compare llamacpp: --batch-sizes 1,4: llama-cpp-python serves one sequence"),
    (["bench", "latency", "--compare", "llamacpp", "--batch-sizes", "1"],
     "benchmark_latency: error: --compare llamacpp needs --llamacpp-python"),
    (["bench", "latency", "--compare", "tgi"], "benchmark_latency: error: --compare tgi: unknown ['tgi']"),
    (["bench", "latency", "--speculative-method", "draft_model", "--prompt-lookup-max", "3"],
     "benchmark_latency: error: --prompt-lookup-max: no --speculative-method given uses it"),
], ids=lambda v: v[0] + "-" + v[1] if isinstance(v, list) else None)
def test_bad_input_is_one_line_and_exit_2(args, prefix):
    _one_error_line(jaxrunner(*args), prefix)


def test_convert_checks_the_destination_before_loading(tiny_checkpoints, tmp_path):
    """An existing checkpoint needs --overwrite; a path under a file or a foreign directory is refused;
    all before the source is read (the source here does not even exist)."""
    existing = tmp_path / "ckpt"
    existing.mkdir()
    (existing / "jaxrunner_checkpoint.json").write_text("{}")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    missing_src = str(tmp_path / "no-such-model")
    cases = [(existing, "holds a jaxrunner checkpoint; pass --overwrite to replace it"),
             (tmp_path / "afile" / "sub", "which is a file, not a directory"),
             (tmp_path / "afile", "is a file"),
             (tmp_path / "other", "holds no jaxrunner checkpoint")]
    procs = jaxrunner_side_by_side(*(("convert", missing_src, str(dst)) for dst, _ in cases))
    for (_, message), proc in zip(cases, procs):
        line = _one_error_line(proc, "jaxrunner convert: error:")
        assert message in line, line


def test_convert_overwrite_replaces_a_checkpoint(tiny_checkpoints, tmp_path):
    dst = str(tmp_path / "ckpt")
    _ok(jaxrunner("convert", tiny_checkpoints["llama"], dst))
    _one_error_line(jaxrunner("convert", tiny_checkpoints["llama"], dst), "jaxrunner convert: error:")
    assert "wrote " in _ok(jaxrunner("convert", tiny_checkpoints["llama"], dst, "--overwrite")).stdout


def test_generate_on_a_model_with_a_short_limit_needs_no_flags(tiny_checkpoints):
    """A Qwen2 directory with max_position_embeddings=512: the default max_model_len is the model's.
    With vLLM's --speculative-config naming a draft model (the tiny Llama, same vocabulary), the
    greedy tokens are the same."""
    generate = ("generate", "--model", tiny_checkpoints["qwen2"], "--max-tokens", "8", "--json", "hello")
    draft = json.dumps({"model": tiny_checkpoints["llama"], "num_speculative_tokens": 2})
    plain, drafted = (json.loads(_ok(proc).stdout.splitlines()[-1])["token_ids"] for proc in
                      jaxrunner_side_by_side(generate, (*generate, "--speculative-config", draft)))
    assert len(plain) <= 8
    assert drafted == plain


def test_bad_flag_value_is_argparse_exit_2():
    proc = jaxrunner("generate", "--max-tokens", "many", "hi")
    assert proc.returncode == 2 and "invalid int value" in proc.stderr and "Traceback" not in proc.stderr


def test_chat_drops_oldest_turns_to_fit():
    """`jaxrunner chat` forgets the oldest exchanges when the conversation outgrows max_model_len."""
    from jaxrunner.cli import _fit_chat_prompt

    class FakeLLM:  # one token per character, max_model_len 50
        class engine:
            max_model_len = 50

        @staticmethod
        def chat_prompt(conversation):
            return {"prompt_token_ids": [0] * sum(len(m["content"]) for m in conversation)}

    def turn(role, n):
        return {"role": role, "content": "x" * n}

    history = [turn("user", 20), turn("assistant", 20), turn("user", 10)]
    assert _fit_chat_prompt(FakeLLM, [], history, 16) is not None
    assert history == [turn("user", 10)]
    history = [turn("user", 5), turn("assistant", 5), turn("user", 40)]
    assert _fit_chat_prompt(FakeLLM, [], history, 16) is None  # the last message alone is too long
    assert len(history) == 3  # untouched: the caller drops only the message it could not send


def test_builtin_chat_prompts():
    rows = [json.loads(line) for line in (ROOT / "jaxrunner" / "data" / "chat_prompts.jsonl").read_text().splitlines()
            if line.strip()]
    assert 15 <= len(rows) <= 30
    for row in rows:
        assert isinstance(row["prompt"], str) and row["prompt"].strip()
        assert isinstance(row["output_len"], int) and 1 <= row["output_len"] <= 256
    assert len({row["prompt"] for row in rows}) == len(rows)


# ----------------------------------------------------------------------------- slow: the real model


@pytest.mark.slow
@requires_smollm2
def test_generate_json_greedy_paris():
    proc = _ok(jaxrunner("generate", "What is the capital of France?", "Name one primary color.", "--json",
                         "--max-tokens", "16", *SMALL_ENGINE))
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert len(records) == 2
    for record in records:
        assert set(record) >= {"prompt", "text", "token_ids", "finish_reason"}
        assert isinstance(record["text"], str) and record["text"]
        assert record["token_ids"] and all(isinstance(t, int) for t in record["token_ids"])
        assert len(record["token_ids"]) <= 16 and record["finish_reason"] in ("stop", "length")
    assert records[0]["prompt"] == "What is the capital of France?"
    assert "Paris" in records[0]["text"]


@pytest.mark.slow
@requires_smollm2
def test_chat_two_turns_reset_exit():
    stdin = ("What is the capital of France?\n"
             "And what about Italy?\n"
             "/reset\n"
             "Say hello.\n"
             "/exit\n"
             "this line comes after /exit and must be ignored\n")
    proc = _ok(jaxrunner("chat", "--max-tokens", "24", *SMALL_ENGINE, stdin=stdin))
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 4, proc.stdout
    assert "Paris" in lines[0]
    assert "Rome" in lines[1]  # the second turn saw the first (history kept)
    assert lines[2] == "(conversation cleared)"
    assert lines[3].strip()


def _read_json(path: Path) -> dict:
    data = json.loads(path.read_text())
    for key in ("benchmark", "date", "versions", "device", "config"):
        assert key in data, key
    assert data["versions"]["jaxrunner"] and data["versions"]["jax"]
    assert data["device"]["jax_backend"] == "cpu"
    return data


def _assert_percentiles(block: dict):
    for q in ("p50", "p90", "p99"):
        assert block[q] is not None and block[q] >= 0, block
    assert block["p50"] <= block["p90"] <= block["p99"]


# ----------------------------------------------------------------------------- the benchmark scripts
# On a tiny checkpoint: the model does not matter to what they check.


def test_benchmark_throughput_vs_hf(tiny_checkpoints, tmp_path):
    """Against transformers, and int8 weights beside the float ones in the same process, taking
    turns: each engine's figures are its median run's, every run's rate beside them, and no run
    reads the prompts' pages cached by the run before (prompts of two full pages and more)."""
    out = tmp_path / "tp.json"
    workload = ["--num-requests", "4", "--input-len", "40..48", "--output-len", "4"]
    proc = _ok(script("throughput", "--model", tiny_checkpoints["llama"], *workload, *SMALL_ENGINE,
                      "--compare", "hf", "--hf-batch-sizes", "2,4", "--hf-threads", "1", "--output-json", str(out),
                      "--compare-quantization", "int8", "--repetitions", "2"))
    data = _read_json(out)
    assert data["benchmark"] == "throughput" and data["config"]["num_requests"] == 4
    results = data["results"]
    assert set(results) == {"jaxrunner", "jaxrunner+int8", "hf_bs2", "hf_bs4"}
    for figures in results.values():
        assert figures["total_tokens_per_s"] > 0 and figures["output_tokens_per_s"] > 0 and figures["elapsed_s"] > 0
        assert figures["output_tokens"] == 16
    for name in ("jaxrunner", "jaxrunner+int8"):
        runs = results[name]["total_tokens_per_s_runs"]
        assert len(runs) == 2 and results[name]["total_tokens_per_s"] == max(runs)  # the upper median of two
    assert data["engine_stats"]["prefix_cache_hit_tokens"] == 0
    quantized = data["ratio"]["jaxrunner+int8/jaxrunner"]
    assert len(quantized["total_tokens_per_s_by_repetition"]) == 2 and quantized["total_tokens_per_s"] > 0
    assert "jaxrunner/jaxrunner+int8" not in data["ratio"]
    assert data["ratio"]["jaxrunner/best_hf"]["output_tokens_per_s"] > 0
    assert data["transformers"]["process"].startswith("separate") and data["transformers"]["torch_num_threads"] == 1
    assert out.with_suffix(".png").stat().st_size > 1000
    assert proc.stdout.strip().splitlines()[-1].startswith("hf_bs4")  # the table is printed last


def test_benchmark_latency_vs_hf(tiny_checkpoints, tmp_path):
    out = tmp_path / "lat.json"
    _ok(script("latency", "--model", tiny_checkpoints["llama"], "--batch-sizes", "1,2", "--input-lens", "8",
               "--output-lens", "4", "--repetitions", "2", *SMALL_ENGINE, "--compare", "hf", "--hf-threads", "1",
               "--output-json", str(out)))
    data = _read_json(out)
    rows = data["results"]
    assert sorted((r["engine"], r["batch_size"]) for r in rows) == [("hf", 1), ("hf", 2), ("jaxrunner", 1),
                                                                     ("jaxrunner", 2)]
    for row in rows:
        assert row["input_len"] == 8 and row["output_len"] == 4
        _assert_percentiles(row["ttft_s"])
        _assert_percentiles(row["e2e_s"])
        assert row["tpot_s"]["p50"] is not None
        if row["engine"] == "jaxrunner":  # per request: batch × repetitions samples
            assert row["ttft_s"]["n"] == row["batch_size"] * 2
            assert row["e2e_s"]["p50"] >= row["ttft_s"]["p50"]
    assert out.with_suffix(".png").stat().st_size > 1000


def test_benchmark_serving_via_cli(tiny_checkpoints, tmp_path):
    """`jaxrunner bench serving` starts `jaxrunner serve`, streams over HTTP and stops it (exit 0). On a
    random-weight model some steps' tokens decode to no text: every request still completes."""
    out = tmp_path / "srv.json"
    _ok(jaxrunner("bench", "serving", "--model", tiny_checkpoints["llama"], *TINY_WORKLOAD, "--sweep-rates", "inf,8", "--slo-ttft-ms", "60000",
                  "--slo-tpot-ms", "60000", *SMALL_ENGINE, "--output-json", str(out)))
    data = _read_json(out)
    assert data["server"]["exit_status"] == 0
    assert [s["request_rate"] for s in data["results"]] == ["inf", 8.0]
    for summary in data["results"]:
        assert summary["completed"] == summary["num_prompts"] == 4 and summary["failed"] == 0
        assert summary["total_output_tokens"] == 16
        for key in ("request_throughput", "output_throughput", "total_token_throughput"):
            assert summary[key] > 0
        assert summary["slo_attainment"] == 1.0  # generous SLOs
        assert summary["request_goodput"] == pytest.approx(summary["request_throughput"])
        for name in ("ttft", "tpot", "itl", "e2el"):  # vLLM's key names
            assert 0 <= summary[f"median_{name}_ms"] <= summary[f"p90_{name}_ms"] <= summary[f"p99_{name}_ms"]
            assert summary[f"mean_{name}_ms"] > 0
    assert set(data["per_request"]) == {"inf", "8.0"}
    assert out.with_suffix(".png").stat().st_size > 1000


def test_benchmark_startup_cold_vs_cached(tiny_checkpoints, tmp_path):
    out = tmp_path / "st.json"
    _ok(script("startup", "--model", tiny_checkpoints["llama"], *TINY_ENGINE, "--repeats", "1", "--input-len", "8",
               "--output-len", "4", "--output-json", str(out)))
    data = _read_json(out)
    results = data["results"]
    assert set(results) == {"custom cold", "custom cached"}
    for r in results.values():
        for key in ("startup_s", "load_s", "compile_s_total", "trace_s_total", "lower_s_total", "warmup_s",
                    "kv_alloc_s", "process_wall_s", "ttft_first_s", "ttft_tenth_s"):
            assert r[key] is not None and r[key] >= 0, key
        assert sum(r["runs"][0]["breakdown_s"].values()) == pytest.approx(r["runs"][0]["startup_s"])
        assert len(r["ttft_s"]) == 10 and r["num_buckets"] == len(TINY_PLAN.buckets())
    cold, cached = results["custom cold"]["runs"][0], results["custom cached"]["runs"][0]
    assert cold["compilation_cache_dir"] == cached["compilation_cache_dir"]
    assert not os.path.exists(cold["compilation_cache_dir"])  # the temporary cache is removed
    assert data["config"]["cache_files_after_cached"]["custom"] > 0
    # The cached start found every executable the cold one compiled.
    assert cold["persistent_cache"]["misses"] > 0
    assert cached["persistent_cache"]["misses"] == 0 and cached["persistent_cache"]["hits"] > 0
