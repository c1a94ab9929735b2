"""The sequential WKV kernel's scaled walk (`ops.wkv7(..., rows_per_thread=2, scaled_rows=True)`,
docs/kernels.md "Scaled walk") on a GPU (skipped without one). It keeps the state rows divided by
their running decay product, so it rounds differently from the plain walk; what it must keep:

- its error against a float64 walk stays within twice the plain walk's (plus a floor of float32
  rounding), for states and outputs, over long slots that fold the product back in many times;
- decays that fold every token (down to a decay of exactly 0) give finite results as close;
- a chunk's first token, so every one-token slot, gives the plain walk's bits;
- both layouts (the shared-memory tile and direct rows) give the same bits as each other;
- a slot fed in two chunks ends close to the slot fed in one.
"""

from __future__ import annotations

import pytest
import torch

from albatross import cuda_ops, ops
from wkv_reference import assert_as_accurate_as_plain, wkv7_float64, wkv_inputs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

N = 64
DEV = "cuda"


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    results = cuda_ops.enable_cuda_kernels()
    assert results["wkv7"].how in ("prebuilt", "jit"), results["wkv7"].describe()
    assert "wkv7" in ops.registered_cuda_ops()


def _inputs(lengths: list[int], heads: int, dtype: torch.dtype, seed: int, log_decay: tuple[float, float] = (-5.0, -0.5)) -> list[torch.Tensor]:
    """r, w, k, v, a, b in a trained model's ranges, w uniform in `log_decay` (a model's range is
    [-inf, -0.5]: decays of 0.545 and up)."""
    return wkv_inputs(lengths, heads, dtype, torch.Generator(device=DEV).manual_seed(seed), device=DEV, log_decay=log_decay)


def _batch(slots: list[int], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """slot_idx and cu_seqlens of a call."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return torch.tensor(slots, dtype=torch.int32, device=DEV), cu


def _call(state: torch.Tensor, slots: list[int], lengths: list[int], inputs: list[torch.Tensor], **shape: object) -> torch.Tensor:
    y = ops.wkv7(state, *_batch(slots, lengths), *inputs, **shape)
    torch.cuda.synchronize()
    return y


PLAIN = {"rows_per_thread": 2}
SCALED = {"rows_per_thread": 2, "scaled_rows": True}


@pytest.mark.parametrize("direct", [False, True], ids=["tile", "direct"])
@pytest.mark.parametrize(
    "lengths, log_decay",
    [
        ([512], (-5.0, -0.5)),
        ([4097], (-5.0, -0.5)),
        ([300, 1, 130, 47, 2], (-5.0, -0.5)),
        ([512, 256], (-0.6, -0.5)),  # the model's fastest decays: a fold every ~22 tokens
        ([200, 64], (-3.0, 3.0)),  # faster than a model's: a fold nearly every token
        ([96], (5.0, 6.0)),  # decays of exactly 0 in float32 (exp(-e**5) underflows)
    ],
    ids=["512", "4097", "mixed", "fast", "faster", "zero"],
)
def test_the_scaled_walk_is_as_accurate_as_the_plain_walk(lengths: list[int], log_decay: tuple[float, float], direct: bool) -> None:
    heads = 2
    inputs = _inputs(lengths, heads, torch.float32, seed=sum(lengths), log_decay=log_decay)
    gen = torch.Generator(device=DEV).manual_seed(len(lengths))
    pool = len(lengths) + 2
    state = torch.randn(pool, heads, N, N, generator=gen, device=DEV) * 0.3
    slots = torch.randperm(pool, generator=gen, device=DEV).tolist()[: len(lengths)]
    want_y, want_state = wkv7_float64(state, *_batch(slots, lengths), *inputs)
    plain, scaled = state.clone(), state.clone()
    y_plain = _call(plain, slots, lengths, inputs, direct_rows=direct, **PLAIN)
    y_scaled = _call(scaled, slots, lengths, inputs, direct_rows=direct, **SCALED)
    assert torch.isfinite(y_scaled).all() and torch.isfinite(scaled).all()
    assert_as_accurate_as_plain((("state", scaled[slots], plain[slots], want_state), ("y", y_scaled, y_plain, want_y)))
    untouched = [s for s in range(pool) if s not in slots]
    assert torch.equal(scaled[untouched], state[untouched])


@pytest.mark.parametrize("act_dtype, state_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)],
                         ids=["fp32", "fp16", "bf16", "fp16-act"])  # fmt: skip
def test_a_chunks_first_token_gives_the_plain_bits(act_dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    """The first token of a chunk folds (P = 1), which is the plain step to the bit: a one-token
    slot's state and output, and every chunk's first output, equal the plain walk's; the two
    layouts of the scaled walk equal each other."""
    heads, lengths = 3, [1, 40, 1, 1, 129, 1, 2, 1]
    inputs = _inputs(lengths, heads, act_dtype, seed=5)
    gen = torch.Generator(device=DEV).manual_seed(6)
    state = (torch.randn(len(lengths), heads, N, N, generator=gen, device=DEV) * 0.3).to(state_dtype)
    slots = list(range(len(lengths)))
    plain, tile, direct = state.clone(), state.clone(), state.clone()
    y_plain = _call(plain, slots, lengths, inputs, **PLAIN)
    y_tile = _call(tile, slots, lengths, inputs, **SCALED)
    y_direct = _call(direct, slots, lengths, inputs, direct_rows=True, **SCALED)
    assert torch.equal(y_tile, y_direct) and torch.equal(tile, direct)
    firsts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]], device=DEV)
    assert torch.equal(y_tile[firsts], y_plain[firsts])
    ones = [s for s, n in enumerate(lengths) if n == 1]
    assert torch.equal(tile[ones], plain[ones])
    if state_dtype == torch.float32:  # a 16-bit state can round both walks' states to the same bits
        longer = [s for s, n in enumerate(lengths) if n > 2]
        assert not torch.equal(tile[longer], plain[longer]), "the scaled walk did not run (same bits as the plain one)"


def test_a_slot_fed_in_two_chunks_ends_where_one_chunk_does() -> None:
    heads, length, cut = 2, 600, 257
    inputs = _inputs([length], heads, torch.float32, seed=9)
    gen = torch.Generator(device=DEV).manual_seed(10)
    state = torch.randn(1, heads, N, N, generator=gen, device=DEV) * 0.3
    whole, split = state.clone(), state.clone()
    y_whole = _call(whole, [0], [length], inputs, **SCALED)
    y_first = _call(split, [0], [cut], [x[:cut] for x in inputs], **SCALED)
    y_rest = _call(split, [0], [length - cut], [x[cut:] for x in inputs], **SCALED)
    assert torch.allclose(split, whole, rtol=0, atol=2e-6)
    assert torch.allclose(torch.cat([y_first, y_rest]), y_whole, rtol=0, atol=2e-5)
