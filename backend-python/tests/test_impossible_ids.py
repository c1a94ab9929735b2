"""A random checkpoint written with impossible ids gives those ids the logit -100 for every input,
in our model and in the official `rwkv` package alike, so no server can sample them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from albatross.model import RWKV7
from albatross.random_checkpoint import (
    IMPOSSIBLE_LOGIT,
    UNDEFINED_IDS,
    CheckpointShape,
    parse_ids,
    random_state_dict,
    write_random_checkpoint,
)
from runner.classic_backend import rwkv_model_module

ReferenceRWKV = rwkv_model_module().RWKV

SHAPE = CheckpointShape(n_layer=2, n_embd=128)
IDS = (0, *UNDEFINED_IDS)


@pytest.fixture(scope="module")
def safe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("safe") / "safe.pth", SHAPE, seed=4, impossible_ids=IDS)


def _prompts(count: int, length: int) -> list[list[int]]:
    return torch.randint(0, 65536, (count, length), generator=torch.Generator().manual_seed(9)).tolist()


def test_parse_ids_reads_ranges_and_single_ids() -> None:
    assert parse_ids("0,65530-65535") == IDS
    assert parse_ids("") == ()


def test_our_model_gives_the_ids_the_impossible_logit_at_every_position(safe_checkpoint: Path) -> None:
    model = RWKV7.load(safe_checkpoint, progress=False)
    pool = model.new_pool(4)
    prompts = _prompts(3, 40)
    logits = model.forward(pool, [0, 1, 2], prompts, full_output=True)
    rows = torch.cat(logits)
    assert torch.equal(rows[:, list(IDS)], torch.full((rows.shape[0], len(IDS)), IMPOSSIBLE_LOGIT))
    others = rows[:, 1:65530]
    assert others.max(dim=-1).values.min() > IMPOSSIBLE_LOGIT + 50, "some position's logits came near -100"
    for _ in range(8):  # greedy decode never reaches them
        step = model.forward(pool, [0, 1, 2], [[t] for t in rows[-3:].argmax(-1).tolist()])
        assert not set(step.argmax(-1).tolist()) & set(IDS)
        assert torch.equal(step[:, list(IDS)], torch.full((3, len(IDS)), IMPOSSIBLE_LOGIT))
        rows = step


def test_the_official_package_sees_the_same_impossible_logits(safe_checkpoint: Path) -> None:
    reference = ReferenceRWKV(model=str(safe_checkpoint.with_suffix("")), strategy="cpu fp32")
    logits, state = reference.forward(_prompts(1, 30)[0], None)
    for token in (5, 17, 65529):
        assert torch.allclose(logits[list(IDS)].float(), torch.full((len(IDS),), IMPOSSIBLE_LOGIT))
        logits, state = reference.forward([token], state)


def test_only_the_final_norm_channel_and_the_head_change() -> None:
    plain = random_state_dict(SHAPE, seed=4)
    safe = random_state_dict(SHAPE, seed=4, impossible_ids=IDS)
    changed = sorted(key for key in plain if not torch.equal(plain[key], safe[key]))
    assert changed == ["head.weight", "ln_out.bias", "ln_out.weight"]
    assert torch.equal(plain["ln_out.weight"][1:], safe["ln_out.weight"][1:])
    keep = [i for i in range(65536) if i not in IDS]
    assert torch.equal(plain["head.weight"][keep, 1:], safe["head.weight"][keep, 1:])


def test_ids_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(ValueError, match="impossible ids"):
        random_state_dict(SHAPE, impossible_ids=[65536])


def test_block_zero_value_weights_are_added_and_ignored_by_both_models(tmp_path: Path) -> None:
    """`layer0_value_weights` (for RWKV-Runner's Albatross, which reads them at load) adds block 0's
    att.v0/v1/v2 and changes no other weight; our model and the official package ignore them."""
    plain = random_state_dict(SHAPE, seed=4, impossible_ids=IDS)
    full = random_state_dict(SHAPE, seed=4, impossible_ids=IDS, layer0_value_weights=True)
    added = sorted(set(full) - set(plain))
    assert added == ["blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2"]
    assert all(torch.equal(plain[key], full[key]) for key in plain)
    assert all(full[key].abs().sum() > 0 for key in added)  # random, not zeros: ignoring them is what is tested
    with_them = write_random_checkpoint(tmp_path / "full.pth", SHAPE, seed=4, impossible_ids=IDS, layer0_value_weights=True)
    without = write_random_checkpoint(tmp_path / "plain.pth", SHAPE, seed=4, impossible_ids=IDS)
    prompt = _prompts(1, 24)
    ours = [RWKV7.load(path, progress=False) for path in (with_them, without)]
    logits = [model.forward(model.new_pool(1), [0], prompt) for model in ours]
    assert torch.equal(logits[0], logits[1])
    official = [ReferenceRWKV(model=str(path.with_suffix("")), strategy="cpu fp32").forward(prompt[0], None)[0] for path in (with_them, without)]
    assert torch.equal(official[0], official[1])
    assert torch.allclose(logits[0][0].float(), official[0].float(), atol=2e-3, rtol=1e-3)
