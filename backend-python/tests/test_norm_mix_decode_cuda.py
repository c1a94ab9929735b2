"""The CUDA `norm_mix_decode` op on a GPU (skipped without one): bit-identical to `add_layer_norm`
then `shift_mix` (their vectorised kernels) for every activation dtype, 1 to 960 rows, with and
without the residual delta, K mixes or one, shuffled slots of a layered shift pool, and the 7.2B
width; replayable from a CUDA graph; the model's decode dispatch takes it only where the two ops
would take their vectorised kernels; a model decoding through both CUDA decode ops gives the same
logits, bit for bit, as without them; and its argument checks raise."""

from __future__ import annotations

import pytest
import torch

from albatross import cuda_ops, norm_mix, ops, wkv_decode
from decode_paths import assert_decode_identical, assert_graph_replays

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

DEV = "cuda"


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    results = cuda_ops.enable_cuda_kernels()
    assert results["fused"].how in ("prebuilt", "jit"), results["fused"].describe()
    assert "norm_mix_decode" in ops.registered_cuda_ops()


def _operands(rows: int, C: int, with_delta: bool, mixes: int, dtype: torch.dtype, seed: int) -> dict[str, object]:
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEV) * scale + shift).to(dtype)

    pool = rows + 3
    layers = randn(2, pool, C)  # the model's shift state is one layer of [L, B, C]
    return {
        "x": randn(rows, C, scale=2.0, shift=0.5), "delta": randn(rows, C) if with_delta else None,
        "weight": randn(C, scale=0.3, shift=1.0), "bias": randn(C, scale=0.1), "shift_state": layers[1],
        "slot_idx": torch.randperm(pool, generator=gen, device=DEV)[:rows].to(torch.int32),
        "coefficients": torch.rand(mixes, C, generator=gen, device=DEV).to(dtype) if mixes else torch.rand(C, generator=gen, device=DEV).to(dtype),
    }  # fmt: skip


def _fresh(o: dict[str, object]) -> dict[str, object]:
    return {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in o.items()}


def _two_ops(o: dict[str, object]) -> torch.Tensor:
    h = ops.add_layer_norm(o["x"], o["delta"], o["weight"], o["bias"])
    decode_cu = torch.arange(o["x"].shape[0] + 1, dtype=torch.int32, device=DEV)  # type: ignore[attr-defined]
    return ops.shift_mix(h, o["shift_state"], o["slot_idx"], decode_cu, o["coefficients"])


def _op(o: dict[str, object]) -> torch.Tensor:
    return ops.norm_mix_decode(o["x"], o["delta"], o["weight"], o["bias"], o["shift_state"], o["slot_idx"], o["coefficients"])


def _assert_identical(o: dict[str, object]) -> None:
    fused, unfused = _fresh(o), _fresh(o)
    got, want = _op(fused), _two_ops(unfused)
    assert torch.equal(got, want), f"mixes differ: {(got.float() - want.float()).abs().max().item():.3e}"
    assert torch.equal(fused["x"], unfused["x"]), "the residual, updated in place, differs"  # type: ignore[arg-type]
    assert torch.equal(fused["shift_state"], unfused["shift_state"]), "the shift vectors differ"  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("with_delta, mixes", [(True, 6), (True, 1), (False, 0)])
def test_the_op_is_bit_identical_to_the_two_ops(rows: int, with_delta: bool, mixes: int, dtype: torch.dtype) -> None:
    _assert_identical(_operands(rows, 256, with_delta, mixes, dtype, seed=rows + mixes))


@pytest.mark.parametrize("rows", [1, 4, 960])
def test_the_7b_width_is_bit_identical_at_batch_1_to_960(rows: int) -> None:
    _assert_identical(_operands(rows, 4096, True, 6, torch.float16, seed=rows))


def test_untouched_slots_stay_as_they_were_and_a_graph_replays_the_op() -> None:
    o = _operands(5, 512, True, 6, torch.float16, seed=3)
    eager = _fresh(o)
    _op(eager)
    untouched = [s for s in range(o["shift_state"].shape[0]) if s not in o["slot_idx"].tolist()]  # type: ignore[attr-defined]
    assert untouched and torch.equal(eager["shift_state"][untouched], o["shift_state"][untouched])  # type: ignore[index]
    assert_graph_replays(_op, o, ("x", "shift_state"))


def test_the_dispatch_takes_the_op_only_where_the_two_ops_would_vectorise() -> None:
    o = _operands(2, 256, True, 6, torch.float16, seed=5)
    batch = ops.FlatBatch.build([0, 1], [1, 1], torch.device(DEV))
    operands = (o["weight"], o["bias"], o["shift_state"], o["coefficients"])
    norm_mix.set_op_allowed(True)
    try:
        assert norm_mix.op_applies(o["x"], o["delta"], operands, batch)  # type: ignore[arg-type]
        assert not norm_mix.op_applies(o["x"], o["delta"], operands, ops.FlatBatch.build([0], [2], torch.device(DEV))), "prefill"  # type: ignore[arg-type]
        odd = torch.empty(2 * 256 + 4, dtype=torch.float16, device=DEV)[4:].view(2, 256)  # 8-byte aligned rows
        assert not norm_mix.op_applies(odd, o["delta"], operands, batch), "unaligned rows take the two ops"  # type: ignore[arg-type]
    finally:
        norm_mix.set_op_allowed(norm_mix.OP_BY_DEFAULT)


def test_decode_through_both_cuda_decode_ops_gives_the_same_logits_bit_for_bit() -> None:
    def allow(allowed: bool) -> None:
        norm_mix.set_op_allowed(allowed)
        wkv_decode.set_step_op_allowed(allowed)

    try:
        assert_decode_identical(allow, seed=6)
    finally:
        norm_mix.set_op_allowed(norm_mix.OP_BY_DEFAULT)
        wkv_decode.set_step_op_allowed(wkv_decode.STEP_OP_BY_DEFAULT)


@pytest.mark.parametrize(
    "what, message",
    [("slot_idx", "slot_idx"), ("coefficients", "coefficients must be"), ("width", "multiple of 8"), ("shift_state", "shift_state must be")],
)
def test_bad_arguments_raise(what: str, message: str) -> None:
    o = _operands(3, 256, True, 6, torch.float16, seed=1)
    if what == "slot_idx":
        o["slot_idx"] = o["slot_idx"][:2]  # type: ignore[index]
    elif what == "coefficients":
        o["coefficients"] = o["coefficients"][:, :128].contiguous()  # type: ignore[index]
    elif what == "width":
        o = _operands(3, 252, True, 6, torch.float16, seed=1)
    else:
        o["shift_state"] = o["shift_state"][:, :128]  # type: ignore[index]
    with pytest.raises(RuntimeError, match=message):
        _op(o)
