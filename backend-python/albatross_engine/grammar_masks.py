"""The masked rows of an issued step: their grammars' allowed tokens, then their samples.

A constrained task's mask for step N+1 depends on its token of step N, so the worker fills the
masks of step N+1 once step N's ids have advanced the matchers and before issuing step N+2 (whose
decode reads step N+1's ids): on a GPU, while the device still runs step N+1's forward. The masks
of all masked rows are filled at once with the GIL released (`albatross.constraints.fill_bitmasks`,
a thread per lexer shard) into the device step's page-locked rows, then one sampler call samples
those rows on the device.

`start(issued)` begins the fill on a thread of its own: the worker calls it as soon as step N's
matchers have moved (`ResultProcessor.process`'s `advanced`), so the fill runs while the worker
thread turns step N's ids into events; `sample(issued)` waits for it (or fills at once if nothing
was started) and issues the sampler call.

A masked row whose task has ended since its fill began (finished, aborted or failed while
processing step N) samples unconstrained: its sample is dropped like any finished task's. A
matcher that fails while filling fails its own task only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from albatross.constraints import ConstraintError, TokenMatcher, bitmask_fill
from albatross_engine.device_step import DeviceStep, IssuedStep
from albatross_engine.finishing import Finisher
from albatross_engine.metrics import WorkerMetrics
from albatross_engine.tasks import EngineTask
from runner.interface import output_grammar_failed

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Fill:
    issued: IssuedStep
    live: list[tuple[int, EngineTask, TokenMatcher]]  # (masked row, task, its matcher) at the start
    result: Callable[[], tuple[list[int], float]]  # positions in `live` whose matcher failed, and the fill's seconds


class GrammarMasks:
    def __init__(self, device_step: DeviceStep, finisher: Finisher, metrics: WorkerMetrics) -> None:
        self.device_step = device_step
        self.finisher = finisher
        self.metrics = metrics
        self._thread: ThreadPoolExecutor | None = None  # made at the first start: most engines never mask
        self._pending: _Fill | None = None

    def start(self, issued: IssuedStep) -> None:
        """Begin filling `issued`'s masks on a thread; nothing for a step without masked rows."""
        if issued.masked is None or self._pending is not None:
            return
        live, pairs, rows = self._live(issued)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        fill = bitmask_fill(pairs, rows)  # the matchers' states, taken here
        self._pending = _Fill(issued, live, self._thread.submit(_timed, fill).result)

    def sample(self, issued: IssuedStep) -> None:
        """Fill the masks of `issued`'s masked rows (or wait for the fill `start` began) and sample
        them; nothing for a step without."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.issued is not issued:
            _wait_quietly(pending)  # it writes the rows this step's masks reuse
            pending = None
        if issued.masked is None:
            return
        if pending is None:
            live, pairs, rows = self._live(issued)
            pending = _Fill(issued, live, lambda: _timed(bitmask_fill(pairs, rows)))
        self._finish(pending)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    def _live(
        self, issued: IssuedStep
    ) -> tuple[list[tuple[int, EngineTask, TokenMatcher]], list[tuple[TokenMatcher, int]], np.ndarray]:
        """The masked rows whose task still runs, their (matcher, mask row) pairs, the host rows."""
        masked = issued.masked
        assert masked is not None
        live = [(n, task, task.matcher) for n, task in enumerate(masked.tasks) if task.matcher is not None and not task.finished]
        return live, [(matcher, k) for k, (_, _, matcher) in enumerate(live)], self.device_step.mask_rows(len(live))

    def _finish(self, fill: _Fill) -> None:
        masked = fill.issued.masked
        assert masked is not None
        seconds = 0.0
        try:
            positions, seconds = fill.result()
            failed = set(positions)
        except Exception as error:  # the library itself failed: every one of these grammars is lost
            logger.exception("filling %d grammar masks failed", len(fill.live))
            failed, reason = set(range(len(fill.live))), f"{type(error).__name__}: {error}"
        else:
            reason = ""
        mask_index = [-1] * len(masked.tasks)
        for k, (n, task, matcher) in enumerate(fill.live):
            if task.finished:  # ended while its mask was being filled: sampled unconstrained, dropped
                continue
            if k in failed:
                if reason:  # the library failed, not this request's grammar: a server error
                    self.finisher.fail(task, ConstraintError(f"filling the grammar masks failed: {reason}"))
                else:
                    self.finisher.fail(task, output_grammar_failed(matcher.error() or "no token is allowed"))
            else:
                mask_index[n] = k
        self.metrics.record_masks(len(fill.live) - len(failed), seconds)
        self.device_step.sample_masked(fill.issued, mask_index, len(fill.live))


def _wait_quietly(fill: _Fill) -> None:
    try:
        fill.result()
    except Exception:  # its step is not sampled from these masks: its outcome no longer matters
        logger.debug("an abandoned grammar-mask fill failed", exc_info=True)


def _timed(fill: Callable[[], list[int]]) -> tuple[list[int], float]:
    started = time.perf_counter()
    failed = fill()
    return failed, time.perf_counter() - started
