"""From a request's prompts to the jobs the generation driver runs, for every completion route.

Long prompts are encoded in a thread: tokenizing a 3 MiB prompt takes ~57 ms, which on the event
loop would stall every other stream for as long. Short ones are encoded on the loop (a 200-word
prompt takes ~16 us): a thread hop sends the request to the back of the loop's queue, so in a
burst no request reached the engine before every other one had reached its own hop (the wave-1
burst on the simulated device: the first of 960 submitted 1.2 s after the clients sent, all of
them within the 0.13 s after that; docs/performance.md, "Session 26").

An empty prompt from a zero state becomes END_OF_TEXT_TOKEN alone: RWKV World documents begin
after token 0, so the model writes a new document, which is what OpenAI documents for an empty
prompt. After a loaded state an empty prompt stays empty: the state already holds the
conversation (the backend decides whether there is anything to generate from).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from runner.errors import ApiError
from runner.generation import ChoiceJob
from runner.interface import END_OF_TEXT_TOKEN, AbstractRWKV, GenerationRequest, OutputConstraint, SamplingParams, StateRef

# Prompts of at most this many characters in all are encoded on the event loop. With the pinned
# Rust encoder 32 KiB takes ~0.4 ms of mixed English text and ~2 ms of random characters up to
# U+3000 (this machine's CPU), a stall that streams decoding at ~36 ms a token (a full batch) do
# not notice.
INLINE_ENCODE_CHARS = 32_768


def check_max_tokens(max_tokens: int, cap: int) -> None:
    if max_tokens > cap:
        raise ApiError(400, f"max_tokens {max_tokens} exceeds the server cap of {cap} (--max-tokens)", "max_tokens")


def check_item_count(count: int, cap: int, field_name: str, what: str = "prompts") -> None:
    """A request's generations (prompts, or prompts times `n`) against --max-batch-items."""
    if count == 0:
        raise ApiError(400, f"{field_name} must hold at least one prompt", field_name)
    if count > cap:
        raise ApiError(400, f"{count} {what} exceed the server cap of {cap} per request (--max-batch-items)", field_name)


async def encode_prompts(
    backend: AbstractRWKV, prompts: Sequence[str], prompt_cap: int, field_name: str, state: StateRef | None = None
) -> list[list[int]]:
    """Token ids of every prompt, computed off the event loop; a prompt over the cap is a 400."""
    continues_state = state is not None and state.load_key is not None
    empty = [] if continues_state else [END_OF_TEXT_TOKEN]

    def encode_all() -> list[list[int]]:
        return [backend.encode(prompt) if prompt else list(empty) for prompt in prompts]

    inline = sum(len(prompt) for prompt in prompts) <= INLINE_ENCODE_CHARS
    encoded = encode_all() if inline else await asyncio.to_thread(encode_all)
    for index, tokens in enumerate(encoded):
        if len(tokens) > prompt_cap:
            name = "the prompt" if len(encoded) == 1 else f"prompt {index}"
            raise ApiError(400, f"{name} has {len(tokens)} tokens, over the server cap of {prompt_cap} (--max-prompt-tokens)", field_name)
    return encoded


def build_jobs(
    prompts: Sequence[list[int]],
    sampling: SamplingParams,
    request_id: str,
    state: StateRef | None = None,
    n: int = 1,
    constraint: OutputConstraint | None = None,
    penalized: Sequence[list[int]] | None = None,
) -> list[ChoiceJob]:
    """Choice `p * n + j` is sample j of prompt p; sample j uses seed + j, so a seeded request
    returns the same choices whatever else runs. Each job gets its own copy of `state`.
    `penalized[p]`: prompt p's ids that count in the penalties from the start (global_penalty)."""
    jobs: list[ChoiceJob] = []
    for p, tokens in enumerate(prompts):
        for j in range(n):
            seeded = sampling if sampling.seed is None or j == 0 else dataclasses.replace(sampling, seed=sampling.seed + j)
            index = p * n + j
            row_state = None if state is None else dataclasses.replace(state)
            request = GenerationRequest(list(tokens), seeded, f"{request_id}-{index}", row_state, constraint)
            if penalized is not None:
                request.penalized_prompt_ids = list(penalized[p])
            jobs.append(ChoiceJob(index, request))
    return jobs
