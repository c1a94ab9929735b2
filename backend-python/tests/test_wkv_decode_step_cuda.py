"""The CUDA `wkv_decode_step` op on a GPU (skipped without one): bit-identical to the three ops it
replaces (`wkv_prep`, the WKV op's decode kernel, `gn_bonus_gate`) for every activation and state
dtype, 1 to 960 rows, both block kinds, shuffled slots, and the 7.2B width; replayable from a CUDA
graph; a model decoding through it gives the same logits, bit for bit, eagerly and from graphs,
as without it; and its argument checks raise instead of reading out of bounds."""

from __future__ import annotations

import pytest
import torch

from albatross import cuda_ops, ops, wkv_decode
from decode_paths import assert_decode_identical, assert_graph_replays

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

DEV = "cuda"
N = ops.HEAD_SIZE


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    results = cuda_ops.enable_cuda_kernels()
    for name in ("wkv7", "fused"):
        assert results[name].how in ("prebuilt", "jit"), results[name].describe()
    assert "wkv_decode_step" in ops.registered_cuda_ops()


def _operands(rows: int, H: int, block0: bool, dtype: torch.dtype, state_dtype: torch.dtype, seed: int) -> dict[str, object]:
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0, like: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEV) * scale + shift).to(like)

    C, pool = H * N, rows + 3
    slots = torch.randperm(pool, generator=gen, device=DEV)[:rows].to(torch.int32)  # shuffled, some slots untouched
    return {
        "state": randn(pool, H, N, N, scale=0.5, like=state_dtype), "slot_idx": slots,
        "r": randn(rows, C), "k": randn(rows, C), "v": randn(rows, C), "g": torch.sigmoid(randn(rows, C, like=torch.float32)).to(dtype),
        "w_lora": randn(rows, C, scale=0.5), "a_lora": randn(rows, C, scale=0.5),
        "v_lora": None if block0 else randn(rows, C, scale=0.5), "v_first": None if block0 else randn(rows, C),
        "w0": randn(C, scale=0.5, shift=-1.0), "a0": randn(C, scale=0.5), "v0": None if block0 else randn(C, scale=0.5),
        "k_k": randn(C, scale=0.2, shift=0.8), "k_a": randn(C, scale=0.2, shift=1.0), "r_k": randn(C, scale=0.3),
        "ln_w": randn(C, scale=0.3, shift=1.0), "ln_b": randn(C, scale=0.1),
    }  # fmt: skip


ORDER = ("state", "slot_idx", "r", "k", "v", "g", "w_lora", "a_lora", "v_lora", "v_first", "w0", "a0", "v0", "k_k", "k_a", "r_k", "ln_w", "ln_b")


def _fresh(o: dict[str, object]) -> dict[str, object]:
    return {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in o.items()}


def _three_ops(o: dict[str, object]) -> torch.Tensor:
    """The unfused path: the three ops' CUDA kernels, as the model calls them."""
    w, a, b = ops.wkv_prep(o["k"], o["v"], o["w_lora"], o["a_lora"], o["v_lora"], o["v_first"], o["w0"], o["a0"], o["v0"], o["k_k"], o["k_a"])
    rows = o["r"].shape[0]  # type: ignore[attr-defined]
    decode_cu = torch.arange(rows + 1, dtype=torch.int32, device=DEV)
    y = ops.wkv7(o["state"], o["slot_idx"], decode_cu, o["r"], w, o["k"], o["v"], a, b, single_token=True)
    return ops.gn_bonus_gate(y, o["r"], o["k"], o["v"], o["g"], o["r_k"], o["ln_w"], o["ln_b"])


def _step(o: dict[str, object]) -> torch.Tensor:
    return ops.wkv_decode_step(*(o[name] for name in ORDER))


def _assert_identical(o: dict[str, object]) -> None:
    fused, unfused = _fresh(o), _fresh(o)
    got, want = _step(fused), _three_ops(unfused)
    assert torch.equal(got, want), f"output differs: {(got.float() - want.float()).abs().max().item():.3e}"
    for name in ("k", "v", "state"):
        assert torch.equal(fused[name], unfused[name]), f"{name}, updated in place, differs"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "dtype, state_dtype",
    [(torch.float16, torch.float16), (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)],
)
@pytest.mark.parametrize("rows", [1, 3, 64, 2048])  # 2048 x 2 heads: several waves of blocks on any GPU, in every dtype
@pytest.mark.parametrize("block0", [False, True])
def test_the_step_is_bit_identical_to_the_three_ops(rows: int, block0: bool, dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    _assert_identical(_operands(rows, 2, block0, dtype, state_dtype, seed=rows + 7 * block0))


@pytest.mark.parametrize("rows", [1, 4, 960])
def test_the_7b_width_is_bit_identical_at_batch_1_to_960(rows: int) -> None:
    _assert_identical(_operands(rows, 64, False, torch.float16, torch.float16, seed=rows))


def test_untouched_slots_stay_as_they_were_and_a_graph_replays_the_step() -> None:
    o = _operands(5, 2, False, torch.float16, torch.float16, seed=3)
    eager = _fresh(o)
    _step(eager)
    untouched = [s for s in range(o["state"].shape[0]) if s not in o["slot_idx"].tolist()]  # type: ignore[attr-defined]
    assert untouched and torch.equal(eager["state"][untouched], o["state"][untouched])  # type: ignore[index]
    assert_graph_replays(_step, o, ("state", "k", "v"))


def test_decode_through_the_op_gives_the_same_logits_bit_for_bit() -> None:
    """The model's decode steps, eager and from CUDA graphs, at a batch of 2 (the batch-1 Triton
    paths stay as they are) and of 6, with the op on and off."""
    try:
        assert_decode_identical(wkv_decode.set_step_op_allowed, seed=4)
    finally:
        wkv_decode.set_step_op_allowed(wkv_decode.STEP_OP_BY_DEFAULT)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"slot_idx": "short"}, "slot_idx"),
        ({"r": "narrow"}, "r must be"),
        ({"state": "heads"}, "state must be"),
        ({"v0": "missing"}, "given together"),
    ],
)
def test_bad_arguments_raise(change: dict[str, str], message: str) -> None:
    o = _operands(3, 2, False, torch.float16, torch.float16, seed=1)
    what = next(iter(change))
    if what == "slot_idx":
        o["slot_idx"] = o["slot_idx"][:2]  # type: ignore[index]
    elif what == "r":
        o["r"] = o["r"][:, :64].contiguous()  # type: ignore[index]
    elif what == "state":
        o["state"] = o["state"][:, :1].contiguous()  # type: ignore[index]
    else:
        o["v0"] = None
    with pytest.raises(RuntimeError, match=message):
        _step(o)
