"""RWKV-Runner's `global_penalty`: the prompt's tokens count in the presence and frequency
penalties as if the model had generated them, so a reply avoids repeating its prompt.

As in the Runner, single-character tokens of punctuation, digits, spaces and newlines are left
out (its AVOID_PENALTY list): penalising them would push the model off ordinary punctuation.
"""

from __future__ import annotations

from collections.abc import Sequence

from runner.interface import AbstractRWKV

UNPENALIZED_CHARACTERS = '\n,.:?!，。：？！"“”<>[]{}/\\|;；~`@#$%^&*()_+-=0123456789 '


def unpenalized_ids(backend: AbstractRWKV) -> frozenset[int]:
    """The ids of the characters above that are one token each in the backend's vocabulary."""
    ids: set[int] = set()
    for character in UNPENALIZED_CHARACTERS:
        tokens = backend.encode(character)
        if len(tokens) == 1:
            ids.add(tokens[0])
    return frozenset(ids)


def penalized_prompt_ids(prompt_tokens: Sequence[int], backend: AbstractRWKV) -> list[int]:
    """The prompt's ids, in order, that count in the penalties of its reply."""
    exempt = unpenalized_ids(backend)
    return [token for token in prompt_tokens if token not in exempt]
