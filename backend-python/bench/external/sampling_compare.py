"""Sampling: our CUDA sampler (`albatross.ops.sample`) against FlashInfer's top-k/top-p
sampling kernels (our binding of them, flashinfer_build.py): time per call at several batch sizes,
and how far many draws from one peaked distribution are from the exact truncated distribution.

Like with like, as far as it goes:
- FlashInfer's "joint" filter keeps a token when fewer than top_k tokens are more likely and their
  mass is below top_p: our definition (albatross/sampler.py, kept_mask) up to ties. FlashInfer's
  default Python order, "top_k_first" (top-k, renormalise, then top-p), draws from another
  distribution and is not measured.
- Ours starts from logits: it subtracts the slot's penalties (all zero here), applies temperature,
  softmax, the filters, draws, and with "penalty update" updates the penalties. FlashInfer's
  kernels start from probabilities, so its rows add a softmax, torch's (as FlashInfer's Python
  "joint" path does) or FlashInfer's own OnlineSoftmax; "draw only" times the kernel alone.
- Ours draws from a per-slot hash stream (seed32, step), FlashInfer from Philox (seed, offset).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from albatross import cuda_ops, ops, sampler
from flashinfer_build import load
from report import Report, markdown
from timing import Deadline, cuda_ms

WORKSPACE_BYTES = 1 << 20  # FlashInfer's Python API gives its softmax the same


@dataclass(frozen=True, slots=True)
class Filter:
    top_k: int  # 0 = off
    top_p: float

    @property
    def label(self) -> str:
        return f"top_k {self.top_k}, top_p {self.top_p}" if self.top_k else f"top_p {self.top_p}"


TIMING_FILTERS = (Filter(50, 0.6), Filter(0, 0.9))
# the third one makes top_k the binding filter on the peaked distribution below
DRAW_FILTERS = (Filter(50, 0.6), Filter(0, 0.9), Filter(20, 0.9))


def our_batch(rows: int, filt: Filter, device: torch.device) -> sampler.SamplingBatch:
    def full(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device=device)

    return sampler.SamplingBatch(
        temperature=full(1.0), top_p=full(filt.top_p), top_k=full(filt.top_k, torch.int64), presence=full(0.0),
        frequency=full(0.0), decay=full(1.0), seed32=(torch.arange(rows, dtype=torch.int64, device=device) * 7919 + 17) & sampler.MASK32,
        step=torch.zeros(rows, dtype=torch.int64, device=device),
    )  # fmt: skip


@dataclass(slots=True)
class FlashinferArgs:
    top_k: torch.Tensor  # int32 [rows]
    top_p: torch.Tensor  # f32 [rows]
    seed: torch.Tensor  # int64 [rows], one Philox stream per row
    offset: torch.Tensor  # int64 [rows]

    @classmethod
    def build(cls, rows: int, filt: Filter, device: torch.device) -> FlashinferArgs:
        return cls(
            top_k=torch.full((rows,), filt.top_k, dtype=torch.int32, device=device),
            top_p=torch.full((rows,), filt.top_p, dtype=torch.float32, device=device),
            seed=torch.arange(1, rows + 1, dtype=torch.int64, device=device),
            offset=torch.zeros(rows, dtype=torch.int64, device=device),
        )


def flashinfer_draw(fi: ModuleType, probs: torch.Tensor, filt: Filter, args: FlashinferArgs) -> tuple[torch.Tensor, torch.Tensor]:
    if filt.top_k > 0:
        return fi.top_k_top_p_from_probs(probs, args.top_k, args.top_p, args.seed, args.offset)
    return fi.top_p_from_probs(probs, args.top_p, args.seed, args.offset)


@dataclass(slots=True)
class TimingRow:
    impl: str
    filter: str
    batch: int
    ms: float
    draws_per_s: float
    note: str = ""


@dataclass(slots=True)
class DrawRow:
    impl: str
    filter: str
    draws: int
    kept_tokens: int
    tv: float  # total variation between the empirical frequencies and the exact distribution
    tv_exact_sampler: float  # the same for an exact sampler with the same number of draws: the noise floor
    outside_kept: int  # draws of a token the filters drop
    invalid: int  # FlashInfer rows reported not valid


TIMING_COLUMNS = (("filter", "filter", ""), ("batch", "batch", "d"), ("impl", "impl", ""), ("ms", "ms/call", ".4f"), ("draws_per_s", "draws/s", ",.0f"), ("note", "note", ""))
DRAW_COLUMNS = (
    ("filter", "filter", ""), ("impl", "impl", ""), ("draws", "draws", ",d"), ("kept_tokens", "kept", "d"), ("tv", "TV", ".4f"),
    ("tv_exact_sampler", "TV exact sampler", ".4f"), ("outside_kept", "outside kept", "d"), ("invalid", "invalid", "d"),
)  # fmt: skip


def timing_impls(fi: ModuleType | None, logits: torch.Tensor, filt: Filter) -> dict[str, tuple[Callable[[], object], str]]:
    """name -> (one call, note) for one batch of logits."""
    rows, device = logits.shape[0], logits.device
    slots = torch.arange(rows, device=device)
    batch = our_batch(rows, filt, device)
    penalties = sampler.PenaltyPool(rows, logits.shape[1], device)
    impls: dict[str, tuple[Callable[[], object], str]] = {
        "ours (penalty update)": (lambda: ops.sample(logits, slots, batch, penalties, True), "logits in; zero penalties read, updated"),
        "ours (no penalty update)": (lambda: ops.sample(logits, slots, batch, penalties, False), "logits in; zero penalties read"),
        "ours, rejection draw (penalty update)": (lambda: ops.sample(logits, slots, batch, penalties, True, rejection=True), "logits in; zero penalties read, updated"),
    }
    if fi is not None:
        args = FlashinferArgs.build(rows, filt, device)
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        probs = torch.softmax(logits, dim=-1)
        impls["flashinfer: torch softmax + draw"] = (lambda: flashinfer_draw(fi, torch.softmax(logits, dim=-1), filt, args), "logits in")
        impls["flashinfer: fi softmax + draw"] = (lambda: flashinfer_draw(fi, fi.softmax(logits, workspace, 1.0), filt, args), "logits in")
        impls["flashinfer: draw only"] = (lambda: flashinfer_draw(fi, probs, filt, args), "probs in")
    return impls


def peaked_logits(vocab: int) -> torch.Tensor:
    """200 tokens at random ids with probabilities proportional to exp(-rank/15), the rest at
    logit -30 (mass ~1e-10 in all). top_p 0.6 keeps 14 tokens, 0.9 keeps 35, and the cumulative
    mass passes each top_p with a margin of more than 0.003, so fp32 rounding cannot move the
    boundary; top_k 20 binds before top_p 0.9."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.full((vocab,), -30.0)
    logits[torch.randperm(vocab, generator=gen)[:200]] = -torch.arange(200, dtype=torch.float32) / 15.0
    return logits


def exact_distribution(logits: torch.Tensor, filt: Filter) -> torch.Tensor:
    """The truncated, renormalised distribution of our definition, in float64 on the CPU."""
    probs = torch.softmax(logits.double(), dim=-1)[None]
    kept = sampler.kept_mask(probs, torch.tensor([filt.top_k]), torch.tensor([filt.top_p], dtype=torch.float64))
    truncated = torch.where(kept, probs, torch.zeros_like(probs))[0]
    return truncated / truncated.sum()


def _draw_row(impl: str, filt: Filter, counts: torch.Tensor, exact: torch.Tensor, invalid: int) -> DrawRow:
    draws = int(counts.sum())
    floor_counts = torch.bincount(torch.multinomial(exact, draws, replacement=True, generator=torch.Generator().manual_seed(9)), minlength=exact.numel())
    return DrawRow(
        impl=impl, filter=filt.label, draws=draws, kept_tokens=int((exact > 0).sum()),
        tv=0.5 * float((counts.double() / draws - exact).abs().sum()),
        tv_exact_sampler=0.5 * float((floor_counts.double() / draws - exact).abs().sum()),
        outside_kept=int(counts[exact == 0].sum()), invalid=invalid,
    )  # fmt: skip


def draw_rows(fi: ModuleType | None, vocab: int, rows: int, calls: int, device: torch.device) -> list[DrawRow]:
    logits = peaked_logits(vocab)
    batch_logits = logits.to(device).expand(rows, vocab).contiguous()
    probs = torch.softmax(batch_logits, dim=-1)
    slots = torch.arange(rows, device=device)
    penalties = sampler.PenaltyPool(rows, vocab, device)
    out: list[DrawRow] = []
    for filt in DRAW_FILTERS:
        exact = exact_distribution(logits, filt)
        batch = our_batch(rows, filt, device)
        for impl, rejection in (("ours", False), ("ours, rejection draw", True)):
            counts = torch.zeros(vocab, dtype=torch.int64, device=device)
            for call in range(calls):
                batch.step.fill_(call)
                counts += torch.bincount(ops.sample(batch_logits, slots, batch, penalties, False, rejection=rejection), minlength=vocab)
            out.append(_draw_row(impl, filt, counts.cpu(), exact, 0))
        if fi is None:
            continue
        args = FlashinferArgs.build(rows, filt, device)
        counts.zero_()
        invalid = torch.zeros((), dtype=torch.int64, device=device)
        for call in range(calls):
            args.seed.copy_(torch.arange(1, rows + 1, device=device) + call * rows)
            ids, valid = flashinfer_draw(fi, probs, filt, args)
            counts += torch.bincount(ids.long(), minlength=vocab)
            invalid += (~valid).sum()
        out.append(_draw_row("flashinfer (joint)", filt, counts.cpu(), exact, int(invalid)))
    return out


def run(args: Any, report: Report, deadline: Deadline) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if not torch.cuda.is_available():
        report.note("sampling: skipped (no CUDA GPU)")
        return [], []
    results = cuda_ops.enable_cuda_kernels()
    if "sample" not in ops.registered_cuda_ops():
        report.note(f"sampling: skipped (our CUDA sampler did not load: {results['sampler'].describe()})")
        return [], []
    fi: ModuleType | None = None
    try:
        fi = load(Path(args.ext_root))
    except Exception as error:  # missing headers or a failed build: skip FlashInfer's rows, say why
        report.note(f"sampling: FlashInfer rows skipped ({type(error).__name__}: {error})")
    device = torch.device("cuda")
    timing: list[dict[str, Any]] = []
    gen = torch.Generator(device=device).manual_seed(3)
    for filt in TIMING_FILTERS:
        for rows in [int(b) for b in args.batches.split(",") if b]:
            if deadline.passed():
                report.note(f"sampling: {filt.label} batch {rows} skipped (time budget spent)")
                continue
            # moderately peaked: the largest of 65536 normal logits times 3 sits ~13 above the mean
            logits = torch.randn(rows, args.vocab, generator=gen, device=device) * args.logit_scale
            for name, (call, note) in timing_impls(fi, logits, filt).items():
                try:
                    ms = cuda_ms(call)
                    row = asdict(TimingRow(name, filt.label, rows, ms, rows / (ms / 1000), note))
                    timing.append(row)
                    report.add("sampling", "timing", row)
                    print(row, flush=True)
                except Exception as error:  # report and go on
                    report.error(f"sampling {filt.label} batch {rows} {name}", error)
    draws: list[dict[str, Any]] = []
    if deadline.passed():
        report.note("sampling: distribution check skipped (time budget spent)")
    else:
        try:
            for row in draw_rows(fi, args.vocab, args.draw_rows, args.draw_calls, device):
                draws.append(asdict(row))
                report.add("sampling", "distribution", asdict(row))
        except Exception as error:
            report.error("sampling distribution", error)
    print("\n" + markdown(timing, TIMING_COLUMNS), flush=True)
    print("\n" + markdown(draws, DRAW_COLUMNS), flush=True)
    return timing, draws
