"""llguidance's view of the RWKV World vocabulary, with the encoding it needs done in native code.

While llguidance computes a mask it tokenizes the text the grammar forces next (a property name
and its `": "`, say), so that only the canonical tokens of that text are allowed. Handed a Python
tokenizer it calls back into Python for that from its own worker threads, and every call must take
the GIL (and build a Python thread state for a thread that has none). Masks of different lexer
shards then wait for the GIL in turn, and all of them wait behind whatever Python the engine's
own thread runs meanwhile: `bench/mask_scaling.py --busy` on a 2-core machine filled 480 masks in
1,393-1,553 ms on one thread beside a busy Python thread, against 57.5-62.0 ms with the native
encoder (and in 29.9 ms rather than 35.3 ms on two shard threads with no busy thread).

So the encoding llguidance calls is a C function compiled by numba (which never takes the GIL)
walking a trie packed into one int32 array: greedy longest match over the bytes, which is the
RWKV World encoding itself (albatross/tokenizer.py), so the masks are the ones the Python
tokenizer gives (tests/test_grammar_vocabulary.py compares both, and the encodings on random text
and bytes). It reaches llguidance through `LLTokenizer.from_llamacpp`, the entry point for a
native tokenize function (`vocab_ptr` is the packed trie's address). Without numba the Python
tokenizer is used, with one warning; `ALBATROSS_GRAMMAR_ENCODER=python` chooses it too (for
comparisons, and as a way out should numba misbehave on a platform).

`ALBATROSS_GRAMMAR_SLICES=fine` gives llguidance finer "slices" (`FINE_SLICES`): token sets it
precomputes per regex and ORs into a mask wherever the lexer state allows every string of the
regex, so that only the rest of the vocabulary is walked. Its JSON defaults are runs of 1-10, 1-30
and any number of string characters, so inside a string with `maxLength` and fewer than 30
characters left only the 1-10 run applies; finer steps measured 43-48% less time per mask along
`maxLength` 24 and 32 strings on one thread, with the same masks bit for bit; over the uniform
walk of mask_scaling.py they fill 13% faster but make the advance (on a step's critical path)
twice as slow. On the H200 they were 4.5% slower at 100% constrained, measured while the Python
tokenizer still held the mask threads back, so the default stays the library's until the native
encoder is measured with both.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import llguidance
import numpy as np

from albatross.tokenizer import VOCAB_SIZE, Tokenizer

log = logging.getLogger("albatross.constraints")

END_OF_TEXT = 0  # the RWKV World end-of-text id, allowed where the grammar can end
_END_OF_TEXT_TEXT = b"<|endoftext|>"  # id 0 has no text; llguidance wants a special token for it
_SPECIAL_TOKEN_MARKER = b"\xff"  # llguidance's prefix for special tokens: no text ever matches them

# The packed trie: a header of _HEADER int32 words (the array's length, the node count, and where
# each section starts), then `child_start` (nodes + 1: node n's children are edges
# child_start[n] .. child_start[n + 1] - 1), `edge_byte` and `edge_node` (sorted by byte within a
# node), and `node_token` (the id a node spells, or -1). Node 0 is the root.
_HEADER = 8
ENCODER_ENV = "ALBATROSS_GRAMMAR_ENCODER"  # "native" (the default) or "python"
SLICES_ENV = "ALBATROSS_GRAMMAR_SLICES"  # "library" (the default: llguidance's JSON slices) or "fine"
STRING_RUN_SLICES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 30)
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'
FINE_SLICES: tuple[str, ...] = (
    r"[\x20\x0A\x0D\x09]+",
    *(f"{_STRING_CHAR}{{1,{n}}}" for n in STRING_RUN_SLICES),
    f"{_STRING_CHAR}+",
)


def vocabulary_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Every id's bytes, `VOCAB_SIZE` rows: ids without text (0, 65530..65535) are empty, except
    that id 0 gets a placeholder name (llguidance marks it special, so it never matches text)."""
    rows = [tokenizer.token_bytes(token_id) for token_id in range(VOCAB_SIZE)]
    rows[END_OF_TEXT] = _END_OF_TEXT_TEXT
    return rows


def pack_trie(rows: Sequence[bytes], skip: Sequence[int] = (END_OF_TEXT,)) -> np.ndarray:
    """The trie of every non-empty row (ids in `skip` left out), packed as described above."""
    children: list[dict[int, int]] = [{}]
    node_token = [-1]
    skipped = set(skip)
    for token_id, row in enumerate(rows):
        if not row or token_id in skipped:
            continue
        node = 0
        for byte in row:
            child = children[node].get(byte)
            if child is None:
                child = len(children)
                children[node][byte] = child
                children.append({})
                node_token.append(-1)
            node = child
        node_token[node] = token_id
    nodes = len(children)
    edges = nodes - 1  # a tree: every node but the root has one parent edge
    child_start = np.zeros(nodes + 1, dtype=np.int64)
    np.cumsum([len(c) for c in children], out=child_start[1:])
    starts = [_HEADER, _HEADER + nodes + 1, _HEADER + nodes + 1 + edges, _HEADER + nodes + 1 + 2 * edges]
    packed = np.zeros(starts[3] + nodes, dtype=np.int32)
    packed[:6] = [packed.size, nodes, *starts]
    packed[starts[0] : starts[0] + nodes + 1] = child_start
    edge_byte = packed[starts[1] : starts[1] + edges]
    edge_node = packed[starts[2] : starts[2] + edges]
    for node, branch in enumerate(children):
        for k, byte in enumerate(sorted(branch), start=int(child_start[node])):
            edge_byte[k] = byte
            edge_node[k] = branch[byte]
    packed[starts[3] :] = node_token
    return packed


@lru_cache(maxsize=1)
def native_encoder() -> Any | None:
    """The compiled encoder (a numba cfunc; `.address` is the C function pointer), compiled once
    per process (~1 s), or None where numba is missing or cannot compile it (logged once).

    Its C signature is llama.cpp's tokenize, which `LLTokenizer.from_llamacpp` calls:
    `int32 (const void *trie, const char *text, int32 len, int32 *out, int32 capacity, bool, bool)`.
    It writes the ids of `text` into `out` (up to `capacity`) and returns their count, or minus
    the count when `capacity` is too small (the caller then calls again with room for all). Bytes
    no token starts with (none in the RWKV vocabulary, which has every single byte) are skipped."""
    try:
        return _compile_encoder()
    except ImportError as error:
        log.warning("the native grammar encoder needs numba (%s)", error)
    except Exception as error:  # numba or LLVM failing on this platform: the Python tokenizer serves
        log.warning("compiling the native grammar encoder failed: %s: %s", type(error).__name__, error)
    return None


def _compile_encoder() -> Any:
    import numba
    from numba import types

    signature = types.int32(types.voidptr, types.voidptr, types.int32, types.CPointer(types.int32), types.int32, types.boolean, types.boolean)

    # A cfunc is always compiled in nopython mode: it never touches the GIL. Cached on disk (numba's
    # __pycache__ files), so later processes load it in ~0.1 s.
    @numba.cfunc(signature, cache=True)
    def encode(trie, text, length, out, capacity, add_special, parse_special):  # type: ignore[no-untyped-def]
        header = numba.carray(trie, _HEADER, np.int32)
        words = numba.carray(trie, header[0], np.int32)
        child_start, edge_byte, edge_node, node_token = header[2], header[3], header[4], header[5]
        data = numba.carray(text, length, np.uint8)
        count = 0
        position = 0
        while position < length:
            node = 0
            best = -1
            best_end = position + 1
            end = position
            while end < length:
                byte = np.int32(data[end])
                low = words[child_start + node]
                high = words[child_start + node + 1] - 1
                child = -1
                while low <= high:
                    middle = (low + high) >> 1
                    found = words[edge_byte + middle]
                    if found == byte:
                        child = words[edge_node + middle]
                        break
                    if found < byte:
                        low = middle + 1
                    else:
                        high = middle - 1
                if child < 0:
                    break
                node = child
                end += 1
                if words[node_token + node] >= 0:
                    best = words[node_token + node]
                    best_end = end
            if best >= 0:
                if count < capacity:
                    out[count] = best
                count += 1
            position = best_end
        return -count if count > capacity else count

    return encode


@dataclass(frozen=True, slots=True)
class GrammarVocabulary:
    """An LLTokenizer and what must live as long as it does (the packed trie its encoder reads)."""

    tokenizer: llguidance.LLTokenizer
    native: bool
    trie: np.ndarray | None = None


class _PythonTokenizer:
    """What llguidance.TokenizerWrapper reads from a tokenizer (the fallback without numba)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokens = vocabulary_bytes(tokenizer)
        self.eos_token_id = END_OF_TEXT
        self.bos_token_id = None
        self.special_token_ids = [END_OF_TEXT]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)


def native_wanted() -> bool:
    """What ALBATROSS_GRAMMAR_ENCODER asks for: the native encoder unless it says "python"."""
    return _choice(ENCODER_ENV, "native", ("native", "python")) == "native"


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    choice = os.environ.get(name, default).strip().lower()
    if choice not in allowed:
        raise ValueError(f"{name} must be {' or '.join(allowed)}, not {choice!r}")
    return choice


def grammar_slices() -> list[str] | None:
    """The slices ALBATROSS_GRAMMAR_SLICES asks for: None for llguidance's defaults, or FINE_SLICES."""
    return list(FINE_SLICES) if _choice(SLICES_ENV, "library", ("library", "fine")) == "fine" else None


_tries_handed_over: list[np.ndarray] = []  # see build_grammar_vocabulary


def build_grammar_vocabulary(tokenizer: Tokenizer, native: bool | None = None, slices: list[str] | None = None) -> GrammarVocabulary:
    """llguidance's view of `tokenizer` (its token trie, ~0.3 s to build), encoding natively when
    `native` (default: `native_wanted()`) and numba is there, through the Python tokenizer
    otherwise; with `slices` (default: `grammar_slices()`) for its mask slicer."""
    if native is None:
        native = native_wanted()
    if slices is None:
        slices = grammar_slices()
    encoder = native_encoder() if native else None
    if native and encoder is None:
        log.warning("grammar masks call the Python tokenizer for forced text, and fill slower under load")
    if encoder is None:
        wrapper = llguidance.TokenizerWrapper(_PythonTokenizer(tokenizer))
        return GrammarVocabulary(llguidance.LLTokenizer(wrapper, n_vocab=VOCAB_SIZE, eos_token=END_OF_TEXT, slices=slices), native=False)
    rows = vocabulary_bytes(tokenizer)
    trie = pack_trie(rows)
    # llguidance keeps the raw address, in the tokenizer and in every matcher made from it, which
    # may outlive this object: a trie handed over is never freed (1.9 MB, once per process in
    # serving, where grammar_tokenizer caches the vocabulary).
    _tries_handed_over.append(trie)
    rows[END_OF_TEXT] = _SPECIAL_TOKEN_MARKER + _END_OF_TEXT_TEXT
    # from_llamacpp is in llguidance's extension but not in its type stub.
    built = llguidance.LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
        tokens=rows, vocab_ptr=trie.ctypes.data, tokenize_fptr=encoder.address, eos_token=END_OF_TEXT, slices=slices
    )
    return GrammarVocabulary(built, native=True, trie=trie)


_vocabularies: dict[Path, GrammarVocabulary] = {}
_vocabularies_lock = threading.Lock()


def grammar_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary: built once per vocabulary file and process (the trie
    it points into stays alive with it)."""
    with _vocabularies_lock:
        built = _vocabularies.get(tokenizer.vocab_path)
        if built is None:
            built = _vocabularies[tokenizer.vocab_path] = build_grammar_vocabulary(tokenizer)
        return built.tokenizer
