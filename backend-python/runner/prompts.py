"""Prompt templates: OpenAI chat messages to the runner's RWKV chat prompt, and stop lists."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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

ROLE_NAMES: dict[str, str] = {
    "system": "System",
    "developer": "System",
    "user": "User",
    "assistant": "Assistant",
    "tool": "Observation",
}

ASSISTANT_PREFIX = "Assistant:"


def chat_prompt(messages: Iterable[tuple[str, str | None]], assistant_prefix: str = ASSISTANT_PREFIX) -> str:
    """`"{Role}: {content}\\n\\n"` per (role, text) message, then the assistant's turn header.

    An assistant message without text (an OpenAI tool-call turn) adds nothing."""
    parts: list[str] = []
    for role, text in messages:
        if text is None:
            continue
        parts.append(f"{ROLE_NAMES[role]}: {text}\n\n")
    parts.append(assistant_prefix)
    return "".join(parts)


def stop_list(stop: str | Sequence[str] | None, default: Sequence[str] = ()) -> tuple[str, ...]:
    """A request's `stop` as a tuple; None means the default list."""
    if stop is None:
        return tuple(default)
    if isinstance(stop, str):
        return (stop,)
    return tuple(stop)
