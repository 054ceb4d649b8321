"""Tool-call parsers: a model's generated text to OpenAI ``tool_calls``, whole or streamed.

The formats are the ones vLLM's ``--tool-call-parser`` names:

``hermes``
    Hermes 2 Pro / 3, Qwen2.5 and QwQ. Zero or more blocks; the text before the first is content::

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

``llama3_json``
    Llama 3.1, 3.2 and 3.3 (JSON tool calling). The output is a JSON object, optionally after
    ``<|python_tag|>``, with the arguments under ``"parameters"`` (or ``"arguments"``); several calls
    are separated by ``;``. Text that does not start with ``{`` (after whitespace) and holds no
    ``<|python_tag|>`` is plain content::

        <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

``mistral``
    Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo / Small / Large. ``[TOOL_CALLS]`` and a JSON array,
    or, with the newer tokenizers (Mistral Small 3.2, Magistral, Devstral), ``[TOOL_CALLS]`` before
    each call in the ``name[ARGS]{...}`` form. Call ids are 9 alphanumeric characters::

        [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
        [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

``qwen3_xml``
    Qwen3-Coder. XML-like blocks, one parameter per element; a value is JSON-decoded when it parses as
    JSON (numbers, booleans, objects, arrays), else kept as a string, less one leading and one
    trailing newline::

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

``<|python_tag|>`` and ``[TOOL_CALLS]`` are special tokens: the text given to those two parsers must
be decoded with special tokens kept.

``ToolParser.parse`` reads a whole output; ``ToolParser.stream`` gives a per-request state that reads
it piece by piece, holding back text that may begin a call and emitting each call once it is
complete. Both run the same scanner, so streaming any split of a text gives what ``parse`` gives.
Text that looks like a call but is not one (JSON that never parses, a block never closed) is content.
"""
from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # text outside tool calls; None when empty or whitespace
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of a tool call: OpenAI's ``delta.tool_calls[i]``."""
    index: int
    id: str | None  # set on the first delta of a call
    name: str | None  # set on the first delta of a call
    arguments: str  # a piece of the arguments JSON text


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(strict=False, parse_constant=_reject_constant)


def _load(text: str):
    """The JSON value ``text`` holds, or None when it is not JSON."""
    try:
        return _DECODER.decode(text)
    except ValueError:
        return None


def _decode_prefix(text: str):
    """(value, end) of the JSON value at the start of ``text``, or None while it does not parse."""
    try:
        return _DECODER.raw_decode(text)
    except ValueError:
        return None


def _as_call(obj) -> tuple[str, dict] | None:
    """(name, arguments) of a ``{"name": ..., "arguments"|"parameters": {...}}`` object, else None."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters"))
    if args is None:
        args = {}
    elif isinstance(args, str):
        args = _load(args)
    if not isinstance(name, str) or not name.strip() or not isinstance(args, dict):
        return None
    return name, args


def _partial_marker(buffer: str, marker: str) -> int:
    """Length of the longest suffix of ``buffer`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(buffer)), 0, -1):
        if buffer.endswith(marker[:k]):
            return k
    return 0


class ToolParser:
    """A tool-call format. Subclasses say where a call starts (``_find_start``, ``_held_back``) and
    when the text after that start holds a whole call (``_read_call``)."""

    name = ""
    start_marker = ""

    def parse(self, text: str) -> ParsedOutput:
        """The calls in a whole output. Content is the text as it is when there are no calls, and the
        text outside them, stripped, when there are."""
        stream = self.stream()
        content, deltas = stream.feed(text)
        rest, more = stream.finish()
        content += rest
        calls = [ToolCall(d.id, d.name, d.arguments) for d in deltas + more]
        if calls:
            content = content.strip()
        return ParsedOutput(content if content.strip() else None, calls)

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def _new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def _find_start(self, buffer: str, fresh: bool) -> tuple[int, int] | None:
        """The span of the first call start in ``buffer``, or None. ``fresh``: only whitespace has
        come since the output began or since the last call."""
        at = buffer.find(self.start_marker)
        return None if at < 0 else (at, at + len(self.start_marker))

    def _held_back(self, buffer: str, fresh: bool) -> int:
        """How many trailing characters of ``buffer`` (holding no call start) may begin one."""
        return _partial_marker(buffer, self.start_marker)

    def _read_call(self, body: str, final: bool) -> tuple[int, list[tuple[str, dict]] | None] | None:
        """For the text after a call start: None while more text may complete the call, else the
        length that the call takes and its calls as (name, arguments), or None calls when that text
        is not a call. ``final``: no more text will come."""
        raise NotImplementedError


class ToolStream:
    """One request's streaming state: feed it the generated text, then call ``finish``. Content that
    is only whitespace waits for more content; once a call has been emitted, trailing whitespace is
    dropped."""

    def __init__(self, parser: ToolParser):
        self._parser = parser
        self._buffer = ""
        self._marker: str | None = None  # the start of the call being read; None outside calls
        self._fresh = True
        self._spaces = ""  # whitespace-only content, held until more content comes
        self._index = 0

    def feed(self, delta_text: str) -> tuple[str, list[ToolCallDelta]]:
        """Content text safe to emit now, and tool-call deltas completed by this piece."""
        self._buffer += delta_text
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of generation: flush held text / calls."""
        content, deltas = self._advance(final=True)
        if self._index == 0:
            content += self._spaces
        self._spaces = ""
        return content, deltas

    def _advance(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._marker is None:
                moved = self._start_call(content, final)
            else:
                moved = self._end_call(content, deltas, final)
            if not moved:
                break
        return "".join(content), deltas

    def _start_call(self, content: list[str], final: bool) -> bool:
        span = self._parser._find_start(self._buffer, self._fresh)
        if span is None:
            keep = 0 if final else self._parser._held_back(self._buffer, self._fresh)
            cut = len(self._buffer) - keep
            content.append(self._content(self._buffer[:cut]))
            self._buffer = self._buffer[cut:]
            return False
        start, end = span
        content.append(self._content(self._buffer[:start]))
        self._marker, self._buffer = self._buffer[start:end], self._buffer[end:]
        return True

    def _end_call(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        read = self._parser._read_call(self._buffer, final)
        if read is None and not final:
            return False
        used, calls = read if read is not None else (len(self._buffer), None)
        text, self._buffer = self._buffer[:used], self._buffer[used:]
        if calls is None:
            content.append(self._content(self._marker + text))
            self._fresh = False
        else:
            deltas.extend(self._delta(name, args) for name, args in calls)
            self._fresh = True
        self._marker = None
        return True

    def _content(self, text: str) -> str:
        if not text.strip():
            self._spaces += text
            return ""
        text, self._spaces = self._spaces + text, ""
        self._fresh = False
        return text

    def _delta(self, name: str, args: dict) -> ToolCallDelta:
        delta = ToolCallDelta(self._index, self._parser._new_id(), name, json.dumps(args, ensure_ascii=False))
        self._index += 1
        return delta


class HermesToolParser(ToolParser):
    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"

    def _read_call(self, body, final):
        at = body.find(self.end_marker)
        if at < 0:
            return None
        return at + len(self.end_marker), self._calls_in(body[:at])

    def _calls_in(self, block: str) -> list[tuple[str, dict]] | None:
        call = _as_call(_load(block.strip()))
        return [call] if call else None


_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def _xml_items(pattern: re.Pattern, text: str) -> list[tuple[str, str]] | None:
    """(name, body) of each element ``pattern`` matches; None when other text lies between them."""
    items, pos = [], 0
    for match in pattern.finditer(text):
        if text[pos:match.start()].strip():
            return None
        items.append((match.group(1).strip(), match.group(2)))
        pos = match.end()
    return None if text[pos:].strip() else items


def _xml_value(text: str):
    text = text[1:] if text.startswith("\n") else text
    text = text[:-1] if text.endswith("\n") else text
    try:
        return _DECODER.decode(text)
    except ValueError:
        return text


class Qwen3XmlToolParser(HermesToolParser):
    name = "qwen3_xml"

    def _calls_in(self, block):
        functions = _xml_items(_FUNCTION, block)
        if not functions:
            return None
        calls = []
        for name, body in functions:
            params = _xml_items(_PARAMETER, body)
            if not name or params is None or not all(key for key, _ in params):
                return None
            calls.append((name, {key: _xml_value(value) for key, value in params}))
        return calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_marker = "<|python_tag|>"
    _LEAD = re.compile(r"(\s*)((?:;\s*)*)")  # whitespace, then the ';' separators between calls

    def _find_start(self, buffer, fresh):
        if fresh:
            lead = self._LEAD.match(buffer)
            if buffer.startswith("{", lead.end()):
                return lead.end(1), lead.end()
        return super()._find_start(buffer, fresh)

    def _held_back(self, buffer, fresh):
        if fresh and self._LEAD.match(buffer).end() == len(buffer):
            return len(buffer)
        return super()._held_back(buffer, fresh)

    def _read_call(self, body, final):
        text = body.lstrip()
        if not text:
            return None
        if not text.startswith("{"):
            return 0, None
        decoded = _decode_prefix(text)
        if decoded is None:
            return None
        value, end = decoded
        call = _as_call(value)
        return len(body) - len(text) + end, ([call] if call else None)


_MISTRAL_ARGS = "[ARGS]"
_NAME = re.compile(r"[\w.\-]+")
_NAME_SO_FAR = re.compile(r"\s*[\w.\-]*\s*")
_ALNUM = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    start_marker = "[TOOL_CALLS]"

    def _new_id(self) -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))

    def _read_call(self, body, final):
        text = body.lstrip()
        if not text.startswith(("[", "{")):
            return self._read_named_call(body)
        decoded = _decode_prefix(text)
        if decoded is None:
            return None
        value, end = decoded
        calls = [_as_call(item) for item in (value if isinstance(value, list) else [value])]
        return len(body) - len(text) + end, (calls if calls and all(calls) else None)

    def _read_named_call(self, body: str):
        """The ``name[ARGS]{...}`` form."""
        at = body.find(_MISTRAL_ARGS)
        if at < 0:
            head = body[:len(body) - _partial_marker(body, _MISTRAL_ARGS)]
            return None if _NAME_SO_FAR.fullmatch(head) else (0, None)
        name = body[:at].strip()
        if not _NAME.fullmatch(name):
            return 0, None
        after = body[at + len(_MISTRAL_ARGS):]
        text = after.lstrip()
        if not text.startswith("{"):
            return (0, None) if text else None
        decoded = _decode_prefix(text)
        if decoded is None:
            return None
        value, end = decoded
        call = _as_call({"name": name, "arguments": value})
        return len(body) - len(text) + end, ([call] if call else None)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, Qwen3XmlToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        valid = ", ".join(TOOL_PARSERS)
        raise ValueError(f"unknown tool_call_parser {name!r}; valid names: {valid}") from None
