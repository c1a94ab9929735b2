"""Grammar constraints on sampling: which token ids a request may produce next.

Built on llguidance (docs/performance.md says why it and not xgrammar). Host-side and torch-free:
a mask is 2,048 int32 words per row, bit `i` of word `j` standing for token `32 * j + i`, written
into memory the caller owns (a worker hands a view of its page-locked buffer, which it copies to
the device with the step; the classic backend a small array).

- The vocabulary as llguidance sees it comes from `albatross.grammar_vocabulary`, whose encoder of
  forced text is native code: llguidance calls it from its own threads, where a Python tokenizer
  would make every such call wait for the GIL.
- A grammar is llguidance lark text (`json_schema_grammar`, or the tool-call grammar the runner
  builds from `json_value_rule`). Its text is its cache key: `ConstraintCompiler.compile` returns
  the same `CompiledGrammar` for the same text without compiling again.
- `CompiledGrammar.matcher()` gives each request its own `TokenMatcher`; per generated token the
  caller fills the mask (`fill_bitmask`, or `fill_bitmasks` for many matchers in parallel with the
  GIL released), samples inside it, then `advance`s the matcher with the sampled id (`advance_all`
  for many, in parallel).
- Matchers of one grammar are spread over `lexer_shards()` independent copies of it. llguidance's
  matchers copied from one template share its lexer (the lazily built DFA) behind one mutex held
  for a whole mask, so masks of one grammar's matchers never ran in parallel: on the H200 host,
  960 masks took 96 ms on 12 threads, what one thread takes. Each shard has its own lexer, and the
  parallel calls work each shard's matchers on one thread of their own.
- The end-of-text token (id 0) is allowed exactly where the grammar can end; ids without text
  (65530..65535) are never allowed. `is_terminated()` is true once nothing but the end can follow,
  so the caller stops the request there with `finish_reason: "stop"`.
- An unsupported JSON Schema keyword is a `ConstraintError` naming it; nothing is relaxed.

JSON is written in one fixed form: `{"a": 1, "b": [true, null]}` (`", "` and `": "`, no other
whitespace), optionally after one leading space (a chat answer starts after `"Assistant:"`).
Fixed whitespace keeps the output of a grammar whose strings and numbers are bounded bounded too,
and a model cannot spin in whitespace.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from functools import lru_cache
from typing import Any

import llguidance
import numpy as np

from albatross.grammar_vocabulary import END_OF_TEXT as END_OF_TEXT  # id 0, allowed where the grammar can end
from albatross.grammar_vocabulary import grammar_tokenizer
from albatross.tokenizer import VOCAB_SIZE, Tokenizer

MASK_WORDS = VOCAB_SIZE // 32  # int32 words per mask row
JSON_FORMAT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_COMPILED_CACHE_SIZE = 256


class ConstraintError(ValueError):
    """A grammar or schema that cannot be enforced; the message says what and where."""


# Matchers report errors without the parser's state and grammar: those repeat the client's schema
# (kilobytes of it) into replies and logs, and the first line says what went wrong.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
_NON_VERBOSE_MARK = "<non-verbose/>"


def _concise(message: str) -> str:
    """llguidance's message without its non-verbose mark, and without what follows a panic's first
    line (a native backtrace: frames and the build's source paths, nothing a client can act on)."""
    message = message.replace(_NON_VERBOSE_MARK, "")
    return message.split("\n<backtrace>", 1)[0].strip()


# ---------------------------------------------------------------------------- grammars


@lru_cache(maxsize=1024)
def _schema_problem(schema_text: str) -> str | None:
    """What keeps the schema (canonical JSON text: the cache key) from being enforced, or None.
    Cached: a route checks every request's schema, and the check costs milliseconds."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_text, overrides=JSON_FORMAT)  # type: ignore[arg-type]
    except ValueError as error:  # its JSON reader refuses the text itself (nesting past its depth limit)
        return _too_deep(str(error)) or f"the schema cannot be read: {_concise(str(error))}"
    # llguidance reports relaxations as warnings only in its lenient mode, which we never set;
    # a warning is still refused, so that nothing is relaxed silently.
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if not is_error and not messages:
        return None
    message = _concise(messages[0]) if messages else "invalid schema"
    if deep := _too_deep(message):
        return deep
    prefix = "Unimplemented keys: "
    if message.startswith(prefix):
        try:
            names = json.loads(message[len(prefix) :])
        except ValueError:
            names = [message[len(prefix) :]]
        return f"unsupported JSON Schema keyword{'s' if len(names) > 1 else ''} {', '.join(map(str, names))}"
    return message


def _too_deep(message: str) -> str | None:
    """llguidance's JSON reader stops at its recursion limit (~125 levels of JSON, reached from a
    schema of ~62 nested objects) with the position in our canonical text, which means nothing to
    the client: say what it is instead."""
    if "recursion limit exceeded" not in message:
        return None
    return "the schema is nested too deeply for the grammar engine (at most about 120 levels of JSON)"


def check_json_schema(schema: Any) -> dict[str, Any]:
    """The schema as a dict, or ConstraintError naming what cannot be enforced."""
    if schema is True:
        schema = {}
    if schema is False:
        raise ConstraintError("the schema false allows no value")
    if not isinstance(schema, Mapping):
        raise ConstraintError("a JSON schema must be an object")
    if "x-guidance" in schema:
        raise ConstraintError("unsupported JSON Schema keyword x-guidance")
    problem = _schema_problem(json.dumps(schema, ensure_ascii=False, separators=(",", ":")))
    if problem is not None:
        raise ConstraintError(problem)
    return dict(schema)


def json_value_rule(schema: Mapping[str, Any]) -> str:
    """The lark right-hand side for one JSON value matching `schema`, in the fixed JSON form
    (check the schema with `check_json_schema` first for a clean error message)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_FORMAT}, ensure_ascii=False, separators=(",", ":"))


def json_schema_grammar(schema: Any) -> str:
    """One JSON value matching `schema`, optionally after one space; ConstraintError if the schema
    cannot be enforced."""
    checked = check_json_schema(schema)
    return f'start: " "? answer\nanswer: {json_value_rule(checked)}\n'


JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


# ---------------------------------------------------------------------------- matching


class TokenMatcher:
    """One request's position in its grammar. Not thread-safe: one owner at a time (the request's
    worker thread), which calls fill_bitmask / advance alternately."""

    __slots__ = ("_matcher", "grammar_text", "shard")

    def __init__(self, matcher: llguidance.LLMatcher, grammar_text: str, shard: int = 0) -> None:
        self._matcher: llguidance.LLMatcher | None = matcher
        self.grammar_text = grammar_text
        self.shard = shard  # which of its grammar's independent lexers it uses (the parallel calls group by it)

    @property
    def _live(self) -> llguidance.LLMatcher:
        if self._matcher is None:
            raise RuntimeError("this TokenMatcher was freed")
        return self._matcher

    def fill_bitmask(self, out_row: np.ndarray) -> None:
        """Write the allowed ids of the next token into `out_row` (int32, MASK_WORDS, contiguous).
        Raises ConstraintError when the matcher failed (its row would allow nothing)."""
        _check_row(out_row)
        matcher = self._live
        matcher.unsafe_compute_mask_ptr(out_row.ctypes.data, out_row.nbytes)
        if matcher.is_error():
            raise ConstraintError(f"the grammar matcher failed: {_concise(matcher.get_error())}")

    def advance(self, token_id: int) -> bool:
        """Consume a sampled id; False when the grammar did not allow it (the matcher has failed)."""
        return bool(self._live.consume_token(token_id))

    def can_end(self) -> bool:
        """The output so far is complete: the end-of-text token is allowed now."""
        return bool(self._live.is_accepting())

    def is_terminated(self) -> bool:
        """Nothing but the end can follow (the request is done), or the matcher failed."""
        return bool(self._live.is_stopped())

    def error(self) -> str | None:
        matcher = self._live
        return _concise(matcher.get_error()) if matcher.is_error() else None

    def reset(self) -> None:
        """Back to the grammar's start (a fresh output)."""
        self._live.reset()

    def free(self) -> None:
        """Drop the matcher's state; the object is unusable afterwards. Idempotent."""
        self._matcher = None

    @property
    def freed(self) -> bool:
        return self._matcher is None


def _check_row(row: np.ndarray) -> None:
    if row.dtype != np.int32 or row.shape != (MASK_WORDS,) or not row.flags["C_CONTIGUOUS"] or not row.flags["WRITEABLE"]:
        raise ValueError(f"a mask row must be a writable contiguous int32 array of {MASK_WORDS} words; got {row.dtype} {row.shape}")


class CompiledGrammar:
    """A grammar compiled against one vocabulary. `matcher()` copies one of `shards` pristine
    templates in turn (cheap); each template beyond the first is compiled at its first use (a few
    milliseconds, the GIL released), so a grammar only a few requests use costs one compile."""

    def __init__(self, text: str, template: llguidance.LLMatcher, build: Callable[[], llguidance.LLMatcher], shards: int) -> None:
        self.text = text
        self._templates: list[llguidance.LLMatcher | None] = [template] + [None] * (max(1, shards) - 1)
        self._build = build
        self._next = 0
        self._lock = threading.Lock()

    def matcher(self) -> TokenMatcher:
        with self._lock:
            shard = self._next
            self._next = (shard + 1) % len(self._templates)
            template = self._templates[shard]
            if template is None:
                template = self._templates[shard] = self._build()
            return TokenMatcher(template.deep_copy(), self.text, shard)

    def shards_built(self) -> int:
        with self._lock:
            return sum(template is not None for template in self._templates)


class ConstraintCompiler:
    """Compiles lark grammars for one tokenizer's vocabulary, keeping the most recently used
    `cache_size` compiled grammars by their text. Thread-safe."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = _COMPILED_CACHE_SIZE, shards: int | None = None) -> None:
        self._tokenizer = grammar_tokenizer(tokenizer)
        self._shards = lexer_shards() if shards is None else shards
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def cached_grammar(self, grammar_text: str) -> CompiledGrammar | None:
        """The compiled grammar if it is cached (marked as just used), else None; never compiles."""
        with self._lock:
            cached = self._cache.get(grammar_text)
            if cached is not None:
                self._cache.move_to_end(grammar_text)
            return cached

    def compile(self, grammar_text: str) -> CompiledGrammar:
        with self._lock:
            cached = self._cache.get(grammar_text)
            if cached is not None:
                self._cache.move_to_end(grammar_text)
                return cached
        compiled = self._compile(grammar_text)  # outside the lock: llguidance drops the GIL here
        with self._lock:
            self._cache[grammar_text] = compiled
            self._cache.move_to_end(grammar_text)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, grammar_text: str) -> CompiledGrammar:
        grammar = llguidance.LLMatcher.grammar_from_lark(grammar_text)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error or messages:
            raise ConstraintError(f"the grammar cannot be enforced: {_concise(messages[0]) if messages else 'invalid grammar'}")

        def build() -> llguidance.LLMatcher:
            template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=_LIMITS)
            if template.is_error():
                raise ConstraintError(f"the grammar cannot be enforced: {_concise(template.get_error())}")
            return template

        return CompiledGrammar(grammar_text, build(), build, self._shards)

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)


def lexer_shards() -> int:
    """Independent lexers per grammar, and threads that fill masks: llguidance's own default of
    80% of the CPUs this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every CPU counts
    cpus = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return max(1, int(cpus * 0.8))


class _ShardThreads:
    """One single-threaded llguidance executor per shard, each driven from its own thread: shard s's
    matchers are always worked by the same thread, one after another, so no two threads ever wait
    on one lexer's lock. (One executor over all matchers splits its list without regard to shards;
    on the H200 host it filled 960 sorted, sharded masks in 38 ms on 12 threads.)"""

    def __init__(self, count: int) -> None:
        self.executors = [llguidance.LLExecutor(num_threads=1) for _ in range(count)]
        self.pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="grammar-shard") if count > 1 else None

    def run(self, groups: dict[int, list[int]], call: Callable[[llguidance.LLExecutor, list[int]], Any]) -> dict[int, Any]:
        """`call(executor, group)` for each shard's group, the groups in parallel (the executors
        release the GIL); the results by shard. The first error is raised once all have ended."""
        if self.pool is None or len(groups) == 1:
            return {shard: call(self.executors[shard], group) for shard, group in groups.items()}
        futures = {shard: self.pool.submit(call, self.executors[shard], group) for shard, group in groups.items()}
        wait(futures.values())
        return {shard: future.result() for shard, future in futures.items()}


_threads: _ShardThreads | None = None
_threads_lock = threading.Lock()


def _shard_threads() -> _ShardThreads:
    global _threads
    with _threads_lock:
        if _threads is None:
            _threads = _ShardThreads(lexer_shards())
        return _threads


def _groups(count: int, shard_of: Callable[[int], int], threads: int) -> dict[int, list[int]]:
    """Positions 0..count-1 by the thread that works them (a matcher's shard, modulo the threads)."""
    groups: dict[int, list[int]] = {}
    for n in range(count):
        groups.setdefault(shard_of(n) % threads, []).append(n)
    return groups


def fill_bitmasks(rows: Sequence[tuple[TokenMatcher, int]], out: np.ndarray) -> list[int]:
    """Fill `out[row]` for every (matcher, row) pair at once, a thread per lexer shard with the GIL
    released (a worker calls this for all its constrained slots while the GPU runs the forward).
    `out` is int32 [rows, MASK_WORDS], contiguous. Returns the positions in `rows` whose matcher
    has failed: their rows allow nothing, and their requests must end with an error."""
    return bitmask_fill(rows, out)()


def bitmask_fill(rows: Sequence[tuple[TokenMatcher, int]], out: np.ndarray) -> Callable[[], list[int]]:
    """`fill_bitmasks` in two halves: the checks and the matchers' states are taken now, and the
    returned call does the filling, on any thread, even once the TokenMatchers have been freed
    (it holds their states until it returns). Nothing may use those matchers while it runs."""
    if out.dtype != np.int32 or out.ndim != 2 or out.shape[1] != MASK_WORDS or not out.flags["C_CONTIGUOUS"]:
        raise ValueError(f"masks must be a contiguous int32 array [rows, {MASK_WORDS}]; got {out.dtype} {out.shape}")
    if any(not 0 <= row < out.shape[0] for _, row in rows):
        raise ValueError(f"a mask row lies outside the {out.shape[0]} rows of the buffer")
    if not rows:
        return lambda: []
    threads = _shard_threads()
    live = [(matcher._live, row) for matcher, row in rows]
    groups = _groups(len(rows), lambda n: rows[n][0].shard, len(threads.executors))
    address, batch = out.ctypes.data, out.shape[0]

    def fill(executor: llguidance.LLExecutor, group: list[int]) -> None:
        executor.unsafe_compute_mask_ptr([live[n] for n in group], address, MASK_WORDS * 4, batch)

    def run() -> list[int]:
        threads.run(groups, fill)
        return [n for n, (matcher, _) in enumerate(live) if matcher.is_error()]

    return run


def advance_all(pairs: Sequence[tuple[TokenMatcher, int]]) -> list[bool]:
    """`matcher.advance(token)` for every pair at once, a thread per lexer shard with the GIL
    released (a worker advances all its constrained slots by their sampled ids this way). The
    matchers must be distinct; a False leaves that matcher failed, as `advance` does."""
    if not pairs:
        return []
    threads = _shard_threads()
    live = [(matcher._live, token_id) for matcher, token_id in pairs]
    groups = _groups(len(pairs), lambda n: pairs[n][0].shard, len(threads.executors))

    def advance(executor: llguidance.LLExecutor, group: list[int]) -> list[bool]:
        return list(executor.consume_token_par([live[n] for n in group]))

    accepted = threads.run(groups, advance)
    result = [False] * len(pairs)
    for shard, group in groups.items():
        for n, ok in zip(group, accepted[shard]):
            result[n] = bool(ok)
    return result


def allowed_ids(row: np.ndarray) -> np.ndarray:
    """The ids a mask row allows, ascending (for tests and tools, not for the hot path)."""
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
