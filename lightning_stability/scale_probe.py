"""``init_scale="auto"``: the first fp16 step runs at scale 1 and measures the largest gradient.

:class:`ScaleProbe` gathers, over the optimizers of that first step, whether the gradients overflowed and
their largest finite magnitude (both reduced across ranks with the overflow flag: one collective), then
sets the scale with :func:`~lightning_stability.scaling.auto_initial_scale`. All on the device.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability import _compat
from lightning_stability.scaling import FusedScaleState, ScaleRule, ScaleState, auto_initial_scale, update_scale


def _local_grads(optimizer: Optimizer) -> list[Tensor]:
    grads = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if hasattr(g, "to_local"):  # a DTensor shard: this rank's part, reduced across ranks later
                g = g.to_local()
            g = _compat.sparse_values(g) if g.is_sparse else g
            if g.numel():  # a rank's shard of a small tensor may be empty
                grads.append(g)
    return grads


def _peak(grads: list[Tensor], device: torch.device) -> Tensor:
    """max |g| over all finite gradient values (0 when there are none, or none are finite)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for g in grads:
        buckets[(g.device, g.dtype)].append(g)
    peaks = [
        torch.stack(_compat.foreach_norm(group, math.inf, dtype=torch.float32)).amax().to(device, non_blocking=True)
        for group in buckets.values()
    ]
    peak = torch.stack(peaks).amax()
    return torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))


class ScaleProbe:
    """The measurements of the probe step, over every optimizer that steps in it."""

    def __init__(self) -> None:
        self.found: Tensor | None = None
        self.peak: Tensor | None = None

    def observe(
        self, local_found: Tensor, optimizer: Optimizer, device: torch.device, reduce: Callable[[Tensor], Tensor]
    ) -> Tensor:
        """Record one optimizer's overflow flag and gradient peak; return the flag its step obeys.

        ``reduce`` max-reduces a tensor across ranks. All-zero gradients at the probe scale carry nothing: their
        step is skipped like an overflow, though it does not count as one.
        """
        pair = reduce(torch.stack([local_found, _peak(_local_grads(optimizer), device)]))
        found, peak = pair[0], pair[1]
        self.found = found if self.found is None else torch.maximum(self.found, found)
        self.peak = peak if self.peak is None else torch.maximum(self.peak, peak)
        return torch.where(peak == 0, torch.ones_like(found), found)

    @property
    def observed(self) -> bool:
        return self.found is not None and self.peak is not None

    def apply(
        self, state: FusedScaleState, found: Tensor, rule: ScaleRule, headroom: float, counts: Tensor, out: Tensor
    ) -> None:
        """The update of the probe step: the rule's answer if the probe overflowed, else the measured scale.

        Writes ``counts`` plus this step's ``[overflow, floor hit]`` into ``out``, as ``update_scale_`` does.
        """
        assert self.found is not None and self.peak is not None
        scale, growth, hysteresis = state.scale, state.growth_tracker, state.hysteresis_tracker
        new, _, _, floor_hit = update_scale(ScaleState(scale, growth, hysteresis), found, rule)
        overflow = self.found != 0  # `found` also holds the skip of an all-zero probe
        torch.add(counts, torch.stack([overflow, floor_hit & overflow]), out=out)
        auto = auto_initial_scale(self.peak, headroom, rule.min_scale)
        scale.copy_(torch.where(overflow, new.scale, auto))
        growth.copy_(torch.where(overflow, new.growth_tracker, torch.zeros_like(new.growth_tracker)))
        hysteresis.copy_(torch.where(overflow, new.hysteresis_tracker.clamp(min=1), float(rule.hysteresis)))
        state.refill_tracker.copy_(growth)
