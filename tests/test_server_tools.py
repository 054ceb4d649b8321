"""Structured output and tool calls over HTTP with the ``openai`` client, against the shared
SmolLM2 server (conftest ``served``; tool calls read by the hermes parser): JSON schemas, regex and
choice on both endpoints, streamed and whole; the tool-call loop (request, tool_calls, tool result,
answer) with a tool-capable chat template written here; refusals that name the request's field; and
constrained, free and tool-calling requests mixed with nothing compiled."""
from __future__ import annotations

import concurrent.futures
import json
import re

import pytest

from conftest import SERVER_KEY, requires_smollm2
from engine_helpers import count_compilations

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = [pytest.mark.slow, requires_smollm2]

MODEL = "smollm2-135m-instruct"
# A Hermes-style template: the tools in a system turn, assistant tool calls and tool results in the history.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function') | map(attribute='name') "
    "| join(', ') }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{%- if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] }}}</tool_call>{% endfor %}"
    "{%- elif m['role'] == 'tool' %}<tool_response id=\"{{ m['tool_call_id'] }}\">{{ m['content'] }}</tool_response>"
    "{%- else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, headers={"Authorization": f"Bearer {SERVER_KEY}"}, timeout=300)


def _arguments_valid(call, tool: dict) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_json_schema_and_json_object_on_chat_whole_and_streamed(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person as JSON."}],
                                           response_format=fmt, max_tokens=60, temperature=0)
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person as JSON."}],
                                            response_format=fmt, max_tokens=60, temperature=0.8, seed=3, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    obj = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please."}],
                                         response_format={"type": "json_object"}, max_tokens=60, temperature=0,
                                         extra_body={"structured_outputs": None})
    assert obj.choices[0].message.content.lstrip().startswith("{")


def test_structured_outputs_regex_and_choice_on_completions(client):
    regex = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20, temperature=0.9, seed=1,
                                      extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", regex.choices[0].text)
    choice = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=5, n=3, temperature=1.0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert {c.text for c in choice.choices} <= {"yes", "no"} and all(c.finish_reason == "stop" for c in choice.choices)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "bogus"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"chat_template": "{% for m in messages %}{{ m.nope.nope }}{% endfor %}"}, "chat_template"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"continue_final_message": True}, "continue_final_message"),
])
def test_bad_structured_output_and_tool_fields_are_400s_naming_the_field(served, client, body, param):
    base = served[0]
    response = _post(base, "/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_the_tool_call_loop_with_the_openai_client(served, client):
    """required -> tool_calls valid against the tool's schema -> the tool's result in the history ->
    an answer; the history reaches the template as given."""
    template = {"chat_template": TOOL_TEMPLATE}
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           max_tokens=80, temperature=0, extra_body=template)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) >= 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
    for call in calls:
        _arguments_valid(call, {"get_weather": WEATHER, "get_time": TIME}[call.function.name])
    history = ASK + [choice.message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "18 C, sunny"} for c in calls]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME], tool_choice="none",
                                           max_tokens=20, temperature=0, extra_body=template)
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")
    rendered = _post(served[0], "/tokenize", {"model": MODEL, "messages": history, "tools": [WEATHER, TIME],
                                               **template}).json()
    text = _post(served[0], "/detokenize", {"model": MODEL, "tokens": rendered["tokens"]}).json()["prompt"]
    assert f'<tool_response id="{calls[0].id}">18 C, sunny</tool_response>' in text
    assert f'<tool_call>{{"name": "{calls[0].function.name}", "arguments": {calls[0].function.arguments}}}' in text
    assert "Tools: get_weather, get_time" in text
    assert final.usage.prompt_tokens == rendered["count"]


def test_named_choice_and_single_call_required(client):
    named = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0.7, seed=2,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, extra_body={"chat_template": TOOL_TEMPLATE})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and named.choices[0].finish_reason == "stop"
    _arguments_valid(call, TIME)
    single = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=5, n=3,
                                            extra_body={"chat_template": TOOL_TEMPLATE})
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)


HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}\n</tool_call>'


def test_auto_choice_reads_hermes_calls_whole_and_streamed(client):
    """The model is steered into the hermes format by a regex; the parser turns it into tool_calls."""
    body = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=60, temperature=0.9, seed=4,
                extra_body={"chat_template": TOOL_TEMPLATE, "structured_outputs": {"regex": HERMES_CALL}})
    whole = client.chat.completions.create(**body)
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    deltas, reasons = [], []
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "tool_calls"
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0,
                                           extra_body={"chat_template": TOOL_TEMPLATE})
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_chat_template_kwargs_and_continue_final_message(served, client):
    template = "{{ greeting }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    rendered = _post(served[0], "/tokenize", {"model": MODEL, "messages": ASK, "chat_template": template,
                                               "chat_template_kwargs": {"greeting": "Bonjour!"}}).json()
    text = _post(served[0], "/detokenize", {"model": MODEL, "tokens": rendered["tokens"]}).json()["prompt"]
    assert text == "Bonjour![user]What is the weather in Paris?"
    partial = ASK + [{"role": "assistant", "content": "The weather in Paris is"}]
    llm = served[1]
    expected = llm.chat_prompt(partial, add_generation_prompt=False, continue_final_message=True)
    assert expected["prompt"].endswith("The weather in Paris is")
    reply = client.chat.completions.create(model=MODEL, messages=partial, max_tokens=4, temperature=0,
                                           extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert reply.usage.prompt_tokens == len(expected["prompt_token_ids"])


def test_constrained_free_and_tool_requests_mixed_compile_nothing(served, client):
    calls = [
        dict(messages=ASK, max_tokens=30, response_format={"type": "json_schema",
                                                           "json_schema": {"name": "p", "schema": SCHEMA}}),
        dict(messages=ASK, max_tokens=30),
        dict(messages=ASK, max_tokens=60, tools=[WEATHER], tool_choice="required",
             extra_body={"chat_template": TOOL_TEMPLATE}),
        dict(messages=ASK, max_tokens=30, temperature=0.9, seed=1),
    ] * 2
    client.chat.completions.create(model=MODEL, **calls[0])
    with count_compilations() as compiles, concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda body: client.chat.completions.create(model=MODEL, **body), calls))
    assert compiles == []
    jsonschema.validate(json.loads(replies[0].choices[0].message.content), SCHEMA)
    _arguments_valid(replies[2].choices[0].message.tool_calls[0], WEATHER)
