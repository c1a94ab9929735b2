"""How many prompt tokens a step may carry. Plain Python, no torch, no clock of its own.

A step that carries prompt chunks delays every decoding stream's next token by its whole
duration, and that duration grows with its prompt tokens (on an H100 at 7.2B, roughly
5 ms + 27 us per prompt token + 40 us per decode row: docs/performance.md). Two policies:

- static (`itl_target_s=None`): `prefill_budget` tokens per step, whatever else the step carries;
- adaptive: the worker reports how long each step with both decode rows and prompt chunks took
  (`observe`), a `StepTimeModel` keeps a running fit of that time against prompt tokens and decode
  rows, and a step with decoding streams gets the prompt tokens the fit says fit in the
  inter-token target: `(target - base - per_row * rows) / per_token`, between a floor (prefill
  always advances) and `prefill_budget`. A step with no decoding stream keeps the full budget
  (nobody waits on it).

Both share a step's tokens among the waiting prompts, in the scheduler's prefill order, each at most
`max(prefill_chunk, an equal share of what is left)`: many prompts (a burst) in chunks of
`prefill_chunk`, a few in long chunks. A prompt whose rest is at most twice that takes all of it
(unless that rest crosses a prefix-cache boundary: Scheduler._whole_rest):
a remnant of less than a chunk would cost the prompt another step (~400 ms in a 960-prompt burst on
the H200) before its first token, and rows of up to two chunks still give a 16,384-token step 64
rows, which keep the WKV walk's GPU full (docs/performance.md, "Session 23": the burst's TTFT p50
-12% in simulation, with 200-300-token prompts). A lone long prompt so goes in one step instead of one
`prefill_chunk` a step: on an H100 at 7.2B, a 4,096-token prompt alone took 32 steps of 12.2 ms
(389 ms) in chunks of 128 and takes one of 146 ms now (924 against 166 ms beside 480 decoding
streams; docs/performance.md, "Session 14"). A long chunk without prefix-cache checkpoints also
takes the chunked WKV kernel: ~0.4 us a token a layer against 0.7-0.9 for the sequential walk
(wkv_dispatch.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Features are scaled so that a typical step has entries of order 1-10: prompt tokens in
# thousands, decode rows in hundreds; times in milliseconds.
_TOKENS_UNIT = 1000.0
_ROWS_UNIT = 100.0
# The fit starts from the 7.2B mixed-step grid measured head-on on an H100 (ms, ms per 1,000
# prompt tokens, ms per 100 decode rows; docs/performance.md, "Session 14": fits from a burst's
# own steps could not tell the base from the per-token cost), with a standard deviation of
# twice each, so the first measurements decide.
PRIOR_MS = (5.2, 26.9, 4.0)
PRIOR_SPREAD = 2.0
# Each coefficient may drift by this fraction of itself per step (the random walk of the filter
# below): a device that slows down or a batch that changes shape is followed within ~10 steps.
DRIFT = 0.03
# A measurement's own spread, as a fraction of the step time (timer and host jitter).
NOISE = 0.05
# One measurement moves the fit by at most this factor of its own prediction, so an outlier (a
# first-use compile, a GC pause) cannot swing the budget by more than that for a step.
CLIP_FACTOR = 3.0
# The floor of the adaptive budget, in chunks: even when decoding alone exceeds the target,
# waiting prompts keep advancing (four of them, or one four times as fast).
MIN_BUDGET_CHUNKS = 4


@dataclass(slots=True)
class StepTimeModel:
    """A running fit `ms = base + per_token * prompt_tokens + per_row * decode_rows`: a Kalman
    filter over the three coefficients as a random walk. Unlike least squares with exponential
    forgetting it keeps what it knows in directions the recent steps did not explore (a full
    batch decoding next to a steady budget is one point, over and over), and a surprise is
    attributed in proportion to each term's uncertainty, so the largest term absorbs most of it."""

    prior_ms: tuple[float, float, float] = PRIOR_MS
    drift: float = DRIFT
    noise: float = NOISE
    steps: int = 0  # measurements taken
    _theta: list[float] = field(default_factory=list)  # scaled coefficients
    _cov: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.drift < 0.0 or self.noise <= 0.0 or min(self.prior_ms) <= 0.0:
            raise ValueError(f"need drift >= 0, noise > 0 and positive prior coefficients, got {self}")
        self._theta = list(self.prior_ms)
        self._cov = [[(PRIOR_SPREAD * self.prior_ms[i]) ** 2 if i == j else 0.0 for j in range(3)] for i in range(3)]

    @staticmethod
    def _features(prompt_tokens: int, decode_rows: int) -> tuple[float, float, float]:
        return (1.0, prompt_tokens / _TOKENS_UNIT, decode_rows / _ROWS_UNIT)

    def _predict_ms(self, x: tuple[float, float, float]) -> float:
        return sum(t * xi for t, xi in zip(self._theta, x))

    def predict(self, prompt_tokens: int, decode_rows: int) -> float:
        """Seconds a step with these prompt tokens and decode rows is expected to take."""
        return self._predict_ms(self._features(prompt_tokens, decode_rows)) / 1000.0

    def coefficients_ms(self) -> tuple[float, float, float]:
        """(ms per step, ms per prompt token, ms per decode row)."""
        base, tokens, rows = self._theta
        return base, tokens / _TOKENS_UNIT, rows / _ROWS_UNIT

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        if not 0.0 < seconds < float("inf"):
            return  # a clock glitch carries no information
        x = self._features(prompt_tokens, decode_rows)
        expected = max(self._predict_ms(x), 1e-3)
        ms = min(max(seconds * 1000.0, expected / CLIP_FACTOR), expected * CLIP_FACTOR)
        cov, theta = self._cov, self._theta
        for i in range(3):  # the random walk: each coefficient may have moved since the last step
            cov[i][i] += (self.drift * max(abs(theta[i]), 0.1 * self.prior_ms[i])) ** 2
        px = [sum(cov[i][j] * x[j] for j in range(3)) for i in range(3)]
        spread = sum(x[i] * px[i] for i in range(3)) + (self.noise * max(ms, expected)) ** 2
        gain = [value / spread for value in px]
        error = ms - self._predict_ms(x)
        for i in range(3):  # no coefficient is negative: clamped here, so errors and predictions agree
            theta[i] = max(0.0, theta[i] + gain[i] * error)
        self._cov = [[cov[i][j] - gain[i] * px[j] for j in range(3)] for i in range(3)]
        self.steps += 1


@dataclass(frozen=True, slots=True)
class StepBudget:
    """What one step may feed of prompts: `tokens` in all, at most `chunk` per task."""

    tokens: int
    chunk: int


class PrefillBudget:
    """The static policy, or the adaptive one when `itl_target_s` is set (module docstring)."""

    def __init__(self, prefill_chunk: int, prefill_budget: int, itl_target_s: float | None = None) -> None:
        if prefill_chunk < 1 or prefill_budget < 1:
            raise ValueError("prefill_chunk and prefill_budget must be >= 1")
        if itl_target_s is not None and not 0.0 < itl_target_s < float("inf"):
            raise ValueError(f"itl_target_s must be a positive number of seconds or None, got {itl_target_s!r}")
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = prefill_budget
        self.itl_target_s = itl_target_s
        self.min_budget = min(prefill_budget, MIN_BUDGET_CHUNKS * prefill_chunk)
        self.model = StepTimeModel()
        self.last_tokens = prefill_budget  # the most recent constrained step's budget, for status

    @property
    def adaptive(self) -> bool:
        return self.itl_target_s is not None

    def tokens(self, decode_rows: int, decoding: int) -> int:
        """Prompt tokens a step may carry next to `decode_rows` rows, `decoding` of which sample
        for a stream (the others only feed a finished task's last token)."""
        if self.itl_target_s is None or decoding == 0:
            return self.prefill_budget
        base, per_token, per_row = self.model.coefficients_ms()
        room_ms = self.itl_target_s * 1000.0 - base - per_row * decode_rows
        fit = int(room_ms / per_token) if per_token > 0.0 else self.prefill_budget
        self.last_tokens = min(self.prefill_budget, max(self.min_budget, fit))
        return self.last_tokens

    def chunk(self, tokens: int, prefilling: int, rest: int | None = None) -> int:
        """The most one task feeds of a step's `tokens` when `prefilling` tasks want some:
        `prefill_chunk`, or an equal share of them when that is larger (module docstring); or its
        whole `rest` of prompt when that is at most twice as much (module docstring)."""
        share = self.prefill_chunk if prefilling < 1 else max(self.prefill_chunk, tokens // prefilling)
        return rest if rest is not None and rest <= 2 * share else share

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        """A step's measured duration: the time between the previous step's sampled ids and this
        step's reaching the host, which is what each decoding stream waited for its token. Only
        steps that carried both prompt chunks and decode rows teach the fit (decode-only steps run
        from CUDA graphs at another cost, and the budget only limits mixed steps)."""
        if self.itl_target_s is not None and prompt_tokens > 0 and decode_rows > 0:
            self.model.observe(prompt_tokens, decode_rows, seconds)

    def describe(self) -> dict[str, float | int | None]:
        base, per_token, per_row = self.model.coefficients_ms()
        return {
            "itl_target_ms": None if self.itl_target_s is None else self.itl_target_s * 1000.0,
            "budget_tokens": self.last_tokens,
            "fit_steps": self.model.steps,
            "fit_base_ms": round(base, 3),
            "fit_us_per_prompt_token": round(per_token * 1000.0, 3),
            "fit_us_per_decode_row": round(per_row * 1000.0, 3),
        }
