"""The memory plan: what a worker needs on its GPU against what is free, decided once at load.

Plain arithmetic on the model's shape (no device calls; the worker passes the free bytes in):

- weights at the chosen format (exact: every tensor the model keeps, albatross/quant.py for int8);
- the state slots at the state dtype, the scratch slot of the graph replays and the per-slot
  penalty rows of the sampler (exact);
- the activations of the largest step (`prefill_budget` prompt rows plus a decode row per slot),
  the head's logits and the sampler's copies of them for every slot, and the dequantized slab of
  the int8 path for many rows (estimates from the model's temporaries, checked against the GPU's
  peak in tests/test_memory_plan_cuda.py), and the prefix states a step captures inside its
  chunks (`MAX_CHECKPOINTS_PER_STEP` slot states, exact);
- the CUDA graphs' memory (the largest bucket's activations, and every bucket's static logits);
- the L1 state cache's budget on this device, and a reserve for the allocator and cuBLAS.

If it all fits, the worker runs as asked. If not, it lowers what it may, in this order, and logs
one line saying so: the L1 cache budget, then `prefill_budget` (halved, not below
`MIN_PREFILL_BUDGET`), then `batch` (the most that fit). If not even one slot fits, it refuses
with one message that says what would fit (`MemoryPlanError`), e.g.

    7.2B fp16 needs 14.5 GB of weights; this GPU has 11.6 GB free: use weights=int8 (7.8 GB) with batch up to 146
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from albatross import wkv_chunked
from albatross.checkpoint import ModelConfig, expected_shapes
from albatross.int8_dispatch import DEQUANTIZE_SLAB
from albatross.model import stacked_lora_padding
from albatross.quant import LARGE_MATRICES, WEIGHT_FORMATS
from albatross_engine.scheduler import MAX_CHECKPOINTS_PER_STEP
from albatross_engine.device_step import graph_buckets

GB = 1e9  # messages use decimal gigabytes, as card makers do
MIN_PREFILL_BUDGET = 512
RESERVE_BYTES = 256 << 20  # cuBLAS workspaces, kernel launch buffers
RESERVE_FRACTION = 0.04  # the caching allocator's rounding and fragmentation, of what is planned
SAMPLER_LOGIT_COPIES = 2  # fp32 [slots, V] rows the sampling step may hold besides the logits
SUGGESTED_BATCH_CAP = 4096  # the largest batch a refusal suggests
_NOT_KEPT = ("blocks.0.ln0.weight", "blocks.0.ln0.bias")  # applied to the embedding at load


class MemoryPlanError(RuntimeError):
    """The model cannot run on this device; the message says what would fit."""


@dataclass(frozen=True, slots=True)
class MemoryRequest:
    """What a worker is asked to run."""

    config: ModelConfig
    weights: str  # "fp16" (the model dtype) or "int8"
    dtype_bytes: int  # weights and activations
    state_dtype_bytes: int
    batch_size: int
    prefill_chunk: int
    prefill_budget: int
    cuda_graphs: bool
    cache_bytes: int = 0  # the L1 state cache's budget on this device
    resident_weight_bytes: int = 0  # weights already on the device when the plan is made

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weights!r}")
        for name in ("dtype_bytes", "state_dtype_bytes", "batch_size", "prefill_chunk", "prefill_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    request: MemoryRequest  # with any lowered values
    weights_bytes: int
    states_bytes: int
    activations_bytes: int
    graphs_bytes: int
    cache_bytes: int
    reserve_bytes: int
    free_bytes: int | None  # None: not checked (the CPU)
    lowered: tuple[str, ...] = ()  # one phrase per lowered setting

    @property
    def batch_size(self) -> int:
        return self.request.batch_size

    @property
    def prefill_budget(self) -> int:
        return self.request.prefill_budget

    @property
    def prefill_chunk(self) -> int:
        return self.request.prefill_chunk

    @property
    def planned_bytes(self) -> int:
        """What the worker will hold on the device beyond what it already held."""
        new_weights = max(0, self.weights_bytes - self.request.resident_weight_bytes)
        return new_weights + self.states_bytes + self.activations_bytes + self.graphs_bytes + self.cache_bytes + self.reserve_bytes

    def as_status(self) -> dict[str, object]:
        return {
            "weights": self.request.weights,
            "weights_bytes": self.weights_bytes,
            "states_bytes": self.states_bytes,
            "activations_bytes": self.activations_bytes,
            "graphs_bytes": self.graphs_bytes,
            "cache_bytes": self.cache_bytes,
            "reserve_bytes": self.reserve_bytes,
            "planned_bytes": self.planned_bytes,
            "free_bytes": self.free_bytes,
            "batch_size": self.batch_size,
            "prefill_budget": self.prefill_budget,
            "prefill_chunk": self.prefill_chunk,
            "lowered": list(self.lowered),
        }


# ---------------------------------------------------------------------------------------------
# The parts


def parameter_count(config: ModelConfig) -> int:
    return sum(math.prod(shape) for shape in expected_shapes(config).values())


def size_label(config: ModelConfig) -> str:
    """"7.2B", "0.4B": the parameter count as model names give it."""
    return f"{parameter_count(config) / 1e9:.1f}B"


def weight_bytes(config: ModelConfig, weights: str, dtype_bytes: int) -> int:
    """Exactly what the model keeps: the large matrices as int8 plus one fp32 scale per output
    channel (`weights="int8"`), everything else at the model dtype."""
    total = 0
    for key, shape in expected_shapes(config).items():
        if key in _NOT_KEPT:
            continue
        count = math.prod(shape)
        if weights == "int8" and key.endswith(LARGE_MATRICES):
            total += count + 4 * shape[0]  # checkpoint matrices are [out, in]
        else:
            total += count * dtype_bytes
    return total + stacked_lora_padding(config) * dtype_bytes


def state_bytes(request: MemoryRequest) -> int:
    """The pool's slots (albatross.state.slot_bytes each), the sampler's penalty rows (fp32 and
    bool per id) and the grammar masks' rows (a bit per id, DeviceStep's device copy)."""
    config = request.config
    pool_slots = request.batch_size + (1 if request.cuda_graphs else 0)  # the graph replays' scratch slot
    return pool_slots * slot_state_bytes(request) + request.batch_size * config.vocab_size * 5 + request.batch_size * config.vocab_size // 8


def slot_state_bytes(request: MemoryRequest) -> int:
    """One slot's state: both token-shift vectors of every layer and the WKV state."""
    config = request.config
    shifts = 2 * config.n_layer * config.n_embd * request.dtype_bytes
    return shifts + config.n_layer * config.n_head * config.head_size * config.head_size * request.state_dtype_bytes


def step_bytes(config: ModelConfig, rows: int, slots: int, dtype_bytes: int, weights: str, dequantizes: bool, prefill: bool = True) -> int:
    """A forward of `rows` flat rows for `slots` slots: the live per-row temporaries at the time-mix
    peak (~26 `[rows, C]` tensors: the residual, v_first, the mixes, r/k/v, the LoRA outputs, the
    WKV inputs and output, and in a `prefill` step the chunked WKV kernel's fp32 scratch during
    its call, ~24 C bytes a row, as a long prompt takes that kernel) or the channel mix
    (`[rows, F]` twice), the head's output and its fp32 copy per slot plus the sampler's, and the
    int8 path's dequantized slab."""
    C, F, V = config.n_embd, config.ffn_size, config.vocab_size
    chunked_wkv = wkv_chunked.scratch_bytes(1, C) if prefill else 0
    per_row = max(dtype_bytes * 26 * C + chunked_wkv, dtype_bytes * (8 * C + 2 * F))
    logits = slots * V * (dtype_bytes + 4 * (1 + SAMPLER_LOGIT_COPIES))
    slab = 0
    if weights == "int8" and dequantizes:
        largest = max(C * C * 3, C * F, C * V)
        slab = dtype_bytes * min(largest, DEQUANTIZE_SLAB)
    return rows * per_row + logits + slab


def graph_bytes(request: MemoryRequest, dequantize_above_rows: int) -> int:
    """Captured decode graphs share one memory pool (the largest bucket's step), and each keeps its
    static fp32 logits."""
    if not request.cuda_graphs:
        return 0
    config, batch = request.config, request.batch_size
    largest = step_bytes(config, batch, batch, request.dtype_bytes, request.weights, batch > dequantize_above_rows, prefill=False)
    return largest + sum(graph_buckets(batch)) * config.vocab_size * 4


# ---------------------------------------------------------------------------------------------
# The plan


def estimate(request: MemoryRequest, free_bytes: int | None, dequantize_above_rows: int) -> MemoryPlan:
    """Every part of `request`, without deciding anything."""
    rows = request.prefill_budget + request.batch_size
    activations = step_bytes(
        request.config, rows, request.batch_size, request.dtype_bytes, request.weights, rows > dequantize_above_rows
    ) + MAX_CHECKPOINTS_PER_STEP * slot_state_bytes(request)
    weights = weight_bytes(request.config, request.weights, request.dtype_bytes)
    states = state_bytes(request)
    graphs = graph_bytes(request, dequantize_above_rows)
    planned = max(0, weights - request.resident_weight_bytes) + states + activations + graphs + request.cache_bytes
    reserve = RESERVE_BYTES + int(RESERVE_FRACTION * planned)
    return MemoryPlan(request, weights, states, activations, graphs, request.cache_bytes, reserve, free_bytes)


def plan_memory(request: MemoryRequest, free_bytes: int | None, dequantize_above_rows: int = 1024) -> MemoryPlan:
    """The plan for `request` on a device with `free_bytes` free (None: no check, as on the CPU).
    Lowers the cache, then the prefill budget, then the batch, to fit; raises MemoryPlanError when
    not even one slot fits. `dequantize_above_rows`: the int8 path's slab threshold."""

    def fits(candidate: MemoryRequest) -> MemoryPlan | None:
        plan = estimate(candidate, free_bytes, dequantize_above_rows)
        return plan if free_bytes is None or plan.planned_bytes <= free_bytes else None

    plan = fits(request)
    if plan is not None:
        return plan
    assert free_bytes is not None
    lowered: list[str] = []
    current = request
    if current.cache_bytes:
        without = dataclasses.replace(current, cache_bytes=0)
        spare = free_bytes - estimate(without, free_bytes, dequantize_above_rows).planned_bytes
        cache = max(0, int(spare / (1 + RESERVE_FRACTION)))
        if cache < current.cache_bytes:
            lowered.append(f"state cache L1 {_gb(current.cache_bytes)} -> {_gb(cache)}")
            current = dataclasses.replace(current, cache_bytes=cache)
    plan = fits(current)
    budget = current.prefill_budget
    floor = min(MIN_PREFILL_BUDGET, current.prefill_budget)
    while plan is None and budget > floor:
        budget = max(floor, budget // 2)
        candidate = dataclasses.replace(current, prefill_budget=budget, prefill_chunk=min(current.prefill_chunk, budget))
        plan = fits(candidate)
        if plan is not None or budget == floor:
            current = candidate
    if current.prefill_budget != request.prefill_budget:
        lowered.append(f"prefill_budget {request.prefill_budget} -> {current.prefill_budget}")
    if plan is None:
        batch = _most_slots(current, free_bytes, dequantize_above_rows)
        if batch == 0:
            raise MemoryPlanError(refusal_message(request, free_bytes, dequantize_above_rows))
        lowered.append(f"batch {request.batch_size} -> {batch}")
        current = dataclasses.replace(current, batch_size=batch)
        plan = fits(current)
        assert plan is not None
    return dataclasses.replace(plan, lowered=tuple(lowered))


def _most_slots(request: MemoryRequest, free_bytes: int, dequantize_above_rows: int, most: int | None = None) -> int:
    """The largest batch (up to `most`, default the request's) that fits with the request's other
    values; 0 if none."""
    low, high = 0, request.batch_size if most is None else most
    while low < high:
        middle = (low + high + 1) // 2
        plan = estimate(dataclasses.replace(request, batch_size=middle), free_bytes, dequantize_above_rows)
        if plan.planned_bytes <= free_bytes:
            low = middle
        else:
            high = middle - 1
    return low


def refusal_message(request: MemoryRequest, free_bytes: int, dequantize_above_rows: int = 1024) -> str:
    """One sentence: what the model needs, what is free, and what would fit instead."""
    config = request.config
    weights = weight_bytes(config, request.weights, request.dtype_bytes)
    head = f"{size_label(config)} {request.weights} needs {_gb(weights)} of weights"
    minimal = dataclasses.replace(
        request, batch_size=1, cache_bytes=0, prefill_budget=min(MIN_PREFILL_BUDGET, request.prefill_budget),
        prefill_chunk=min(request.prefill_chunk, MIN_PREFILL_BUDGET),
    )  # fmt: skip
    running = estimate(minimal, free_bytes, dequantize_above_rows).planned_bytes - max(0, weights - request.resident_weight_bytes)
    if weights <= free_bytes:
        head += f" and {_gb(running)} to run one request"
    head += f"; this GPU has {_gb(free_bytes)} free"
    if request.weights != "int8":
        as_int8 = dataclasses.replace(minimal, weights="int8", resident_weight_bytes=0, batch_size=request.batch_size)
        batch = _most_slots(as_int8, free_bytes, dequantize_above_rows, SUGGESTED_BATCH_CAP)
        if batch:
            int8_bytes = weight_bytes(config, "int8", request.dtype_bytes)
            return f"{head}: use weights=int8 ({_gb(int8_bytes)}) with batch up to {batch}"
        return f"{head}: it does not fit even with weights=int8 ({_gb(weight_bytes(config, 'int8', request.dtype_bytes))}); use a smaller model or a GPU with more memory"
    return f"{head}: use a smaller model or a GPU with more memory"


def _gb(count: int) -> str:
    return f"{count / GB:.1f} GB"
