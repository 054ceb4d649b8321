"""The OpenAI-compatible server on 127.0.0.1, driven by the ``openai`` client: greedy completions equal
``LLM.generate``, streams concatenate to the full text, disconnecting clients free their pages, bad
requests get OpenAI-shaped errors with the right status and the server keeps serving, nothing compiles
while serving, and ``jaxrunner serve`` shuts down cleanly on SIGTERM."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import requires_smollm2
from engine_helpers import COMPILE_CACHE, count_compilations

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from jaxrunner import SamplingParams  # noqa: E402
from jaxrunner.entrypoints.openai.api_server import ServerConfig, ServerState, build_app, make_server  # noqa: E402

MODEL = "smollm2-135m-instruct"
KEY = "test-key"
PROMPTS = ["The capital of France is", "List three colors:", "def fibonacci(n):"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_health(base: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base} did not become healthy")


@pytest.fixture(scope="module")
def served():
    """One SmolLM2 (small engine limits) behind a server on a thread; yields (base_url, llm, state)."""
    if not os.path.exists(os.path.join(os.path.dirname(__file__), "conftest.py")):
        pytest.skip("tests run from the source tree")
    from jaxrunner import LLM

    llm = LLM(MODEL, dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256,
              compilation_cache_dir=COMPILE_CACHE, progress=False, min_token_bucket=16)
    state = ServerState(ServerConfig(model=MODEL, port=free_port(), api_key=KEY), llm)
    server = make_server(state)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{state.config.port}"
    wait_for_health(base, 60)
    yield base, llm, state
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=KEY, max_retries=0, timeout=300)


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        match = re.match(r"^(jaxrunner:[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
        if match:
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(2))
    return values


def wait_until_drained(base: str, timeout_s: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        values = metrics(base)
        if (values["jaxrunner:num_requests_running"] == 0 and values["jaxrunner:num_requests_waiting"] == 0
                and values["jaxrunner:kv_cache_pages_used"] == 0):
            return values
        assert time.monotonic() < deadline, values
        time.sleep(0.1)




@pytest.mark.slow
@requires_smollm2
def test_greedy_completions_equal_llm_generate(served, client):
    _, llm, _ = served
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    tokenizer = llm.get_tokenizer()
    for prompt, want in zip(PROMPTS, expected):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
        choice = got.choices[0]
        assert choice.text == want.text
        assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in want.token_ids]  # token for token
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.prompt_tokens == len(tokenizer.encode(prompt))
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [w.text for w in expected]


@pytest.mark.slow
@requires_smollm2
def test_streamed_chunks_concatenate_to_the_full_text(served, client):
    _, llm, _ = served
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert chat.choices[0].message.content == want.text
    assert chat.usage.completion_tokens == len(want.token_ids)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want.text


@pytest.mark.slow
@requires_smollm2
def test_64_streaming_clients_8_disconnect_and_every_page_comes_back(served):
    base = served[0]

    async def one(index: int):
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=300) as aclient:
            leaves = index % 8 == 0
            stream = await aclient.completions.create(
                model=MODEL, prompt=f"Request {index}: count from one to fifty.", stream=True,
                max_tokens=60 if leaves else 6, temperature=0.7, seed=index, extra_body={"ignore_eos": True})
            text, chunks = "", 0
            async for chunk in stream:
                chunks += 1
                text += chunk.choices[0].text
                if leaves and chunks == 2:
                    await stream.close()  # disconnect mid-stream
                    return None
            return chunk.choices[0].finish_reason

    async def main():
        return await asyncio.gather(*(one(i) for i in range(64)))

    before = metrics(base)
    reasons = asyncio.run(main())
    assert [r for i, r in enumerate(reasons) if i % 8] == ["length"] * 56
    after = wait_until_drained(base, timeout_s=10)  # well before the 60 tokens the leavers asked for
    assert after["jaxrunner:kv_cache_pages_free"] > 0
    # Only the 56 that stayed finished: the 8 that left were aborted, not run to their 60 tokens.
    grew = {name: after[name] - before[name] for name in after}
    assert grew["jaxrunner:generation_tokens_total"] == 56 * 6
    assert grew["jaxrunner:request_success_total"] == 56
    assert grew["jaxrunner:time_to_first_token_seconds_count"] >= 64


@pytest.mark.slow
@requires_smollm2
def test_bad_requests_get_openai_errors_and_serving_goes_on(served, client):
    base, llm, state = served
    url = f"{base}/v1/completions"
    auth = {"Authorization": f"Bearer {KEY}"}
    good = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}

    def post(body, headers=auth, content=None):
        if content is None:
            content = json.dumps(body)
        return httpx.post(url, content=content, headers={**headers, "Content-Type": "application/json"}, timeout=60)

    cases = [
        (post(None, content="{not json"), 400, None),
        (post({**good, "max_tokens": "many"}), 400, "max_tokens"),
        (post({**good, "temperature": [1]}), 400, "temperature"),
        (post({**good, "model": "gpt-5"}), 404, "model"),
        (post({**good, "max_tokens": -3}), 400, "max_tokens"),
        (post({**good, "prompt": "word " * 400}), 400, "prompt"),
        (post({"model": MODEL}), 400, "prompt"),
        (post(None, content="x" * (10 * 1024 * 1024)), 413, None),
        (post(good, headers={"Authorization": "Bearer wrong"}), 401, None),
        (post(good, headers={}), 401, None),
    ]
    for response, status, param in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["message"] and error["type"]
        if param is not None:
            assert error["param"] == param, error
    chat = httpx.post(f"{base}/v1/chat/completions", headers=auth, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user"}], "max_tokens": 2})
    assert chat.status_code == 400 and "content" in chat.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    state.config.max_queue = 0
    try:
        busy = post(good)
        assert busy.status_code == 503 and busy.headers["Retry-After"]
    finally:
        state.config.max_queue = 4096
    assert client.completions.create(**good).choices[0].text  # still serving
    assert [m.id for m in client.models.list().data] == [MODEL]
    wait_until_drained(base)


@pytest.mark.slow
@requires_smollm2
def test_nothing_compiles_while_serving_over_http(served, client):
    with count_compilations() as compiles:
        client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=5, temperature=0.8, top_p=0.9, seed=3,
                                  n=2, logprobs=3, presence_penalty=0.5,
                                  extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2})
        list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                            max_tokens=6, stream=True, logprobs=True, top_logprobs=2, stop=["."]))
    assert compiles == []


def test_health_is_503_until_the_model_is_ready():
    from fastapi.testclient import TestClient

    state = ServerState(ServerConfig(model="not-loaded-yet"))
    with TestClient(build_app(state)) as http:
        assert http.get("/health").status_code == 503
        response = http.post("/v1/completions", json={"model": "not-loaded-yet", "prompt": "hi"})
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
        assert "jaxrunner:num_requests_running" in http.get("/metrics").text


@pytest.mark.parametrize("args, message", [(["no-such-model-is-loaded", "--max-num-seqs", "0"], "max_num_seqs"),
                                           (["/no/such/model.gguf"], "model.gguf")])
def test_serve_checks_options_and_model_before_loading(args, message):
    proc = subprocess.run([sys.executable, "-m", "jaxrunner", "serve", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_serve_subprocess_shuts_down_on_sigterm_with_exit_0(tiny_checkpoints):
    port = free_port()
    env = dict(os.environ, JAXRUNNER_COMPILATION_CACHE=COMPILE_CACHE, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "jaxrunner", "serve", tiny_checkpoints["llama"], "--port",
                             str(port), "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens",
                             "32"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_health(base, 300)
        done = httpx.post(f"{base}/v1/completions", timeout=60,
                          json={"model": tiny_checkpoints["llama"], "prompt": "Hello world", "max_tokens": 4})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
        in_flight = []

        def stream_long():  # still streaming when the signal arrives
            with httpx.stream("POST", f"{base}/v1/completions", timeout=60, json={
                    "model": tiny_checkpoints["llama"], "prompt": "Hello", "max_tokens": 100, "ignore_eos": True,
                    "stream": True}) as response:
                in_flight.append(response.status_code)
                for _ in response.iter_lines():
                    pass

        client = threading.Thread(target=stream_long)
        client.start()
        while not in_flight:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        client.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "ready at http://127.0.0.1" in stderr and "Traceback" not in stderr
