"""Pure: each rank's step time on the host clock, and the figures over ranks that name a straggler.

Under synchronous data parallelism every rank's whole step takes as long as the slowest rank's: the others wait
for it inside the gradient all-reduce. A whole-step time is therefore the same on every rank and names nobody.
What differs is the time a rank takes *before its first wait*: from the end of the previous step (its
``on_train_batch_end``) to the backward of this step's last micro-batch, where DDP's gradient all-reduce starts.
That span holds fetching the batch (data loading and collation), the training step's forward and the non-final
micro-batches (whose gradient sync is skipped); a rank slow there (a starved data loader, a host busy with
something else, a slow device once the host waits for it) makes every other rank wait. :class:`StepTimer`
measures both spans with ``time.perf_counter()`` and nothing else: no device op, no sync.

What a host timer measures on a GPU: the host enqueues kernels and runs ahead of the device until something makes
it wait (a ``.item()``, a copy to the host, the caching allocator, a full launch queue). The span then holds the
host's own work (data collation after the fetch, Python, kernel launches) plus whatever waits fall inside it; a
GPU that computes slowly shows only once the host waits for it there. Collectives inside the forward (FSDP's
all-gathers, tensor-parallel all-reduces, DDP's buffer broadcast) put some of the wait for others into the span
too. For the device's own time use CUDA events or a profiler (Megatron-LM's ``StragglerDetector`` times kernels).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class StepTimer:
    """One rank's host wall-clock marks at the step boundaries; the means per optimizer step since the last take.

    * own time: from the previous step's ``on_train_batch_end`` to the last ``on_before_backward`` before this
      step's first optimizer step (the span before the gradient sync, see the module's docstring);
    * step time: from one step's ``on_train_batch_end`` to the next's (whole steps).

    After :meth:`break_interval` (validation ran, a checkpoint was saved, an epoch began: work that may wait
    for other ranks) the next step's own time starts at its first ``on_train_batch_start`` instead, and its
    whole-step time is left out.

    Args:
        clock: the host clock, seconds (``time.perf_counter``; tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._start: float | None = None  # where the step began: the last step's end, or its first batch start
        self._ready: float | None = None  # the last on_before_backward before the step's first optimizer step
        self._stepped = False  # an optimizer stepped in the current batch
        self._last_end: float | None = None
        self._own = [0.0, 0]  # sum, count since the last take
        self._step = [0.0, 0]

    def batch_start(self) -> None:
        if self._start is None:  # a later micro-batch of the same step keeps the first one's start
            self._start = self._last_end if self._last_end is not None else self.clock()

    def backward(self) -> None:
        if not self._stepped:
            self._ready = self.clock()

    def optimizer_step(self) -> bool:
        """Mark the step's optimizer step; ``True`` for the first of the batch (it closes the own-time span)."""
        if self._stepped:
            return False
        self._stepped = True
        if self._start is not None:
            ready = self._ready if self._ready is not None else self.clock()
            self._own[0] += max(ready - self._start, 0.0)
            self._own[1] += 1
        return True

    def batch_end(self) -> None:
        if not self._stepped:  # a micro-batch that did not end the step
            return
        now = self.clock()
        if self._last_end is not None:
            self._step[0] += now - self._last_end
            self._step[1] += 1
        self._last_end = now
        self._start, self._ready, self._stepped = None, None, False

    def break_interval(self) -> None:
        """Leave the current interval out: something that may wait for other ranks ran in it."""
        self._last_end = None
        if not self._stepped:
            self._start = None

    def take_own(self) -> float | None:
        """Mean own time per step since the last call (``None`` if no step was timed); starts a new window."""
        total, count = self._own
        self._own = [0.0, 0]
        return total / count if count else None

    def take_step(self) -> float | None:
        """Mean whole-step time since the last call (``None`` if none was timed); starts a new window."""
        total, count = self._step
        self._step = [0.0, 0]
        return total / count if count else None


@dataclass(frozen=True)
class StragglerFigures:
    """Min / median / max over ranks of one time per rank, and the slowest rank.

    ``median`` is the lower median (torch's ``median``): with two ranks, the faster one, so the slower is named
    when it takes ``factor`` times as long as the other.
    """

    minimum: float
    median: float
    maximum: float
    slowest: int

    def straggles(self, factor: float, min_gap_s: float) -> bool:
        """Whether the slowest rank took more than ``factor`` x the median and at least ``min_gap_s`` longer."""
        return self.maximum > factor * self.median and self.maximum - self.median >= min_gap_s


def straggler_figures(times: Sequence[float]) -> StragglerFigures:
    """The figures of ``times`` (one per rank, in rank order; NaN for a rank that timed no step is ignored)."""
    timed = [(t, r) for r, t in enumerate(times) if not math.isnan(t)]
    if not timed:
        return StragglerFigures(math.nan, math.nan, math.nan, -1)
    ordered = sorted(timed)
    return StragglerFigures(ordered[0][0], ordered[(len(ordered) - 1) // 2][0], ordered[-1][0], ordered[-1][1])


def straggler_message(figures: StragglerFigures, factor: float, step: int, world_size: int) -> str:
    """The warning naming the slowest rank."""
    ratio = figures.maximum / figures.median if figures.median > 0 else math.inf
    return (
        f"Straggler: rank {figures.slowest} took {figures.maximum:.3g} s per step before its gradient sync, "
        f"{ratio:.3g}x the median over {world_size} ranks ({figures.median:.3g} s; fastest {figures.minimum:.3g} "
        f"s), mean of the steps up to optimizer step {step} (straggler_factor={factor:g}). Every rank waits for "
        "it in the gradient all-reduce. Look at that rank's host: its data loading (a slow disk or too few "
        "workers), another process on it, a throttled or failing GPU (nvidia-smi -q: clocks, temperature, "
        "ECC errors); replace the node if it stays slow."
    )
