"""How grammar-mask filling scales with threads (host only, no GPU): N matchers of one JSON schema
(structured_benchmark's 20-property schema) walk STEPS tokens, each drawn uniformly from its own
mask, and every step fills all N masks at once. Rows:

- "one executor": llguidance's LLExecutor with T threads over matchers copied from one template,
  which share one lexer behind one lock (what the engine did before lexer shards);
- "shard threads": `albatross.constraints` as the engine runs it, the matchers spread over T lexer
  shards, each shard's masks filled by a thread of its own.

Each under both vocabularies (`--vocabulary native,python`): the native encoder of forced text
(albatross/grammar_vocabulary.py), or the Python tokenizer, which llguidance's threads call
holding the GIL. `--busy` runs a pure-Python loop on another thread while the masks fill, as the
engine's worker thread does while it turns the last step's ids into events.

Prints ms per fill of N masks and µs per mask, and the advance of N matchers.

    python bench/mask_scaling.py [--matchers 960] [--steps 40] [--threads 1,4,8,12] [--busy]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import llguidance
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import constraints, grammar_vocabulary
from albatross.constraints import MASK_WORDS, ConstraintCompiler, allowed_ids, json_schema_grammar
from albatross.tokenizer import get_tokenizer
from structured_benchmark import benchmark_schema

WARM_UP_STEPS = 3


@contextmanager
def _python_busy(busy: bool) -> Iterator[None]:
    """A thread running Python (so holding the GIL but for the interpreter's switches) meanwhile."""
    stop = threading.Event()

    def spin() -> None:
        total = 0
        while not stop.is_set():
            for n in range(1000):
                total += n

    thread = threading.Thread(target=spin, daemon=True) if busy else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread is not None:
            thread.join()


def _walk(fill, advance, matchers: list, steps: int, seed: int, busy: bool) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Mean ms per fill and per advance of all matchers, after a few warm-up steps."""
    rng = random.Random(seed)
    out = np.zeros((len(matchers), MASK_WORDS), dtype=np.int32)
    fill_s = advance_s = 0.0
    for step in range(steps + WARM_UP_STEPS):
        with _python_busy(busy):
            started = time.perf_counter()
            fill(out)
            filled = time.perf_counter()
        tokens = []
        for n in range(len(matchers)):
            ids = allowed_ids(out[n])
            ids = ids[ids != constraints.END_OF_TEXT] if len(ids) > 1 else ids
            tokens.append(int(rng.choice(ids.tolist())) if len(ids) else constraints.END_OF_TEXT)
        before_advance = time.perf_counter()
        advance(tokens)
        if step >= WARM_UP_STEPS:
            fill_s += filled - started
            advance_s += time.perf_counter() - before_advance
    return 1e3 * fill_s / steps, 1e3 * advance_s / steps


def one_executor(grammar: str, count: int, threads: int, steps: int, busy: bool) -> tuple[float, float]:
    compiled = ConstraintCompiler(get_tokenizer(), shards=1).compile(grammar)
    matchers = [compiled.matcher()._live for _ in range(count)]
    executor = llguidance.LLExecutor(num_threads=threads)

    def fill(out: np.ndarray) -> None:
        executor.unsafe_compute_mask_ptr([(m, n) for n, m in enumerate(matchers)], out.ctypes.data, MASK_WORDS * 4, out.shape[0])

    def advance(tokens: list[int]) -> None:
        executor.consume_token_par(list(zip(matchers, tokens)))

    return _walk(fill, advance, matchers, steps, seed=count, busy=busy)


def shard_threads(grammar: str, count: int, threads: int, steps: int, busy: bool) -> tuple[float, float]:
    constraints._threads = constraints._ShardThreads(threads)
    compiled = ConstraintCompiler(get_tokenizer(), shards=threads).compile(grammar)
    matchers = [compiled.matcher() for _ in range(count)]

    def fill(out: np.ndarray) -> None:
        constraints.fill_bitmasks([(m, n) for n, m in enumerate(matchers)], out)

    def advance(tokens: list[int]) -> None:
        constraints.advance_all(list(zip(matchers, tokens)))

    return _walk(fill, advance, matchers, steps, seed=count, busy=busy)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matchers", type=int, default=960)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", default="1,4,8,12")
    parser.add_argument("--vocabulary", default="native,python", help="native (the numba encoder), python (the Python tokenizer), or both")
    parser.add_argument("--busy", action="store_true", help="run Python on another thread while the masks fill")
    args = parser.parse_args(argv)
    grammar = json_schema_grammar(benchmark_schema(0))
    tokenizer = get_tokenizer()
    busy = " beside a busy Python thread" if args.busy else ""
    print(f"{args.matchers} matchers, {args.steps} steps, {os.cpu_count()} CPUs, llguidance {llguidance.__version__}{busy}")
    print(f"{'vocabulary':<12}{'how':<16}{'threads':>8}{'fill ms':>10}{'us/mask':>10}{'advance ms':>12}")
    for vocabulary in args.vocabulary.split(","):
        # The compilers below take the vocabulary from grammar_vocabulary's per-process cache.
        grammar_vocabulary._vocabularies[tokenizer.vocab_path] = grammar_vocabulary.build_grammar_vocabulary(tokenizer, native=vocabulary == "native")
        for threads in (int(t) for t in args.threads.split(",")):
            for name, run in (("one executor", one_executor), ("shard threads", shard_threads)):
                fill_ms, advance_ms = run(grammar, args.matchers, threads, args.steps, args.busy)
                print(f"{vocabulary:<12}{name:<16}{threads:>8}{fill_ms:>10.2f}{1e3 * fill_ms / args.matchers:>10.1f}{advance_ms:>12.2f}", flush=True)


if __name__ == "__main__":
    main()
