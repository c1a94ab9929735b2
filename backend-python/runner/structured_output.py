"""What a completion body asks of its output's shape: `response_format` and `tools` become one
`OutputConstraint` (the grammar the backend enforces) and, for tools, the `ToolPlan` that shapes
the prompt and the reply. Every problem is a 400 naming the field; nothing is dropped silently."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from albatross.constraints import JSON_OBJECT_SCHEMA, ConstraintError, json_schema_grammar
from runner.errors import ApiError
from runner.interface import OutputConstraint
from runner.schemas import ChatCompletionRequest, ChatMessage, ResponseFormat, SamplingFields
from runner.tools import ToolPlan, plan_tools


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    constraint: OutputConstraint | None = None
    tools: ToolPlan | None = None  # the reply may hold tool calls


UNCONSTRAINED = StructuredOutput()
Body = TypeVar("Body", bound=SamplingFields)


def _response_format(response_format: ResponseFormat | None) -> OutputConstraint | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return OutputConstraint(json_schema_grammar(JSON_OBJECT_SCHEMA), "response_format json_object")
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise ApiError(400, "response_format.json_schema.schema is required for type json_schema", "response_format.json_schema.schema")
    try:
        grammar = json_schema_grammar(spec.json_schema)
    except ConstraintError as exc:
        raise ApiError(400, f"response_format.json_schema.schema: {exc}", "response_format.json_schema.schema") from exc
    return OutputConstraint(grammar, "response_format json_schema")


def completion_output(body: SamplingFields) -> StructuredOutput:
    constraint = _response_format(body.response_format)
    return UNCONSTRAINED if constraint is None else StructuredOutput(constraint)


def chat_output(body: ChatCompletionRequest) -> StructuredOutput:
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    constraint = _response_format(body.response_format)
    if tools is None:
        return UNCONSTRAINED if constraint is None else StructuredOutput(constraint)
    if constraint is not None:
        raise ApiError(400, "response_format together with callable tools is not supported; send one of them", "response_format")
    return StructuredOutput(OutputConstraint(tools.grammar(), "tools"), tools)


async def read_off_loop(read: Callable[[Body], StructuredOutput], body: Body) -> StructuredOutput:
    """`read(body)` (chat_output or completion_output) without holding up the event loop: llguidance
    reads a client's schema in milliseconds, but a large one takes seconds (10,000 properties:
    2.5 s) with the GIL released, so on a worker thread the loop keeps every other stream going. A
    body without a schema to read is answered at once."""
    has_schema = bool(getattr(body, "tools", None)) or (body.response_format is not None and body.response_format.type == "json_schema")
    return await asyncio.to_thread(read, body) if has_schema else read(body)


def with_tools_prompt(body: ChatCompletionRequest, output: StructuredOutput) -> ChatCompletionRequest:
    """The body whose messages start with the tools' System turn (the prompt builders then place
    it as they place any system message)."""
    if output.tools is None:
        return body
    system = ChatMessage(role="system", content=output.tools.system_prompt())
    return body.model_copy(update={"messages": [system, *body.messages]})
