"""What bench_external collects: rows per part, skip and error lines, written to JSON after every
row (a device call cut short by its time limit still leaves what it measured), and markdown
tables for the log."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Report:
    def __init__(self, path: Path | None, header: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {**header, "notes": [], "errors": []}

    def note(self, line: str) -> None:
        """A skipped part or item: printed at once and kept in the JSON."""
        print(line, flush=True)
        self.data["notes"].append(line)
        self.save()

    def error(self, where: str, error: BaseException) -> None:
        line = f"{where}: {type(error).__name__}: {error}"
        print(f"ERROR {line}", flush=True)
        self.data["errors"].append(line)
        self.save()

    def put(self, part: str, key: str, value: Any) -> None:
        self.data.setdefault(part, {})[key] = value
        self.save()

    def add(self, part: str, key: str, row: dict[str, Any]) -> None:
        self.data.setdefault(part, {}).setdefault(key, []).append(row)
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)


def fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, str):
        return value
    return format(value, spec)


def markdown(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A markdown table of `rows`; each column is (key, title, format spec)."""
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(key), spec) for key, _, spec in columns) + " |")
    return "\n".join(lines)
