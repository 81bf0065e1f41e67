"""LossScaleTuner: fp16 loss scaling with hysteresis, a floor, an automatic first scale, consistent skips.

The callback installs a :class:`~lightning_stability.amp.scaler.TunedGradScaler` at ``setup`` and logs through
the ledger. With the Trainer's clipping it also installs :class:`FusedClipMixedPrecision`, Lightning's
``MixedPrecision`` with ``gradient_clip_val`` working for fused optimizers too.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal, NamedTuple

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

from lightning_stability import _compat
from lightning_stability.amp.diagnostics import (
    PrecisionDiagnostics,
    check_loss,
    fp16_without_scaler_problem,
    run_fit_start_checks,
)
from lightning_stability.amp.rule import ScaleRule
from lightning_stability.amp.scaler import ScalerSettings, TunedGradScaler
from lightning_stability.errors import StabilityConfigError, check_bool, check_number, config_error
from lightning_stability.ledger import OnHost, OptimizerRecord, StepLedger
from lightning_stability.ledger.callback import LedgerCallback
from lightning_stability.ledger.skips import unscale_if_deferred
from lightning_stability.norms import clip_by_global_norm_

_NEAR_FLOOR_BACKOFFS = 4  # "near the floor": at most this many backoffs above min_scale
_K_SCALE = "stability/loss_scale"
_K_OVERFLOWS = "stability/overflow_steps"
_K_RATE = "stability/overflow_rate"
_K_FLOOR = "stability/loss_scale_floor_hits"


class LossScaleFloorError(RuntimeError):
    """The loss scale sat at ``min_scale`` and the gradients still overflowed (``on_min_scale="raise"``)."""


class LossScaleTuner(LedgerCallback):
    """Own fp16 dynamic loss scaling: hysteresis, a floor, an automatic first scale, rank-consistent skips.

    At ``setup`` it replaces the ``GradScaler`` of the precision plugin (Lightning's
    ``MixedPrecision("16-mixed")``, or any plugin with a ``scaler`` and ``precision="16-mixed"``, such
    as the project's FSDP strategy) with a :class:`TunedGradScaler` on the same device. With
    ``Trainer(gradient_clip_val=...)`` it also swaps ``MixedPrecision`` for
    :class:`FusedClipMixedPrecision`, so clipping works with fused optimizers. Under ``bf16-mixed``,
    ``16-true`` or fp32 there is nothing to scale: it says so once (info) and stays inactive.

    Every overflow skips the update; the shared :class:`~lightning_stability.ledger.step_ledger.StepLedger` records
    it as ``Outcome.SKIPPED_SCALER`` (so ``ledger.record_of().applied_steps`` and the LR schedule skip it too). The
    scale changes by the rule of :mod:`lightning_stability.amp.rule`. Nothing here adds a host sync to a
    step that does not log; on logging steps the values ride the ledger's one batched transfer, and the
    decisions below are made from those host values:

    * **Floor.** An overflow that ``min_scale`` stops from lowering the scale further means fp16 cannot
      represent this run's gradients. ``on_min_scale="raise"`` stops the run with
      :class:`LossScaleFloorError` at the next logging step (at most ``log_every_n_steps - 1`` steps
      late: the price of not syncing every step; pass ``log_every_n_steps=1`` to pay it); ``"warn"``
      warns and goes on. A floor hit after the last logging step is reported at the end of training.
    * **Struggling.** Once per run, when the overflow rate over a full window of ``overflow_window``
      steps exceeds ``max_overflow_rate``, or recent overflows have pushed the scale to within 4
      backoffs of ``min_scale``: a warning saying what to do (lower the LR, clip harder, or bf16).

    Defaults and where they come from:

    ========================  ==========  ==========================================================
    Argument                  Default     Source
    ========================  ==========  ==========================================================
    ``init_scale``            ``2**16``   torch ``GradScaler`` and DeepSpeed ``initial_scale_power=16``.
                                          Megatron-LM starts at ``2**32``; the ``175b`` preset (a
                                          common recipe) at 32768.
    ``growth_factor``         2.0         torch, Megatron-LM, DeepSpeed
    ``backoff_factor``        0.5         torch, Megatron-LM, DeepSpeed
    ``growth_interval``       2000        torch; Megatron-LM's and DeepSpeed's window is 1000
    ``hysteresis``            2           Megatron-LM ``--hysteresis``, DeepSpeed ``hysteresis``
                                          (torch has none: 1)
    ``min_scale``             1.0         Megatron-LM ``--min-loss-scale``, DeepSpeed
                                          ``min_loss_scale`` (torch has none: ``None``)
    ``on_min_scale``          "raise"     DeepSpeed raises at its minimum scale; Megatron-LM clamps
    ``overflow_window``       1000        DeepSpeed ``loss_scale_window``, Megatron-LM
                                          ``--loss-scale-window``
    ========================  ==========  ==========================================================

    Logged keys (on logging steps, to every Lightning logger):

    ===================================  ======================================================
    Key                                  Meaning
    ===================================  ======================================================
    ``stability/loss_scale``             the scale after this step's update
    ``stability/overflow_steps``         steps whose gradients overflowed, since the start
    ``stability/overflow_rate``          share of the last ``overflow_window`` steps that overflowed
    ``stability/loss_scale_floor_hits``  overflows the floor stopped from lowering the scale
    ===================================  ======================================================

    Args:
        init_scale: the first scale, or ``"auto"``: measure the first step's gradients at scale 1 and
            start from the largest power of two keeping them ``auto_headroom`` times inside fp16's 65504.
        growth_factor: multiply the scale by this after ``growth_interval`` finite steps in a row.
        backoff_factor: multiply the scale by this when it backs off.
        growth_interval: finite steps in a row before the scale grows.
        hysteresis: overflows tolerated before the scale backs off (1 = at once, like torch). Each
            overflow step is skipped regardless.
        min_scale: the floor of the scale; ``None`` for none.
        on_min_scale: ``"raise"`` or ``"warn"`` when the floor stops a backoff.
        consecutive_hysteresis: refill the hysteresis after every finite step (DeepSpeed's option).
        overflow_window: steps covered by ``stability/overflow_rate``.
        max_overflow_rate: warn once when the overflow rate over a full window exceeds this.
        auto_headroom: safety factor of ``init_scale="auto"``.
        log_every_n_steps: log (and decide) every this many optimizer steps; default: the Trainer's.
        fit_start_checks: run :func:`lightning_stability.amp.diagnostics.run_fit_start_checks` at fit start
            and check the loss dtype after the first batch (skipped when a ``PrecisionDiagnostics``
            callback does it).

    Raises:
        StabilityConfigError: for a bad argument, or at ``setup`` for a second ``LossScaleTuner``.
        LossScaleFloorError: during training, with ``on_min_scale="raise"``.

    Example::

        trainer = L.Trainer(precision="16-mixed", callbacks=[LossScaleTuner(init_scale="auto")])
    """

    def __init__(
        self,
        init_scale: float | Literal["auto"] = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 2,
        min_scale: float | None = 1.0,
        on_min_scale: Literal["raise", "warn"] = "raise",
        consecutive_hysteresis: bool = False,
        overflow_window: int = 1000,
        max_overflow_rate: float = 0.05,
        auto_headroom: float = 8.0,
        log_every_n_steps: int | None = None,
        fit_start_checks: bool = True,
    ) -> None:
        super().__init__(log_every_n_steps)
        self.settings = ScalerSettings.among(locals())
        if on_min_scale not in ("raise", "warn"):
            raise config_error("on_min_scale", on_min_scale, "is not 'raise' or 'warn'", "pass 'raise' or 'warn'")
        check_number("max_overflow_rate", max_overflow_rate, 0.0, 1.0, example="0.05", high_inclusive=True)
        check_bool("fit_start_checks", fit_start_checks)
        self.on_min_scale = on_min_scale
        self.max_overflow_rate = float(max_overflow_rate)
        self.fit_start_checks = fit_start_checks
        self._scaler: TunedGradScaler | None = None
        self._floor_hits_seen = 0
        self._warned = False
        self._error: LossScaleFloorError | None = None
        self._check_loss = False
        # per optimizer record, what a logging step's on_host needs: the scaler, its update count, the updates
        # the overflow rate covers, the step
        self._at_flush: dict[int, _AtFlush] = {}

    one_instance_reason = "each would own the loss scale"

    def state_fields(self) -> dict[str, Any]:
        return self.settings.as_arguments()  # this order makes the state key that checkpoints are matched by

    @property
    def scaler(self) -> TunedGradScaler | None:
        """The installed scaler (``None`` before ``setup`` or when inactive)."""
        return self._scaler

    # ------------------------------------------------------------------ setup
    def on_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.precision_plugin
        precision = str(getattr(plugin, "precision", trainer.precision))
        current = getattr(plugin, "scaler", None)
        problem = fp16_without_scaler_problem(trainer)  # "16-true" under ModelParallelStrategy: nothing to tune
        if problem is not None:
            raise StabilityConfigError(f"LossScaleTuner: {problem}")
        if precision != "16-mixed" or current is None or not current.is_enabled():
            self._scaler = None
            rank_zero_info(
                f"LossScaleTuner: precision={precision!r} uses no fp16 loss scaling (bf16 and fp32 need "
                "none), so the tuner stays inactive."
            )
            return
        if current is not self._scaler:
            device = _compat.scaler_device(current, trainer.strategy.root_device.type)
            self._scaler = self.settings.scaler(device)
            self._floor_hits_seen, self._warned = 0, False  # a checkpoint may restore both later
            plugin.scaler = self._scaler  # type: ignore[attr-defined]  # any plugin with a `scaler`
        if trainer.gradient_clip_val and type(plugin) is MixedPrecision:
            trainer.strategy.precision_plugin = FusedClipMixedPrecision("16-mixed", plugin.device, scaler=self._scaler)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._error = None
        own_checks = self.fit_start_checks and not any(
            isinstance(cb, PrecisionDiagnostics)
            for cb in trainer.callbacks  # type: ignore[attr-defined]
        )
        self._check_loss = own_checks
        if own_checks:
            run_fit_start_checks(trainer, pl_module)

    # ------------------------------------------------------------------ the step
    def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: Optimizer) -> None:
        if self._scaler is not None:
            # logged after the scaler's update, so the logged scale is the one the next step uses
            self._scaler.call_after_next_update(partial(self._log_scale, ledger))

    def _log_scale(self, ledger: StepLedger, scaler: TunedGradScaler) -> None:
        # Host numbers while the scaler decides on the host; else a snapshot: the scaler updates these tensors in
        # place, and with several optimizers (or a monitor that reads `callback_metrics` later) each step's
        # metric must keep the value it had after its own update.
        values = scaler.host_snapshot()
        scale, overflows, floor_hits = values if values is not None else scaler.snapshot().unbind(0)
        sent_scale = self.record_metric(_K_SCALE, scale)
        self.record_metric(_K_OVERFLOWS, overflows)
        sent_floor_hits = self.record_metric(_K_FLOOR, floor_hits)
        if not self.is_logging_step:
            return
        sent_rate = self.record_metric(_K_RATE, scaler.overflow_rate())
        state = scaler.device_state()
        # back to the host with this step's one transfer (see TunedGradScaler.to_host)
        sent_state = self.to_host(state) if state is not None else None
        covered = min(scaler.updates, scaler.overflow_window)
        record = ledger.record_of()
        self._at_flush[record.index] = _AtFlush(
            scaler, scaler.updates, covered, record.steps, sent_state, sent_scale, sent_floor_hits, sent_rate
        )

    def on_host(self, trainer: pl.Trainer, record: OptimizerRecord) -> None:
        """The scaler's state back to the host; the floor and struggling decisions, from the logging step's one
        transfer."""
        queued = self._at_flush.pop(record.index, None)
        if queued is None:
            return
        scaler, covered, step = queued.scaler, queued.covered, queued.step
        if queued.state is not None:
            scaler.to_host(queued.state.numbers(), queued.updates)
        hits, scale, rate = queued.floor_hits.number(), queued.scale.number(), queued.rate.number()
        rule, window = scaler.rule, scaler.overflow_window
        self._on_floor_hits(int(hits), rule, step)
        if self._warned:
            return
        high_rate = covered >= window and rate > self.max_overflow_rate
        # pushed down by recent overflows to within a few backoffs of the floor
        near_floor = (
            rule.min_scale is not None
            and rate > 0
            and scale <= rule.min_scale / rule.backoff_factor**_NEAR_FLOOR_BACKOFFS
        )
        if high_rate or near_floor:
            self._warned = True
            rank_zero_warn(
                f"fp16 loss scaling is struggling at step {step}: {rate:.1%} of the last {covered} steps "
                f"overflowed (each one skips an update) and the loss scale is {scale:g} "
                f"(min_scale={rule.min_scale}). Fix: lower the learning rate, clip gradients harder "
                "(GradientNormMonitor(max_norm=...)), or train in bf16 (precision='bf16-mixed') on hardware "
                "that has it (NVIDIA Ampere or newer, TPUs, recent CPUs).",
                category=RuntimeWarning,
            )

    def _on_floor_hits(self, hits: int, rule: ScaleRule, step: int) -> None:
        if hits <= self._floor_hits_seen:
            return
        new, self._floor_hits_seen = hits - self._floor_hits_seen, hits
        message = (
            f"The fp16 loss scale is at its floor (min_scale={rule.min_scale}) and gradients still "
            f"overflowed {new} more time(s) by step {step} ({hits} in all): fp16 cannot represent this run's "
            "gradients even unscaled, and every such step is skipped. Fix: lower the learning rate or clip "
            "gradients "
            "(GradientNormMonitor(max_norm=...)), check the model for an exploding layer, or train in bf16 "
            "(precision='bf16-mixed'); lowering min_scale only hides it."
        )
        if self.on_min_scale == "raise":
            self._error = LossScaleFloorError(message)
        else:
            rank_zero_warn(message, category=RuntimeWarning)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._check_loss:
            self._check_loss = False
            check_loss(trainer, outputs)
        self._raise_pending()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._scaler is None:
            return
        # HOST SYNC (once, after training): a floor hit after the last logging step.
        hits = int(self._scaler.floor_hits.item())
        self._on_floor_hits(hits, self._scaler.rule, StepLedger.of(trainer).record_of().steps)
        self._raise_pending()

    def _raise_pending(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The tuner's own state; the scale and its trackers travel with the precision plugin's state."""
        return {"floor_hits_seen": self._floor_hits_seen, "warned": self._warned}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._floor_hits_seen = int(state_dict.get("floor_hits_seen", 0))
        self._warned = bool(state_dict.get("warned", False))

    def transient_state(self) -> dict[str, Any]:
        return {"_scaler": None, "_error": None, "_at_flush": {}}


class _AtFlush(NamedTuple):
    """What a logging step's transfer brings back to ``LossScaleTuner.on_host``, with the scaler it is about."""

    scaler: TunedGradScaler
    updates: int  # the scaler's update count when its state was read
    covered: int  # steps the overflow rate covers
    step: int  # the optimizer step
    state: OnHost | None  # the scaler's device state (None: on the host already)
    scale: OnHost
    floor_hits: OnHost
    rate: OnHost


class FusedClipMixedPrecision(MixedPrecision):
    """Lightning's ``MixedPrecision`` where ``Trainer(gradient_clip_val=...)`` works for fused optimizers too.

    Lightning raises for fused optimizers (they unscale inside ``step()``) because their gradients are
    still scaled when it would clip. Here they are unscaled first (unless a ledger callback already
    did); torch's ``GradScaler.step`` then passes ``grad_scale=None`` and the overflow flag to the fused
    kernel, so nothing is unscaled twice and overflow steps are still skipped. Checkpoints keep the
    ``MixedPrecision`` key, so they load with or without this plugin.

    Example::

        trainer = L.Trainer(gradient_clip_val=1.0, plugins=[FusedClipMixedPrecision("16-mixed", "cuda")])
    """

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val > 0 and self.scaler is not None:
            unscale_if_deferred(self.scaler, optimizer)
        # Skip MixedPrecision.clip_gradients (the fused-optimizer refusal): the gradients are unscaled now.
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip by the global norm with the package's one clip (``torch.nn.utils.clip_grad_norm_``'s coefficient)."""
        grads = [p.grad for p in self.main_params(optimizer) if p.grad is not None]
        if grads:
            clip_by_global_norm_(grads, float(clip_val))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        own = type(self).__qualname__
        if own in checkpoint:
            checkpoint[MixedPrecision.__qualname__] = checkpoint.pop(own)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        own, base = type(self).__qualname__, MixedPrecision.__qualname__
        if own not in checkpoint and base in checkpoint:
            checkpoint[own] = checkpoint[base]
