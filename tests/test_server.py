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
import subprocess
import sys
import threading
import time

import pytest

from conftest import SERVER_KEY, requires_smollm2
from engine_helpers import COMPILE_CACHE, count_compilations

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from jaxrunner import SamplingParams  # noqa: E402
from jaxrunner.entrypoints.openai.api_server import ServerConfig, ServerState, build_app  # noqa: E402
from server_helpers import free_port, serving, wait_for_health  # noqa: E402

MODEL = "smollm2-135m-instruct"
KEY = SERVER_KEY  # the shared server's (conftest: served, client)
PROMPTS = ["The capital of France is", "List three colors:", "def fibonacci(n):"]


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        match = re.match(r"^((?:vllm|jaxrunner):[a-z0-9_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
        if match:
            values[match.group(1)] = values.get(match.group(1), 0.0) + float(match.group(2))
    return values


def aborted_total(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    match = re.search(r'^vllm:request_success_total\{finished_reason="abort",model_name="[^"]*"\} ([0-9.e+-]+)$',
                      text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_until_drained(base: str, timeout_s: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        values = metrics(base)
        if (values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
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

    before, aborted_before = metrics(base), aborted_total(base)
    reasons = asyncio.run(main())
    assert [r for i, r in enumerate(reasons) if i % 8] == ["length"] * 56
    after = wait_until_drained(base, timeout_s=10)  # well before the 60 tokens the leavers asked for
    assert after["jaxrunner:kv_cache_pages_free"] > 0
    # The 8 that left were aborted, not run to their 60 tokens, and are counted with reason "abort".
    grew = {name: after[name] - before[name] for name in after}
    assert 56 * 6 + 8 <= grew["vllm:generation_tokens_total"] < 56 * 6 + 8 * 60
    assert grew["vllm:request_success_total"] == 64
    assert aborted_total(base) - aborted_before == 8
    assert grew["vllm:time_to_first_token_seconds_count"] >= 64


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
    assert client.completions.create(**good).choices[0].text  # still serving
    assert [m.id for m in client.models.list().data] == [MODEL]
    wait_until_drained(base)


@pytest.mark.slow
@requires_smollm2
def test_vllm_sampling_fields_reach_the_engine_as_in_llm_generate(served, client):
    """allowed_token_ids, bad_words and include_stop_str_in_output were dropped by the server (200,
    ignored); they now give what LLM.generate gives with the same SamplingParams."""
    _, llm, _ = served
    tokenizer = llm.get_tokenizer()
    allowed = [tokenizer.encode(word, add_special_tokens=False)[0] for word in (" yes", " no", " maybe")]
    cases = [dict(allowed_token_ids=allowed), dict(bad_words=[" Paris", " the"]),
             dict(stop=["."], include_stop_str_in_output=True)]
    for extra in cases:
        want = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, **extra),
                            use_tqdm=False)[0].outputs[0].text
        got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                        extra_body=extra).choices[0].text
        assert got == want, extra
    assert set(tokenizer.encode(got_allowed := client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body=cases[0]).choices[0].text,
        add_special_tokens=False)) <= set(allowed), got_allowed


@pytest.mark.slow
@requires_smollm2
def test_fields_not_built_are_refused_by_name_never_ignored(served):
    base = served[0]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    good = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    refused = [
        ("chat/completions", {"response_format": {"type": "bogus"}}),
        ("chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}}}),  # no tools
        ("chat/completions", {"continue_final_message": True}),  # with add_generation_prompt (the default)
        ("chat/completions", {"echo": True}),
        ("chat/completions", {"guided_json": {"type": "object"}}),
        ("chat/completions", {"functions": [{"name": "f"}]}),
        ("completions", {"best_of": 2}),
        ("completions", {"use_beam_search": True}),
        ("completions", {"prompt_logprobs": 1, "stream": True}),
        ("completions", {"prompt_logprobs": 21}),
        ("completions", {"truncate_prompt_tokens": 0}),
        ("completions", {"truncate_prompt_tokens": 257}),
        ("completions", {"suffix": "end"}),
    ]
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=f"{base}/v1", headers=headers, timeout=60) as http:
        for endpoint, extra in refused:
            body = {**(chat if endpoint.startswith("chat") else good), **extra}
            response = http.post(f"/{endpoint}", json=body)
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == next(iter(extra)), (extra, error)
        # what asks for nothing passes: plain text format, no tools, a tool-calling history for the template
        history = [{"role": "user", "content": "Weather?"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        for extra in ({"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"messages": history},
                      {"some_future_field": 1}):
            assert http.post("/chat/completions", json={**chat, **extra}).status_code == 200, extra


@pytest.mark.slow
@requires_smollm2
def test_echo_prompt_logprobs_and_truncation_as_in_llm_generate(served, client):
    llm = served[1]
    prompt = "The capital of France is"
    reference = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=2),
                             use_tqdm=False)[0]
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2, echo=True,
                                      extra_body={"prompt_logprobs": 2})
    choice = reply.choices[0]
    assert choice.text == prompt + reference.outputs[0].text
    n_prompt = len(reference.prompt_token_ids)
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == n_prompt + 6
    for position in range(1, n_prompt):
        token = reference.prompt_token_ids[position]
        expected = reference.prompt_logprobs[position][token].logprob
        assert choice.logprobs.token_logprobs[position] == pytest.approx(expected, abs=1e-5)
        assert choice.prompt_logprobs[position][str(token)]["logprob"] == pytest.approx(expected, abs=1e-5)
    assert choice.prompt_logprobs[0] is None
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                         stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == choice.text
    ids = llm.get_tokenizer().encode(prompt)
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 3})
    last_three = llm.generate([{"prompt_token_ids": ids[-3:]}], SamplingParams(temperature=0, max_tokens=6),
                              use_tqdm=False)[0]
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text == last_three.outputs[0].text


def test_chat_history_fields_reach_the_template():
    from jaxrunner.entrypoints.openai import protocol

    request = protocol.parse(protocol.ChatCompletionRequest, {"messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}],
         "reasoning_content": "think"},
        {"role": "tool", "tool_call_id": "c1", "name": "w", "content": "sunny"}]})
    assert request.conversation() == [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function"}],
         "reasoning_content": "think"},
        {"role": "tool", "content": "sunny", "name": "w", "tool_call_id": "c1"}]


@pytest.mark.slow
@requires_smollm2
def test_hostile_bodies_get_400_and_the_same_connection_serves_the_next_request(served):
    """Each body once gave a 500 (and a closed keep-alive connection) or a silent 200; each now gets
    OpenAI's error naming the request's own field, and one client connection carries on throughout."""
    base = served[0]
    good = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    chat = {"model": MODEL, "max_tokens": 2}
    user = [{"role": "user", "content": "Hi"}]
    cases = [
        ("completions", {**good, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ("completions", {**good, "logit_bias": {"1.5": 1}}, 400, "logit_bias"),
        ("chat/completions", {**chat, "messages": [{"role": "user", "content": "a \ud800 b"}]}, 400, "messages"),
        ("completions", {**good, "model": "\ud800"}, 404, "model"),
        ("completions", None, 400, None),  # JSON nested 10,000 levels
        ("chat/completions", {**chat, "messages": user, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
        ("chat/completions", {**chat, "messages": user, "top_logprobs": 5}, 400, "top_logprobs"),
        ("chat/completions", {**chat, "messages": user, "logprobs": True, "top_logprobs": 1000}, 400, "top_logprobs"),
        ("completions", {**good, "max_tokens": 10_000}, 400, "max_tokens"),
        ("chat/completions", {**chat, "messages": user, "max_completion_tokens": 10_000}, 400,
         "max_completion_tokens"),
        ("completions", {**good, "temperature": 1e30}, 400, "temperature"),
        ("completions", {**good, "n": 5000, "max_tokens": 1}, 400, "n"),
    ]
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=f"{base}/v1", headers=headers, timeout=60) as http:
        for endpoint, body, status, param in cases:
            content = "[" * 10_000 + "]" * 10_000 if body is None else json.dumps(body)
            response = http.post(f"/{endpoint}", content=content)
            assert response.status_code == status, (body if body is None else str(body)[:200], response.text)
            error = response.json()["error"]
            assert error["message"] and error["type"] and error["param"] == param, error
            assert http.post("/completions", json=good).status_code == 200  # the same connection goes on
    wait_until_drained(base)


@pytest.mark.slow
@requires_smollm2
def test_admission_counts_free_sequence_slots_and_refuses_only_what_would_wait(served):
    """With --max-queue 4 and 8 sequence slots, 12 requests at once are all taken (8 run, 4 wait),
    however the burst lines up against the engine's steps; with the slots and the queue full, the
    next is a 503 with Retry-After."""
    base, _, state = served
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "Count from one to fifty:", "max_tokens": 8, "ignore_eos": True}

    async def burst(count: int) -> list[int]:
        async with httpx.AsyncClient(base_url=f"{base}/v1", headers=headers, timeout=120) as http:
            responses = await asyncio.gather(*(http.post("/completions", json=body) for _ in range(count)))
        return [r.status_code for r in responses]

    async def full_then_one_more() -> int:
        async with httpx.AsyncClient(base_url=f"{base}/v1", headers=headers, timeout=120) as http:
            held = [asyncio.ensure_future(http.post("/completions", json={**body, "max_tokens": 32}))
                    for _ in range(12)]
            while served[1].engine_loop.num_requests() < 12:
                await asyncio.sleep(0.01)
            extra = await http.post("/completions", json=body)
            await asyncio.gather(*held)
            return extra

    state.config.max_queue = 4
    try:
        assert asyncio.run(burst(12)) == [200] * 12
        busy = asyncio.run(full_then_one_more())
        assert busy.status_code == 503 and busy.headers["Retry-After"], busy.text
    finally:
        state.config.max_queue = 4096
    wait_until_drained(base)


@pytest.mark.slow
@requires_smollm2
def test_nothing_compiles_while_serving_over_http(served, client):
    with count_compilations() as compiles:
        client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=5, temperature=0.8, top_p=0.9, seed=3,
                                  n=2, logprobs=3, presence_penalty=0.5,
                                  extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2,
                                              "allowed_token_ids": list(range(100, 200)), "bad_words": [" the"]})
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
        assert "vllm:num_requests_running" in http.get("/metrics").text


@pytest.mark.parametrize("args, message", [(["no-such-model-is-loaded", "--max-num-seqs", "0"], "max_num_seqs"),
                                           (["/no/such/model.gguf"], "model.gguf")])
def test_serve_checks_options_and_model_before_loading(args, message):
    proc = subprocess.run([sys.executable, "-m", "jaxrunner", "serve", *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_serve_subprocess_shuts_down_on_sigterm_with_exit_0(tiny_checkpoints):
    """A stream that needs longer than the drain window (--shutdown-timeout) is ended by the server with
    an error event and [DONE] before the process exits 0, not cut off."""
    port = free_port()
    env = dict(os.environ, JAXRUNNER_COMPILATION_CACHE=COMPILE_CACHE, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "jaxrunner", "serve", tiny_checkpoints["llama"], "--port",
                             str(port), "--max-model-len", "512", "--max-num-seqs", "4", "--max-num-batched-tokens",
                             "32", "--shutdown-timeout", "0.2", "--enable-log-requests", "--uvicorn-log-level",
                             "info"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_health(base, 300)
        done = httpx.post(f"{base}/v1/completions", timeout=60,
                          json={"model": tiny_checkpoints["llama"], "prompt": "Hello world", "max_tokens": 4})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
        events: list[str] = []

        def stream_long():  # still streaming when the drain window ends
            with httpx.stream("POST", f"{base}/v1/completions", timeout=60, json={
                    "model": tiny_checkpoints["llama"], "prompt": "Hello", "max_tokens": 500, "ignore_eos": True,
                    "stream": True}) as response:
                events.extend(line for line in response.iter_lines() if line)

        client = threading.Thread(target=stream_long)
        client.start()
        while len(events) < 2:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        client.join(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "ready at http://127.0.0.1" in stderr and "Traceback" not in stderr
    assert "Uvicorn running on" in stderr and re.search(r"request cmpl-\w+: prompt tokens \[\d+\], n=1", stderr)
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 503 and "shutting down" in error["message"], error


def test_a_dead_engine_loop_turns_health_503_and_serve_exits_1(tiny_checkpoints, monkeypatch):
    """The engine loop's thread failing outside a step (injected into its bookkeeping) fails the request
    in flight with a 503, turns /health to 503, and `run_server` stops and returns 1, so a supervisor
    restarts the process instead of leaving it up and useless."""
    from jaxrunner.engine import loop as loop_module
    from jaxrunner.entrypoints.openai.server_process import run_server

    model = tiny_checkpoints["llama"]
    broken = threading.Event()
    publish = loop_module.EngineLoop._publish_stats

    def failing_publish(self):
        if broken.is_set() and self.engine.config.model == model:
            raise RuntimeError("injected: the loop thread fails outside a step")
        publish(self)

    monkeypatch.setattr(loop_module.EngineLoop, "_publish_stats", failing_publish)
    config = ServerConfig(model=model, port=free_port())
    exits: list[int] = []
    options = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, compilation_cache_dir=COMPILE_CACHE)
    server = threading.Thread(target=lambda: exits.append(run_server(config, options)), daemon=True)
    server.start()
    base = f"http://127.0.0.1:{config.port}"
    wait_for_health(base, 300)
    broken.set()
    response = httpx.post(f"{base}/v1/completions", timeout=60, json={"model": model, "prompt": "Hi", "max_tokens": 4})
    assert response.status_code == 503 and "engine loop died" in response.json()["error"]["message"], response.text
    try:
        health = httpx.get(f"{base}/health", timeout=5).status_code
    except httpx.HTTPError:
        health = None  # the server has already stopped
    assert health in (503, None)
    server.join(timeout=30)
    assert exits == [1]


@pytest.mark.slow
@requires_smollm2
def test_a_stream_sends_its_first_chunk_with_the_first_token(served):
    """The role chunk waits for the first token (as vLLM's), so the time to a client's first chunk is at
    least the server's own time to first token, not the time to an empty chunk sent before prefill."""
    base = served[0]
    prompt = "Summarize: " + " ".join(f"item {i} is a word," for i in range(20))
    before = metrics(base)
    start = time.perf_counter()
    chunks, first_s = [], None
    with httpx.stream("POST", f"{base}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
                            "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                first_s = first_s or time.perf_counter() - start
                chunks.append(json.loads(line[6:]))
    after = metrics(base)
    server_ttft = after["vllm:time_to_first_token_seconds_sum"] - before["vllm:time_to_first_token_seconds_sum"]
    assert after["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"] == 1
    assert first_s >= 0.9 * server_ttft, (first_s, server_ttft)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


@pytest.mark.slow
@requires_smollm2
def test_tokenize_detokenize_version_and_cors(served):
    base, llm, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    tokenizer = llm.get_tokenizer()
    with httpx.Client(base_url=base, headers=headers, timeout=60) as http:
        tokens = http.post("/tokenize", json={"model": MODEL, "prompt": "The capital of France"}).json()
        assert tokens["tokens"] == tokenizer.encode("The capital of France") and tokens["count"] == len(tokens["tokens"])
        assert tokens["max_model_len"] == llm.engine.max_model_len
        chat = [{"role": "user", "content": "Hi"}]
        templated = http.post("/tokenize", json={"messages": chat}).json()["tokens"]
        assert templated == llm.chat_prompt(chat)["prompt_token_ids"]
        assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "The capital of France"}
        bad = http.post("/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
        assert http.get("/version").json()["version"]
        preflight = http.options("/v1/chat/completions", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] in ("*",
                                                                                                   "http://localhost:3000")


def test_generation_config_defaults_and_several_served_names(tiny_checkpoints, tmp_path):
    """--generation-config DIR: its temperature and max_new_tokens fill what a request leaves unset, as
    LLM's defaults do; a request that sets them wins. Every --served-model-name is accepted and echoed."""
    from engine_helpers import make_llm

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    llm = make_llm(tiny_checkpoints["llama"])
    with serving(llm, model=tiny_checkpoints["llama"], served_model_name=["first", "second"],
                 generation_config=str(tmp_path)) as (base, _):
        chat = [{"role": "user", "content": "Hello world"}]
        want = llm.generate([llm.chat_prompt(chat)], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
        got = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                         json={"model": "second", "messages": chat, "ignore_eos": True}).json()
        assert got["model"] == "second" and got["usage"]["completion_tokens"] == 5
        assert got["choices"][0]["message"]["content"] == want.text
        longer = httpx.post(f"{base}/v1/chat/completions", timeout=60,
                            json={"model": "first", "messages": chat, "ignore_eos": True, "max_tokens": 7}).json()
        assert longer["usage"]["completion_tokens"] == 7
        names = [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]]
        assert names == ["first", "second"]


# The series vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana) queries, each with
# model_name="$model_name", and the counters vLLM 0.32 adds beside them.
DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum", "vllm:inter_token_latency_seconds_bucket",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
]


@pytest.mark.slow
@requires_smollm2
def test_metrics_answer_every_query_of_vllms_dashboard(served, client):
    base = served[0]
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    text = httpx.get(f"{base}/metrics", timeout=10).text
    labelled = {re.match(r"^([a-z0-9_:]+)\{", line).group(1) for line in text.splitlines()
                if f'model_name="{MODEL}"' in line}
    assert [name for name in DASHBOARD_SERIES if name not in labelled] == []
    values = metrics(base)
    assert 0 <= values["vllm:kv_cache_usage_perc"] <= 1
    assert values["vllm:request_queue_time_seconds_count"] >= 1 and values["vllm:request_decode_time_seconds_sum"] > 0
    assert values["vllm:prefix_cache_queries_total"] >= values["vllm:prefix_cache_hits_total"] >= 0
