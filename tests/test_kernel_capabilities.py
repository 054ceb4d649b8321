"""The one door into the kernels: the capability query, the implementation names written once, the
runner's matmul choice reaching the model, and model code that imports only the public
``jaxrunner.kernels`` names and asks JAX nothing about devices."""
from __future__ import annotations

import argparse
import ast
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxrunner
from jaxrunner import kernels
from jaxrunner.kernels import names as kernel_names
from jaxrunner.kernels import native

PACKAGE = pathlib.Path(jaxrunner.__file__).parent
MODELS = PACKAGE / "models"


# ----------------------------------------------------------------------------- the capability query
def test_capabilities_answer_on_this_cpu_machine():
    caps = kernels.capabilities()
    assert caps.platform == "cpu" and caps.device_count == jax.device_count()
    assert set(caps.attention) == set(kernel_names.ATTENTION_IMPLS)
    assert {"reference", "xla", "pallas"} <= set(caps.attention_impls)
    assert "jax_tpu" not in caps.attention_impls and "TPU only" in caps.attention["jax_tpu"]
    assert caps.native_cpu == native.unavailable_reason()
    if caps.native_cpu is None:  # built and loaded here: native attention, and its bf16 write in place
        assert "native" in caps.attention_impls and caps.native_cpu_status == "ready"
        assert caps.writes_in_place("native", "bfloat16")
        assert caps.matmuls == kernels.MatmulKernels("native", "native", min_16bit_rows=4,
                                                     onednn_dtypes=caps.matmuls.onednn_dtypes,
                                                     onednn_min_weight_bytes=caps.matmuls.onednn_min_weight_bytes,
                                                     onednn_weight_only=caps.matmuls.onednn_weight_only,
                                                     xla_weights_nk=caps.matmuls.xla_weights_nk,
                                                     xla_weights_nk_min_inputs=caps.matmuls.xla_weights_nk_min_inputs,
                                                     elementwise="native", weight_only_gemm=native.panel_gemm(),
                                                     dequantize_min_rows=caps.matmuls.dequantize_min_rows,
                                                     weight_only_panels=caps.matmuls.weight_only_panels,
                                                     w8a8_tiles=native.w8a8_matmul_ready())
        # AMX-INT8 tiles for "w8a8" weights exactly where the build has them and the OS grants AMX
        assert caps.matmuls.w8a8_tiles == ("amx_int8" in native.cpu_features() and native.w8a8_matmul_ready())
        # panels where the native kernel takes every row count oneDNN does not (oneDNN reads them too)
        every_row = native.stored_panels() and not caps.matmuls.dequantize_min_rows
        assert caps.matmuls.weight_only_panels == (("float32", "bfloat16") if every_row else ())
    else:  # no compiler (or a failed build): the reason, and XLA everywhere
        assert caps.attention["native"] == caps.native_cpu and caps.native_cpu
        assert caps.native_cpu_status.startswith("unavailable, XLA fallback in use: ")
        assert caps.matmuls.one_row == caps.matmuls.weight_only == caps.matmuls.elementwise == "xla"
    assert caps.writes_in_place("xla", "float32") and not caps.writes_in_place("xla", "bfloat16")
    assert not caps.writes_in_place("jax_tpu", "float32")  # it does not run here at all


def test_capabilities_of_other_platforms_and_device_counts():
    several = kernels.capabilities("cpu", device_count=8)
    assert several.matmuls.one_row == several.matmuls.weight_only == "xla"  # sharded programs keep XLA's dot
    assert several.matmuls.onednn_dtypes == () == several.matmuls.onednn_weight_only
    assert not several.matmuls.xla_weights_nk and not several.matmuls.weight_only_gemm
    assert several.matmuls.weight_only_panels == ()
    assert several.matmuls.min_16bit_rows == 4                             # XLA:CPU's one-row GEMV
    for name in ("gpu", "cuda"):
        gpu = kernels.capabilities(name)
        assert gpu.platform == "gpu" and gpu.matmuls == kernels.XLA_MATMULS
        assert gpu.native_cpu_status == "not used on gpu" and "CPU only" in gpu.attention["native"]
        assert gpu.writes_in_place("pallas", "bfloat16") and gpu.writes_in_place("xla", "float16")
    tpu = kernels.capabilities("tpu")
    assert "native" not in tpu.attention_impls and "jax_tpu" in tpu.attention  # shipped or not, it says why


@pytest.mark.parametrize("flags, want", [
    ({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}, (("float32", "bfloat16", "float16"), 0)),
    ({"avx2", "fma"}, (("float32",), 2048)),                       # AVX2 without AVX-512: wide float32 only
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, ((), 0)),          # AVX-512 without AMX: not measured faster
    (set(), ((), 0)),
])
def test_weights_held_transposed_follow_the_cpu_kind(monkeypatch, flags, want):
    """Which float weights start-up holds [N, K] for XLA's dot is read off the CPU's flags."""
    from jaxrunner.kernels import platform_support
    monkeypatch.setattr(platform_support.native, "cpu_features", lambda: tuple(sorted(flags)))
    assert platform_support._xla_weights_nk() == want


@pytest.mark.parametrize("flags, cpu, want", [
    ({"avx2", "fma"}, ("AuthenticAMD", 0x17, 0x01), 512),   # Zen 1: 256-bit instructions in halves
    ({"avx2", "fma"}, ("HygonGenuine", 0x18, 0x00), 512),   # Dhyana, a Zen 1
    ({"avx2", "fma"}, ("AuthenticAMD", 0x17, 0x31), 32),    # Zen 2 runs them whole
    ({"avx2", "fma"}, ("AuthenticAMD", 0x19, 0x01), 32),    # Zen 3
    ({"avx2", "fma"}, ("GenuineIntel", 6, 0x55), 32),
    ({"avx2", "fma", "avx512f", "avx512_vnni"}, ("AuthenticAMD", 0x19, 0x11), 0),  # VNNI panels: never
    ({"avx2", "fma"}, ("", -1, -1), 32),                     # /proc/cpuinfo unreadable
    (set(), ("GenuineIntel", 6, 0x55), 0),
])
def test_float_rows_leave_the_panels_by_cpu_kind(monkeypatch, flags, cpu, want):
    """From how many float32 rows weight-only products go to XLA's dot is read off the CPU's flags
    and, on AVX2, whether it splits 256-bit instructions in halves (the family and model)."""
    from jaxrunner.kernels import cpu_isa, platform_support
    monkeypatch.setattr(platform_support.native, "cpu_features", lambda: tuple(sorted(flags)))
    monkeypatch.setattr(cpu_isa, "machine_model", lambda: cpu)
    assert cpu_isa.splits_256bit_vectors() == (want == 512)
    assert platform_support._dequantize_float_rows() == want


def test_default_kv_cache_dtype_follows_the_capabilities():
    from jaxrunner.runner.startup import default_kv_cache_dtype

    caps = kernels.capabilities()
    for impl in caps.attention_impls:
        want = "bfloat16" if caps.writes_in_place(impl, "bfloat16") else "float32"
        assert default_kv_cache_dtype("bfloat16", "cpu", impl) == want, impl


def test_matmul_choice_is_checked():
    with pytest.raises(ValueError, match="MatmulKernels.one_row"):
        kernels.MatmulKernels(one_row="triton")
    with pytest.raises(ValueError, match="MatmulKernels.min_16bit_rows"):
        kernels.MatmulKernels(min_16bit_rows=0)
    with pytest.raises(ValueError, match="MatmulKernels.onednn_dtypes"):
        kernels.MatmulKernels(onednn_dtypes=("float16",))
    with pytest.raises(ValueError, match="MatmulKernels.onednn_min_weight_bytes"):
        kernels.MatmulKernels(onednn_min_weight_bytes=-1)
    with pytest.raises(ValueError, match="MatmulKernels.xla_weights_nk"):
        kernels.MatmulKernels(xla_weights_nk=("int4",))
    with pytest.raises(ValueError, match="MatmulKernels.xla_weights_nk_min_inputs"):
        kernels.MatmulKernels(xla_weights_nk_min_inputs=-1)


def test_runner_hands_its_matmul_choice_to_the_model():
    """The runner asks the query once; the forward it traces routes a one-row product to the native
    kernel exactly when the answer says so (an architecture built without a choice stays on XLA),
    and its sampler the top-k/top-p thresholds and the logprob statistics."""
    from jaxrunner.models import registry
    from jaxrunner.models.config import ModelConfig
    from jaxrunner.models.params import param_shapes
    from jaxrunner.runner.buckets import Bucket
    from jaxrunner.runner.model_runner import KVCacheSpec, ModelRunner
    from jaxrunner.runner.warmup import random_dummy_batch

    cfg = ModelConfig("llama", 256, 64, 128, 2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda shape: (rng.standard_normal(shape) * 0.05).astype(np.float32), param_shapes(cfg),
                          is_leaf=lambda x: isinstance(x, tuple))
    spec = KVCacheSpec(16, 8, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float32")
    batch = random_dummy_batch(jax.random.key(0), Bucket(1, 1, 4), 8, 16, cfg.vocab_size, 32)

    runner = ModelRunner(cfg, params, spec, "xla", max_seqs_per_step=1)
    assert runner.matmuls == kernels.capabilities().matmuls
    lowered = runner.lower(batch).as_text()
    assert (lowered.count(native.MATMUL_TARGET_NAME) > 0) == (runner.matmuls.one_row == "native")
    # and the sampler's top-k/top-p thresholds and logprob statistics go where the element-wise steps do
    assert (lowered.count(native.THRESHOLDS_TARGET_NAME) > 0) == (runner.matmuls.elementwise == "native")
    assert (lowered.count(native.LOGPROB_STATS_TARGET_NAME) > 0) == (runner.matmuls.elementwise == "native")
    portable = ModelRunner(cfg, params, spec, "xla", max_seqs_per_step=1, architecture=registry.architecture_for(cfg))
    assert portable.lower(batch).as_text().count(native.MATMUL_TARGET_NAME) == 0


def test_cache_takes_the_layout_its_attention_reads():
    """Every implementation but ``jax_tpu`` keeps K and V in two pools per layer; ``jax_tpu`` one
    combined pool, jax's kernel's own layout (no page is copied into it per step), of the same size."""
    from jaxrunner.runner.model_runner import KVCacheSpec

    spec = KVCacheSpec(6, 8, 3, 2, 16, "float32")
    for impl, shapes in (("xla", [(6, 8, 2, 16)] * 2), ("jax_tpu", [(6, 8, 4, 16)])):
        cache = spec.allocate(attention_impl=impl)
        assert len(cache) == 3 and all([pool.shape for pool in layer] == shapes for layer in cache), impl
        assert sum(pool.nbytes for layer in cache for pool in layer) == spec.nbytes


@pytest.mark.parametrize("kv_heads,tp,kv_dtype,want", [
    (12, 1, "bfloat16", "pallas"),   # bf16: 1, 2, 4 or a multiple of 8
    (12, 1, "float32", "jax_tpu"),   # float32 also multiples of 4 (with 2+ query heads each)
    (12, 1, None, "pallas"),         # the pool's dtype unknown: only what both take
    (12, 3, "bfloat16", "jax_tpu"),  # 4 KV heads per shard
    (16, 2, "bfloat16", "jax_tpu"),  # 8 per shard
    (12, 2, "bfloat16", "pallas"),   # 6 per shard
    (2, 4, "bfloat16", "jax_tpu"),   # fewer KV heads than shards: one copy per shard
])
def test_start_up_judges_the_kv_heads_of_one_shard(kv_heads, tp, kv_dtype, want):
    """On TPU ``auto`` asks jax's kernel about the heads each shard holds, in the pool's dtype."""
    from jaxrunner import EngineConfig
    from jaxrunner.kernels import jax_tpu
    from jaxrunner.models.config import ModelConfig
    from jaxrunner.runner.startup import choose_attention

    if jax_tpu.available() is not None:
        pytest.skip(jax_tpu.available())
    cfg = ModelConfig("llama", 256, 64, 128, 2, num_heads=2 * kv_heads * max(1, tp // kv_heads), num_kv_heads=kv_heads,
                      head_dim=128, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                      tie_word_embeddings=False)
    impl, why = choose_attention(EngineConfig(tensor_parallel_size=tp), "tpu", cfg, kv_dtype)
    assert impl == want, why


# ----------------------------------------------------------------------------- implementation names
def test_implementation_names_are_one_tuple():
    from jaxrunner import cli, config
    from jaxrunner.kernels import dispatch

    assert kernel_names.ATTENTION_IMPL_CHOICES == ("auto", *kernel_names.ATTENTION_IMPLS)
    assert config.ATTENTION_IMPL_CHOICES is kernel_names.ATTENTION_IMPL_CHOICES
    assert dispatch.ATTENTION_IMPLS is kernels.ATTENTION_IMPLS is kernel_names.ATTENTION_IMPLS
    flags = [action for parser in _parsers(cli.build_parser()) for action in parser._actions
             if "--attention-impl" in action.option_strings]
    assert flags and all(list(action.choices) == list(kernel_names.ATTENTION_IMPL_CHOICES) for action in flags)
    for path in (PACKAGE / "config.py", PACKAGE / "cli.py", pathlib.Path(dispatch.__file__)):
        assert not _name_lists(ast.parse(path.read_text())), f"{path.name} writes the implementation names again"


def test_name_list_check_can_fail():
    assert _name_lists(ast.parse('IMPLS = ("auto", "xla", "native")\nchoices=["pallas", "jax_tpu"]')) == 2


def test_unknown_implementation_names_the_valid_ones():
    from jaxrunner import EngineConfig

    with pytest.raises(ValueError, match="EngineConfig.attention_impl") as err:
        EngineConfig(attention_impl="triton")
    assert all(repr(name) in str(err.value) for name in kernel_names.ATTENTION_IMPL_CHOICES)
    with pytest.raises(ValueError, match="triton") as err:
        kernels.choose_impl("triton")
    assert all(name in str(err.value) for name in kernel_names.ATTENTION_IMPLS)


def test_config_and_names_import_without_jax():
    code = "import sys, jaxrunner.config, jaxrunner.kernels.names; print('jax' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def _name_lists(tree: ast.AST) -> int:
    """Tuple or list literals that hold two or more implementation names."""
    names = set(kernel_names.ATTENTION_IMPLS)
    return sum(1 for node in ast.walk(tree) if isinstance(node, (ast.Tuple, ast.List))
               and sum(isinstance(e, ast.Constant) and e.value in names for e in node.elts) >= 2)


# ----------------------------------------------------------------------------- model code and the kernels
DEVICE_QUERIES = {"device_count", "devices", "local_devices", "local_device_count", "default_backend"}
# Loading runs on the host before anything is traced; it asks which device the weights go to.
DEVICE_QUERIES_ALLOWED_IN = ("loading",)


def test_model_code_imports_only_public_kernel_names_and_never_asks_for_devices():
    problems = []
    for path in sorted(MODELS.rglob("*.py")):
        relative = path.relative_to(MODELS)
        tree = ast.parse(path.read_text(), filename=str(path))
        problems += [f"{relative}: {p}" for p in _private_kernel_uses(tree)]
        if relative.parts[0] not in DEVICE_QUERIES_ALLOWED_IN:
            problems += [f"{relative}: {p}" for p in _device_queries(tree)]
    assert not problems, "\n".join(problems)


def test_model_code_check_can_fail():
    tree = ast.parse("import jax\nfrom jax import devices\nfrom jaxrunner import kernels\n"
                     "from jaxrunner.kernels import native, capabilities\nimport jaxrunner.kernels.xla\n"
                     "from jaxrunner.kernels.native import small_matmul_native\n"
                     "def f(x):\n    return kernels.native.x(x) if jax.device_count() == 1 else jax.default_backend()\n")
    assert len(_private_kernel_uses(tree)) == 4  # native (twice), kernels.xla, kernels.native
    assert len(_device_queries(tree)) == 3       # devices, device_count, default_backend


def _private_kernel_uses(tree: ast.AST) -> list[str]:
    public = set(kernels.__all__)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("jaxrunner.kernels."):
                found.append(f"imports {node.module}")
            elif node.module == "jaxrunner.kernels":
                found += [f"imports jaxrunner.kernels.{a.name}" for a in node.names if a.name not in public]
        elif isinstance(node, ast.Import):
            found += [f"imports {a.name}" for a in node.names if a.name.startswith("jaxrunner.kernels.")]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "kernels"
              and node.attr not in public):
            found.append(f"uses kernels.{node.attr}")
    return found


def _device_queries(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "jax":
            found += [f"imports jax.{a.name}" for a in node.names if a.name in DEVICE_QUERIES]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "jax"
              and node.attr in DEVICE_QUERIES):
            found.append(f"calls jax.{node.attr}")
    return found
