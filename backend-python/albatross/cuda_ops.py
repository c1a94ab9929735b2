"""Python faces of the CUDA kernels, and the switch that plugs them into `albatross.ops`.

`enable_cuda_kernels()` loads the kernel libraries (kernel_loader's order: prebuilt, JIT, none)
and registers the CUDA WKV op and the fused elementwise ops with `ops.register_cuda_ops`; it is idempotent and does nothing
without a GPU. `sample(...)` has the signature of `albatross.sampler.sample` and runs the CUDA
sampler kernel when its inputs are on a GPU and the kernel is loaded, else the torch sampler.
Both ops are TORCH_LIBRARY ops (`torch.ops.albatross.*`): no host syncs, capturable in CUDA graphs.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from albatross import kernel_loader, ops, sampler

log = logging.getLogger("albatross.kernels")

_enabled: dict[str, kernel_loader.LoadResult] | None = None


def enable_cuda_kernels(manifest_path: Path = kernel_loader.DEFAULT_MANIFEST, allow_jit: bool = True) -> dict[str, kernel_loader.LoadResult]:
    """Load the kernels once per process and route `ops.wkv7` on CUDA tensors to them."""
    global _enabled
    if _enabled is not None:
        return _enabled
    results = kernel_loader.load_kernels(manifest_path=manifest_path, allow_jit=allow_jit)
    summary = "; ".join(result.describe() for result in results.values())
    log.info("albatross kernels loaded: %s", summary)
    if results["wkv7"].how in ("prebuilt", "jit"):
        ops.register_cuda_ops(wkv7=wkv7_cuda)
    if results["fused"].how in ("prebuilt", "jit"):
        ops.register_cuda_ops(
            add_layer_norm=add_layer_norm_cuda,
            shift_mix=shift_mix_cuda,
            wkv_prep=wkv_prep_cuda,
            gn_bonus_gate=gn_bonus_gate_cuda,
            relu_square=relu_square_cuda,
        )
    _enabled = results
    return results


def cuda_sampler_available() -> bool:
    return _enabled is not None and _enabled["sampler"].how in ("prebuilt", "jit")


def wkv7_cuda(
    state: torch.Tensor,
    slot_idx: torch.Tensor,
    cu_seqlens: torch.Tensor,
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    single_token: bool = False,
) -> torch.Tensor:
    """The WKV op of docs/architecture.md on the GPU (state fp32, fp16 or bf16; updated in place).
    `single_token` (one row per slot) selects the decode kernel."""
    return torch.ops.albatross.wkv7(state, slot_idx, cu_seqlens, r, w, k, v, a, b, single_token)


def add_layer_norm_cuda(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`ops.add_layer_norm` in one kernel (x updated in place when delta is given)."""
    return torch.ops.albatross.add_layer_norm(x, delta, weight, bias, ops.LAYER_NORM_EPS)


def shift_mix_cuda(x: torch.Tensor, shift_state: torch.Tensor, batch: ops.FlatBatch, coefficients: torch.Tensor) -> torch.Tensor:
    """`ops.shift_mix` in one kernel (the slots' shift vectors updated in place)."""
    return torch.ops.albatross.shift_mix(x, shift_state, batch.slot_idx_i32, batch.cu_seqlens, coefficients)


def wkv_prep_cuda(
    k: torch.Tensor,
    v: torch.Tensor,
    w_lora: torch.Tensor,
    a_lora: torch.Tensor,
    v_lora: torch.Tensor | None,
    v_first: torch.Tensor | None,
    w0: torch.Tensor,
    a0: torch.Tensor,
    v0: torch.Tensor | None,
    k_k: torch.Tensor,
    k_a: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ops.wkv_prep` in one kernel (k and v updated in place); returns w, a, b."""
    return torch.ops.albatross.wkv_prep(k, v, w_lora, a_lora, v_lora, v_first, w0, a0, v0, k_k, k_a)


def gn_bonus_gate_cuda(
    y: torch.Tensor,
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    r_k: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """`ops.gn_bonus_gate` in one kernel."""
    return torch.ops.albatross.gn_bonus_gate(y, r, k, v, g, r_k, weight, bias, ops.GROUP_NORM_EPS)


def relu_square_cuda(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.albatross.relu_square(x)


def sample_cuda(
    logits: torch.Tensor,
    slots: torch.Tensor,
    batch: sampler.SamplingBatch,
    penalties: sampler.PenaltyPool,
    update_penalties: bool = True,
) -> torch.Tensor:
    """The sampler kernel: same arguments and result as `albatross.sampler.sample`."""
    return torch.ops.albatross.sample(
        logits.float(),
        slots.to(torch.int64),
        batch.temperature,
        batch.top_p,
        batch.top_k,
        batch.presence,
        batch.frequency,
        batch.decay,
        batch.seed32,
        batch.step,
        penalties.penalties,
        penalties.seen,
        update_penalties,
    )


def sample(
    logits: torch.Tensor,
    slots: torch.Tensor,
    batch: sampler.SamplingBatch,
    penalties: sampler.PenaltyPool,
    update_penalties: bool = True,
) -> torch.Tensor:
    """`albatross.sampler.sample`, on the CUDA kernel when it applies. The kernel does not take
    allowed-token masks or logit biases yet: a batch with either runs the torch twin instead."""
    if logits.is_cuda and cuda_sampler_available() and batch.allowed is None and batch.bias is None:
        return sample_cuda(logits, slots, batch, penalties, update_penalties)
    return sampler.sample(logits, slots, batch, penalties, update_penalties)
