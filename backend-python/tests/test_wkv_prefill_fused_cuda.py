"""The CUDA `wkv_prefill_fused` op on a GPU (skipped without one): bit-identical to the three ops
it replaces (`wkv_prep`, the WKV op at two state rows a thread straight in registers,
`gn_bonus_gate`) for every activation and state dtype, slots of 1 to 130 tokens (groups of four
tokens cut short), shuffled slots, block 0 and the others, and the 7.2B width; k and v are left as
they were and untouched slots keep their states; a model prefilling through it gives the same
logits and states, bit for bit, as without it; and its argument checks raise instead of reading
out of bounds."""

from __future__ import annotations

import pytest
import torch

from albatross import cuda_ops, ops, wkv_decode, wkv_dispatch
from albatross.random_checkpoint import CheckpointShape, random_state_dict

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

DEV = "cuda"
N = ops.HEAD_SIZE
LENGTHS = (5, 1, 130, 4, 3, 8, 2, 9, 7)  # every remainder of a four-token group, a single token, a long slot


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    results = cuda_ops.enable_cuda_kernels()
    for name in ("wkv7", "fused"):
        assert results[name].how in ("prebuilt", "jit"), results[name].describe()
    assert "wkv_prefill_fused" in ops.registered_cuda_ops()


def _operands(lengths: tuple[int, ...], H: int, block0: bool, dtype: torch.dtype, state_dtype: torch.dtype, seed: int) -> dict[str, object]:
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0, like: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=DEV) * scale + shift).to(like)

    C, pool, rows = H * N, len(lengths) + 3, sum(lengths)
    slots = torch.randperm(pool, generator=gen, device=DEV)[: len(lengths)].to(torch.int32)  # shuffled, some slots untouched
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return {
        "state": randn(pool, H, N, N, scale=0.5, like=state_dtype), "slot_idx": slots, "cu_seqlens": cu,
        "r": randn(rows, C), "k": randn(rows, C), "v": randn(rows, C), "g": torch.sigmoid(randn(rows, C, like=torch.float32)).to(dtype),
        "w_lora": randn(rows, C, scale=0.5), "a_lora": randn(rows, C, scale=0.5),
        "v_lora": None if block0 else randn(rows, C, scale=0.5), "v_first": None if block0 else randn(rows, C),
        "w0": randn(C, scale=0.5, shift=-1.0), "a0": randn(C, scale=0.5), "v0": None if block0 else randn(C, scale=0.5),
        "k_k": randn(C, scale=0.2, shift=0.8), "k_a": randn(C, scale=0.2, shift=1.0), "r_k": randn(C, scale=0.3),
        "ln_w": randn(C, scale=0.3, shift=1.0), "ln_b": randn(C, scale=0.1),
    }  # fmt: skip


ORDER = ("state", "slot_idx", "cu_seqlens", "r", "k", "v", "g", "w_lora", "a_lora", "v_lora", "v_first", "w0", "a0", "v0", "k_k", "k_a", "r_k", "ln_w", "ln_b")


def _fresh(o: dict[str, object]) -> dict[str, object]:
    return {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in o.items()}


def _three_ops(o: dict[str, object]) -> torch.Tensor:
    """The unfused path: the three ops' CUDA kernels, as the model calls them on a call of many chunks."""
    w, a, b = ops.wkv_prep(o["k"], o["v"], o["w_lora"], o["a_lora"], o["v_lora"], o["v_first"], o["w0"], o["a0"], o["v0"], o["k_k"], o["k_a"])
    y = ops.wkv7(o["state"], o["slot_idx"], o["cu_seqlens"], o["r"], w, o["k"], o["v"], a, b, rows_per_thread=2, direct_rows=True)
    return ops.gn_bonus_gate(y, o["r"], o["k"], o["v"], o["g"], o["r_k"], o["ln_w"], o["ln_b"])


def _fused(o: dict[str, object]) -> torch.Tensor:
    return ops.wkv_prefill_fused(*(o[name] for name in ORDER))


def _assert_identical(o: dict[str, object]) -> None:
    fused, unfused = _fresh(o), _fresh(o)
    got, want = _fused(fused), _three_ops(unfused)
    assert torch.equal(got, want), f"output differs: {(got.float() - want.float()).abs().max().item():.3e}"
    assert torch.equal(fused["state"], unfused["state"]), "the states differ"  # type: ignore[arg-type]
    for name in ("k", "v"):
        assert torch.equal(fused[name], o[name]), f"{name} was changed"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "dtype, state_dtype",
    [(torch.float16, torch.float16), (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)],
)
@pytest.mark.parametrize("block0", [False, True])
def test_the_walk_is_bit_identical_to_the_three_ops(block0: bool, dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    _assert_identical(_operands(LENGTHS, 2, block0, dtype, state_dtype, seed=3 + 7 * block0))


def test_the_7b_width_is_bit_identical_with_many_chunks() -> None:
    _assert_identical(_operands((64,) * 24 + (37,), 64, False, torch.float16, torch.float16, seed=11))


def test_untouched_slots_keep_their_states() -> None:
    o = _operands(LENGTHS, 2, False, torch.float16, torch.float16, seed=5)
    after = _fresh(o)
    _fused(after)
    untouched = [s for s in range(o["state"].shape[0]) if s not in o["slot_idx"].tolist()]  # type: ignore[attr-defined]
    assert untouched and torch.equal(after["state"][untouched], o["state"][untouched])  # type: ignore[index]


def _prefill_both_ways(seed: int) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """A small random model prefilling slots of several lengths in one call, with the op allowed
    and then not, under a layout that walks every call of chunks with direct rows (so the op
    applies at this size): per setting, the logits of every row and the pool's states."""
    from albatross.model import RWKV7

    model = RWKV7.from_state_dict(random_state_dict(CheckpointShape(n_layer=3, n_embd=256), seed=seed, device="cuda"), "cuda", progress=False)
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]
    results = []
    for allowed in (True, False):
        wkv_decode.set_prefill_op_allowed(allowed)
        pool = model.new_pool(len(LENGTHS) + 1, torch.float16)
        slots = list(range(1, len(LENGTHS) + 1))
        logits = model.forward(pool, slots, tokens, full_output=True)
        results.append((logits, [pool.att_shift.clone(), pool.ffn_shift.clone(), pool.wkv.clone()]))
    return results


def test_a_prefill_through_the_op_gives_the_same_logits_and_states_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wkv_dispatch, "LAYOUT", wkv_dispatch.SequentialLayout(min_tokens=1, chains_per_sm=0, direct_chains_per_sm=0))
    monkeypatch.setattr(wkv_dispatch, "POLICY", wkv_dispatch.ChunkedPolicy(enabled=False))
    calls = []
    real = ops.wkv_prefill_fused
    monkeypatch.setattr(ops, "wkv_prefill_fused", lambda *args: calls.append(1) or real(*args))
    try:
        (on, on_states), (off, off_states) = _prefill_both_ways(seed=4)
    finally:
        wkv_decode.set_prefill_op_allowed(wkv_decode.PREFILL_OP_BY_DEFAULT)
    assert len(calls) == 3, "the op did not take every block's walk"
    assert torch.equal(on, off), f"logits differ: {(on - off).abs().max().item():.3e}"
    assert all(torch.equal(a, b) for a, b in zip(on_states, off_states)), "the states differ"


def test_the_dispatch_offers_the_op_only_to_a_direct_walk() -> None:
    """`prefill_op_applies` follows `wkv_dispatch.walks_direct`: a decode call never, a call of few
    chunks (one row a thread) never, and many chunks at the kernel's threshold yes."""
    sms = wkv_dispatch.multiprocessors(torch.cuda.current_device())
    H = 64
    state = torch.zeros(1, H, N, N, device=DEV)
    k = torch.zeros(1, H * N, device=DEV, dtype=torch.float16)
    many = wkv_dispatch.LAYOUT.direct_chains_per_sm * sms // H + 1
    cases = {(1,) * 8: False, (512,) * 2: False, (wkv_dispatch.LAYOUT.min_tokens,) * many: True}
    wkv_decode.set_prefill_op_allowed(True)
    try:
        for lengths, expected in cases.items():
            batch = ops.FlatBatch.build(list(range(len(lengths))), list(lengths), torch.device(DEV))
            assert wkv_decode.prefill_op_applies(state, k, batch) is expected, lengths
    finally:
        wkv_decode.set_prefill_op_allowed(wkv_decode.PREFILL_OP_BY_DEFAULT)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"cu_seqlens": "short"}, "cu_seqlens must be"),
        ({"r": "narrow"}, "r must be"),
        ({"state": "heads"}, "state must be"),
        ({"v0": "missing"}, "given together"),
    ],
)
def test_bad_arguments_raise(change: dict[str, str], message: str) -> None:
    o = _operands(LENGTHS, 2, False, torch.float16, torch.float16, seed=1)
    what = next(iter(change))
    if what == "cu_seqlens":
        o["cu_seqlens"] = o["cu_seqlens"][:-1]  # type: ignore[index]
    elif what == "r":
        o["r"] = o["r"][:, :64].contiguous()  # type: ignore[index]
    elif what == "state":
        o["state"] = o["state"][:, :1].contiguous()  # type: ignore[index]
    else:
        o["v0"] = None
    with pytest.raises(RuntimeError, match=message):
        _fused(o)
