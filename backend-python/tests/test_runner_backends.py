"""The backend registry and the model manager: strategies, loading, switching, status."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

import runner_fakes
from runner.backends import BACKENDS, BackendEntry, BackendLoadError, UnknownStrategy, default_strategy, find_backend, load_factory
from runner.errors import ApiError
from runner.model_manager import ModelManager, ModelStatus, SwitchInProgress
from runner_fakes import TEST_REGISTRY, settings_with


@pytest.mark.parametrize(("strategy", "backend"), [("albatross workers=2", "albatross"), ("chirrup", "albatross"), ("cpu fp32", "classic"), ("CUDA fp16 *10 -> cpu fp32", "classic")])
def test_a_strategy_is_served_by_the_backend_of_its_first_word(strategy: str, backend: str) -> None:
    assert find_backend(strategy).name == backend


def test_an_unknown_strategy_lists_the_known_first_words() -> None:
    with pytest.raises(UnknownStrategy, match="albatross, chirrup, cpu, cuda"):
        find_backend("tpu bf16")


def test_default_strategy_falls_back_to_classic_when_albatross_cannot_be_imported() -> None:
    missing = BackendEntry("albatross", ("albatross",), "no_such_module_here:create_backend", "albatross workers=1 batch=32")
    assert default_strategy((missing, BACKENDS[1])) == "cpu fp32"
    present = BackendEntry("albatross", ("albatross",), "runner_fakes:create_backend", "albatross workers=1 batch=32")
    assert default_strategy((present, BACKENDS[1])) == "albatross workers=1 batch=32"


def test_an_import_failure_becomes_a_load_error_naming_the_reason() -> None:
    broken = BackendEntry("broken", ("broken",), "no_such_module_here:create_backend", "broken")
    with pytest.raises(BackendLoadError, match="no_such_module_here"):
        load_factory(broken)


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    for name in ("first", "second"):
        (tmp_path / f"{name}.pth").write_bytes(b"weights")
    return tmp_path


def manager_for(models_dir: Path) -> ModelManager:
    return ModelManager(settings_with(models_dir=models_dir), TEST_REGISTRY)


def test_switching_loads_resolves_paths_and_shuts_the_old_backend_down_first(models_dir: Path) -> None:
    manager = manager_for(models_dir)

    async def scenario() -> None:
        await manager.switch("first", "fake")
        first = manager.backend
        assert manager.status is ModelStatus.WORKING and first is not None and first.name == "first"
        assert manager.model_path == str(models_dir / "first.pth")
        await manager.switch(str(models_dir / "second.pth"), "fake concurrent")
        assert isinstance(first, runner_fakes.ScriptedBackend) and first.shutdown_calls == 1
        assert manager.backend is not None and manager.backend.name == "second" and manager.backend.concurrent
        await manager.switch("", "")
        assert manager.status is ModelStatus.OFFLINE and manager.backend is None

    asyncio.run(scenario())


def test_a_switch_while_loading_is_refused(models_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = manager_for(models_dir)
    release = threading.Event()
    real_factory = runner_fakes.create_backend

    def slow_factory(*args: object) -> runner_fakes.ScriptedBackend:
        release.wait(5)
        return real_factory(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(runner_fakes, "create_backend", slow_factory)

    async def scenario() -> None:
        loading = asyncio.create_task(manager.switch("first", "fake"))
        await asyncio.sleep(0.05)
        assert manager.status is ModelStatus.LOADING
        with pytest.raises(SwitchInProgress):
            await manager.switch("second", "fake")
        release.set()
        await loading
        assert manager.status is ModelStatus.WORKING

    asyncio.run(scenario())


def test_a_failed_load_is_a_500_and_leaves_the_server_offline(models_dir: Path) -> None:
    manager = manager_for(models_dir)

    async def scenario() -> None:
        await manager.switch("first", "fake")
        with pytest.raises(ApiError) as failure:
            await manager.switch("second", "fake explode")
        assert failure.value.status_code == 500 and failure.value.message.startswith("failed to load: the scripted load failed")
        assert "no model is loaded now" in failure.value.message
        assert manager.status is ModelStatus.OFFLINE and manager.backend is None

    asyncio.run(scenario())


@pytest.mark.parametrize(("model", "strategy", "status"), [("first.gguf", "fake", 400), ("absent", "fake", 404), ("first", "tpu", 400)])
def test_bad_switches_are_refused_before_anything_is_unloaded(models_dir: Path, model: str, strategy: str, status: int) -> None:
    manager = manager_for(models_dir)

    async def scenario() -> None:
        await manager.switch("first", "fake")
        with pytest.raises(ApiError) as refusal:
            await manager.switch(model, strategy)
        assert refusal.value.status_code == status
        assert manager.status is ModelStatus.WORKING and manager.backend is not None and manager.backend.name == "first"

    asyncio.run(scenario())


def test_update_config_overrides_the_backend_defaults_and_survives_a_switch(models_dir: Path) -> None:
    manager = manager_for(models_dir)

    async def scenario() -> None:
        manager.update_config({"temperature": 0.5, "top_k": 9})
        await manager.switch("first", "fake")
        defaults = manager.sampling_defaults()
        assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.5, 9, 0.3)
        with pytest.raises(ApiError, match="--max-tokens"):
            manager.update_config({"max_tokens": 10**9})

    asyncio.run(scenario())
