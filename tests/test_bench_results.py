"""Benchmark result files: how the scripts name them, what history.csv keeps, what the repo holds."""
import argparse
import csv
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
sys.path.insert(0, os.path.join(REPO, "scripts"))

import _bench_common as common  # noqa: E402
import bench_history  # noqa: E402

NAME = re.compile(r"^(?P<kind>[a-z]+(-tp\d+)?(-dp\d+)?-(float32|bfloat16)(-(int8|int4|w4a8|w8a8))?"
                  r"(-kv(float32|bfloat16|fp8|fp8_e4m3|fp8_e5m2))?(-sampled)?(-logprobs)?)-(?P<date>\d{4}-\d\d-\d\d)-"
                  r"(?P<commit>[0-9a-f]{7,}|nogit)\.(json|png)$")


def test_result_name_says_benchmark_parallelism_dtype_date_and_commit():
    assert common.result_name("throughput", "float32", date="2026-12-01", commit="abc1234") == \
        "throughput-float32-2026-12-01-abc1234"
    assert common.result_name("latency", "bfloat16", tensor_parallel_size=3, data_parallel_size=2,
                              date="2026-12-01", commit="abc1234") == "latency-tp3-dp2-bfloat16-2026-12-01-abc1234"


def test_a_kv_cache_dtype_other_than_the_default_is_in_the_name_and_the_history_label():
    args = argparse.Namespace(output_json=None, dtype="bfloat16", quantization="int8", kv_cache_dtype="fp8")
    name = os.path.basename(common.default_output_json("throughput", args, commit="abc1234"))
    assert NAME.match(name) and name.startswith("throughput-bfloat16-int8-kvfp8-"), name
    assert bench_history._dtype_label({"dtype": "bfloat16", "kv_cache_dtype": "fp8"}) == "bfloat16-kvfp8"
    assert bench_history._dtype_label({"dtype": "bfloat16", "kv_cache_dtype": "auto"}) == "bfloat16"
    args.kv_cache_dtype = "auto"
    assert "-kv" not in common.default_output_json("throughput", args, commit="abc1234")


def test_sampled_requests_are_in_the_name_and_the_history_workload():
    args = argparse.Namespace(output_json=None, dtype="bfloat16", quantization=None, temperature=0.8)
    name = os.path.basename(common.default_output_json("throughput", args, commit="abc1234"))
    assert NAME.match(name) and name.startswith("throughput-bfloat16-sampled-"), name
    doc = {"benchmark": "throughput", "config": {"num_requests": 64, "input_len": "32..256", "output_len": 128,
                                                 "sampling": {"temperature": 0.8, "top_p": 0.95, "top_k": 0}}}
    assert bench_history._labelled(doc, "num_requests=64") == "num_requests=64 temperature=0.8 top_p=0.95"
    args.temperature = 0.0
    assert "-sampled" not in common.default_output_json("throughput", args, commit="abc1234")


def test_requests_asking_for_logprobs_are_in_the_name_and_the_history_workload():
    """logprobs=0 (the sampled token's own, what RL rollouts take) counts as asked for."""
    args = argparse.Namespace(output_json=None, dtype="bfloat16", quantization=None, temperature=1.0, logprobs=0)
    name = os.path.basename(common.default_output_json("throughput", args, commit="abc1234"))
    assert NAME.match(name) and name.startswith("throughput-bfloat16-sampled-logprobs-"), name
    doc = {"benchmark": "throughput", "config": {"sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                                              "logprobs": 0}}}
    assert bench_history._labelled(doc, "num_requests=64") == "num_requests=64 temperature=1.0 top_p=1.0 logprobs=0"
    args.logprobs = None
    assert "-logprobs" not in common.default_output_json("throughput", args, commit="abc1234")


def test_git_commit_is_the_checkouts_short_head():
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    expected = head.stdout.strip() if head.returncode == 0 else "nogit"
    assert common.git_commit() == expected


def test_default_output_is_named_and_its_headline_figures_go_to_history(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(bench_history, "HISTORY_CSV", str(tmp_path / "history.csv"))
    args = argparse.Namespace(output_json=None, no_plot=True, dtype="bfloat16", tensor_parallel_size=1,
                              data_parallel_size=1)
    payload = {"config": {"num_requests": 4, "input_len": "8..16", "output_len": 8,
                          "engine": {"dtype": "bfloat16", "tensor_parallel_size": 1, "data_parallel_size": 1}},
               "results": {"jaxrunner": {"total_tokens_per_s": 123.5, "output_tokens_per_s": 50.0, "elapsed_s": 2.0}}}
    path = common.write_results(args, "throughput", payload, plot=None, plot_data=None, title="t")

    name = os.path.basename(path)
    assert NAME.match(name), name
    assert name.startswith("throughput-bfloat16-") and name.endswith(f"-{common.git_commit()}.json")
    with open(path, encoding="utf-8") as f:
        assert json.load(f)["commit"] == common.git_commit()
    with open(tmp_path / "history.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [(r["metric"], float(r["value"])) for r in rows] == [("total_tokens_per_s", 123.5),
                                                                ("output_tokens_per_s", 50.0)]
    assert {r["benchmark"] for r in rows} == {"throughput"} and {r["dtype"] for r in rows} == {"bfloat16"}
    assert rows[0]["workload"] == "num_requests=4 input_len=8..16 output_len=8"


def test_an_explicit_output_outside_results_leaves_history_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setattr(bench_history, "HISTORY_CSV", str(tmp_path / "results" / "history.csv"))
    args = argparse.Namespace(output_json=str(tmp_path / "mine.json"), no_plot=True, dtype="float32")
    common.write_results(args, "latency", {"results": []}, plot=None, plot_data=None, title="t")
    assert (tmp_path / "mine.json").exists() and not (tmp_path / "results" / "history.csv").exists()


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(RESULTS) if n != "history.csv"))
def test_repo_results_follow_the_naming(name):
    match = NAME.match(name)
    assert match, f"{name}: expected <benchmark>[-tpN][-dpM]-<dtype>-<date>-<commit>.json"
    if name.endswith(".json"):
        with open(os.path.join(RESULTS, name), encoding="utf-8") as f:
            assert json.load(f)["commit"] == match["commit"]


def test_repo_keeps_one_result_of_each_kind_and_the_history():
    kinds = [NAME.match(n)["kind"] for n in os.listdir(RESULTS) if n.endswith(".json")]
    assert len(kinds) == len(set(kinds)), sorted(kinds)
    with open(os.path.join(RESULTS, "history.csv"), encoding="utf-8") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == bench_history.COLUMNS
        benchmarks = {row["benchmark"] for row in reader}
    assert {"throughput", "latency", "startup"} <= benchmarks


def test_history_tells_another_model_and_a_forced_matmul_apart():
    doc = {"benchmark": "throughput", "config": {"model": "/models/random-llama-1b/", "num_requests": 4,
                                                 "input_len": "8..16", "output_len": 8,
                                                 "engine": {"dtype": "bfloat16", "cpu_matmul": "xla"}},
           "results": {"jaxrunner": {"total_tokens_per_s": 1.0}}}
    rows = bench_history.headline_rows(doc)
    assert rows[0]["workload"] == "model=random-llama-1b num_requests=4 input_len=8..16 output_len=8 cpu_matmul=xla"


def test_history_tells_a_throughput_run_of_another_token_budget_apart():
    def workload(budget):
        doc = {"benchmark": "throughput", "config": {"num_requests": 4, "output_len": 8,
                                                     "engine": {"dtype": "bfloat16", "max_num_batched_tokens": budget}},
               "results": {"jaxrunner": {"total_tokens_per_s": 1.0}}}
        return bench_history.headline_rows(doc)[0]["workload"]

    assert workload(256) == "num_requests=4 output_len=8"
    assert workload(4096) == "num_requests=4 output_len=8 max_num_batched_tokens=4096"


def test_history_tells_cpus_of_one_name_apart_by_their_vector_features():
    def machine(features):
        device = {"jax_backend": "cpu", "cpu": "AMD EPYC", "cpu_affinity": 2, "cpu_features": features}
        return bench_history.machine({"device": device})

    assert machine(["avx2", "fma"]) == "cpu: AMD EPYC (avx2 fma), 2 cores"
    assert machine(["avx2", "avx512_bf16", "avx512f"]) != machine(["avx2", "fma"])
    assert machine([]) == "cpu: AMD EPYC, 2 cores"


def test_history_tells_cpus_of_one_name_and_features_apart_by_their_model():
    cpuinfo = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\n"
               "model name\t: Intel(R) Xeon(R) Processor\nstepping\t: 2\n\nprocessor\t: 1\nmodel\t\t: 1\n")
    assert common.cpu_model_id(cpuinfo) == "family 6 model 207"
    assert common.cpu_model_id("processor\t: 0\nBogoMIPS\t: 50.00\n") is None  # no model number (Arm)

    def machine(model_id):
        device = {"jax_backend": "cpu", "cpu": "Intel(R) Xeon(R) Processor", "cpu_affinity": 2,
                  "cpu_features": ["amx_bf16", "avx512f"], "cpu_model_id": model_id}
        return bench_history.machine({"device": device})

    assert machine("family 6 model 207") == "cpu: Intel(R) Xeon(R) Processor (family 6 model 207; amx_bf16 avx512f), 2 cores"
    assert machine("family 6 model 143") != machine("family 6 model 207")
    assert machine(None) == "cpu: Intel(R) Xeon(R) Processor (amx_bf16 avx512f), 2 cores"


def test_history_labels_per_row_workloads_too():
    doc = {"benchmark": "latency", "config": {"model": "/models/random-llama-1b", "engine": {"dtype": "bfloat16"}},
           "results": [{"engine": "jaxrunner", "batch_size": 1, "input_len": 8, "output_len": 8,
                        "tpot_s": {"p50": 0.01}}]}
    assert bench_history.headline_rows(doc)[0]["workload"] == "model=random-llama-1b batch_size=1 input_len=8 output_len=8"


def test_roofline_sets_a_latency_row_against_the_ceilings():
    """Decode GB/s: the weights plus each sequence's mean K/V context, per TPOT; prefill GFLOP/s:
    the layers' products over the prompt, the LM head once and causal attention, per TTFT."""
    import roofline

    traffic = dict(weight_bytes=1_000_000_000, kv_bytes_per_context_token=1000, layer_matmul_params=10**8,
                   lm_head_params=10**7, num_layers=2, num_heads=4, head_dim=8)
    row = {"batch_size": 2, "input_len": 100, "output_len": 50, "ttft_s": {"p50": 0.5}, "tpot_s": {"p50": 0.1}}
    out = roofline.annotate(row, traffic, {"copy_gbps": 20.0, "matmul_gflops": 100.0})
    assert out["decode_gbps"] == pytest.approx((1e9 + 2 * 125 * 1000) / 0.1 / 1e9)
    assert out["decode_frac_of_copy"] == pytest.approx(out["decode_gbps"] / 20)
    flops = 2 * (2 * 1e8 * 100 + 2 * 1e7 + 4 * 2 * 4 * 8 * 100 * 101 / 2)
    assert out["prefill_gflops"] == pytest.approx(flops / 0.5 / 1e9)
    assert out["prefill_frac_of_matmul"] == pytest.approx(out["prefill_gflops"] / 100)
