"""`include_stop_str_in_output` (vLLM, conRWKV): the stop string that ended a choice stays at the
end of its text.

Backends cut a matched stop string from the text they emit; what they emit always ends exactly
where the match starts. So the stop is found again from the choice's own token ids: decode them
all, take what follows the emitted text, and pick the stop that completed first there (the
shortest one it starts with). A choice that ended on a stop token id, a length limit or an error
is left as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from runner.interface import GenerationEvent


@dataclass(slots=True)
class _Choice:
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)


class StopStringEcho:
    """A driver transform: `(choice index, event) -> event`, appending the matched stop string to
    a choice's final event."""

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]) -> None:
        self._stops = sorted(set(stops), key=len)
        self._decode = decode
        self._choices: dict[int, _Choice] = {}

    def __call__(self, index: int, event: GenerationEvent) -> GenerationEvent:
        choice = self._choices.setdefault(index, _Choice())
        choice.token_ids.extend(event.token_ids)
        choice.text.append(event.text)
        if event.finish_reason != "stop":
            return event
        del self._choices[index]
        matched = self.matched_stop(self._decode(choice.token_ids), "".join(choice.text))
        if matched:
            event.text += matched
        return event

    def matched_stop(self, generated: str, emitted: str) -> str | None:
        if not generated.startswith(emitted):
            return None
        rest = generated[len(emitted) :]
        return next((stop for stop in self._stops if rest.startswith(stop)), None)
