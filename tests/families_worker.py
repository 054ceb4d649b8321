"""Run in a subprocess by test_model_families.py, with XLA_FLAGS set to make 8 CPU devices.

``python families_worker.py JOB.json`` serves the job's prompts greedily on every model of the job
with its ``tensor_parallel_size``, and prints one JSON object (family -> tokens, compiles while
serving, devices the embedding is split over) on its last stdout line.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_helpers import TINY_ENGINE, count_compilations, token_ids  # noqa: E402


def serve(model: str, job: dict) -> dict:
    from jaxrunner import LLM, SamplingParams

    llm = LLM(model, **{**TINY_ENGINE, **job["engine"]}, tensor_parallel_size=job["tensor_parallel_size"])
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=job["max_tokens"])
    with count_compilations() as compiles:
        outputs = llm.generate(job["prompts"], params, use_tqdm=False)
    return {"tokens": token_ids(outputs), "serving_compiles": len(compiles),
            "sharded_devices": len(llm.params["layers"][0]["wqkv"].sharding.device_set)}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        job = json.load(f)
    print(json.dumps({family: serve(path, job) for family, path in job["models"].items()}))
