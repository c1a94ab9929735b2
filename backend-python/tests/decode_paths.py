"""GPU checks shared by the decode-path tests: a small random model decoded with some batch-1
Triton paths on and then off, eagerly and from CUDA graphs, whose logits must agree
(test_norm_mix_cuda.py, test_wkv_decode_cuda.py); the same with the CUDA decode ops, bit for bit
(test_norm_mix_decode_cuda.py, test_wkv_decode_step_cuda.py); and an op's CUDA graph replay
against its eager call (those two)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from albatross.cuda_graphs import DecodeGraphRunner
from albatross.random_checkpoint import CheckpointShape, random_state_dict


def _decode_both_ways(allow: Callable[[bool], None], shape: CheckpointShape, seed: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]]:
    """A small random model decoded with `allow(True)` and then `allow(False)`: per setting, the
    logits of eager steps and of captured steps at batches of 2 and 6 (after a prefill, which
    takes the unfused ops either way), and the pool's states at the end."""
    from albatross.model import RWKV7

    model = RWKV7.from_state_dict(random_state_dict(shape, seed=seed, device="cuda"), "cuda", progress=False)
    results = []
    for allowed in (True, False):
        allow(allowed)
        pool = model.new_pool(9, torch.float16)  # slot 8 is the graphs' scratch row
        slots = [0, 2, 3, 4, 5, 6]
        model.forward(pool, slots, [[11 + s, 12, 13][: 1 + s % 3] for s in slots])
        sizes = [2 + 4 * (i % 2) for i in range(4)]
        eager = [model.forward(pool, slots[:n], [[21 + i + s] for s in slots[:n]]) for i, n in enumerate(sizes)]
        runner = DecodeGraphRunner(model, pool, scratch_slot=8, buckets=(2, 8))  # 6 rows run padded in 8
        ids = torch.tensor(slots, device="cuda")
        graphed = [runner.decode(ids[:n], torch.arange(n, device="cuda") + 41 + i).clone() for i, n in enumerate(sizes)]
        results.append((eager, graphed, [pool.att_shift.clone(), pool.ffn_shift.clone(), pool.wkv.clone()]))
    return results


def assert_decode_matches_without(paths: Sequence[ModuleType]) -> None:
    """`paths`: modules with `set_fused_allowed` and `FUSED_BY_DEFAULT` (loras, norm_mix, wkv_decode)."""

    def allow(allowed: bool) -> None:
        for path in paths:
            path.set_fused_allowed(allowed)

    try:
        on, off = _decode_both_ways(allow, CheckpointShape(n_layer=4, n_embd=512), seed=8)
    finally:
        for path in paths:
            path.set_fused_allowed(path.FUSED_BY_DEFAULT)
    for got, expected in [*zip(on[0], off[0]), *zip(on[1], off[1])]:
        rel = ((got - expected).norm() / expected.norm()).item()
        assert rel < 1e-2, f"logits relative difference {rel:.2e}"


def assert_decode_identical(allow: Callable[[bool], None], seed: int) -> None:
    """Decode with `allow(True)` and then `allow(False)` (the caller's switches, which it restores):
    logits eager and from graphs, at batches of 2 and 6, and the states must be bit-identical."""
    on, off = _decode_both_ways(allow, CheckpointShape(n_layer=3, n_embd=256), seed)
    assert all(torch.equal(a, b) for a, b in zip(on[0], off[0])), "eager logits differ"
    assert all(torch.equal(a, b) for a, b in zip(on[1], off[1])), "graph logits differ"
    assert all(torch.equal(a, b) for a, b in zip(on[2], off[2])), "the states differ"


def assert_graph_replays(op: Callable[[dict[str, object]], torch.Tensor], operands: dict[str, object], updated: Sequence[str]) -> None:
    """`op(operands)` captured in a CUDA graph and replayed from the same inputs gives what an eager
    call gives: its output and the operands it updates in place (`updated`)."""

    def fresh() -> dict[str, object]:
        return {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in operands.items()}

    eager = fresh()
    want = op(eager)
    static = fresh()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(fresh())  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(static)
    for name in updated:
        static[name].copy_(operands[name])  # type: ignore[attr-defined]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want), "the replay's output differs from eager"
    for name in updated:
        assert torch.equal(static[name], eager[name]), f"{name}, updated in place, differs between replay and eager"  # type: ignore[arg-type]
