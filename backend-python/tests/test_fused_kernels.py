"""The fused elementwise CUDA kernels (cuda/fused.cu) compute what their torch twins in
albatross.ops compute (run on a GPU; skipped without one).

Oracle: the twin in fp32 on the same (already rounded) inputs; the kernel runs in the activation
dtype, so the tolerance is that dtype's rounding. Outputs are poisoned (NaN) before each kernel
run so that an element it forgets to write cannot pass."""

from __future__ import annotations

import pytest
import torch

from albatross import cuda_ops, ops

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

N = 64
FUSED = ("add_layer_norm", "gn_bonus_gate", "relu_square", "shift_mix", "wkv_prep")
DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
ROW_CASES = [
    # lengths per slot: decode batches, one prefill chunk, prefill chunks mixed with decode rows
    [1],
    [1] * 7,
    [1] * 64,
    [1] * 960,
    [37],
    [5, 1, 1, 130, 1, 17, 1],
    [1] * 33 + [64, 3] + [1] * 30,
]
ROW_IDS = ["b1", "b7", "b64", "b960", "chunk37", "mixed7", "mixed65"]
# (rows, heads) in every dtype, except the large shape, which runs once in fp16 (the served dtype).
HEAD_CASES = [
    pytest.param(rows, heads, dtype, tolerance, id=f"rows{rows}-heads{heads}-{dtype_id}")
    for rows in (1, 7, 64, 960, 37)
    for heads in (2, 5, 64)
    for (dtype, tolerance), dtype_id in zip(DTYPES, DTYPE_IDS)
    if not (rows == 960 and heads == 64 and dtype != torch.float16)
]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    results = cuda_ops.enable_cuda_kernels()
    assert results["fused"].how in ("prebuilt", "jit"), results["fused"].describe()
    # ops.* on CUDA tensors must reach the kernels, not the twins they are compared with.
    missing = set(FUSED) - set(ops.registered_cuda_ops())
    assert not missing, f"no CUDA kernel registered for {sorted(missing)}"


def _gen(*seed_parts: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(hash(seed_parts) % (2**31))


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


def _poison_next_allocation(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    # The caching allocator hands this block to the next allocation of the same size.
    poison = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    del poison


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def _check(name: str, actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    assert not actual.isnan().any(), f"{name}: {int(actual.isnan().sum())} elements never written (NaN poison)"
    error = _relative_error(actual, expected)
    assert error <= tolerance, f"{name} differs from the twin by {error:.2e} (tolerance {tolerance:.0e})"


def _flat_batch(lengths: list[int], pool_size: int, gen: torch.Generator) -> ops.FlatBatch:
    slots = torch.randperm(pool_size, generator=gen, device="cuda")[: len(lengths)].tolist()
    return ops.FlatBatch.build(slots, lengths, torch.device("cuda"))


@pytest.mark.parametrize("lengths", ROW_CASES, ids=ROW_IDS)
@pytest.mark.parametrize("dtype, tolerance", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("coefficients", [(6,), ()], ids=["att-6-mixes", "ffn-vector"])
def test_shift_mix_matches_twin_and_updates_only_the_batch_slots(
    lengths: list[int], dtype: torch.dtype, tolerance: float, coefficients: tuple[int, ...]
) -> None:
    gen = _gen(len(lengths), sum(lengths), len(coefficients))
    C, pool_size = 320, len(lengths) + 4  # C not a multiple of the 256-thread block
    batch = _flat_batch(lengths, pool_size, gen)
    x = _randn(gen, sum(lengths), C, dtype=dtype)
    # The pool keeps [L, B, C]; a layer's view is [B, C]; here a strided [B, C] view as well.
    backing = _randn(gen, pool_size, 2, C, dtype=dtype)
    mixes = _randn(gen, *coefficients, C, scale=0.5, dtype=dtype)  # [6, C] (time mix) or [C] (channel mix)

    expected_shift = backing[:, 1].float().clone()  # clone: .float() of fp32 is the same tensor
    expected = ops.shift_mix_torch(x.float(), expected_shift, batch.slot_idx, batch.cu_seqlens, mixes.float())
    actual_backing = backing.clone()
    _poison_next_allocation((*coefficients, sum(lengths), C), dtype)
    actual = ops.shift_mix(x, actual_backing[:, 1], batch.slot_idx, batch.cu_seqlens, mixes)
    torch.cuda.synchronize()

    _check("mixes", actual, expected, tolerance)
    assert torch.equal(actual_backing[:, 1].float(), expected_shift.to(dtype).float()), "new shift vectors differ from the slots' last rows"
    assert torch.equal(actual_backing[:, 0], backing[:, 0]), "the shift kernel wrote outside the [B, C] view"


def test_shift_mix_decode_reads_the_saved_vector_before_overwriting_it() -> None:
    gen = _gen(11)
    C = 256
    batch = ops.FlatBatch.build([2, 0], [1, 1], torch.device("cuda"))
    x = _randn(gen, 2, C)
    shift = _randn(gen, 3, C)
    saved = shift.clone()
    out = ops.shift_mix(x, shift, batch.slot_idx, batch.cu_seqlens, torch.ones(1, C, device="cuda"))
    # With a coefficient of 1 the mix is the previous token (x + (prev - x), to fp32 rounding).
    torch.testing.assert_close(out[0], saved[[2, 0]], rtol=0, atol=1e-5, msg="decode rows must mix with the vector saved before this step")
    assert torch.equal(shift[[2, 0]], x) and torch.equal(shift[1], saved[1])


@pytest.mark.parametrize("rows", [1, 7, 960, 37], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("width", [192, 4096, 8192])
@pytest.mark.parametrize("dtype, tolerance", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_delta", [True, False], ids=["residual", "plain"])
def test_add_layer_norm_matches_twin(rows: int, width: int, dtype: torch.dtype, tolerance: float, with_delta: bool) -> None:
    gen = _gen(rows, width, int(with_delta))
    x = _randn(gen, rows, width, scale=3.0, dtype=dtype) + _randn(gen, 1, width, dtype=dtype)  # non-zero row means
    delta = _randn(gen, rows, width, dtype=dtype) if with_delta else None
    weight, bias = _randn(gen, width, dtype=dtype), _randn(gen, width, scale=0.1, dtype=dtype)

    expected_x = x.float().clone()  # the twin adds in place
    expected = ops.add_layer_norm_torch(expected_x, delta.float() if delta is not None else None, weight.float(), bias.float())
    actual_x = x.clone()
    _poison_next_allocation((rows, width), dtype)
    actual = ops.add_layer_norm(actual_x, delta, weight, bias)
    torch.cuda.synchronize()

    _check("h", actual, expected, tolerance)
    _check("x (residual, in place)", actual_x, expected_x, tolerance)


@pytest.mark.parametrize("rows, heads, dtype, tolerance", HEAD_CASES)
@pytest.mark.parametrize("layer0", [True, False], ids=["layer0", "value-residual"])
def test_wkv_prep_matches_twin(rows: int, heads: int, dtype: torch.dtype, tolerance: float, layer0: bool) -> None:
    gen = _gen(rows, heads, int(layer0))
    C = heads * N

    def mat(scale: float = 1.0) -> torch.Tensor:
        return _randn(gen, rows, C, scale=scale, dtype=dtype)

    def vec(scale: float = 1.0) -> torch.Tensor:
        return _randn(gen, C, scale=scale, dtype=dtype)

    k, v, w_lora, a_lora = mat(), mat(), mat(), mat()
    v_lora, v_first, v0 = (None, None, None) if layer0 else (mat(), mat(), vec())
    w0, a0, k_k, k_a = vec(2.0), vec(), vec(), vec()
    f = lambda t: t.float() if t is not None else None  # noqa: E731

    expected_k, expected_v = k.float().clone(), v.float().clone()  # the twin updates them in place
    expected = ops.wkv_prep_torch(expected_k, expected_v, f(w_lora), f(a_lora), f(v_lora), f(v_first), f(w0), f(a0), f(v0), f(k_k), f(k_a))
    actual_k, actual_v = k.clone(), v.clone()
    actual = ops.wkv_prep(actual_k, actual_v, w_lora, a_lora, v_lora, v_first, w0, a0, v0, k_k, k_a)
    torch.cuda.synchronize()

    for name, got, want in zip(("w", "a (-kk)", "b (kk * a)"), actual, expected):
        _check(name, got, want, tolerance)
    _check("k (in place)", actual_k, expected_k, tolerance)
    _check("v (in place)", actual_v, expected_v, tolerance)
    if layer0:
        assert torch.equal(actual_v, v), "layer 0 has no value residual: v must stay as it was"


@pytest.mark.parametrize("rows, heads, dtype, tolerance", HEAD_CASES)
def test_gn_bonus_gate_matches_twin(rows: int, heads: int, dtype: torch.dtype, tolerance: float) -> None:
    gen = _gen(rows, heads, 77)
    C = heads * N
    y = _randn(gen, rows, C, scale=2.0, dtype=dtype) + 0.5  # non-zero group means
    r, k, v, g = (_randn(gen, rows, C, dtype=dtype) for _ in range(4))
    r_k, weight, bias = _randn(gen, C, dtype=dtype), _randn(gen, C, dtype=dtype), _randn(gen, C, scale=0.1, dtype=dtype)

    expected = ops.gn_bonus_gate_torch(*(t.float() for t in (y, r, k, v, g, r_k, weight, bias)))
    _poison_next_allocation((rows, C), dtype)
    actual = ops.gn_bonus_gate(y, r, k, v, g, r_k, weight, bias)
    torch.cuda.synchronize()
    _check("out", actual, expected, tolerance)


@pytest.mark.parametrize("shape", [(1, 1024), (7, 4 * 320), (960, 16384)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype, tolerance", DTYPES, ids=DTYPE_IDS)
def test_relu_square_matches_twin(shape: tuple[int, int], dtype: torch.dtype, tolerance: float) -> None:
    x = _randn(_gen(*shape), *shape, dtype=dtype)
    _poison_next_allocation(shape, dtype)
    actual = ops.relu_square(x)
    torch.cuda.synchronize()
    _check("relu^2", actual, ops.relu_square_torch(x.float()), tolerance)
    assert bool((actual[x <= 0] == 0).all()), "negative inputs must give exactly 0"


def test_fused_ops_refuse_mismatched_inputs() -> None:
    x = torch.randn(4, 128, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="weight must have dtype"):
        ops.add_layer_norm(x, None, torch.ones(128, device="cuda"), torch.zeros(128, device="cuda", dtype=torch.float16))
    with pytest.raises(RuntimeError, match="v_lora, v_first and v0"):
        ones = torch.ones(128, device="cuda", dtype=torch.float16)
        ops.wkv_prep(x, x.clone(), x, x, x, None, ones, ones, None, ones, ones)
