"""TunedGradScaler and FusedClipMixedPrecision: the fp16 loss-scaling machinery behind LossScaleTuner.

* :class:`TunedGradScaler`, a ``torch.amp.GradScaler`` that keeps torch's contract (``unscale_`` once
  per step, ``step`` skips the update on overflow, ``update`` once per optimizer step) and replaces the
  update with the rule of :mod:`lightning_stability.scaling`, run on the device. It also reduces the
  overflow flag across ranks, so one rank's (or one shard's) inf makes every rank skip.
* :class:`FusedClipMixedPrecision`, Lightning's ``MixedPrecision`` plus gradient clipping for fused
  optimizers (Lightning refuses it): gradients are unscaled first, the fused step then gets
  ``grad_scale=None`` and the overflow flag.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability import _compat
from lightning_stability.scaler_args import check_scaler_arguments
from lightning_stability.scaling import (
    FusedScaleState,
    ScaleRule,
    ScaleState,
    auto_initial_scale,
    fused_state,
    update_scale,
    update_scale_,
)
from lightning_stability.skips import restore_overflow_flags

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


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


class TunedGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` with hysteresis, a floor, an automatic first scale and cross-rank overflow.

    Drop-in for torch's scaler: ``scale``, ``unscale_``, ``step`` and ``update`` keep their contract,
    so Lightning's precision plugins and :class:`~lightning_stability.ledger.StepLedger` use it as is.

    * ``update()`` applies :func:`lightning_stability.scaling.update_scale_` on the device (nine small
      ops around torch's fused kernel): no host sync beyond the one ``step()`` already costs to skip a
      non-fused optimizer.
    * Every ``unscale_`` reduces the overflow flag with ``MAX`` across ``process_group`` (one 0-dim
      collective per optimizer step) when ``torch.distributed`` runs with more than one rank.
    * ``init_scale="auto"``: the first step runs at scale 1 and measures the largest unscaled gradient;
      ``update()`` then sets the scale with :func:`~lightning_stability.scaling.auto_initial_scale`.
      That step is applied, unless its gradients overflowed (the rule then takes over from 1) or were
      all zero (fp16 underflow: the step is skipped and the scale becomes 2**24).
    * Device counts of overflow steps and floor hits after each of the last ``overflow_window`` steps (one
      ring), from which the overflow rate is read.

    Like torch's scaler, ``load_state_dict`` restores the rule's settings along with its state.

    Args:
        device: ``"cuda"``, ``"cpu"``, ... as for ``torch.amp.GradScaler``.
        init_scale: the first scale, or ``"auto"``.
        growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, consecutive_hysteresis:
            see :class:`~lightning_stability.scaling.ScaleRule`.
        overflow_window: how many recent steps :meth:`overflow_rate` covers.
        auto_headroom: safety factor of ``init_scale="auto"``.
        process_group: the group the overflow flag is reduced over; ``None``: the default group.
        enabled: ``False`` makes every method a no-op, as in torch.

    Raises:
        StabilityConfigError: for a bad argument.

    Example::

        scaler = TunedGradScaler("cuda", init_scale="auto", hysteresis=2, min_scale=1.0)
        trainer = L.Trainer(plugins=[MixedPrecision("16-mixed", "cuda", scaler=scaler)])
    """

    #: ``update`` ignores the skip votes the ledger added to the overflow flags (see ``skips``).
    restores_overflow_flags = True

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float | Literal["auto"] = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 2,
        min_scale: float | None = 1.0,
        consecutive_hysteresis: bool = False,
        overflow_window: int = 1000,
        auto_headroom: float = 8.0,
        process_group: ProcessGroup | None = None,
        enabled: bool = True,
    ) -> None:
        check_scaler_arguments(
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            min_scale,
            consecutive_hysteresis,
            overflow_window,
            auto_headroom,
        )
        auto = init_scale == "auto"
        super().__init__(
            device,
            init_scale=1.0 if auto else float(init_scale),
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self._hysteresis = hysteresis
        self._min_scale = None if min_scale is None else float(min_scale)
        self._consecutive_hysteresis = consecutive_hysteresis
        self._overflow_window = overflow_window
        self._auto_headroom = float(auto_headroom)
        self.process_group = process_group
        self._probing = auto
        self._probe_found: Tensor | None = None
        self._probe_peak: Tensor | None = None
        self._updates = 0
        self._init_extra: dict[str, Any] = {
            "hysteresis_tracker": hysteresis,
            "counts": [[0.0, 0.0]] * (overflow_window + 1),
        }
        self._fused: FusedScaleState | None = None
        # [overflow steps, floor hits] after each of the last `overflow_window` updates, and before the first of
        # them: after update u in row u % (overflow_window + 1) (float32, exact up to 2**24)
        self._ring: Tensor | None = None
        self._rows: tuple[Tensor, ...] = ()  # a view per row, made once
        self._after_update: Callable[[TunedGradScaler], None] | None = None
        self._rule: ScaleRule | None = None
        self._rule_settings: tuple[Any, ...] = ()

    # ------------------------------------------------------------------ settings
    @property
    def rule(self) -> ScaleRule:
        """The current settings of the update rule (torch's setters, e.g. ``set_growth_factor``, included)."""
        settings = (
            self._growth_factor,
            self._backoff_factor,
            self._growth_interval,
            self._hysteresis,
            self._min_scale,
            self._consecutive_hysteresis,
        )
        if self._rule is None or self._rule_settings != settings:
            self._rule, self._rule_settings = ScaleRule(*settings), settings
            if self._fused is not None:  # the refill's tracker only follows the growth tracker under some rules
                self._fused.refill_tracker.copy_(self._fused.growth_tracker)
                self._fused.floor_test[1].fill_(self._min_scale or 0.0)
        return self._rule

    @property
    def overflow_window(self) -> int:
        return self._overflow_window

    @property
    def probing(self) -> bool:
        """Whether ``init_scale="auto"`` is still waiting for its first step."""
        return self._probing

    # ------------------------------------------------------------------ device state
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._init_device_state(dev)

    def _init_device_state(self, dev: torch.device) -> None:
        """The rule's device state around torch's scale and growth tracker, from ``_init_extra``."""
        assert self._scale is not None and self._growth_tracker is not None
        extra = self._init_extra
        self._fused = fused_state(self._scale, self._growth_tracker, extra["hysteresis_tracker"], self._min_scale)
        self._ring = torch.tensor(extra["counts"], dtype=torch.float32, device=dev)
        self._rows = self._ring.unbind(0)

    def _extra_host(self) -> dict[str, Any]:
        """The device state as host values (a sync: checkpoints and pickling only)."""
        if self._fused is None or self._ring is None:
            return dict(self._init_extra)
        return {"hysteresis_tracker": int(self._fused.hysteresis_tracker.item()), "counts": self._ring.tolist()}

    def _row(self, updates: int) -> Tensor:
        """``[overflow steps, floor hits]`` after update number ``updates`` (one of the last ``overflow_window``)."""
        index = updates % (self._overflow_window + 1)
        if self._ring is None:
            return torch.tensor(self._init_extra["counts"][index], dtype=torch.float32)
        return self._rows[index]

    @property
    def loss_scale(self) -> Tensor:
        """The current scale (0-dim float32 tensor; no sync)."""
        if self._scale is not None:
            return self._scale
        return torch.tensor(self._init_scale, dtype=torch.float32)

    @property
    def overflow_steps(self) -> Tensor:
        """Optimizer steps whose gradients overflowed since the start (0-dim int64 tensor)."""
        return self._row(self._updates)[0].to(torch.int64)

    @property
    def floor_hits(self) -> Tensor:
        """Overflows that ``min_scale`` stopped from lowering the scale (0-dim int64 tensor)."""
        return self._row(self._updates)[1].to(torch.int64)

    def snapshot(self) -> Tensor:
        """``[loss scale, overflow steps, floor hits]`` as one new float32 tensor (one op, no sync)."""
        return torch.cat([self.loss_scale.reshape(1), self._row(self._updates)])

    @property
    def updates(self) -> int:
        """How many times :meth:`update` applied the rule (host integer)."""
        return self._updates

    def overflow_rate(self) -> Tensor:
        """Share of the last ``min(updates, overflow_window)`` steps that overflowed (0-dim tensor)."""
        covered = min(self._updates, self._overflow_window)
        return (self._row(self._updates)[0] - self._row(self._updates - covered)[0]) / max(1, covered)

    def call_after_next_update(self, hook: Callable[[TunedGradScaler], None]) -> None:
        """Run ``hook(scaler)`` right after the next :meth:`update` (replaces a pending hook)."""
        self._after_update = hook

    # ------------------------------------------------------------------ overflow detection
    def _reduce_max(self, flags: Tensor) -> Tensor:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        return flags

    def _unscale_grads_(
        self, optimizer: Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        # torch's contract lets `_unscale_grads_` run before any `scale()` (its own tests do): no scale yet,
        # so the flags gather on the device of the caller's `found_inf`.
        device = self._scale.device if self._scale is not None else found_inf.device
        flags = [f if f.device == device else f.to(device, non_blocking=True) for f in per_device.values()]
        if len(flags) == 1:
            local = flags[0]
        else:  # no gradients on this rank (it still joins the collective), or several devices
            local = torch.stack(flags).sum() if flags else torch.zeros((), dtype=torch.float32, device=device)
        if self._probing:
            pair = self._reduce_max(torch.stack([local, _peak(_local_grads(optimizer), device)]))
            found, peak = pair[0], pair[1]
            self._probe_found = found if self._probe_found is None else torch.maximum(self._probe_found, found)
            self._probe_peak = peak if self._probe_peak is None else torch.maximum(self._probe_peak, peak)
            # All-zero gradients at the probe scale carry nothing: skip the update like an overflow.
            found = torch.where(peak == 0, torch.ones_like(found), found)
        else:
            found = self._reduce_max(local)
        # One entry, on the scale's device, for the gradients of every device: torch's `step` and `update` only
        # sum the entries. A copy back to the host for CPU-offloaded gradients would be a non-blocking
        # device-to-host transfer that `step()` could read (`.item()` on a CPU tensor) before it completes.
        return {device: found}

    # ------------------------------------------------------------------ the update
    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Apply the rule once for this optimizer step (every optimizer's flags combined). No host sync.

        Args:
            new_scale: set the scale by hand instead, as in torch (the trackers are kept).
        """
        if not self._enabled:
            return
        restore_overflow_flags(self)  # the scale follows the gradients' overflows, not the ledger's skip votes
        if new_scale is not None:
            super().update(new_scale)
            self._probing = False
            self._fire_after_update()
            return
        scale, _ = self._check_scale_growth_tracker("update")
        fused, rows = self._fused, self._rows
        assert fused is not None and fused.scale is scale and rows
        # one flag per optimizer, on the scale's device (see _unscale_grads_)
        flags = [f for state in self._per_optimizer_states.values() for f in state["found_inf_per_device"].values()]
        if not flags:
            raise AssertionError("No inf checks were recorded prior to update.")
        found = flags[0] if len(flags) == 1 else torch.stack(flags).amax()  # 1.0 if any overflowed
        rule = self.rule
        before, after = rows[self._updates % len(rows)], rows[(self._updates + 1) % len(rows)]
        if self._probing and self._probe_found is not None and self._probe_peak is not None:
            self._probe_update(fused, found, rule, before, after)
        else:
            update_scale_(fused, found, rule, before, after)
        self._probing = False
        self._probe_found = self._probe_peak = None
        self._updates += 1
        _compat.reset_scaler_optimizer_states(self)
        self._fire_after_update()

    def _probe_update(
        self, state: FusedScaleState, found: Tensor, rule: ScaleRule, counts: Tensor, out: Tensor
    ) -> None:
        """The first step of ``init_scale="auto"`` (once per run): the rule's answer unless the probe overflowed."""
        assert self._probe_found is not None and self._probe_peak is not None
        scale, growth, hysteresis = state.scale, state.growth_tracker, state.hysteresis_tracker
        new, _, _, floor_hit = update_scale(ScaleState(scale, growth, hysteresis), found, rule)
        overflow = self._probe_found != 0  # `found` also holds the skip of an all-zero probe
        torch.add(counts, torch.stack([overflow, floor_hit & overflow]), out=out)
        auto = auto_initial_scale(self._probe_peak, self._auto_headroom, rule.min_scale)
        scale.copy_(torch.where(overflow, new.scale, auto))
        growth.copy_(torch.where(overflow, new.growth_tracker, torch.zeros_like(new.growth_tracker)))
        hysteresis.copy_(torch.where(overflow, new.hysteresis_tracker.clamp(min=1), float(rule.hysteresis)))
        state.refill_tracker.copy_(growth)

    def _fire_after_update(self) -> None:
        hook, self._after_update = self._after_update, None
        if hook is not None:
            hook(self)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """torch's entries plus the hysteresis tracker, the counters and the rule's extra settings."""
        state = super().state_dict()
        if not state:
            return state
        extra = self._extra_host()
        overflows, floor_hits = (int(v) for v in extra["counts"][self._updates % (self._overflow_window + 1)])
        state.update(
            hysteresis=self._hysteresis,
            min_scale=self._min_scale,
            consecutive_hysteresis=self._consecutive_hysteresis,
            overflow_window=self._overflow_window,
            _hysteresis_tracker=extra["hysteresis_tracker"],
            overflow_steps=overflows,
            floor_hits=floor_hits,
            overflow_counts=extra["counts"],
            updates=self._updates,
            probing=self._probing,
        )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; one saved by torch's ``GradScaler`` also loads (fresh counters).

        A saved scale below ``min_scale`` starts at ``min_scale``.
        """
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        self._min_scale = state_dict.get("min_scale", self._min_scale)
        self._consecutive_hysteresis = bool(state_dict.get("consecutive_hysteresis", self._consecutive_hysteresis))
        self._overflow_window = int(state_dict.get("overflow_window", self._overflow_window))
        self._updates = int(state_dict.get("updates", 0))
        self._probing = bool(state_dict.get("probing", False))
        if self._min_scale is not None and self._init_scale < self._min_scale:
            self._init_scale = float(self._min_scale)
            if self._scale is not None:
                self._scale.fill_(self._init_scale)
        self._init_extra = {
            "hysteresis_tracker": max(int(state_dict.get("_hysteresis_tracker", self._hysteresis)), 1),
            "counts": self._loaded_counts(state_dict),
        }
        if self._fused is not None:  # already running: overwrite the device state in place
            self._init_device_state(self._fused.scale.device)

    def _loaded_counts(self, state_dict: dict[str, Any]) -> list[list[float]]:
        """The ring of counts of a state dict; rebuilt from the totals (and overflow flags) of older ones."""
        rows = self._overflow_window + 1
        counts = state_dict.get("overflow_counts")
        if counts is not None and len(counts) == rows:
            return [[float(v) for v in row] for row in counts]
        overflows, floor_hits = float(state_dict.get("overflow_steps", 0)), float(state_dict.get("floor_hits", 0))
        ring = [[0.0, 0.0] for _ in range(rows)]
        # an earlier version kept one 0/1 flag per update, update u in slot u % overflow_window
        flags = state_dict.get("overflow_flags") or [0.0] * self._overflow_window
        updates = self._updates
        for back in range(min(updates, self._overflow_window) + 1):
            ring[(updates - back) % rows] = [overflows, floor_hits]
            if back < min(updates, self._overflow_window) and len(flags) == self._overflow_window:
                overflows -= float(flags[(updates - 1 - back) % self._overflow_window] != 0)
        return ring

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state["_init_extra"] = self._extra_host()
            state.update(_fused=None, _ring=None, _rows=())
        state.pop("_stability_overflow_flags", None)
        state.update(_after_update=None, _probe_found=None, _probe_peak=None, process_group=None)
        return state
