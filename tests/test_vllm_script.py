"""A vLLM offline script runs with only its import line changed (tests/scripts/vllm_offline.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import requires_smollm2
from engine_helpers import COMPILE_CACHE

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "vllm_offline.py")


def test_only_the_import_line_differs_from_vllm():
    with open(SCRIPT, encoding="utf-8") as f:
        imports = [line for line in f if line.startswith(("import ", "from "))]
    assert imports == ["from jaxrunner import LLM, SamplingParams  # vLLM: from vllm import LLM, SamplingParams\n"]


@pytest.mark.slow
@requires_smollm2
def test_vllm_offline_script_runs_against_the_default_model():
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAXRUNNER_COMPILATION_CACHE=COMPILE_CACHE)
    done = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    generated = re.findall(r"^Prompt: (.*), Generated text: (.*), finish_reason: (\w+), samples: (\d+)$", out, re.M)
    assert len(generated) == 5  # four prompts, the third with n=2
    assert [g[3] for g in generated] == ["1", "1", "2", "2", "1"]
    count = generated[-1]
    assert count[2] == "stop" and count[1].endswith(" five'"), count  # the stop string kept, as asked
    tokens = re.findall(r"^Token: .*, logprob: (-?[\d.]+), rank: (\d+), alternatives: (\d+)$", out, re.M)
    assert len(tokens) == 4 and all(rank == "1" for _, rank, _ in tokens)  # greedy takes the best token
    assert all(int(n) in (3, 4) for _, _, n in tokens)  # the top 3, plus the sampled one when outside them
    assert re.search(r"^Prompt logprobs: \d+ positions, first: None$", out, re.M)
    assert "Paris" in re.search(r"^Chat: (.*)$", out, re.M).group(1)
