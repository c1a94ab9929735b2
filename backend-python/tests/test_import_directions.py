"""The imports point one way (docs/architecture.md): runner -> (registry, on demand) -> engine ->
model core. Read from the sources, so a new upward import fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> the packages (or modules) of ours it may import at run time
ALLOWED = {
    "albatross": {"albatross"},
    # runner.sessions: the state key spaces and the turn-lock contract the state store implements.
    "albatross_engine": {"albatross", "albatross_engine", "runner.interface", "runner.backends", "runner.sessions"},
    # The Ray Serve deployment sits on top: it builds the runner's app and reads the engine's strategy.
    "albatross_serve": {"albatross_serve", "runner", "albatross_engine.config"},
    "runner": {"runner", "albatross.tokenizer", "albatross.detokenizer", "albatross.stopping", "albatross.sampler", "albatross.constraints"},
}
OURS = ("albatross", "albatross_engine", "albatross_serve", "runner")


def runtime_imports(path: Path) -> set[str]:
    """Modules of ours that `path` imports, leaving out `if TYPE_CHECKING:` blocks (types only)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in OURS}


def allowed(name: str, permitted: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in permitted)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_what_lies_below_it(package: str) -> None:
    wrong = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in runtime_imports(path)
        if not allowed(name, ALLOWED[package])
    }
    assert not wrong, "imports against the direction:\n" + "\n".join(sorted(wrong))
