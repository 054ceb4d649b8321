"""Tool-call parsers: each format's calls come back with their names and arguments, text outside
calls is content, malformed calls are content, and streaming any split of a text gives what
``parse`` gives."""
from __future__ import annotations

import json
import re

import pytest

from jaxrunner.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCallDelta, get_tool_parser

WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"timezone": "Europe/Paris", "precise": True})
NESTED = ("search", {"query": "café naïve 日本語 😀", "limit": 5, "text": "first line\nsecond line",
                     "filters": {"tags": ["a", "é"], "range": {"min": 1, "max": 2.5}, "none": None}})
NO_ARGS = ("ping", {})
CALL_SETS = {"single": [WEATHER], "two": [WEATHER, TIME], "nested": [NESTED], "no_args": [NO_ARGS],
             "three": [TIME, NESTED, WEATHER]}
CONTENTS = [None, "Let me check that for you.", "D'accord — voilà : 日本語."]
OPENAI_ID = re.compile(r"call_[0-9a-f]{24}")
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _hermes(content, calls):
    blocks = "".join(f"<tool_call>\n{_dumps({'name': n, 'arguments': a})}\n</tool_call>\n" for n, a in calls)
    return f"{content}\n\n{blocks}" if content else blocks


def _llama3(content, calls):
    """Bare JSON without content, ``<|python_tag|>`` after content."""
    body = "; ".join(_dumps({"name": n, "parameters": a}) for n, a in calls)
    return f"{content} <|python_tag|>{body}" if content else body


def _llama3_tagged(content, calls):
    body = ";".join(_dumps({"name": n, "arguments": a}) for n, a in calls)
    return f"{content or ''}<|python_tag|>{body}"


def _mistral(content, calls):
    return f"{content or ''}[TOOL_CALLS]{_dumps([{'name': n, 'arguments': a} for n, a in calls])}"


def _mistral_named(content, calls):
    return (content or "") + "".join(f"[TOOL_CALLS]{n}[ARGS]{_dumps(a)}" for n, a in calls)


def _qwen3(content, calls):
    def value(v):
        return v if isinstance(v, str) else _dumps(v)
    blocks = "".join(
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>\n" for n, a in calls)
    return f"{content}\n\n{blocks}" if content else blocks


RENDERERS = [("hermes", _hermes), ("llama3_json", _llama3), ("llama3_json", _llama3_tagged),
             ("mistral", _mistral), ("mistral", _mistral_named), ("qwen3_xml", _qwen3)]

PLAIN = ["Hello! How can I help?", "  Use a <tool> tag, or x < y; [TOOLS] {curly} braces.\n",
         "The answer is {\"a\": 1}.", "", "   \n", "<", "naïve café 日本語 😀"]

MALFORMED = {
    "hermes": ["<tool_call>\n{not json}\n</tool_call>",
               '<tool_call>\n{"name": "f", "arguments": {}}',
               '<tool_call>{"arguments": {"a": 1}}</tool_call>',
               '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',
               "Before <tool_call>"],
    "llama3_json": ['{"name": "f", "parameters": {"a": 1}',
                    '{"answer": 42}',
                    '<|python_tag|>print("hi")',
                    "{oops",
                    'Sure: {"name": "f", "parameters": {}}'],
    "mistral": ['[TOOL_CALLS][{"name": "f", "arguments": {}}',
                "[TOOL_CALLS]not a call at all",
                "[TOOL_CALLS]f[ARGS]oops",
                "[TOOL_CALLS][1, 2]",
                '[TOOL_CALLS]f [ARGS]{"a": NaN}',
                "[TOOL_CALLS]get_weather"],
    "qwen3_xml": ["<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>",
                  "<tool_call>\nplain text\n</tool_call>",
                  "<tool_call>\n<function=>\n</function>\n</tool_call>",
                  "<tool_call>\n<function=f>\n</function>\nstray text\n</tool_call>"],
}


def _splits(text: str):
    """``text`` cut into chunks of 1, 2, 3 and 7 characters, at every offset."""
    for size in (1, 2, 3, 7):
        for offset in range(min(size, max(len(text), 1))):
            yield [text[:offset]] + [text[i:i + size] for i in range(offset, len(text), size)]


def _streamed(parser, pieces):
    """Content and calls (id, name, arguments) reassembled from a stream fed ``pieces``."""
    stream = parser.stream()
    content, calls = [], {}
    results = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    for text, deltas in results:
        content.append(text)
        for delta in deltas:
            assert isinstance(delta, ToolCallDelta)
            if delta.index not in calls:
                assert delta.id and delta.name, "the first delta of a call carries its id and name"
                calls[delta.index] = [delta.id, delta.name, ""]
            calls[delta.index][2] += delta.arguments
    assert sorted(calls) == list(range(len(calls)))
    return "".join(content), [tuple(calls[i]) for i in sorted(calls)]


def _assert_streams_like_parse(parser, text):
    parsed = parser.parse(text)
    expected = [(c.name, c.arguments) for c in parsed.tool_calls]
    for pieces in _splits(text):
        content, calls = _streamed(parser, pieces)
        assert [(name, args) for _, name, args in calls] == expected, pieces
        assert (content.strip() or None) == (parsed.content.strip() if parsed.content else None), pieces


@pytest.mark.parametrize("content", CONTENTS, ids=["no_content", "ascii", "unicode"])
@pytest.mark.parametrize("case", sorted(CALL_SETS))
@pytest.mark.parametrize("parser_name, render", RENDERERS, ids=[f"{p}-{r.__name__}" for p, r in RENDERERS])
def test_calls_parse_and_stream(parser_name, render, case, content):
    parser = get_tool_parser(parser_name)
    calls = CALL_SETS[case]
    text = render(content, calls)
    parsed = parser.parse(text)
    assert parsed.content == content
    assert [c.name for c in parsed.tool_calls] == [name for name, _ in calls]
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [args for _, args in calls]
    assert all("\\u" not in c.arguments for c in parsed.tool_calls), "non-ASCII text is kept as is"
    _assert_streams_like_parse(parser, text)


@pytest.mark.parametrize("parser_name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("text", PLAIN)
def test_plain_text_is_content(parser_name, text):
    parser = get_tool_parser(parser_name)
    parsed = parser.parse(text)
    assert parsed.tool_calls == []
    assert parsed.content == (text if text.strip() else None)
    for pieces in _splits(text):
        assert _streamed(parser, pieces) == (text, [])


@pytest.mark.parametrize("parser_name, text", [(p, t) for p, texts in MALFORMED.items() for t in texts])
def test_malformed_call_is_content(parser_name, text):
    parser = get_tool_parser(parser_name)
    assert parser.parse(text).tool_calls == []
    assert parser.parse(text).content == text
    for pieces in _splits(text):
        assert _streamed(parser, pieces) == (text, [])


@pytest.mark.parametrize("parser_name, render", RENDERERS, ids=[f"{p}-{r.__name__}" for p, r in RENDERERS])
def test_malformed_call_between_good_ones(parser_name, render):
    parser = get_tool_parser(parser_name)
    bad = MALFORMED[parser_name][1] if parser_name != "llama3_json" else "trailing {x}"
    text = render(None, [WEATHER]) + bad + render(None, [TIME])
    parsed = parser.parse(text)
    assert parsed.tool_calls and parsed.tool_calls[0].name == "get_weather"
    assert parsed.content
    _assert_streams_like_parse(parser, text)


@pytest.mark.parametrize("parser_name, render", RENDERERS, ids=[f"{p}-{r.__name__}" for p, r in RENDERERS])
def test_ids_are_unique_and_shaped(parser_name, render):
    parser = get_tool_parser(parser_name)
    text = render(None, CALL_SETS["three"])
    ids = [c.id for _ in range(3) for c in parser.parse(text).tool_calls]
    shape = MISTRAL_ID if parser_name == "mistral" else OPENAI_ID
    assert len(ids) == 9 and len(set(ids)) == 9
    assert all(shape.fullmatch(i) for i in ids), ids


def test_stream_emits_content_early_and_calls_when_complete():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hello <tool") == ("Hello ", [])
    assert stream.feed('_call>\n{"name": "f", "arguments": {"a": 1}}\n') == ("", [])
    content, deltas = stream.feed("</tool_call>\n")
    assert content == "" and len(deltas) == 1
    assert (deltas[0].index, deltas[0].name, json.loads(deltas[0].arguments)) == (0, "f", {"a": 1})
    assert stream.finish() == ("", [])


def test_llama3_holds_only_leading_whitespace():
    stream = get_tool_parser("llama3_json").stream()
    assert stream.feed("  ") == ("", [])
    assert stream.feed("Hi {") == ("  Hi {", [])
    stream = get_tool_parser("llama3_json").stream()
    assert stream.feed(' {"name": "f", "parameters": {}}')[1][0].name == "f"
    assert stream.feed(' ;{"name": "g", "parameters": {"x": [1]}}')[1][0].index == 1
    assert stream.finish() == ("", [])


def test_unknown_parser_names_the_valid_ones():
    with pytest.raises(ValueError, match="tool_call_parser") as info:
        get_tool_parser("pythonic")
    assert all(name in str(info.value) for name in ("hermes", "llama3_json", "mistral", "qwen3_xml"))
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "qwen3_xml"}
