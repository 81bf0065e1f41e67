"""TunedGradScaler: the fp16 loss scaler behind LossScaleTuner.

A ``torch.amp.GradScaler`` that keeps torch's contract (``unscale_`` once per step, ``step`` skips the update
on overflow, ``update`` once per optimizer step) and replaces the update with the rule of
:mod:`~lightning_stability.amp.rule`; where the rule runs, the running totals and the ``init_scale="auto"`` probe
are in :mod:`~lightning_stability.amp.state`.

Each optimizer step has one overflow flag, the same on every rank: torch's unscale records one flag per device the
gradients live on, :func:`combine_flags` makes them one 0-dim flag on the scale's device, and
:func:`lightning_stability.ranks.max_` max-reduces it over a process group, so an inf in one rank's gradient (or
one shard) makes every rank skip and back off alike. :class:`ScalerSettings` holds the scaler's settings and their
checks, the one definition ``TunedGradScaler`` and ``LossScaleTuner`` both take their arguments from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability import _compat, ranks
from lightning_stability.amp.rule import HostScaleState, ScaleRule
from lightning_stability.amp.state import OverflowCounts, RuleState, ScaleProbe, overflow_read_on_host
from lightning_stability.errors import check_bool, check_instance, check_int, check_number, config_error
from lightning_stability.ledger.skips import has_votes_in_flags, restore_overflow_flags

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class TunedGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` with hysteresis, a floor, an automatic first scale and cross-rank overflow.

    Drop-in for torch's scaler: ``scale``, ``unscale_``, ``step`` and ``update`` keep their contract,
    so Lightning's precision plugins and :class:`~lightning_stability.ledger.step_ledger.StepLedger` use it as is.

    * ``update()`` applies the rule with no host sync of its own: on host numbers when ``step()`` read every
      overflow flag on the host (non-fused optimizers; the device scale is written only when it changes), else
      on the device (:func:`lightning_stability.amp.rule.update_scale_`, built on torch's ``_amp_update_scale_``).
    * Every ``unscale_`` reduces the overflow flag with ``MAX`` across ``process_group`` (one 0-dim
      collective per optimizer step) when ``torch.distributed`` runs with more than one rank.
    * ``init_scale="auto"``: the first step runs at scale 1 and measures the largest unscaled gradient;
      ``update()`` then sets the scale with :func:`~lightning_stability.amp.rule.auto_initial_scale`.
      That step is applied, unless its gradients overflowed (the rule then takes over from 1) or were
      all zero (fp16 underflow: the step is skipped and the scale becomes 2**24).
    * Counts of overflow steps and floor hits after each of the last ``overflow_window`` steps (one ring,
      where the rule runs), from which the overflow rate is read.

    Like torch's scaler, ``load_state_dict`` restores the rule's settings along with its state.

    Args:
        device: ``"cuda"``, ``"cpu"``, ... as for ``torch.amp.GradScaler``.
        init_scale: the first scale, or ``"auto"``.
        growth_factor: as in :class:`~lightning_stability.amp.rule.ScaleRule`.
        backoff_factor: as in :class:`~lightning_stability.amp.rule.ScaleRule`.
        growth_interval: as in :class:`~lightning_stability.amp.rule.ScaleRule`.
        hysteresis: as in :class:`~lightning_stability.amp.rule.ScaleRule`.
        min_scale: as in :class:`~lightning_stability.amp.rule.ScaleRule`.
        consecutive_hysteresis: as in :class:`~lightning_stability.amp.rule.ScaleRule`.
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
        check_instance("device", device, (str, torch.device), "a device", "'cuda' or 'cpu'")
        if process_group is not None:
            check_instance("process_group", process_group, dist.ProcessGroup, "a ProcessGroup or None", "None")
        check_bool("enabled", enabled)
        settings = ScalerSettings.among(locals())  # the checks
        auto = init_scale == "auto"
        super().__init__(
            device,
            init_scale=1.0 if auto else float(init_scale),
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self._hysteresis = settings.hysteresis
        self._min_scale = None if settings.min_scale is None else float(settings.min_scale)
        self._consecutive_hysteresis = settings.consecutive_hysteresis
        self._overflow_window = settings.overflow_window
        self._auto_headroom = float(settings.auto_headroom)
        self.process_group = process_group
        self._probing = auto
        self._probe = ScaleProbe()
        self._init_hysteresis = hysteresis  # the hysteresis tracker until the device state exists
        # the rule's state, on the host while the host knows every overflow (see `_maybe_opt_step`)
        self._state = RuleState(OverflowCounts(overflow_window))
        self._host_flags: dict[int, bool | None] = {}  # this step's overflow per optimizer, read by `step()`
        self._host_possible = False  # the last device update had every flag read on the host (a vote hid one)
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
            self._state.adopt_rule(self._rule)
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
        """The rule's state around torch's scale and growth tracker."""
        assert self._scale is not None and self._growth_tracker is not None
        start = HostScaleState(self._init_scale, int(self._init_growth_tracker), self._init_hysteresis)
        self._state.fused = None  # a reload rebuilds it: no stale state adopts the rule below
        # the probe of init_scale="auto" measures on the device
        self._scale = self._state.place(self._scale, self._growth_tracker, start, self.rule, not self._probing)

    # ------------------------------------------------------------------ host and device decisions
    @property
    def decides_on_host(self) -> bool:
        """Whether the rule's state is on the host now (the overflows so far were read by ``step()``)."""
        return self._state.host is not None

    def device_state(self) -> Tensor | None:
        """The state on the device, to read on a logging step and hand to :meth:`to_host` (one new tensor), or
        ``None`` when it is on the host already or cannot go back there (a fused optimizer, the probe)."""
        if self._probing or not self._host_possible:
            return None
        return self._state.device_state()

    def to_host(self, values: list[float], updates: int) -> None:
        """Take the state back to the host from a :meth:`device_state` read after update ``updates`` (on a
        logging step, in its one transfer). Ignored when an update has run since."""
        if not self._probing:
            self._state.to_host(values, updates)

    def _hysteresis_host(self) -> int:
        """The hysteresis tracker as a host value (a sync on the device: checkpoints and pickling only)."""
        return self._state.hysteresis_tracker(self._init_hysteresis)

    @property
    def loss_scale(self) -> Tensor:
        """The current scale (0-dim float32 tensor; no sync)."""
        if self._scale is not None:
            return self._scale
        return torch.tensor(self._init_scale, dtype=torch.float32)

    @property
    def overflow_steps(self) -> Tensor:
        """Optimizer steps whose gradients overflowed since the start (0-dim int64 tensor)."""
        return self._state.totals()[0]

    @property
    def floor_hits(self) -> Tensor:
        """Overflows that ``min_scale`` stopped from lowering the scale (0-dim int64 tensor)."""
        return self._state.totals()[1]

    def host_snapshot(self) -> tuple[float, float, float] | None:
        """``(loss scale, overflow steps, floor hits)`` as host numbers while the host decides, else ``None``."""
        return self._state.host_snapshot()

    def snapshot(self) -> Tensor:
        """``[loss scale, overflow steps, floor hits]`` as one new float32 tensor (no sync)."""
        return self._state.snapshot(self.loss_scale)

    @property
    def updates(self) -> int:
        """How many times :meth:`update` applied the rule (host integer)."""
        return self._state.updates

    def overflow_rate(self) -> Tensor:
        """Share of the last ``min(updates, overflow_window)`` steps that overflowed (0-dim tensor; a CPU one
        while the host decides)."""
        return self._state.overflow_rate()

    def call_after_next_update(self, hook: Callable[[TunedGradScaler], None]) -> None:
        """Run ``hook(scaler)`` right after the next :meth:`update` (replaces a pending hook)."""
        self._after_update = hook

    # ------------------------------------------------------------------ overflow detection
    def _reduce_max(self, flags: Tensor) -> Tensor:
        return ranks.max_(flags, self.process_group)  # one 0-dim collective

    def _unscale_grads_(
        self, optimizer: Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        # torch's contract lets `_unscale_grads_` run before any `scale()` (its own tests do): no scale yet,
        # so the flags gather on the device of the caller's `found_inf`.
        device = self._scale.device if self._scale is not None else found_inf.device
        local = combine_flags(per_device, device)
        if self._probing:
            found = self._probe.observe(local, optimizer, device, self._reduce_max)
        else:
            found = self._reduce_max(local)
        # One entry, on the scale's device, for the gradients of every device: torch's `step` and `update` only
        # sum the entries. A copy back to the host for CPU-offloaded gradients would be a non-blocking
        # device-to-host transfer that `step()` could read (`.item()` on a CPU tensor) before it completes.
        return {device: found}

    def _maybe_opt_step(self, optimizer: Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """torch's step of a non-fused optimizer, which reads the overflow flag on the host: keep what it read."""
        # HOST SYNC: torch's own, once per step of a non-fused optimizer (the same read as torch's).
        found = sum(v.item() for v in optimizer_state["found_inf_per_device"].values())
        # With a skip vote among the flags, a true read does not tell an overflow from the vote.
        self._host_flags[id(optimizer)] = None if found and has_votes_in_flags(self, optimizer) else bool(found)
        return None if found else optimizer.step(*args, **kwargs)

    # ------------------------------------------------------------------ the update
    def update(self, new_scale: float | Tensor | None = None) -> None:
        """Apply the rule once for this optimizer step (every optimizer's flags combined). No host sync.

        When ``step()`` read every overflow flag of the step on the host (non-fused optimizers, as torch does),
        the rule runs on host numbers and writes the device scale only on a step that changes it.
        Otherwise it runs on the device, with :func:`~lightning_stability.amp.rule.update_scale_`.

        Args:
            new_scale: set the scale by hand instead, as in torch (the trackers are kept).
        """
        if not self._enabled:
            return
        restore_overflow_flags(self)  # the scale follows the gradients' overflows, not the ledger's skip votes
        read, self._host_flags = self._host_flags, {}
        if read and new_scale is None:
            overflow, self._host_possible = overflow_read_on_host(self._per_optimizer_states, read)
            if overflow is not None and self._state.host is not None:
                self._state.update_on_host(overflow, self.rule)
                _compat.reset_scaler_optimizer_states(self)
                self._fire_after_update()
                return
        else:  # nothing read on the host (a fused optimizer): the device decides
            self._host_possible = False
        self._state.to_device()
        if new_scale is not None:
            super().update(new_scale)
            self._probing = False
            self._fire_after_update()
            return
        scale, _ = self._check_scale_growth_tracker("update")
        assert self._state.fused is not None and self._state.fused.scale is scale
        # one flag per optimizer, on the scale's device (see _unscale_grads_)
        flags = [f for state in self._per_optimizer_states.values() for f in state["found_inf_per_device"].values()]
        if not flags:
            raise AssertionError("No inf checks were recorded prior to update.")
        found = flags[0] if len(flags) == 1 else torch.stack(flags).amax()  # 1.0 if any overflowed
        probe = self._probe if self._probing and self._probe.observed else None
        self._state.update_on_device(found, self.rule, probe, self._auto_headroom)
        if self._probing:
            self._probing, self._probe = False, ScaleProbe()
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
        state.update(self._state.checkpoint_entries(self._init_hysteresis))
        state.update(
            hysteresis=self._hysteresis,
            min_scale=self._min_scale,
            consecutive_hysteresis=self._consecutive_hysteresis,
            overflow_window=self._overflow_window,
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
        self._probing = bool(state_dict.get("probing", False))
        if self._min_scale is not None and self._init_scale < self._min_scale:
            self._init_scale = float(self._min_scale)
            if self._scale is not None:
                self._scale.fill_(self._init_scale)
        # the tracker never exceeds the rule's hysteresis (a checkpoint may lower it)
        self._init_hysteresis = min(
            max(int(state_dict.get("_hysteresis_tracker", self._hysteresis)), 1), self._hysteresis
        )
        updates = int(state_dict.get("updates", 0))
        fused = self._state.fused
        self._state = RuleState(OverflowCounts.from_state(state_dict, self._overflow_window), updates)
        if fused is not None:  # already running: rebuild the rule's state around torch's reloaded tensors
            self._init_device_state(fused.scale.device)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            host = self._state.host
            if host is not None:  # the device's growth tracker is stale while the host decides
                state.update(_init_scale=host.scale, _init_growth_tracker=host.growth_tracker)
            state.update(_init_hysteresis=self._hysteresis_host(), _host_flags={})
        state.pop("_stability_overflow_flags", None)
        state.update(_after_update=None, _probe=ScaleProbe(), process_group=None)
        return state


def combine_flags(per_device: dict[torch.device, Tensor], device: torch.device) -> Tensor:
    """One 0-dim flag on ``device``: the largest of ``per_device`` (0 when there are none: a rank without
    gradients still joins the collective)."""
    flags = [f if f.device == device else f.to(device, non_blocking=True) for f in per_device.values()]
    if len(flags) == 1:
        return flags[0]
    return torch.stack(flags).amax() if flags else torch.zeros((), dtype=torch.float32, device=device)


def _check_init_scale(init_scale: object, min_scale: object) -> None:
    if init_scale == "auto":
        return
    scale = check_number("init_scale", init_scale, 0.0, example="2.0**16, 32768 or 'auto'")
    if isinstance(min_scale, (int, float)) and scale < min_scale:
        raise config_error(
            "init_scale", init_scale, f"is below min_scale={min_scale}", "raise init_scale, or lower min_scale"
        )


@dataclass(frozen=True)
class ScalerSettings(ScaleRule):
    """The settings of a :class:`TunedGradScaler`: the rule's (:class:`~lightning_stability.amp.rule.ScaleRule`)
    and the scaler's own three, checked at construction. The one definition of the arguments ``TunedGradScaler``
    and ``LossScaleTuner`` share (each is documented in :class:`TunedGradScaler`); ``LossScaleTuner`` holds one and
    builds its scaler with :meth:`scaler`.

    Raises:
        StabilityConfigError: for a bad setting, naming it.
    """

    init_scale: float | Literal["auto"] = 2.0**16
    overflow_window: int = 1000
    auto_headroom: float = 8.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_init_scale(self.init_scale, self.min_scale)
        check_int("overflow_window", self.overflow_window, 1, "1000")
        check_number("auto_headroom", self.auto_headroom, 1.0, example="8.0", low_inclusive=True)

    @classmethod
    def among(cls, arguments: Mapping[str, Any]) -> ScalerSettings:
        """The settings found among a constructor's ``arguments`` (its ``locals()``), checked."""
        return cls(**{f.name: arguments[f.name] for f in fields(cls)})

    def as_arguments(self) -> dict[str, Any]:
        """The settings as keyword arguments, in the constructors' order (``init_scale`` first)."""
        settings = asdict(self)
        return {"init_scale": settings.pop("init_scale"), **settings}

    def scaler(self, device: str) -> TunedGradScaler:
        """A :class:`TunedGradScaler` on ``device`` with these settings."""
        return TunedGradScaler(device, **self.as_arguments())
