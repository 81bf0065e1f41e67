"""Running statistics of training signals (loss, gradient norm) and their spike scores, on the device.

The estimator is ZClip's (Kumar et al., 2025): the mean and variance of the first ``warmup`` values, then
exponential moving averages with factor ``alpha``; a value's spike score is its z-score against them. Here it
runs on a vector of signals at once, entirely on the device (no host branch, no sync), so it can be decided
identically on every rank from the same reduced values.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class SpikeStats:
    """EMA mean and variance of ``n`` signals, with a warmup that initialises them from plain moments.

    Args:
        n: how many signals (e.g. 2: the update's loss and the gradient norm).
        alpha: EMA factor (ZClip's default 0.97: about the last 33 steps weigh most).
        warmup: how many values of a signal initialise its mean and variance (ZClip's default 25); before
            that, no value of the signal counts as a spike.
        eps: added to the standard deviation in the z-score.
    """

    def __init__(self, n: int, alpha: float = 0.97, warmup: int = 25, eps: float = 1e-6) -> None:
        self.n, self.alpha, self.warmup, self.eps = n, float(alpha), int(warmup), float(eps)
        self._state: Tensor | None = None  # rows: mean, var, count, warmup sum, warmup sum of squares
        self._loaded: list[list[float]] | None = None

    def _ensure(self, device: torch.device) -> Tensor:
        if self._state is None or self._state.device != device:
            if self._state is not None:
                self._state = self._state.to(device)
            elif self._loaded is not None:
                self._state = torch.tensor(self._loaded, dtype=torch.float64, device=device)
            else:
                self._state = torch.zeros(5, self.n, dtype=torch.float64, device=device)
        return self._state

    def ready(self, device: torch.device) -> Tensor:
        """Which signals have finished their warmup (bool vector)."""
        return self._ensure(device)[2] >= self.warmup

    def mean_std(self, device: torch.device) -> tuple[Tensor, Tensor]:
        state = self._ensure(device)
        return state[0].float(), state[1].clamp(min=0).sqrt().float()

    def zscore(self, values: Tensor) -> Tensor:
        """``(value - mean) / (std + eps)`` per signal; 0 for a signal still in its warmup."""
        mean, std = self.mean_std(values.device)
        z = (values.float() - mean) / (std + self.eps)
        return torch.where(self.ready(values.device), z, torch.zeros_like(z))

    def update(self, values: Tensor, include: Tensor) -> None:
        """Fold ``values`` (one per signal) into the statistics where ``include`` (and the value is finite)."""
        state = self._ensure(values.device)
        x = values.to(torch.float64)
        inc = include & torch.isfinite(x)
        x = torch.where(inc, x, torch.zeros_like(x))
        mean, var, count, total, squares = state.unbind(0)
        warming = count < self.warmup
        total = total + torch.where(warming, x, 0.0)
        squares = squares + torch.where(warming, x * x, 0.0)
        new_count = count + inc.to(count.dtype)
        starts = warming & (new_count >= self.warmup)  # the warmup ends with this value
        init_mean = total / self.warmup
        init_var = (squares / self.warmup - init_mean * init_mean).clamp(min=0)
        ema_mean = self.alpha * mean + (1 - self.alpha) * x
        ema_var = self.alpha * var + (1 - self.alpha) * (x - ema_mean) ** 2
        moving = ~warming & inc
        new_mean = torch.where(starts, init_mean, torch.where(moving, ema_mean, mean))
        new_var = torch.where(starts, init_var, torch.where(moving, ema_var, var))
        state.copy_(torch.stack([new_mean, new_var, new_count, total, squares]))

    def state_dict(self) -> dict[str, Any]:
        """Host values (a sync: checkpoints only)."""
        rows = self._state.tolist() if self._state is not None else self._loaded
        return {"alpha": self.alpha, "warmup": self.warmup, "state": rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rows = state.get("state")
        self._loaded, self._state = rows, None


def zclip_threshold(mean: Tensor, std: Tensor, z: Tensor, z_thresh: float) -> Tensor:
    """ZClip's adaptive clip value for a gradient norm with z-score ``z > z_thresh``: ``mean + z_thresh * std /
    (z / z_thresh)``, lower the larger the outlier (its ``adaptive_scaling`` option, ``clip_factor=1``)."""
    return mean + z_thresh * z_thresh * std / z.clamp(min=z_thresh)
