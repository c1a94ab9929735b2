"""albatross_engine.allocator: expandable segments turned on once, unless the user configured the
CUDA allocator. (The setting itself parses on a CPU-only torch too; the GPU suite's memory-plan
test shows what it does to reserved memory.)"""

from __future__ import annotations

import pytest
import torch

from albatross_engine import allocator


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(allocator, "_done", False)
    for name in allocator.ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    return calls


def test_expandable_segments_are_set_once(fresh: list[str]) -> None:
    assert allocator.use_expandable_segments() and allocator.use_expandable_segments()
    assert fresh == ["expandable_segments:True"]


@pytest.mark.parametrize("name", allocator.ALLOCATOR_ENV)
def test_a_users_allocator_configuration_is_left_alone(fresh: list[str], monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "max_split_size_mb:512")
    assert not allocator.use_expandable_segments() and fresh == []
