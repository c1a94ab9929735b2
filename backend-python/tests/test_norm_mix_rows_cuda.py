"""The CUDA `norm_mix_rows` op on a GPU (skipped without one): bit-identical to `add_layer_norm`
then `shift_mix` (their vectorised kernels) for every activation dtype, each width class of the
kernel (one, two and four groups of 8 channels a thread), K mixes or one, slots of 1 to 130 rows
cut at every place a block's rows (and the pairs it norms at once) can cut them, shuffled slots
of a layered shift pool; x is left as it was, the new residual comes out of place, and untouched
slots keep their shift vectors; the model's dispatch takes it only for prompt rows with a residual; a model prefilling
through it gives the same logits and states, bit for bit, as without it; and its argument checks
raise."""

from __future__ import annotations

import pytest
import torch

from albatross import cuda_ops, norm_mix, ops
from albatross.random_checkpoint import CheckpointShape, random_state_dict

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

DEV = "cuda"
LENGTHS = (5, 1, 130, 4, 3, 8, 2, 9, 7)


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    results = cuda_ops.enable_cuda_kernels()
    assert results["fused"].how in ("prebuilt", "jit"), results["fused"].describe()
    assert "norm_mix_rows" in ops.registered_cuda_ops()


def _operands(lengths: tuple[int, ...], C: int, mixes: int, dtype: torch.dtype, seed: int) -> dict[str, object]:
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEV) * scale + shift).to(dtype)

    rows, pool = sum(lengths), len(lengths) + 3
    layers = randn(2, pool, C)  # the model's shift state is one layer of [L, B, C]
    return {
        "x": randn(rows, C, scale=2.0, shift=0.5), "delta": randn(rows, C),
        "weight": randn(C, scale=0.3, shift=1.0), "bias": randn(C, scale=0.1), "shift_state": layers[1],
        "slot_idx": torch.randperm(pool, generator=gen, device=DEV)[: len(lengths)].to(torch.int32),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV),
        "coefficients": torch.rand(mixes, C, generator=gen, device=DEV).to(dtype) if mixes else torch.rand(C, generator=gen, device=DEV).to(dtype),
    }  # fmt: skip


ORDER = ("x", "delta", "weight", "bias", "shift_state", "slot_idx", "cu_seqlens", "coefficients")


def _fresh(o: dict[str, object]) -> dict[str, object]:
    return {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in o.items()}


def _assert_identical(o: dict[str, object]) -> None:
    fused, unfused = _fresh(o), _fresh(o)
    x_new, got = ops.norm_mix_rows(*(fused[name] for name in ORDER))
    h = ops.add_layer_norm(unfused["x"], unfused["delta"], unfused["weight"], unfused["bias"])
    want = ops.shift_mix(h, unfused["shift_state"], unfused["slot_idx"], unfused["cu_seqlens"], unfused["coefficients"])
    assert torch.equal(got, want), f"mixes differ: {(got.float() - want.float()).abs().max().item():.3e}"
    assert torch.equal(x_new, unfused["x"]), "the new residual differs"
    assert torch.equal(fused["x"], o["x"]), "x was changed"  # type: ignore[arg-type]
    assert torch.equal(fused["shift_state"], unfused["shift_state"]), "the shift vectors differ"  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("C", [64, 2048, 4096, 8192])  # one group of 8 channels a thread (twice), two, four
@pytest.mark.parametrize("mixes", [6, 0])  # a time-mix block's six, a channel mix's one vector
def test_the_op_is_bit_identical_to_the_two_ops(dtype: torch.dtype, C: int, mixes: int) -> None:
    _assert_identical(_operands(LENGTHS, C, mixes, dtype, seed=C + mixes))


# A block walks 8 rows two at a time in fp16 and 4 rows one at a time otherwise: slots cut at
# either, a pair split by a slot's start or end, and a block's last pair cut short.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths", [(1,), (2,), (3,), (4,), (5,), (7,), (8,), (9,), (15,), (16,), (17,), (1,) * 9,
                                     (4, 4, 1, 3), (8, 1, 8, 2), (3, 6, 7, 1, 1), (7, 2, 7, 1), (512,) * 8])
def test_every_cut_of_a_slot_by_the_blocks_is_bit_identical(lengths: tuple[int, ...], dtype: torch.dtype) -> None:
    _assert_identical(_operands(lengths, 4096, 6, dtype, seed=len(lengths)))


def test_untouched_slots_keep_their_shift_vectors() -> None:
    o = _operands(LENGTHS, 256, 6, torch.float16, seed=2)
    after = _fresh(o)
    ops.norm_mix_rows(*(after[name] for name in ORDER))
    untouched = [s for s in range(o["shift_state"].shape[0]) if s not in o["slot_idx"].tolist()]  # type: ignore[attr-defined]
    assert untouched and torch.equal(after["shift_state"][untouched], o["shift_state"][untouched])  # type: ignore[index]


def test_the_dispatch_takes_it_for_prompt_rows_with_a_residual_only() -> None:
    o = _operands((3, 1), 256, 6, torch.float16, seed=4)
    x, delta = o["x"], o["delta"]
    operands = (o["weight"], o["bias"], o["shift_state"], o["coefficients"])
    prompt = ops.FlatBatch.build([0, 1], [3, 1], torch.device(DEV))
    decode = ops.FlatBatch.build([0, 1, 2, 3], [1, 1, 1, 1], torch.device(DEV))
    norm_mix.set_rows_op_allowed(True)
    try:
        assert norm_mix.rows_op_applies(x, delta, operands, prompt)  # type: ignore[arg-type]
        assert not norm_mix.rows_op_applies(x, None, operands, prompt), "no residual: the two ops (block 0's first norm)"  # type: ignore[arg-type]
        assert not norm_mix.rows_op_applies(x, delta, operands, decode), "decode rows: norm_mix_decode"  # type: ignore[arg-type]
        norm_mix.set_rows_op_allowed(False)
        assert not norm_mix.rows_op_applies(x, delta, operands, prompt)  # type: ignore[arg-type]
    finally:
        norm_mix.set_rows_op_allowed(norm_mix.ROWS_OP_BY_DEFAULT)


def test_a_prefill_through_the_op_gives_the_same_logits_and_states_bit_for_bit() -> None:
    from albatross.model import RWKV7

    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(n_layer=3, n_embd=256), seed=6, device="cuda"), "cuda", progress=False)
    gen = torch.Generator().manual_seed(6)
    tokens = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]
    runs = []
    try:
        for allowed in (True, False):
            norm_mix.set_rows_op_allowed(allowed)
            pool = model.new_pool(len(LENGTHS) + 1, torch.float16)
            slots = list(range(1, len(LENGTHS) + 1))
            logits = model.forward(pool, slots, tokens, full_output=True)  # a slot's rows each
            runs.append((torch.cat(list(logits)), [pool.att_shift.clone(), pool.ffn_shift.clone(), pool.wkv.clone()]))
    finally:
        norm_mix.set_rows_op_allowed(norm_mix.ROWS_OP_BY_DEFAULT)
    (on, on_states), (off, off_states) = runs
    assert torch.equal(on, off), f"logits differ: {(on - off).abs().max().item():.3e}"
    assert all(torch.equal(a, b) for a, b in zip(on_states, off_states)), "the states differ"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"cu_seqlens": "short"}, "cu_seqlens must be"),
        ({"delta": "narrow"}, "delta must be"),
        ({"shift_state": "dtype"}, "shift_state must be"),
        ({"coefficients": "wide"}, "coefficients must be"),
    ],
)
def test_bad_arguments_raise(change: dict[str, str], message: str) -> None:
    o = _operands(LENGTHS, 256, 6, torch.float16, seed=1)
    what = next(iter(change))
    if what == "cu_seqlens":
        o["cu_seqlens"] = o["cu_seqlens"][:-1]  # type: ignore[index]
    elif what == "delta":
        o["delta"] = o["delta"][:, :128].contiguous()  # type: ignore[index]
    elif what == "shift_state":
        o["shift_state"] = o["shift_state"].float()  # type: ignore[attr-defined]
    else:
        o["coefficients"] = torch.rand(6, 264, device=DEV, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=message):
        ops.norm_mix_rows(*(o[name] for name in ORDER))
