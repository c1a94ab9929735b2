"""The albatross strategy string, as the runner documents it."""

from __future__ import annotations

import logging

import pytest

from albatross_engine.config import AlbatrossBackendConfig, is_albatross_strategy, parse_albatross_strategy


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("albatross", True),
        ("chirrup", True),
        ("  Albatross workers=2", True),
        ("CHIRRUP batch=8", True),
        ("cuda fp16", False),
        ("cpu fp32", False),
        ("albatrossx", False),
        ("", False),
    ],
)
def test_a_strategy_is_albatross_when_its_first_word_is_albatross_or_chirrup(strategy: str, expected: bool) -> None:
    assert is_albatross_strategy(strategy) is expected


def test_the_bare_word_gives_the_documented_defaults() -> None:
    assert parse_albatross_strategy("albatross") == AlbatrossBackendConfig(worker_num=1, batch_size=32)
    assert parse_albatross_strategy("chirrup") == AlbatrossBackendConfig()


@pytest.mark.parametrize(
    ("strategy", "workers", "batch"),
    [
        ("albatross workers=2 batch=64", 2, 64),
        ("albatross worker=3", 3, 32),
        ("albatross worker_num=4 batch_size=8", 4, 8),
        ("chirrup batch=1", 1, 1),
        ("albatross BATCH=16", 1, 16),
    ],
)
def test_workers_and_batch_accept_their_aliases(strategy: str, workers: int, batch: int) -> None:
    config = parse_albatross_strategy(strategy)
    assert (config.worker_num, config.batch_size) == (workers, batch)


@pytest.mark.parametrize(
    "strategy",
    [
        "albatross workers=0",
        "albatross workers=-1",
        "albatross workers=two",
        "albatross batch=1.5",
        "albatross batch=",
        "albatross colour=blue",
        "albatross lonely",
        "albatross prefill_chunk=0",
        "albatross dtype=fp8",
        "albatross device=tpu",
        "albatross itl_target_ms=-5",
        "albatross itl_target_ms=soon",
        "albatross itl_target_ms=inf",
        "albatross prefill_order=longest",
    ],
)
def test_an_invalid_value_or_unknown_key_is_ignored_with_a_warning(strategy: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="albatross_engine.config"):
        config = parse_albatross_strategy(strategy)
    assert config == AlbatrossBackendConfig(), f"{strategy!r} should leave the defaults, got {config}"
    assert caplog.records, f"{strategy!r} should log a warning"


def test_a_bad_word_does_not_spoil_the_good_ones() -> None:
    config = parse_albatross_strategy("albatross workers=x batch=12 nonsense=1")
    assert (config.worker_num, config.batch_size) == (1, 12)


def test_optional_device_dtype_and_prefill_settings() -> None:
    config = parse_albatross_strategy("albatross device=cuda:1 dtype=bf16 prefill_chunk=256 state_dtype=fp16 overlap=0")
    assert config.device == "cuda:1"
    assert config.dtype == "bf16"
    assert config.prefill_chunk == 256
    assert config.state_dtype == "fp16"
    assert config.overlap is False
    assert parse_albatross_strategy("albatross device=2").device == "cuda:2", "a bare index names a GPU"
    assert parse_albatross_strategy("albatross device=cpu").device == "cpu"


def test_the_inter_token_target_of_the_adaptive_prefill_budget() -> None:
    assert AlbatrossBackendConfig().itl_target_s is None, "off by default (the static budget)"
    assert parse_albatross_strategy("albatross itl_target_ms=90.5").itl_target_s == pytest.approx(0.0905)
    for off in ("0", "off", "OFF", "none"):
        config = parse_albatross_strategy(f"albatross itl_target_ms={off}")
        assert config.itl_target_ms == 0 and config.itl_target_s is None, f"{off!r} turns it off"
    with pytest.raises(ValueError, match="itl_target_ms"):
        AlbatrossBackendConfig(itl_target_ms=-1.0)
    with pytest.raises(ValueError, match="itl_target_ms"):
        AlbatrossBackendConfig(itl_target_ms=float("nan"))


def test_the_prefill_order() -> None:
    assert AlbatrossBackendConfig().prefill_order == "shortest", "the fewest prompt tokens left first by default"
    assert parse_albatross_strategy("albatross prefill_order=Arrival").prefill_order == "arrival"
    with pytest.raises(ValueError, match="prefill_order"):
        AlbatrossBackendConfig(prefill_order="fifo")


def test_a_non_albatross_strategy_is_refused() -> None:
    with pytest.raises(ValueError, match="not an albatross strategy"):
        parse_albatross_strategy("cuda fp16")


def test_the_config_validates_itself() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        AlbatrossBackendConfig(batch_size=0)
