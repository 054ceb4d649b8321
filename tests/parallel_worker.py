"""Run in a subprocess by test_parallel.py, with XLA_FLAGS set to make 8 CPU devices.

``python parallel_worker.py SCENARIO ARG`` prints one JSON object on its last stdout line. The
device count is fixed when JAX starts, so these scenarios cannot run inside the pytest process.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_helpers import TINY_ENGINE, count_compilations, random_prompts, token_ids  # noqa: E402

GREEDY = dict(temperature=0.0, ignore_eos=True)
# Two buckets (32 tokens × 1 or 4 sequences): each mesh compiles every bucket again, and on 8
# forced CPU devices that compile is what these scenarios cost.
MESH_ENGINE = dict(TINY_ENGINE, max_num_seqs=4, max_num_batched_tokens=32)


def _serve(model: str, prompts, max_tokens: int, engine: dict, **parallel) -> dict:
    """Start an engine, serve ``prompts`` greedily; what the tests compare."""
    from jaxrunner import LLM, SamplingParams

    llm = LLM(model, **engine, **parallel)
    with count_compilations() as compiles:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    report = llm.startup_report
    return {"tokens": token_ids(outputs), "serving_compiles": len(compiles),
            "weights_bytes_per_device": report["weights_bytes_per_device"],
            "kv_bytes_per_device": report["kv_bytes_per_device"], "kv_heads": report["kv_heads"],
            "kv_head_replication": report["kv_head_replication"], "weights_bytes": report["weights_bytes"],
            "mesh": report.get("global_mesh", report["mesh"]), "pages_in_use": llm.engine.stats()["pages_in_use"]}


def _error(**options) -> str:
    from jaxrunner import LLM

    try:
        LLM(**options)
    except ValueError as err:
        return str(err)
    return "no error"


def tiny(model_dir: str) -> dict:
    """8 query / 2 KV heads: TP 2 splits KV heads, TP 4 replicates them; DP 2 × TP 2; bad meshes."""
    prompts = random_prompts(6, 512, 3, 40, seed=1)
    results = {f"tp{tp}_dp{dp}": _serve(model_dir, prompts, 12, MESH_ENGINE, tensor_parallel_size=tp,
                                        data_parallel_size=dp)
               for tp, dp in ((1, 1), (2, 1), (4, 1), (2, 2))}
    results["error_tp3"] = _error(model=model_dir, **MESH_ENGINE, tensor_parallel_size=3)
    results["error_too_many"] = _error(model=model_dir, **MESH_ENGINE, tensor_parallel_size=4, data_parallel_size=4)
    return results


def smollm2(gguf_path: str) -> dict:
    """The real model (9 query / 3 KV heads): TP 3, DP 2 and TP 3 × DP 2 against one device.

    Loaded once from the GGUF and written as an orbax checkpoint, which every engine then restores
    straight into its own shardings.
    """
    from jaxrunner.models.loading import load_model
    from jaxrunner.models.loading.orbax_ckpt import save_checkpoint

    checkpoint = os.path.join(tempfile.mkdtemp(), "smollm2")
    model = load_model(gguf_path, progress=False)
    save_checkpoint(checkpoint, model.params, model.hf_config, model.tokenizer)
    prompts = [{"prompt_token_ids": model.tokenizer.encode(text)} for text in
               ("The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time")]
    del model
    engine = dict(MESH_ENGINE, max_model_len=64, num_pages=40)
    return {f"tp{tp}_dp{dp}": _serve(checkpoint, prompts, 8, engine, tensor_parallel_size=tp, data_parallel_size=dp)
            for tp, dp in ((1, 1), (3, 1), (1, 2), (3, 2))}


def in_memory(model_dir: str) -> dict:
    """Params already sharded for TP 2 served by ``LLM.from_params`` in place; a weight swap under TP 2
    and under DP 2 × TP 2 compiles nothing."""
    import jax

    from jaxrunner import LLM, SamplingParams
    from jaxrunner.models.loading.hf import read_hf_config

    prompts = random_prompts(4, 512, 3, 40, seed=2)
    params = SamplingParams(max_tokens=8, **GREEDY)
    loaded = LLM(model_dir, **MESH_ENGINE, tensor_parallel_size=2)
    config = read_hf_config(model_dir)
    results = {"loaded": token_ids(loaded.generate(prompts, params, use_tqdm=False))}
    for tp, dp in ((2, 1), (2, 2)):
        served = LLM.from_params(loaded.params, config, **MESH_ENGINE, tensor_parallel_size=tp, data_parallel_size=dp)
        same = [a is b for a, b in zip(jax.tree.leaves(served.params), jax.tree.leaves(loaded.params))]
        tokens = token_ids(served.generate(prompts, params, use_tqdm=False))
        new = jax.tree.map(lambda x: x * 1.5, loaded.params)
        with count_compilations() as compiles:
            served.update_weights(new)
            swapped = token_ids(served.generate(prompts, params, use_tqdm=False))
        results[f"tp{tp}_dp{dp}"] = {"tokens": tokens, "in_place": all(same), "swap_compiles": len(compiles),
                                     "swapped_differs": swapped != tokens,
                                     "sharded": len(served.params["embed"].sharding.device_set)}
    return results


def moe(model_dirs: str) -> dict:
    """Mixture-of-experts checkpoints (JSON: family -> directory) at TP 2: attention heads split,
    experts split over the model axis (expert parallelism). test_moe.py's prompts and engine."""
    prompts = random_prompts(4, 512, 3, 70, seed=11)
    return {family: _serve(path, prompts, 24, MESH_ENGINE, tensor_parallel_size=2)
            for family, path in json.loads(model_dirs).items()}


def lora(spec: str) -> dict:
    """LoRA adapters (JSON: the base directory and {name: adapter directory}) in one batch on one
    device, at TP 2 and at DP 2 (each replica its own slots): the same tokens, the slot factors
    split as their projections are."""
    import jax

    from jaxrunner import LLM, LoRARequest, SamplingParams

    spec = json.loads(spec)
    adapters = [LoRARequest(name, index, path) for index, (name, path) in enumerate(spec["adapters"].items(), 1)]
    prompts = random_prompts(3, 512, 3, 30, seed=4)
    requests = [adapter for adapter in [None, *adapters] for _ in prompts]
    results = {}
    for tp, dp in ((1, 1), (2, 1), (1, 2)):
        llm = LLM(spec["base"], **MESH_ENGINE, tensor_parallel_size=tp, data_parallel_size=dp, enable_lora=True,
                  max_loras=2, max_lora_rank=8)
        with count_compilations() as compiles:
            outputs = llm.generate(prompts * (len(adapters) + 1), SamplingParams(max_tokens=8, **GREEDY),
                                   use_tqdm=False, lora_request=requests)
        slots = llm.engine.executor.runner.lora_slots[0]
        results[f"tp{tp}_dp{dp}"] = {"tokens": token_ids(outputs), "serving_compiles": len(compiles),
                              "split": {f"{name}/{part}": list(jax.tree.leaves(slots[name][part])[0].sharding.spec)
                                        for name in ("wqkv", "wo") for part in ("a", "b")}}
    return results


if __name__ == "__main__":
    scenario, arg = sys.argv[1], sys.argv[2]
    result = {"tiny": tiny, "smollm2": smollm2, "in_memory": in_memory, "moe": moe, "lora": lora}[scenario](arg)
    print(json.dumps(result))
