"""llguidance's view of the vocabulary (albatross/grammar_vocabulary.py): the native encoder is the
RWKV World encoding, masks built on it are the masks the Python tokenizer gives, and filling them
never calls back into Python."""

from __future__ import annotations

import ctypes
import logging
import random

import llguidance
import numpy as np
import pytest

from albatross import grammar_vocabulary
from albatross.constraints import MASK_WORDS, allowed_ids, json_schema_grammar
from albatross.grammar_vocabulary import END_OF_TEXT, GrammarVocabulary, build_grammar_vocabulary, native_encoder, pack_trie, vocabulary_bytes
from albatross.tokenizer import LongestMatchEncoder, Tokenizer, get_tokenizer, read_vocab

pytestmark = pytest.mark.skipif(native_encoder() is None, reason="numba is not installed")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "role": {"enum": ["administrator", "user", "guest"]},
        "note": {"const": "fixed text, forced whole: ünïcode 中文 too"},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    },
    "required": ["name", "role", "note", "scores"],
    "additionalProperties": False,
}
ALPHABET = list("abcdefghij klmnopXYZ{}[]\":,.0123456789\\/") + ["中", "文字", "é", "😀", "\n", "\r\n", "  ", "\t", "ü", "ǅ", "ꙮ", "\x00", "\x7f", "\u200b"]


class _CountingTokenizer:
    """The project tokenizer, counting how often anything asks it to encode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.vocab_path = tokenizer.vocab_path
        self.encodes = 0

    def token_bytes(self, token_id: int) -> bytes:
        return self._tokenizer.token_bytes(token_id)

    def encode(self, text: str) -> list[int]:
        self.encodes += 1
        return self._tokenizer.encode(text)


@pytest.fixture(scope="module")
def native() -> GrammarVocabulary:
    built = build_grammar_vocabulary(get_tokenizer())
    assert built.native
    return built


@pytest.fixture(scope="module")
def reference() -> LongestMatchEncoder:
    return LongestMatchEncoder(read_vocab(get_tokenizer().vocab_path))


def _random_text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(length))


def test_native_encoding_is_the_rwkv_encoding_on_random_text(native: GrammarVocabulary) -> None:
    tokenizer = get_tokenizer()
    rng = random.Random(11)
    for _ in range(3000):
        text = _random_text(rng, rng.randint(1, 80))
        assert native.tokenizer.tokenize_str(text) == tokenizer.encode(text), repr(text)
    long_text = _random_text(rng, 6000)
    assert native.tokenizer.tokenize_str(long_text) == tokenizer.encode(long_text)


def test_native_encoding_of_random_bytes(native: GrammarVocabulary, reference: LongestMatchEncoder) -> None:
    """UTF-8 bytes encode as the RWKV encoding does. Bytes that are not UTF-8 llguidance splits
    into valid and invalid runs and encodes run by run (its own greedy walk for the invalid ones),
    with the Python tokenizer as with ours: both vocabularies agree there too."""
    python = build_grammar_vocabulary(get_tokenizer(), native=False)
    rng = random.Random(12)
    for _ in range(2000):
        data = bytes(rng.randrange(256) for _ in range(rng.randint(1, 48)))
        assert native.tokenizer.tokenize_bytes(data) == python.tokenizer.tokenize_bytes(data), data
    for _ in range(500):
        data = _random_text(rng, rng.randint(1, 40)).encode()
        assert native.tokenizer.tokenize_bytes(data) == reference.encode_bytes(data), data


def test_encoder_contract_through_its_c_pointer(native: GrammarVocabulary, reference: LongestMatchEncoder) -> None:
    """The C function itself: ids and their count, minus the count when the room is too small,
    nothing for empty text."""
    encoder = native_encoder()
    assert encoder is not None and native.trie is not None
    call = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32, ctypes.c_bool, ctypes.c_bool)(encoder.address)
    data = "Hello, 世界! {\"key\": [1, 2]} \x01\xff".encode()
    expected = reference.encode_bytes(data)
    out = (ctypes.c_int32 * 64)()
    assert call(native.trie.ctypes.data, data, len(data), out, 64, False, False) == len(expected)
    assert list(out[: len(expected)]) == expected
    small = (ctypes.c_int32 * 2)()
    assert call(native.trie.ctypes.data, data, len(data), small, 2, False, False) == -len(expected)
    assert list(small) == expected[:2]  # what fits is written
    assert call(native.trie.ctypes.data, b"", 0, out, 64, False, False) == 0


def test_packed_trie_leaves_out_skipped_and_empty_rows() -> None:
    rows = [b"<eos>", b"a", b"ab", b"", b"b", b"abc"]
    packed = pack_trie(rows)
    nodes = int(packed[1])
    assert nodes == 1 + 3 + 1  # root, a, ab, abc, b: no node for id 0's text
    node_token = packed[int(packed[5]) :]
    assert sorted(int(t) for t in node_token if t >= 0) == [1, 2, 4, 5]


def test_masks_are_the_python_tokenizers_masks(native: GrammarVocabulary) -> None:
    """The same grammar walked by random allowed tokens under both vocabularies: every mask equal,
    and the forced text in it (keys, separators, the const) tokenized the same way."""
    python = build_grammar_vocabulary(get_tokenizer(), native=False)
    assert not python.native
    grammar = llguidance.LLMatcher.grammar_from_lark(json_schema_grammar(SCHEMA))
    for seed in range(6):
        rng = random.Random(seed)
        ours, theirs = llguidance.LLMatcher(native.tokenizer, grammar), llguidance.LLMatcher(python.tokenizer, grammar)
        row, other = np.zeros(MASK_WORDS, np.int32), np.zeros(MASK_WORDS, np.int32)
        for _ in range(200):
            ours.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            theirs.unsafe_compute_mask_ptr(other.ctypes.data, other.nbytes)
            assert np.array_equal(row, other)
            assert ours.compute_ff_tokens() == theirs.compute_ff_tokens()
            ids = allowed_ids(row)
            token_id = int(rng.choice(ids[ids != END_OF_TEXT].tolist() or [END_OF_TEXT]))
            assert ours.consume_token(token_id) and theirs.consume_token(token_id)
            if token_id == END_OF_TEXT or ours.is_stopped():
                break
        assert ours.is_accepting() == theirs.is_accepting()


def test_filling_masks_never_calls_python() -> None:
    """Masks over forced text, filled in parallel: the native vocabulary asks the Python tokenizer
    nothing, the Python one asks it at every forced stretch (so the count can tell them apart)."""
    grammar = llguidance.LLMatcher.grammar_from_lark(json_schema_grammar(SCHEMA))
    counts = {}
    for native in (True, False):
        counting = _CountingTokenizer(get_tokenizer())
        built = build_grammar_vocabulary(counting, native=native)  # type: ignore[arg-type]
        matchers = [llguidance.LLMatcher(built.tokenizer, grammar) for _ in range(8)]
        out = np.zeros((len(matchers), MASK_WORDS), np.int32)
        executor = llguidance.LLExecutor(num_threads=2)
        rng = random.Random(5)
        before = counting.encodes
        for _ in range(40):
            executor.unsafe_compute_mask_ptr([(m, n) for n, m in enumerate(matchers)], out.ctypes.data, MASK_WORDS * 4, len(matchers))
            for n, matcher in enumerate(matchers):
                ids = allowed_ids(out[n])
                if not matcher.is_stopped():
                    matcher.consume_token(int(rng.choice(ids[ids != END_OF_TEXT].tolist() or [END_OF_TEXT])))
        counts[native] = counting.encodes - before
    assert counts[True] == 0
    assert counts[False] > 0


def test_without_numba_the_python_tokenizer_serves(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(grammar_vocabulary, "native_encoder", lambda: None)
    with caplog.at_level(logging.WARNING, logger="albatross.constraints"):
        built = build_grammar_vocabulary(get_tokenizer())
    assert not built.native and built.trie is None
    assert "Python tokenizer" in caplog.text
    text = "{\"a\": 1} 中文"
    assert built.tokenizer.tokenize_str(text) == get_tokenizer().encode(text)


@pytest.mark.parametrize("failure", [ImportError("No module named 'numba'"), RuntimeError("LLVM failed")], ids=["missing", "broken"])
def test_an_encoder_that_cannot_be_built_is_logged_and_skipped(
    failure: Exception, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def fail() -> None:
        raise failure

    monkeypatch.setattr(grammar_vocabulary, "_compile_encoder", fail)
    grammar_vocabulary.native_encoder.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="albatross.constraints"):
            assert grammar_vocabulary.native_encoder() is None
        assert str(failure) in caplog.text
    finally:
        monkeypatch.undo()
        grammar_vocabulary.native_encoder.cache_clear()
    assert grammar_vocabulary.native_encoder() is not None


def test_the_environment_chooses_the_encoder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(grammar_vocabulary.ENCODER_ENV, "python")
    assert not build_grammar_vocabulary(get_tokenizer()).native
    monkeypatch.setenv(grammar_vocabulary.ENCODER_ENV, "Native")
    assert build_grammar_vocabulary(get_tokenizer()).native
    monkeypatch.setenv(grammar_vocabulary.ENCODER_ENV, "rust")
    with pytest.raises(ValueError, match="native or python"):
        build_grammar_vocabulary(get_tokenizer())


def test_fine_slices_give_the_library_defaults_masks_bit_for_bit(native: GrammarVocabulary) -> None:
    """FINE_SLICES only add run lengths to llguidance's own JSON slices, and slices are an
    optimisation: walks that dwell inside length-bounded strings get the same mask either way."""
    assert set(llguidance.LLTokenizer.json_slices()) <= set(grammar_vocabulary.FINE_SLICES)
    fine = build_grammar_vocabulary(get_tokenizer(), slices=list(grammar_vocabulary.FINE_SLICES))
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 24}, "b": {"type": "string", "minLength": 2, "maxLength": 7},
              "c": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}}, "required": ["a", "b", "c"]}  # fmt: skip
    grammar = llguidance.LLMatcher.grammar_from_lark(json_schema_grammar(schema))
    one_byte = np.array([i for i in range(1, 65530) if len(get_tokenizer().token_bytes(i)) == 1])
    for seed in range(3):
        rng = random.Random(seed)
        fast, slow = llguidance.LLMatcher(fine.tokenizer, grammar), llguidance.LLMatcher(native.tokenizer, grammar)
        rows = np.zeros((2, MASK_WORDS), dtype=np.int32)
        for _ in range(120):
            fast.unsafe_compute_mask_ptr(rows[0].ctypes.data, rows[0].nbytes)
            slow.unsafe_compute_mask_ptr(rows[1].ctypes.data, rows[1].nbytes)
            assert np.array_equal(rows[0], rows[1])
            ids = allowed_ids(rows[0])
            if fast.is_stopped() or not len(ids):
                break
            short = np.intersect1d(ids, one_byte)  # mostly single characters: the walk dwells inside strings
            token = int(rng.choice((short if len(short) and rng.random() < 0.7 else ids).tolist()))
            assert fast.consume_token(token) and slow.consume_token(token)


def test_the_environment_chooses_the_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(grammar_vocabulary.SLICES_ENV, raising=False)
    assert grammar_vocabulary.grammar_slices() is None
    monkeypatch.setenv(grammar_vocabulary.SLICES_ENV, "fine")
    assert grammar_vocabulary.grammar_slices() == list(grammar_vocabulary.FINE_SLICES)
    monkeypatch.setenv(grammar_vocabulary.SLICES_ENV, "coarse")
    with pytest.raises(ValueError, match="library or fine"):
        grammar_vocabulary.grammar_slices()


def test_vocabulary_rows_mark_the_undefined_ids_empty() -> None:
    rows = vocabulary_bytes(get_tokenizer())
    assert len(rows) == 65536 and all(rows[i] == b"" for i in range(65530, 65536))
    assert rows[END_OF_TEXT] == b"<|endoftext|>"
