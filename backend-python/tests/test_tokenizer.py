"""The World tokenizer gives the official package's ids and decodes any id without raising."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from albatross.tokenizer import VOCAB_SIZE, LongestMatchEncoder, Tokenizer, get_tokenizer, normalize_text

CORPUS = (Path(__file__).parent / "data" / "tokenizer_corpus.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return get_tokenizer()


@pytest.fixture(scope="module")
def official() -> object:
    """The official rwkv package's TRIE_TOKENIZER: the definition we must reproduce."""
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER

    spec = importlib.util.find_spec("rwkv")
    assert spec is not None and spec.submodule_search_locations
    vocab = Path(list(spec.submodule_search_locations)[0]) / "rwkv_vocab_v20230424.txt"
    return TRIE_TOKENIZER(str(vocab))


def _random_texts(alphabet: Callable[[random.Random], str], count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(alphabet(rng) for _ in range(rng.randrange(1, 60))) for _ in range(count)]


INPUT_CLASSES: dict[str, Callable[[random.Random], str]] = {
    "english": lambda rng: rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:'\"!?-"),
    "cjk": lambda rng: chr(rng.choice([rng.randrange(0x4E00, 0x9FFF), rng.randrange(0x3040, 0x30FF), 0x3002, 0xFF0C])),
    "emoji": lambda rng: rng.choice(["😀", "👍", "🏽", "\u200d", "👨", "👩", "🇫", "🇷", "❤", "\ufe0f", "🤖", " "]),
    "code": lambda rng: rng.choice(["def ", "(", ")", ":", "\n    ", "return ", "x", "_", "=", "==", "{", "}", ";", "0x1F", "//"]),
    "control": lambda rng: chr(rng.randrange(0, 32)) if rng.random() < 0.7 else chr(rng.choice([0x7F, 0x85, 0xA0, 0x2028])),
    "whitespace": lambda rng: rng.choice([" ", "  ", "\t", "\n", "\n\n", " " * rng.randrange(1, 200)]),
    "crlf": lambda rng: rng.choice(["\r\n", "\r", "\n", "a", "\r\n\r\n", " "]),
    "any_bmp_and_astral": lambda rng: chr(rng.choice([rng.randrange(0x20, 0xD800), rng.randrange(0xE000, 0x110000)])),
}


def test_vocabulary_table_equals_the_official_one(tokenizer: Tokenizer, official: object) -> None:
    assert tokenizer._table == official.idx2token  # type: ignore[attr-defined]


def test_vocab_size_is_the_model_head_size(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == VOCAB_SIZE == 65536


def test_native_encoder_is_used_when_installed(tokenizer: Tokenizer) -> None:
    assert tokenizer.encoder_name == "pyrwkv_tokenizer"


def test_corpus_encodes_to_the_official_ids_line_by_line_and_whole(tokenizer: Tokenizer, official: object) -> None:
    for text in [CORPUS, *CORPUS.splitlines(keepends=True)]:
        expected = official.encode(text)  # type: ignore[attr-defined]
        assert tokenizer.encode(text) == expected, f"ids differ for {text!r}"


@pytest.mark.parametrize("input_class", sorted(INPUT_CLASSES))
def test_random_text_of_each_class_encodes_to_the_official_ids(
    tokenizer: Tokenizer, official: object, input_class: str
) -> None:
    for text in _random_texts(INPUT_CLASSES[input_class], count=150, seed=sum(map(ord, input_class))):
        assert tokenizer.encode(text) == official.encode(text), f"{input_class}: ids differ for {text!r}"  # type: ignore[attr-defined]


def test_python_fallback_encoder_equals_the_official_ids(tokenizer: Tokenizer, official: object) -> None:
    fallback = LongestMatchEncoder(tokenizer._table)
    texts = [CORPUS, *_random_texts(INPUT_CLASSES["any_bmp_and_astral"], count=200, seed=7)]
    texts += _random_texts(INPUT_CLASSES["whitespace"], count=50, seed=8)
    for text in texts:
        assert fallback.encode(text) == official.encode(text), f"ids differ for {text!r}"  # type: ignore[attr-defined]


def test_tokenizer_without_native_library_gives_the_same_ids(tokenizer: Tokenizer) -> None:
    python_only = Tokenizer(use_native=False)
    assert python_only.encoder_name == "python"
    assert python_only.encode(CORPUS) == tokenizer.encode(CORPUS)


def test_encode_batch_equals_encoding_each_text(tokenizer: Tokenizer) -> None:
    texts = CORPUS.splitlines() + ["", "a\ud800b"]
    assert tokenizer.encode_batch(texts) == [tokenizer.encode(text) for text in texts]


def test_empty_text_encodes_to_no_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("") == []


def test_corpus_round_trips_through_encode_and_decode(tokenizer: Tokenizer) -> None:
    assert tokenizer.decode(tokenizer.encode(CORPUS)) == CORPUS


def test_lone_surrogates_encode_as_the_replacement_character(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("a\ud800b\udfffc") == tokenizer.encode("a\ufffdb\ufffdc")
    assert tokenizer.encode("\ud83d") == tokenizer.encode("\ufffd")


def test_surrogate_pairs_encode_as_the_character_they_stand_for(tokenizer: Tokenizer) -> None:
    assert normalize_text("x\ud83d\ude00y") == "x😀y"
    assert tokenizer.encode("\ud83d\ude00") == tokenizer.encode("😀")


def test_every_id_in_the_head_decodes_without_raising(tokenizer: Tokenizer, official: object) -> None:
    """One id at a time and all at once, to the official vocabulary's bytes (an id it lacks: none)."""
    reference: dict[int, bytes] = official.idx2token  # type: ignore[attr-defined]
    expected = [reference.get(token_id, b"") for token_id in range(VOCAB_SIZE)]
    assert [tokenizer.decode_bytes([token_id]) for token_id in range(VOCAB_SIZE)] == expected
    assert tokenizer.decode_bytes(range(VOCAB_SIZE)) == b"".join(expected)
    assert tokenizer.decode(range(VOCAB_SIZE)) == b"".join(expected).decode("utf-8", errors="replace")


def test_undefined_ids_decode_to_no_bytes(tokenizer: Tokenizer) -> None:
    undefined = [token_id for token_id in range(VOCAB_SIZE) if not tokenizer.is_defined(token_id)]
    assert undefined == [0, 65530, 65531, 65532, 65533, 65534, 65535]
    for token_id in [*undefined, -1, 65536, 10**9]:
        assert tokenizer.decode_bytes([token_id]) == b"", f"id {token_id} decoded to bytes"
    assert tokenizer.decode([33155, 65535, 40213, 0]) == tokenizer.decode([33155, 40213])


def test_token_bytes_of_a_partial_character_are_raw_bytes(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("😀")
    assert b"".join(tokenizer.token_bytes(token_id) for token_id in ids) == "😀".encode()
    assert len(ids) > 1, "expected the emoji to span several byte tokens"
    assert tokenizer.decode(ids[:1]) == "\ufffd", "an incomplete character must decode to U+FFFD, not raise"


def test_get_tokenizer_returns_one_shared_instance() -> None:
    assert get_tokenizer() is get_tokenizer()
