"""The fused LoRA up products + `wkv_prep` (albatross/lora_prep_triton.py) on a Hopper GPU
(skipped elsewhere): against the bmm and the CUDA `wkv_prep` op at the 7.2B block's shapes and off
the tiles, in fp16 and bf16, with and without the value residual, at every tile shape the
benchmark times (outputs differ only where fp32 sums added in another order round to a
neighbouring value); and a prefill through it against one without it."""

from __future__ import annotations

import pytest
import torch

from albatross import linear, lora_prep, ops
from albatross.lora_prep_triton import CANDIDATES, Tiles
from albatross.random_checkpoint import CheckpointShape, random_state_dict

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"),
]

DEV = "cuda"
ULP = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # one unit in the last place, relative to the largest


def _operands(rows: int, C: int, n: int, R: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)

    return {
        "hidden": randn(n, rows, R), "up": randn(n, R, C, scale=R**-0.5), "k": randn(rows, C), "v": randn(rows, C),
        "v_first": randn(rows, C) if n == 3 else None, "w0": randn(C), "a0": randn(C), "v0": randn(C) if n == 3 else None,
        "k_k": randn(C), "k_a": torch.rand(C, generator=gen, device=DEV).to(dtype),
    }  # fmt: skip


def _check(o: dict[str, torch.Tensor | None], tiles: Tiles | None = None) -> None:
    from albatross import lora_prep_triton

    hidden, up, k, v = o["hidden"], o["up"], o["k"], o["v"]
    assert hidden is not None and up is not None and k is not None and v is not None
    vectors = (o["w0"], o["a0"], o["v0"], o["k_k"], o["k_a"])
    k_want, v_want = k.clone(), v.clone()
    lora = linear.bmm(hidden, up)
    want = ops.wkv_prep(k_want, v_want, lora[-2], lora[-1], lora[0] if hidden.shape[0] == 3 else None, o["v_first"], *vectors)
    got = lora_prep_triton.lora_prep(hidden, up, k, v, o["v_first"], *vectors, tiles=tiles)
    for name, g, w in (("w", got[0], want[0]), ("-kk", got[1], want[1]), ("kk*a", got[2], want[2]), ("k", k, k_want), ("v", v, v_want)):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        differ = (g != w).double().mean().item()
        worst = ((g.double() - w.double()).abs().max() / w.double().abs().max()).item()
        assert differ <= 0.01 and worst <= 2 * ULP[k.dtype], (name, differ, worst)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "C", "n", "R"), [(4097, 4096, 3, 128), (4096, 4096, 2, 128), (1, 512, 3, 64), (300, 2560, 3, 96), (65, 768, 2, 40)])
def test_matches_the_bmm_and_wkv_prep(rows: int, C: int, n: int, R: int, dtype: torch.dtype) -> None:
    _check(_operands(rows, C, n, R, dtype, seed=rows + n))


@pytest.mark.parametrize("tiles", CANDIDATES, ids=Tiles.label)
def test_every_tile_shape_the_benchmark_times(tiles: Tiles) -> None:
    _check(_operands(1500, 1024, 3, 128, torch.float16, seed=CANDIDATES.index(tiles)), tiles)


def test_a_prefill_through_it_matches_one_without(monkeypatch: pytest.MonkeyPatch) -> None:
    from albatross import lora_prep_triton
    from albatross.model import RWKV7

    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(n_layer=3, n_embd=512), seed=10, device=DEV), DEV, progress=False)
    prompts = [[(5 * i + 11 * s) % 60000 + 1 for i in range(600)] for s in range(2)]  # 1,200 rows: over the threshold
    calls: list[int] = []
    real = lora_prep_triton.lora_prep
    monkeypatch.setattr(lora_prep_triton, "lora_prep", lambda hidden, *rest, **kw: calls.append(hidden.shape[0]) or real(hidden, *rest, **kw))
    outputs = []
    for enabled in (True, False):
        lora_prep.set_fused_allowed(enabled)
        try:
            pool = model.new_pool(2)
            outputs.append((model.forward(pool, [0, 1], prompts), pool.wkv.clone()))
        finally:
            lora_prep.set_fused_allowed(lora_prep.FUSED_BY_DEFAULT)
    assert calls == [2, 3, 3], calls  # block 0 stacks two LoRAs, the others three
    (got, got_state), (expected, expected_state) = outputs
    rel = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    assert rel < 1e-3, f"logits relative difference {rel:.2e} (the same roundings: only the sums' order differs)"
    state_rel = ((got_state.float() - expected_state.float()).norm() / expected_state.float().norm()).item()
    assert state_rel < 1e-3, state_rel


def test_the_prefix_cache_captures_through_it_match_those_without() -> None:
    """forward_saving's states at its cuts, with the fused kernel and without."""
    from albatross.model import RWKV7

    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(n_layer=2, n_embd=512), seed=12, device=DEV), DEV, progress=False)
    prompts = [[(3 * i + 7 * s) % 60000 + 1 for i in range(700)] for s in range(2)]
    captured = []
    for enabled in (True, False):
        lora_prep.set_fused_allowed(enabled)
        try:
            _, states = model.forward_saving(model.new_pool(2), [0, 1], prompts, [[256, 512], [256]])
            captured.append(states)
        finally:
            lora_prep.set_fused_allowed(lora_prep.FUSED_BY_DEFAULT)
    for got_slot, want_slot in zip(*captured):
        assert len(got_slot) == len(want_slot) > 0
        for got, want in zip(got_slot, want_slot):
            rel = ((got.wkv.float() - want.wkv.float()).norm() / want.wkv.float().norm()).item()
            assert rel < 1e-3, rel


def test_the_engine_builds_it_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeviceStep.warm_long_prefill runs a prompt long enough for the fused kernel (block 0's
    build and the others') before any task holds a slot, and leaves slot 0 zero."""
    from albatross import lora_prep_triton
    from albatross.model import RWKV7
    from albatross_engine.device_step import DeviceStep

    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(n_layer=2, n_embd=512), seed=9, device=DEV), DEV, progress=False)
    calls: list[int] = []
    real = lora_prep_triton.lora_prep
    monkeypatch.setattr(lora_prep_triton, "lora_prep", lambda hidden, *rest, **kw: calls.append(hidden.shape[0]) or real(hidden, *rest, **kw))
    lora_prep.set_fused_allowed(True)
    try:
        step = DeviceStep(model, batch_size=2, state_dtype="fp16", cuda_graphs=False)
        step.warm_long_prefill(prefill_budget=lora_prep.MIN_ROWS - 1)
        assert calls == [], calls
        step.warm_long_prefill(prefill_budget=16384)
        assert calls == [2, 3], calls  # block 0 stacks two LoRAs, block 1 three
        assert not step.pool.read(0).wkv.any()
    finally:
        lora_prep.set_fused_allowed(lora_prep.FUSED_BY_DEFAULT)
