"""Reading tool calls out of an answer as it streams (the grammar of runner/tools.py fixed its shape).

`ToolCallReader.feed(text)` returns what the new text adds: content text, the start of a call
(its id and name), or a fragment of a call's arguments. The same reader serves streams (each
delta as OpenAI sends it: index, id and name first, then argument fragments) and whole replies
(feed everything, then `finish()`), so both read an answer identically.

An answer is undecided while it could still become `<tool_call>` (after at most one space): that
much text is held back. Text that cannot start a call is content from then on.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Literal

from runner.tools import ARGUMENTS_KEY, CALL_HEAD, CALL_SEPARATOR, TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(slots=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def payload(self) -> dict[str, object]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Delta:
    kind: Literal["content", "call", "arguments"]
    text: str = ""  # content, or an arguments fragment
    call: ToolCall | None = None  # the call a "call" or "arguments" delta belongs to


_State = Literal["lead", "text", "head", "arguments", "tail"]


@dataclass(slots=True)
class ToolCallReader:
    calls: list[ToolCall] = field(default_factory=list)
    content_parts: list[str] = field(default_factory=list)
    _state: _State = "lead"
    _pending: str = ""
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    @property
    def content(self) -> str | None:
        return "".join(self.content_parts) if self.content_parts or not self.calls else None

    def feed(self, text: str) -> list[Delta]:
        deltas: list[Delta] = []
        self._pending += text
        while self._pending:
            before = (self._state, len(self._pending))
            getattr(self, f"_read_{self._state}")(deltas)
            if (self._state, len(self._pending)) == before:
                break  # needs more text
        return deltas

    def finish(self) -> list[Delta]:
        """The end of the answer: undecided text is content; a call cut short stays incomplete."""
        deltas: list[Delta] = []
        if self._state in ("lead", "text") and self._pending:
            self._content(self._pending, deltas)
        elif self._state == "head" and self._pending and not self.calls:
            self._content(TOOL_CALL_OPEN + self._pending, deltas)
        self._pending = ""
        return deltas

    def _content(self, text: str, deltas: list[Delta]) -> None:
        self.content_parts.append(text)
        deltas.append(Delta("content", text))

    def _read_lead(self, deltas: list[Delta]) -> None:
        candidate = self._pending[1:] if self._pending.startswith(" ") else self._pending
        if candidate.startswith(TOOL_CALL_OPEN):
            self._pending = candidate[len(TOOL_CALL_OPEN) :]
            self._state = "head"
        elif not TOOL_CALL_OPEN.startswith(candidate):
            self._state = "text"

    def _read_text(self, deltas: list[Delta]) -> None:
        self._content(self._pending, deltas)
        self._pending = ""

    def _read_head(self, deltas: list[Delta]) -> None:
        if not self._pending.startswith(CALL_HEAD):
            if not CALL_HEAD.startswith(self._pending):
                self._state = "text"  # not our grammar's output (a stop string cut it): keep it readable
                self._pending = TOOL_CALL_OPEN + self._pending
            return
        end = self._pending.find(ARGUMENTS_KEY, len(CALL_HEAD))
        if end < 0:
            return
        name = json.loads(self._pending[len(CALL_HEAD) : end])
        call = ToolCall(len(self.calls), new_call_id(), name)
        self.calls.append(call)
        deltas.append(Delta("call", call=call))
        self._pending = self._pending[end + len(ARGUMENTS_KEY) :]
        self._state, self._depth, self._in_string, self._escaped = "arguments", 0, False, False

    def _read_arguments(self, deltas: list[Delta]) -> None:
        call = self.calls[-1]
        end = None
        for position, char in enumerate(self._pending):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = position + 1
                    break
        fragment = self._pending if end is None else self._pending[:end]
        call.arguments += fragment
        deltas.append(Delta("arguments", fragment, call))
        self._pending = "" if end is None else self._pending[end:]
        if end is not None:
            call.complete = True
            self._state = "tail"

    def _read_tail(self, deltas: list[Delta]) -> None:
        closing = "}" + TOOL_CALL_CLOSE
        following = closing + CALL_SEPARATOR + TOOL_CALL_OPEN
        if self._pending.startswith(following):
            self._pending = self._pending[len(following) :]
            self._state = "head"
        elif len(self._pending) > len(closing) and not following.startswith(self._pending):
            self._pending = self._pending[len(closing) :] if self._pending.startswith(closing) else self._pending
            self._state = "text"  # after the calls only the end can follow in our grammar
