"""llguidance against xgrammar on the RWKV World vocabulary: compile time, mask time, mask accuracy.

Both libraries get the same 65,536 rows of byte strings (ids 65530..65535 empty, so never allowed;
id 0 the end-of-text token) and the same schemas in the server's fixed JSON form (`", "`, `": "`,
no other whitespace). For each schema:

- compile: a new schema's first request, compile plus its first mask (the cache off), median and
  worst of `--repeats` runs after one warm-up on another schema;
- mask: the time to fill one token's mask along trajectories that spell a valid instance (each
  step takes the longest allowed token that continues the instance) and along random walks (each
  step a uniformly random allowed token), per token;
- accuracy: at sampled states, every id's verdict against a brute-force judge
  (`json_prefix_oracle`: does the text plus the token's bytes stay a prefix of valid output?).
  "false allows" break validity and must be 0; "valid masked" are valid continuations a library
  refuses (llguidance allows only the canonical tokens where the grammar forces a string).

    pip install -r bench/requirements-grammar.txt   # xgrammar and regex, for this script only
    python bench/bench_grammar_libraries.py [--repeats 5] [--walks 4] [--states 6] [--json out.json]

CPU only (the libraries run on the host); figures in docs/performance.md name the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from albatross import constraints, grammar_vocabulary
from albatross.tokenizer import VOCAB_SIZE, get_tokenizer
from bench.json_prefix_oracle import SchemaRegex

WORDS = ["alpha", "Bob", "café", "東京", "naïve", "x", "emoji 🎉", 'quote " mark', "line\nbreak", "tab\tstop", "42"]


def _string(max_length: int, min_length: int = 0) -> dict[str, Any]:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def _integer(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


def _object(properties: dict[str, Any], optional: Sequence[str] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": [n for n in properties if n not in optional], "additionalProperties": False}


TWENTY_PROPERTIES = _object(
    {
        "id": _integer(0, 1000), "name": _string(16), "active": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue", "black"]}, "score": {"type": "number"},
        "code": _string(8, 1), "digits": {"type": "array", "items": _integer(0, 9), "maxItems": 4},
        "nothing": {"type": "null"}, "version": {"const": "v1"},
        "point": _object({"x": _integer(0, 10), "y": _integer(0, 10)}), "city": _string(12),
        "offset": _integer(-50, 50), "verified": {"type": "boolean"},
        "tags": {"type": "array", "items": _string(6), "minItems": 1, "maxItems": 3},
        "either": {"anyOf": [_string(5), _integer(0, 9)]}, "note": _string(20), "ratio": {"type": "number"},
        "level": {"enum": [1, 2, 3]}, "nickname": {"type": ["string", "null"], "maxLength": 10}, "country": _string(10),
    }
)  # fmt: skip
NESTED = {
    **_object(
        {
            "team": _object({"lead": {"$ref": "#/$defs/person"}, "members": {"type": "array", "items": {"$ref": "#/$defs/person"}, "maxItems": 3}}),
            "status": {"enum": ["open", "closed"]},
            "location": {"anyOf": [_object({"city": _string(12)}), _object({"lat": {"type": "number"}, "lon": {"type": "number"}})]},
            "budget": {"type": ["integer", "null"], "minimum": 0, "maximum": 100},
        },
        optional=["budget"],
    ),
    "$defs": {"person": _object({"name": _string(12), "age": _integer(0, 120), "email": _string(24)}, optional=["email"])},
}
SMALL = _object({"name": _string(10), "age": _integer(0, 150)})
SCHEMAS: dict[str, dict[str, Any]] = {"20 properties": TWENTY_PROPERTIES, "nested+$ref+anyOf": NESTED, "2 properties": SMALL}


# ---------------------------------------------------------------------------- instances


def instance(schema: dict[str, Any], rng: random.Random, defs: dict[str, Any]) -> Any:
    """A random valid value of `schema` (the oracle's subset), properties in schema order."""
    if "$ref" in schema:
        return instance(defs[schema["$ref"].rsplit("/", 1)[1]], rng, defs)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "anyOf" in schema:
        return instance(rng.choice(schema["anyOf"]), rng, defs)
    kind = schema.get("type")
    if isinstance(kind, list):
        return instance({**schema, "type": rng.choice(kind)}, rng, defs)
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength", 12)
        text = rng.choice(WORDS)[:high]
        return text if len(text) >= low else text + "z" * (low - len(text))
    if kind == "integer":
        return rng.randint(schema.get("minimum", -1000), schema.get("maximum", 1000))
    if kind == "number":
        return round(rng.uniform(-100, 100), rng.randint(0, 3))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "array":
        count = rng.randint(schema.get("minItems", 0), schema.get("maxItems", 3))
        return [instance(schema["items"], rng, defs) for _ in range(count)]
    required = set(schema.get("required", ()))
    return {name: instance(sub, rng, defs) for name, sub in schema["properties"].items() if name in required or rng.random() < 0.5}


def instance_bytes(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": ")).encode()


# ---------------------------------------------------------------------------- the two libraries


class Library:
    name: str

    def compile(self, schema: dict[str, Any]) -> Any: ...

    def matcher(self, compiled: Any) -> Any: ...

    def fill(self, matcher: Any, row: np.ndarray) -> None: ...

    def advance(self, matcher: Any, token_id: int) -> bool: ...


class Llguidance(Library):
    name = "llguidance"

    def __init__(self) -> None:
        self.compiler = constraints.ConstraintCompiler(get_tokenizer(), cache_size=0)

    def compile(self, schema: dict[str, Any]) -> Any:
        # The schema itself, not the server's " "-prefixed wrapper, so both libraries match the same language.
        return self.compiler._compile("start: answer\nanswer: " + constraints.json_value_rule(constraints.check_json_schema(schema)))

    def matcher(self, compiled: Any) -> Any:
        return compiled.matcher()

    def fill(self, matcher: Any, row: np.ndarray) -> None:
        matcher.fill_bitmask(row)

    def advance(self, matcher: Any, token_id: int) -> bool:
        return matcher.advance(token_id)


class Xgrammar(Library):
    name = "xgrammar"

    def __init__(self) -> None:
        import torch
        import xgrammar

        self.xgr = xgrammar
        self.torch = torch
        rows = grammar_vocabulary.vocabulary_bytes(get_tokenizer())
        rows[constraints.END_OF_TEXT] = b""  # xgrammar takes the stop token by id
        self.info = xgrammar.TokenizerInfo(rows, xgrammar.VocabType.RAW, vocab_size=VOCAB_SIZE, stop_token_ids=[constraints.END_OF_TEXT])
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "), strict_mode=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, row: np.ndarray) -> None:
        matcher.fill_next_token_bitmask(self.torch.from_numpy(row).view(1, -1), 0)

    def advance(self, matcher: Any, token_id: int) -> bool:
        return bool(matcher.accept_token(token_id))


# ---------------------------------------------------------------------------- measurements


@dataclass
class Trajectory:
    tokens: list[int]
    mask_seconds: list[float]
    completed: bool


@dataclass
class Result:
    library: str
    schema: str
    compile_ms: list[float] = field(default_factory=list)
    first_mask_ms: list[float] = field(default_factory=list)
    mask_us: list[float] = field(default_factory=list)
    spelled: int = 0  # instances spelled to the end
    spell_failures: int = 0  # instances whose valid text the library's mask could not spell
    states: int = 0
    false_allows: int = 0
    valid_masked: int = 0
    rejected_prefixes: int = 0  # sampled states (valid text) the library refused to reach


def walk(library: Library, compiled: Any, choose: Callable[[np.ndarray, bytes], int | None], limit: int) -> Trajectory:
    matcher = library.matcher(compiled)
    row = np.zeros(constraints.MASK_WORDS, np.int32)
    tokens: list[int] = []
    seconds: list[float] = []
    text = b""
    tokenizer = get_tokenizer()
    for _ in range(limit):
        started = time.perf_counter()
        library.fill(matcher, row)
        seconds.append(time.perf_counter() - started)
        allowed = constraints.allowed_ids(row)
        token_id = choose(allowed, text)
        if token_id is None:
            return Trajectory(tokens, seconds, False)
        if token_id == constraints.END_OF_TEXT:
            return Trajectory(tokens, seconds, True)
        if not library.advance(matcher, token_id):
            return Trajectory(tokens, seconds, False)
        tokens.append(token_id)
        text += tokenizer.token_bytes(token_id)
    return Trajectory(tokens, seconds, False)


def spelling(target: bytes) -> Callable[[np.ndarray, bytes], int | None]:
    tokenizer = get_tokenizer()

    def choose(allowed: np.ndarray, text: bytes) -> int | None:
        rest = target[len(text) :]
        if not rest:
            return constraints.END_OF_TEXT if constraints.END_OF_TEXT in allowed else None
        best, best_length = None, 0
        for token_id in allowed:
            data = tokenizer.token_bytes(int(token_id))
            if len(data) > best_length and rest.startswith(data):
                best, best_length = int(token_id), len(data)
        return best

    return choose


def random_choice(rng: random.Random) -> Callable[[np.ndarray, bytes], int | None]:
    def choose(allowed: np.ndarray, text: bytes) -> int | None:
        return int(rng.choice(allowed)) if len(allowed) else None

    return choose


def judge(library: Library, compiled: Any, oracle: SchemaRegex, tokens: list[int], result: Result) -> None:
    """Compare the library's mask after `tokens` with the oracle's verdict on every id."""
    tokenizer = get_tokenizer()
    matcher = library.matcher(compiled)
    for token_id in tokens:
        if not library.advance(matcher, token_id):
            result.rejected_prefixes += 1
            return
    row = np.zeros(constraints.MASK_WORDS, np.int32)
    library.fill(matcher, row)
    allowed = set(constraints.allowed_ids(row).tolist())
    prefix = tokenizer.decode_bytes(tokens)
    first_bytes = {byte for byte in range(256) if oracle.is_prefix(prefix + bytes([byte]))}
    valid = {constraints.END_OF_TEXT} if oracle.is_complete(prefix) else set()
    for token_id in range(1, VOCAB_SIZE):
        data = tokenizer.token_bytes(token_id)
        if data and data[0] in first_bytes and oracle.is_prefix(prefix + data):
            valid.add(token_id)
    result.states += 1
    result.false_allows += len(allowed - valid)
    result.valid_masked += len(valid - allowed)


def measure(library: Library, name: str, schema: dict[str, Any], args: argparse.Namespace, shared_states: list[list[int]]) -> Result:
    result = Result(library.name, name)
    for _ in range(args.repeats):
        started = time.perf_counter()
        compiled = library.compile(schema)
        compiled_at = time.perf_counter()
        library.fill(library.matcher(compiled), np.zeros(constraints.MASK_WORDS, np.int32))
        result.compile_ms.append((compiled_at - started) * 1e3)
        result.first_mask_ms.append((time.perf_counter() - compiled_at) * 1e3)
    rng = random.Random(args.seed)
    defs = schema.get("$defs", {})
    for _ in range(args.instances):
        trajectory = walk(library, compiled, spelling(instance_bytes(instance(schema, rng, defs))), args.max_steps)
        result.mask_us.extend(s * 1e6 for s in trajectory.mask_seconds)
        result.spelled += trajectory.completed
        result.spell_failures += not trajectory.completed
    for _ in range(args.walks):
        trajectory = walk(library, compiled, random_choice(rng), args.max_steps)
        result.mask_us.extend(s * 1e6 for s in trajectory.mask_seconds)
        # states along the walk, judged for both libraries
        for _ in range(args.states):
            shared_states.append(trajectory.tokens[: rng.randint(0, len(trajectory.tokens))])
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="compiles per schema")
    parser.add_argument("--instances", type=int, default=4, help="valid instances spelled per schema")
    parser.add_argument("--walks", type=int, default=3, help="random walks per schema and library")
    parser.add_argument("--states", type=int, default=3, help="states judged per walk")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    started = time.perf_counter()
    libraries: list[Library] = [Llguidance()]
    setup = {"llguidance": time.perf_counter() - started}
    started = time.perf_counter()
    libraries.append(Xgrammar())
    setup["xgrammar"] = time.perf_counter() - started
    for library in libraries:  # warm-up on another schema: one-time costs are not a schema's
        library.fill(library.matcher(library.compile({"type": "object"})), np.zeros(constraints.MASK_WORDS, np.int32))

    results: list[Result] = []
    for name, schema in SCHEMAS.items():
        states: list[list[int]] = []
        per_library = [measure(library, name, schema, args, states) for library in libraries]
        oracle = SchemaRegex(schema)
        for library, result in zip(libraries, per_library):
            compiled = library.compile(schema)
            for tokens in states:
                judge(library, compiled, oracle, tokens, result)
        results.extend(per_library)

    print(f"# {platform.processor() or platform.machine()}, {platform.python_implementation()} {platform.python_version()}, CPU, one thread")
    print("vocabulary setup: " + ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in setup.items()))
    header = "| library | schema | compile ms (median / max) | first mask ms | mask us/token (median / p90 / max) | instances spelled | states judged | false allows | valid masked | valid prefixes refused |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in results:
        print(
            f"| {r.library} | {r.schema} | {statistics.median(r.compile_ms):.1f} / {max(r.compile_ms):.1f} | {statistics.median(r.first_mask_ms):.2f} "
            f"| {statistics.median(r.mask_us):.0f} / {percentile(r.mask_us, 0.9):.0f} / {max(r.mask_us):.0f} "
            f"| {r.spelled}/{r.spelled + r.spell_failures} | {r.states} | {r.false_allows} | {r.valid_masked} | {r.rejected_prefixes} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"setup_seconds": setup, "results": [r.__dict__ for r in results]}, indent=1))


if __name__ == "__main__":
    main()
