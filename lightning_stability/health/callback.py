"""TrainingHealthMonitor: watches the gradient norm, the update size, the loss and the memory, and responds to a
spike: warn, adaptive clip (ZClip), skip (OLMo-core), or rollback (PaLM).

:func:`check_health_arguments` checks the monitor's arguments: each bad value is named, with the fix.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability import _compat, incidents, ranks
from lightning_stability.checkpoint.recover import newest_verified
from lightning_stability.errors import (
    StabilityConfigError,
    check_bool,
    check_int,
    check_number,
    check_path,
    config_error,
)
from lightning_stability.health.history import HealthHistory, HealthReporter, HealthSent
from lightning_stability.health.report import outcome_name
from lightning_stability.health.report_loggers import send_report
from lightning_stability.health.responses import RESPONSES, Response
from lightning_stability.health.rollback import HostFlag, Rollback, newest_clean_step, restore_checkpoint
from lightning_stability.health.signals import capacity, peak_memory_over_ranks
from lightning_stability.health.spike_stats import NEW_LEVEL_AFTER, IntervalMean, Scored, SpikeStats, zclip_threshold
from lightning_stability.ledger import LedgerCallback, OnHost, OptimizerRecord, Outcome, Stage, StepLedger, loss_scaler
from lightning_stability.ledger.forward_state import ForwardState
from lightning_stability.ledger.gradients import StepGradients
from lightning_stability.ledger.verdict import CheckpointRing, HealthVerdict
from lightning_stability.norms import local_tensor, module_groups

_LOSS, _GRAD = 0, 1


class _Constants:
    """Device tensors the step reads and never writes (made once: no fill or copy per step)."""

    def __init__(self, device: torch.device) -> None:
        self.zero = torch.zeros((), device=device)
        self.nan = torch.full((1,), math.nan, device=device)
        self.grad_only = torch.tensor([False, True], device=device)  # HOST DATA: once


class _Answer(NamedTuple):
    """What the response to a step's verdict leaves: the values the statistics see (the clipped norm under
    ``"clip"``), the clip threshold (NaN without one), what the statistics fold in, the rollback's damage flag."""

    values: Tensor
    threshold: Tensor
    deviation: Tensor
    include: Tensor
    damaged: Tensor | bool


class TrainingHealthMonitor(LedgerCallback):
    """Watches the loss, the gradient norm, the update size and the memory, and acts on spikes.

    Every optimizer step, on the device and identically on every rank (the loss and the norm are averaged
    over ranks with one 2-element all-reduce, then scored against running statistics, ZClip's EMA
    estimator): a value more than ``spike_z`` standard deviations above its running mean is a spike, and a
    non-finite loss or norm always skips the update. Spikes stay out of the statistics; a signal that stays above
    the threshold (a count past 10, up one above it, down one below) is at a new level and enters them instead
    (not under ``"rollback"``, nor the gradient norm under ``"clip"``). The response to a spike:

    * ``"warn"``: a warning naming the steps, at the next logging step;
    * ``"clip"``: ZClip's adaptive clipping of the gradient when its norm's z-score exceeds ``clip_z``;
    * ``"skip"``: the update is skipped, weights and optimizer state stay exactly as they were (OLMo-core);
    * ``"rollback"``: the update is skipped; when the spike outlasts it (the next step spikes too, on the same
      weights: the damage is in the weights, not in one batch), the step after that restores the weights and
      optimizer state from the last good snapshot (taken every ``snapshot_every`` steps, in host memory, each
      rank its own shard), drops its own update and skips the next ``skip_batches`` batches (PaLM). After
      ``max_rollbacks`` rollbacks, with a ``StableCheckpoint`` attached, the next ones (``max_disk_rollbacks``)
      restore the newest healthy checkpoint on disk older than the damage, each a different one; then training
      stops with :class:`TrainingDivergedError`. No host sync: the flag is copied to the host without waiting and
      read one step later (see ``lightning_stability.health.rollback``).

    Its verdict of each step it scores (spike, new level, rollback pending) is data: a
    :class:`~lightning_stability.ledger.verdict.HealthVerdict` in the step ledger (``StepLedger.of(trainer).health``),
    which ``StableCheckpoint`` reads to defer a save, and whose flags the history and the report record.

    On logging steps it also measures the update-to-weight ratio ``‖Δθ‖/‖θ‖`` (total and per module, one
    transient copy of the local shard) and the peak memory (max over ranks), and warns when the peak nears
    the device's capacity. At the end of ``fit``, and when it ends in an exception, it writes the stability report
    (JSON, and a PNG with matplotlib) into the logger's directory or ``report_dir``, and sends it to the loggers
    that take images or files (TensorBoard, W&B, MLflow).

    Args:
        response: ``"warn"``, ``"clip"``, ``"skip"`` or ``"rollback"``.
        spike_z: z-score above which a loss or gradient norm is a spike, unless it has settled there (a new level;
            OLMo-core's ``sigma_factor``, 6).
        clip_z: z-score above which ``"clip"`` clips the gradient (ZClip's ``z_thresh``, 2.5).
        alpha: EMA factor of the running statistics (ZClip, 0.97).
        warmup_steps: values that initialise the statistics before any spike is called (ZClip, 25).
        snapshot_every: steps between rollback snapshots. Default (``None``): 1% of the run's optimizer steps
            (``trainer.estimated_stepping_batches``), at least 1 and at most 100; 100 when the length is not
            known (PaLM restarted ~100 steps before a spike).
        skip_batches: optimizer steps skipped after a rollback, each with its batch (its ``k`` micro-batches
            under gradient accumulation). Default (``None``): 0.2% of the run's steps, at least 1 and at most
            200; 200 when the length is not known (PaLM skipped 200-500 batches in a run of 255k steps).
        max_rollbacks: rollbacks from the snapshot in memory.
        max_disk_rollbacks: rollbacks from a checkpoint on disk once those from memory are spent (or when the
            snapshot in memory is not older than the damage), with a ``StableCheckpoint`` attached: each to the
            newest healthy checkpoint saved before the damage and not rolled back to already. ``0``: none. Then
            :class:`TrainingDivergedError`.
        memory_warn_fraction: warn when the peak memory passes this share of the capacity.
        top_modules: per-module update ratios logged on logging steps (the largest ones), as
            ``stability/update_ratio_by_module/<module>``; ``0``: none.
        report: write the stability report at the end of ``fit``, also when it ends in an exception, and send it
            to the loggers that take images or files (TensorBoard, W&B, MLflow).
        report_dir: where; default: the logger's ``log_dir``, else the Trainer's ``default_root_dir``.
        skip_on: under ``response="skip"``, the spikes that skip an update: ``"any"``, the loss's or the gradient
            norm's; ``"loss"``, the loss's alone: a gradient-norm spike without one is applied (clipped by
            ``GradientNormMonitor(max_norm=...)`` where one is attached), recorded in the history and the report,
            and warned about. A non-finite loss or norm always skips. A step whose loss is not known has no loss
            spike. Other responses take ``"any"`` only (see :func:`check_skip_on`).
        log_every_n_steps: default: the Trainer's.

    Example::

        trainer = L.Trainer(callbacks=[GradientNormMonitor(max_norm=1.0), TrainingHealthMonitor(response="skip")])
        # skip only on loss spikes: a gradient-norm spike alone is clipped to 1.0 and applied
        trainer = L.Trainer(
            callbacks=[GradientNormMonitor(max_norm=1.0), TrainingHealthMonitor(response="skip", skip_on="loss")]
        )
    """

    one_instance_reason = "each would vote on the same steps and restore the same weights"
    needs_loss = True

    def __init__(
        self,
        response: Response = "warn",
        spike_z: float = 6.0,
        clip_z: float = 2.5,
        alpha: float = 0.97,
        warmup_steps: int = 25,
        snapshot_every: int | None = None,
        skip_batches: int | None = None,
        max_rollbacks: int = 3,
        max_disk_rollbacks: int = 1,
        memory_warn_fraction: float = 0.9,
        top_modules: int = 5,
        report: bool = True,
        report_dir: str | Path | None = None,
        skip_on: Literal["any", "loss"] = "any",
        log_every_n_steps: int | None = None,
    ) -> None:
        super().__init__(log_every_n_steps)
        check_health_arguments(
            response,
            spike_z,
            clip_z,
            alpha,
            warmup_steps,
            snapshot_every,
            skip_batches,
            max_rollbacks,
            memory_warn_fraction,
            top_modules,
            max_disk_rollbacks,
        )
        check_skip_on(skip_on, response)
        check_bool("report", report)
        if report_dir is not None:
            check_path("report_dir", report_dir, "'reports/'")
        self.response, self.spike_z, self.clip_z = response, float(spike_z), float(clip_z)
        self.skip_on = skip_on
        self.rollback = Rollback(snapshot_every, skip_batches, max_rollbacks, max_disk_rollbacks)
        self.report, self.report_dir = report, report_dir
        # a lasting new level is learnt after 10 steps above the threshold; never under "rollback", which rolls
        # back each time and, past max_rollbacks, stops with an error that says what to change; nor for the
        # gradient norm under "clip", which ZClip always folds in (clipped)
        k = NEW_LEVEL_AFTER
        levels = {"rollback": (None, None), "clip": (k, None)}.get(response, (k, k))
        self.stats = SpikeStats(2, alpha, warmup_steps, new_level_after=levels)
        self._log = HealthReporter(response, self.spike_z, memory_warn_fraction, top_modules, skip_on)
        self._spiked: Tensor | bool = False  # the last scored step's spike flag (rollback), on the device
        self._damaged = HostFlag()  # "this step and the one before spiked", read on the host one step later
        self._module_of: dict[int, int] = {}  # id(param) -> its module's index in `_names`
        self._module_index: tuple[tuple[int, ...], Tensor] | None = None  # for the params that have gradients
        self._trainer: pl.Trainer | None = None
        self._resumed_at = 0  # the global step this fit started at
        self._interval = IntervalMean()  # the loss (and norm) over the logging interval
        self._const: _Constants | None = None
        self._row: int | None = None  # the open step's history row, its outcome set in after_step
        self._grads: StepGradients | None = None  # the open step's gradients: their fixed clip read in after_step
        self._measured = False  # this logging step's update is measured (the step's UpdateSize, read in after_step)
        self._sent_memory: OnHost | None = None  # a logging step's peak memory, read back in on_host
        self._sent: dict[int, HealthSent] = {}  # per optimizer: what a logging step sent, read in on_host
        # (step, generation, scores, values, the flags read on the host or None: see flags_on_host)
        self._scored_of: tuple[Any, int, Scored, Tensor, list[bool] | None] | None = None
        self._rolling = False  # under "rollback": the open step is a rollback's or skipped after one (row 3)

    @property
    def history(self) -> HealthHistory:
        """Each step's loss, gradient norm, clip threshold, spike flags, LR, loss scale, update ratio (where measured)
        and outcome (host series up to the last logging step): the newest 2,000 steps in ``series``, older ones
        downsampled in ``buckets``, exact whole-run counts in ``totals`` (see
        :class:`~lightning_stability.health.history.HealthHistory`)."""
        return self._log.history

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every step so far that was not applied as it came (spikes, skipped and rolled-back steps, ZClip's clips) and
        the new levels, as ``{"step", "kind", "detail"}`` and, by kind, ``"outcome"``, ``"to_step"``, ``"last_step"``
        (see ``docs/how-to/find-why-a-run-spiked.md``)."""
        return self._log.events

    def state_fields(self) -> dict[str, Any]:
        return {"response": self.response}  # skip_on left out: the state is the same, a checkpoint loads either way

    # ------------------------------------------------------------------ setup
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) > 1:
            raise StabilityConfigError(
                f"TrainingHealthMonitor watches one optimizer's updates; this module has {len(trainer.optimizers)}. "
                "Fix: remove it, or train with one optimizer (GradientNormMonitor and the LR schedules serve several)."
            )
        names = {id(p): n for n, p in pl_module.named_parameters()}
        params = [p for g in trainer.optimizers[0].param_groups for p in g["params"]] if trainer.optimizers else []
        index, self._log.names = module_groups(params, names)
        self._module_of = {id(p): i for p, i in zip(params, index, strict=True)}
        self._module_index = None
        device = pl_module.device
        self._log.capacity = capacity(device)
        self._const = None
        self._trainer = trainer
        self._log.on_events = self._record_incidents
        # row 3 of the step table: a rollback restores the state before anything measures the step
        rollback = self._open_rollback if self.response == "rollback" else None
        StepLedger.of(trainer).at(Stage.OPEN, "TrainingHealthMonitor.rollback", rollback)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resumed_at = trainer.global_step  # the outcomes of steps before it came with the checkpoint
        if self.response == "rollback":
            total = _total_steps(trainer)
            every, skip = self.rollback.fit_to_run(total)
            length = "of unknown length" if total is None else f"of {total} steps"
            rank_zero_info(
                f"TrainingHealthMonitor: for a run {length}, a rollback snapshot every {every} steps and "
                f"{skip} batches skipped after a rollback"
            )
            # the state before the next step: labelled with the last step taken (-1 at the very start); from the
            # global step, not Lightning's label, which after a mid-epoch resume is one behind until the first batch
            self.rollback.start(pl_module, trainer.optimizers, trainer.global_step - 1)
            ForwardState.of(pl_module).forget()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self.response == "rollback":
            # the buffers a forward changes, as the step starts: for a snapshot taken in this step, or to undo the
            # forward of a batch of the window skipped after a rollback
            ForwardState.of(pl_module).begin(copy=self.rollback.wants_copy(_compat.batches_that_stepped(trainer)))

    # ------------------------------------------------------------------ the step
    def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: Optimizer) -> None:
        """The verdict on this step (scores against the running statistics), then the response to it, then what
        the step leaves: the statistics, the metrics, the history's row, the update measured on logging steps."""
        lr = optimizer.param_groups[0]["lr"]
        host = {} if isinstance(lr, Tensor) else {"lr": float(lr)}
        if self._rolling:
            self._skip_for_rollback(ledger, host)  # the rollback step or the data window after it: no sync
            return
        grads = ledger.gradients()
        const = self._constants(grads.total.device)
        # 1. the verdict: the update's loss and gradient norm, averaged over ranks, scored
        scored, values, raw, z = self._score(ledger, grads, const)
        # 2. the response: a non-finite value is never applied, whatever the response; then the response's own
        read = self._read_flags(ledger)  # host bools, where StepReplay read them as the step opened
        ledger.mark_skip(Outcome.SKIPPED_NONFINITE, scored.nonfinite if read is None else read[0])
        answer = self._respond(ledger, grads, scored, values, z, const, read)
        verdict = ledger.health = HealthVerdict(scored.flags, scored.spikes, answer.damaged)  # StableCheckpoint's
        # 3. what the step leaves: the statistics move, the metrics, the history's row
        self.stats.update(answer.deviation, answer.include, scored.run)
        self._record_step(
            trainer, ledger, grads, answer.values, scored.finite, z, raw, answer.threshold, verdict, lr, host
        )

    def _skip_for_rollback(self, ledger: StepLedger, host: dict[str, float]) -> None:
        ledger.mark_skip(Outcome.SKIPPED_ROLLBACK, True)
        row = self.history.add(ledger.step_label, [], host, ledger.record_of().device)
        self.history.set_outcome(row, int(Outcome.SKIPPED_ROLLBACK))
        self._row, self._measured, self._grads = None, False, None
        self.record_metric("stability/rollbacks", float(self.rollback.rollbacks))
        if self.is_logging_step:
            self._on_logging_step(ledger)

    def _score(
        self, ledger: StepLedger, grads: StepGradients, const: _Constants
    ) -> tuple[Scored, Tensor, Tensor, Tensor]:
        """The step's scores, the values scored (mean over ranks), the history's raw values and the z-scores."""
        scored, values = self._scored(ledger, grads, const)
        if (
            ledger.step.loss is None
        ):  # the step's loss is not known: a placeholder the statistics skip; NaN in the history
            z, raw = torch.where(const.grad_only, scored.z, const.nan), torch.cat([const.nan, values[_GRAD:]])
            return scored, values, raw, z
        return scored, values, values, scored.z

    def _scored(self, ledger: StepLedger, grads: StepGradients, const: _Constants) -> tuple[Scored, Tensor]:
        """The step's loss (0 when not known) and gradient norm, averaged over ranks (one all-reduce), and their
        scores against the statistics as they stand: once per step's gradients, shared with ``StepReplay``'s look
        at the step (:meth:`flags_on_host`)."""
        step = ledger.step
        memo = self._scored_of
        if memo is not None and memo[0] is step and memo[1] == step.generation:
            return memo[2], memo[3]
        loss = step.loss
        first = const.zero if loss is None else loss.detach().float().to(const.zero.device)
        values = ranks.mean(torch.stack([first, grads.total]))  # every rank decides from the same numbers
        scored = self.stats.score(values, self.spike_z, const.grad_only if loss is None else None)
        self._scored_of = (step, step.generation, scored, values, None)
        return scored, values

    def _record_incidents(self, events: list[dict[str, Any]]) -> None:
        if self._trainer is not None:
            replayed = {e.get("step") for e in (*self._log.events, *events) if e.get("kind") == "replay"}
            record_incidents(self._trainer, events, replayed, self._resumed_at)

    def record_event(self, ledger: StepLedger, event: dict[str, Any]) -> None:
        """Record an event of the run (``{"step", "kind", "detail", ...}``: a rollback, a replay) in the report's
        :attr:`events` and the ledger's (saved in checkpoints)."""
        self._log.add_events([event])
        ledger.note(event)

    # ------------------------------------------------------------------ for StepReplay
    def scores_step(self) -> bool:
        """Whether this monitor scores the open step (under ``"rollback"``, not the rollback's own step nor the data
        window skipped after it, decided as the step opened). Reads nothing from the device."""
        return not self._rolling

    def flags_on_host(self, ledger: StepLedger) -> list[bool]:
        """The open step's ``[non-finite, loss spike, gradient-norm spike]`` by the monitor's rule, read on the host
        in the step's early read (``OptimizerStep.read_on_host``: a HOST SYNC on a GPU), once per generation of its
        gradients. This monitor's votes on the step are then host bools, and so is any vote on non-finite values
        (``step.known_finite``): a non-fused optimizer's step needs no other read."""
        read = self._read_flags(ledger)
        if read is None:
            grads = ledger.gradients()
            scored, values = self._scored(ledger, grads, self._constants(grads.total.device))
            flags = torch.cat([scored.nonfinite.reshape(1), scored.spikes])
            read = [bool(v) for v in ledger.step.read_on_host(flags)]
            self._scored_of = (ledger.step, ledger.step.generation, scored, values, read)
            ledger.step.known_finite = not read[0]
        return read

    def _read_flags(self, ledger: StepLedger) -> list[bool] | None:
        memo = self._scored_of
        step = ledger.step
        return memo[4] if memo is not None and memo[0] is step and memo[1] == step.generation else None

    def loss_flags(self, losses: Tensor) -> Tensor:
        """Which of ``losses`` (a vector of single micro-batch losses, this rank's) are non-finite or spikes of the
        loss by the running statistics (none while they warm up). Nothing moves."""
        mean, std = self.stats.mean_std(losses.device)
        ready = self.stats.ready(losses.device)[_LOSS]
        z = (losses - mean[_LOSS]) / std[_LOSS]
        return ~torch.isfinite(losses) | (ready & (z > self.spike_z))

    def _respond(
        self,
        ledger: StepLedger,
        grads: StepGradients,
        scored: Scored,
        values: Tensor,
        z: Tensor,
        const: _Constants,
        read: list[bool] | None = None,
    ) -> _Answer:
        """The response to the verdict: ``"clip"`` clips (ZClip), ``"skip"``/``"rollback"`` vote, ``"rollback"``
        also notes whether the damage got in; what the statistics then fold in."""
        threshold, deviation, include = const.nan, scored.deviation, scored.include
        damaged: Tensor | bool = False
        spikes = scored.spikes
        if self.response == "clip":
            mean, std = self.stats.mean_std(values.device)
            over = z[_GRAD] > self.clip_z
            limit = torch.where(over, zclip_threshold(mean[_GRAD], std[_GRAD], z[_GRAD], self.clip_z), math.inf)
            grads.clip_(limit)
            values = torch.stack([values[_LOSS], torch.minimum(values[_GRAD], limit)])  # ZClip: the clipped norm
            deviation = torch.minimum(deviation, self.stats.zscore(values)[1])  # folded in clipped, always
            include = include | (scored.finite & const.grad_only)
            threshold = limit.reshape(1)
            self.record_metric("stability/clip_threshold", threshold[0])
        elif self.response in ("skip", "rollback"):
            # skip_on="loss": the loss's flag alone (a gradient-norm spike without one is applied)
            if read is not None:  # [non-finite, loss spike, gradient-norm spike] as StepReplay read them
                ledger.mark_skip(Outcome.SKIPPED_SPIKE, read[1] or (self.skip_on != "loss" and read[2]))
            else:
                ledger.mark_skip(Outcome.SKIPPED_SPIKE, spikes[_LOSS] if self.skip_on == "loss" else spikes.any())
        if self.response == "rollback":
            # the damage got in when this step spiked on the weights of a spike whose update was skipped
            spiked, before = spikes.any(), self._spiked
            if isinstance(before, Tensor) or before:
                got_in = spiked & before if isinstance(before, Tensor) else spiked
                self._damaged.send(got_in)
                damaged = got_in
            self._spiked = spiked
        return _Answer(values, threshold, deviation, include, damaged)

    def _record_step(
        self,
        trainer: pl.Trainer,
        ledger: StepLedger,
        grads: StepGradients,
        values: Tensor,
        finite: Tensor,
        z: Tensor,
        raw: Tensor,
        threshold: Tensor,
        verdict: HealthVerdict,
        lr: Any,
        host: dict[str, float],
    ) -> None:
        const = self._constants(values.device)
        # the loss's mean over the logging interval, every step so that EarlyStopping/ModelCheckpoint find it at
        # any epoch end (device ops, no sync)
        loss_z, grad_norm_z = z.unbind()
        metrics = (
            ("stability/loss_mean", self._interval.add(values, finite)[_LOSS]),
            ("stability/rollbacks", float(self.rollback.rollbacks)),
            ("stability/loss_z", loss_z),
            ("stability/grad_norm_z", grad_norm_z),
        )
        for key, value in metrics:
            self.record_metric(key, value)
        scaler = loss_scaler(trainer)
        scaler_scale = _compat.scaler_scale(scaler) if scaler is not None else None
        scale = scaler_scale.reshape(1).float().to(const.nan.device) if scaler_scale is not None else const.nan
        lr_value = lr.reshape(1).float() if isinstance(lr, Tensor) else const.nan
        # the history's row: loss, grad norm, clip threshold, the two spike flags, LR, loss scale, update ratio (set
        # in after_step where the step measured its update)
        parts = [raw, threshold, verdict.flags, lr_value, scale, const.nan]
        self._row = self.history.add(ledger.step_label, parts, host, values.device)
        self._grads = grads if self.response != "clip" else None
        # the update-to-weight ratio on logging steps: measured across the update by the step (shared with others)
        self._measured = self.is_logging_step and ledger.step.measure_update(log=True) is not None
        if self.is_logging_step:
            self._on_logging_step(ledger)

    def after_step(self, trainer: pl.Trainer, ledger: StepLedger) -> None:
        if self.response == "rollback":
            ForwardState.of(trainer.lightning_module).end()
        if self._row is not None:
            self.history.set_outcome(self._row, ledger.outcome)
            measured = ledger.step.update  # by this monitor on logging steps, or by another callback (a device copy)
            if measured is not None and measured.ratio is not None:
                self.history.set_value(self._row, "update_ratio", measured.ratio)
            scale = ledger.step.scale
            if scale.factors and scale.lrs is not None:  # the row holds the schedule's LR: the update's, when scaled
                self.history.set_value(self._row, "lr", scale.lrs[0])
            # the report's clip line where this monitor does not clip: the fixed clip the step's gradients got
            fixed = self._grads.fixed_threshold if self._grads is not None else None
            if fixed is not None:
                self.history.set_host(self._row, "clip_threshold", fixed)
            self._row, self._grads = None, None
        top = None
        size = ledger.step.update if self._measured else None
        self._measured = False
        if size is not None:  # the update-to-weight ratio (total and the largest modules), after the update
            _, largest = self._log.update_ratios(size, self._index_of(size.params))
            top = (self.to_host(largest[0]), self.to_host(largest[1])) if largest is not None else None
        if self.is_logging_step:
            rows = self.history.pending()  # the rows since the last logging step ride this step's transfer
            sent_rows = self.to_host(rows) if rows is not None else None
            self._sent[ledger.record_of().index] = HealthSent(sent_rows, top, self._sent_memory)
            self._sent_memory = None

    def _index_of(self, params: list[Tensor]) -> Tensor:
        """Each parameter's module index, on the device, for the parameters that have gradients this step (a
        frozen or unused parameter has none); built once per distinct set (logging steps only)."""
        key = tuple(id(p) for p in params)
        if self._module_index is None or self._module_index[0] != key:
            index = [self._module_of.get(id(p), 0) for p in params]
            device = local_tensor(params[0]).device
            self._module_index = (key, torch.tensor(index, dtype=torch.int64, device=device))
        return self._module_index[1]

    def _constants(self, device: torch.device) -> _Constants:
        if self._const is None or self._const.zero.device != device:
            self._const = _Constants(device)
        return self._const

    def _open_rollback(self, ledger: StepLedger) -> None:
        """As the step opens (row 3 of the step table, ``Stage.OPEN``), under ``"rollback"``: roll back or skip."""
        trainer = ledger.trainer
        self._rolling = trainer is not None and self._rollback_or_skip(trainer, ledger)

    def _rollback_or_skip(self, trainer: pl.Trainer, ledger: StepLedger) -> bool:
        """Under ``"rollback"``, before the step's update: roll back if the flag sent one step ago says the damage
        got in, or count down the skipped window; otherwise keep the snapshots. Whether the update is dropped."""
        module, optimizers, step = trainer.lightning_module, trainer.optimizers, ledger.step_label
        if self._damaged.read():  # HOST READ of a copy started a step ago: no wait for the device
            self._roll_back(ledger, step, end=False)
            return True
        state = ForwardState.of(module)
        if self.rollback.take_skip():
            with torch.no_grad():
                state.restore()  # the skipped batch's forward leaves nothing in the buffers either
            return True
        self.rollback.advance(module, optimizers, step, state.as_started())
        return False

    def _roll_back(self, ledger: StepLedger, step: int, end: bool) -> None:
        """Restore the snapshot in memory, or a healthy checkpoint on disk, or stop (every rank alike)."""
        trainer = ledger.trainer
        assert trainer is not None
        r, module, optimizers = self.rollback, trainer.lightning_module, trainer.optimizers
        rings = [cb for cb in trainer.callbacks if isinstance(cb, CheckpointRing)]  # type: ignore[attr-defined]
        found, why_not = None, ""
        if not r.from_memory(step):
            found, why_not = self._checkpoint_before_damage(trainer, rings, step)
        state = ForwardState.of(module)
        if found is not None:
            path, saved_at = found
            with state.rewriting():
                restore_checkpoint(trainer, path)
            event = r.rolled_back_to_disk(module, optimizers, step, path, saved_at, skip=not end)
            said = f"rollback from disk {r.disk_rollbacks}/{r.max_disk_rollbacks}"
            kept = state.tracked(persistent=False)
            if kept:  # no checkpoint holds them
                rank_zero_warn(
                    f"TrainingHealthMonitor: the buffer(s) {', '.join(kept)} that the forward changes are registered "
                    f"with persistent=False, so {path} does not hold them: the rollback leaves them as they were. "
                    "Fix: register them with persistent=True to have checkpoints (and this rollback) keep them."
                )
        elif r.memory_rollbacks < r.max_rollbacks and r.snapshot is not None:
            # the good snapshot; or, when it is the resumed state (not known older than the damage) and no
            # checkpoint is, the best there is
            with state.rewriting():
                event = r.roll_back(module, optimizers, step, skip=not end)
            said = f"rollback {r.memory_rollbacks}/{r.max_rollbacks}"
        else:
            raise r.diverged(step, why_not)
        self._spiked = False  # the next step is scored on the restored weights
        if ledger.health is not None:  # the verdict stays the last scored step's, its rollback done
            ledger.health = replace(ledger.health, rollback_pending=False)
        self.record_event(ledger, event)
        rank_zero_warn(f"TrainingHealthMonitor: {said}: {event['detail']}.")
        # the checkpoints saved after the newest clean state hold the damage: off the healthy list
        for ring in rings:
            dropped = ring.discard_newer_than(trainer, newest_clean_step(step) + 1)
            if dropped:
                rank_zero_info(
                    f"TrainingHealthMonitor: {', '.join(map(str, dropped))} hold(s) the state this rollback undid: "
                    "taken off the healthy list (ckpt_path='last' and later rollbacks skip it; the file stays)."
                )

    def _checkpoint_before_damage(
        self, trainer: pl.Trainer, rings: list[CheckpointRing], step: int
    ) -> tuple[tuple[Path, int] | None, str]:
        """The newest healthy checkpoint saved before the damage and not rolled back to already, as ``(path,
        global step)``, chosen by rank 0 and broadcast; else ``None`` and why not, for the error.

        Rank 0 takes the first that verifies, by the ``newest_verified`` that serves ``ckpt_path="last"``:
        complete, every file's checksum as written, and holding the name and step its list entry gives (not
        replaced whole by another checkpoint). One that fails is skipped with a warning naming it and what
        differs."""
        r = self.rollback
        if not rings:
            return None, (
                "none from disk: no StableCheckpoint is attached (add StableCheckpoint(dirpath=..., "
                "every_n_train_steps=...) to the callbacks to go back to a healthy checkpoint instead of stopping)"
            )
        if r.disk_rollbacks >= r.max_disk_rollbacks:
            return None, f"{r.disk_rollbacks} from disk (max_disk_rollbacks={r.max_disk_rollbacks})"
        newest = newest_clean_step(step) + 1  # the global step of a save of the newest clean state
        found: tuple[str, int] | None = None
        if trainer.is_global_zero:

            def passed_over(path: Path, saved_at: int, err: Exception) -> None:
                incidents.record(
                    trainer, "damaged_checkpoint", "passed over by a rollback to disk", detail=str(err), step=saved_at
                )
                rank_zero_warn(
                    f"TrainingHealthMonitor: skipping a damaged checkpoint for the rollback: {err} (the next older "
                    "one is tried)"
                )

            candidates = sorted(
                {(p, s) for ring in rings for p, s in ring.healthy_checkpoints(newest) if s not in r.disk_steps},
                key=lambda c: (c[1], str(c[0])),
                reverse=True,
            )
            verified = newest_verified(candidates, passed_over)
            found = None if verified is None else (str(verified.read), verified.step)
        found = trainer.strategy.broadcast(found)  # every rank loads the same one
        if found is None:
            return None, (
                f"none from disk: no healthy checkpoint saved at or before global step {newest} (before the damage) "
                f"that was not rolled back to already{f' (steps {r.disk_steps})' if r.disk_steps else ''}; "
                "StableCheckpoint(every_n_train_steps=...) saves more often, keep=... keeps more"
            )
        return (Path(found[0]), int(found[1])), ""

    # ------------------------------------------------------------------ logging steps
    def _on_logging_step(self, ledger: StepLedger) -> None:
        device = ledger.record_of().device
        memory = peak_memory_over_ranks(device)
        self._sent_memory = self.record_metric("stability/memory_peak_gb", memory[0])
        if device.type == "cuda":
            self.record_metric("stability/memory_reserved_gb", memory[1])
        self._interval.reset()  # its value for this interval was logged in on_step

    def on_host(self, trainer: pl.Trainer, record: OptimizerRecord) -> dict[str, float]:
        return self._log.read(self._sent.pop(record.index, HealthSent(None, None, None)))

    # ------------------------------------------------------------------ end of fit, checkpoints
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # HOST SYNC (once): the steps after the last logging step get the same scan, and a rollback decided at
        # the last step restores the last good snapshot (there is no data left to skip)
        self._log.take_rows(self.history.pending_on_host(), {})
        ledger = StepLedger.of(trainer)
        if self.response == "rollback" and self._damaged.read():
            self._roll_back(ledger, ledger.step_label, end=True)
        # the counter as it ends, also when the last rollback came after the last step that recorded it
        self.record_metric("stability/rollbacks", float(self.rollback.rollbacks), to_loggers=False)
        if self.report and trainer.is_global_zero:
            self.write_report(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A fit that ends in an exception (a ``TrainingDivergedError``, a crash in the step, Ctrl-C) still leaves
        its report, with ``meta.ended`` naming the exception; a failure to write it is a warning, and the
        exception goes on as it was."""
        if not (self.report and trainer.is_global_zero and self._trainer is trainer):
            return
        try:
            # HOST SYNC (once): the rows recorded since the last logging step
            self._log.take_rows(self.history.pending_on_host(), {})
        except Exception as err:  # the device may be what failed: keep what reached the host
            rank_zero_warn(f"stability report: the last steps' rows were lost ({type(err).__name__}: {err})")
        try:
            self.write_report(trainer, ended=f"{type(exception).__name__}: {exception}")
        except Exception as err:
            rank_zero_warn(f"stability report not written after the {type(exception).__name__}: {err}")

    def write_report(
        self, trainer: pl.Trainer | None = None, out_dir: str | Path | None = None, ended: str = "normally"
    ) -> tuple[Path, Path | None]:
        """Write ``stability_report.json`` (and ``.png`` with matplotlib), and send them to the Trainer's loggers
        that take images or files (TensorBoard, W&B, MLflow: see ``health/report_loggers.py``); returns the paths.
        ``ended``: how the fit ended, kept as ``meta.ended``."""
        trainer = trainer or self._trainer
        directory = out_dir or self.report_dir
        if directory is None and trainer is not None:
            directory = (
                trainer.logger.log_dir if trainer.logger is not None and trainer.logger.log_dir else None
            ) or trainer.default_root_dir
        meta = {
            "response": self.response,
            "skip_on": self.skip_on,
            "spike_z": self.spike_z,
            "clip_z": self.clip_z,
            "ended": ended,
        }
        counts = {"rollbacks": self.rollback.rollbacks, "disk_rollbacks": self.rollback.disk_rollbacks}
        logged = incidents.log_directory(trainer) if trainer is not None else None
        found = [asdict(i) for i in incidents.read_incidents(logged)] if logged is not None and logged.is_dir() else []
        json_path, png_path = self._log.write_report(directory or ".", {**meta, **counts}, found)
        if trainer is not None:
            send_report(trainer.loggers, json_path, png_path, trainer.global_step)
        return json_path, png_path

    def state_dict(self) -> dict[str, Any]:
        return {
            "stats": self.stats.state_dict(),
            "history": self.history.state_dict(),
            "events": list(self.events),
            "events_dropped": self._log.events_dropped,
            "rollback": self.rollback.state_dict(),
            # syncs, checkpoints only: a rollback decided and not yet done, and the last step's spike flag
            "pending_rollback": self._damaged.peek(),
            "last_spike": bool(self._spiked),
            "interval": self._interval.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.stats.load_state_dict(state_dict.get("stats", {}))
        self.history.load_state_dict(state_dict.get("history", {}))
        self._log.load_events(state_dict.get("events", []), state_dict.get("events_dropped", 0))
        self.rollback.load_state_dict(state_dict.get("rollback", {}))
        self._damaged.load(bool(state_dict.get("pending_rollback", False)))
        self._spiked = bool(state_dict.get("last_spike", False))
        self._interval.load_state_dict(state_dict.get("interval", {}))

    def transient_state(self) -> dict[str, Any]:
        return {
            "_trainer": None,
            "_spiked": bool(self._spiked) if not isinstance(self._spiked, Tensor) else False,
            "_module_index": None,
            "_const": None,
            "_row": None,
            "_measured": False,
            "_grads": None,
            "_sent_memory": None,
            "_sent": {},
            "_scored_of": None,
        }


def check_health_arguments(
    response: Any,
    spike_z: Any,
    clip_z: Any,
    alpha: Any,
    warmup_steps: Any,
    snapshot_every: Any,
    skip_batches: Any,
    max_rollbacks: Any,
    memory_warn_fraction: Any,
    top_modules: Any,
    max_disk_rollbacks: Any,
) -> None:
    """Raise ``StabilityConfigError`` for the first bad argument."""
    if response not in RESPONSES:
        raise config_error("response", response, "is not a response", f"pass one of {', '.join(RESPONSES)}")
    for name, value in (("spike_z", spike_z), ("clip_z", clip_z)):
        check_number(name, value, 0.0, example="6.0 (spikes) or 2.5 (clip)", high_inclusive=True)
    check_number("alpha", alpha, 0.0, 1.0, example="0.97 (ZClip's default)")
    check_int("warmup_steps", warmup_steps, 1, "25")
    if snapshot_every is not None:
        check_int("snapshot_every", snapshot_every, 1, "20, or None to scale it to the run")
    if warmup_steps < 2:
        # one value has no spread: every later value would score as a spike, and "skip" would skip them all
        raise config_error(
            "warmup_steps", warmup_steps, "must be >= 2 (a standard deviation needs two values)", "pass e.g. 25"
        )
    if skip_batches is not None:
        check_int("skip_batches", skip_batches, 0, "5, or None to scale it to the run")
    for name, value in (("max_rollbacks", max_rollbacks), ("top_modules", top_modules)):
        check_int(name, value, 0, "3 or 5")
    check_int("max_disk_rollbacks", max_disk_rollbacks, 0, "1, or 0 to stop instead of loading a checkpoint")
    check_number("memory_warn_fraction", memory_warn_fraction, 0.0, 1.0, example="0.9", high_inclusive=True)


def check_skip_on(skip_on: Any, response: Any) -> None:
    """Raise ``StabilityConfigError`` for a bad ``skip_on``, or ``"loss"`` with a response other than ``"skip"``.

    ``"loss"`` chooses what ``"skip"`` skips. ``"warn"`` and ``"clip"`` skip no spike, so it would change nothing
    there; ``"rollback"`` tells damage in the weights from a bad batch by a spike on the step after a skipped one,
    the gradient norm's included, and skipping fewer steps would let a gradient-norm spike's update in before that
    test (a rule not measured in ``benchmarks/rollback_defaults.py``)."""
    if skip_on not in ("any", "loss"):
        raise config_error("skip_on", skip_on, "is not a choice", "pass 'any' (loss or gradient-norm spikes) or 'loss'")
    if skip_on == "loss" and response != "skip":
        raise config_error(
            "skip_on",
            skip_on,
            f"chooses what response='skip' skips; response={response!r} takes 'any' only",
            "pass response='skip' with skip_on='loss', or leave skip_on='any'",
        )


def _total_steps(trainer: pl.Trainer) -> int | None:
    """The run's optimizer steps, when known: Lightning's estimate (``max_steps``, or epochs of a sized loader)."""
    try:
        total = float(trainer.estimated_stepping_batches)
    except Exception:  # a loader without a length and no max_steps: Lightning cannot tell
        total = math.inf
    if not math.isfinite(total) and trainer.max_steps > 0:
        total = float(trainer.max_steps)
    return int(total) if math.isfinite(total) and total > 0 else None


def record_incidents(
    trainer: pl.Trainer, events: list[dict[str, Any]], replayed: set[Any], resumed_at: int = 0
) -> None:
    """The monitor's new events in the incident log (host only: the events come from rows read on logging steps,
    rollbacks and replays as they happen). Left out: the fp16 scaler's own overflow skips (its normal dynamics),
    new levels, the data skipped after a rollback (the rollback's incident says it) and the skip of a step
    ``StepReplay`` replayed (its incident says it). An event of a step before ``resumed_at`` (a row the checkpoint
    held unread) is left out too when the log holds it: the run that saved the checkpoint may have read that row and
    recorded it before it was killed."""
    for event in events:
        kind, step, detail = event.get("kind"), int(event.get("step", -1)), str(event.get("detail", ""))
        if kind == "skip" and (event.get("outcome") == outcome_name(1) or event.get("step") in replayed):
            continue
        if kind in ("new_level", "data_skip"):
            continue
        again = step < resumed_at
        if kind in ("spike", "clip"):
            action = str(event.get("outcome") or kind)
            incidents.record(trainer, "spike", action, detail=detail, step=step, unless_logged=again)
        elif kind == "skip":
            lost = "this step's update"
            incidents.record(trainer, "skip", "update skipped", lost, detail, step, unless_logged=again)
        elif kind == "rollback":
            to_step = int(event.get("to_step", step))
            incidents.record(
                trainer,
                "rollback",
                f"rolled back to the state after step {to_step}",
                lost=f"the updates of steps {to_step + 1}-{step} and the batches skipped after it",
                detail=detail,
                step=step,
                unless_logged=again,
            )
        elif kind == "replay":  # StepReplay's verdict (every rank alike)
            cause, quarantined = str(event.get("cause")), int(event.get("quarantined", 0))
            applied = cause == "transient" or "dropped_micro_batches" in event
            incidents.record(
                trainer,
                "replay",
                f"replayed ({event.get('runs')} runs): {cause}; " + ("applied" if applied else "skipped"),
                lost="" if cause == "transient" else "this step's update" if not applied else "bad micro-batches",
                detail=detail,
                step=step,
                unless_logged=again,
            )
            if quarantined:
                incidents.record(
                    trainer,
                    "quarantine",
                    f"{quarantined} sample(s) quarantined",
                    lost=f"{quarantined} sample(s), for the rest of the run",
                    detail="read them with lightning-stability quarantine or read_quarantine",
                    step=step,
                    unless_logged=again,
                )
