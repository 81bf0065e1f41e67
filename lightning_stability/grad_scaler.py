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
from lightning_stability.scaling import ScaleRule, ScaleState, auto_initial_scale, update_scale, update_scale_
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

    * ``update()`` applies :func:`lightning_stability.scaling.update_scale_` on the device: no host
      sync beyond the one ``step()`` already costs to skip a non-fused optimizer.
    * Every ``unscale_`` reduces the overflow flag with ``MAX`` across ``process_group`` (one 0-dim
      collective per optimizer step) when ``torch.distributed`` runs with more than one rank.
    * ``init_scale="auto"``: the first step runs at scale 1 and measures the largest unscaled gradient;
      ``update()`` then sets the scale with :func:`~lightning_stability.scaling.auto_initial_scale`.
      That step is applied, unless its gradients overflowed (the rule then takes over from 1) or were
      all zero (fp16 underflow: the step is skipped and the scale becomes 2**24).
    * Device counters: overflow steps, floor hits, and a ring of the last ``overflow_window`` flags.

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
            "overflows": 0,
            "floor_hits": 0,
            "window": [0.0] * overflow_window,
        }
        self._hysteresis_tracker: Tensor | None = None
        self._overflows: Tensor | None = None
        self._floor_hits: Tensor | None = None
        self._window: Tensor | None = None
        self._backoff_tracker: Tensor | None = None
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
        extra = self._init_extra
        self._hysteresis_tracker = torch.tensor(extra["hysteresis_tracker"], dtype=torch.int32, device=dev)
        self._overflows = torch.tensor(extra["overflows"], dtype=torch.int64, device=dev)
        self._floor_hits = torch.tensor(extra["floor_hits"], dtype=torch.int64, device=dev)
        self._window = torch.tensor(extra["window"], dtype=torch.float32, device=dev)

    def _backoff_tracker_for(self, device: torch.device) -> Tensor:
        """Scratch state of the fused backoff pass (its value never changes the scale; not checkpointed)."""
        if self._backoff_tracker is None or self._backoff_tracker.device != device:
            self._backoff_tracker = torch.zeros((), dtype=torch.int32, device=device)
        return self._backoff_tracker

    def _extra_host(self) -> dict[str, Any]:
        """The device counters as host values (a sync: checkpoints and pickling only)."""
        if self._window is None:
            return dict(self._init_extra)
        assert self._hysteresis_tracker is not None and self._overflows is not None and self._floor_hits is not None
        return {
            "hysteresis_tracker": int(self._hysteresis_tracker.item()),
            "overflows": int(self._overflows.item()),
            "floor_hits": int(self._floor_hits.item()),
            "window": self._window.tolist(),
        }

    def _device_or_init(self, name: str) -> Tensor:
        value = getattr(self, f"_{name}")
        if value is not None:
            return value
        dtype = torch.float32 if name == "window" else torch.int64
        return torch.tensor(self._init_extra[name], dtype=dtype)

    @property
    def loss_scale(self) -> Tensor:
        """The current scale (0-dim float32 tensor; no sync)."""
        if self._scale is not None:
            return self._scale
        return torch.tensor(self._init_scale, dtype=torch.float32)

    @property
    def overflow_steps(self) -> Tensor:
        """Optimizer steps whose gradients overflowed since the start (0-dim int64 tensor)."""
        return self._device_or_init("overflows")

    @property
    def floor_hits(self) -> Tensor:
        """Overflows that ``min_scale`` stopped from lowering the scale (0-dim int64 tensor)."""
        return self._device_or_init("floor_hits")

    @property
    def updates(self) -> int:
        """How many times :meth:`update` applied the rule (host integer)."""
        return self._updates

    def overflow_rate(self) -> Tensor:
        """Share of the last ``min(updates, overflow_window)`` steps that overflowed (0-dim tensor)."""
        window = self._device_or_init("window")
        return window.sum() / max(1, min(self._updates, self._overflow_window))

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
        scale, growth = self._check_scale_growth_tracker("update")
        assert self._hysteresis_tracker is not None and self._overflows is not None
        assert self._floor_hits is not None and self._window is not None
        flags = [
            f if f.device == scale.device else f.to(scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for f in state["found_inf_per_device"].values()
        ]
        if not flags:
            raise AssertionError("No inf checks were recorded prior to update.")
        found = flags[0] if len(flags) == 1 else torch.stack(flags).sum()
        rule = self.rule
        state = ScaleState(scale, growth, self._hysteresis_tracker)
        if self._probing and self._probe_found is not None and self._probe_peak is not None:
            # the first step of init_scale="auto" (once per run): the rule's answer unless the probe overflowed
            new, overflow, _, floor_hit = update_scale(state, found, rule)
            overflow = self._probe_found != 0  # `found` also holds the skip of an all-zero probe
            auto = auto_initial_scale(self._probe_peak, self._auto_headroom, rule.min_scale)
            scale.copy_(torch.where(overflow, new.scale, auto))
            growth.copy_(torch.where(overflow, new.growth_tracker, torch.zeros_like(new.growth_tracker)))
            self._hysteresis_tracker.copy_(
                torch.where(overflow, new.hysteresis_tracker, torch.full_like(new.hysteresis_tracker, rule.hysteresis))
            )
            floor_hit = floor_hit & overflow
        else:
            # every other step: the rule in place, around torch's fused update (see scaling.update_scale_)
            overflow, floor_hit = update_scale_(state, found, rule, self._backoff_tracker_for(scale.device))
        self._probing = False
        self._probe_found = self._probe_peak = None
        _compat.foreach_add_([self._overflows, self._floor_hits], [overflow, floor_hit])
        self._window[self._updates % self._overflow_window] = overflow
        self._updates += 1
        _compat.reset_scaler_optimizer_states(self)
        self._fire_after_update()

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
        state.update(
            hysteresis=self._hysteresis,
            min_scale=self._min_scale,
            consecutive_hysteresis=self._consecutive_hysteresis,
            overflow_window=self._overflow_window,
            _hysteresis_tracker=extra["hysteresis_tracker"],
            overflow_steps=extra["overflows"],
            floor_hits=extra["floor_hits"],
            overflow_flags=extra["window"],
            updates=self._updates,
            probing=self._probing,
        )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; one saved by torch's ``GradScaler`` also loads (fresh counters)."""
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        self._min_scale = state_dict.get("min_scale", self._min_scale)
        self._consecutive_hysteresis = bool(state_dict.get("consecutive_hysteresis", self._consecutive_hysteresis))
        self._overflow_window = int(state_dict.get("overflow_window", self._overflow_window))
        self._updates = int(state_dict.get("updates", 0))
        self._probing = bool(state_dict.get("probing", False))
        self._init_extra = {
            "hysteresis_tracker": int(state_dict.get("_hysteresis_tracker", self._hysteresis)),
            "overflows": int(state_dict.get("overflow_steps", 0)),
            "floor_hits": int(state_dict.get("floor_hits", 0)),
            "window": [float(v) for v in state_dict.get("overflow_flags", [0.0] * self._overflow_window)],
        }
        if self._window is not None:  # already running: overwrite the device state in place
            assert self._hysteresis_tracker is not None and self._overflows is not None
            assert self._floor_hits is not None
            extra = self._init_extra
            self._hysteresis_tracker.fill_(extra["hysteresis_tracker"])
            self._overflows.fill_(extra["overflows"])
            self._floor_hits.fill_(extra["floor_hits"])
            self._window = torch.tensor(extra["window"], dtype=torch.float32, device=self._window.device)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state["_init_extra"] = self._extra_host()
            state.update(_hysteresis_tracker=None, _overflows=None, _floor_hits=None, _window=None)
        state.pop("_stability_overflow_flags", None)
        state.update(_after_update=None, _probe_found=None, _probe_peak=None, process_group=None, _backoff_tracker=None)
        return state
