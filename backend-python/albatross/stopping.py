"""Whether a generated token ends its request, and the text it adds: the one decision that every
backend (the engine's workers, the classic backend) makes for each token.

In order: a stop token id ends the request (`stop`; counted as generated, not part of the text);
a completed stop string ends it (`stop`; no part of the stop is emitted); an output grammar that
allows nothing more ends it (`stop`, with the held-back text); reaching `max_tokens` ends it
(`length`, or `stop` when the held-back text completes a stop string at the flush).
"""

from __future__ import annotations

from collections.abc import Container
from typing import Literal, NamedTuple

from albatross.detokenizer import TextStream

StopReason = Literal["stop", "length"]


class TokenOutcome(NamedTuple):
    text: str  # the text delta to emit now
    finish_reason: StopReason | None  # None: the request goes on
    stop_token: bool  # the token was a stop token id: it ends the request and adds no text


def accept_token(
    stream: TextStream, token: int, stop_token_ids: Container[int], generated: int, max_tokens: int, grammar_complete: bool = False
) -> TokenOutcome:
    """`token` is the request's `generated`-th token (counting it); `stream` has seen the ones before.
    `grammar_complete`: the request's output constraint, advanced by `token`, allows nothing more."""
    if token in stop_token_ids:
        return TokenOutcome(stream.flush(), "stop", True)
    text, stopped = stream.push_token(token)
    if stopped:
        return TokenOutcome(text, "stop", False)
    if grammar_complete:
        return TokenOutcome(text + stream.flush(), "stop", False)
    if generated >= max_tokens:
        text += stream.flush()
        return TokenOutcome(text, "stop" if stream.stopped else "length", False)
    return TokenOutcome(text, None, False)
