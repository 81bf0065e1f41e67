"""Where a scaler's loss-scale rule runs (host or device), its running overflow totals, and the ``"auto"`` probe.

:class:`RuleState` holds the rule's state for one :class:`~lightning_stability.amp.scaler.TunedGradScaler`:
the device tensors (:class:`~lightning_stability.amp.rule.FusedScaleState`, whose scale is the scaler's
``_scale``), the host numbers (:class:`~lightning_stability.amp.rule.HostScaleState`) while the host
decides, the running totals (:class:`~lightning_stability.amp.state.OverflowCounts`) and the number of
updates. While the host decides, only the device scale is kept current (one fill when it changes); the device
trackers and totals are brought up to date, with a few fills and no sync, when a step's overflow is known on
the device only. They come back to the host from a read of :meth:`RuleState.device_state` (a logging step's
one transfer).

:class:`OverflowCounts` keeps ``[overflow steps, floor hits]`` after each of the last ``window`` updates, and
before the first of them, in a ring of ``window + 1`` rows: the totals after update ``u`` are in row
``u % (window + 1)``, so the overflow rate over the last ``window`` updates is the difference of two rows. The
ring lives on the host while the scaler decides on the host (:attr:`OverflowCounts.on_host`), and on the device
after :meth:`~OverflowCounts.to_device`, where :func:`~lightning_stability.amp.rule.update_scale_` writes each new
row from the previous one. float32 counts are exact up to 2**24.

:class:`ScaleProbe` serves ``init_scale="auto"``: the first fp16 step runs at scale 1, and the probe gathers over
that step's optimizers whether the gradients overflowed and their largest finite magnitude (both reduced across
ranks with the overflow flag: one collective), then sets the scale with
:func:`~lightning_stability.amp.rule.auto_initial_scale`. All on the device.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability import _compat
from lightning_stability.amp.rule import (
    FusedScaleState,
    HostScaleState,
    ScaleRule,
    ScaleState,
    adopt_rule_,
    auto_initial_scale,
    float32,
    fused_state,
    update_scale,
    update_scale_,
    update_scale_host,
)
from lightning_stability.norms import local_tensor


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
            fused.scale.fill_(host.scale)  # the device is written only on the rare step that changes the scale
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
        """``[loss scale, overflow steps, floor hits]`` as one new float32 tensor (no sync)."""
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


class OverflowCounts:
    """The ring of running totals (see the module docstring)."""

    def __init__(self, window: int, rows: list[list[float]] | None = None) -> None:
        self.window = window
        self._host = rows if rows is not None else [[0.0, 0.0] for _ in range(window + 1)]
        self.on_host = True  # the host rows are the truth; the device ring is stale until `to_device`
        self._ring: Tensor | None = None
        self._rows: tuple[Tensor, ...] = ()

    def place(self, device: torch.device) -> None:
        """Allocate the device ring on ``device`` (filled from the host rows)."""
        self._ring = torch.tensor(self._host, dtype=torch.float32, device=device)
        self._rows = self._ring.unbind(0)  # a view per row, made once

    def to_device(self) -> None:
        """Make the device ring the truth from now on (the host rows are copied there without a sync)."""
        if not self.on_host:
            return
        self.on_host = False
        if self._ring is None:
            return
        rows = torch.tensor(self._host, dtype=torch.float32)
        if self._ring.device.type == "cuda":
            rows = rows.pin_memory()  # a pinned source: the copy does not wait for the device
        self._ring.copy_(rows, non_blocking=True)

    def to_host(self, flat: list[float]) -> None:
        """Make the host rows the truth again, from the device ring's values (``flat``, row after row)."""
        self._host = [[flat[2 * i], flat[2 * i + 1]] for i in range(self.window + 1)]
        self.on_host = True

    def ring(self) -> Tensor:
        """The device ring (placed)."""
        assert self._ring is not None
        return self._ring

    def row(self, updates: int) -> Tensor:
        """``[overflow steps, floor hits]`` after update number ``updates`` (one of the last ``window``)."""
        index = updates % (self.window + 1)
        if self.on_host or self._ring is None:
            return torch.tensor(self._host[index], dtype=torch.float32)
        return self._rows[index]

    def host_row(self, updates: int) -> list[float]:
        """:meth:`row` as host numbers (on the host only)."""
        return self._host[updates % (self.window + 1)]

    def advance_host(self, updates: int, overflow: bool, floor_hit: bool) -> None:
        """Write the row after update ``updates + 1`` from the one before it (on the host)."""
        overflows, floor_hits = self._host[updates % (self.window + 1)]
        self._host[(updates + 1) % (self.window + 1)] = [overflows + overflow, floor_hits + floor_hit]

    def rate(self, updates: int) -> Tensor | float:
        """Share of the last ``min(updates, window)`` updates that overflowed (a float on the host, else a
        0-dim tensor)."""
        covered = min(updates, self.window)
        if self.on_host:
            return (self.host_row(updates)[0] - self.host_row(updates - covered)[0]) / max(1, covered)
        return (self.row(updates)[0] - self.row(updates - covered)[0]) / max(1, covered)

    def host_rows(self) -> list[list[float]]:
        """The rows as host values (a sync when on a device: checkpoints and pickling only)."""
        if self.on_host or self._ring is None:
            return [list(r) for r in self._host]
        return self._ring.tolist()

    @classmethod
    def from_state(cls, state_dict: dict[str, Any], window: int) -> OverflowCounts:
        """The ring saved in a scaler's state dict; fresh counts for one saved by torch's ``GradScaler``."""
        counts = state_dict.get("overflow_counts")
        if counts is None:
            return cls(window)
        return cls(window, [[float(v) for v in row] for row in counts])

    def __getstate__(self) -> dict[str, Any]:
        return {"window": self.window, "_host": self.host_rows(), "on_host": True, "_ring": None, "_rows": ()}


def _local_grads(optimizer: Optimizer) -> list[Tensor]:
    grads = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            g = local_tensor(g)  # a DTensor's shard: this rank's part, reduced across ranks later
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
