"""Tool calling for the chat endpoint: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

How each choice is served, as vLLM serves it:

* ``none`` (or no tools): the tools still reach the chat template; the output is plain content.
* ``auto``: needs ``--enable-auto-tool-choice`` and ``--tool-call-parser``; the model decides, and
  the parser (``tool_parsers``) reads calls out of its text, streamed or whole.
* ``required``: structured output (compact JSON) forces a JSON array of one or more ``{"name", "parameters"}``
  objects, each ``parameters`` valid against its tool's schema (one at most without
  ``parallel_tool_calls``); the array becomes ``tool_calls``.
* a named function: structured output forces that function's arguments object.

``ToolPlan`` is a request's checked choice; ``message`` builds a whole reply, ``ToolDeltas`` the
streamed ``delta.tool_calls``.
"""
from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from jaxrunner.entrypoints.openai.protocol import RequestError
from jaxrunner.entrypoints.openai.tool_parsers import ToolCall, ToolParser, ToolStream
from jaxrunner.sampling_params import StructuredOutputsParams

TOOL_CHOICES = ("none", "auto", "required")


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """One request's tools and how the reply is read for calls."""

    tools: list[dict]           # as given ({"type": "function", "function": {...}}), for the template
    choice: str                 # "none", "auto", "required" or "named"
    parallel: bool
    function: str | None = None  # the forced function of a named choice
    parser: ToolParser | None = None  # "auto": the format the model writes calls in

    @property
    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output that forces the call ("required", named), else None."""
        functions = {t["function"]["name"]: t["function"] for t in self.tools}
        if self.choice == "named":  # compact JSON: arguments need no layout, and small models indent forever
            return StructuredOutputsParams(json=_parameters(functions[self.function]), disable_any_whitespace=True)
        if self.choice == "required":
            call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name},
                                                                 "parameters": _parameters(function)},
                               "required": ["name", "parameters"], "additionalProperties": False}
                              for name, function in functions.items()]}
            array = {"type": "array", "items": call, "minItems": 1}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array, disable_any_whitespace=True)
        return None

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"


def plan_tools(tools: list | None, tool_choice: Any, parallel: bool | None,
               parser: ToolParser | None) -> ToolPlan | None:
    """The request's tools checked (400 naming ``tools`` or ``tool_choice``); None without tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise RequestError("tool_choice: needs `tools`", param="tool_choice")
        return None
    names = _check_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    function = None
    if isinstance(choice, dict):
        function = _named_function(choice)
        if function not in names:
            raise RequestError(f"tool_choice: function {function!r} is not one of tools ({', '.join(names)})",
                               param="tool_choice")
        choice = "named"
    elif choice not in TOOL_CHOICES:
        raise RequestError(f"tool_choice: {choice!r} is not one of {', '.join(TOOL_CHOICES)} or "
                           '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if choice == "auto" and parser is None:
        if tool_choice is None:
            choice = "none"  # tools only inform the template, as vLLM without a parser
        else:
            raise RequestError('tool_choice: "auto" needs the server started with --enable-auto-tool-choice '
                               "and --tool-call-parser", param="tool_choice")
    return ToolPlan(list(tools), choice, True if parallel is None else bool(parallel), function,
                    parser if choice == "auto" else None)


def _check_tools(tools) -> list[str]:
    if not isinstance(tools, list):
        raise RequestError("tools: must be a list of {\"type\": \"function\", \"function\": {...}}", param="tools")
    names = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise RequestError(f"{where}: must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}.function.name: must be a non-empty string", param="tools")
        if name in names:
            raise RequestError(f"{where}.function.name: {name!r} is given twice", param="tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise RequestError(f"{where}.function.parameters: must be a JSON schema object", param="tools")
        names.append(name)
    return names


def _named_function(choice: dict) -> str:
    function = choice.get("function") if choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise RequestError('tool_choice: a named choice is {"type": "function", "function": {"name": ...}}',
                           param="tool_choice")
    return name


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_openai(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def reply(plan: ToolPlan | None, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The assistant message for a whole output, and the finish reason ("tool_calls" when the model
    chose to call: auto and required)."""
    if plan is None or not plan.reads_calls or finish_reason not in ("stop", None):
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = _calls(plan, text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": content, "tool_calls": [_as_openai(c) for c in calls]}
    return message, finish_reason if plan.choice == "named" else "tool_calls"


def _calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    if plan.choice == "named":
        return None, [ToolCall(new_call_id(), plan.function, text)]
    if plan.choice == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []  # cut short by max_tokens or a stop string: the text as it came
        return None, [ToolCall(new_call_id(), item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                      for item in items]
    parsed = plan.parser.parse(text)
    calls = parsed.tool_calls if plan.parallel else parsed.tool_calls[:1]
    return parsed.content, calls


class ToolDeltas:
    """One streamed choice's ``delta`` pieces: content as it comes, each call when it is whole."""

    def __init__(self, plan: ToolPlan | None):
        self.plan = plan
        self.stream: ToolStream | None = plan.parser.stream() if plan and plan.choice == "auto" else None
        self.held: list[str] = []  # required / named: the forced JSON, read when the choice ends
        self.num_calls = 0

    def feed(self, text: str, finished: bool) -> list[dict]:
        """The deltas for ``text`` (a piece of output); at the end, whatever was held."""
        if self.plan is None or not self.plan.reads_calls:
            return [{"content": text}] if text else []
        if self.stream is None:
            self.held.append(text)
            if not finished:
                return []
            message, _ = reply(self.plan, "".join(self.held), "stop")
            return self._calls_deltas(message)
        content, calls = self.stream.feed(text)
        if finished:
            more_content, more_calls = self.stream.finish()
            content, calls = content + more_content, calls + more_calls
        deltas = [{"content": content}] if content else []
        for call in calls:
            if not self.plan.parallel and (call.index > 0):
                continue
            self.num_calls = max(self.num_calls, call.index + 1)
            piece = {"index": call.index, "function": {"arguments": call.arguments}}
            if call.id is not None:
                piece.update(id=call.id, type="function")
                piece["function"]["name"] = call.name
            deltas.append({"tool_calls": [piece]})
        return deltas

    def _calls_deltas(self, message: dict) -> list[dict]:
        calls = message.get("tool_calls") or []
        self.num_calls = len(calls)
        if not calls:
            return [{"content": message["content"]}] if message["content"] else []
        return [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)]

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" for a choice that called (auto, required), as in the whole reply."""
        if reason == "stop" and self.num_calls and self.plan.choice != "named":
            return "tool_calls"
        return reason
