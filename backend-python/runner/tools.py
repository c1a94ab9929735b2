"""Tool calling: the prompt that offers functions to the model, the grammar that holds its calls
to them, and how an earlier call reads in a later prompt.

The one template (docs/api.md, "Tools"): a `System:` turn first, with the instructions and one
JSON line per function, then the conversation; a call is one line

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

and parallel calls are such lines one after another. The prompt only asks; the grammar
(`ToolPlan.grammar`) guarantees it: `name` is one of the callable functions, `arguments` matches
that function's `parameters` schema. With `tool_choice: "auto"` the grammar allows either free
text or calls, and the answer's first characters decide: an answer that starts with
`<tool_call>` (after at most one space) is held to the call grammar from there on; any other
start is text to the end.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from albatross.constraints import ConstraintError, check_json_schema, json_value_rule
from runner.errors import ApiError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
CALL_SEPARATOR = "\n"  # between parallel calls
CALL_HEAD = '{"name": '  # then the JSON string of the name
ARGUMENTS_KEY = ', "arguments": '  # then the arguments object, then "}"

ToolMode = Literal["auto", "required"]


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]  # an object schema, checked


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools allow: `callable` may be called (all, or the one `tool_choice`
    names), `offered` are described in the prompt."""

    offered: tuple[Function, ...]
    callable: tuple[Function, ...]
    mode: ToolMode
    parallel: bool

    @property
    def names(self) -> frozenset[str]:
        return frozenset(function.name for function in self.callable)

    def system_prompt(self) -> str:
        """The System turn's text: instructions, then one JSON line per offered function. It holds
        no blank line (RWKV World chats separate turns with one)."""
        several = " Several calls go on separate lines." if self.parallel else ""
        if self.mode == "auto":
            when = "Call a function only when it helps; otherwise reply in plain text."
        elif len(self.callable) == 1 and len(self.offered) > 1:
            when = f"You must call {self.callable[0].name} now."
        else:
            when = "You must call a function now."
        lines = [
            f"You can call functions. To call one, reply with {TOOL_CALL_OPEN}{{\"name\": \"<function name>\", "
            f"\"arguments\": <the arguments as a JSON object>}}{TOOL_CALL_CLOSE} and nothing else.{several} {when}",
            "Functions:",
        ]
        for function in self.offered:
            entry: dict[str, Any] = {"name": function.name}
            if function.description:
                entry["description"] = function.description
            entry["parameters"] = function.parameters
            lines.append(json.dumps(entry, ensure_ascii=False))
        return "\n".join(lines)

    def grammar(self) -> str:
        """llguidance lark text of the answers this plan allows."""
        rules = [f"start: {'TEXT | calls' if self.mode == 'auto' else 'calls'}"]
        rules.append("calls: OPEN call CLOSE (NEXT call CLOSE)*" if self.parallel else "calls: OPEN call CLOSE")
        rules.append("call: " + " | ".join(f"f{i}" for i in range(len(self.callable))))
        for i, function in enumerate(self.callable):
            head = CALL_HEAD + json.dumps(function.name) + ARGUMENTS_KEY
            rules.append(f"f{i}: {json.dumps(head)} a{i} \"}}\"")
            rules.append(f"a{i}: {json_value_rule(function.parameters)}")
        rules.append(f"OPEN: / ?{TOOL_CALL_OPEN}/")
        rules.append(f"CLOSE: {json.dumps(TOOL_CALL_CLOSE)}")
        rules.append(f"NEXT: {json.dumps(CALL_SEPARATOR + TOOL_CALL_OPEN)}")
        if self.mode == "auto":
            # any text that does not start a call; the two leading forms match OPEN's
            rules.append(f"TEXT: /(?s:.*)/ & ~/ ?{TOOL_CALL_OPEN}(?s:.*)/")
        return "\n".join(rules) + "\n"


def _function(tool: Any, index: int) -> Function:
    where = f"tools.{index}"
    kind = getattr(tool, "type", None)
    if kind != "function":
        raise ApiError(400, f"{where}.type: only function tools are supported, not {kind!r}", f"{where}.type")
    function = tool.function
    if function is None:
        raise ApiError(400, f"{where}.function is required", f"{where}.function")
    if function.parameters is None:
        raise ApiError(400, f"{where}.function.parameters is required: the JSON schema of {function.name}'s arguments", f"{where}.function.parameters")
    parameters = dict(function.parameters)
    kind = parameters.setdefault("type", "object")
    if kind != "object":
        raise ApiError(400, f"{where}.function.parameters must describe an object (arguments are a JSON object), not {kind!r}", f"{where}.function.parameters")
    try:
        checked = check_json_schema(parameters)
    except ConstraintError as exc:
        raise ApiError(400, f"{where}.function.parameters of {function.name}: {exc}", f"{where}.function.parameters") from exc
    return Function(function.name, function.description, checked)


def plan_tools(tools: Sequence[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The request's tool plan, or None when no call may be made (no tools, or tool_choice
    "none"). `tools` are runner.schemas.ToolDefinition, `tool_choice` None, a mode string or a
    NamedToolChoice. Problems are 400s naming the field."""
    named = getattr(getattr(tool_choice, "function", None), "name", None)
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return None
    functions = tuple(_function(tool, i) for i, tool in enumerate(tools))
    names = [function.name for function in functions]
    duplicates = sorted(name for name, count in Counter(names).items() if count > 1)
    if duplicates:
        raise ApiError(400, f"tools: function names must be unique; repeated: {', '.join(duplicates)}", "tools")
    if tool_choice == "none":
        return None
    if named is not None:
        chosen = [function for function in functions if function.name == named]
        if not chosen:
            raise ApiError(400, f"tool_choice names the function {named!r}, which is not among the tools ({', '.join(names)})", "tool_choice")
        return ToolPlan(functions, tuple(chosen), "required", parallel=False)
    mode: ToolMode = "required" if tool_choice == "required" else "auto"
    return ToolPlan(functions, functions, mode, parallel=parallel_tool_calls is not False)


def render_tool_calls(tool_calls: Sequence[Mapping[str, Any]]) -> str:
    """An assistant message's earlier calls (OpenAI `tool_calls`) in the template's own form, so
    the model sees its past calls as it is asked to write them."""
    lines: list[str] = []
    for call in tool_calls:
        function = call.get("function") or {}
        arguments = function.get("arguments") or "{}"
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parsed = arguments  # a client's malformed history: shown as it was sent
        text = json.dumps(parsed, ensure_ascii=False, separators=(", ", ": "))
        lines.append(f"{TOOL_CALL_OPEN}{CALL_HEAD}{json.dumps(function.get('name', ''))}{ARGUMENTS_KEY}{text}}}{TOOL_CALL_CLOSE}")
    return CALL_SEPARATOR.join(lines)
