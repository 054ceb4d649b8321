"""Engine options: checked before anything loads, defaults taken from the model, vLLM's names.

Engines here run on the tiny random-weight checkpoints of conftest.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from engine_helpers import TINY_ENGINE, make_llm

from jaxrunner import LLM, SamplingParams
from jaxrunner.config import EngineConfig
from jaxrunner.models.loading.precision import choose_dtype, cpu_has_native_bf16


# ----------------------------------------------------------------------------- values alone
@pytest.mark.parametrize("field, value, valid", [
    ("max_num_seqs", 2.5, "an integer >= 1"),
    ("max_num_seqs", True, "an integer >= 1"),
    ("max_num_seqs", 0, "an integer >= 1"),
    ("page_size", "16", "an integer >= 1"),
    ("num_pages", 1, "an integer >= 2 or None"),
    ("max_model_len", 0.5, "an integer >= 1 or None"),
    ("seed", -1, "an integer >= 0"),
    ("dtype", "fp8", "one of 'auto', 'float32', 'bfloat16', 'float16'"),
    ("kv_cache_dtype", "float16", "one of None, 'auto', 'float32', 'bfloat16', 'fp8', 'fp8_e4m3', 'fp8_e5m2'"),
    ("enable_prefix_caching", 1, "True or False"),
    ("async_scheduling", "no", "True or False"),
    ("memory_utilization", 1.5, "a number in (0, 1]"),
    ("memory_utilization", True, "a number in (0, 1]"),
    ("model", None, "an alias, a .gguf file or a model directory"),
])
def test_bad_option_names_the_field_and_valid_values(field, value, valid):
    with pytest.raises(ValueError) as err:
        EngineConfig(**{field: value})
    assert f"EngineConfig.{field}" in str(err.value) and valid in str(err.value)


def test_numpy_integers_are_integers():
    import numpy as np

    config = EngineConfig(max_num_seqs=np.int64(4), num_pages=np.int32(10))
    assert type(config.max_num_seqs) is int and type(config.num_pages) is int


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if any weight is read: the checks must come first."""
    from jaxrunner.runner import builder

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(builder, "load_model", refuse)


# ----------------------------------------------------------------------------- against the model, before loading
def test_max_model_len_over_the_model_limit_is_refused_before_loading(tiny_checkpoints, no_loading):
    with pytest.raises(ValueError, match=r"max_model_len: 1000000 exceeds the model's max_position_embeddings "
                                         r"\(512\); valid: 1\.\.512"):
        LLM(tiny_checkpoints["qwen2"], **dict(TINY_ENGINE, max_model_len=10**6))


def test_cpu_matmul_onednn_where_it_cannot_run_is_refused_before_loading(tiny_checkpoints, no_loading, monkeypatch):
    from jaxrunner.kernels import platform_support

    monkeypatch.setattr(platform_support, "onednn_unavailable", lambda platform="cpu": "no libdnnl here")
    with pytest.raises(ValueError, match=r"cpu_matmul='onednn': oneDNN's matmul is unavailable here "
                                         r"\(no libdnnl here\); valid here: 'auto' or 'xla'"):
        LLM(tiny_checkpoints["qwen2"], **dict(TINY_ENGINE, cpu_matmul="onednn"))


def test_cpu_matmul_onednn_for_a_dtype_it_lacks_is_refused_before_loading(tiny_checkpoints, no_loading, monkeypatch):
    """A CPU with AVX2 alone has oneDNN's float32 matmul but not its bf16 one."""
    from jaxrunner.kernels import onednn, platform_support

    monkeypatch.setattr(platform_support, "onednn_unavailable", lambda platform="cpu": None)
    monkeypatch.setattr(onednn, "has_matmul", lambda dtype: dtype == "float32")
    with pytest.raises(ValueError, match=r"cpu_matmul='onednn': oneDNN has no bfloat16 matmul on this CPU .*valid "
                                         r"here: cpu_matmul 'auto' or 'xla', or dtype in \['float32'\]"):
        LLM(tiny_checkpoints["qwen2"], **dict(TINY_ENGINE, dtype="bfloat16", cpu_matmul="onednn"))


@pytest.mark.parametrize("field", ["num_pages", "kv_cache_memory_bytes"])
def test_kv_pool_larger_than_memory_is_refused_with_numbers_before_loading(tiny_checkpoints, no_loading, field):
    from jaxrunner.runner.memory import available_host_bytes

    page_bytes = 2 * 2 * 8 * 2 * 16 * 4  # K and V × 2 layers × page 8 × 2 KV heads × head_dim 16 × float32
    too_many = 4 * available_host_bytes() // page_bytes
    value = too_many if field == "num_pages" else too_many * page_bytes
    start = time.perf_counter()
    with pytest.raises(ValueError) as err:
        LLM(tiny_checkpoints["llama"], **{**TINY_ENGINE, "dtype": "float32", "num_pages": None, field: value})
    message = str(err.value)
    assert f"EngineConfig.{field}={value}" in message and "GiB" in message and "valid: " in message
    if field == "num_pages":
        assert f"({page_bytes} bytes per page)" in message
    assert time.perf_counter() - start < 30


def test_fp8_kv_cache_with_a_kernel_that_cannot_read_it_is_refused_before_loading(tiny_checkpoints, no_loading):
    with pytest.raises(ValueError, match=r"attention_impl='pallas' does not read float8_e4m3fn KV pages .*valid "
                                         r"with them: 'auto' or one of \('reference', 'xla', 'native'\)"):
        LLM(tiny_checkpoints["qwen2"], **dict(TINY_ENGINE, kv_cache_dtype="fp8", attention_impl="pallas"))


def test_kv_cache_dtype_names_as_vllm_has_them():
    assert EngineConfig(kv_cache_dtype="auto").kv_pool_dtype is None
    assert EngineConfig(kv_cache_dtype="fp8").kv_pool_dtype == "float8_e4m3fn"
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_pool_dtype == "float8_e4m3fn"
    assert EngineConfig(kv_cache_dtype="fp8_e5m2").kv_pool_dtype == "float8_e5m2"
    assert EngineConfig(kv_cache_dtype="bfloat16").kv_pool_dtype == "bfloat16"


def test_fp8_pages_hold_twice_a_bf16_pool_in_the_same_bytes(tiny_checkpoints):
    pages = {}
    for kv in ("bfloat16", "fp8"):
        llm = make_llm(tiny_checkpoints["llama"], kv_cache_dtype=kv, num_pages=None, kv_cache_memory_bytes=2**15)
        pages[kv] = llm.engine.executor.runner.cache_spec.num_pages
        assert llm.startup_report["kv_cache_dtype"] == EngineConfig(kv_cache_dtype=kv).kv_pool_dtype
    assert pages["fp8"] == 2 * pages["bfloat16"]


# ----------------------------------------------------------------------------- defaults from the model
def test_max_model_len_defaults_to_the_model_limit(tiny_checkpoints, caplog):
    """A Qwen2 directory with max_position_embeddings=512 starts with no max_model_len given."""
    with caplog.at_level(logging.INFO, logger="jaxrunner"):
        llm = make_llm(tiny_checkpoints["qwen2"], max_model_len=None, num_pages=None, kv_cache_memory_bytes=2**22)
    assert llm.engine.max_model_len == 512
    assert llm.startup_report["max_model_len_source"] == "the model's max_position_embeddings"
    assert "max_model_len 512: the model's max_position_embeddings" in caplog.text


def test_default_max_model_len_is_lowered_to_what_the_pool_holds(tiny_checkpoints, caplog):
    with caplog.at_level(logging.INFO, logger="jaxrunner"):
        llm = make_llm(tiny_checkpoints["qwen2"], max_model_len=None, num_pages=17)  # 16 usable pages of 8
    assert llm.engine.max_model_len == 128
    assert "the KV pool holds 128 tokens for one sequence" in llm.startup_report["max_model_len_source"]
    out = llm.generate([{"prompt_token_ids": [5] * 100}], SamplingParams(max_tokens=64, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 28  # capped at max_model_len


def test_provisional_pool_for_profiling_fits_a_long_default_max_model_len():
    """On an accelerator the largest bucket is profiled against a provisional pool: with the
    model's own limit (e.g. 131072 tokens) it must not ask for more than the device holds."""
    from jaxrunner.runner.startup import provisional_num_pages
    from jaxrunner.runner.buckets import BucketPlan

    largest = max(BucketPlan.from_limits(512, 64, 131072, 16).buckets())
    page_bytes = 2 * 32 * 16 * 8 * 128 * 2  # Llama-3-8B, bf16
    pages = provisional_num_pages(largest, page_bytes, room_bytes=100 * 2**30)
    assert pages * page_bytes <= 10 * 2**30 and pages >= 2
    small = max(BucketPlan.from_limits(64, 4, 256, 16).buckets())
    assert provisional_num_pages(small, page_bytes, 100 * 2**30) == small.num_seqs * small.num_pages + 1


@pytest.mark.parametrize("platform, requested, stored, native_bf16, expected", [
    ("cpu", "auto", "float32", False, "float32"),
    ("cpu", "auto", "bfloat16", False, "float32"),
    ("cpu", "auto", "bfloat16", True, "bfloat16"),
    ("cpu", "auto", "quantized", False, "float32"),
    ("cpu", "auto", "quantized", True, "bfloat16"),
    ("cpu", "float16", "float16", True, "bfloat16"),
    ("cpu", "float16", "float32", False, "float32"),
    ("cpu", "auto", "float16", False, "float32"),
    ("cpu", "bfloat16", "float32", False, "bfloat16"),  # asked for: kept
    ("gpu", "auto", "bfloat16", None, "bfloat16"),
    ("gpu", "auto", "float16", None, "float16"),
    ("gpu", "auto", "quantized", None, "bfloat16"),
    ("tpu", "auto", "float16", None, "bfloat16"),
    ("tpu", "float16", "float32", None, "bfloat16"),
])
def test_auto_dtype_choice(platform, requested, stored, native_bf16, expected):
    dtype, why = choose_dtype(requested, stored, platform, native_bf16=native_bf16)
    assert dtype == expected and why


def test_cpu_bf16_detection_reads_the_flags():
    assert cpu_has_native_bf16(frozenset({"avx2", "avx512_bf16"}))
    assert cpu_has_native_bf16(frozenset({"amx_bf16"}))
    assert not cpu_has_native_bf16(frozenset({"avx2", "avx512f"}))


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_checkpoints, tmp_path_factory):
    """The tiny llama stored as bfloat16, with a generation_config.json."""
    import torch
    import transformers

    path = tmp_path_factory.mktemp("bf16") / "llama"
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    for name in os.listdir(tiny_checkpoints["llama"]):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tiny_checkpoints["llama"], name), path)
    (path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7, "eos_token_id": [2, 7],
         "do_sample": True}))
    return str(path)


def test_auto_dtype_float16_and_generation_config(bf16_checkpoint, caplog):
    """dtype="float16" on CPU (which the KV write does not take) runs as bf16/f32; the directory's
    generation_config.json gives the default sampling params and an extra EOS id."""
    with caplog.at_level(logging.WARNING, logger="jaxrunner"):
        llm = make_llm(bf16_checkpoint, dtype="float16")
    expected = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert llm.startup_report["dtype"] == expected and "float16 is not computed on CPU" in caplog.text
    assert "float16 is not computed on CPU" in llm.startup_report["dtype_reason"]
    out = llm.generate([{"prompt_token_ids": [5, 6, 9]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].token_ids
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.6, 0.9, 20, 7)
    assert {2, 7} <= set(llm.engine.eos_token_ids)


def test_convert_keeps_the_generation_config(bf16_checkpoint, tmp_path):
    from jaxrunner.cli import main
    from jaxrunner.models.loading import load_model

    assert main(["convert", bf16_checkpoint, str(tmp_path / "ckpt")]) == 0
    converted = load_model(str(tmp_path / "ckpt"), progress=False)
    assert converted.generation_config["temperature"] == 0.6 and {2, 7} <= set(converted.config.eos_token_ids)


def test_llm_model_none_is_a_value_error(no_loading):
    with pytest.raises(ValueError, match="EngineConfig.model: invalid value None"):
        LLM(model=None)


def test_auto_dtype_of_a_bfloat16_checkpoint(bf16_checkpoint):
    llm = make_llm(bf16_checkpoint, dtype="auto")
    assert llm.startup_report["dtype"] == ("bfloat16" if cpu_has_native_bf16() else "float32")
    assert llm.startup_report["dtype_reason"].startswith("auto: the checkpoint is bfloat16")


def test_without_generation_config_the_defaults_are_plain(tiny_checkpoints):
    llm = make_llm(tiny_checkpoints["llama"])
    assert llm.get_default_sampling_params() == SamplingParams()


# ----------------------------------------------------------------------------- vLLM's names
def test_vllm_names_map_to_the_same_knobs(tiny_checkpoints, caplog):
    options = {k: v for k, v in TINY_ENGINE.items() if k != "page_size"}
    with caplog.at_level(logging.INFO, logger="jaxrunner"):
        llm = LLM(tiny_checkpoints["llama"], gpu_memory_utilization=0.5, block_size=8, enforce_eager=True,
                  tokenizer=tiny_checkpoints["qwen2"], **options)
    assert llm.engine.config.page_size == 8 and llm.engine.config.memory_utilization == 0.5
    assert "enforce_eager=True has no effect" in caplog.text
    assert llm.get_tokenizer().name_or_path == tiny_checkpoints["qwen2"]


@pytest.mark.parametrize("options, message", [
    ({"max_num_seq": 4}, "unknown option(s) max_num_seq"),
    ({"block_size": 8, "page_size": 8}, "both 'block_size' and 'page_size'"),
    ({"enforce_eager": "yes"}, "LLM.enforce_eager"),
    ({"tokenizer": "/no/such/dir"}, "LLM.tokenizer"),
])
def test_bad_vllm_style_options(tiny_checkpoints, no_loading, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(tiny_checkpoints["llama"], **options)


def test_reset_prefix_cache(tiny_checkpoints):
    llm = make_llm(tiny_checkpoints["llama"])
    allocator = llm.engine.scheduler.allocator
    llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert allocator.num_cached_pages > 0
    assert llm.reset_prefix_cache() is True
    assert allocator.num_cached_pages == 0 and allocator.num_free_pages == allocator.num_usable_pages
    allocator.check_invariants()


# ----------------------------------------------------------------------------- in someone else's process
# A fresh process compiles from an empty cache: one bucket keeps that short.
ONE_BUCKET = dict(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=32, page_size=16)


def test_user_jax_settings_are_kept_and_a_failing_native_build_is_reported_once(tiny_checkpoints, tmp_path):
    """In a fresh process: a compilation cache dir set in jax.config stays; a native kernel that
    cannot be built (CXX=/bin/false) is tried once, warned about once, and named in the report."""
    code = textwrap.dedent(f"""
        import json, logging, jax
        logging.basicConfig(level=logging.WARNING)
        jax.config.update("jax_compilation_cache_dir", {str(tmp_path / "users-cache")!r})
        from jaxrunner import LLM
        from jaxrunner.kernels import native
        options = {dict(TINY_ENGINE, compilation_cache_dir=str(tmp_path / "ours"), **ONE_BUCKET)!r}
        llm = LLM({tiny_checkpoints["llama"]!r}, **options)
        for _ in range(3):
            assert not native.available()
        report = llm.startup_report
        print(json.dumps({{k: report[k] for k in ("native_cpu_kernel", "attention_impl", "compilation_cache_dir")}}
                         | {{"jax": jax.config.jax_compilation_cache_dir}}))
    """)
    env = dict(os.environ, CXX="/bin/false", JAXRUNNER_CACHE_DIR=str(tmp_path / "kernels"))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["jax"] == report["compilation_cache_dir"] == str(tmp_path / "users-cache")
    assert not (tmp_path / "ours").exists()
    assert report["native_cpu_kernel"].startswith("unavailable, XLA fallback in use: building the native")
    assert report["attention_impl"] == "xla"
    assert result.stderr.count("native CPU kernel unavailable") == 1, result.stderr[-3000:]


def test_jaxrunner_sets_its_cache_dir_only_when_none_is_set_and_logs_it(tmp_path, caplog):
    import jax

    from jaxrunner.runner.startup import enable_compilation_cache

    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        with caplog.at_level(logging.INFO, logger="jaxrunner"):
            assert enable_compilation_cache(str(tmp_path / "a")) == str(tmp_path / "a")
            assert enable_compilation_cache(str(tmp_path / "b")) == str(tmp_path / "a")
        assert f"set jax_compilation_cache_dir to {tmp_path / 'a'}" in caplog.text
        assert f"keeping {tmp_path / 'a'}, already set in jax.config" in caplog.text
        assert not (tmp_path / "b").exists()
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
