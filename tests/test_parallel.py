"""Tensor and data parallelism, multi-host: every mesh serves exactly what one device serves.

Meshes need several devices, and JAX fixes the CPU device count when it starts, so those cases run
in subprocesses (tests/parallel_worker.py) with ``--xla_force_host_platform_device_count=8``.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import build_tiny_checkpoint, requires_smollm2, smollm2_gguf_path
from engine_helpers import COMPILE_CACHE, TINY_ENGINE

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parallel_worker.py")


def _env(devices: int | None = 8) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAXRUNNER_COMPILATION_CACHE=COMPILE_CACHE)
    if devices:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    return env


def _run_worker(scenario: str, arg: str, timeout: int = 900) -> dict:
    done = subprocess.run([sys.executable, WORKER, scenario, arg], env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def gqa_8_2_checkpoint(tmp_path_factory) -> str:
    """8 query / 2 KV heads with q/k/v biases (qwen2): splits at TP 2, replicates KV heads at TP 4."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("gqa82") / "qwen2", "qwen2", num_heads=8, num_kv_heads=2)


# ----------------------------------------------------------------------------- in-process checks
def test_mesh_checks_say_what_would_work():
    from jaxrunner.models.config import ModelConfig
    from jaxrunner.parallel import mesh

    cfg = ModelConfig("llama", 512, 64, 1536, 2, num_heads=9, num_kv_heads=3, head_dim=8, rms_norm_eps=1e-5,
                      rope_theta=1e4, max_position_embeddings=512, tie_word_embeddings=True)
    assert mesh.valid_tensor_parallel_sizes(cfg) == [1, 3]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: it does not divide the 9 query heads.*\[1, 3\]"):
        mesh.check_tensor_parallel(cfg, 2)
    with pytest.raises(ValueError, match="asks for 6 devices, but only 4 cpu"):
        mesh.check_device_count(3, 2, devices=[type("D", (), {"platform": "cpu"})()] * 4)
    with pytest.raises(ValueError, match="data_parallel_size: expected a positive integer"):
        mesh.check_device_count(1, 0)


def test_more_devices_than_exist_fail_before_loading(tmp_path):
    from jaxrunner import LLM

    # the model path does not exist: the mesh check must come first
    with pytest.raises(ValueError, match="tensor_parallel_size=2 × data_parallel_size=1 asks for 2 devices"):
        LLM(str(tmp_path / "no-such-model"), **TINY_ENGINE, tensor_parallel_size=2)


def test_replicated_kv_heads_leave_the_model_unchanged(gqa_8_2_checkpoint):
    """TP 4 on 2 KV heads copies each KV head into 2 groups; the dense forward must not change."""
    from jaxrunner.models.decoder import Decoder
    from jaxrunner.models.attention import DenseAttention
    from jaxrunner.models import registry
    from jaxrunner.models.registry import config_from_hf
    from jaxrunner.models.loading.hf import load_hf_state_dict, read_hf_config
    from jaxrunner.models.params import cast_params, host_params_from_state_dict
    from jaxrunner.parallel.sharding import replicate_kv_heads

    cfg = config_from_hf(read_hf_config(gqa_8_2_checkpoint))
    host = host_params_from_state_dict(load_hf_state_dict(gqa_8_2_checkpoint, progress=False), cfg)
    wide_host, wide_cfg = replicate_kv_heads(host, cfg, 4, registry.kv_grouped_leaves(cfg))
    assert wide_cfg.num_kv_heads == 4 and wide_host["layers"][0]["wqkv"].shape[1] == 4 * (2 + 2) * 8

    ids = np.random.default_rng(0).integers(3, 512, 24)

    def logits(params, config):
        hidden, _ = Decoder(config).forward(cast_params(params, "float32"), jnp.asarray(ids), jnp.arange(len(ids)),
                                            [None] * config.num_layers, jnp.zeros(len(ids), jnp.int32),
                                            DenseAttention())
        return np.asarray(Decoder(config).compute_logits(cast_params(params, "float32"), hidden))

    np.testing.assert_allclose(logits(wide_host, wide_cfg), logits(host, cfg), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- meshes (subprocess)
def test_tensor_and_data_parallel_equal_one_device(gqa_8_2_checkpoint):
    results = _run_worker("tiny", gqa_8_2_checkpoint)
    single = results["tp1_dp1"]
    for name in ("tp2_dp1", "tp4_dp1", "tp2_dp2"):
        assert results[name]["tokens"] == single["tokens"], name
        assert results[name]["serving_compiles"] == 0, name
        assert results[name]["pages_in_use"] == 0, name
    # TP 2 splits the 2 KV heads; TP 4 replicates each onto 2 shards and says so
    assert (results["tp2_dp1"]["kv_heads"], results["tp2_dp1"]["kv_head_replication"]) == (2, 1)
    assert (results["tp4_dp1"]["kv_heads"], results["tp4_dp1"]["kv_head_replication"]) == (4, 2)
    # per-device weights fall as 1/TP beyond the replicated norms (3 per layer pair: 2 layers × 2 + final)
    norms = (2 * 2 + 1) * 64 * 4
    assert results["tp2_dp1"]["weights_bytes_per_device"] == (single["weights_bytes"] - norms) // 2 + norms
    assert results["tp4_dp1"]["weights_bytes_per_device"] < results["tp2_dp1"]["weights_bytes_per_device"]
    assert results["tp2_dp1"]["kv_bytes_per_device"] * 2 == single["kv_bytes_per_device"]
    assert results["error_tp3"].startswith("tensor_parallel_size=3: it does not divide the 8 query heads")
    assert "sizes that work for this model: [1, 2, 4, 8]" in results["error_tp3"]
    assert "asks for 16 devices, but only 8 cpu device(s) exist" in results["error_too_many"]


def test_in_memory_params_sharded_for_tensor_parallelism(gqa_8_2_checkpoint):
    """LLM.from_params on params already sharded over 2 devices: served in place (no host round
    trip), the same tokens, and a weight swap that compiles nothing (also with 2 replicas)."""
    results = _run_worker("in_memory", gqa_8_2_checkpoint)
    for name in ("tp2_dp1", "tp2_dp2"):
        assert results[name]["tokens"] == results["loaded"], name
        assert results[name]["swap_compiles"] == 0 and results[name]["swapped_differs"], name
        assert results[name]["sharded"] == 2, name
    assert results["tp2_dp1"]["in_place"]


@pytest.mark.slow
@requires_smollm2
def test_smollm2_tensor_and_data_parallel_equal_one_device():
    """The real model has 9 query / 3 KV heads: TP 3, DP 2 and TP 3 × DP 2, restored from orbax."""
    results = _run_worker("smollm2", smollm2_gguf_path())
    single = results["tp1_dp1"]
    for name in ("tp3_dp1", "tp1_dp2", "tp3_dp2"):
        assert results[name]["tokens"] == single["tokens"], name
        assert results[name]["serving_compiles"] == 0, name
    per_device = results["tp3_dp1"]["weights_bytes_per_device"]
    assert single["weights_bytes"] / 3 <= per_device < single["weights_bytes"] / 3 * 1.01
    assert results["tp3_dp2"]["mesh"].startswith("{'data': 2, 'model': 3}")


# ----------------------------------------------------------------------------- multi-host
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def test_two_processes_through_jax_distributed_agree_with_one(gqa_8_2_checkpoint):
    """Two local processes (one CPU device each, gloo collectives) serve one TP-2 engine."""
    cli = [sys.executable, "-m", "jaxrunner", "generate", "The quick brown fox", "Paris is", "hello there",
           "--model", gqa_8_2_checkpoint, "--raw", "--json", "--max-tokens", "10", "--max-num-seqs", "4",
           "--max-num-batched-tokens", "16", "--max-model-len", "64"]
    address = f"localhost:{_free_port()}"
    commands = [cli + ["--tensor-parallel-size", "2", "--coordinator-address", address, "--num-processes", "2",
                       "--process-id", str(i)] for i in range(2)]
    # the one-process reference runs beside the pair: all three mostly wait on imports and collectives
    procs = [subprocess.Popen(command, env=_env(devices=None), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for command in [*commands, cli]]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    parse = lambda text: [json.loads(line)["token_ids"] for line in text.splitlines() if line.startswith("{")]  # noqa: E731
    expected = parse(outs[2][0])
    assert len(expected) == 3 and len(set(map(tuple, expected))) > 1  # distinct outputs: a real comparison
    assert parse(outs[0][0]) == expected
    assert parse(outs[1][0]) == expected
