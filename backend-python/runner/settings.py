"""Server-wide settings: CLI flags with environment-variable twins, frozen into `ServerSettings`.

Every flag `--some-name` has the twin `RWKV_SOME_NAME`; a flag given on the command line wins over
its twin, the twin wins over the default. Boolean flags read their twin as 1/true/yes/on.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ENV_PREFIX = "RWKV_"
MIB = 1024 * 1024
GIB = 1024 * MIB

# rwkv_lightning's `--inference-engine` / `--backend` values and the strategies they mean here.
ENGINE_STRATEGIES: dict[str, str] = {
    "fp16": "albatross workers=1 batch=32",
    "int8": "albatross workers=1 batch=32 weights=int8",  # W8A16: the large matrices in int8
}
LOG_FORMATS = ("text", "json")


def default_data_dir(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "rwkv-albatross"


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _parse_byte_size(text: str) -> int:
    """`4194304`, `4MiB`, `512M`, `2G`: binary units, as budgets are sized against memory."""
    cleaned = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1024, "M": MIB, "G": GIB, "T": 1024 * GIB}
    factor = units.get(cleaned[-1:], 1) if cleaned else 1
    number = cleaned[:-1] if factor != 1 else cleaned
    value = int(float(number) * factor)
    if value < 0:
        raise ValueError(f"a size must be >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be >= 1, got {text!r}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise ValueError(f"must be a number of seconds > 0, got {text!r}")
    return value


STATE_STORE_SCHEMES = ("sqlite:///", "redis://", "rediss://", "unix://")  # albatross_engine.state_cache.store_url reads them


def _state_store_url(text: str) -> str:
    url = text.strip()
    if not url.startswith(STATE_STORE_SCHEMES) or url == "sqlite:///":
        raise ValueError("use sqlite:///relative.sqlite3, sqlite:////absolute.sqlite3 or redis://HOST:PORT/DB")
    return url


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"must be a finite number >= 0, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {text!r}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"a port is within [0, 65535], got {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    webui: bool = False
    webui_dir: Path = Path(__file__).resolve().parents[2] / "frontend" / "dist"
    password: str | None = None
    model_path: str | None = None
    strategy: str | None = None  # None: the registry's default (backends.default_strategy())
    models_dir: Path = Path("models")
    deploy: bool = False  # refuses /switch-model and /exit (a fixed model for a public deployment)
    max_tokens: int = 102400  # RWKV-Runner's own cap (its GUI's slider goes this far)
    max_prompt_tokens: int = 131072
    max_batch_items: int = 4096
    max_body_bytes: int = 4 * MIB
    state_cache_path: Path = field(default_factory=lambda: default_data_dir() / "states.sqlite3")
    state_l1_bytes: int = 2 * GIB
    state_l2_bytes: int = 8 * GIB
    state_l3_bytes: int = 64 * GIB
    state_store: str | None = None  # a URL (store_url.py); None: SQLite at state_cache_path
    state_lock_lease: float = 30.0  # seconds a dead replica's session lock outlives it (Redis)
    drain_timeout: float = 30.0  # seconds running streams get after SIGTERM
    cors_origins: tuple[str, ...] = ()
    log_level: str = "info"
    request_read_timeout: float = 30.0  # seconds for a request's headers, and again for its body; 0: none
    log_format: str = "text"  # or "json": one JSON object per line
    max_queued_requests: int | None = None  # generations waiting beyond the slots; None: 4 x the slots (runner.admission)

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_prompt_tokens", "max_batch_items", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")


@dataclass(frozen=True, slots=True)
class _Flag:
    name: str  # the ServerSettings field
    help: str
    parse: Callable[[str], object] | None = str  # None: a boolean switch

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


_FLAGS: tuple[_Flag, ...] = (
    _Flag("host", "interface to listen on"),
    _Flag("port", "TCP port", _port),
    _Flag("webui", "serve the built web GUI (frontend/dist) at /", None),
    _Flag("webui_dir", "directory of the built web GUI", Path),
    _Flag("password", "require this password on every route except GET / and /healthz"),
    _Flag("model_path", "checkpoint to load at start (.pth optional)"),
    _Flag("strategy", "strategy for --model-path, e.g. 'albatross workers=1 batch=32' or 'cpu fp32'"),
    _Flag("models_dir", "where /switch-model resolves relative model paths", Path),
    _Flag("deploy", "deploy mode: /switch-model and /exit answer 403", None),
    _Flag("max_tokens", "cap on a request's max_tokens", _positive_int),
    _Flag("max_prompt_tokens", "cap on a request's prompt tokens", _positive_int),
    _Flag("max_batch_items", "cap on the items of one batch request", _positive_int),
    _Flag("max_body_bytes", "cap on a request body (e.g. 4MiB)", _parse_byte_size),
    _Flag("state_cache_path", "SQLite file of the state cache (L3)", Path),
    _Flag("state_l1_bytes", "state cache budget in device memory", _parse_byte_size),
    _Flag("state_l2_bytes", "state cache budget in host memory", _parse_byte_size),
    _Flag("state_l3_bytes", "state cache budget on disk", _parse_byte_size),
    _Flag(
        "state_store",
        "where sessions and dialogue nodes are stored: sqlite:///path.sqlite3 (default: --state-cache-path) "
        "or redis://HOST:PORT/DB, shared by replicas",
        _state_store_url,
    ),
    _Flag("state_lock_lease", "seconds a session lock in Redis outlives a replica that died holding it", _positive_seconds),
    _Flag("drain_timeout", "seconds running requests get to finish after SIGTERM before they end with an error", _positive_seconds),
    _Flag("cors_origins", "comma-separated web origins allowed besides the desktop shell's and localhost's ('*' for any)"),
    _Flag("log_level", "uvicorn log level"),
    _Flag("request_read_timeout", "seconds a client may take to send a request's headers, and its body (0: no limit)", _non_negative_float),
    _Flag("max_queued_requests", "generations that may wait for a slot; beyond them a request gets 429", _non_negative_int),
    _Flag("log_format", f"log lines as {' or '.join(LOG_FORMATS)} (json: one object per line, for log collectors)"),
)


def _shown_default(flag: _Flag) -> str:
    """The default as --help prints it (argparse's own defaults are None, so env twins can apply)."""
    if flag.name == "state_cache_path":
        return str(default_data_dir() / "states.sqlite3")
    if flag.name == "max_queued_requests":
        from runner.admission import QUEUE_SLOTS_MULTIPLE  # lazy: keeps settings free of runner imports

        return f"{QUEUE_SLOTS_MULTIPLE} x the backend's slots"
    if flag.name == "strategy":
        from runner.backends import BACKENDS  # lazy: the registry imports these settings

        return f"{BACKENDS[0].default_strategy!r}, or {BACKENDS[-1].default_strategy!r} without the {BACKENDS[0].name} module"
    value = ServerSettings.__dataclass_fields__[flag.name].default
    if flag.parse is None:
        return "on" if value else "off"
    if value is None or value == ():
        return "none"
    if flag.parse is _parse_byte_size and isinstance(value, int):
        return _format_bytes(value)
    return str(value)


def _format_bytes(value: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", MIB)):
        if value >= size and value % size == 0:
            return f"{value // size}{unit}"
    return str(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="main.py",
        description="RWKV-7 inference server (runner API + Albatross engine). "
        f"Every --flag has an environment twin {ENV_PREFIX}FLAG (dashes become underscores).",
    )
    for flag in _FLAGS:
        shown = f"{flag.help} (default: {_shown_default(flag)}) [{flag.env}]"
        if flag.parse is None:
            parser.add_argument(flag.option, action="store_true", default=None, help=shown)
        else:
            parser.add_argument(flag.option, default=None, help=shown)
    parser.add_argument(
        "--inference-engine",
        "--backend",
        dest="inference_engine",
        default=None,
        help=f"rwkv_lightning spelling: {', '.join(ENGINE_STRATEGIES)} (maps to a strategy) [{ENV_PREFIX}INFERENCE_ENGINE]",
    )
    return parser


def settings_from_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> ServerSettings:
    """Parse flags and env twins; a bad value exits with argparse's usage error naming it."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    args = parser.parse_args(argv)
    values: dict[str, object] = {}
    for flag in _FLAGS:
        given = getattr(args, flag.name)
        source = flag.option
        if given is None and flag.env in environ:
            given, source = environ[flag.env], flag.env
            if flag.parse is None:
                try:
                    given = _parse_bool(str(given))
                except ValueError as exc:
                    parser.error(f"{source}: {exc}")
        if given is None:
            continue
        if flag.parse is not None:
            try:
                given = flag.parse(str(given))
            except ValueError as exc:
                parser.error(f"{source}: invalid value {given!r} ({exc})")
        values[flag.name] = given
    if isinstance(values.get("cors_origins"), str):
        values["cors_origins"] = tuple(o.strip() for o in str(values["cors_origins"]).split(",") if o.strip())
    if "state_cache_path" not in values:
        values["state_cache_path"] = default_data_dir(environ) / "states.sqlite3"

    engine = args.inference_engine or environ.get(ENV_PREFIX + "INFERENCE_ENGINE")
    if engine:
        if engine not in ENGINE_STRATEGIES:
            parser.error(
                f"--inference-engine {engine!r} is not available here; known: {', '.join(ENGINE_STRATEGIES)} "
                "(classic strategies such as 'cpu fp32' go in --strategy)"
            )
        if "strategy" in values:
            parser.error("give either --strategy or --inference-engine, not both")
        values["strategy"] = ENGINE_STRATEGIES[engine]
    try:
        return ServerSettings(**values)  # type: ignore[arg-type]
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
