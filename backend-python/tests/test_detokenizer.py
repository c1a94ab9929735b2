"""Streaming text: never a split character, never any part of a matched stop, whatever the splits."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Sequence

import pytest

from albatross.detokenizer import IncrementalDecoder, StopMatcher, TextStream
from albatross.tokenizer import Tokenizer, get_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return get_tokenizer()


def _random_splits(items: Sequence[object], rng: random.Random) -> list[list[object]]:
    pieces: list[list[object]] = []
    position = 0
    while position < len(items):
        size = rng.choice([0, 1, 1, 2, 3, 7])
        pieces.append(list(items[position : position + size]))
        position += size
    return pieces


def _byte_token_ids(data: bytes) -> list[int]:
    return [byte + 1 for byte in data]  # World ids 1..256 are the single bytes 0..255


def _first_stop_by_characters(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Oracle: read one character at a time; the first stop to complete wins (longest on a tie)."""
    for end in range(1, len(text) + 1):
        ended = [stop for stop in stops if text[:end].endswith(stop)]
        if ended:
            return text[: end - max(map(len, ended))], True
    return text, False


def _run_matcher(pieces: Sequence[str], stops: Sequence[str]) -> tuple[str, bool, list[str]]:
    matcher = StopMatcher(stops)
    emitted: list[str] = []
    stopped = False
    for piece in pieces:
        text, stopped = matcher.push(piece)
        emitted.append(text)
        if stopped:
            break
    if not stopped:
        emitted.append(matcher.flush())
    return "".join(emitted), stopped, emitted


# IncrementalDecoder


def test_decoder_holds_an_incomplete_character_until_its_last_byte(tokenizer: Tokenizer) -> None:
    decoder = IncrementalDecoder(tokenizer)
    emoji = "😀".encode()
    assert decoder.push(_byte_token_ids(b"ok" + emoji[:1])) == "ok"
    assert decoder.push(_byte_token_ids(emoji[1:3])) == ""
    assert decoder.pending_bytes == emoji[:3]
    assert decoder.push(_byte_token_ids(emoji[3:])) == "😀"
    assert decoder.flush() == ""


def test_decoder_replaces_an_invalid_sequence_once_it_cannot_complete(tokenizer: Tokenizer) -> None:
    decoder = IncrementalDecoder(tokenizer)
    assert decoder.push(_byte_token_ids(b"\xe4\xb8")) == ""
    assert decoder.push(_byte_token_ids(b"A")) == "\ufffdA", "a lead byte followed by ASCII is invalid at once"
    assert decoder.push(_byte_token_ids(b"\xff")) == "\ufffd"


def test_decoder_flush_turns_a_dangling_sequence_into_a_replacement_character(tokenizer: Tokenizer) -> None:
    decoder = IncrementalDecoder(tokenizer)
    assert decoder.push(_byte_token_ids("中".encode()[:2])) == ""
    assert decoder.flush() == "\ufffd"


def test_decoder_ignores_undefined_ids(tokenizer: Tokenizer) -> None:
    decoder = IncrementalDecoder(tokenizer)
    assert decoder.push([0, 65535, *tokenizer.encode("hi"), 65530]) == "hi"


def test_decoder_output_equals_whole_decode_for_random_bytes_and_random_splits(tokenizer: Tokenizer) -> None:
    rng = random.Random(11)
    pieces_of_text = ["a", "中", "😀", "é", "\n", "ひ"]
    for _ in range(300):
        data = b"".join(
            rng.choice(pieces_of_text).encode() if rng.random() < 0.7 else bytes([rng.randrange(256)])
            for _ in range(rng.randrange(0, 30))
        )
        decoder = IncrementalDecoder(tokenizer)
        output = [decoder.push(piece) for piece in _random_splits(_byte_token_ids(data), rng)]  # type: ignore[arg-type]
        output.append(decoder.flush())
        assert "".join(output) == data.decode("utf-8", "replace"), f"decoding {data!r} in pieces differed"


def test_decoder_output_equals_whole_decode_for_real_token_ids(tokenizer: Tokenizer) -> None:
    rng = random.Random(12)
    text = "混合 text with emoji 👨‍👩‍👧 and 日本語のテキスト, code `x = {1: 2}`\r\n" * 3
    ids = tokenizer.encode(text)
    for _ in range(50):
        decoder = IncrementalDecoder(tokenizer)
        output = [decoder.push(piece) for piece in _random_splits(ids, rng)]  # type: ignore[arg-type]
        assert "".join(output) + decoder.flush() == text


def test_push_token_equals_push_of_one_token_for_random_and_partial_character_tokens(tokenizer: Tokenizer) -> None:
    """The engine's fast path: same text as `push((id,))`, pending bytes included (byte tokens
    that split characters, invalid bytes, undefined ids, whole-character tokens mixed)."""
    rng = random.Random(13)
    pieces_of_text = ["a", "中", "😀", "é", "\n"]
    for _ in range(300):
        data = b"".join(
            rng.choice(pieces_of_text).encode() if rng.random() < 0.7 else bytes([rng.randrange(256)])
            for _ in range(rng.randrange(0, 20))
        )
        ids = _byte_token_ids(data) + [rng.randrange(0, 70000) for _ in range(rng.randrange(0, 4))]
        rng.shuffle(ids)
        fast, slow = IncrementalDecoder(tokenizer), IncrementalDecoder(tokenizer)
        for token_id in ids:
            assert fast.push_token(token_id) == slow.push((token_id,))
        assert fast.flush() == slow.flush()


# StopMatcher


def test_matcher_without_stops_passes_text_through() -> None:
    matcher = StopMatcher([])
    assert matcher.push("\n\nUser") == ("\n\nUser", False)
    assert matcher.flush() == ""


def test_matcher_holds_back_the_longest_suffix_that_may_start_a_stop() -> None:
    matcher = StopMatcher(["\n\nUser", "###"])
    assert matcher.push("Hello\n") == ("Hello", False)
    assert matcher.held == "\n"
    assert matcher.push("\nUs") == ("", False)
    assert matcher.held == "\n\nUs"
    assert matcher.push("ually ##") == ("\n\nUsually ", False)
    assert matcher.held == "##"


def test_matcher_drops_everything_from_the_match_on_and_finishes() -> None:
    matcher = StopMatcher(["\n\nUser"])
    assert matcher.push("Answer.\n\nUser: next question") == ("Answer.", True)
    assert matcher.finished
    assert matcher.push("more text") == ("", True)
    assert matcher.flush() == ""


def test_matcher_matches_a_stop_split_over_many_pushes() -> None:
    matcher = StopMatcher(["STOP"])
    outputs = [matcher.push(piece) for piece in ["abc S", "T", "O", "P tail"]]
    assert outputs == [("abc ", False), ("", False), ("", False), ("", True)]


def test_matcher_releases_held_text_at_flush_when_no_stop_completed() -> None:
    matcher = StopMatcher(["\n\nUser"])
    assert matcher.push("end\n\nUs") == ("end", False)
    assert matcher.flush() == "\n\nUs"


def test_matcher_releases_held_text_once_it_can_no_longer_become_a_stop() -> None:
    matcher = StopMatcher(["abc"])
    assert matcher.push("xab") == ("x", False)
    assert matcher.push("d") == ("abd", False)
    assert matcher.held == ""


def test_matcher_picks_the_stop_that_completes_first() -> None:
    assert _run_matcher(["xabcd"], ["abcd", "bc"])[:2] == ("xa", True)
    assert _run_matcher(["xabcd"], ["abcd", "abc"])[:2] == ("x", True)


def test_matcher_rejects_empty_stop_strings() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopMatcher(["ok", ""])


def test_matcher_equals_the_character_oracle_for_random_text_and_random_splits() -> None:
    rng = random.Random(21)
    stop_sets = [["ab"], ["aab", "b\n"], ["\n\n", "a\nb"], ["abab", "ba", "bb"], ["aaaa"], ["a"]]
    for trial in range(1500):
        stops = stop_sets[trial % len(stop_sets)]
        text = "".join(rng.choice("ab\n") for _ in range(rng.randrange(0, 25)))
        pieces = ["".join(piece) for piece in _random_splits(text, rng)]  # type: ignore[arg-type]
        output, stopped, _ = _run_matcher(pieces, stops)
        assert (output, stopped) == _first_stop_by_characters(text, stops), f"text {text!r} split {pieces} stops {stops}"


def test_matcher_never_emits_a_character_of_the_stop_it_later_matches() -> None:
    rng = random.Random(22)
    for _ in range(300):
        text = "".join(rng.choice("xy\n") for _ in range(rng.randrange(1, 30))) + "\n\nUser"
        pieces = ["".join(piece) for piece in _random_splits(text, rng)]  # type: ignore[arg-type]
        output, stopped, emitted = _run_matcher(pieces, ["\n\nUser"])
        expected_cut = text.index("\n\nUser")
        assert stopped and output == text[:expected_cut], f"{pieces} gave {emitted}"


def _longest_suffix_that_starts_a_stop(text: str, stops: Sequence[str]) -> str:
    """Oracle for the held text: the longest suffix of `text` that is a proper prefix of a stop."""
    for start in range(len(text)):
        tail = text[start:]
        if any(len(tail) < len(stop) and stop.startswith(tail) for stop in stops):
            return tail
    return ""


def test_matcher_holds_exactly_the_longest_suffix_that_starts_a_stop_after_every_push() -> None:
    rng = random.Random(23)
    stop_sets = [["abab", "ba"], ["aab", "b\n"], ["aaaa", "ab"], ["\n\nUser", "\n\nQ"]]
    for trial in range(600):
        stops = stop_sets[trial % len(stop_sets)]
        text = "".join(rng.choice("ab\nUserQ") for _ in range(rng.randrange(0, 30)))
        matcher = StopMatcher(stops)
        seen = ""
        for piece in ["".join(p) for p in _random_splits(text, rng)]:  # type: ignore[arg-type]
            emitted, stopped = matcher.push(piece)
            if stopped:
                break
            seen += piece
            expected = _longest_suffix_that_starts_a_stop(seen, stops)
            assert matcher.held == expected, f"after {seen!r} with stops {stops}: held {matcher.held!r}, expected {expected!r}"


def _peak_bytes_of(build: object) -> int:
    tracemalloc.start()
    try:
        kept = build()  # type: ignore[operator]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del kept
    return peak


def test_matcher_memory_is_linear_in_the_stop_length() -> None:
    """A stop of n characters costs O(n) bytes; storing every prefix cost O(n^2) (20k characters:
    ~150 MiB, 1 MB killed the server)."""
    length = 20_000
    stop = "".join(random.Random(24).choice("abcdefgh") for _ in range(length))
    peak = _peak_bytes_of(lambda: StopMatcher([stop]))
    assert peak < 64 * length, f"a {length}-character stop took {peak} bytes to prepare"


def test_matcher_follows_a_self_overlapping_stop_through_a_long_near_match() -> None:
    stop = "a" * 2000 + "b"
    matcher = StopMatcher([stop, "ab"])
    assert matcher.push("x" + "a" * 5000) == ("x" + "a" * 3000, False)
    assert matcher.held == "a" * 2000
    assert matcher.push("b") == ("", True), "both stops end here; the one that starts first wins"


# TextStream


def test_text_stream_cuts_at_a_stop_split_over_several_tokens(tokenizer: Tokenizer) -> None:
    stream = TextStream(tokenizer, ["\n\nUser"])
    ids = tokenizer.encode("Sure, here it is.\n\nUser: thanks")
    deltas: list[str] = []
    for token_id in ids:
        text, stopped = stream.push([token_id])
        deltas.append(text)
        if stopped:
            break
    assert stream.stopped
    assert "".join(deltas) == "Sure, here it is."


def test_text_stream_stop_made_of_multibyte_characters_split_inside_a_character(tokenizer: Tokenizer) -> None:
    stream = TextStream(tokenizer, ["。结束"])
    data = "好的。结束了".encode()
    deltas = [stream.push([byte + 1]) for byte in data]
    assert "".join(text for text, _ in deltas) == "好的"
    assert deltas[-1][1] or any(stopped for _, stopped in deltas)


def test_text_stream_equals_whole_text_oracle_for_random_token_splits(tokenizer: Tokenizer) -> None:
    rng = random.Random(31)
    vocabulary = ["User", ":", "\n", "\n\n", " hi", "中文", "😀", "Q", "A"]
    stops = ["\n\nUser", "\n\nQ", "😀😀"]
    for _ in range(200):
        text = "".join(rng.choice(vocabulary) for _ in range(rng.randrange(0, 12)))
        ids = tokenizer.encode(text)
        stream = TextStream(tokenizer, stops)
        output: list[str] = []
        for piece in _random_splits(ids, rng):
            delta, stopped = stream.push(piece)  # type: ignore[arg-type]
            output.append(delta)
            if stopped:
                break
        if not stream.stopped:
            output.append(stream.flush())
        assert ("".join(output), stream.stopped) == _first_stop_by_characters(text, stops), f"text {text!r}"


def test_text_stream_flush_emits_held_text_and_dangling_bytes(tokenizer: Tokenizer) -> None:
    stream = TextStream(tokenizer, ["\n\nUser"])
    assert stream.push(tokenizer.encode("done\n\n")) == ("done", False)
    assert stream.push(["中".encode()[0] + 1]) == ("", False), "an incomplete character is not text yet"
    assert stream.flush() == "\n\n\ufffd"
    assert not stream.stopped


def test_text_stream_returns_nothing_after_it_stopped(tokenizer: Tokenizer) -> None:
    stream = TextStream(tokenizer, ["x"])
    assert stream.push(tokenizer.encode("ax")) == ("a", True)
    assert stream.push(tokenizer.encode("more")) == ("", True)
    assert stream.flush() == ""
