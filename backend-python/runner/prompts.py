"""Prompt templates: RWKV-Runner's chat template (its `chat_template` for RWKV-5 and later) and
its stop lists.

    User: hi\\n\\nAssistant: Hi. I am your assistant ...\\n\\n     (only with `presystem`)
    {system}: {content}\\n\\n                                  (system and developer messages)
    {user}: {content}\\n\\n
    {assistant}: {content}\\n\\n
    {assistant}: {name}\\n```python\\ntool_call("k"="v", ...)\\n```\\n\\n  (an assistant tool call)
    Observation: {content}\\n\\n                               (tool results)
    {assistant}:                                             (the generation prompt)

The names default to User / Assistant / System and follow the request's `user_name`,
`assistant_name` and `system_name`. A last assistant message with `prefix: true` is left open (no
separator, no generation prompt): the model continues it. Contents are used as they are; the
Runner's `raw` flag only changes its pre-RWKV-5 template, so it changes nothing here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# The runner's default chat stops: any new turn header ends the assistant's turn.
DEFAULT_CHAT_STOPS: tuple[str, ...] = (
    "\n\nUser",
    "\n\nQuestion",
    "\n\nQ",
    "\n\nHuman",
    "\n\nBob",
    "\n\nAssistant",
    "\n\nAnswer",
    "\n\nA",
    "\n\nBot",
    "\n\nAlice",
    "\n\nObservation",
)

NAME_SEPARATOR = ":"  # the Runner's `interface`
TOOL_RESULT_NAME = "Observation"
PRESYSTEM_ASSISTANT_INTRO = (
    "Hi. I am your assistant and I will provide expert full response in full details. "
    "Please feel free to ask any question and I will always answer it."
)
TURN_SEPARATOR = "\n\n"


@dataclass(frozen=True, slots=True)
class ChatNames:
    user: str = "User"
    assistant: str = "Assistant"
    system: str = "System"

    def __post_init__(self) -> None:
        if not (self.user and self.assistant and self.system):
            raise ValueError("chat names must not be empty")


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, object]


@dataclass(frozen=True, slots=True)
class ChatTurn:
    role: str  # system, developer, user, assistant, tool
    text: str | None
    tool_call: ToolCall | None = None  # an assistant turn that called a tool
    prefix: bool = False  # an assistant turn the model continues (only honoured last)


def tool_call_text(call: ToolCall) -> str:
    """How the Runner writes a tool call into the history: the arguments as `"k"="v"` pairs."""
    arguments = ", ".join(f'"{key}"="{value}"' for key, value in call.arguments.items())
    return f"{call.name}\n```python\ntool_call({arguments})\n```"


def parse_tool_arguments(arguments: str) -> dict[str, object]:
    """A tool call's `arguments` (a JSON object in text); ValueError when it is not one."""
    value = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(value, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return value


def _header(name: str) -> str:
    return f"{name}{NAME_SEPARATOR} "


def runner_chat_template(turns: Sequence[ChatTurn], names: ChatNames = ChatNames(), presystem: bool = False, add_generation_prompt: bool = True) -> str:
    """The Runner's chat prompt for `turns` (see the module doc)."""
    parts: list[str] = []
    if presystem:
        parts.append(f"{_header(names.user)}hi{TURN_SEPARATOR}{_header(names.assistant)}{PRESYSTEM_ASSISTANT_INTRO}{TURN_SEPARATOR}")
    open_prefix = False
    for index, turn in enumerate(turns):
        if turn.role in ("system", "developer"):
            text = _header(names.system) + (turn.text or "")
        elif turn.role == "user":
            text = _header(names.user) + (turn.text or "")
        elif turn.role == "tool":
            text = _header(TOOL_RESULT_NAME) + (turn.text or "")
        elif turn.tool_call is not None:
            text = _header(names.assistant) + tool_call_text(turn.tool_call)
        elif turn.text is None:
            continue  # an assistant turn without content adds nothing
        else:
            text = _header(names.assistant) + turn.text
        open_prefix = turn.role == "assistant" and turn.prefix and index == len(turns) - 1
        parts.append(text if open_prefix else text + TURN_SEPARATOR)
    if not open_prefix and add_generation_prompt:
        parts.append(names.assistant + NAME_SEPARATOR)
    return "".join(parts)


def chat_prompt(messages: Sequence[tuple[str, str | None]]) -> str:
    """The template for plain (role, text) messages with the default names."""
    return runner_chat_template([ChatTurn(role, text) for role, text in messages])


def name_stop(name: str, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]) -> str:
    """`"\\n\\n"` + the text of the name's first token, as the Runner stops a turn (a name whose
    first token is not a whole character stops at the whole name instead)."""
    tokens = encode(name)
    first = decode(tokens[:1]) if tokens else name
    return TURN_SEPARATOR + (first if first and "\ufffd" not in first else name)


def chat_stops(stop: str | Sequence[str] | None, names: ChatNames, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]) -> tuple[str, ...]:
    """The Runner's stops of a chat: the request's `stop` (the default list when it has none),
    then the stops of the user's and the assistant's names, which a request's `stop` adds to."""
    chosen = stop_list(stop, DEFAULT_CHAT_STOPS)
    extra = (name_stop(names.user, encode, decode), name_stop(names.assistant, encode, decode))
    return tuple(dict.fromkeys((*chosen, *extra)))


def stop_list(stop: str | Sequence[str] | None, default: Sequence[str] = ()) -> tuple[str, ...]:
    """A request's `stop` as a tuple; None means the default list."""
    if stop is None:
        return tuple(default)
    if isinstance(stop, str):
        return (stop,)
    return tuple(stop)
