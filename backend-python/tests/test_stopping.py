"""albatross/stopping.py: the one per-token end-of-request decision both backends use."""

from __future__ import annotations

import pytest

from albatross.detokenizer import TextStream
from albatross.stopping import TokenOutcome, accept_token
from albatross.tokenizer import Tokenizer, get_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return get_tokenizer()


def byte_ids(text: str) -> list[int]:
    return [byte + 1 for byte in text.encode()]  # World ids 1..256 are the single bytes


def run(tokenizer: Tokenizer, tokens: list[int], stops: tuple[str, ...] = (), stop_ids: tuple[int, ...] = (), max_tokens: int = 100) -> list[TokenOutcome]:
    """Outcomes token by token, up to and including the one that ends the request."""
    stream = TextStream(tokenizer, stops)
    outcomes: list[TokenOutcome] = []
    for generated, token in enumerate(tokens, start=1):
        outcomes.append(accept_token(stream, token, stop_ids, generated, max_tokens))
        if outcomes[-1].finish_reason is not None:
            break
    return outcomes


def test_ordinary_tokens_add_their_text_and_go_on(tokenizer: Tokenizer) -> None:
    outcomes = run(tokenizer, byte_ids("abc"))
    assert outcomes == [TokenOutcome("a", None, False), TokenOutcome("b", None, False), TokenOutcome("c", None, False)]


def test_a_stop_token_ends_with_stop_and_flushes_held_text_without_its_own(tokenizer: Tokenizer) -> None:
    outcomes = run(tokenizer, [*byte_ids("ab"), 0, *byte_ids("cd")], stops=("bx",), stop_ids=(0,))
    assert [o.text for o in outcomes] == ["a", "", "b"], "'b' is held as a possible start of 'bx', then flushed"
    assert outcomes[-1] == TokenOutcome("b", "stop", True)


def test_a_completed_stop_string_ends_with_stop_and_emits_no_part_of_it(tokenizer: Tokenizer) -> None:
    outcomes = run(tokenizer, byte_ids("hi END more"), stops=("END",))
    assert "".join(o.text for o in outcomes) == "hi "
    assert outcomes[-1].finish_reason == "stop" and not outcomes[-1].stop_token
    assert len(outcomes) == len("hi END"), "the token completing the stop ends the request"


def test_max_tokens_ends_with_length_and_flushes_held_text(tokenizer: Tokenizer) -> None:
    outcomes = run(tokenizer, byte_ids("abE"), stops=("EN",), max_tokens=3)
    assert [o.text for o in outcomes] == ["a", "b", "E"]
    assert outcomes[-1] == TokenOutcome("E", "length", False)


def test_max_tokens_on_a_split_character_flushes_it_as_a_replacement(tokenizer: Tokenizer) -> None:
    first_byte = byte_ids("é")[0]
    assert run(tokenizer, [first_byte], max_tokens=1) == [TokenOutcome("\ufffd", "length", False)]


def test_a_complete_grammar_ends_with_stop_and_flushes_held_text_before_max_tokens(tokenizer: Tokenizer) -> None:
    stream = TextStream(tokenizer, ("}x",))
    assert accept_token(stream, byte_ids("{")[0], (0,), 1, 2) == TokenOutcome("{", None, False)
    assert accept_token(stream, byte_ids("}")[0], (0,), 2, 2, grammar_complete=True) == TokenOutcome("}", "stop", False), "stop, not length"
