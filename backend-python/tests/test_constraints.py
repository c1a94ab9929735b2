"""Grammar constraints (albatross/constraints.py): masks that keep output valid, EOS only where the
grammar can end, clear errors for what cannot be enforced, a compile cache, parallel fills."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import jsonschema
import numpy as np
import pytest

from albatross import constraints
from albatross.constraints import MASK_WORDS, ConstraintCompiler, ConstraintError, allowed_ids, json_schema_grammar, lexer_shards
from albatross.tokenizer import get_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "manager": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/ref"}]},
        "nickname": {"type": ["string", "null"], "maxLength": 5},
        "version": {"const": 2},
    },
    "required": ["name", "age", "role", "tags", "manager", "version"],
    "additionalProperties": False,
    "$defs": {"ref": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["id"], "additionalProperties": False}},
}
UNDEFINED_IDS = range(65530, 65536)


@pytest.fixture(scope="module")
def compiler() -> ConstraintCompiler:
    # Three lexer shards whatever this machine's CPU count, so the parallel calls below mix shards.
    return ConstraintCompiler(get_tokenizer(), shards=3)


@pytest.fixture(autouse=True, scope="module")
def three_shard_threads() -> Iterator[None]:
    """The parallel calls on three threads, one per shard, whatever this machine's CPU count."""
    saved = constraints._threads
    constraints._threads = constraints._ShardThreads(3)
    yield
    constraints._threads = saved


def _row() -> np.ndarray:
    return np.zeros(MASK_WORDS, dtype=np.int32)


def _random_output(compiler: ConstraintCompiler, grammar: str, seed: int, limit: int = 400) -> tuple[bytes, bool]:
    """Uniformly random allowed tokens until the grammar ends; the bytes and whether it ended."""
    tokenizer = get_tokenizer()
    matcher = compiler.compile(grammar).matcher()
    rng = random.Random(seed)
    row = _row()
    out = b""
    for _ in range(limit):
        matcher.fill_bitmask(row)
        ids = allowed_ids(row)
        assert not set(ids.tolist()) & set(UNDEFINED_IDS), "an id without text was allowed"
        token_id = int(rng.choice(ids))
        assert (token_id == constraints.END_OF_TEXT) <= matcher.can_end(), "EOS was allowed where the grammar cannot end"
        assert matcher.advance(token_id)
        out += tokenizer.token_bytes(token_id)
        if token_id == constraints.END_OF_TEXT or matcher.is_terminated():
            return out, True
    return out, False


@pytest.mark.parametrize("seed", range(12))
def test_random_tokens_under_the_mask_always_spell_a_valid_instance(compiler: ConstraintCompiler, seed: int) -> None:
    out, ended = _random_output(compiler, json_schema_grammar(PERSON), seed)
    assert ended, f"a bounded schema must end: {out[-60:]!r}"
    value = json.loads(out.decode("utf-8"))
    jsonschema.validate(value, PERSON)
    assert out.lstrip(b" ") == json.dumps(value, ensure_ascii=False, separators=(", ", ": ")).encode() or b"\\" in out, "the fixed JSON form"


def test_eos_is_allowed_exactly_where_the_grammar_can_end(compiler: ConstraintCompiler) -> None:
    tokenizer = get_tokenizer()
    matcher = compiler.compile(json_schema_grammar({"type": "integer", "minimum": 0, "maximum": 500})).matcher()
    row = _row()
    for token_id in tokenizer.encode(" 42"):
        matcher.fill_bitmask(row)
        assert row[0] & 1 == 0, "EOS before any digit"
        assert matcher.advance(token_id)
    matcher.fill_bitmask(row)
    assert row[0] & 1 == 1 and matcher.can_end() and not matcher.is_terminated(), "42 is complete but may still grow to 420"
    assert matcher.advance(tokenizer.encode("0")[0])
    assert matcher.is_terminated(), "420 cannot grow within the maximum"


def test_json_object_mode_allows_any_object_but_only_an_object(compiler: ConstraintCompiler) -> None:
    matcher = compiler.compile(json_schema_grammar(constraints.JSON_OBJECT_SCHEMA)).matcher()
    row = _row()
    matcher.fill_bitmask(row)
    starts = {get_tokenizer().token_bytes(int(i))[:2] for i in allowed_ids(row)}
    assert starts and all(s.startswith(b"{") or s.startswith(b" {") or s == b" " for s in starts), starts


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "object", "if": {"type": "object"}}, "keyword if"),
        ({"type": "array", "uniqueItems": True}, "keyword uniqueItems"),
        ({"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}}, "keyword not"),
        ({"type": "string", "format": "color"}, "Unknown format: color"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "object", "x-guidance": {"lenient": True}}, "x-guidance"),
        ({"type": "strin"}, "strin"),
        ([1, 2], "must be an object"),
    ],
)
def test_what_cannot_be_enforced_is_an_error_naming_it(schema: Any, named: str) -> None:
    with pytest.raises(ConstraintError, match=named):
        json_schema_grammar(schema)


def test_a_compiled_grammar_is_cached_by_its_text_and_the_oldest_is_dropped() -> None:
    compiler = ConstraintCompiler(get_tokenizer(), cache_size=2)
    grammars = [json_schema_grammar({"type": "integer", "maximum": n}) for n in range(3)]
    first = compiler.compile(grammars[0])
    assert compiler.compile(grammars[0]) is first
    compiler.compile(grammars[1])
    compiler.compile(grammars[2])
    assert compiler.cached() == 2
    assert compiler.compile(grammars[0]) is not first, "the least recently used grammar was dropped"


def test_matchers_of_one_grammar_are_independent_and_reset_and_free_work(compiler: ConstraintCompiler) -> None:
    grammar = compiler.compile(json_schema_grammar({"enum": ["yes", "no"]}))
    one, two = grammar.matcher(), grammar.matcher()
    tokenizer = get_tokenizer()
    for token_id in tokenizer.encode(' "yes"'):
        assert one.advance(token_id)
    assert one.is_terminated() and not two.can_end()
    one.reset()
    assert not one.can_end()
    one.free()
    one.free()
    with pytest.raises(RuntimeError, match="freed"):
        one.fill_bitmask(_row())


def test_matchers_take_the_shards_in_turn_and_each_shard_is_compiled_at_its_first_use(compiler: ConstraintCompiler) -> None:
    grammar = compiler.compile(json_schema_grammar({"type": "array", "items": {"type": "integer"}, "maxItems": 4}))
    assert grammar.shards_built() == 1
    matchers = [grammar.matcher() for _ in range(7)]
    assert [m.shard for m in matchers] == [0, 1, 2, 0, 1, 2, 0] and grammar.shards_built() == 3
    tokenizer = get_tokenizer()
    rows = np.zeros((len(matchers), MASK_WORDS), dtype=np.int32)
    for n, matcher in enumerate(matchers):  # every shard enforces the same grammar
        for token_id in tokenizer.encode(" [1, 2"[: 2 + n % 5]):
            assert matcher.advance(token_id)
        matcher.fill_bitmask(rows[n])
    for n in range(len(matchers)):
        same_text = [m for m in range(len(matchers)) if m % 5 == n % 5]
        assert all(np.array_equal(rows[n], rows[m]) for m in same_text)
    assert lexer_shards() >= 1 and constraints.ConstraintCompiler(get_tokenizer()).compile("start: \"a\"\n").shards_built() == 1


def test_a_refused_token_fails_the_matcher_and_its_mask_raises(compiler: ConstraintCompiler) -> None:
    matcher = compiler.compile(json_schema_grammar({"type": "boolean"})).matcher()
    assert not matcher.advance(get_tokenizer().encode("x")[0])
    assert matcher.error()
    with pytest.raises(ConstraintError, match="failed"):
        matcher.fill_bitmask(_row())


def test_parallel_fills_equal_one_by_one_fills_and_report_failed_matchers(compiler: ConstraintCompiler) -> None:
    tokenizer = get_tokenizer()
    grammar = compiler.compile(json_schema_grammar(PERSON))
    matchers = [grammar.matcher() for _ in range(4)]
    for matcher, text in zip(matchers, ["", ' {"name": "a', ' {"name": "ab", "age": 1', ' {"name": "ab", "age": 12, "role": "']):
        for token_id in tokenizer.encode(text):
            assert matcher.advance(token_id)
    broken = grammar.matcher()
    broken.advance(tokenizer.encode("x")[0])
    out = np.zeros((6, MASK_WORDS), dtype=np.int32)
    failed = constraints.fill_bitmasks([(matchers[0], 5), (matchers[1], 0), (broken, 1), (matchers[2], 2), (matchers[3], 3)], out)
    assert failed == [2]
    for matcher, row in zip(matchers, [5, 0, 2, 3]):
        single = _row()
        matcher.fill_bitmask(single)
        assert np.array_equal(out[row], single)
    assert not out[4].any(), "rows without a matcher are left alone"
    with pytest.raises(ValueError, match="outside"):
        constraints.fill_bitmasks([(matchers[0], 6)], out)


def test_parallel_advances_equal_one_by_one_advances_and_report_refused_tokens(compiler: ConstraintCompiler) -> None:
    tokenizer = get_tokenizer()
    grammar = compiler.compile(json_schema_grammar(PERSON))
    texts = [' {"name": "a', ' {"name": "ab", "age": 1', ' {"name": "ab", "age": 12, "role": "']
    together = [grammar.matcher() for _ in texts]
    alone = [grammar.matcher() for _ in texts]
    steps = [tokenizer.encode(text) for text in texts]
    for position in range(max(map(len, steps))):
        live = [n for n, ids in enumerate(steps) if position < len(ids)]
        accepted = constraints.advance_all([(together[n], steps[n][position]) for n in live])
        assert accepted == [alone[n].advance(steps[n][position]) for n in live] == [True] * len(live)
    for matcher, single in zip(together, alone):
        assert (matcher.can_end(), matcher.is_terminated()) == (single.can_end(), single.is_terminated())
        rows = np.zeros((2, MASK_WORDS), dtype=np.int32)
        matcher.fill_bitmask(rows[0])
        single.fill_bitmask(rows[1])
        assert np.array_equal(rows[0], rows[1])
    refused = constraints.advance_all([(together[0], 0), (together[1], tokenizer.encode("3")[0])])
    assert refused == [False, True], "the end of text inside a string is refused; a digit after a digit is not"
    assert together[0].error() and constraints.advance_all([]) == []


def test_a_mask_row_must_be_the_right_shape(compiler: ConstraintCompiler) -> None:
    matcher = compiler.compile(json_schema_grammar({"type": "null"})).matcher()
    with pytest.raises(ValueError, match="int32"):
        matcher.fill_bitmask(np.zeros(MASK_WORDS, dtype=np.int64))
    with pytest.raises(ValueError, match="2048"):
        matcher.fill_bitmask(np.zeros(100, dtype=np.int32))
