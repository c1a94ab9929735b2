"""WKV-7 on one layer of the 7.2B shape (64 heads): our CUDA op `albatross.ops.wkv7` against
flash-linear-attention's Triton RWKV-7 kernels (`fla.ops.rwkv7`: chunk, fused_recurrent,
fused_mul_recurrent); time per call and max error against a float64 reference.

Parameter mapping (read from the fla 0.6.0 sources; `mapping_check` verifies it on the CPU against
fla's naive recurrence):

    ours  S [value, key] per head:  S = S diag(exp(-exp(w))) + (S a) b^T + v k^T,  y = S r
    fla   h [key, value] = S^T;  w is the log decay gk = -exp(w_ours);  r (fla's q), k, v, a, b
          unchanged;  scale = 1 (fla's default would be 64**-0.5);  fused_mul_recurrent takes
          kk and iclr and forms a = -kk, b = kk * iclr itself, as fla's RWKV7 layer calls it
    rows  our [T, H*64] rows are fla's varlen [1, T, H, 64] (cu_seqlens, B = 1), no copy

fla keeps no slot indirection: it takes the initial states as one [N, H, K, V] tensor and returns
new final states, so a pool-backed engine would gather and scatter them around each call. The
"ms +pool" column times that too (with the pool kept in fla's [K, V] layout, so no transposes).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from albatross import cuda_ops, ops
from report import Report, markdown
from timing import Deadline, cuda_ms

HEAD = 64
# fla's RWKV7 layer passes this bound (w = -exp(-0.5) * sigmoid(.)); ours satisfies it too, since
# our w <= -0.5 gives -exp(w) >= -exp(-0.5). It licenses fla's 64-token tensor-core chunk scheme.
FLA_LOWER_BOUND = -math.exp(-0.5)


@dataclass(frozen=True, slots=True)
class WkvCase:
    sequences: int
    length: int
    heads: int = 64

    @property
    def label(self) -> str:
        return f"{'decode' if self.length == 1 else 'prefill'} {self.sequences}x{self.length}"

    @property
    def tokens(self) -> int:
        return self.sequences * self.length

    def ideal_bytes(self) -> int:
        """Each input row read once (r, w, k, v, a, b fp16), y written once, each state read and
        written once (fp32): the traffic an ideal kernel cannot avoid."""
        return self.tokens * self.heads * HEAD * 2 * 7 + self.sequences * self.heads * HEAD * HEAD * 4 * 2


def parse_cases(text: str, heads: int) -> list[WkvCase]:
    cases = []
    for item in text.split(","):
        sequences, length = (int(n) for n in item.lower().split("x"))
        if sequences < 1 or length < 1 or heads < 1:
            raise ValueError(f"{item!r}: sequences, length and heads must be positive")
        cases.append(WkvCase(sequences, length, heads))
    return cases


@dataclass(slots=True)
class WkvInputs:
    r: torch.Tensor  # [T, C] activations; w is our raw w (decay = exp(-exp(w)))
    w: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor  # -kk
    b: torch.Tensor  # kk * iclr
    kk: torch.Tensor  # for fla's fused_mul_recurrent
    iclr: torch.Tensor
    state0: torch.Tensor  # fp32 [N, H, 64, 64], our [value, key] layout
    slot_idx: torch.Tensor  # int32 [N]
    cu_seqlens: torch.Tensor  # int32 [N + 1] (ours)
    cu_seqlens64: torch.Tensor  # int64 (fla)
    cu_seqlens_cpu: torch.Tensor  # int64 on the host: fla's chunk sizes its chunk table without a sync


def make_inputs(case: WkvCase, device: torch.device | str, seed: int, dtype: torch.dtype = torch.float16) -> WkvInputs:
    """Random inputs with the magnitudes the model produces (albatross/model.py, wkv_prep; the
    ranges of random_checkpoint): decay exp(-exp(-softplus(-z) - 0.5)) in (0.545, 1) with z around
    w0 ~ U(-6, 1), kk a unit vector per head, iclr = sigmoid(.), k scaled by (1 + (iclr - 1) k_a).
    The recurrence stays bounded over thousands of tokens, as in the model."""
    gen = torch.Generator(device=device).manual_seed(seed)
    T, C, H = case.tokens, case.heads * HEAD, case.heads

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device) * std

    def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, device=device) * (high - low) + low

    w = -F.softplus(-(uniform(-6.0, 1.0, C) + randn(T, C, std=0.5))) - 0.5
    raw_k = randn(T, C, std=0.5)
    iclr = torch.sigmoid(randn(C, std=0.5) + randn(T, C, std=0.5))
    kk = F.normalize((raw_k * uniform(0.5, 1.0, C)).view(T, H, HEAD), dim=-1).view(T, C)
    k = raw_k * (1 + (iclr - 1) * uniform(0.5, 1.5, C))
    kk_d, iclr_d = kk.to(dtype), iclr.to(dtype)
    starts = torch.arange(0, T + 1, case.length, dtype=torch.int64)
    return WkvInputs(
        r=randn(T, C, std=0.5).to(dtype), w=w.to(dtype), k=k.to(dtype), v=randn(T, C).to(dtype),
        a=-kk_d, b=(kk_d.float() * iclr_d.float()).to(dtype), kk=kk_d, iclr=iclr_d,
        state0=randn(case.sequences, H, HEAD, HEAD, std=0.3),
        slot_idx=torch.arange(case.sequences, dtype=torch.int32, device=device),
        cu_seqlens=starts.to(torch.int32).to(device), cu_seqlens64=starts.to(device), cu_seqlens_cpu=starts,
    )  # fmt: skip


def reference(inputs: WkvInputs, case: WkvCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence in float64 from the exact inputs the kernels get: y [T, C], final states
    [N, H, 64, 64] in our layout. All sequences have the same length, so one step covers all."""
    N, L, H = case.sequences, case.length, case.heads

    def seq(x: torch.Tensor) -> torch.Tensor:
        return x.double().view(N, L, H, HEAD)

    r, w, k, v, a, b = (seq(x) for x in (inputs.r, inputs.w, inputs.k, inputs.v, inputs.a, inputs.b))
    decay = torch.exp(-torch.exp(w))
    S = inputs.state0.double().clone()
    y = torch.empty(N, L, H, HEAD, dtype=torch.float64, device=S.device)
    for t in range(L):
        sa = S @ a[:, t, :, :, None]
        S = S * decay[:, t, :, None, :] + sa @ b[:, t, :, None, :] + v[:, t, :, :, None] @ k[:, t, :, None, :]
        y[:, t] = (S @ r[:, t, :, :, None])[..., 0]
    return y.view(case.tokens, H * HEAD), S


def fla_gate(inputs: WkvInputs, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fla's w: the log decay, -exp(w) (fp32 by default, so the mapping adds no rounding)."""
    return (-torch.exp(inputs.w.float())).to(dtype)


def _heads(x: torch.Tensor) -> torch.Tensor:
    return x.view(1, x.shape[0], -1, HEAD)


def _fla_chunk(fla: ModuleType, inputs: WkvInputs, gate: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # the settings fla's RWKV7 layer uses for prompts of 64+ tokens
    return fla.chunk_rwkv7(
        r=_heads(inputs.r), w=_heads(gate), k=_heads(inputs.k), v=_heads(inputs.v), a=_heads(inputs.a), b=_heads(inputs.b),
        scale=1.0, initial_state=h0, output_final_state=True, cu_seqlens=inputs.cu_seqlens64,
        cu_seqlens_cpu=inputs.cu_seqlens_cpu, safe_gate=True, lower_bound=FLA_LOWER_BOUND, chunk_size=64,
    )  # fmt: skip


def _fla_recurrent(fla: ModuleType, inputs: WkvInputs, gate: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fla.fused_recurrent_rwkv7(
        r=_heads(inputs.r), w=_heads(gate), k=_heads(inputs.k), v=_heads(inputs.v), a=_heads(inputs.a), b=_heads(inputs.b),
        scale=1.0, initial_state=h0, output_final_state=True, cu_seqlens=inputs.cu_seqlens64,
    )  # fmt: skip


def _fla_mul_recurrent(fla: ModuleType, inputs: WkvInputs, gate: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # what fla's RWKV7 layer uses in inference below 64 tokens (decode); a is iclr here
    return fla.fused_mul_recurrent_rwkv7(
        r=_heads(inputs.r), w=_heads(gate), k=_heads(inputs.k), v=_heads(inputs.v), kk=_heads(inputs.kk), a=_heads(inputs.iclr),
        scale=1.0, initial_state=h0, output_final_state=True, cu_seqlens=inputs.cu_seqlens64,
    )  # fmt: skip


FlaKernel = Callable[[ModuleType, WkvInputs, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# name -> (kernel, shortest sequence it is run for): chunking one-token sequences measures nothing useful
FLA_KERNELS: dict[str, tuple[FlaKernel, int]] = {
    "chunk": (_fla_chunk, 2),
    "recurrent": (_fla_recurrent, 1),
    "mul_recurrent": (_fla_mul_recurrent, 1),
}


@dataclass(slots=True)
class WkvRow:
    impl: str
    case: str
    ms: float | None = None
    ms_pool: float | None = None
    tokens_per_s: float | None = None
    tb_per_s: float | None = None
    y_err: float | None = None
    y_rel_rms: float | None = None  # rms(y - ref) / rms(ref): fp16 output rounding alone gives ~1e-4
    state_err: float | None = None
    y_ref_max: float | None = None
    state_ref_max: float | None = None
    note: str = ""


COLUMNS = (
    ("case", "case", ""), ("impl", "impl", ""), ("ms", "ms/call", ".3f"), ("ms_pool", "ms +pool", ".3f"),
    ("tokens_per_s", "tok/s", ",.0f"), ("tb_per_s", "eq. TB/s", ".2f"), ("y_err", "max|y err|", ".2e"),
    ("y_rel_rms", "rms y err (rel)", ".1e"), ("state_err", "max|state err|", ".2e"), ("y_ref_max", "max|y|", ".1f"),
    ("state_ref_max", "max|S|", ".1f"), ("note", "note", ""),
)  # fmt: skip


def mapping_check(fla_naive: Callable[..., Any]) -> dict[str, float]:
    """On the CPU, small shape, fp32: our torch twin and fla's naive dplr recurrence (through the
    mapping above) against the float64 reference. Both errors should be ~1e-6; a wrong transpose
    or sign convention shows as O(1)."""
    case = WkvCase(sequences=2, length=9, heads=2)
    inputs = make_inputs(case, "cpu", seed=11, dtype=torch.float32)
    ref_y, ref_S = reference(inputs, case)
    state = inputs.state0.clone()
    ours_y = ops.wkv7_torch(state, inputs.slot_idx, inputs.cu_seqlens, inputs.r, inputs.w, inputs.k, inputs.v, inputs.a, inputs.b)

    def bhld(x: torch.Tensor) -> torch.Tensor:  # [T, C] -> fla naive's [B, H, L, D]
        return x.view(case.sequences, case.length, case.heads, HEAD).transpose(1, 2).contiguous()

    # the naive reference scales q by D**-0.5 itself; undo it to get scale 1
    o, S = fla_naive(
        bhld(inputs.r) * HEAD**0.5, bhld(inputs.k), bhld(inputs.v), bhld(inputs.a), bhld(inputs.b), bhld(fla_gate(inputs)),
        initial_state=inputs.state0.transpose(-1, -2).contiguous(), output_final_state=True,
    )  # fmt: skip
    fla_y = o.transpose(1, 2).reshape(case.tokens, -1)
    return {
        "ours_torch_y_err": float((ours_y.double() - ref_y).abs().max()),
        "ours_torch_state_err": float((state.double() - ref_S).abs().max()),
        "fla_naive_y_err": float((fla_y.double() - ref_y).abs().max()),
        "fla_naive_state_err": float((S.transpose(-1, -2).double() - ref_S).abs().max()),
    }


def _errors(row: WkvRow, y: torch.Tensor, state: torch.Tensor, ref_y: torch.Tensor, ref_S: torch.Tensor) -> None:
    diff = y.double() - ref_y
    row.y_err = float(diff.abs().max())
    row.y_rel_rms = float(diff.norm() / ref_y.norm())
    row.state_err = float((state.double() - ref_S).abs().max())
    row.y_ref_max = float(ref_y.abs().max())
    row.state_ref_max = float(ref_S.abs().max())


def _speed(row: WkvRow, case: WkvCase, ms: float) -> None:
    row.ms = ms
    row.tokens_per_s = case.tokens / (ms / 1000)
    row.tb_per_s = case.ideal_bytes() / (ms / 1000) / 1e12


def bench_ours(case: WkvCase, inputs: WkvInputs, ref: tuple[torch.Tensor, torch.Tensor]) -> WkvRow:
    row = WkvRow("ours (albatross wkv7)", case.label, note="addresses pool slots itself")
    state = inputs.state0.clone()
    y = ops.wkv7(state, inputs.slot_idx, inputs.cu_seqlens, inputs.r, inputs.w, inputs.k, inputs.v, inputs.a, inputs.b)
    _errors(row, y, state, *ref)
    _speed(row, case, cuda_ms(lambda: ops.wkv7(state, inputs.slot_idx, inputs.cu_seqlens, inputs.r, inputs.w, inputs.k, inputs.v, inputs.a, inputs.b)))
    row.ms_pool = row.ms
    return row


def bench_fla(fla: ModuleType, name: str, case: WkvCase, inputs: WkvInputs, ref: tuple[torch.Tensor, torch.Tensor]) -> WkvRow:
    kernel, _ = FLA_KERNELS[name]
    row = WkvRow(f"fla {name}", case.label)
    h0 = inputs.state0.transpose(-1, -2).contiguous()
    gate = fla_gate(inputs)
    try:  # the first call also runs fla's Triton autotuning
        o, ht = kernel(fla, inputs, gate, h0)
    except Exception as first:  # retry with the gate in the activation dtype, as fla's layer passes it
        gate = fla_gate(inputs, inputs.r.dtype)
        try:
            o, ht = kernel(fla, inputs, gate, h0)
        except Exception as second:
            raise RuntimeError(f"fp32 gate: {type(first).__name__}: {first}; {gate.dtype} gate: {type(second).__name__}: {second}") from second
        row.note = f"gate {gate.dtype} (fp32 gate failed: {type(first).__name__})"
    _errors(row, o.view(case.tokens, -1), ht.transpose(-1, -2), *ref)
    if name == "mul_recurrent":
        row.note = (row.note + "; " if row.note else "") + "b = kk*iclr formed in-kernel"
    _speed(row, case, cuda_ms(lambda: kernel(fla, inputs, gate, h0)))

    pool = h0.clone()
    slots = inputs.slot_idx.to(torch.int64)

    def pooled() -> None:
        _, final = kernel(fla, inputs, gate, pool.index_select(0, slots))
        pool.index_copy_(0, slots, final)

    row.ms_pool = cuda_ms(pooled)
    return row


def import_fla() -> tuple[ModuleType | None, Callable[..., Any] | None, str]:
    """fla.ops.rwkv7 and fla's naive dplr recurrence, or Nones and why."""
    try:
        import fla
        import fla.ops.rwkv7 as fla_rwkv7
        from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence
    except Exception as error:  # any import failure means: skip fla, say why
        return None, None, f"{type(error).__name__}: {error}"
    return fla_rwkv7, dplr_recurrence, getattr(fla, "__version__", "?")


def warm_fla(name: str, cases: list[WkvCase]) -> None:
    """Call one fla kernel once per case and exit: its Triton autotuning and compiles land in
    Triton's disk cache (fla enables autotune result caching), where the main run finds them. The
    GPU session runs one of these per kernel in parallel, since compiling ~180 Triton configs one
    after another would take most of a device call."""
    fla, _, why = import_fla()
    if fla is None or not torch.cuda.is_available():
        print(f"fla {name} not warmed: {why if fla is None else 'no CUDA GPU'}", flush=True)
        return
    kernel, shortest = FLA_KERNELS[name]
    start = time.perf_counter()
    for case in cases:
        if case.length < shortest:
            continue
        inputs = make_inputs(case, "cuda", seed=case.tokens)
        try:
            kernel(fla, inputs, fla_gate(inputs), inputs.state0.transpose(-1, -2).contiguous())
            torch.cuda.synchronize()
            print(f"fla {name} {case.label}: ready after {time.perf_counter() - start:.0f}s", flush=True)
        except Exception as error:  # the main run meets it again and reports it
            print(f"fla {name} {case.label}: {type(error).__name__}: {error}", flush=True)
        del inputs
        torch.cuda.empty_cache()


def run(args: Any, report: Report, deadline: Deadline) -> list[dict[str, Any]]:
    fla, fla_naive, fla_version = import_fla()
    report.put("wkv", "fla", fla_version if fla else None)
    if fla is None:
        report.note(f"wkv: fla skipped (flash-linear-attention not importable: {fla_version})")
    else:
        try:
            check = mapping_check(fla_naive)
            report.put("wkv", "mapping_check_cpu", check)
            print("wkv: mapping check on the CPU (fp32 vs float64, should be ~1e-6): " + ", ".join(f"{k} {v:.1e}" for k, v in check.items()), flush=True)
        except Exception as error:  # the GPU comparison still has its own float64 reference
            report.error("wkv mapping check", error)
    if not torch.cuda.is_available():
        report.note("wkv: GPU part skipped (no CUDA GPU)")
        return []
    kernels = [name for name in args.fla_kernels.split(",") if name]
    rows: list[dict[str, Any]] = []
    ours_ready: bool | None = None
    for case in parse_cases(args.wkv_shapes, args.heads):
        if deadline.passed():
            report.note(f"wkv: {case.label} skipped (time budget spent)")
            continue
        try:
            inputs = make_inputs(case, "cuda", seed=case.tokens)
            ref = reference(inputs, case)
        except Exception as error:  # report and go on with the next case
            report.error(f"wkv {case.label} inputs/reference", error)
            continue
        # fla first: its Triton autotuning overlaps with a background JIT build of our kernels
        for name in kernels if fla is not None else []:
            if case.length < FLA_KERNELS[name][1]:
                continue
            try:
                row = asdict(bench_fla(fla, name, case, inputs, ref))
                rows.append(row)
                report.add("wkv", "rows", row)
                print(row, flush=True)
            except Exception as error:
                report.error(f"wkv {case.label} fla {name}", error)
        if ours_ready is None:
            try:
                cuda_ops.enable_cuda_kernels()
            except Exception as error:  # e.g. a failed JIT build: fla's rows still count
                report.error("wkv: loading our kernels", error)
            ours_ready = "wkv7" in ops.registered_cuda_ops()
            if not ours_ready:
                report.note("wkv: ours skipped (the wkv7 CUDA kernel did not load; the torch twin is no benchmark)")
        if ours_ready:
            try:
                row = asdict(bench_ours(case, inputs, ref))
                rows.append(row)
                report.add("wkv", "rows", row)
                print(row, flush=True)
            except Exception as error:
                report.error(f"wkv {case.label} ours", error)
        del inputs, ref
        torch.cuda.empty_cache()
    print("\n" + markdown(rows, COLUMNS), flush=True)
    return rows
