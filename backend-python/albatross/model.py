"""The RWKV-7 model: weights laid out for inference and the batched state-slot forward.

One `forward` call advances any set of pool slots by any number of tokens each (1 = decode, more
= a prefill chunk). All tokens are flattened into `[total_T, C]` rows so every matmul runs once
over the whole batch; only the token shift and the WKV recurrence look at slot boundaries, and
both go through `albatross.ops`, where CUDA kernels replace the torch twins.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from albatross import linear, lora_prep, loras, norm_mix, ops, wkv_decode, wkv_dispatch
from albatross.checkpoint import ModelConfig, fingerprint, read_state_dict, resolve_checkpoint_path, validate_state_dict
from albatross.dtypes import DTYPES, SUPPORTED_DTYPES, default_dtype_name, dtype_named
from albatross.quant import DEFAULT_WEIGHT_FORMAT, LARGE_MATRICES, Int8Weight, check_weight_format, quantize
from albatross.state import SlotState, StatePool

_ATT_MIX = ("x_r", "x_k", "x_v", "x_w", "x_a", "x_g")  # r, k, v first: their mixes feed one bmm
# Fields that are views of a stack (counted once, through the stack).
_VIEWS = ("receptance", "key", "value", "w1", "w2", "a1", "a2", "v1", "v2")
_EMB_NORM_ROWS = 8192  # rows of the embedding layer-normed at once (bounds the fp32 temporary)
_TRANSPOSE_SLAB = 1 << 24  # elements of a large matrix moved to the device at once (32 MB in fp16)


@dataclass(slots=True)
class LayerWeights:
    """One block. Matrices are stored `[in, out]` so activations multiply as `x @ W`; the
    per-channel vectors are flat `[C]`."""

    ln1_weight: torch.Tensor
    ln1_bias: torch.Tensor
    ln2_weight: torch.Tensor
    ln2_bias: torch.Tensor
    att_mix: torch.Tensor  # [6, C]: x_r, x_k, x_v, x_w, x_a, x_g
    w0: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    a0: torch.Tensor
    a1: torch.Tensor
    a2: torch.Tensor
    v0: torch.Tensor | None  # block 0 defines v_first and has no value residual
    v1: torch.Tensor | None
    v2: torch.Tensor | None
    g1: torch.Tensor
    g2: torch.Tensor
    # The value (blocks 1+), decay and in-context-rate LoRAs stacked in that order, each padded with
    # zeros to the largest of their ranks, so their six small products are two bmm calls: at batch 1
    # each small product cost ~4.5 us of launch-bound GPU time (H200 profile, docs/performance.md).
    # v1/v2, w1/w2, a1/a2 above are views into these.
    lora_down: torch.Tensor  # [n, C, R]
    lora_up: torch.Tensor  # [n, R, C]
    k_k: torch.Tensor
    k_a: torch.Tensor
    r_k: torch.Tensor  # [C]: the [H, N] checkpoint tensor flattened
    # The large matrices: float tensors, or int8 with scales (`weights=int8`), multiplied through `linear`.
    rkv: linear.Weight  # [3, C, C]: receptance, key, value stacked, so the three are one bmm
    receptance: linear.Weight  # views of rkv
    key: linear.Weight
    value: linear.Weight
    output: linear.Weight
    ln_x_weight: torch.Tensor
    ln_x_bias: torch.Tensor
    ffn_mix: torch.Tensor
    ffn_key: linear.Weight  # [C, F]
    ffn_value: linear.Weight  # [F, C]


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return DTYPES[default_dtype_name(device.type)]
    if isinstance(dtype, str):
        return dtype_named(dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be fp32, fp16 or bf16; got {dtype}")
    return dtype


class _Converter:
    """Moves tensors out of a state dict one at a time: pop (freeing the source once converted),
    transpose matrices, flatten vectors, cast, place on the device. With `weights="int8"` the
    large matrices are quantized on the device from the file's own precision."""

    def __init__(
        self,
        source: MutableMapping[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        weights: str,
        progress: bool,
        prequantized: dict[str, Int8Weight] | None = None,
    ):
        self.source = source
        self.device = device
        self.dtype = dtype
        self.weights = weights
        self.prequantized = prequantized or {}  # matrices of an int8 checkpoint, by official key
        self.bar = tqdm(total=len(source), desc="loading weights", unit="tensor", file=sys.stderr, disable=not progress)

    def take(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The converted tensor, written into `out` when given (a stack's row)."""
        tensor = self.source.pop(key)
        self.bar.update(1)
        if key.endswith(LARGE_MATRICES):  # stored [out, in]; kept [in, out]
            return _transposed_to(tensor, self.device, self.dtype, out)
        tensor = tensor.to(self.device)
        if tensor.dim() != 2 or key.endswith("att.r_k"):
            tensor = tensor.reshape(-1)  # (1, 1, C) mixing vectors and r_k [H, N] become [C]
        converted = tensor.to(self.dtype, memory_format=torch.contiguous_format)
        if out is None:
            return converted
        out.copy_(converted)
        return out

    def take_stacked(self, keys: Sequence[str]) -> torch.Tensor:
        first = self.take(keys[0])
        stacked = torch.empty((len(keys), *first.shape), dtype=first.dtype, device=first.device)
        stacked[0] = first
        del first
        for n, key in enumerate(keys[1:], start=1):
            self.take(key, stacked[n])
        return stacked

    def take_matrix(self, key: str) -> linear.Weight:
        """A large matrix `[in, out]`, in the model dtype or quantized."""
        if key in self.prequantized:
            return self._as_asked(self._prequantized(key))
        if self.weights == "fp16":
            return self.take(key)
        return quantize(self._raw_matrix(key), self.device)

    def take_matrices(self, keys: Sequence[str]) -> linear.Weight:
        if keys[0] in self.prequantized:
            parts = [self._prequantized(key) for key in keys]
            return self._as_asked(Int8Weight(torch.stack([p.q for p in parts]), torch.stack([p.scale for p in parts])))
        if self.weights == "fp16":
            return self.take_stacked(keys)
        parts = [quantize(self._raw_matrix(key), self.device) for key in keys]
        return Int8Weight(torch.stack([p.q for p in parts]), torch.stack([p.scale for p in parts]))

    def _prequantized(self, key: str) -> Int8Weight:
        self.source.pop(key)  # its shape-only placeholder
        self.bar.update(1)
        weight = self.prequantized.pop(key)
        return Int8Weight(weight.q.to(self.device), weight.scale.to(self.device))

    def _as_asked(self, weight: Int8Weight) -> linear.Weight:
        return weight if self.weights == "int8" else weight.dequantize(self.dtype)

    def _raw_matrix(self, key: str) -> torch.Tensor:
        """A matrix `[in, out]` where the file keeps it (a transposed view): `quantize` moves it."""
        tensor = self.source.pop(key)
        self.bar.update(1)
        return tensor.t()

    def take_optional(self, key: str) -> torch.Tensor | None:
        return self.take(key) if key in self.source else None

    def close(self) -> None:
        self.bar.close()


class RWKV7:
    """An RWKV-7 (x070) model ready for `forward`. Build with `load` or `from_state_dict`."""

    def __init__(
        self,
        config: ModelConfig,
        layers: list[LayerWeights],
        emb: torch.Tensor,
        ln_out_weight: torch.Tensor,
        ln_out_bias: torch.Tensor,
        head: linear.Weight,
        fingerprint: str,
        name: str,
        weights: str = DEFAULT_WEIGHT_FORMAT,
    ) -> None:
        self.config = config
        self.layers = layers
        self.emb = emb  # [V, C], already layer-normed with ln0
        self.ln_out_weight = ln_out_weight
        self.ln_out_bias = ln_out_bias
        self.head: linear.Weight = head  # [C, V]
        self.fingerprint = fingerprint
        self.name = name
        self.weights = weights  # "fp16": matrices at the model dtype; "int8": quantized
        self.dtype: torch.dtype = emb.dtype
        self.device: torch.device = emb.device
        # Each block's vectors for its WKV step, bundled once here rather than on every forward.
        self._step_weights = [
            wkv_decode.StepWeights(layer.w0, layer.a0, layer.v0 if index else None, layer.k_k, layer.k_a, layer.r_k, layer.ln_x_weight, layer.ln_x_bias)
            for index, layer in enumerate(layers)
        ]

    # ------------------------------------------------------------------------------------------
    # loading

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        progress: bool = True,
        weights: str = DEFAULT_WEIGHT_FORMAT,
    ) -> RWKV7:
        """Load a `.pth` checkpoint (suffix optional) or an int8 `.safetensors` one
        (albatross/int8_checkpoint.py). Default dtype: fp32 on CPU, fp16 on CUDA; `weights="int8"`
        quantizes the large matrices (albatross/quant.py); an int8 file with `weights="fp16"` is
        dequantized."""
        resolved = resolve_checkpoint_path(path)
        if resolved.suffix == ".safetensors":
            from albatross import int8_checkpoint

            source = int8_checkpoint.read(resolved)
            return cls.from_state_dict(
                source.state_dict, device, dtype, name=resolved.stem, progress=progress, weights=weights,
                prequantized=source.matrices, known_fingerprint=source.fingerprint,
            )  # fmt: skip
        return cls.from_state_dict(read_state_dict(resolved), device, dtype, name=resolved.stem, progress=progress, weights=weights)

    @classmethod
    @torch.no_grad()
    def from_state_dict(
        cls,
        state_dict: MutableMapping[str, torch.Tensor],
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
        name: str = "random",
        progress: bool = True,
        weights: str = DEFAULT_WEIGHT_FORMAT,
        prequantized: dict[str, Int8Weight] | None = None,
        known_fingerprint: str | None = None,
    ) -> RWKV7:
        """Build a model from an official-layout state dict on any device. The dict is consumed:
        each tensor is removed from it as it is converted, so peak memory is one copy of the
        weights plus one tensor (and its fp32 quantization slabs with `weights="int8"`).
        `prequantized`: matrices already in int8 (an int8 checkpoint), whose keys hold shape-only
        placeholders in the dict; `known_fingerprint`: that file's recorded fingerprint."""
        check_weight_format(weights)
        config = validate_state_dict(state_dict)
        target = torch.device(device)
        if target.type == "cuda" and target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        act_dtype = resolve_dtype(dtype, target)
        digest = known_fingerprint or fingerprint(state_dict)
        convert = _Converter(state_dict, target, act_dtype, weights, progress, prequantized)
        try:
            emb = _normed_embedding(convert, config, act_dtype)
            layers = [_convert_layer(convert, i) for i in range(config.n_layer)]
            ln_out_weight = convert.take("ln_out.weight")
            ln_out_bias = convert.take("ln_out.bias")
            head = convert.take_matrix("head.weight")
            for key in list(state_dict):  # unused optional keys (block 0 v0/v1/v2)
                convert.source.pop(key)
        finally:
            convert.close()
        return cls(config, layers, emb, ln_out_weight, ln_out_bias, head, digest, name, weights)

    # ------------------------------------------------------------------------------------------
    # forward

    def weight_bytes(self) -> int:
        """Bytes the weights occupy on the device (views such as `receptance` counted once)."""
        total = sum(linear.weight_bytes(t) for t in (self.emb, self.ln_out_weight, self.ln_out_bias, self.head))
        for layer in self.layers:
            for name in LayerWeights.__slots__:
                if name in _VIEWS:
                    continue
                value = getattr(layer, name)
                total += 0 if value is None else linear.weight_bytes(value)
        return total

    def new_pool(self, batch_size: int, state_dtype: torch.dtype = torch.float32) -> StatePool:
        return StatePool(self, batch_size, state_dtype)

    @torch.inference_mode()
    def forward(
        self,
        pool: StatePool,
        slots: Sequence[int],
        tokens: Sequence[Sequence[int]],
        full_output: bool = False,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Advance each `slots[s]` by `tokens[s]` in one batched pass; the slots' states change in
        place. Returns fp32 logits `[len(slots), V]` of each slot's last token, or with
        `full_output` a list of `[len(tokens[s]), V]`. Logits are inference-mode tensors."""
        lengths, flat = self._flat_tokens(tokens)
        batch = self._checked_batch(pool, slots, lengths)
        logits = self.forward_batch(pool, batch, ops.host_to_device(flat, self.device), full_output)
        if not full_output:
            return logits
        return list(logits.split(lengths))

    @torch.inference_mode()
    def forward_saving(
        self, pool: StatePool, slots: Sequence[int], tokens: Sequence[Sequence[int]], cuts: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, list[list[SlotState]]]:
        """`forward`, also returning the states each slot passes through: slot s's after its first
        `cuts[s][j]` tokens (increasing, within [1, len(tokens[s])) ), as device tensors of the
        pool's dtypes. The prefix cache saves these at its boundaries inside a long chunk, so the
        chunk need not be fed one boundary a step."""
        lengths, flat = self._flat_tokens(tokens)
        return self.forward_ids(pool, slots, lengths, ops.host_to_device(flat, self.device), cuts)

    @torch.inference_mode()
    def forward_ids(
        self,
        pool: StatePool,
        slots: Sequence[int],
        lengths: Sequence[int],
        token_ids: torch.Tensor,
        cuts: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, list[list[SlotState]]]:
        """`forward_saving` (cuts None or empty: `forward`) from token ids already on the device:
        `token_ids` (int64) holds slot s's `lengths[s]` tokens after those of the slots before it.
        Their values are the caller's to have checked (ids a sampler drew, prompts checked at
        admission): reading them would wait for the device. So a step can be queued while the one
        before it still runs, its decode rows' ids taken from that step's sampled ids."""
        batch = self._checked_batch(pool, slots, lengths)
        if token_ids.dtype != torch.int64 or token_ids.device != self.device or token_ids.shape != (sum(batch.lengths),):
            raise ValueError(f"token_ids must be int64 [{sum(batch.lengths)}] on {self.device}, got {token_ids.dtype} {tuple(token_ids.shape)} on {token_ids.device}")
        if cuts is not None and len(cuts) != len(batch.lengths):
            raise ValueError(f"got {len(batch.lengths)} slots but {len(cuts)} lists of cuts")
        if cuts is None or not any(cuts):
            return self.forward_batch(pool, batch, token_ids), [[] for _ in batch.lengths]
        call_cuts = tuple(tuple(c) for c in cuts)
        # The slots that capture inside their rows go last in the call, so the others are one run
        # of rows and take one WKV launch a layer (wkv_dispatch.split_parts stages the capturing
        # slots' pieces). The logits and captured states come back in the caller's order.
        order = sorted(range(len(call_cuts)), key=lambda s: bool(call_cuts[s]))
        reordered = order != list(range(len(order)))
        if reordered:
            batch, token_ids = _reordered(list(slots), batch, token_ids, order, self.device)
            call_cuts = tuple(call_cuts[s] for s in order)
        saving = StateCaptures.build(self, pool, batch, call_cuts)
        logits = self.forward_batch(pool, batch, token_ids, captures=saving)
        states = saving.states()
        if reordered:
            place = {s: position for position, s in enumerate(order)}
            states = [states[place[s]] for s in range(len(order))]
        return logits, states

    @torch.inference_mode()
    def forward_batch(
        self, pool: StatePool, batch: ops.FlatBatch, token_ids: torch.Tensor, full_output: bool = False, captures: StateCaptures | None = None
    ) -> torch.Tensor:
        """`forward` from device tensors only (no host work, no syncs, so it can be captured in a
        CUDA graph): `token_ids` are the flat rows of `batch`. Returns fp32 logits of each slot's
        last row `[slots, V]`, or of every row `[rows, V]` with `full_output`. `captures`
        collects the states of `forward_saving`."""
        x = self.emb.index_select(0, token_ids)
        v_first = x  # replaced by block 0's value before any use
        # Each block's channel-mix output is added to x by the next residual layer norm (x is the
        # residual it returns: the same tensor updated in place, or a new one).
        pending: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            att_shift, ffn_shift, wkv = pool.layer(index)
            x, mixes = norm_mix.norm_mix(x, pending, layer.ln1_weight, layer.ln1_bias, att_shift, batch, layer.att_mix)
            if captures is not None:  # x is now the block's input: its norm is the token shift's state
                captures.att_shift[index] = ops.add_layer_norm(x.index_select(0, captures.rows), None, layer.ln1_weight, layer.ln1_bias)
            out, v_first = self._time_mix(index, layer, mixes, v_first, wkv, batch, captures)
            x, xk = norm_mix.norm_mix(x, out, layer.ln2_weight, layer.ln2_bias, ffn_shift, batch, layer.ffn_mix)
            if captures is not None:
                captures.ffn_shift[index] = ops.add_layer_norm(x.index_select(0, captures.rows), None, layer.ln2_weight, layer.ln2_bias)
            pending = self._channel_mix(layer, xk)
        if not full_output and len(batch.lengths) != x.shape[0]:  # some slot has several rows
            x = x.index_select(0, batch.last_rows)
            pending = pending.index_select(0, batch.last_rows) if pending is not None else None
        h = ops.add_layer_norm(x, pending, self.ln_out_weight, self.ln_out_bias)
        return linear.mm_float32(h, self.head)

    __call__ = forward

    def _flat_tokens(self, tokens: Sequence[Sequence[int]]) -> tuple[list[int], torch.Tensor]:
        """Host token lists as one flat int64 tensor, every id checked against the vocabulary."""
        lengths = [len(t) for t in tokens]
        flat = torch.tensor([t for seq in tokens for t in seq], dtype=torch.int64)
        if flat.numel():
            low, high = int(flat.min()), int(flat.max())
            if low < 0 or high >= self.config.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(f"token id {bad} out of range [0, {self.config.vocab_size})")
        return lengths, flat

    def _checked_batch(self, pool: StatePool, slots: Sequence[int], lengths: Sequence[int]) -> ops.FlatBatch:
        """The call's row bookkeeping, after checking the pool, the slots and their token counts."""
        if pool.config != self.config or pool.device != self.device or pool.dtype != self.dtype:
            raise ValueError("the state pool was built for a different model, device or dtype")
        slot_list = list(slots)
        if not slot_list:
            raise ValueError("forward needs at least one slot")
        if len(lengths) != len(slot_list):
            raise ValueError(f"got {len(slot_list)} slots but {len(lengths)} token lists")
        for slot in slot_list:
            pool.check_slot(slot)
        if len(set(slot_list)) != len(slot_list):
            raise ValueError(f"slots must be distinct, got {slot_list}")
        for slot, n in zip(slot_list, lengths):
            if n < 1:
                raise ValueError(f"slot {slot} has an empty token list")
        return ops.FlatBatch.build(slot_list, list(lengths), self.device)

    def _time_mix(
        self,
        index: int,
        layer: LayerWeights,
        mixes: torch.Tensor,
        v_first: torch.Tensor,
        wkv_state: torch.Tensor,
        batch: ops.FlatBatch,
        captures: StateCaptures | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Few, large ops: at batch 1 the step is bound by the host's per-op cost. `mixes` are the
        # six token-shift mixes of the block's normed input (norm_mix).
        r, k, v = linear.bmm(mixes[:3], layer.rkv).unbind(0)
        if index == 0:  # block 0 defines v_first and has no value residual
            v_first = v
            first = None
        else:
            assert layer.v0 is not None and layer.lora_down.shape[0] == 3
            first = v_first
        saving = None if captures is None else (captures.cuts, captures.wkv[index])
        weights = self._step_weights[index]
        if lora_prep.applies(k, batch, layer.lora_down):  # many prompt rows: the up products and wkv_prep in one kernel
            from albatross import lora_prep_triton  # Triton is imported only where a GPU path runs

            hidden, g = loras.hidden_and_gate(mixes, layer.lora_down, layer.g1, layer.g2)
            w, a, b = lora_prep_triton.lora_prep(hidden, layer.lora_up, k, v, first, weights.w0, weights.a0, weights.v0, weights.k_k, weights.k_a)
            y = wkv_decode.wkv_gate(wkv_state, batch, r, (w, k, v, a, b), g, weights, saving)
            return linear.mm(y, layer.output), v_first
        # mixes is (r, k, v, w, a, g): the stacked LoRAs take (v, w, a), or (w, a) in block 0.
        lora, g = loras.block_loras(mixes, layer.lora_down, layer.lora_up, layer.g1, layer.g2)
        v_lora = lora[0] if index > 0 else None
        y = wkv_decode.prep_wkv_gate(wkv_state, batch, (r, k, v), g, (v_lora, lora[-2], lora[-1]), first, weights, saving)
        return linear.mm(y, layer.output), v_first

    def _channel_mix(self, layer: LayerWeights, xk: torch.Tensor) -> torch.Tensor:
        """The channel mix of `xk`, the token-shift mix of the block's second normed input."""
        return linear.mm(linear.mm_relu_square(xk, layer.ffn_key), layer.ffn_value)


@dataclass(slots=True)
class StateCaptures:
    """What `forward_saving` captures: per cut (in order of slot, then cut) the token shift's
    states of every layer (the norms of the cut's last row, which the pool keeps for a slot's
    last row) and the WKV state after that row, in buffers of the pool's dtypes."""

    cuts: tuple[tuple[int, ...], ...]
    rows: torch.Tensor  # int64 [cuts]: each cut's last row in the call
    att_shift: torch.Tensor  # [L, cuts, C]
    ffn_shift: torch.Tensor  # [L, cuts, C]
    wkv: torch.Tensor  # [L, cuts, H, N, N]

    @classmethod
    def build(cls, model: RWKV7, pool: StatePool, batch: ops.FlatBatch, cuts: tuple[tuple[int, ...], ...]) -> StateCaptures:
        rows = []
        start = 0
        for length, slot_cuts in zip(batch.lengths, cuts):
            wkv_dispatch.check_cuts(slot_cuts, length)  # here, before any layer has touched the pool
            rows += [start + cut - 1 for cut in slot_cuts]
            start += length
        config, count = model.config, len(rows)
        shifts = (config.n_layer, count, config.n_embd)
        return cls(
            cuts=cuts,
            rows=ops.host_to_device(torch.tensor(rows, dtype=torch.int64), model.device),
            att_shift=torch.empty(shifts, dtype=pool.dtype, device=model.device),
            ffn_shift=torch.empty(shifts, dtype=pool.dtype, device=model.device),
            wkv=torch.empty(config.n_layer, count, config.n_head, config.head_size, config.head_size, dtype=pool.state_dtype, device=model.device),
        )

    def states(self) -> list[list[SlotState]]:
        """Per slot, its captured states in cut order (views of the buffers: copy before reuse)."""
        out: list[list[SlotState]] = []
        index = 0
        for slot_cuts in self.cuts:
            out.append([SlotState(self.att_shift[:, j], self.ffn_shift[:, j], self.wkv[:, j]) for j in range(index, index + len(slot_cuts))])
            index += len(slot_cuts)
        return out


def _reordered(
    slots: list[int], batch: ops.FlatBatch, token_ids: torch.Tensor, order: list[int], device: torch.device
) -> tuple[ops.FlatBatch, torch.Tensor]:
    """The call (`slots`, host-side: no sync) with its slots in `order`, their rows moved with
    them; its `last_rows` still list each slot's last row in the caller's order, so the logits
    come out in that order."""
    starts = [0]
    for n in batch.lengths:
        starts.append(starts[-1] + n)
    rows = [row for s in order for row in range(starts[s], starts[s + 1])]
    lengths = [batch.lengths[s] for s in order]
    moved = ops.FlatBatch.build([slots[s] for s in order], lengths, device)
    last = [0] * len(order)
    at = 0
    for s, n in zip(order, lengths):
        at += n
        last[s] = at - 1
    longs = ops.host_to_device(torch.tensor(last + rows, dtype=torch.int64), device)  # one copy for both
    return dataclasses.replace(moved, last_rows=longs[: len(last)]), token_ids.index_select(0, longs[len(last) :])


def _transposed_to(matrix: torch.Tensor, device: torch.device, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """`matrix.t()` contiguous on `device` in `dtype`, moved and transposed a slab of rows at a
    time: a whole device copy at the file's layout beside the result would be a transient of the
    matrix's size (the 7.2B head: 512 MB) that the memory plan does not hold."""
    rows, columns = matrix.shape
    if out is None:
        out = torch.empty((columns, rows), dtype=dtype, device=device)
    step = max(1, _TRANSPOSE_SLAB // max(1, columns))
    for start in range(0, rows, step):
        out[:, start : start + step] = matrix[start : start + step].to(device, dtype).t()
    return out


def _normed_embedding(convert: _Converter, config: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """The embedding with block 0's ln0 applied once at load (as the reference does), computed
    in fp32 a slab of rows at a time and stored in the model dtype."""
    emb = convert.source.pop("emb.weight")
    convert.bar.update(1)
    ln_weight = convert.source.pop("blocks.0.ln0.weight").to(convert.device, torch.float32)
    ln_bias = convert.source.pop("blocks.0.ln0.bias").to(convert.device, torch.float32)
    convert.bar.update(2)
    out = torch.empty(config.vocab_size, config.n_embd, dtype=dtype, device=convert.device)
    for start in range(0, config.vocab_size, _EMB_NORM_ROWS):
        rows = emb[start : start + _EMB_NORM_ROWS].to(convert.device, torch.float32)
        out[start : start + _EMB_NORM_ROWS] = F.layer_norm(rows, (config.n_embd,), ln_weight, ln_bias)
    del emb
    return out


def stacked_lora_padding(config: ModelConfig) -> int:
    """Elements of zeros the stacked LoRAs hold beyond the checkpoint's (the memory plan counts
    them): per block, its value LoRA (blocks 1+), decay and in-context-rate LoRAs, down and up,
    each padded to the largest of their ranks."""
    total = 0
    for layer in range(config.n_layer):
        ranks = ([config.value_rank] if layer > 0 else []) + [config.decay_rank, config.a_rank]
        total += sum(max(ranks) - rank for rank in ranks) * 2 * config.n_embd
    return total


def _stack_loras(
    downs: Sequence[torch.Tensor], ups: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """`[n, C, R]` and `[n, R, C]` stacks, zero beyond each LoRA's own rank (zero hidden
    columns meet zero rows: the padding adds exact zeros), and the views of each LoRA in them."""
    rank = max(d.shape[1] for d in downs)
    width = downs[0].shape[0]
    down = torch.zeros((len(downs), width, rank), dtype=downs[0].dtype, device=downs[0].device)
    up = torch.zeros((len(ups), rank, width), dtype=ups[0].dtype, device=ups[0].device)
    down_views, up_views = [], []
    for n, (d, u) in enumerate(zip(downs, ups)):
        down[n, :, : d.shape[1]] = d
        up[n, : u.shape[0]] = u
        down_views.append(down[n, :, : d.shape[1]])
        up_views.append(up[n, : u.shape[0]])
    return down, up, down_views, up_views


def _convert_layer(convert: _Converter, index: int) -> LayerWeights:
    p, a, f = f"blocks.{index}.", f"blocks.{index}.att.", f"blocks.{index}.ffn."
    take = convert.take
    if index == 0:  # unused value-residual weights that some files carry in block 0
        for name in ("v0", "v1", "v2"):
            if a + name in convert.source:
                convert.source.pop(a + name)
                convert.bar.update(1)
    optional = convert.take_optional
    rkv = convert.take_matrices([a + name for name in ("receptance.weight", "key.weight", "value.weight")])
    # The stack's order (value first where a block has one) is what _time_mix reads: (w, a) last.
    v1, v2 = optional(a + "v1"), optional(a + "v2")
    value = [] if v1 is None or v2 is None else [(v1, v2)]
    loras = [*value, (take(a + "w1"), take(a + "w2")), (take(a + "a1"), take(a + "a2"))]
    lora_down, lora_up, downs, ups = _stack_loras([down for down, _ in loras], [up for _, up in loras])
    return LayerWeights(
        ln1_weight=take(p + "ln1.weight"),
        ln1_bias=take(p + "ln1.bias"),
        ln2_weight=take(p + "ln2.weight"),
        ln2_bias=take(p + "ln2.bias"),
        att_mix=convert.take_stacked([a + name for name in _ATT_MIX]),
        w0=take(a + "w0"),
        w1=downs[-2],
        w2=ups[-2],
        a0=take(a + "a0"),
        a1=downs[-1],
        a2=ups[-1],
        v0=optional(a + "v0"),
        v1=downs[0] if value else None,
        v2=ups[0] if value else None,
        g1=take(a + "g1"),
        g2=take(a + "g2"),
        lora_down=lora_down,
        lora_up=lora_up,
        k_k=take(a + "k_k"),
        k_a=take(a + "k_a"),
        r_k=take(a + "r_k"),
        rkv=rkv,
        receptance=rkv[0],
        key=rkv[1],
        value=rkv[2],
        output=convert.take_matrix(a + "output.weight"),
        ln_x_weight=take(p + "att.ln_x.weight"),
        ln_x_bias=take(p + "att.ln_x.bias"),
        ffn_mix=take(f + "x_k"),
        ffn_key=convert.take_matrix(f + "key.weight"),
        ffn_value=convert.take_matrix(f + "value.weight"),
    )
