"""The one-launch decode WKV step on a GPU (skipped without one): the 7.2B width (64 heads) in fp16
and bf16 at 1-4 rows, fp16 and fp32 states, against the three CUDA ops; deterministic and
replayable from a CUDA graph; and decode through it (eager and from graphs), alone and with the
other batch-1 Triton paths, against decode without them."""

from __future__ import annotations

import pytest
import torch

from albatross import cuda_ops, loras, norm_mix, ops, wkv_decode
from decode_paths import assert_decode_matches_without, assert_graph_replays

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

DEV = "cuda"
N = 64
# Of the largest value: both sides compute in fp32 and round each stored value once; the sums
# (the kk norm, S @ a, S @ r, the group norm) are added in another order.
TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 3.2e-2}


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    results = cuda_ops.enable_cuda_kernels()
    for name in ("wkv7", "fused"):
        assert results[name].how in ("prebuilt", "jit"), results[name].describe()


def _operands(slots: list[int], H: int, block0: bool, dtype: torch.dtype, state_dtype: torch.dtype, seed: int) -> dict[str, object]:
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0, like: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEV) * scale + shift).to(like)

    rows, C = len(slots), H * N
    lora = randn(3, rows, C, scale=0.5)
    return {
        "mix": randn(3, rows, C), "g": torch.sigmoid(randn(rows, C, like=torch.float32)).to(dtype),
        "w_lora": lora[1], "a_lora": lora[2], "v_lora": None if block0 else lora[0],
        "v_first": None if block0 else randn(rows, C), "w0": randn(C, scale=0.5, shift=-1.0), "a0": randn(C, scale=0.5),
        "v0": None if block0 else randn(C, scale=0.5), "k_k": randn(C, scale=0.2, shift=0.8), "k_a": randn(C, scale=0.2, shift=1.0),
        "r_k": randn(C, scale=0.3), "ln_w": randn(C, scale=0.3, shift=1.0), "ln_b": randn(C, scale=0.1),
        "state": randn(8, H, N, N, scale=0.5, like=state_dtype), "batch": ops.FlatBatch.build(slots, [1] * rows, torch.device(DEV)),
    }  # fmt: skip


def _run(o: dict[str, object], fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mix, state = o["mix"].clone(), o["state"].clone()  # type: ignore[attr-defined]
    r, k, v = mix.unbind(0)
    wkv_decode.set_fused_allowed(fused)
    try:
        assert wkv_decode.fused_applies(k, o["batch"]) == fused  # type: ignore[arg-type]
        run = wkv_decode.prep_wkv_gate if fused else wkv_decode.prep_wkv_gate_torch
        out = run(state, o["batch"], (r, k, v), *_rest(o))  # type: ignore[arg-type]
    finally:
        wkv_decode.set_fused_allowed(wkv_decode.FUSED_BY_DEFAULT)
    return out, mix, state


def _rest(o: dict[str, object]) -> tuple[object, ...]:
    """The arguments after (r, k, v): the gate, the LoRA outputs, v_first and the block's vectors."""
    weights = wkv_decode.StepWeights(o["w0"], o["a0"], o["v0"], o["k_k"], o["k_a"], o["r_k"], o["ln_w"], o["ln_b"])  # type: ignore[arg-type]
    return o["g"], (o["v_lora"], o["w_lora"], o["a_lora"]), o["v_first"], weights


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert error <= TOLERANCE[dtype], f"error {error:.2e}"


@pytest.mark.parametrize("dtype, state_dtype", [(torch.float16, torch.float16), (torch.float16, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("slots", [[0], [5, 2], [7, 0, 3], [1, 6, 4, 2]])
@pytest.mark.parametrize("block0", [False, True])
def test_the_7b_width_matches_the_three_ops(slots: list[int], block0: bool, dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    o = _operands(slots, 64, block0, dtype, state_dtype, seed=len(slots) + 10 * block0)
    got, got_mix, got_state = _run(o, fused=True)
    want, want_mix, want_state = _run(o, fused=False)
    _close(got, want, dtype)
    _close(got_mix, want_mix, dtype)  # r untouched, k and v updated in place
    _close(got_state[slots], want_state[slots], dtype)  # an fp32 state holds values computed from rounded inputs
    untouched = [s for s in range(8) if s not in slots]
    assert torch.equal(got_state[untouched], o["state"][untouched])  # type: ignore[index]


def test_results_are_deterministic_and_replay_from_a_cuda_graph() -> None:
    o = _operands([3], 64, False, torch.float16, torch.float16, seed=9)
    first = _run(o, fused=True)
    for _ in range(3):
        again = _run(o, fused=True)
        assert all(torch.equal(a, b) for a, b in zip(again, first))

    def op(d: dict[str, object]) -> torch.Tensor:
        r, k, v = d["mix"].unbind(0)  # type: ignore[attr-defined]
        return wkv_decode.prep_wkv_gate(d["state"], d["batch"], (r, k, v), *_rest(d))  # type: ignore[arg-type]

    wkv_decode.set_fused_allowed(True)
    try:
        assert_graph_replays(op, o, ("mix", "state"))
    finally:
        wkv_decode.set_fused_allowed(wkv_decode.FUSED_BY_DEFAULT)


@pytest.mark.parametrize("others", [False, True], ids=["alone", "with the other batch-1 paths"])
def test_decode_through_the_kernel_matches_decode_without_it(others: bool) -> None:
    assert_decode_matches_without([wkv_decode, norm_mix, loras] if others else [wkv_decode])
