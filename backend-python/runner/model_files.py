"""Finding model and state files.

A relative path is looked up against the working directory first (RWKV-Runner's GUI sends
`./models/x.pth`, relative to the runner's root, which is its backend's working directory), then
against `--models-dir`; `.pth` may be left off. A miss names every place that was looked at.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from runner.errors import ApiError

CHECKPOINT_SUFFIX = ".pth"
SHOWN_NAME_CHARACTERS = 200  # of a name quoted back in a 404: a body may carry a megabyte of one


def _expanded(name: str) -> Path:
    try:
        return Path(name).expanduser()
    except RuntimeError:  # `~someone` for a user this machine does not have: a literal name
        return Path(name)


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name past the OS's limits (ENAMETOOLONG), a symlink loop: nothing to load
        return False


def _shown(text: str) -> str:
    return text if len(text) <= SHOWN_NAME_CHARACTERS else text[:SHOWN_NAME_CHARACTERS] + f"... ({len(text)} characters)"


def candidate_paths(name: str, search_dirs: Sequence[Path], suffix: str = CHECKPOINT_SUFFIX) -> list[Path]:
    """Every path `name` may mean, in lookup order (without duplicates)."""
    path = _expanded(name)
    bases = [path] if path.is_absolute() else [directory / path for directory in search_dirs]
    found: list[Path] = []
    for base in bases:
        for candidate in (base,) if base.suffix == suffix else (base, base.with_name(base.name + suffix)):
            if candidate not in found:
                found.append(candidate)
    return found


def find_file(name: str, models_dir: Path, what: str, param: str, suffix: str = CHECKPOINT_SUFFIX) -> Path:
    """The first existing file `name` names (absolute, cwd-relative, then models_dir-relative);
    404 naming every place looked at otherwise."""
    candidates = candidate_paths(name, [Path.cwd(), models_dir], suffix)
    for candidate in candidates:
        if _is_file(candidate):
            return candidate.resolve()
    looked = ", ".join(_shown(str(c.absolute())) for c in candidates)
    raise ApiError(404, f"{what} not found: {_shown(repr(name))} (looked for {looked})", param)

