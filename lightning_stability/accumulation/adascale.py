"""AdaScale glue for GradientAccumulation(lr_scaling="adascale"): FairScale's gain applied inside the step.

FairScale's ``AdaScale`` estimates, from the spread of the micro-batch gradients, how much a larger batch
gains: 1 when they agree, up to the number of gradients when they are pure noise. Here it only measures:
:class:`AdaScaleGain` reads the gain, and the caller puts it on the update (``StepLedger.scale_update``, which
multiplies the LR for that update only, so LR schedules never see it). FairScale keeps its
statistics as numpy arrays in the optimizer state (under ``"adascale"``); they travel in checkpoints as
lists in the callback's state instead, because ``torch.load(weights_only=True)`` refuses numpy arrays.
No Lightning import: the caller passes the optimizer, the world size and the window size.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, cast

from torch.optim import Optimizer

__all__ = ["AdaScaleGain", "strip_from_checkpoint"]


def _store(optimizer: Optimizer) -> dict[Any, Any]:
    """The optimizer's state dict, where FairScale's AdaScale keeps its statistics under "adascale"."""
    return cast("dict[Any, Any]", optimizer.state)


def strip_from_checkpoint(checkpoint: dict[str, Any]) -> None:
    """Drop AdaScale's numpy statistics from the checkpoint's optimizer states (they travel as lists)."""
    for opt_state in checkpoint.get("optimizer_states", []):
        opt_state.get("state", {}).pop("adascale", None)


def export_statistics(optimizer: Optimizer | None) -> dict[str, list[float]] | None:
    """AdaScale's statistics in ``optimizer`` as plain lists (``None`` when it holds none)."""
    if optimizer is None or "adascale" not in _store(optimizer):
        return None
    return {k: [float(x) for x in v] for k, v in _store(optimizer)["adascale"].items()}


class AdaScaleGain:
    """The AdaScale gain of one optimizer, re-measured every step and applied inside ``optimizer.step()``.

    Life cycle: :meth:`start` at train start, :meth:`configure` at each window start (AdaScale is rebuilt
    when the window size changes, keeping the statistics), :meth:`read_gain` before each step (the caller puts
    it on the update), :meth:`stop` at teardown. :meth:`suspend`/:meth:`resume` bracket a run that is not
    training (a tuner search).
    """

    def __init__(self) -> None:
        self.gain = 1.0
        self.saved_statistics: dict[str, list[float]] | None = None  # from a checkpoint, put back at start
        self._optimizer: Optimizer | None = None
        self._adascale: Any = None
        self._size = 0

    def start(self, optimizer: Optimizer) -> None:
        self._optimizer = optimizer
        self._put_back_statistics()
        self._adascale, self._size, self.gain = None, 0, 1.0

    def _put_back_statistics(self) -> None:
        import numpy as np

        if self.saved_statistics is not None and self._optimizer is not None:
            _store(self._optimizer)["adascale"] = {
                k: np.asarray(v, dtype=np.float64) for k, v in self.saved_statistics.items()
            }

    def configure(self, world_size: int, size: int) -> None:
        """Measure the gain of ``size`` micro-batches per step on each of ``world_size`` ranks."""
        from fairscale.optim import AdaScale

        if self._size == size:
            return
        assert self._optimizer is not None
        state = _store(self._optimizer).get("adascale")
        saved = {k: v.copy() for k, v in state.items()} if state else None
        if self._adascale is not None:
            self._adascale.unhook()
        self._adascale, self._size = None, size
        if world_size * size < 2:
            return  # one gradient per step: nothing to estimate, and the gain is 1 by definition
        # scale=size: the gain is relative to one micro-batch per rank, the batch the base LR was tuned for.
        self._adascale = AdaScale(
            self._optimizer,
            world_size=world_size,
            scale=float(size),
            num_gradients_to_accumulate=size,
        )
        if saved is not None:
            # AdaScale's constructor rescales the stored variance estimate for a fresh start; keep ours.
            _store(self._optimizer)["adascale"] = saved

    def read_gain(self) -> float:
        """Read (HOST SYNC: FairScale's estimator) the gain of the step about to be applied."""
        self.gain = self._measure()
        return self.gain

    def _measure(self) -> float:
        if self._adascale is None:
            return 1.0
        gain = float(self._adascale.gain())
        if not math.isfinite(gain):
            warnings.warn(
                "AdaScale's gain is not finite (non-finite gradients); using 1.", RuntimeWarning, stacklevel=3
            )
            return 1.0
        return gain

    def _drop_estimator(self) -> None:
        if self._adascale is not None:
            self._adascale.unhook()
        self._adascale, self._size = None, 0

    def suspend(self) -> None:
        """Stop measuring and applying the gain until :meth:`resume` (the next :meth:`configure` rebuilds)."""
        self._drop_estimator()
        self.gain = 1.0

    def resume(self) -> None:
        """After :meth:`suspend`: put the checkpointed statistics back if a restore dropped them."""
        if self._optimizer is not None and "adascale" not in _store(self._optimizer):
            self._put_back_statistics()

    def stop(self) -> None:
        self._drop_estimator()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_optimizer=None, _adascale=None)
        return state
