"""The backend registry: which factory serves a strategy, chosen by the strategy's first word.

The runner never imports a backend module up front; `load_factory` imports the one a strategy asks
for when a model is loaded, so a backend whose dependencies are missing only fails when chosen.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from runner.interface import AbstractRWKV

if TYPE_CHECKING:
    from runner.settings import ServerSettings

BackendFactory = Callable[[str, str, "ServerSettings"], AbstractRWKV]


@dataclass(frozen=True, slots=True)
class BackendEntry:
    name: str
    first_words: tuple[str, ...]  # lower-case first words of the strategies it serves
    factory: str  # "module:function"
    default_strategy: str
    # "module:function"s called in turn with (model path, strategy) BEFORE the serving backend is
    # shut down: they raise LoadRefused for what can be known without loading (a bad strategy, a
    # file that is not a checkpoint), so a refused switch leaves the old model serving.
    preflight: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for spec in (self.factory, *self.preflight):
            if ":" not in spec:
                raise ValueError(f"factory and preflight must be 'module:function', got {spec!r}")

    @property
    def module_name(self) -> str:
        return self.factory.partition(":")[0]


class UnknownStrategy(ValueError):
    pass


class BackendLoadError(RuntimeError):
    pass


# The Albatross engine parses the rest of its strategy itself (albatross_engine/config.py).
ALBATROSS_STRATEGY_WORDS: tuple[str, ...] = ("albatross", "chirrup")


class LoadRefused(ValueError):
    """A load that cannot succeed, found before anything was unloaded (400 naming `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


BACKENDS: tuple[BackendEntry, ...] = (
    BackendEntry(
        "albatross",
        ALBATROSS_STRATEGY_WORDS,
        "albatross_engine.adapter:create_backend",
        "albatross workers=1 batch=32",
        preflight=("albatross_engine.preflight:check_load",),
    ),
    BackendEntry(
        "classic",
        ("cpu", "cuda"),
        "runner.classic_backend:create_backend",
        "cpu fp32",
        # the checkpoint check is the model's knowledge: the engine package holds it for both
        preflight=("runner.classic_backend:check_load", "albatross_engine.preflight:check_checkpoint"),
    ),
)


def first_word(strategy: str) -> str:
    words = strategy.split()
    return words[0].lower() if words else ""


def known_first_words(registry: Sequence[BackendEntry] = BACKENDS) -> list[str]:
    return [word for entry in registry for word in entry.first_words]


def find_backend(strategy: str, registry: Sequence[BackendEntry] = BACKENDS) -> BackendEntry:
    word = first_word(strategy)
    for entry in registry:
        if word in entry.first_words:
            return entry
    raise UnknownStrategy(
        f"unknown strategy {strategy!r}: its first word must be one of {', '.join(known_first_words(registry))}"
    )


def is_importable(entry: BackendEntry) -> bool:
    try:
        return importlib.util.find_spec(entry.module_name) is not None
    except (ImportError, ValueError):
        return False


def default_strategy(registry: Sequence[BackendEntry] = BACKENDS) -> str:
    """The first registered backend whose module exists (Albatross once it lands, else classic)."""
    for entry in registry:
        if is_importable(entry):
            return entry.default_strategy
    return registry[-1].default_strategy


def _load_callable(entry: BackendEntry, spec: str) -> Callable[..., object]:
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing a backend is a load error, not a crash
        raise BackendLoadError(f"the {entry.name} backend cannot be imported ({module_name}): {exc}") from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        raise BackendLoadError(f"{spec} is not callable")
    return function


def load_factory(entry: BackendEntry) -> BackendFactory:
    return cast(BackendFactory, _load_callable(entry, entry.factory))


def preflight(entry: BackendEntry, model_path: str, strategy: str) -> None:
    """The entry's checks before a switch (see BackendEntry.preflight); raises LoadRefused."""
    for spec in entry.preflight:
        _load_callable(entry, spec)(model_path, strategy)
