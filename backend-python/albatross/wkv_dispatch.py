"""Which WKV kernel runs a forward call: the sequential one (`ops.wkv7`: decode steps, short or
many chunks) or the chunked-parallel Triton prefill (`wkv_chunked_triton`: few long chunks).

The sequential kernel walks a slot's tokens one after another, ~1 us a token for each (slot,
head), so a call of a few long chunks leaves most of the GPU idle; the chunked kernel does ~2.5x
the arithmetic per token but in parallel matrix products, so it wins until the sequential grid
fills the GPU. The decision uses only host-side lengths (no device sync). `POLICY` holds the
measured switch point (docs/kernels.md, "Chunked WKV prefill"); benchmarks replace it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from albatross import ops

log = logging.getLogger("albatross.kernels")


@dataclass(frozen=True, slots=True)
class ChunkedPolicy:
    """Take the chunked kernel when the longest slot has at least `min_tokens` tokens and the
    slots that long, times the heads, are at most `max_long_heads` sequential chains (past that
    the sequential kernel's grid fills the GPU and its lower arithmetic wins). `enabled=False`
    always takes the sequential kernel."""

    # Measured on the H200 (docs/performance.md, "Session 7"): the chunked kernel wins for one long
    # slot (1x1024: 0.46 against 0.98 ms a layer, 1x4096: 1.68 against 3.85), loses for one of 256
    # tokens (0.26 against 0.17; 512 lies past the ~280-token crossover the two imply) and from
    # four long slots (4x1024: 1.59 against 1.00), so only one slot's heads may run chunked.
    min_tokens: int = 512
    max_long_heads: int = 64
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.min_tokens < 2 or self.max_long_heads < 1:
            raise ValueError(f"min_tokens must be >= 2 and max_long_heads >= 1, got {self}")

    def prefers_chunked(self, lengths: tuple[int, ...], heads: int) -> bool:
        if not self.enabled or not lengths or max(lengths) < self.min_tokens:
            return False
        long_slots = sum(1 for n in lengths if n >= self.min_tokens)
        return long_slots * heads <= self.max_long_heads


DEFAULT_POLICY = ChunkedPolicy()
POLICY = DEFAULT_POLICY  # benchmarks replace it to compare the kernels

_chunked: Any = None  # the Triton module once imported; False when it cannot be
_offsets_cache: tuple[ops.FlatBatch, torch.Tensor] | None = None  # one batch's chunk offsets, reused by every layer


def chunked_kernel_available() -> bool:
    """Import the Triton kernels once (triton ships with CUDA builds of torch); False without it."""
    global _chunked
    if _chunked is None:
        try:
            from albatross import wkv_chunked_triton

            _chunked = wkv_chunked_triton
        except ImportError as error:  # a CPU build of torch or no triton: the sequential kernel serves
            log.info("chunked WKV prefill unavailable (%s); the sequential kernel runs every call", error)
            _chunked = False
    return _chunked is not False


def wkv7(
    state: torch.Tensor,
    batch: ops.FlatBatch,
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    policy: ChunkedPolicy | None = None,
) -> torch.Tensor:
    """`ops.wkv7` for one layer of a forward call, on the kernel the policy picks."""
    policy = POLICY if policy is None else policy
    if (
        state.is_cuda
        and not batch.single_token
        and policy.prefers_chunked(batch.lengths, state.shape[1])
        and chunked_kernel_available()
    ):
        return _chunked.wkv7_chunked_triton(
            state, batch.slot_idx, batch.cu_seqlens, r, w, k, v, a, b, batch.lengths, offsets=_offsets(batch)
        )
    return ops.wkv7(state, batch.slot_idx, batch.cu_seqlens, r, w, k, v, a, b, batch.single_token)


def _offsets(batch: ops.FlatBatch) -> torch.Tensor:
    global _offsets_cache
    cached = _offsets_cache  # read once: workers on other GPUs replace it from their threads
    if cached is None or cached[0] is not batch:
        host = torch.tensor(_chunked.chunk_offsets(batch.lengths), dtype=torch.int32)
        cached = (batch, ops.host_to_device(host, batch.cu_seqlens.device))
        _offsets_cache = cached
    return cached[1]
