"""The one-launch layer norm + token-shift mix on a GPU (skipped without one): the 7.2B width in
fp16 and bf16 at 1-4 rows against the two CUDA ops, deterministic and replayable from a CUDA
graph, and decode through it (eager and from graphs) against decode without it."""

from __future__ import annotations

import pytest
import torch

from albatross import cuda_ops, norm_mix, ops
from decode_paths import assert_decode_matches_without, assert_graph_replays

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

DEV = "cuda"
# Of the largest value: both sides round each stored result once; only the norm's sums are
# added in another order.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    results = cuda_ops.enable_cuda_kernels()
    assert results["fused"].how in ("prebuilt", "jit"), results["fused"].describe()


def _operands(slots: list[int], C: int, K: int, with_delta: bool, dtype: torch.dtype, seed: int) -> dict[str, object]:
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEV) * scale + shift).to(dtype)

    rows = len(slots)
    return {
        "x": randn(rows, C, scale=2.0, shift=0.5), "delta": randn(rows, C) if with_delta else None,
        "weight": randn(C, scale=0.5, shift=1.0), "bias": randn(C, scale=0.2),
        "shift_state": randn(8, C),
        "coefficients": torch.rand(K, C, generator=gen, device=DEV).to(dtype) if K else torch.rand(C, generator=gen, device=DEV).to(dtype),
        "batch": ops.FlatBatch.build(slots, [1] * rows, torch.device(DEV)),
    }  # fmt: skip


def _run(operands: dict[str, object], fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = operands["x"].clone()  # type: ignore[attr-defined]
    shift = operands["shift_state"].clone()  # type: ignore[attr-defined]
    args = (operands["delta"], operands["weight"], operands["bias"], shift, operands["batch"], operands["coefficients"])
    norm_mix.set_fused_allowed(fused)
    try:
        assert norm_mix.fused_applies(x, operands["batch"]) == fused  # type: ignore[arg-type]
        if fused:
            residual, out = norm_mix.norm_mix(x, *args)  # type: ignore[arg-type]
            assert residual is x, "the Triton form updates x in place"
        else:
            out = norm_mix.norm_mix_torch(x, *args)  # type: ignore[arg-type]
    finally:
        norm_mix.set_fused_allowed(norm_mix.FUSED_BY_DEFAULT)
    return out, x, shift


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert error <= TOLERANCE[dtype], f"error {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slots", [[0], [5, 2], [7, 0, 3], [1, 6, 4, 2]])
@pytest.mark.parametrize("K, with_delta", [(6, True), (0, True), (6, False)])
def test_the_7b_width_matches_the_two_ops(slots: list[int], K: int, with_delta: bool, dtype: torch.dtype) -> None:
    operands = _operands(slots, 4096, K, with_delta, dtype, seed=len(slots) + K)
    got, got_x, got_shift = _run(operands, fused=True)
    want, want_x, want_shift = _run(operands, fused=False)
    assert torch.equal(got_x, want_x), "x += delta is rounded once, as the CUDA op stores it"
    _close(got, want, dtype)
    _close(got_shift, want_shift, dtype)
    untouched = [s for s in range(8) if s not in slots]
    assert torch.equal(got_shift[untouched], operands["shift_state"][untouched])  # type: ignore[index]


def test_results_are_deterministic_and_replay_from_a_cuda_graph() -> None:
    operands = _operands([3], 4096, 6, True, torch.float16, seed=9)
    first = _run(operands, fused=True)
    for _ in range(3):
        again = _run(operands, fused=True)
        assert all(torch.equal(a, b) for a, b in zip(again, first))

    def op(o: dict[str, object]) -> torch.Tensor:
        return norm_mix.norm_mix(o["x"], o["delta"], o["weight"], o["bias"], o["shift_state"], o["batch"], o["coefficients"])[1]  # type: ignore[arg-type]

    norm_mix.set_fused_allowed(True)
    try:
        assert_graph_replays(op, operands, ("x", "shift_state"))
    finally:
        norm_mix.set_fused_allowed(norm_mix.FUSED_BY_DEFAULT)


def test_decode_through_the_kernel_matches_decode_without_it() -> None:
    assert_decode_matches_without([norm_mix])
