"""The Albatross strategy string: `albatross` (alias `chirrup`) followed by `key=value` words.

    albatross workers=2 batch=64 dtype=fp16 weights=int8 prefill_chunk=1024

As the runner documents it, an unknown key or an invalid value is ignored with a logged warning
and the default stays; `GET /status` shows the effective values (AlbatrossRWKV.status()).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, fields

from albatross.dtypes import DTYPES, default_dtype_name
from albatross.quant import DEFAULT_WEIGHT_FORMAT, WEIGHT_FORMATS
from runner.backends import ALBATROSS_STRATEGY_WORDS as STRATEGY_WORDS

logger = logging.getLogger(__name__)

DTYPE_NAMES = tuple(DTYPES)  # for weights and activations (`dtype`) and WKV states (`state_dtype`)
WORKER_MODES = ("process", "thread")
# Short chunks from many prompts, a large budget per step: the measurements are in docs/performance.md.
DEFAULT_PREFILL_CHUNK = 128
DEFAULT_PREFILL_BUDGET = 16384
# The step time the adaptive prefill budget aims at while streams are decoding; 0: off, the static
# budget, by default: on the 960-client burst 150 ms meets ITL p99 <= 200 ms but costs 3-7% of the
# throughput on an H100 (docs/performance.md, "Session 15"; 15% on the H200 in session 4).
DEFAULT_ITL_TARGET_MS = 0.0
# Which prompts a step's prefill budget feeds first: "shortest" (the fewest prompt tokens left, aged
# by admission; a 960-prompt burst's TTFT p50 falls by a third at the same throughput in the
# scheduler simulation, docs/performance.md "Session 23") or "arrival" (oldest admission first).
PREFILL_ORDERS = ("shortest", "arrival")
DEFAULT_PREFILL_ORDER = "shortest"

_DEVICE_PATTERN = re.compile(r"^(cpu|cuda|cuda:\d+)$")


@dataclass(frozen=True, slots=True)
class AlbatrossBackendConfig:
    worker_num: int = 1  # one worker per device (a thread or a process: worker_mode)
    batch_size: int = 32  # state slots per worker
    device: str | None = None  # None: cuda when available, else cpu; "cuda:N" puts worker 0 on GPU N
    dtype: str | None = None  # weights and activations; None: fp16 on cuda, fp32 on cpu
    weights: str = DEFAULT_WEIGHT_FORMAT  # the large matrices: fp16 (at `dtype`) or int8 with per-channel scales
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens a request feeds per step when many share the budget
    prefill_budget: int = DEFAULT_PREFILL_BUDGET  # most prompt tokens all requests feed together in one step
    itl_target_ms: float = DEFAULT_ITL_TARGET_MS  # adaptive budget: a step next to decoding streams aims at this; 0: off
    prefill_order: str = DEFAULT_PREFILL_ORDER  # which prompts the budget feeds first (PREFILL_ORDERS)
    state_dtype: str | None = None  # WKV state precision; None: fp16 on cuda, fp32 on cpu (docs/performance.md)
    overlap: bool | None = None  # host work of step N while step N+1 runs; None: on for cuda
    cuda_graphs: bool = True  # replay decode-only steps from CUDA graphs (a GPU only)
    worker_mode: str | None = None  # "process" or "thread"; None: effective_worker_mode() decides

    def __post_init__(self) -> None:
        for name in ("worker_num", "batch_size", "prefill_chunk", "prefill_budget"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        target = self.itl_target_ms
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0.0 <= target < float("inf"):
            raise ValueError(f"itl_target_ms must be a number of milliseconds >= 0 (0: off), got {target!r}")
        if self.device is not None and not _DEVICE_PATTERN.match(self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        for name in ("dtype", "state_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPE_NAMES:
                raise ValueError(f"{name} must be one of {', '.join(DTYPE_NAMES)}, got {value!r}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {', '.join(PREFILL_ORDERS)}, got {self.prefill_order!r}")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weights!r}")
        if self.worker_mode is not None and self.worker_mode not in WORKER_MODES:
            raise ValueError(f"worker_mode must be one of {', '.join(WORKER_MODES)}, got {self.worker_mode!r}")

    @property
    def itl_target_s(self) -> float | None:
        """The adaptive budget's target in seconds; None when it is off."""
        return self.itl_target_ms / 1000.0 if self.itl_target_ms > 0 else None

    def effective_device(self, cuda_available: bool) -> str:
        """Where the workers start: `device`, else cuda when a GPU is visible, else cpu."""
        return self.device or ("cuda" if cuda_available else "cpu")

    def effective_dtype(self, device_type: str) -> str:
        """The weights' and activations' type on `device_type` (albatross.dtypes has the default)."""
        return self.dtype or default_dtype_name(device_type)

    def effective_state_dtype(self, device_type: str) -> str:
        """The WKV state precision on `device_type`. On a GPU the default fp16 decodes 12-16%
        faster at batch 960 and costs less accuracy than the fp16 weights already do
        (docs/performance.md, "Default WKV state dtype")."""
        return self.state_dtype or default_dtype_name(device_type)

    def effective_worker_mode(self, device_type: str) -> str:
        """Where each worker runs: "process" (its own spawned process, one CUDA context and one GIL
        each) or "thread" (threads of the server process, sharing its GIL). The default is a process
        per GPU, because the host work of one GPU step takes about a third of the step at batch 960
        and one GIL feeds about two GPUs at most; on the CPU, threads (a process buys nothing there,
        the workers share the same cores). Measurements: docs/performance.md, "Worker processes"."""
        if self.worker_mode is not None:
            return self.worker_mode
        return "process" if device_type == "cuda" else "thread"


def is_albatross_strategy(strategy: str) -> bool:
    words = strategy.strip().split()
    return bool(words) and words[0].lower() in STRATEGY_WORDS


def _positive_int(text: str) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= 1 else None


def _milliseconds_or_off(text: str) -> float | None:
    """A positive number of milliseconds, or 0 / off for none."""
    if text.lower() in ("off", "none", "false"):
        return 0.0
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0.0 <= value < float("inf") else None


def _device(text: str) -> str | None:
    text = text.lower()
    if text.isdigit():  # a bare GPU index
        return f"cuda:{int(text)}"
    return text if _DEVICE_PATTERN.match(text) else None


def _choice(choices: tuple[str, ...]) -> Callable[[str], str | None]:
    def parse(text: str) -> str | None:
        text = text.lower()
        return text if text in choices else None

    return parse


def _boolean(text: str) -> bool | None:
    return {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}.get(text.lower())


# strategy key -> (config field, value parser returning None for an invalid value)
_KEYS: dict[str, tuple[str, Callable[[str], object]]] = {
    "workers": ("worker_num", _positive_int),
    "worker": ("worker_num", _positive_int),
    "worker_num": ("worker_num", _positive_int),
    "batch": ("batch_size", _positive_int),
    "batch_size": ("batch_size", _positive_int),
    "device": ("device", _device),
    "dtype": ("dtype", _choice(DTYPE_NAMES)),
    "weights": ("weights", _choice(WEIGHT_FORMATS)),
    "prefill_chunk": ("prefill_chunk", _positive_int),
    "prefill_budget": ("prefill_budget", _positive_int),
    "itl_target_ms": ("itl_target_ms", _milliseconds_or_off),
    "prefill_order": ("prefill_order", _choice(PREFILL_ORDERS)),
    "state_dtype": ("state_dtype", _choice(DTYPE_NAMES)),
    "overlap": ("overlap", _boolean),
    "cuda_graphs": ("cuda_graphs", _boolean),
    "worker_mode": ("worker_mode", _choice(WORKER_MODES)),
}


def parse_albatross_strategy(strategy: str) -> AlbatrossBackendConfig:
    """Parse a strategy string; never raises for a bad key or value (warns and keeps the default)."""
    words = strategy.strip().split()
    if not words or words[0].lower() not in STRATEGY_WORDS:
        raise ValueError(f"not an albatross strategy: {strategy!r} (it must start with {' or '.join(STRATEGY_WORDS)})")
    values: dict[str, object] = {}
    for word in words[1:]:
        key, sep, raw = word.partition("=")
        key = key.strip().lower()
        if not sep:
            logger.warning("albatross strategy: ignoring %r (expected key=value)", word)
            continue
        if key not in _KEYS:
            logger.warning("albatross strategy: ignoring unknown key %r; known keys: %s", key, ", ".join(_KEYS))
            continue
        field_name, parse = _KEYS[key]
        value = parse(raw.strip())
        if value is None:
            logger.warning("albatross strategy: ignoring invalid value %s=%r; keeping the default", key, raw)
            continue
        values[field_name] = value
    return AlbatrossBackendConfig(**values)  # type: ignore[arg-type]


def config_field_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(AlbatrossBackendConfig))
