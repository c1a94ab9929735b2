"""Streaming text for one request: token ids -> UTF-8-safe text -> text cut at stop strings.

`IncrementalDecoder` turns token ids into text without ever splitting a character: the bytes of an
incomplete UTF-8 sequence wait for the next token, and an invalid sequence becomes U+FFFD as soon
as no continuation can complete it. The concatenated output equals
`all_bytes.decode("utf-8", "replace")` however the ids are split into pushes.

`StopMatcher` sees only generated text (a stop string inside the prompt is irrelevant). It holds
back the longest suffix that could still grow into a stop string. The stop that fires is the one
that completes first (earliest end; on a tie the earliest start), which is what one-character
pushes would give, so the result does not depend on how the text was split into pushes.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Sequence
from typing import Protocol


class TokenBytes(Protocol):
    def decode_bytes(self, token_ids: Iterable[int]) -> bytes: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class IncrementalDecoder:
    """Token ids in, complete characters out."""

    __slots__ = ("_tokenizer", "_utf8")

    def __init__(self, tokenizer: TokenBytes) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Iterable[int]) -> str:
        return self._utf8.decode(self._tokenizer.decode_bytes(token_ids), final=False)

    def push_token(self, token_id: int) -> str:
        """`push((token_id,))`, faster: a token whose bytes are whole characters, with nothing
        pending, decodes directly (the incremental decoder would return the same text)."""
        data = self._tokenizer.token_bytes(token_id)
        if not self._utf8.buffer:  # a codecs.BufferedIncrementalDecoder
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError:
                pass
        return self._utf8.decode(data, final=False)

    def flush(self) -> str:
        """End of stream: bytes of a sequence that never completed become U+FFFD."""
        return self._utf8.decode(b"", final=True)

    @property
    def pending_bytes(self) -> bytes:
        return self._utf8.getstate()[0]


def _failure_function(stop: str) -> list[int]:
    """KMP: entry i is the length of the longest proper prefix of stop[: i + 1] that is also its suffix."""
    failure = [0] * len(stop)
    matched = 0
    for i in range(1, len(stop)):
        while matched and stop[i] != stop[matched]:
            matched = failure[matched - 1]
        if stop[i] == stop[matched]:
            matched += 1
        failure[i] = matched
    return failure


class StopMatcher:
    """Text in, text safe to emit out; finishes at the first stop string.

    Each stop has a Knuth-Morris-Pratt state: how many of its first characters end the text seen so
    far. Memory is linear in the stops' lengths and every character costs amortised O(1) per stop
    (a table of every prefix was quadratic: one 1 MB stop string took the process down). The held
    text is the longest such state; while nothing is held, text up to the first character that can
    start a stop is passed through without stepping any state."""

    __slots__ = ("_stops", "_failures", "_states", "_starters", "_held", "finished")

    def __init__(self, stops: Sequence[str]) -> None:
        if any(stop == "" for stop in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._failures = [_failure_function(stop) for stop in self._stops]
        self._states = [0] * len(self._stops)
        self._starters = re.compile("[" + "".join(re.escape(c) for c in {stop[0] for stop in self._stops}) + "]") if self._stops else None
        self._held = ""
        self.finished = False

    @property
    def held(self) -> str:
        return self._held

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text to emit now, whether a stop matched). After a match it returns ("", True)."""
        if self.finished:
            return "", True
        if self._starters is None:
            return text, False
        held = self._held
        begin = 0
        if not held:
            first = self._starters.search(text)
            if first is None:
                return text, False
            begin = first.start()
        buffer = held + text
        stops, failures, states = self._stops, self._failures, self._states
        for position in range(len(held) + begin, len(buffer)):
            char = buffer[position]
            longest_match = 0
            for k, stop in enumerate(stops):
                matched = states[k]
                while matched and stop[matched] != char:
                    matched = failures[k][matched - 1]
                if stop[matched] == char:
                    matched += 1
                    if matched == len(stop):
                        longest_match = max(longest_match, matched)
                        matched = failures[k][matched - 1]
                states[k] = matched
            if longest_match:  # the first stop to complete; on a tie the longest (earliest start)
                self._held = ""
                self.finished = True
                return buffer[: position + 1 - longest_match], True
        keep = max(states)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """End of generation without a match: the held text is ordinary text after all."""
        held, self._held = self._held, ""
        self._states = [0] * len(self._stops)
        return "" if self.finished else held


class TextStream:
    """One request's token ids -> (text delta, stopped), UTF-8 safe and cut at stop strings."""

    __slots__ = ("_decoder", "_matcher")

    def __init__(self, tokenizer: TokenBytes, stops: Sequence[str] = ()) -> None:
        self._decoder = IncrementalDecoder(tokenizer)
        self._matcher = StopMatcher(stops)

    @property
    def stopped(self) -> bool:
        return self._matcher.finished

    def push(self, token_ids: Iterable[int]) -> tuple[str, bool]:
        if self._matcher.finished:
            return "", True
        return self._matcher.push(self._decoder.push(token_ids))

    def push_token(self, token_id: int) -> tuple[str, bool]:
        """`push((token_id,))`: the engine's per-token call, kept cheap (it runs for every row of
        every step on the worker thread)."""
        if self._matcher.finished:
            return "", True
        return self._matcher.push(self._decoder.push_token(token_id))

    def flush(self) -> str:
        """End of generation: the last incomplete bytes (as U+FFFD) and any held text. The decoder's
        tail can still complete a stop string; then `stopped` turns True and the text is cut."""
        if self._matcher.finished:
            return ""
        text, stopped = self._matcher.push(self._decoder.flush())
        return text if stopped else text + self._matcher.flush()
