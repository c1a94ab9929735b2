"""The int8 kernels on a GPU (skipped without one): the split-K GEMV (1-4 rows), the Triton tile and
swap-AB kernels and the L2-slab product compute the twin's `x @ (q * scale)` on the 7.2B shapes and
at edge sizes, the dispatch picks them as `ROW_PATHS` says, they replay in CUDA graphs, and an int8
model decodes like the float one."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from albatross import cuda_ops, int8_dispatch, int8_triton, linear
from albatross.cuda_graphs import DecodeGraphRunner
from albatross.model import RWKV7
from albatross.quant import Int8Weight, quantize
from albatross.random_checkpoint import CheckpointShape, random_state_dict

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

DEV = "cuda"
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # of the largest output: the output's rounding
# The 7.2B matrices [in, out]: r/k/v/output, FFN key, FFN value, head.
SHAPES_7B = [(4096, 4096), (4096, 16384), (16384, 4096), (4096, 65536)]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    results = cuda_ops.enable_cuda_kernels()
    assert results["int8"].how in ("prebuilt", "jit"), results["int8"].describe()
    assert int8_dispatch.enabled() == {"gemv": True, "tile": True, "swap": True, "slab": True}


def _operands(rows: int, K: int, N: int, dtype: torch.dtype, seed: int, stack: int | None = None) -> tuple[torch.Tensor, Int8Weight]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    lead = () if stack is None else (stack,)
    x = torch.randn(*lead, rows, K, generator=gen, device=DEV).to(dtype)
    weight = quantize(torch.randn(*lead, K, N, generator=gen, device=DEV) / K**0.5)
    return x, weight


def _check(y: torch.Tensor, x: torch.Tensor, weight: Int8Weight) -> None:
    dense = weight.dequantize(torch.float64)
    expected = x.double() @ dense
    assert y.shape == expected.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all(), "an output was not written"
    error = ((y.double() - expected).abs().max() / expected.abs().max()).item()
    assert error <= TOLERANCE[x.dtype], f"max error {error:.2e} of the largest output"


# ---------------------------------------------------------------------------------------------
# GEMV


@pytest.mark.parametrize("K, N", SHAPES_7B, ids=[f"{k}x{n}" for k, n in SHAPES_7B])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gemv_matches_the_twin_on_the_7b_shapes(K: int, N: int, rows: int, dtype: torch.dtype) -> None:
    x, weight = _operands(rows, K, N, dtype, seed=K + N + rows)
    poison = torch.full((rows, N), float("nan"), dtype=dtype, device=DEV)
    del poison  # y reuses this block: an unwritten output stays NaN
    if rows <= int8_dispatch.GEMV_MAX_ROWS:  # the kernel takes 1-4 rows; the dispatch sends it the measured few
        assert int8_dispatch.path_for(x, weight) == "gemv"
    _check(int8_dispatch.int8_gemv(x, weight), x, weight)


@pytest.mark.parametrize("K, N", [(1, 16), (7, 16), (33, 272), (1000, 2064), (2049, 528), (5000, 1040)], ids=str)
def test_gemv_edge_sizes(K: int, N: int) -> None:
    """K not a multiple of the rows in flight or of a split, N not a multiple of the 512-column tile."""
    x, weight = _operands(3, K, N, torch.float16, seed=K * N)
    _check(int8_dispatch.int8_gemv(x, weight), x, weight)


def test_gemv_of_a_stack_is_one_product_per_matrix() -> None:
    x, weight = _operands(2, 4096, 4096, torch.float16, seed=3, stack=3)  # the r/k/v projections
    assert int8_dispatch.path_for(x, weight) == "gemv"
    _check(linear.bmm(x, weight), x, weight)


def test_gemv_reads_rows_of_a_wider_tensor() -> None:
    wide, weight = _operands(2, 8192, 4096, torch.float16, seed=4)
    x = wide[:, 1024 : 1024 + 4096]  # row stride 8192, as the model's per-mix views
    small = Int8Weight(weight.q[:4096].contiguous(), weight.scale)
    _check(linear.mm(x, small), x, small)


def test_gemv_is_deterministic_and_leaves_the_counters_at_zero() -> None:
    x, weight = _operands(1, 4096, 16384, torch.float16, seed=5)
    first = int8_dispatch.int8_gemv(x, weight)
    for _ in range(5):
        assert torch.equal(int8_dispatch.int8_gemv(x, weight), first)
    torch.cuda.synchronize()
    assert int(linear.counters(x.device).abs().sum()) == 0


_BAD_CALLS = {
    "five rows": "x = torch.zeros(5, 64, dtype=torch.half, device='cuda'); q = torch.zeros(64, 32, dtype=torch.int8, device='cuda')",
    "17 columns": "x = torch.zeros(1, 64, dtype=torch.half, device='cuda'); q = torch.zeros(64, 17, dtype=torch.int8, device='cuda')",
    "fp32 x": "x = torch.zeros(1, 64, device='cuda'); q = torch.zeros(64, 32, dtype=torch.int8, device='cuda')",
}


@pytest.mark.parametrize("setup", list(_BAD_CALLS.values()), ids=list(_BAD_CALLS))
def test_bad_gemv_arguments_raise_instead_of_crashing(setup: str) -> None:
    """In a child process: a crash there fails this test instead of the whole run."""
    script = (
        "import torch; from albatross import cuda_ops, linear, ops; cuda_ops.enable_cuda_kernels(); "
        f"{setup}; scale = torch.ones(q.shape[1], device='cuda')\n"
        "try:\n    ops.int8_gemv(x, q, scale, linear.counters(x.device))\n"
        "except RuntimeError as error:\n    print('raised:', error)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and "raised:" in done.stdout, f"rc {done.returncode}\n{done.stdout}\n{done.stderr[-2000:]}"


# ---------------------------------------------------------------------------------------------
# Tile kernel (Triton) and the dispatch


@pytest.mark.parametrize("K, N", SHAPES_7B, ids=[f"{k}x{n}" for k, n in SHAPES_7B])
@pytest.mark.parametrize("rows", [5, 16, 64, 200, 960])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_tile_kernel_matches_the_twin_on_the_7b_shapes(K: int, N: int, rows: int, dtype: torch.dtype) -> None:
    x, weight = _operands(rows, K, N, dtype, seed=K + N + rows)  # (the default table no longer picks it: swap-AB won)
    _check(int8_dispatch.int8_tile(x, weight), x, weight)


@pytest.mark.parametrize("config", [c for _, c in int8_triton.CONFIGS], ids=lambda c: f"{c.block_m}x{c.block_n}x{c.block_k}")
def test_every_tile_config_handles_ragged_edges(config: int8_triton.TileConfig) -> None:
    x, weight = _operands(133, 1000, 1040, torch.float16, seed=7)
    _check(int8_triton.w8a16_mm(x, weight.q, weight.scale, config), x, weight)


def test_tile_kernel_of_a_stack_and_of_strided_rows() -> None:
    x, weight = _operands(40, 2048, 2048, torch.float16, seed=8, stack=3)
    _check(linear.bmm(x, weight), x, weight)
    wide = torch.randn(40, 4096, device=DEV, dtype=torch.float16)
    small = Int8Weight(weight.q[0], weight.scale[0])
    _check(linear.mm(wide[:, :2048], small), wide[:, :2048], small)


def test_many_rows_dequantize_in_slabs_and_use_cublas() -> None:
    x, weight = _operands(4097, 4096, 65536, torch.float16, seed=9)
    _check(int8_dispatch.int8_dequantized(x, weight), x, weight)


# ---------------------------------------------------------------------------------------------
# Swap-AB kernel, L2 slabs, and what the dispatch picks

ROWS_64_UP = [64, 77, 256, 960, 1025]  # M not a multiple of any block among them


@pytest.mark.parametrize("K, N", SHAPES_7B, ids=[f"{k}x{n}" for k, n in SHAPES_7B])
@pytest.mark.parametrize("rows", ROWS_64_UP)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_swap_kernel_matches_the_twin_on_the_7b_shapes(K: int, N: int, rows: int, dtype: torch.dtype) -> None:
    x, weight = _operands(rows, K, N, dtype, seed=K + N + rows + 1)
    _check(int8_dispatch.int8_swap(x, weight), x, weight)


_SWAP_CASES = [(c, torch.float16) for c in int8_triton.SWAP_CONFIGS] + [(c, torch.bfloat16) for c in dict.fromkeys(c for _, c in int8_triton.SWAP_DEFAULTS)]


@pytest.mark.parametrize("config, dtype", _SWAP_CASES, ids=[f"{c.name.replace(' ', '-')}-{str(d)[6:]}" for c, d in _SWAP_CASES])
def test_every_swap_config_handles_ragged_edges(config: int8_triton.SwapConfig, dtype: torch.dtype) -> None:
    """Every benchmarked config in fp16 (the bf16 conversion differs only in the defaults' kernels)."""
    x, weight = _operands(133, 1000, 1040, dtype, seed=17)  # K off every block_k: the masked reduction
    _check(int8_triton.w8a16_swap_mm(x, weight.q, weight.scale, config), x, weight)
    x, weight = _operands(200, 4096, 4096, dtype, seed=18)
    _check(int8_triton.w8a16_swap_mm(x, weight.q, weight.scale, config), x, weight)


def test_swap_kernel_of_a_stack_and_of_strided_rows() -> None:
    x, weight = _operands(300, 4096, 4096, torch.float16, seed=19, stack=3)  # the r/k/v bmm
    _check(int8_dispatch.int8_swap(x, weight), x, weight)
    wide = torch.randn(300, 8192, device=DEV, dtype=torch.bfloat16)
    small = Int8Weight(weight.q[1], weight.scale[1])
    _check(int8_dispatch.int8_swap(wide[:, 4096:], small), wide[:, 4096:], small)


def _compiled_variants() -> int:
    kernels = (int8_triton._w8a16_kernel, int8_triton._w8a16_swap_kernel)
    return sum(len(entry[0]) for kernel in kernels for entry in kernel.device_caches.values())  # [0]: the kernel cache


@pytest.mark.parametrize("kernel", ["tile", "swap"])
def test_any_row_count_reuses_one_build_per_config(kernel: str) -> None:
    """A step's rows are any number: after one build per tile config, row counts that are and are
    not multiples of 16 (and 1) compile nothing again (each compile held an int8 server's worker
    for seconds), and every product is still right."""
    mm = int8_triton.w8a16_mm if kernel == "tile" else int8_triton.w8a16_swap_mm
    config = int8_triton.config_for(300) if kernel == "tile" else int8_triton.swap_config_for(300)
    before = None
    for rows in (288, 1, 289, 300, 257, 272):
        x, weight = _operands(rows, 512, 1024, torch.float16, seed=rows)
        _check(mm(x, weight.q, weight.scale, config), x, weight)
        if before is None:
            before = _compiled_variants()  # the first call built this config's kernel
    assert _compiled_variants() == before


@pytest.mark.parametrize("K, N", SHAPES_7B, ids=[f"{k}x{n}" for k, n in SHAPES_7B])
@pytest.mark.parametrize("slab_mb", [2, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_slab_product_matches_cublas_on_the_twins_columns(K: int, N: int, slab_mb: int, dtype: torch.dtype) -> None:
    x, weight = _operands(960, K, N, dtype, seed=K + N + slab_mb)
    y = int8_dispatch.int8_slab(x, weight, slab_mb << 20)
    _check(y, x, weight)
    dense = weight.dequantize(dtype)  # the twin's matrix, bit for bit what each slab multiplies
    columns = min(N, (slab_mb << 20) // (2 * K) // 16 * 16)
    for start in (0, (N // columns - 1) * columns):
        part = torch.mm(x, dense[:, start : start + columns].contiguous()).float()
        error = float((y[:, start : start + columns].float() - part).abs().max() / part.abs().max())
        assert error <= TOLERANCE[dtype] / 4, f"slab at column {start}: {error:.2e} from cuBLAS on the same columns"


def test_slab_product_of_a_stack_and_of_strided_rows() -> None:
    x, weight = _operands(257, 4096, 4096, torch.bfloat16, seed=20, stack=3)
    _check(int8_dispatch.int8_slab(x, weight, 4 << 20), x, weight)  # 170 columns of three matrices a slab
    wide = torch.randn(70, 8192, device=DEV, dtype=torch.float16)
    small = Int8Weight(weight.q[2], weight.scale[2])
    _check(int8_dispatch.int8_slab(wide[:, :4096], small, 2 << 20), wide[:, :4096], small)


@pytest.mark.parametrize("table", [((1024, "swap"), (1 << 62, "slab")), ((256, "tile"), (2048, "slab"), (1 << 62, "dequantize"))], ids=str)
def test_the_dispatch_runs_what_the_table_says(table: tuple[tuple[int, str], ...], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8_dispatch, "ROW_PATHS", table)
    ran: list[str] = []
    for name in ("tile", "swap", "slab", "dequantize"):
        original = int8_dispatch._PATHS[name]
        monkeypatch.setitem(int8_dispatch._PATHS, name, lambda x, w, name=name, original=original: ran.append(name) or original(x, w))
    for rows in (3, 100, 256, 1000, 3000):
        x, weight = _operands(rows, 512, 1024, torch.float16, seed=rows)
        expected = "gemv" if rows <= int8_dispatch.GEMV_MAX_ROWS else next(p for most, p in table if rows <= most)
        assert int8_dispatch.path_for(x, weight) == expected
        _check(linear.mm(x, weight), x, weight)
    assert ran == [int8_dispatch.row_path(rows) for rows in (3, 100, 256, 1000, 3000) if rows > int8_dispatch.GEMV_MAX_ROWS]


@pytest.mark.parametrize("path", ["swap", "slab"])
def test_swap_and_slab_replay_from_a_cuda_graph(path: str) -> None:
    x, weight = _operands(960, 4096, 4096, torch.float16, seed=21, stack=3)
    product = int8_dispatch._PATHS[path]
    eager = product(x, weight)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        product(x, weight)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = product(x, weight)
    x.copy_(torch.randn_like(x))  # new inputs in the same buffer, as the decode graphs get them
    graph.replay()
    _check(replayed, x, weight)
    assert not torch.equal(replayed, eager)


# ---------------------------------------------------------------------------------------------
# The model

SHAPE = CheckpointShape(n_layer=4, n_embd=512)


@pytest.fixture(scope="module")
def models() -> tuple[RWKV7, RWKV7]:
    half = RWKV7.from_state_dict(random_state_dict(SHAPE, seed=3, device=DEV), DEV, torch.float16, progress=False)
    int8 = RWKV7.from_state_dict(random_state_dict(SHAPE, seed=3, device=DEV), DEV, torch.float16, progress=False, weights="int8")
    return half, int8


def _prompts(count: int, length: int) -> list[list[int]]:
    return torch.randint(0, 65536, (count, length), generator=torch.Generator().manual_seed(11)).tolist()


def test_the_int8_model_stays_close_to_the_fp16_model(models: tuple[RWKV7, RWKV7]) -> None:
    half, int8 = models
    prompts = _prompts(8, 32)  # 256 rows: the tile kernel, then 8 decode rows
    half_pool, int8_pool = half.new_pool(8, torch.float32), int8.new_pool(8, torch.float32)
    prefill = half.forward(half_pool, range(8), prompts)
    actual = int8.forward(int8_pool, range(8), prompts)
    error = float((actual - prefill).norm() / prefill.norm())
    assert error < 0.05, f"prefill logits: relative error {error:.2e}"
    for rows in (1, 3, 8):  # the GEMV, then the tile kernel
        feed = [[t] for t in prefill[:rows].argmax(-1).tolist()]
        expected = half.forward(half_pool, range(rows), feed)
        actual = int8.forward(int8_pool, range(rows), feed)
        error = float((actual - expected).norm() / expected.norm())
        assert error < 0.05, f"decode of {rows} rows: relative error {error:.2e}"


def test_int8_decode_replays_from_cuda_graphs_like_the_eager_forward(models: tuple[RWKV7, RWKV7]) -> None:
    _, model = models
    eager_pool, graph_pool = model.new_pool(9, torch.float16), model.new_pool(9, torch.float16)
    prompts = _prompts(6, 12)
    model.forward(eager_pool, range(6), prompts)
    model.forward(graph_pool, range(6), prompts)
    runner = DecodeGraphRunner(model, graph_pool, scratch_slot=8, buckets=(2, 8))
    tokens = [[t] for t in range(100, 106)]
    for rows in (2, 6):  # the GEMV bucket, then the tile bucket (padded with the scratch slot)
        eager = model.forward(eager_pool, range(rows), tokens[:rows])
        slots = torch.arange(rows, device=DEV)
        replayed = runner.decode(slots, torch.tensor([t[0] for t in tokens[:rows]], device=DEV))
        assert torch.allclose(replayed, eager, atol=2e-2, rtol=0), f"{rows} rows: max diff {(replayed - eager).abs().max():.3e}"
