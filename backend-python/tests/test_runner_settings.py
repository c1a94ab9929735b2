"""CLI flags, their RWKV_* environment twins, and the rwkv_lightning engine spelling."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.settings import ServerSettings, settings_from_args


def test_defaults_match_the_documented_ones() -> None:
    settings = settings_from_args([], environ={"XDG_DATA_HOME": "/data"})
    assert (settings.host, settings.port, settings.password, settings.strategy) == ("127.0.0.1", 8000, None, None)
    assert settings.max_batch_items == 4096 and settings.max_body_bytes == 4 * 1024 * 1024
    assert settings.models_dir == Path("models")
    assert settings.state_cache_path == Path("/data/rwkv-albatross/states.sqlite3")


def test_state_cache_defaults_to_the_home_data_dir_without_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    settings = settings_from_args([], environ={})
    assert settings.state_cache_path == tmp_path / ".local/share/rwkv-albatross/states.sqlite3"


def test_every_flag_has_an_env_twin_and_the_flag_wins() -> None:
    environ = {"RWKV_PORT": "9100", "RWKV_PASSWORD": "pw", "RWKV_WEBUI": "yes", "RWKV_MAX_BODY_BYTES": "2MiB", "RWKV_CORS_ORIGINS": "http://a, http://b"}
    from_env = settings_from_args([], environ=environ)
    assert (from_env.port, from_env.password, from_env.webui, from_env.max_body_bytes) == (9100, "pw", True, 2 * 1024 * 1024)
    assert from_env.cors_origins == ("http://a", "http://b")
    from_flag = settings_from_args(["--port", "9200", "--max-body-bytes", "1024"], environ=environ)
    assert (from_flag.port, from_flag.max_body_bytes) == (9200, 1024)


def test_model_strategy_and_limits_come_from_flags() -> None:
    settings = settings_from_args(
        ["--model-path", "m.pth", "--strategy", "cpu fp32", "--max-tokens", "64", "--max-prompt-tokens", "128", "--deploy", "--state-l2-bytes", "1G"],
        environ={},
    )
    assert (settings.model_path, settings.strategy, settings.max_tokens, settings.max_prompt_tokens) == ("m.pth", "cpu fp32", 64, 128)
    assert settings.deploy is True and settings.state_l2_bytes == 1024**3


@pytest.mark.parametrize("spelling", ["--inference-engine", "--backend"])
def test_rwkv_lightning_engine_fp16_means_the_albatross_strategy(spelling: str) -> None:
    assert settings_from_args([spelling, "fp16"], environ={}).strategy == "albatross workers=1 batch=32"


def test_an_unknown_engine_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        settings_from_args(["--inference-engine", "vllm"], environ={})
    assert "'vllm' is not available here; known: fp16" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "named"), [(["--port", "http"], "--port"), (["--max-tokens", "0"], "--max-tokens"), ([], "RWKV_MAX_BATCH_ITEMS")])
def test_a_bad_value_exits_naming_the_flag(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        settings_from_args(argv, environ={"RWKV_MAX_BATCH_ITEMS": "-2"} if not argv else {})
    assert named in capsys.readouterr().err


def test_settings_are_frozen() -> None:
    with pytest.raises(AttributeError):
        ServerSettings().port = 1  # type: ignore[misc]


def test_reliability_flags_and_their_twins() -> None:
    defaults = settings_from_args([], environ={})
    assert (defaults.request_read_timeout, defaults.max_queued_requests, defaults.log_format) == (30.0, None, "text")
    given = settings_from_args(["--request-read-timeout", "2.5", "--max-queued-requests", "0", "--log-format", "json"], environ={})
    assert (given.request_read_timeout, given.max_queued_requests, given.log_format) == (2.5, 0, "json")
    twins = settings_from_args([], environ={"RWKV_REQUEST_READ_TIMEOUT": "0", "RWKV_MAX_QUEUED_REQUESTS": "12", "RWKV_LOG_FORMAT": "json"})
    assert (twins.request_read_timeout, twins.max_queued_requests, twins.log_format) == (0.0, 12, "json")


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--request-read-timeout", "-1"], "--request-read-timeout"), (["--request-read-timeout", "inf"], "--request-read-timeout"),
     (["--max-queued-requests", "-3"], "--max-queued-requests"), (["--log-format", "xml"], "log_format")],
)
def test_bad_reliability_values_exit_naming_the_flag(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        settings_from_args(argv, environ={})
    assert named in capsys.readouterr().err
