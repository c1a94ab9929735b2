"""The batched sampler in pure torch: the CPU path and the oracle for the CUDA kernel.

It computes exactly the definition in docs/architecture.md ("sampler", "Sampler randomness"):

0. `l = logits - penalties[slot] + bias[row]` (a row's sparse logit bias, if any); a row with an
   allowed-token mask sets `l = -inf` for every id outside it (a mask that allows no id is taken
   as allowing id 0 alone).
1. Temperature 0: argmax of `l` (lowest id on ties), done.
2. `p = softmax(l / temperature)` in fp32 (ids outside the mask get p = 0).
3. top_k > 0 keeps `p >= ` the k-th largest p; top_p < 1 keeps `p >= t`, t being the p of the
   token where the descending cumulative sum first reaches top_p (the last token if rounding keeps
   the sum below top_p). Both thresholds are taken on the full distribution; a token must pass both.
4. `u = uniform(seed32, step)`; the sample is the smallest kept id whose cumulative kept mass, in
   id order, reaches `u * total kept mass`. ("Kept" matters only when u is 0 or the cumulative sum
   is flat: a dropped id never wins.)
5. Penalty update for the sampled id t: `P[slot] *= decay`, then `P[slot, t] += frequency`, plus
   `presence` if the slot had not produced t before.

Every row of a call may have its own settings; nothing loops over rows in Python. Rows without a
mask or a bias cost nothing extra: a call whose batch has neither runs exactly the steps above
without them.

The rejection draw (`rejection=True`, the default: REJECTION; docs/kernels.md "Rejection draw")
replaces steps 3-4 for the sampled rows without top_k with rounds that need no sort: round r draws
from the weights above a pivot with the round's Philox uniform, accepts the draw if it passes
top_p, else raises the pivot to it. It samples the same kept distribution with other uniforms (so
other ids for a seed than the exact draw); what it cannot decide within REJECTION_ROUNDS draws
takes steps 3-4 as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import os

import torch

MASK32 = 0xFFFFFFFF
HASH_MULTIPLIER = 0x45D9F3B
GOLDEN_STEP = 0x9E3779B9


def hash32_int(x: int) -> int:
    """hash32 on a Python int (the host side of the seed derivation)."""
    x &= MASK32
    x = (((x >> 16) ^ x) * HASH_MULTIPLIER) & MASK32
    x = (((x >> 16) ^ x) * HASH_MULTIPLIER) & MASK32
    return ((x >> 16) ^ x) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """hash32 on int64 tensors holding unsigned 32-bit values (products stay below 2**59)."""
    x = x & MASK32
    x = (((x >> 16) ^ x) * HASH_MULTIPLIER) & MASK32
    x = (((x >> 16) ^ x) * HASH_MULTIPLIER) & MASK32
    return ((x >> 16) ^ x) & MASK32


def seed_to_seed32(seed: int) -> int:
    """A request's 64-bit seed -> the 32-bit stream key used for every draw of that request."""
    return hash32_int((seed & MASK32) ^ hash32_int((seed >> 32) & MASK32))


def _mul_mod32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for x < 2**32 without int64 overflow: multiply 16-bit halves."""
    low, high = x & 0xFFFF, (x >> 16) & 0xFFFF
    return (low * constant + (((high * constant) & 0xFFFF) << 16)) & MASK32


def uniform(seed32: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The draw in [0, 1) for generated token number `step` of the stream `seed32` (fp32, 24 bits)."""
    mixed = (seed32.to(torch.int64) + _mul_mod32(step.to(torch.int64) & MASK32, GOLDEN_STEP)) & MASK32
    return (hash32(mixed) >> 8).to(torch.float32) * (2.0**-24)


# Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"): the rejection draw's
# uniform of round r for a row is word 0 of philox((seed32, step mod 2**32), (r, step >> 32, 0, 0)).
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo32(a: torch.Tensor, constant: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * constant for a < 2**32, in int64 without overflow: the
    16-bit halves of a give products below 2**48."""
    high_part, low_part = ((a >> 16) & 0xFFFF) * constant, (a & 0xFFFF) * constant  # a = h * 2**16 + l
    low = (((high_part & 0xFFFF) << 16) + low_part) & MASK32
    high = ((high_part + (low_part >> 16)) >> 16) & MASK32
    return high, low


def philox4x32(counter: Sequence[torch.Tensor], key: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Philox4x32-10 on int64 tensors holding unsigned 32-bit words (broadcast together)."""
    c0, c1, c2, c3 = (c & MASK32 for c in counter)
    k0, k1 = (k & MASK32 for k in key)
    for round_index in range(10):
        if round_index:
            k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
        high0, low0 = _mulhilo32(c0, PHILOX_M0)
        high1, low1 = _mulhilo32(c2, PHILOX_M1)
        c0, c1, c2, c3 = high1 ^ c1 ^ k0, low1, high0 ^ c3 ^ k1, low0
    return [c0, c1, c2, c3]


def round_uniform(seed32: torch.Tensor, step: torch.Tensor, round_index: int) -> torch.Tensor:
    """The rejection draw's uniform in [0, 1) for round `round_index` of token `step` (fp32, 24 bits):
    a function of (seed, step, round) alone, the same in the CUDA kernel."""
    seed, step = seed32.to(torch.int64), step.to(torch.int64)
    zero = torch.zeros_like(step)
    word = philox4x32((zero + round_index, step >> 32, zero, zero), (seed, step))[0]
    return (word >> 8).to(torch.float32) * (2.0**-24)


class SamplingSettings(Protocol):
    """What a row needs from a request's sampling parameters (runner SamplingParams fits)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def penalty_decay(self) -> float: ...
    @property
    def logit_bias(self) -> Sequence[tuple[int, float]]: ...  # (token id, bias) pairs, ids distinct


@dataclass(slots=True)
class AllowedTokens:
    """Allowed-token bitmasks of the constrained rows (grammar constraints). Row r of the batch may
    produce only the ids whose bit is set in `words[index[r]]` (bit i of word j is id 32 * j + i;
    ids past the last word are not allowed); `index[r] = -1` leaves row r unconstrained."""

    index: torch.Tensor  # i64 [R]
    words: torch.Tensor  # i32 [M, W]

    def __post_init__(self) -> None:
        if self.index.dim() != 1 or self.words.dim() != 2 or self.words.dtype != torch.int32:
            raise ValueError(f"AllowedTokens wants index [R] and int32 words [M, W]; got {tuple(self.index.shape)} and {self.words.dtype} {tuple(self.words.shape)}")


@dataclass(slots=True)
class LogitBias:
    """A sparse additive bias per row (OpenAI `logit_bias`), in CSR form: row r's entries are
    `ids[offsets[r]:offsets[r + 1]]` with `values[...]`, its ids distinct."""

    offsets: torch.Tensor  # i64 [R + 1]
    ids: torch.Tensor  # i64 [N]
    values: torch.Tensor  # f32 [N]

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[tuple[int, float]]], device: torch.device | str = "cpu") -> LogitBias | None:
        """None when no row has a bias (the sampler then pays nothing for it)."""
        if not any(rows):
            return None
        lengths = [len(row) for row in rows]
        offsets = [0]
        for length in lengths:
            offsets.append(offsets[-1] + length)
        return cls(
            offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
            ids=torch.tensor([token_id for row in rows for token_id, _ in row], dtype=torch.int64, device=device),
            values=torch.tensor([value for row in rows for _, value in row], dtype=torch.float32, device=device),
        )


_SETTINGS = ("temperature", "top_p", "top_k", "presence", "frequency", "decay", "seed32", "step")  # SamplingBatch's per-row tensors, in order


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling settings as device tensors, one row per logits row."""

    temperature: torch.Tensor  # f32 [R]; 0 = greedy
    top_p: torch.Tensor  # f32 [R]
    top_k: torch.Tensor  # i64 [R]; 0 = off
    presence: torch.Tensor  # f32 [R]
    frequency: torch.Tensor  # f32 [R]
    decay: torch.Tensor  # f32 [R]
    seed32: torch.Tensor  # i64 [R], values in [0, 2**32)
    step: torch.Tensor  # i64 [R], the row's generated-token number
    allowed: AllowedTokens | None = None  # None: no row is constrained
    bias: LogitBias | None = None  # None: no row has a logit bias

    def __post_init__(self) -> None:
        rows = self.temperature.shape
        for name in _SETTINGS[1:]:
            if getattr(self, name).shape != rows:
                raise ValueError(f"SamplingBatch.{name} has shape {tuple(getattr(self, name).shape)}, expected {tuple(rows)}")
        if self.allowed is not None and self.allowed.index.shape != rows:
            raise ValueError(f"SamplingBatch.allowed.index has shape {tuple(self.allowed.index.shape)}, expected {tuple(rows)}")
        if self.bias is not None and self.bias.offsets.shape != (rows[0] + 1,):
            raise ValueError(f"SamplingBatch.bias.offsets has shape {tuple(self.bias.offsets.shape)}, expected ({rows[0] + 1},)")

    @property
    def rows(self) -> int:
        return int(self.temperature.shape[0])

    def narrow(self, start: int, stop: int) -> SamplingBatch:
        """Rows [start, stop) (views of the settings); masks and biases are the caller's to add."""
        if self.allowed is not None or self.bias is not None:
            raise ValueError("narrow a SamplingBatch before adding masks or biases")
        return SamplingBatch(*(getattr(self, name)[start:stop] for name in _SETTINGS))

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingSettings],
        seed32s: Sequence[int],
        steps: Sequence[int],
        device: torch.device | str = "cpu",
        allowed: AllowedTokens | None = None,
    ) -> SamplingBatch:
        if not len(params) == len(seed32s) == len(steps):
            raise ValueError(f"{len(params)} params, {len(seed32s)} seeds and {len(steps)} steps: one each per row")

        def column(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=column([p.temperature for p in params], torch.float32),
            top_p=column([p.top_p for p in params], torch.float32),
            top_k=column([p.top_k for p in params], torch.int64),
            presence=column([p.presence_penalty for p in params], torch.float32),
            frequency=column([p.frequency_penalty for p in params], torch.float32),
            decay=column([p.penalty_decay for p in params], torch.float32),
            seed32=column([s & MASK32 for s in seed32s], torch.int64),
            step=column(list(steps), torch.int64),
            allowed=allowed,
            bias=LogitBias.from_rows([p.logit_bias for p in params], device),
        )


class PenaltyPool:
    """Per-slot additive logit penalties and the set of ids each slot has produced."""

    def __init__(self, batch_size: int, vocab_size: int, device: torch.device | str = "cpu") -> None:
        self.penalties = torch.zeros(batch_size, vocab_size, dtype=torch.float32, device=device)
        self.seen = torch.zeros(batch_size, vocab_size, dtype=torch.bool, device=device)

    @classmethod
    def wrap(cls, penalties: torch.Tensor, seen: torch.Tensor) -> PenaltyPool:
        """A pool over existing tensors (the `sample` op hands its twin the two tensors)."""
        pool = cls.__new__(cls)
        pool.penalties, pool.seen = penalties, seen
        return pool

    def reset(self, slots: torch.Tensor | Sequence[int]) -> None:
        index = torch.as_tensor(slots, dtype=torch.int64, device=self.penalties.device)
        self.penalties[index] = 0.0
        self.seen[index] = False

    def seed(self, slot: int, token_ids: Sequence[int], settings: SamplingSettings) -> None:
        """Start a fresh (reset) slot as if it had produced `token_ids` in order: step 5 once per
        id, in closed form. After n ids, id t holds `frequency * sum(decay**(n-1-i))` over its
        positions i plus `presence * decay**(n-1-first)` for its first position (RWKV-Runner's
        global_penalty counts a prompt this way). Built on the host in fp64, copied once."""
        from albatross.ops import host_to_device  # lazy: albatross.ops imports this module

        if not token_ids:
            return
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
        n = ids.numel()
        weights = torch.pow(torch.tensor(float(settings.penalty_decay), dtype=torch.float64), torch.arange(n - 1, -1, -1, dtype=torch.float64))
        row = torch.zeros(self.penalties.shape[1], dtype=torch.float64)
        row.index_add_(0, ids, weights * float(settings.frequency_penalty))
        used, inverse = torch.unique(ids, return_inverse=True)
        first = torch.full((used.numel(),), n, dtype=torch.int64).scatter_reduce_(0, inverse, torch.arange(n), "amin")
        row.index_add_(0, used, weights[first] * float(settings.presence_penalty))
        seen = torch.zeros(self.seen.shape[1], dtype=torch.bool)
        seen[used] = True
        device = self.penalties.device
        self.penalties[slot].copy_(host_to_device(row.to(torch.float32), device))
        self.seen[slot].copy_(host_to_device(seen, device))

    def update(self, slots: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch) -> None:
        """Step 5 of the definition for each (slot, sampled id); slots must be distinct."""
        penalties = self.penalties[slots] * batch.decay[:, None]
        first_use = ~self.seen[slots, token_ids]
        bump = batch.frequency + torch.where(first_use, batch.presence, torch.zeros_like(batch.presence))
        rows = torch.arange(slots.shape[0], device=slots.device)
        penalties[rows, token_ids] += bump
        self.penalties[slots] = penalties
        self.seen[slots, token_ids] = True


def kept_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Step 3: which ids survive top_k and top_p, for rows of probabilities [R, V]."""
    vocab = probs.shape[-1]
    sorted_probs = torch.sort(probs, dim=-1, descending=True).values
    k_index = (top_k.clamp(min=1, max=vocab) - 1)[:, None]
    k_threshold = torch.where(top_k[:, None] > 0, sorted_probs.gather(-1, k_index), torch.zeros_like(k_index, dtype=probs.dtype))
    reached = torch.cumsum(sorted_probs, dim=-1) >= top_p[:, None]
    # first position where the cumulative sum reaches top_p; rows that never reach it keep everything
    p_index = torch.where(reached.any(dim=-1), reached.to(torch.int8).argmax(dim=-1), vocab - 1)[:, None]
    p_threshold = torch.where(top_p[:, None] < 1.0, sorted_probs.gather(-1, p_index), torch.zeros_like(k_threshold))
    return probs >= torch.maximum(k_threshold, p_threshold)


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 words [M, W] -> bool [M, vocab]: id t is word t // 32, bit t % 32 (ids past the words: False)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = ((words[:, :, None] >> shifts) & 1).bool().reshape(words.shape[0], -1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]), value=False)


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> None:
    """Step 0's `+ bias[row]`, in place."""
    counts = bias.offsets[1:] - bias.offsets[:-1]
    rows = torch.repeat_interleave(torch.arange(logits.shape[0], device=logits.device), counts)
    logits.index_put_((rows, bias.ids), bias.values, accumulate=True)


def apply_allowed(logits: torch.Tensor, allowed: AllowedTokens) -> None:
    """Step 0's mask, in place: -inf outside each constrained row's allowed ids. A mask that allows
    nothing leaves id 0 (the end of text), so that no row is ever empty; a caller's grammar, which
    made that mask, then refuses the id. No host sync (the CUDA kernel cannot raise either)."""
    index = allowed.index
    if allowed.words.shape[0] == 0:  # no row is constrained
        return
    bits = unpack_bitmask(allowed.words.index_select(0, index.clamp(min=0)), logits.shape[1])
    bits |= (index < 0)[:, None]  # unconstrained rows allow every id
    bits[:, 0] |= ~bits.any(dim=-1)
    logits.masked_fill_(~bits, float("-inf"))


def rejection_from_environment(value: str | None) -> bool:
    """ALBATROSS_SAMPLER: unset or "rejection" takes the rejection draw (docs/kernels.md "Rejection
    draw") for the rows without top_k, 7x faster for top_p alone on the H200; "exact" takes the
    exact draw for every row. Anything else is refused, so a typo cannot silently pick a draw."""
    if value in (None, "", "rejection"):
        return True
    if value == "exact":
        return False
    raise ValueError(f"ALBATROSS_SAMPLER={value!r}: expected 'rejection' (the default) or 'exact'")


# The draw of every call that does not choose itself (`rejection=None`).
REJECTION = rejection_from_environment(os.environ.get("ALBATROSS_SAMPLER"))
REJECTION_ROUNDS = 32  # draws before a row takes the exact path
WALK_THREADS = 1024  # the kernel's threads per row: the walk order below follows their ownership
_BELOW_ONE = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))  # largest fp32 under 1


def walk_order(vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ids in the order the rejection draw accumulates mass: id e lies in quad q = e // 4, which
    thread q % WALK_THREADS of the kernel owns (its quads in chunk order q // WALK_THREADS, the four
    ids in order). Each thread of a row's block reads its quads with coalesced vector loads and a
    scan over the threads' totals finds the one thread whose quads hold the draw."""
    quads = (vocab + 3) // 4
    chunks = (quads + WALK_THREADS - 1) // WALK_THREADS
    ids = torch.arange(chunks * WALK_THREADS * 4, device=device).view(chunks, WALK_THREADS, 4)
    order = ids.permute(1, 0, 2).reshape(-1)
    return order[order < vocab]


def _rejection_rows(batch: SamplingBatch, vocab: int) -> torch.Tensor:
    """The rows the rejection draw serves when it is on: those without top_k. A row with top_k keeps
    the exact draw, whose candidate fast path decides it faster on the H200 (0.84 against 0.91 ms
    at 960 rows; top_p alone: 5.49 against 0.77 ms, docs/performance.md). Per row, so a request's
    draw never depends on its neighbours."""
    return ~((batch.top_k > 0) & (batch.top_k < vocab))


def _rejection_draw(adjusted: torch.Tensor, temperature: torch.Tensor, batch: SamplingBatch, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 3-4 by rejection for the rows not in `skip` (the greedy rows): (ids, decided); a row
    without any weight (every l = -inf) is decided with a meaningless id, the caller's to replace. Weights
    w = exp(l / T - max(l) / T) (the maximum has w = 1 exactly). Round r: M, C = mass and count of
    the weights above the pivot (0 at first). A pending draw x (whose w is the pivot) is accepted when
    nothing lies above it, or when C < top_k and M < top_p * Z (Z the total mass): exactly when x is
    in the kept set of step 3. Otherwise draw x from the weights above the pivot in walk order with
    the round's uniform and raise the pivot to w[x]: every id at or under it is dropped (the kept set
    is an upper set of p), so the draw stays one from the renormalised kept distribution. Rows with
    top_k = 1 or top_p <= 0 keep only the maxima: their first pivot is just under 1, their first draw
    accepted. Rows without top_k and top_p accept the first draw. Undecided after REJECTION_ROUNDS
    draws: decided = False."""
    rows, vocab = adjusted.shape
    device = adjusted.device
    scaled = adjusted / temperature[:, None]
    peak = scaled.max(dim=-1, keepdim=True).values
    weights = torch.where(peak > float("-inf"), torch.exp(scaled - peak), torch.zeros_like(scaled))
    order = walk_order(vocab, device)
    walked = weights[:, order]
    use_k = (batch.top_k > 0) & (batch.top_k < vocab)
    use_p = batch.top_p < 1.0
    maxima_only = (use_k & (batch.top_k == 1)) | (batch.top_p <= 0.0)
    free = ~use_k & ~use_p
    pivot = torch.where(maxima_only, torch.full_like(batch.top_p, _BELOW_ONE), torch.zeros_like(batch.top_p))
    token = torch.zeros(rows, dtype=torch.int64, device=device)
    done = skip | (peak[:, 0] == float("-inf"))
    pending = torch.zeros(rows, dtype=torch.bool, device=device)  # a draw waits for its check
    total = torch.zeros(rows, dtype=torch.float64, device=device)
    rows_index = torch.arange(rows, device=device)
    for round_index in range(REJECTION_ROUNDS + 1):
        above = walked > pivot[:, None]
        masses = torch.where(above, walked, torch.zeros_like(walked)).double()
        cumulative = torch.cumsum(masses, dim=-1)
        mass, count = cumulative[:, -1], above.sum(dim=-1)
        if round_index == 0:
            total = mass
        else:
            kept = (count == 0) | ((~use_k | (count < batch.top_k)) & (~use_p | (mass < batch.top_p.double() * total)))
            done = done | (pending & kept)
        if round_index == REJECTION_ROUNDS or bool(done.all()):
            break
        target = round_uniform(batch.seed32, batch.step, round_index).double() * mass
        reached = (cumulative >= target[:, None]) & above
        last_above = vocab - 1 - above.flip(-1).to(torch.int8).argmax(dim=-1)  # rounding: stay in range
        position = torch.where(reached.any(dim=-1), reached.to(torch.int8).argmax(dim=-1), last_above)
        drawing = ~done
        token = torch.where(drawing, order[position], token)
        pivot = torch.where(drawing, walked[rows_index, position], pivot)
        pending = drawing
        done = done | (drawing & (maxima_only | free))
    return token, done


def _exact_draw(adjusted: torch.Tensor, temperature: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Steps 2-4 as defined (every row drawn; greedy rows are the caller's)."""
    probs = torch.softmax(adjusted / temperature[:, None], dim=-1)
    kept = torch.where(kept_mask(probs, batch.top_k, batch.top_p), probs, torch.zeros_like(probs))
    cumulative = torch.cumsum(kept, dim=-1)
    target = uniform(batch.seed32, batch.step) * cumulative[:, -1]
    candidates = (cumulative >= target[:, None]) & (kept > 0)
    return candidates.to(torch.int8).argmax(dim=-1)


def sample(
    logits: torch.Tensor,
    slots: torch.Tensor,
    batch: SamplingBatch,
    penalties: PenaltyPool,
    update_penalties: bool = True,
    rejection: bool | None = None,
) -> torch.Tensor:
    """One token id per row of `logits` [R, V] (fp32), row r using slot `slots[r]` and batch row r.
    `rejection` picks the draw (None: REJECTION)."""
    if logits.dim() != 2 or logits.shape[0] != batch.rows or slots.shape != (batch.rows,):
        raise ValueError(f"logits {tuple(logits.shape)}, slots {tuple(slots.shape)} and {batch.rows} batch rows disagree")
    adjusted = logits.float() - penalties.penalties[slots]
    if batch.bias is not None:
        apply_logit_bias(adjusted, batch.bias)
    if batch.allowed is not None:
        apply_allowed(adjusted, batch.allowed)
    greedy_ids = torch.argmax(adjusted, dim=-1)

    greedy = batch.temperature <= 0
    if bool(greedy.all()):  # nothing to draw: skip the softmax and the sort over the vocabulary
        if update_penalties:
            penalties.update(slots, greedy_ids, batch)
        return greedy_ids
    temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    if REJECTION if rejection is None else rejection:
        drawable = adjusted.max(dim=-1).values > float("-inf")
        exact_rows = ~_rejection_rows(batch, adjusted.shape[-1]) & ~greedy
        sampled_ids, decided = _rejection_draw(adjusted, temperature, batch, greedy | exact_rows)
        sampled_ids = torch.where(drawable, sampled_ids, greedy_ids)  # no weight to draw from: id 0, as the kernel
        exact_rows = exact_rows | (~decided & ~greedy & drawable)  # and, rarely, what rejection left open
        if bool(exact_rows.any()):
            sampled_ids = torch.where(exact_rows, _exact_draw(adjusted, temperature, batch), sampled_ids)
    else:
        sampled_ids = _exact_draw(adjusted, temperature, batch)

    token_ids = torch.where(greedy, greedy_ids, sampled_ids)
    if update_penalties:
        penalties.update(slots, token_ids, batch)
    return token_ids


@dataclass(slots=True)
class TopLogprobs:
    """log-softmax values of each row's chosen id and of its k most likely ids (descending)."""

    chosen: torch.Tensor | None  # f32 [R]; None when no chosen ids were given
    top_values: torch.Tensor  # f32 [R, k]
    top_ids: torch.Tensor  # i64 [R, k]


def top_logprobs(logits: torch.Tensor, k: int, chosen_ids: torch.Tensor | None = None) -> TopLogprobs:
    """Log-probabilities for the API's `logprobs`: the model's distribution (before penalties and
    temperature), the chosen id's value and the top k (k may be 0)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, k=min(k, logprobs.shape[-1]), dim=-1)
    chosen = None if chosen_ids is None else logprobs.gather(-1, chosen_ids.to(torch.int64)[:, None])[:, 0]
    return TopLogprobs(chosen=chosen, top_values=top.values, top_ids=top.indices)
