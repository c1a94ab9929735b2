"""The masked rows of an issued step: their grammars' allowed tokens, then their samples.

A constrained task's mask for step N+1 depends on its token of step N, so the worker calls
`sample(issued)` for step N+1 after processing step N (which advanced the matchers) and before
issuing step N+2 (whose decode reads step N+1's ids): on a GPU, while the device still runs
step N+1's forward. The masks of all masked rows are filled at once with the GIL released
(`albatross.constraints.fill_bitmasks`) into the device step's page-locked rows, then one sampler
call samples those rows on the device.

A masked row whose task has ended since the step was issued (finished, aborted or failed while
processing step N) samples unconstrained: its sample is dropped like any finished task's. A
matcher that fails while filling fails its own task only.
"""

from __future__ import annotations

import logging
import time

from albatross.constraints import ConstraintError, fill_bitmasks
from albatross_engine.device_step import DeviceStep, IssuedStep
from albatross_engine.finishing import Finisher
from albatross_engine.metrics import WorkerMetrics

logger = logging.getLogger(__name__)


class GrammarMasks:
    def __init__(self, device_step: DeviceStep, finisher: Finisher, metrics: WorkerMetrics) -> None:
        self.device_step = device_step
        self.finisher = finisher
        self.metrics = metrics

    def sample(self, issued: IssuedStep) -> None:
        """Fill the masks of `issued`'s masked rows and sample them; nothing for a step without."""
        masked = issued.masked
        if masked is None:
            return
        live = [(n, task, task.matcher) for n, task in enumerate(masked.tasks) if task.matcher is not None and not task.finished]
        started = time.perf_counter()
        rows = self.device_step.mask_rows(len(live))
        try:
            failed = set(fill_bitmasks([(matcher, k) for k, (_, _, matcher) in enumerate(live)], rows))
        except Exception as error:  # the library itself failed: every one of these grammars is lost
            logger.exception("filling %d grammar masks failed", len(live))
            failed, reason = set(range(len(live))), f"{type(error).__name__}: {error}"
        else:
            reason = ""
        mask_index = [-1] * len(masked.tasks)
        for k, (n, task, matcher) in enumerate(live):
            if k in failed:
                problem = reason or matcher.error() or "no token is allowed"
                self.finisher.fail(task, ConstraintError(f"the output grammar failed: {problem}"))
            else:
                mask_index[n] = k
        self.metrics.record_masks(len(live) - len(failed), time.perf_counter() - started)
        self.device_step.sample_masked(issued, mask_index, len(live))
