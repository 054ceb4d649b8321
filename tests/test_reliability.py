"""Reliability evidence against real servers on 127.0.0.1: a short soak (scripts/soak.py, as a user
runs it) with nothing lost, nothing failed, no 5xx and no KV pages held at the end; faults under load
(the KV pool exhausted, a client that stops reading) that every other request survives."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine_helpers import COMPILE_CACHE, make_llm
from server_helpers import serving

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_short_soak_loses_nothing_and_holds_no_pages(tiny_checkpoints, tmp_path):
    out = tmp_path / "soak.json"
    env = dict(os.environ, JAXRUNNER_COMPILATION_CACHE=COMPILE_CACHE, HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    proc = subprocess.run([sys.executable, str(SCRIPTS / "soak.py"), "--model", tiny_checkpoints["llama"],
                           "--num-requests", "120", "--duration-s", "12", "--max-output-len", "24",
                           "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "512",
                           "--request-timeout-s", "60", "--output-json", str(out), "--no-plot"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    total = result["total"]
    assert total["sent"] == 120 and total["lost"] == 0 and total["failed"] == 0, result["problems"]
    assert total["server_errors_5xx"] == 0 and total["pages_held_at_end"] == 0
    assert total["completed"] > 0 and total["aborted"] > 0 and total["refused"] >= 1
    assert result["server"]["exit_status"] == 0
    assert total["rss_mib_start"] > 0 and total["rss_mib_end"] > 0
    assert total["ttft_ms"]["p50"] is not None and total["itl_ms"]["p99"] is not None


@pytest.fixture(scope="module")
def small_pool_server(tiny_checkpoints):
    """The tiny Llama behind a server, with a KV pool of 24 pages of 8 tokens: eight requests of 90
    tokens need 96 pages at once, so serving them preempts."""
    llm = make_llm(tiny_checkpoints["llama"], num_pages=24)
    with serving(llm) as (base, _):
        yield base, llm


def _pages_in_use(llm) -> int:
    return llm.engine.scheduler.allocator.num_used_pages


def test_kv_exhaustion_under_load_preempts_and_completes_everything(small_pool_server):
    base, llm = small_pool_server
    body = {"model": "tiny", "prompt": [5 + i for i in range(10)], "max_tokens": 80, "ignore_eos": True}
    before = llm.engine.scheduler.num_preemptions

    async def burst():
        async with httpx.AsyncClient(base_url=base, timeout=300) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={**body, "seed": i, "temperature": 0.5})
                                          for i in range(8)))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 8, [r.text[:200] for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 80 for r in responses)
    assert llm.engine.scheduler.num_preemptions > before  # the pool could not hold them all at once
    _wait_for(lambda: _pages_in_use(llm) == 0)


def test_a_client_that_stops_reading_stalls_nobody(small_pool_server):
    """A streaming client that never reads its socket: the others are served meanwhile, and its request
    is freed once it goes away."""
    base, llm = small_pool_server
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 100, "ignore_eos": True, "n": 2,
                       "stream": True, "logprobs": 5}).encode()
    silent = socket.create_connection(("127.0.0.1", port))
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    silent.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        for i in range(3):
            done = httpx.post(f"{base}/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": [11, 12, i + 13], "max_tokens": 8, "ignore_eos": True})
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 8
    finally:
        silent.close()
    _wait_for(lambda: llm.engine_loop.num_requests() == 0 and _pages_in_use(llm) == 0)


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
