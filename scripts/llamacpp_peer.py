#!/usr/bin/env python
"""llama.cpp timed for the latency benchmark, run by ``benchmark_latency.py --compare llamacpp``
with the Python that has ``llama-cpp-python`` (``--llamacpp-python``; its own process, so that
neither library's threads slow the other down).

    CMAKE_ARGS=-DGGML_NATIVE=ON pip install llama-cpp-python   # in its own venv, built for this CPU

It reads a JSON spec (the GGUF file, threads, context, the batches of token prompts) and writes a
JSON result. Each prompt is one streamed ``create_completion``: TTFT from the call to the first
token, TPOT from the first to the last over the tokens between, greedy, EOS banned through
``logit_bias`` (as ``ignore_eos`` does for the other engines). llama-cpp-python serves one
sequence at a time, so only batch 1 is measured. ``extra_bufts`` false loads the weights without
llama.cpp's extra buffer types (its repacked and AMX layouts; ``--no-repack`` in its CLI), for a
build whose AMX path fails on the machine.
"""
from __future__ import annotations

import json
import platform
import sys
import time


def measure(llm, prompt: list[int], output_len: int, eos: int) -> tuple[float, float, int]:
    llm.reset()  # no prefix reuse from the previous prompt
    start = time.perf_counter()
    first = last = None
    count = 0
    for _ in llm.create_completion(prompt, max_tokens=output_len, temperature=0.0, stream=True,
                                   logit_bias={eos: -1e9}):
        last = time.perf_counter()
        first = first or last
        count += 1
    return first - start, (last - first) / max(1, count - 1), count


def main(spec_path: str) -> int:
    import llama_cpp

    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    if not spec["extra_bufts"]:  # llama-cpp-python has no argument for it: set it in the model's defaults
        defaults = llama_cpp.llama_model_default_params

        def without_extra_bufts():
            params = defaults()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama.llama_cpp.llama_model_default_params = without_extra_bufts
    llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=spec["n_ctx"], n_threads=spec["threads"],
                          n_threads_batch=spec["threads"], n_batch=spec["n_ctx"], verbose=False)
    eos = llm.token_eos()
    rows = []
    for batch in spec["batches"]:
        if batch["batch_size"] != 1:
            raise SystemExit(f"llama.cpp peer: batch_size {batch['batch_size']}: llama-cpp-python serves one "
                             "sequence at a time; pass --batch-sizes 1")
        times = [measure(llm, prompt, batch["output_len"], eos) for prompt in batch["prompts"]]
        measured = times[spec["warmup_repetitions"]:]
        rows.append(dict(batch, prompts=None, ttft=[t for t, _, _ in measured], tpot=[p for _, p, _ in measured],
                         e2e=[t + p * (n - 1) for t, p, n in measured], tokens=[n for _, _, n in measured]))
    info = dict(llama_cpp=llama_cpp.__version__, python=platform.python_version(), threads=spec["threads"],
                extra_bufts=spec["extra_bufts"],
                system_info=llama_cpp.llama_print_system_info().decode(errors="replace"))
    with open(spec["result"], "w", encoding="utf-8") as f:
        json.dump({"info": info, "result": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
