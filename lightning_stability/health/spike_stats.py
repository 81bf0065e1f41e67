"""Running statistics of training signals (loss, gradient norm) and their spike scores, on the device.

The estimator is ZClip's (Kumar et al., 2025): the mean and variance of the first ``warmup`` values, then
exponential moving averages with factor ``alpha``; a value's spike score is its z-score against them. Here it
runs on a vector of signals at once, entirely on the device (no host branch, no sync), so it can be decided
identically on every rank from the same reduced values.

Both phases are one incremental update with a per-signal weight ``w``: ``1/n`` for the ``n``-th value of the
warmup (Welford's running mean and population variance, equal to the plain moments when the warmup ends) and
``1 - alpha`` after it (ZClip's EMA, its variance taken around the new mean). The state is a few float32 rows
updated in place, among them ``1/(std + eps)`` (0 during the warmup), so that a z-score needs no division.

A spike is left out of the statistics, so a burst of bad batches leaves them as they were. A signal that stays
above the threshold has settled at a new level (new data, layers unfrozen): a count per signal goes up by one
for each value above the threshold and down by one for each below it (never under 0), and past
``new_level_after`` the values above the threshold are a new level, not spikes. They enter capped at the
threshold (``mean + spike_z * std``, as ZClip enters a clipped gradient norm), and the statistics catch up within
a few steps, where they would otherwise score every later value as a spike for ever (with ``response="skip"``:
skip every later update). The count goes up and down rather than back to 0 so that a new level whose values
straddle the old threshold is still recognised. The standard deviation has a floor of ``min_rel_std * |mean|``:
a signal that barely moved through the warmup would otherwise make every later change a spike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

_MEAN, _VAR, _COUNT, _INV_STD = range(4)
_FLOAT32_MAX = torch.finfo(torch.float32).max
#: the default count past which a signal's values above the threshold are a new level (see the module doc)
NEW_LEVEL_AFTER = 10


class Scored(NamedTuple):
    """One step's scores (device tensors; see :meth:`SpikeStats.score`)."""

    z: Tensor  # z-score per signal (0 for a finite value during the warmup)
    spikes: Tensor  # finite values more than ``spike_z`` standard deviations above the mean (but a new level's)
    include: Tensor  # what the statistics fold in: the finite values that are not spikes
    finite: Tensor  # the watched values that are finite
    nonfinite: Tensor  # 0-dim: a watched value is NaN or infinite
    deviation: Tensor  # value - mean, at most spike_z standard deviations: what :meth:`SpikeStats.update` takes
    run: Tensor  # per signal: up by one for each value above the threshold, down by one below it, never under 0
    flags: Tensor  # per signal, for the history: 0 below the threshold, 1 a spike, 2 a new level's value


class SpikeStats:
    """ZClip's mean and variance of ``n`` signals (warmup moments, then EMA), with their z-scores.

    Args:
        n: how many signals (e.g. 2: the update's loss and the gradient norm).
        alpha: EMA factor (ZClip's default 0.97: about the last 33 steps weigh most).
        warmup: how many values of a signal initialise its mean and variance (ZClip's default 25); before
            that, no value of the signal counts as a spike (its z-score is 0).
        eps: added to the standard deviation in the z-score.
        min_rel_std: the floor of the standard deviation in the z-score, relative to ``|mean|`` (1e-3: a move of
            0.6% of the mean is never a 6-sigma spike).
        new_level_after: the count of values above the threshold (up one above it, down one below, at most 2
            past this limit) past which a signal's values above the threshold are a new level: taken into the
            statistics (capped), not spikes. ``None``: never (every value above the threshold is a spike, left
            out). One for all signals, or one per signal.
    """

    def __init__(
        self,
        n: int,
        alpha: float = 0.97,
        warmup: int = 25,
        eps: float = 1e-6,
        min_rel_std: float = 1e-3,
        new_level_after: int | Sequence[int | None] | None = NEW_LEVEL_AFTER,
    ) -> None:
        self.n, self.alpha, self.warmup, self.eps = n, float(alpha), int(warmup), float(eps)
        self.min_rel_std = float(min_rel_std)
        after = list(new_level_after) if isinstance(new_level_after, Sequence) else [new_level_after] * n
        #: per signal: the count past which its values above the threshold are a new level (None: never)
        self.new_level_after: list[int | None] = [None if k is None else int(k) for k in after]
        self._run: Tensor | None = None  # per signal: the count of values above the threshold (see score)
        self._loaded_run: list[float] | None = None
        self._state: Tensor | None = None  # rows: mean, var, count, 1/(std + eps) once warm (else 0)
        self._rows: tuple[Tensor, ...] = ()  # views of the rows, made once
        self._after: Tensor | None = None  # 1 - alpha, the weight after the warmup (a constant)
        self._zeros: Tensor | None = None
        self._loaded: list[list[float]] | None = None

    def _ensure(self, device: torch.device) -> Tensor:
        if self._state is not None and not self._rows:  # unpickled: plain pickle does not keep views
            self._bind(self._state)
        if self._state is None or self._state.device != device:
            if self._state is not None:
                self._state = self._state.to(device)
            elif self._loaded is not None:
                self._state = torch.tensor(self._loaded, dtype=torch.float32, device=device)
                self._inv_std(self._state[_MEAN], self._state[_VAR], self._state[_COUNT], self._state[_INV_STD])
            else:
                self._state = torch.zeros(4, self.n, dtype=torch.float32, device=device)
            self._run = (
                self._run.to(device)
                if self._run is not None
                else torch.tensor(self._loaded_run or [0.0] * self.n, dtype=torch.float32, device=device)
            )
            self._bind(self._state)
        return self._state

    def _bind(self, state: Tensor) -> None:
        """The row views of ``state`` and the constants on its device, made once (no op per step)."""
        self._rows = state.unbind(0)
        self._after = torch.full((self.n,), 1.0 - self.alpha, device=state.device)
        self._zeros = torch.zeros(self.n, device=state.device)
        limits = [math.inf if k is None else float(k) for k in self.new_level_after]
        self._level_after = torch.tensor(limits, device=state.device)  # HOST DATA: once
        self._count_cap = self._level_after + 2.0  # a count this high falls back under the limit in 2 steps

    def ready(self, device: torch.device) -> Tensor:
        """Which signals have finished their warmup (bool vector)."""
        return self._ensure(device)[_COUNT] >= self.warmup

    def mean_std(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The means and the standard deviations (with their floor, as the z-scores use them)."""
        state = self._ensure(device)
        return state[_MEAN], self._std(state[_MEAN], state[_VAR])

    def zscore(self, values: Tensor) -> tuple[Tensor, Tensor]:
        """``(value - mean) / (std + eps)`` per signal (0 for a finite value still in its warmup), and
        ``value - mean``, which :meth:`update` takes."""
        self._ensure(values.device)
        deviation = values - self._rows[_MEAN]
        return deviation * self._rows[_INV_STD], deviation

    def score(self, values: Tensor, spike_z: float, watched: Tensor | None = None) -> Scored:
        """Score ``values`` (one per signal): z-scores, spikes, and what :meth:`update` should fold in.

        ``watched``: a bool mask of the signals that have a value this step (default: all); the others hold a
        placeholder that is neither scored nor folded in.
        """
        z, deviation = self.zscore(values)
        finite = (values - values) == 0  # in place of torch.isfinite (cheaper on a CPU): inf - inf and NaN are NaN
        nonfinite = finite.all().logical_not()  # a placeholder is finite: it never counts here
        over = (z > spike_z) & finite
        assert self._run is not None
        if watched is not None:
            finite, over = finite & watched, over & watched
        if all(k is None for k in self.new_level_after):  # every value above the threshold is a spike, and stays out
            return Scored(z, over, finite ^ over, finite, nonfinite, deviation, self._run.clone(), over)
        # up one above the threshold, down one below, within [0, limit + 2]: after a new level is learnt, a real
        # spike two steps later is a spike again; a NaN or a signal without a value leaves the count as it was
        run = torch.add(self._run, over, alpha=2.0).sub_(1.0).clamp_(self._zeros, self._count_cap)
        run = torch.where(finite, run, self._run)
        spikes = over > (run > self._level_after)  # past the count's limit: a new level, not a spike
        # a new level's values enter at the threshold, mean + spike_z * std (1/inv_std is inf in the warmup)
        capped = torch.minimum(deviation, self._rows[_INV_STD].reciprocal().mul_(spike_z))
        flags = over.to(torch.float32).add_(over ^ spikes)
        return Scored(z, spikes, finite ^ spikes, finite, nonfinite, capped, run, flags)

    def update(self, deviation: Tensor, include: Tensor, run: Tensor | None = None) -> None:
        """Fold the values whose ``deviation`` (from :meth:`zscore`) is given into the statistics where
        ``include``; an included value must be finite. ``run``: :attr:`Scored.run`, kept for the next score."""
        self._ensure(deviation.device)
        if run is not None:
            assert self._run is not None
            self._run.copy_(run)
        assert self._after is not None and self._zeros is not None
        mean, var, count, inv_std = self._rows
        count.add_(include)
        warming = count <= self.warmup  # this value is part of the warmup
        weight = torch.where(include, torch.where(warming, count.reciprocal(), self._after), self._zeros)
        d = torch.where(include, deviation, self._zeros)
        mean.addcmul_(weight, d)
        keep = 1.0 - weight
        e = d * keep  # the value's deviation from the new mean
        # Welford during the warmup (w * d * e), ZClip's EMA after it (w * e * e): both scale the old variance
        var.mul_(keep).addcmul_(weight * e, torch.where(warming, d, e))
        var.clamp_(max=_FLOAT32_MAX)  # a huge finite value would make it inf for good; this way the EMA decays it
        self._inv_std(mean, var, count, out=inv_std)

    def _inv_std(self, mean: Tensor, var: Tensor, count: Tensor, out: Tensor) -> None:
        """``1/(std + eps)`` once warm, else 0, with the std's floor (also run on a checkpoint's rows, so that a
        resumed run holds the same float32 numbers as the run that wrote it)."""
        torch.div(count >= self.warmup, self._std(mean, var).add_(self.eps), out=out)

    def _std(self, mean: Tensor, var: Tensor) -> Tensor:
        """The standard deviation with its floor, ``min_rel_std * |mean|`` (a new tensor)."""
        return torch.maximum(var.sqrt(), mean.abs().mul_(self.min_rel_std))

    def __getstate__(self) -> dict[str, Any]:
        # the row views would come back as copies of their own: rebuilt from `_state` by `_ensure`
        return {**self.__dict__, "_rows": (), "_after": None, "_zeros": None}

    def state_dict(self) -> dict[str, Any]:
        """Host values (a sync: checkpoints only)."""
        rows = self._state.tolist() if self._state is not None else self._loaded
        run = self._run.tolist() if self._run is not None else self._loaded_run
        return {"alpha": self.alpha, "warmup": self.warmup, "state": rows, "run": run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rows = state.get("state")
        self._loaded, self._state = rows, None
        self._loaded_run, self._run = state.get("run"), None


class IntervalMean:
    """The mean of each signal's finite values since the last :meth:`reset` (the logging interval), on the
    device, with no sync."""

    def __init__(self) -> None:
        self._acc: Tensor | None = None  # rows: sum, count
        self._zero: Tensor | None = None
        self._loaded: list[list[float]] | None = None

    def add(self, values: Tensor, finite: Tensor) -> Tensor:
        """Add the ``finite`` ones of ``values``; returns the means so far (NaN for a signal with none)."""
        if self._acc is None or self._acc.device != values.device:
            rows = self._loaded if self._acc is None and self._loaded is not None else None
            self._acc = (
                self._acc.to(values.device)
                if self._acc is not None
                else torch.tensor(rows, device=values.device)
                if rows is not None
                else torch.zeros(2, values.numel(), device=values.device)
            )
            self._zero, self._loaded = torch.zeros((), device=values.device), None
        assert self._zero is not None
        total, count = self._acc.unbind(0)
        total.add_(torch.where(finite, values, self._zero))
        count.add_(finite)
        return total / count

    def reset(self) -> None:
        if self._acc is not None:
            self._acc.zero_()
        self._loaded = None

    def state_dict(self) -> dict[str, Any]:
        """Host values (a sync: checkpoints only)."""
        return {"acc": self._acc.tolist() if self._acc is not None else self._loaded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._acc, self._loaded = None, state.get("acc")


def zclip_threshold(mean: Tensor, std: Tensor, z: Tensor, z_thresh: float) -> Tensor:
    """ZClip's adaptive clip value for a gradient norm with z-score ``z > z_thresh``: ``mean + z_thresh * std /
    (z / z_thresh)``, lower the larger the outlier (its ``adaptive_scaling`` option, ``clip_factor=1``)."""
    return mean + z_thresh * z_thresh * std / z.clamp(min=z_thresh)
