"""A request's output grammar compiled for a backend's vocabulary, the same way on both backends:
a grammar that cannot be enforced is a 400 naming what the client asked for, before anything is
queued (the compiler caches compiled grammars by their text)."""

from __future__ import annotations

from albatross.constraints import CompiledGrammar, ConstraintCompiler, ConstraintError
from runner.interface import BackendError, OutputConstraint


def compile_request_grammar(compiler: ConstraintCompiler, constraint: OutputConstraint | None) -> CompiledGrammar | None:
    if constraint is None:
        return None
    try:
        return compiler.compile(constraint.grammar)
    except ConstraintError as error:
        raise BackendError(400, f"{constraint.label}: {error}") from error
