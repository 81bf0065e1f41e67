"""Where a scaler's loss-scale rule runs: on host numbers or on the device, and the hand-over between them.

:class:`RuleState` holds the rule's state for one :class:`~lightning_stability.grad_scaler.TunedGradScaler`:
the device tensors (:class:`~lightning_stability.scaling.FusedScaleState`, whose scale is the scaler's
``_scale``), the host numbers (:class:`~lightning_stability.host_scale.HostScaleState`) while the host
decides, the running totals (:class:`~lightning_stability.overflow_counts.OverflowCounts`) and the number of
updates. While the host decides, only the device scale is kept current (one fill when it changes); the device
trackers and totals are brought up to date, with a few fills and no sync, when a step's overflow is known on
the device only. They come back to the host from a read of :meth:`RuleState.device_state` (a logging step's
one transfer).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_stability.host_scale import HostScaleState, float32, update_scale_host
from lightning_stability.overflow_counts import OverflowCounts
from lightning_stability.scale_probe import ScaleProbe
from lightning_stability.scaling import FusedScaleState, ScaleRule, adopt_rule_, fused_state, update_scale_


def overflow_read_on_host(
    optimizer_states: dict[int, dict[str, Any]], read: dict[int, bool | None]
) -> tuple[bool | None, bool]:
    """This step's overflow from what ``step()`` read on the host for each optimizer that unscaled (``read``,
    by ``id(optimizer)``: ``None`` where a skip vote among the flags hid it), or ``None`` if one is known on
    the device only; and whether every optimizer's flag was read on the host (the state may return there)."""
    keys = [key for key, state in optimizer_states.items() if state["found_inf_per_device"]]
    found = [read.get(key) for key in keys]
    every_read = bool(keys) and all(key in read for key in keys)
    if not found or None in found:
        return None, every_read
    return any(found), every_read


class RuleState:
    """The rule's state of one scaler (see the module docstring).

    Attributes:
        fused: the device state, once placed.
        host: the host state while the host decides, else ``None``.
        counts: the running totals.
        updates: how many updates applied the rule.
    """

    def __init__(self, counts: OverflowCounts, updates: int = 0) -> None:
        self.fused: FusedScaleState | None = None
        self.host: HostScaleState | None = None
        self.counts = counts
        self.updates = updates

    def place(
        self, scale: Tensor, growth_tracker: Tensor, start: HostScaleState, rule: ScaleRule, on_host: bool
    ) -> Tensor:
        """Build the device state around torch's ``scale`` and ``growth_tracker``, whose values ``start`` gives
        as host numbers (no read); with ``on_host`` the host decides from here. Returns the tensor the scaler
        adopts as its scale."""
        self.fused = fused_state(scale, growth_tracker, start.hysteresis_tracker, rule)
        self.counts.place(scale.device)
        self.counts.on_host = on_host  # the ring was just filled from the host rows: no copy either way
        self.host = None
        if on_host:
            self.host = HostScaleState(float32(start.scale), start.growth_tracker, start.hysteresis_tracker)
        return self.fused.scale

    def adopt_rule(self, rule: ScaleRule) -> None:
        if self.fused is not None:
            adopt_rule_(self.fused, rule)

    # ------------------------------------------------------------------ hand-over
    def to_device(self) -> None:
        """Hand the state over to the device (a few fills, no sync)."""
        host, fused = self.host, self.fused
        if host is None or fused is None:
            return
        self.host = None
        fused.hysteresis_tracker.fill_(float(max(host.hysteresis_tracker, 1)))  # the scale is current already
        fused.growth_tracker.fill_(host.growth_tracker)
        fused.refill_tracker.fill_(host.growth_tracker)
        self.counts.to_device()

    def device_state(self) -> Tensor | None:
        """``[scale, hysteresis tracker, growth tracker, ring...]`` for :meth:`to_host` (float32, one new tensor),
        or ``None`` when the host decides already."""
        fused = self.fused
        if self.host is not None or fused is None:
            return None
        growth = fused.growth_tracker.to(torch.float32).reshape(1)
        return torch.cat([fused.pair, growth, self.counts.ring().reshape(-1)])

    def to_host(self, values: list[float], updates: int) -> None:
        """Take the state back from a :meth:`device_state` read after update ``updates``; ignored when an update
        has run since."""
        if self.host is not None or self.fused is None or updates != self.updates:
            return
        scale, hysteresis, growth = values[:3]
        self.host = HostScaleState(scale, int(growth), int(hysteresis))
        self.counts.to_host(values[3:])

    # ------------------------------------------------------------------ the update
    def update_on_host(self, overflow: bool, rule: ScaleRule) -> None:
        """One update on host numbers; fills the device scale only when it changes."""
        host, fused = self.host, self.fused
        assert host is not None and fused is not None
        scale = host.scale
        floor_hit = update_scale_host(host, overflow, rule)
        if host.scale != scale:
            fused.scale.fill_(host.scale)  # the one kernel, on the rare step that changes the scale
        self.counts.advance_host(self.updates, overflow, floor_hit)
        self.updates += 1

    def update_on_device(self, found: Tensor, rule: ScaleRule, probe: ScaleProbe | None, headroom: float) -> None:
        """One update on the device (``probe``: the probe step of ``init_scale="auto"``)."""
        self.to_device()
        fused = self.fused
        assert fused is not None
        before, after = self.counts.row(self.updates), self.counts.row(self.updates + 1)
        if probe is not None:
            probe.apply(fused, found, rule, headroom, before, after)
        else:
            update_scale_(fused, found, rule, before, after)
        self.updates += 1

    # ------------------------------------------------------------------ reading
    def hysteresis_tracker(self, default: int) -> int:
        """The hysteresis tracker as a host value (a sync on the device: checkpoints and pickling only)."""
        if self.host is not None:
            return max(self.host.hysteresis_tracker, 1)
        return default if self.fused is None else int(self.fused.hysteresis_tracker.item())

    def totals(self) -> tuple[Tensor, Tensor]:
        """``(overflow steps, floor hits)`` since the start (0-dim int64 tensors; CPU ones while on the host)."""
        if self.counts.on_host:
            overflows, floor_hits = self.counts.host_row(self.updates)
            return torch.tensor(int(overflows)), torch.tensor(int(floor_hits))
        row = self.counts.row(self.updates).to(torch.int64)
        return row[0], row[1]

    def host_snapshot(self) -> tuple[float, float, float] | None:
        """``(loss scale, overflow steps, floor hits)`` as host numbers while the host decides, else ``None``."""
        if self.host is None:
            return None
        overflows, floor_hits = self.counts.host_row(self.updates)
        return self.host.scale, overflows, floor_hits

    def snapshot(self, scale: Tensor) -> Tensor:
        """``[loss scale, overflow steps, floor hits]`` as one new float32 tensor (one op, no sync)."""
        scale = self.fused.pair[:1] if self.fused is not None else scale.reshape(1)
        return torch.cat([scale, self.counts.row(self.updates)])

    def overflow_rate(self) -> Tensor:
        """Share of the last ``min(updates, window)`` updates that overflowed (0-dim tensor; a CPU one while on
        the host)."""
        rate = self.counts.rate(self.updates)
        return rate if isinstance(rate, Tensor) else torch.full((), rate, dtype=torch.float32)

    def checkpoint_entries(self, hysteresis_tracker: int) -> dict[str, Any]:
        """The scaler's checkpoint entries of this state (host reads: checkpoints only); ``hysteresis_tracker``
        is the value before the state is placed."""
        rows = self.counts.host_rows()
        overflows, floor_hits = (int(v) for v in rows[self.updates % len(rows)])
        entries: dict[str, Any] = {
            "_hysteresis_tracker": self.hysteresis_tracker(hysteresis_tracker),
            "overflow_steps": overflows,
            "floor_hits": floor_hits,
            "overflow_counts": rows,
            "updates": self.updates,
        }
        if self.host is not None:  # torch's entries, from the device's tensors, are stale while the host decides
            entries.update(scale=self.host.scale, _growth_tracker=self.host.growth_tracker)
        return entries

    def __getstate__(self) -> dict[str, object]:
        # a pickled scaler starts over from its `_init_*` values: no device state, the totals as host rows
        return {"fused": None, "host": None, "counts": self.counts, "updates": self.updates}
