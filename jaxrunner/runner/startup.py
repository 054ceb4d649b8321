"""Start-up: compilation cache, KV-pool sizing, runner construction, warm-up, and the report.

Order matters: the KV pool's shape is part of every executable's signature, so the pool is sized
*before* anything is compiled; then every bucket is compiled and run once on random dummy batches.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import jax

from jaxrunner import kernels
from jaxrunner.config import EngineConfig
from jaxrunner.models import registry
from jaxrunner.models.lora import LoraSpec
from jaxrunner.models.params import param_shapes
from jaxrunner.models.loading import LoadedModel
from jaxrunner.parallel import mesh as meshes, sharding
from jaxrunner.runner.buckets import BucketPlan
from jaxrunner.runner.model_runner import KVCacheSpec, ModelRunner
from jaxrunner.runner import cache_events, memory, warmup
from jaxrunner.runner.memory import StartupError
from jaxrunner.kernels.names import AUTO

logger = logging.getLogger("jaxrunner")


def enable_compilation_cache(cache_dir: str | None) -> str | None:
    """JAX's persistent compilation cache, so a second start-up of the same config compiles less.

    The setting is process-wide: a directory already set in ``jax.config`` (by the user, or by an
    earlier engine) is kept as it is. Returns the directory in use (None: no persistent cache)."""
    current = jax.config.jax_compilation_cache_dir
    if current:
        if cache_dir and os.path.abspath(current) != os.path.abspath(cache_dir):
            logger.info("compilation cache: keeping %s, already set in jax.config (not %s)", current, cache_dir)
        return current
    if not cache_dir:
        return None
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    logger.info("compilation cache: set jax_compilation_cache_dir to %s", cache_dir)
    return cache_dir


def choose_attention(config: EngineConfig, platform: str, cfg, kv_dtype: str | None = None) -> tuple[str, str]:
    """(the attention implementation this engine runs, why): the one place it is chosen, for the
    pre-flight check, the KV pool's dtype, the runner and the start-up report alike. The kernels
    are judged for the heads one shard holds and, when given, the pool's ``kv_dtype`` (jax's TPU
    kernel takes different KV-head counts in bf16 and float32 pools; unknown: only those both take)."""
    tp = config.tensor_parallel_size
    kv_heads = sharding.served_config(cfg, tp).num_kv_heads // tp  # KV heads copied when fewer than shards
    return kernels.choose_impl(config.attention_impl, platform, cfg.head_dim, config.page_size,
                               num_kv_heads=kv_heads, num_q_heads=cfg.num_heads // tp, kv_dtype=kv_dtype)


def check_attention(config: EngineConfig, platform: str, impl: str, why: str, self_check) -> tuple[str, str, float]:
    """``(impl, why, self-check error)``: ``self_check(impl)`` (``warmup.attention_self_check`` on the
    largest bucket) run before anything is sized or compiled for the model.

    On an accelerator some failures show only when the kernel compiles there (Triton over the device's
    shared memory, a Mosaic rejection), never when it lowers here. Under ``auto`` such a kernel falls
    back to plain XLA and ``why`` says what failed; an impl the user named still fails the start, and so
    does any kernel that compiles but differs from the reference (``StartupError``).
    """
    try:
        return impl, why, self_check(impl)
    except StartupError:
        raise
    except Exception as e:  # noqa: BLE001 - any compile failure of the chosen kernel
        if config.attention_impl != AUTO or platform == "cpu" or impl == "xla":
            raise
        reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
        logger.warning("attention %s failed to compile on %s (%s); plain XLA instead", impl, platform, reason)
        return "xla", f"{why}, but it failed to compile here ({reason}); plain XLA instead", self_check("xla")


def choose_matmuls(config: EngineConfig, platform: str):
    """(where the model's linear products run, why): ``config.cpu_matmul`` resolved on ``platform``,
    with ``"w4a8"``'s int8 activations where ``config.quantization`` asks for them."""
    matmuls, why = kernels.choose_matmuls(config.cpu_matmul, platform)
    if config.quantization == "w4a8":
        matmuls = dataclasses.replace(matmuls, weight_only_activations="int8")
    return matmuls, why


def _matmul_summary(matmuls) -> str:
    """For the report: "onednn (bfloat16/float32 weights of 8+ MiB, packed; int8/int4 weights with
    bfloat16 activations)" or "xla", and where the native kernel's panel GEMMs take the weight-only
    products of every row count, "; int8/int4 weights: native panel GEMMs at every row count" (and
    where they are laid out as panels at start-up, with which activations), and "; w8a8 weights:
    native AMX-INT8 tiles" where those products run on AMX-INT8."""
    parts = []
    if matmuls.onednn_dtypes:
        parts.append(f"{'/'.join(matmuls.onednn_dtypes)} weights of {matmuls.onednn_min_weight_bytes >> 20}+ MiB, "
                     f"packed")
    if matmuls.onednn_weight_only:
        parts.append(f"int8/int4 weights with {'/'.join(matmuls.onednn_weight_only)} activations")
    xla = "xla"
    if matmuls.xla_weights_nk:
        inputs = f" of {matmuls.xla_weights_nk_min_inputs}+ inputs" if matmuls.xla_weights_nk_min_inputs else ""
        xla = f"xla (the other {'/'.join(matmuls.xla_weights_nk)} weights{inputs} transposed)"
    summary = f"onednn ({'; '.join(parts)}), {xla}" if parts else xla
    if matmuls.weight_only_gemm:
        summary += "; int8/int4 weights: native panel GEMMs at every row count"
        if matmuls.dequantize_min_rows:
            summary += f" (float32: below {matmuls.dequantize_min_rows})"
        if matmuls.weight_only_panels:
            summary += f", laid out as panels with {'/'.join(matmuls.weight_only_panels)} activations"
    if matmuls.w8a8_tiles:
        summary += "; w8a8 weights: native AMX-INT8 tiles"
    return summary


def default_kv_cache_dtype(dtype: str, platform: str, attention_impl: str = "xla") -> str:
    """The compute dtype where ``attention_impl``'s page write updates such a pool in place
    (``kernels.capabilities``), else float32, which every write does in place. Bfloat16 on CPU
    without the native kernel is the case: XLA:CPU's bf16 scatter converts the whole pool to f32
    and back every layer (measured 56 ms per write for 2 × 25 MB), while the native kernel writes
    bf16 rows in place, and its attention then reads half the bytes."""
    if kernels.capabilities(platform).writes_in_place(attention_impl, dtype):
        return dtype
    return "float32"


def model_max_len(cfg) -> tuple[int, str]:
    """The longest sequence the model takes, and which field says so: ``max_position_embeddings``,
    times the factor of a linear rope scaling (as vLLM derives it; llama3 scaling's
    ``max_position_embeddings`` is already the scaled length)."""
    scaling = cfg.rope_scaling_dict or {}
    if scaling.get("rope_type") == "linear":
        factor = float(scaling.get("factor", 1.0))
        return int(cfg.max_position_embeddings * factor), f"max_position_embeddings × linear rope factor {factor:g}"
    return cfg.max_position_embeddings, "max_position_embeddings"


def resolve_max_model_len(config: EngineConfig, model_config) -> tuple[int, str]:
    """(max_model_len before the KV pool is sized, why): the requested one, checked against the
    model's limit, or that limit."""
    limit, field = model_max_len(model_config)
    if config.max_model_len is None:
        return limit, f"the model's {field}"
    if config.max_model_len > limit:
        raise ValueError(f"EngineConfig.max_model_len: {config.max_model_len} exceeds the model's "
                         f"{field} ({limit}); valid: 1..{limit}, or None for the model's limit")
    return config.max_model_len, "requested"


def fit_max_model_len(config: EngineConfig, max_model_len: int, why: str, num_pages: int) -> tuple[int, str]:
    """A default max_model_len lowered to what the pool holds for one sequence (a requested one is kept)."""
    holds = (num_pages - 1) * config.page_size  # the scratch page holds no tokens
    if config.max_model_len is None and holds < max_model_len:
        return holds, f"the KV pool holds {holds} tokens for one sequence (below {why}, {max_model_len})"
    return max_model_len, why


def provisional_num_pages(bucket, bytes_per_page: int, room_bytes: int) -> int:
    """Pages of the pool the largest bucket is profiled against: as many as it can address, but
    within a tenth of the memory left after the weights (the model's own max_model_len can make a
    bucket address more pages than the device holds; the dummy batch then repeats pages)."""
    return int(max(2, min(bucket.num_seqs * bucket.num_pages + 1, room_bytes // 10 // bytes_per_page)))


def _profile_activation_bytes(model: LoadedModel, plan: BucketPlan, template: KVCacheSpec, config,
                              max_model_len: int, mesh, room_bytes: int) -> int:
    """Peak temporaries of the largest bucket, compiled once against a provisional small pool.

    Only where the device reports its memory (GPU, TPU): there the pool takes what is left, so the
    activations must be known first. The provisional pool is small (:func:`provisional_num_pages`),
    so the extra compile costs little memory.
    """
    largest = max(plan.buckets())
    bytes_per_page = template.bytes_per_page // meshes.tensor_parallel_size(mesh)
    spec = dataclasses.replace(template, num_pages=provisional_num_pages(largest, bytes_per_page, room_bytes))
    platform = meshes.local_device(mesh).platform
    impl, _ = choose_attention(config, platform, model.config)
    runner = ModelRunner(model.config, model.params, spec, impl, mesh=mesh,
                         max_prefill_seqs=config.max_num_prefill_seqs, max_seqs_per_step=largest.num_seqs,
                         architecture=model.architecture, matmuls=choose_matmuls(config, platform)[0],
                         lora_spec=lora_spec(config, model))
    batch = warmup.random_dummy_batch(jax.random.key(config.seed), largest, spec.page_size, spec.num_pages,
                                      model.config.vocab_size, max_model_len, config.max_num_prefill_seqs,
                                      max_loras=config.max_loras if config.enable_lora else 0)
    return int(runner.compile(largest, batch).get("temp_bytes", 0))


def _choose_num_pages(config, model, plan, budget, template, max_model_len, mesh) -> tuple[int, str, int]:
    """(num_pages, how it was chosen, activation bytes profiled), all per device of ``mesh``: each
    holds its shard of the weights and ``1 / tp`` of every page (the pool is split by KV heads)."""
    weights_bytes = max(sharding.bytes_per_device(model.params).values())
    adapters = lora_spec(config, model)
    if adapters is not None:  # the slots sit beside the weights (counted whole: some factors are not split)
        weights_bytes += adapters.nbytes(model.config, param_shapes(model.config)["layers"],
                                         model.params["final_norm"].dtype)
    bytes_per_page = template.bytes_per_page // meshes.tensor_parallel_size(mesh)
    memory.check_pool_fits(budget, weights_bytes, bytes_per_page, config.num_pages, config.kv_cache_memory_bytes)
    if config.num_pages is not None:
        return config.num_pages, "num_pages given", 0
    activation_bytes = 0
    if budget.device_bytes is not None and config.kv_cache_memory_bytes is None:
        memory.check_weights_fit(budget, weights_bytes)
        activation_bytes = _profile_activation_bytes(model, plan, template, config, max_model_len, mesh,
                                                     budget.budget_bytes - weights_bytes)
    pages_per_seq = math.ceil(max_model_len / config.page_size)
    num_pages, how = memory.size_kv_pool(
        budget=budget, weights_bytes=weights_bytes, activation_bytes=activation_bytes,
        bytes_per_page=bytes_per_page,
        max_useful_pages=config.max_num_seqs * pages_per_seq + 1, kv_cache_memory_bytes=config.kv_cache_memory_bytes)
    return num_pages, how, activation_bytes


def lora_spec(config: EngineConfig, model: LoadedModel) -> LoraSpec | None:
    """The adapter slots ``config`` asks for (None without ``enable_lora``); a model they cannot
    serve is refused by name."""
    if not config.enable_lora:
        return None
    if model.architecture is not None:
        raise ValueError("enable_lora: adapters are served on the registered families' models, not on a user's "
                         "architecture (a Flax NNX module)")
    if model.kv_head_replication > 1:
        raise ValueError(f"enable_lora with tensor_parallel_size={config.tensor_parallel_size}: the model's KV heads "
                         f"are replicated across shards, which LoRA slots do not support; use a tensor_parallel_size "
                         f"that divides the number of KV heads")
    return LoraSpec(config.max_loras, config.max_lora_rank)


def start_runner(config: EngineConfig, model: LoadedModel) -> tuple[ModelRunner, BucketPlan, int, dict]:
    """Size the KV pool, build the runner, compile and warm up every bucket.

    Returns (runner, bucket plan, max_model_len, start-up report).
    """
    with cache_events.watch() as cache_watch:
        return _start_runner(config, model, cache_watch)


def _start_runner(config: EngineConfig, model: LoadedModel, cache_watch) -> tuple[ModelRunner, BucketPlan, int, dict]:
    t0 = time.perf_counter()
    cache_dir = enable_compilation_cache(config.compilation_cache_dir)
    max_model_len, why = resolve_max_model_len(config, model.config)
    plan = _bucket_plan(config, max_model_len)
    cfg = model.config
    mesh = model.mesh if model.mesh is not None else meshes.build_mesh(1, 1)
    device = meshes.local_device(mesh)
    budget = memory.memory_budget(device, config.memory_utilization)
    # a TPU writes every float pool in place, so its pool takes the model's dtype unless one is asked for
    impl, impl_why = choose_attention(config, device.platform, cfg, config.kv_pool_dtype or model.dtype)
    key = jax.random.key(config.seed)

    def self_check(name: str) -> float:
        dtype = config.kv_pool_dtype or default_kv_cache_dtype(model.dtype, device.platform, name)
        return warmup.attention_self_check(name, plan.buckets()[-1], config.page_size, cfg.num_heads,
                                           cfg.num_kv_heads, cfg.head_dim, dtype, jax.random.fold_in(key, 1 << 16),
                                           config.max_num_prefill_seqs)

    impl, impl_why, check_error = check_attention(config, device.platform, impl, impl_why, self_check)
    t_checked = time.perf_counter()
    matmuls, matmuls_why = choose_matmuls(config, device.platform)
    template = KVCacheSpec(2, config.page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                           config.kv_pool_dtype or default_kv_cache_dtype(model.dtype, device.platform, impl))
    num_pages, how, activation_bytes = _choose_num_pages(config, model, plan, budget, template, max_model_len, mesh)
    fitted, why = fit_max_model_len(config, max_model_len, why, num_pages)
    if fitted != max_model_len:
        max_model_len, plan = fitted, _bucket_plan(config, fitted)
    logger.info("max_model_len %d: %s", max_model_len, why)
    logger.info("bucket plan: %s", plan.describe())
    spec = dataclasses.replace(template, num_pages=num_pages)
    t_sized = time.perf_counter()
    runner = ModelRunner(cfg, model.params, spec, impl, mesh=mesh, max_prefill_seqs=config.max_num_prefill_seqs,
                         max_seqs_per_step=max(bucket.num_seqs for bucket in plan.buckets()),
                         architecture=model.architecture, matmuls=matmuls, lora_spec=lora_spec(config, model))
    jax.block_until_ready(runner.kv_cache)
    t_alloc = time.perf_counter()

    buckets = plan.buckets()
    per_bucket, phases = warmup.warm_up(runner, buckets, key=key, mode=config.warmup_inputs,
                                        page_size=config.page_size, vocab_size=cfg.vocab_size,
                                        max_model_len=max_model_len, progress=config.progress,
                                        max_prefill_seqs=config.max_num_prefill_seqs)
    t_end = time.perf_counter()
    report = _report(config, model, runner, plan, per_bucket, budget, how, max_model_len, check_error,
                     activation_bytes, kv_alloc_s=t_alloc - t_checked, warmup_s=t_end - t_alloc + t_checked - t0)
    report.update(max_model_len_source=why, compilation_cache_dir=cache_dir, attention_impl_reason=impl_why,
                  cpu_matmul=_matmul_summary(matmuls), cpu_matmul_reason=matmuls_why,
                  native_cpu_kernel=_native_kernel_status(device.platform),
                  persistent_cache=cache_watch.totals(),
                  startup_s=model.load_seconds + (t_end - t0),
                  breakdown_s=_breakdown(model.load_seconds, kv_sizing=t_sized - t_checked, kv_alloc=t_alloc - t_sized,
                                         phases=phases, self_check=t_checked - t0,
                                         total=model.load_seconds + (t_end - t0)))
    architecture = model.architecture if model.architecture is not None else registry.architecture_for(cfg)
    if hasattr(architecture, "expert_load"):  # mixture of experts: random against zero dummies
        report["expert_load"] = _expert_load(config, runner, architecture, buckets[-1], key, len(buckets) - 1,
                                             max_model_len, per_bucket)
    if model.kv_head_replication > 1:
        logger.warning("tensor_parallel_size=%d exceeds the model's %d KV heads: each KV head is replicated onto %d "
                       "shards (the KV pool holds %d heads)", report["tensor_parallel_size"],
                       cfg.num_kv_heads // model.kv_head_replication, model.kv_head_replication, cfg.num_kv_heads)
    logger.info("start-up: %d buckets compiled in %.1f s, KV pool %d pages (%d tokens, %.1f MiB), attention %s",
                len(buckets), report["compile_s_total"], num_pages, report["kv_tokens"],
                spec.nbytes / 2**20, runner.attention_impl)
    return runner, plan, max_model_len, report


def _breakdown(load_s: float, *, kv_sizing: float, kv_alloc: float, phases: dict, self_check: float,
               total: float) -> dict:
    """Where the start-up's wall time went, in consecutive phases that add up to ``total``: loading,
    KV-pool sizing (on accelerators it compiles the largest bucket once to measure activations), the
    runner's params and pool, warm-up's phases (``warmup.warm_up``), the attention self-check, and
    what is left (``other``: the plan, the report)."""
    parts = {"load": load_s, "kv_sizing": kv_sizing, "kv_alloc": kv_alloc, **phases, "self_check": self_check}
    parts["other"] = total - sum(parts.values())
    return parts


def _bucket_plan(config: EngineConfig, max_model_len: int) -> BucketPlan:
    return BucketPlan.from_limits(config.max_num_batched_tokens, config.max_num_seqs, max_model_len,
                                  config.page_size, min_tokens=config.min_token_bucket,
                                  num_speculative_tokens=config.num_speculative_tokens or 0)


def _native_kernel_status(platform: str) -> str:
    """"ready", "not used on <platform>", or why the native CPU kernel could not be built."""
    return kernels.capabilities(platform).native_cpu_status


def _expert_load(config, runner, architecture, bucket, key, index, max_model_len, per_bucket) -> dict:
    """The expert-load report (``warmup.expert_load_report``) on the dummy batch warm-up ran."""
    dummy = warmup.random_dummy_batch(jax.random.fold_in(key, index), bucket, config.page_size,
                                      runner.cache_spec.num_pages, architecture.cfg.vocab_size, max_model_len,
                                      config.max_num_prefill_seqs)
    load = warmup.expert_load_report(runner, architecture, bucket, dummy, config.page_size)
    load["peak_activation_bytes"] = per_bucket[str(bucket)].get("temp_bytes")  # one executable for both inputs
    logger.info("expert load on bucket %s (max/mean tokens per expert): random %s, zeros %s (every row)",
                bucket, load["random"]["max_over_mean"], load["zeros"]["rows_max_over_mean"])
    return load


def _family_name(model: LoadedModel) -> str:
    """The registered family serving ``model`` (``models.registry``), or the class of a user's
    architecture (a Flax NNX module)."""
    if model.architecture is not None:
        return type(model.architecture).__name__
    return registry.family_for_config(model.config).name


def _report(config, model, runner, plan, per_bucket, budget, how, max_model_len, check_error, activation_bytes, *,
            kv_alloc_s, warmup_s) -> dict:
    spec = runner.cache_spec
    usable_tokens = (spec.num_pages - 1) * spec.page_size
    temps = [b.get("temp_bytes", 0) for b in per_bucket.values()]
    return {
        "model": model.source.path,
        "model_family": _family_name(model),
        "load_s": model.load_seconds,
        "weights_bytes": model.nbytes,
        "num_params": model.num_params,
        "dtype": model.dtype,
        "dtype_reason": model.dtype_reason,
        "quantization": config.quantization,
        "device": str(runner.device),
        "platform": runner.device.platform,
        "mesh": meshes.describe(runner.mesh),
        "tensor_parallel_size": meshes.tensor_parallel_size(runner.mesh),
        "weights_bytes_per_device": max(sharding.bytes_per_device(runner.params).values()),
        "kv_bytes_per_device": max(sharding.bytes_per_device(runner.kv_cache).values()),
        "lora": None if runner.lora_spec is None else {
            "max_loras": runner.lora_spec.max_loras, "max_lora_rank": runner.lora_spec.max_rank,
            "slot_bytes_per_device": max(sharding.bytes_per_device(runner.lora_slots).values())},
        "kv_heads": spec.num_kv_heads,
        "kv_head_replication": model.kv_head_replication,
        "attention_impl": runner.attention_impl,
        "kv_cache_dtype": spec.dtype,
        "bucket_plan": plan.describe(),
        "buckets": per_bucket,
        "compile_s_total": sum(b["compile_s"] for b in per_bucket.values()),
        **{f"{part}_s_total": sum(b[f"{part}_s"] for b in per_bucket.values()) for part in ("trace", "lower", "run")},
        "warmup_s": warmup_s,
        "kv_alloc_s": kv_alloc_s,
        "warmup_inputs": config.warmup_inputs,
        "peak_activation_bytes": max(temps, default=0),
        "profiled_activation_bytes": activation_bytes,
        "memory_budget_bytes": budget.budget_bytes,
        "memory_budget_source": budget.source,
        "kv_pages": spec.num_pages,
        "kv_page_size": spec.page_size,
        "kv_tokens": usable_tokens,
        "kv_bytes": spec.nbytes,
        "kv_sizing": how,
        "max_model_len": max_model_len,
        "max_concurrency_at_max_model_len": usable_tokens / max_model_len,
        "attention_self_check_max_abs_error": check_error,
    }
