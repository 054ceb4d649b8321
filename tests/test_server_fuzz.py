"""Fuzzing the server from its own OpenAPI schema (schemathesis) and from strategies for what the
schema leaves loose (hostile unicode, nesting, token ids, numbers at the edges), against a real
server on 127.0.0.1 over one keep-alive connection.

Invariants after every case: no 5xx; every 4xx is OpenAI's error JSON, a 400 naming a field of the
request; the same connection then serves a normal request; and once all cases are done, no request
is left in the engine and no KV page is held. ``FUZZ_CASES`` cases per endpoint and strategy run
here; ``JAXRUNNER_FUZZ_CASES`` raises it for a longer run (the README gives the command).
"""
from __future__ import annotations

import json
import os
import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engine_helpers import make_llm  # noqa: E402
from jaxrunner.entrypoints.openai import protocol  # noqa: E402
from jaxrunner.entrypoints.openai.api_server import ServerConfig, ServerState, build_app  # noqa: E402
from server_helpers import serving  # noqa: E402

FUZZ_CASES = int(os.environ.get("JAXRUNNER_FUZZ_CASES", "60"))
ENDPOINTS = {"/v1/completions": protocol.CompletionRequest, "/v1/chat/completions": protocol.ChatCompletionRequest}
MODEL = "tiny"


@pytest.fixture(scope="module")
def fuzzed_server(tiny_checkpoints):
    llm = make_llm(tiny_checkpoints["llama"])
    with serving(llm, model=MODEL) as (base, _), httpx.Client(base_url=base, timeout=120) as http:
        yield http, llm
    llm.engine.scheduler.allocator.check_invariants()


def _check_answer(http: httpx.Client, path: str, content: bytes, body) -> None:
    response = http.post(path, content=content, headers={"Content-Type": "application/json"})
    shown = content[:300]
    assert response.status_code < 500, (shown, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"] and error["code"] == response.status_code, (shown, error)
        if response.status_code == 400 and isinstance(body, dict):
            field = (error["param"] or "").split(".")[0]  # "messages.0.content" names messages
            assert field in set(body) | set(ENDPOINTS[path].model_fields), (shown, error)
    elif not json.loads(content).get("stream"):
        assert response.json()["choices"], (shown, response.text[:500])
    normal = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    assert http.post("/v1/completions", json=normal).status_code == 200, shown  # the connection goes on


def _settings(cases: int):
    return settings(max_examples=cases, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


def _drained(llm) -> None:
    deadline = time.monotonic() + 30
    while llm.engine_loop.num_requests() or llm.engine.scheduler.allocator.num_used_pages:
        assert time.monotonic() < deadline, "requests or pages left after fuzzing"
        time.sleep(0.05)


@pytest.mark.parametrize("path", list(ENDPOINTS))
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schema_driven_requests_never_get_a_5xx(fuzzed_server, path, mode):
    http, llm = fuzzed_server
    schema = schemathesis.openapi.from_dict(build_app(ServerState(ServerConfig(model=MODEL))).openapi())
    strategy = schema[path]["POST"].as_strategy(schemathesis.GenerationMode(mode))

    @_settings(FUZZ_CASES)
    @given(strategy)
    def run(case):
        body = case.body
        if isinstance(body, dict) and "model" in body and body["model"] is not None and len(body) % 2:
            body = {**body, "model": MODEL}  # half of the cases get past the model check
        if isinstance(body, bytes):  # negative mode also sends raw bytes
            _check_answer(http, path, body, None)
        else:
            _check_answer(http, path, json.dumps(body).encode(), body)

    run()
    _drained(llm)


# ----------------------------------------------------------------------------- what the schema leaves loose
ANY_CODEPOINT = st.one_of(st.characters(exclude_categories=()),  # lone surrogates (Cs) included
                          st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=()))
EDGE_NUMBERS = st.one_of(st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -2**63, 10**30, 1e30, -1e30, 1e-30,
                                          float("inf"), float("-inf"), float("nan"), 0.5, 1e308]),
                         st.integers(), st.floats())
TOKEN_IDS = st.lists(st.one_of(st.integers(-5, 600), st.sampled_from([2**31, 2**63, -2**63])), max_size=40)
FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs", "top_logprobs",
          "max_completion_tokens"]


@st.composite
def loose_bodies(draw, chat: bool):
    text = draw(st.text(ANY_CODEPOINT, max_size=30))
    if chat:
        body = {"messages": [{"role": draw(st.sampled_from(["user", "system", "assistant", "tool", "x"])),
                              "content": draw(st.one_of(st.just(text), st.lists(st.fixed_dictionaries(
                                  {"type": st.sampled_from(["text", "image_url"]), "text": st.just(text)}),
                                  max_size=3)))}]}
    else:
        body = {"prompt": draw(st.one_of(st.just(text), TOKEN_IDS, st.lists(TOKEN_IDS, max_size=3)))}
    body["model"] = draw(st.sampled_from([MODEL, None, text]))
    body["max_tokens"] = draw(st.integers(1, 16))
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        body[name] = draw(EDGE_NUMBERS)
    if draw(st.booleans()):
        body["logit_bias"] = draw(st.dictionaries(st.one_of(st.text(ANY_CODEPOINT, max_size=6),
                                                            st.integers(-10, 10**20).map(str)),
                                                  EDGE_NUMBERS, max_size=3))
    if draw(st.booleans()):
        body["stop"] = draw(st.one_of(st.text(ANY_CODEPOINT, max_size=5), st.lists(st.text(ANY_CODEPOINT, max_size=5),
                                                                                    max_size=3)))
    if draw(st.booleans()):
        body["stop_token_ids"] = draw(TOKEN_IDS)
    body["stream"] = draw(st.booleans())
    return body


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_loose_fields_never_get_a_5xx(fuzzed_server, path):
    http, llm = fuzzed_server

    @_settings(FUZZ_CASES)
    @given(loose_bodies(chat=path.endswith("chat/completions")), st.sampled_from([0, 0, 0, 0, 50, 5000, 100_000]))
    def run(body, depth):
        content = json.dumps(body, allow_nan=True)  # NaN/Infinity: Python's JSON reads them
        if depth:  # the body inside `depth` arrays (written as text: no encoder nests that deep)
            body, content = None, "[" * depth + content + "]" * depth
        _check_answer(http, path, content.encode(), body)

    run()
    _drained(llm)
