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


def candidate_paths(name: str, search_dirs: Sequence[Path], suffix: str = CHECKPOINT_SUFFIX) -> list[Path]:
    """Every path `name` may mean, in lookup order (without duplicates)."""
    path = Path(name).expanduser()
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
        if candidate.is_file():
            return candidate.resolve()
    looked = ", ".join(str(c.absolute()) for c in candidates)
    raise ApiError(404, f"{what} not found: {name!r} (looked for {looked})", param)

