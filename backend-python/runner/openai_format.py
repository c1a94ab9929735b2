"""OpenAI response shapes: non-stream choices and usage, and stream chunks (chat and text).

With tools, a chat answer is read by runner.tool_calls: calls become `message.tool_calls` (and
stream as OpenAI streams them: a delta with the call's index, id, type and name and empty
arguments, then deltas of argument fragments), and a finished answer that holds calls ends with
`finish_reason: "tool_calls"`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from runner.generation import ChoiceOutcome
from runner.interface import GenerationEvent, TokenLogprob
from runner.sse import EventTemplate, event_bytes
from runner.tool_calls import Delta, ToolCallReader

Kind = Literal["chat", "text"]


def chat_logprobs(items: Sequence[TokenLogprob]) -> dict[str, Any]:
    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(i.text, i.logprob), "top_logprobs": [entry(t, lp) for _, t, lp in i.top]} for i in items]}


def text_logprobs(items: Sequence[TokenLogprob], start_offset: int = 0) -> dict[str, Any]:
    offsets: list[int] = []
    offset = start_offset
    for item in items:
        offsets.append(offset)
        offset += len(item.text)
    return {
        "tokens": [i.text for i in items],
        "token_logprobs": [i.logprob for i in items],
        "top_logprobs": [{t: lp for _, t, lp in i.top} for i in items],
        "text_offset": offsets,
    }


def logprobs_payload(kind: Kind, items: Sequence[TokenLogprob] | None, start_offset: int = 0) -> dict[str, Any] | None:
    if items is None:
        return None
    return chat_logprobs(items) if kind == "chat" else text_logprobs(items, start_offset)


def finish_with_calls(finish_reason: str | None, reader: ToolCallReader | None) -> str | None:
    """A completed answer that holds calls finishes with "tool_calls" (a cut one keeps "length")."""
    if reader is not None and reader.calls and finish_reason == "stop":
        return "tool_calls"
    return finish_reason


def choice_payload(kind: Kind, outcome: ChoiceOutcome, tools: bool = False) -> dict[str, Any]:
    logprobs = logprobs_payload(kind, outcome.logprobs)
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": outcome.text}
        finish_reason: str | None = outcome.finish_reason
        if tools:
            reader = ToolCallReader()
            reader.feed(outcome.text)
            reader.finish()
            message["content"] = reader.content
            if reader.calls:
                message["tool_calls"] = [call.payload() for call in reader.calls]
            finish_reason = finish_with_calls(finish_reason, reader)
        return {"index": outcome.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": outcome.index, "text": outcome.text, "logprobs": logprobs, "finish_reason": outcome.finish_reason}


def usage_payload(outcomes: Sequence[ChoiceOutcome], n: int) -> dict[str, int]:
    """The n samples of a prompt share its prefill: its prompt tokens count once."""
    prompt = sum(o.prompt_tokens for o in outcomes if o.index % n == 0)
    completion = sum(o.completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class OpenAIStreamFormatter:
    """Chunks: the assistant role first (chat), text deltas, a finish chunk per choice, an
    optional usage chunk. Plain text deltas are spliced into pre-serialised templates."""

    def __init__(
        self, kind: Kind, response_id: str, created: int, model: str, indices: Sequence[int], n: int, include_usage: bool, tools: bool = False
    ) -> None:
        self.kind = kind
        self.n = n
        self.include_usage = include_usage
        self.head: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created,
            "model": model,
        }
        self.indices = list(indices)
        self.templates = {i: EventTemplate(self._chunk(i, EventTemplate.slot(), None)) for i in self.indices}
        self.outcomes = {i: ChoiceOutcome(i) for i in self.indices}
        self.text_offsets = dict.fromkeys(self.indices, 0)
        self.readers = {i: ToolCallReader() for i in self.indices} if tools and kind == "chat" else None

    def _chunk(self, index: int, text: str | None, finish_reason: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": index, "delta": {} if text is None else {"content": text}}
        else:
            choice = {"index": index, "text": text or ""}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        return {**self.head, "choices": [choice]}

    def opening(self) -> list[bytes]:
        if self.kind != "chat":
            return []
        return [event_bytes({**self.head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}) for i in self.indices]

    def event(self, index: int, event: GenerationEvent) -> bytes | None:
        if self.readers is not None:
            return self._tool_event(index, event, self.readers[index])
        out = b""
        if event.logprobs:
            payload = logprobs_payload(self.kind, event.logprobs, self.text_offsets[index])
            out = event_bytes(self._chunk(index, event.text, None, payload))
            self.text_offsets[index] += len(event.text)
        elif event.text:
            out = self.templates[index].render(event.text)
            self.text_offsets[index] += len(event.text)
        if event.finish_reason is not None:
            outcome = self.outcomes[index]
            outcome.prompt_tokens, outcome.completion_tokens = event.prompt_tokens, event.completion_tokens
            out += event_bytes(self._chunk(index, None, event.finish_reason))
        return out or None

    def _tool_event(self, index: int, event: GenerationEvent, reader: ToolCallReader) -> bytes | None:
        deltas = reader.feed(event.text) if event.text else []
        if event.finish_reason is not None:
            deltas += reader.finish()
        chunks = [self._delta_chunk(index, delta) for delta in deltas]
        logprobs = logprobs_payload(self.kind, event.logprobs, self.text_offsets[index]) if event.logprobs else None
        if logprobs is not None:
            if not chunks:
                chunks.append(self._chunk(index, None, None))
            chunks[0]["choices"][0]["logprobs"] = logprobs
        self.text_offsets[index] += len(event.text)
        if event.finish_reason is not None:
            outcome = self.outcomes[index]
            outcome.prompt_tokens, outcome.completion_tokens = event.prompt_tokens, event.completion_tokens
            chunks.append(self._chunk(index, None, finish_with_calls(event.finish_reason, reader)))
        return b"".join(event_bytes(chunk) for chunk in chunks) or None

    def _delta_chunk(self, index: int, delta: Delta) -> dict[str, Any]:
        if delta.kind == "content":
            return self._chunk(index, delta.text, None)
        assert delta.call is not None
        entry: dict[str, Any] = {"index": delta.call.index}
        if delta.kind == "call":
            entry.update(id=delta.call.id, type="function", function={"name": delta.call.name, "arguments": ""})
        else:
            entry["function"] = {"arguments": delta.text}
        chunk = self._chunk(index, None, None)
        chunk["choices"][0]["delta"] = {"tool_calls": [entry]}
        return chunk

    def closing(self) -> list[bytes]:
        if not self.include_usage:
            return []
        return [event_bytes({**self.head, "choices": [], "usage": usage_payload(list(self.outcomes.values()), self.n)})]
