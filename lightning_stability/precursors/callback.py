"""PrecursorMonitor: what comes before a loss spike, logged as ``stability/...`` metrics, and opt-in early actions.

It measures; the step acts (``lightning_stability/ledger/step.py``). Precursors (each on logging steps, in the
step's one device-to-host transfer; nothing is computed on other steps unless an action needs it, and nothing is
read on the host there):

* ``stability/attention_logit_max`` and ``stability/attention_logit_max_by_module/<module>``: the largest
  pre-softmax attention logit of the step, over all heads, and per attention module
  (:class:`~lightning_stability.precursors.attention.AttentionLogits`);
* ``stability/log_z`` and ``stability/log_z_drift``: the LM head's mean log-sum-exp and its drift from an EMA of
  the measured values (:class:`~lightning_stability.precursors.logits.LogPartition`);
* ``stability/update_ratio``: the update's norm over the weights' norm, all tensors together, and
  ``stability/update_rms_max``: the largest RMS of a tensor's update, both measured across the update for any
  optimizer (the step's ``UpdateSize``; the ratio's key is the step's, recorded by the ledger for every callback
  that measured the update);
* ``stability/adam_eps_share``: with ``torch.optim.Adam``/``AdamW``, the share of coordinates (over every tensor)
  where Adam's epsilon dominates the denominator (:func:`~lightning_stability.precursors.adam.adam_eps_share`).

Early actions (off by default; each runs on the device, without a host sync):

* ``lr_backoff=LRBackoff(...)``: while a precursor stays past its threshold, each measured applied update multiplies
  the update's factor by ``factor`` (to ``floor`` at least); once it is back under, it recovers by ``recovery`` per
  applied update, never past 1. The factor goes on the step's update scale
  (``StepLedger.scale_update``): each param group's LR times the factor for that update, so every optimizer that
  reads ``group["lr"]`` applies its own update, scaled. An LR schedule goes on as it is. The factor moves on what
  earlier updates showed.
* ``qk_clip=100.0``: Kimi K2's QK-clip right after the update (:func:`~.actions.apply_qk_clip_`, ``alpha`` 0.5):
  each head whose largest logit of the step passed ``tau`` has its query and key projections scaled so that it
  falls back to ``tau``. The logits are max-reduced over ranks first, so every rank scales alike.
* ``update_clip=1.0``: StableAdamW's per-tensor update clipping (:func:`~.actions.update_clip_coefficients`,
  ``d = 1``) on top of ``torch.optim.Adam``/``AdamW``: right after the update, each tensor keeps ``c`` of its Adam
  step, from the step's copy of the weights before it (decoupled decay at the full LR).
* ``reset_moments=True``: when ``TrainingHealthMonitor`` calls the step a spike and its update was applied anyway
  (``response="warn"`` or ``"clip"``, or under ``"skip"`` with ``skip_on="loss"`` a gradient-norm spike alone), the
  Adam moments of the tensors whose gradient RMS was more than ``reset_ratio`` times the RMS Adam expected
  (``sqrt(v_hat)``) are zeroed, the step counts left alone (SPAM; :func:`~.actions.reset_moments_`). A skipped
  spike's gradient never reaches the moments.

QK-clip, the update clipping and the moment reset are edits right after the update (row 11 of the step table).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import Shard
from torch.optim import Optimizer

from lightning_stability import _compat, ranks
from lightning_stability.errors import StabilityConfigError, check_bool, check_int, check_number, config_error
from lightning_stability.ledger import LedgerCallback, OnHost, OptimizerRecord, OptimizerStep, Stage, StepLedger
from lightning_stability.ledger.track import applied_flag
from lightning_stability.ledger.update import UpdateSize
from lightning_stability.norms import is_dtensor, per_tensor_norms
from lightning_stability.precursors.actions import (
    QK_CLIP_ALPHA,
    QKProjection,
    apply_qk_clip_,
    clip_updates_,
    qk_projection,
    reset_moments_,
    update_clip_coefficients,
)
from lightning_stability.precursors.adam import adam_eps_share, is_adam
from lightning_stability.precursors.attention import AttentionLogits, attention_modules
from lightning_stability.precursors.logits import LogPartition, find_head

Signal = Literal["update_ratio", "attention_logit", "log_z_drift", "update_rms_jump"]
SIGNALS: tuple[str, ...] = ("update_ratio", "attention_logit", "log_z_drift", "update_rms_jump")


@dataclass(frozen=True)
class LRBackoff:
    """The LR back-off of :class:`PrecursorMonitor`: which precursor, its threshold, how fast down and back up.

    Attributes:
        signal: ``"update_ratio"``: the applied update's norm over the weights' norm, all tensors together (any
            optimizer); ``"attention_logit"``: the step's largest attention logit; ``"log_z_drift"``: ``|log Z -
            EMA|`` of the LM head; ``"update_rms_jump"``: the update's norm over its EMA (Marin saw it double
            before spikes).
        threshold: past it, the update backs off (``update_ratio`` 0.02; for the others e.g. 100, 1.0, 2.0).
        factor: the multiplier per measured applied update while past the threshold (0.5).
        recovery: the multiplier per applied update once back under it, never past 1 (1.02: from 0.5 back to 1 in
            35).
        floor: the smallest multiplier (0.01).
        efficiency: with ``update_ratio``, the run's own baseline: back off only while, besides, the update per unit
            of LR (``update_ratio`` over the LR applied) has fallen below this share of the largest it has been in
            the run (``stability/update_efficiency`` logs the share; 0.3). A healthy run keeps about a third or more
            of its first updates' size per unit of LR; at an LR too large for the model the gradients turn against
            the last ones, Adam's moving average cancels them and the weights grow, and the share falls to about
            0.1-0.25 within a few dozen updates (``docs/concepts/spike-precursors.md``). ``None``: the threshold
            alone. The share is meant for optimizers whose update is normalized (Adam and its kin, Adafactor,
            Lion); with SGD it follows the gradient's norm, so pass ``None`` there or expect the back-off to act
            less.
        ceiling: with ``efficiency``, an ``update_ratio`` past which the update backs off whatever the share
            (0.03; at least ``threshold``): the first updates at an LR far too large change the weights by several
            percent each, before the share has fallen. ``None``: the share decides alone.
        every: the update signals (``update_ratio``, ``update_rms_jump``) are measured on every ``every``-th
            optimizer step (and on logging steps): each costs a transient copy of the weights. The others every
            step.
    """

    signal: Signal = "update_ratio"
    threshold: float = 0.02
    factor: float = 0.5
    recovery: float = 1.02
    floor: float = 0.01
    every: int = 4
    efficiency: float | None = 0.3
    ceiling: float | None = 0.03

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise config_error("signal", self.signal, "is not a precursor", f"pass one of {', '.join(SIGNALS)}")
        check_number("threshold", self.threshold, example="0.02")
        check_number("factor", self.factor, example="0.5")
        check_number("floor", self.floor, example="0.01")
        check_number("recovery", self.recovery, example="1.02")
        if not self.floor <= self.factor < 1:
            raise config_error("factor", self.factor, f"must be in [floor={self.floor}, 1)", "pass factor=0.5")
        if self.recovery <= 1:
            raise config_error("recovery", self.recovery, "must be > 1 (else it never recovers)", "pass recovery=1.02")
        if self.floor > 1:
            raise config_error("floor", self.floor, "must be <= 1", "pass floor=0.01")
        check_int("every", self.every, 1, "4")
        if self.efficiency is not None:
            check_number("efficiency", self.efficiency, example="0.3 (or None: the threshold alone)")
            if self.signal != "update_ratio" or not 0 < self.efficiency < 1:
                raise config_error(
                    "efficiency",
                    self.efficiency,
                    f"must be in (0, 1) and goes with signal='update_ratio' (signal={self.signal!r})",
                    "pass efficiency=0.3 with 'update_ratio', or efficiency=None",
                )
        if self.ceiling is not None:
            check_number("ceiling", self.ceiling, example="0.03 (or None)")

    @property
    def measures_update(self) -> bool:
        return self.signal in ("update_ratio", "update_rms_jump")


class PrecursorMonitor(LedgerCallback):
    """Logs the precursors of a loss spike on logging steps and, opt-in, acts on them early (see the module doc).

    Args:
        attention: measure the largest attention logit (``None``: where the model has an attention module
            :class:`~.attention.AttentionLogits` knows; ``True``: required; ``False``: off).
        log_partition: the LM head's module name; ``None``: the first of ``lm_head``, ``head``, ``output``, ...
            found (none: not measured); ``False``: off.
        qk_clip: QK-clip's ``tau`` (Kimi K2: 100.0), or ``None``: off.
        qk_clip_alpha: the share of the clip on the queries (K2: 0.5).
        update_clip: StableAdamW's threshold ``d`` on each tensor's update RMS (1.0), or ``None``: off.
        lr_backoff: an :class:`LRBackoff`, or ``None``: off.
        reset_moments: zero the moments of the tensors a spike hit (see the module doc).
        reset_ratio: how far above Adam's expected RMS a tensor's gradient RMS must be to count as hit (10).
        other_optimizers: with an optimizer an action cannot act on (``update_clip`` and ``reset_moments`` need
            ``torch.optim.Adam``/``AdamW`` or a subclass, ``update_clip`` without ``amsgrad``; the back-off needs an
            optimizer whose update follows ``lr``, so not ``Rprop``): ``"error"`` (at fit start), or ``"warn"``:
            that action is off for the fit, in one line, the precursors still logged (what a preset uses, not
            knowing the model's optimizer).
        log_every_n_steps: default: the Trainer's.

    Raises:
        StabilityConfigError: for a bad argument; at setup, for an action the model or optimizer cannot take
            (QK-clip without a known attention module, an action with an optimizer it cannot act on).

    Example::

        trainer = L.Trainer(callbacks=[PrecursorMonitor(qk_clip=100.0, lr_backoff=LRBackoff())])
    """

    one_instance_reason = "each would act on the same updates and attention weights"

    def __init__(
        self,
        attention: bool | None = None,
        log_partition: str | bool | None = None,
        qk_clip: float | None = None,
        qk_clip_alpha: float = QK_CLIP_ALPHA,
        update_clip: float | None = None,
        lr_backoff: LRBackoff | None = None,
        reset_moments: bool = False,
        reset_ratio: float = 10.0,
        other_optimizers: Literal["error", "warn"] = "error",
        log_every_n_steps: int | None = None,
    ) -> None:
        super().__init__(log_every_n_steps)
        if attention is not None:
            check_bool("attention", attention)
        if log_partition is True:
            log_partition = None
        if log_partition is not None and log_partition is not False and not isinstance(log_partition, str):
            raise config_error(
                "log_partition", log_partition, "is not a module name", "pass e.g. 'lm_head', None or False"
            )
        if qk_clip is not None:
            check_number("qk_clip", qk_clip, example="100.0 (Kimi K2's tau)")
        if (
            isinstance(qk_clip_alpha, bool)
            or not isinstance(qk_clip_alpha, (int, float))
            or not 0 <= qk_clip_alpha <= 1
        ):
            raise config_error("qk_clip_alpha", qk_clip_alpha, "must be in [0, 1]", "pass 0.5 (Kimi K2's)")
        if update_clip is not None:
            check_number("update_clip", update_clip, example="1.0 (StableAdamW's)")
        if lr_backoff is not None and not isinstance(lr_backoff, LRBackoff):
            raise config_error("lr_backoff", lr_backoff, "is not an LRBackoff", "pass LRBackoff() or None")
        check_bool("reset_moments", reset_moments)
        check_number("reset_ratio", reset_ratio, example="10.0")
        if other_optimizers not in ("error", "warn"):
            raise config_error("other_optimizers", other_optimizers, "is not a choice", "pass 'error' or 'warn'")
        self.other_optimizers = other_optimizers
        self._adam_actions = False  # the Adam actions (update clipping, moment reset) act in this fit (fit start)
        self._backoff_on = False  # the back-off acts in this fit (fit start)
        self.attention, self.log_partition = attention, log_partition
        self.qk_clip, self.qk_clip_alpha = qk_clip, float(qk_clip_alpha)
        self.update_clip, self.lr_backoff = update_clip, lr_backoff
        self.reset_moments, self.reset_ratio = reset_moments, float(reset_ratio)
        #: the back-off multiplier (a device tensor once training; a float in checkpoints)
        self.backoff: Tensor | float = 1.0
        #: heads QK-clip scaled, and tensors whose moments were reset, since the start
        self.clipped_heads: Tensor | float = 0.0
        self.moment_resets: Tensor | float = 0.0
        self._logits: AttentionLogits | None = None
        self._projections: dict[str, QKProjection] = {}
        self._log_z: LogPartition | None = None
        self._log_z_state: dict[str, Any] = {}
        self._rms_ema: Tensor | float | None = None
        #: the largest update per unit of LR of the run (``update_ratio / lr``), the efficiency's baseline
        self._peak_per_lr: Tensor | float | None = None
        self._open: _OpenStep | None = None
        self._fresh = True  # the next batch starts an optimizer step
        self._told = False  # the back-off's warning was given in this fit
        self._backoff_sent: OnHost | None = None
        self._reads = False  # this step's figures are recorded: it logs, or Lightning reads callback_metrics after it
        self._root_numel: tuple[tuple[int, ...], Tensor] | None = None

    def state_fields(self) -> dict[str, Any]:
        return {
            "qk_clip": self.qk_clip,
            "update_clip": self.update_clip,
            "lr_backoff": None if self.lr_backoff is None else asdict(self.lr_backoff),
            "reset_moments": self.reset_moments,
        }

    # ------------------------------------------------------------------ setup
    def on_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        backoff = self.lr_backoff.signal if self.lr_backoff is not None else None
        needs_attention = self.qk_clip is not None or backoff == "attention_logit"
        if self.attention is False and needs_attention:
            raise config_error(
                "attention", False, "turns off what QK-clip or the attention back-off need", "leave attention=None"
            )
        known = dict(attention_modules(pl_module))
        if self.attention is not False and (known or self.attention or needs_attention):
            self._logits = AttentionLogits(pl_module)  # raises when none is known
        if self.qk_clip is not None:
            assert self._logits is not None
            for module in self._logits.modules.values():
                qk_projection(module)  # refuses a module it cannot rescale, before the strategy wraps anything
        if self.log_partition is not False:
            if self.log_partition is None and backoff != "log_z_drift":
                try:
                    find_head(pl_module)
                except StabilityConfigError:
                    self.log_partition = False  # no LM head by the usual names: not measured
            if self.log_partition is not False:
                self._log_z = LogPartition(pl_module, self.log_partition or None)
                if self._log_z_state:
                    self._log_z.load_state_dict(self._log_z_state)
        elif backoff == "log_z_drift":
            raise config_error("log_partition", False, "turns off the back-off's signal", "leave log_partition=None")
        self._set_active(False)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        split = _tensor_parallel(pl_module)
        if split is not None:
            self._under_tensor_parallel(split)
        if self.qk_clip is not None and self._logits is not None:
            # after the strategy's wrapping: FSDP2 replaces the parameters with sharded ones
            self._projections = {name: qk_projection(m) for name, m in self._logits.modules.items()}
        self._adam_actions = self.update_clip is not None or self.reset_moments
        self._backoff_on = self.lr_backoff is not None
        if len(trainer.optimizers) > 1 and (self._adam_actions or self._backoff_on or self.qk_clip is not None):
            # one back-off factor and one QK-clip per step of the module: with several optimizers each would act
            # once per optimizer step (QK-clip twice on the same maxima), not once per update of the module
            raise StabilityConfigError(
                f"PrecursorMonitor's early actions (qk_clip, update_clip, lr_backoff, reset_moments) act once per "
                f"update of the whole module; this module has {len(trainer.optimizers)} optimizers. Fix: leave the "
                "actions off for this fit (PrecursorMonitor() still logs the precursors per optimizer; in a preset, "
                "lr_backoff=None removes it), or train with one optimizer."
            )
        for optimizer in trainer.optimizers:
            name = type(optimizer).__name__
            if self._adam_actions:
                why = ""
                if not is_adam(optimizer):
                    why = f"the optimizer is {name}, not torch.optim.Adam or AdamW"
                elif self.update_clip is not None and any(g.get("amsgrad", False) for g in optimizer.param_groups):
                    why = "the optimizer uses amsgrad=True (its denominator is a running max)"
                if why:
                    self._adam_actions = self._refuse_or_warn(
                        "update clipping and moment reset act on Adam's moments", why, "update_clip, reset_moments"
                    )
            if self._backoff_on and isinstance(optimizer, torch.optim.Rprop):
                self._backoff_on = self._refuse_or_warn(
                    "LR back-off scales the update through the LR",
                    "Rprop reads its LR only once, as its first step sizes",
                    "lr_backoff",
                )
        ledger = StepLedger.of(trainer)
        ledger.at(Stage.OPEN, "PrecursorMonitor.lr_backoff", self._scale_by_backoff if self._backoff_on else None)
        ledger.at(Stage.ENFORCE, "PrecursorMonitor", self._read_gradients)
        ledger.at(Stage.AFTER_UPDATE, "PrecursorMonitor", self._edit)

    def _scale_by_backoff(self, ledger: StepLedger) -> None:
        """As each step opens (before ``StepReplay``'s early read, which then carries it): the back-off's factor on
        the update (row 3 of the step table)."""
        trainer = ledger.trainer
        if trainer is not None:
            ledger.scale_update("lr_backoff", self._backoff_tensor(self._device(trainer)))

    def _refuse_or_warn(self, what: str, why: str, arguments: str) -> bool:
        """Refuse (``other_optimizers="error"``) or warn once and turn the action off (returns ``False``)."""
        if self.other_optimizers == "warn":
            rank_zero_warn(f"PrecursorMonitor: the {what}: {why}, so it is off for this fit ({arguments}).")
            return False
        raise StabilityConfigError(
            f"PrecursorMonitor's {what}; {why}. Fix: use torch.optim.Adam or AdamW, leave {arguments} off, or pass "
            "other_optimizers='warn' to turn it off for such a fit."
        )

    def _under_tensor_parallel(self, split: str) -> None:
        """Under tensor parallelism: the Adam figures and the back-off on them (the optimizer's state is sharded
        like any DTensor: its norms are reduced over the mesh) only. A rank's attention module holds some heads
        and its LM head some of the vocabulary, and some gradients are partial sums: what reads those is refused
        when asked for, and not measured otherwise."""
        signal = self.lr_backoff.signal if self.lr_backoff is not None else None
        asked = [
            name
            for name, on in (
                ("qk_clip", self.qk_clip is not None),
                ("update_clip", self.update_clip is not None),
                ("reset_moments", self.reset_moments),
                ("attention=True", self.attention is True),
                (f"log_partition={self.log_partition!r}", isinstance(self.log_partition, str)),
                (f"LRBackoff({signal!r})", signal in ("attention_logit", "log_z_drift")),
            )
            if on
        ]
        if asked:
            raise StabilityConfigError(
                f"PrecursorMonitor({', '.join(asked)}) cannot run under tensor parallelism ({split}): a rank holds "
                "some attention heads, some of the vocabulary and partial gradients, which these do not follow "
                "yet. Under tensor parallelism it logs the Adam figures and backs off on them: leave these off "
                "(LRBackoff('update_ratio') or 'update_rms_jump'), or run this fit without tensor parallelism."
            )
        if self._logits is not None or self._log_z is not None:
            rank_zero_info(
                "PrecursorMonitor: under tensor parallelism the attention logits and the LM head's log Z are not "
                "measured (a rank holds some heads and some of the vocabulary); the Adam figures are."
            )
        self._remove_hooks()
        self._log_z_state = {}

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        if self._logits is not None:
            self._logits.remove()
            self._logits = None
        if self._log_z is not None:
            self._log_z_state = self._log_z.state_dict()
            self._log_z.remove()
            self._log_z = None

    def _set_active(self, logging: bool) -> None:
        signal = self.lr_backoff.signal if self.lr_backoff is not None else None
        if self._logits is not None:
            self._logits.active = logging or self.qk_clip is not None or signal == "attention_logit"
        if self._log_z is not None:
            self._log_z.active = logging or signal == "log_z_drift"

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        # the first micro-batch of an optimizer step: forget the last step's maxima, measure if this step logs or
        # ends where Lightning reads callback_metrics
        read = _compat.reads_callback_metrics_after(trainer, batch_idx)
        if self._fresh:
            self._fresh = False
            if self._logits is not None:
                self._logits.reset()
            self._reads = read or StepLedger.of(trainer).is_logging_step(self._every_n)
            self._set_active(self._reads)
        elif read and not self._reads:
            self._reads = True
            self._set_active(True)

    # ------------------------------------------------------------------ the step
    def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: Optimizer) -> None:
        """Before the update: whether the update is measured (when a signal or a figure needs it) and whether the
        back-off moves on it. The gradients the Adam actions read are read at row 8 (:meth:`_read_gradients`), after
        every clip; the edits run at row 11 (:meth:`_edit`)."""
        step = ledger.step
        config = self.lr_backoff
        tick = (
            self._backoff_on
            and config is not None
            and (not config.measures_update or ledger.record_of().steps % config.every == 0)
        )
        clipping = self._adam_actions and self.update_clip is not None
        measured = (
            self._reads or self.is_logging_step or clipping or (tick and config is not None and config.measures_update)
        ) and step.measure_update(log=self.is_logging_step) is not None
        self._open = _OpenStep(optimizer, measured, tick)

    def _read_gradients(self, ledger: StepLedger) -> None:
        """Row 8 of the step table, right before the update: the update-clip coefficients and the tensors whose
        gradient spiked, from the gradients the update will use (after every clip, Lightning's too)."""
        open_step, trainer = self._open, ledger.trainer
        if open_step is None or trainer is None or not self._adam_actions:
            return
        optimizer = open_step.optimizer
        clipping = self.update_clip is not None
        device = self._device(trainer)
        params = [
            p
            for g in optimizer.param_groups
            for p in g["params"]
            if p.grad is not None and "exp_avg_sq" in optimizer.state.get(p, {})
        ]
        if params:
            open_step.params = params
            if clipping:
                open_step.clip_coef = self._clip_coefficients(optimizer, params, device)
            if self.reset_moments:
                open_step.hit = self._hit_tensors(optimizer, params, device)
            _agree_across_ranks(open_step)  # what each rank derived from its own gradients and state

    def _clip_coefficients(self, optimizer: Optimizer, params: list[Tensor], device: torch.device) -> Tensor:
        """StableAdamW's coefficient of each of ``params`` (``(n,)``), from its gradient and state before the step."""
        parts = []
        for group in optimizer.param_groups:
            mine = {id(p) for p in group["params"]}
            ps = [p for p in params if id(p) in mine]
            if ps:
                states = [optimizer.state[p] for p in ps]
                parts.append(
                    update_clip_coefficients(
                        [p.grad for p in ps if p.grad is not None],
                        [s["exp_avg_sq"] for s in states],
                        [s["step"] for s in states],
                        group["betas"][1],
                        group["eps"],
                        self.update_clip if self.update_clip is not None else 1.0,
                    ).to(device)
                )
        return torch.cat(parts)

    def _edit(self, ledger: StepLedger) -> None:
        """Right after the update (row 11): the update clipping, the moment reset, QK-clip."""
        open_step, step, outcome = self._open, ledger.step, ledger.outcome
        if open_step is None:
            return
        optimizer = step.optimizer
        applied = applied_flag(outcome, step.device)
        if open_step.clip_coef is not None and step.update is not None:
            self._clip_update(step, step.update, open_step.params, torch.where(applied, open_step.clip_coef, 1.0))
        health = self._ledger.health if self._ledger is not None else None
        if self.reset_moments and open_step.hit is not None and health is not None:
            hit = open_step.hit & health.spike.to(open_step.hit.device) & applied
            reset_moments_(optimizer, open_step.params, hit)
            self.moment_resets = hit.sum().float() + self.moment_resets
        maxima = open_step.maxima = self._attention_maxima()
        if self.qk_clip is not None and maxima:
            clipped = []
            for name, projection in self._projections.items():
                if name in maxima:
                    eta = apply_qk_clip_(projection, maxima[name], self.qk_clip, self.qk_clip_alpha)
                    clipped.append((eta < 1).sum())
            if clipped:
                self.clipped_heads = torch.stack(clipped).sum().float() + self.clipped_heads

    def _clip_update(self, step: OptimizerStep, size: UpdateSize, params: list[Tensor], coef: Tensor) -> None:
        """Each of ``params`` keeps ``coef`` of its Adam step, from the copy taken before it; decoupled decay (AdamW)
        stays at the full LR, as in StableAdamW's reference code."""
        optimizer = step.optimizer
        before = {id(p): b for p, b in zip(size.params, size.before, strict=True)}
        index = {id(p): i for i, p in enumerate(params)}
        decoupled = isinstance(optimizer, torch.optim.AdamW)
        for group, lr in zip(optimizer.param_groups, step.scale.used_lrs(optimizer), strict=True):
            mine = [p for p in group["params"] if id(p) in index and id(p) in before]
            if not mine:
                continue
            wd = group["weight_decay"] if decoupled or group.get("decoupled_weight_decay", False) else 0.0
            coefficients = torch.stack([coef[index[id(p)]] for p in mine])
            clip_updates_(mine, [before[id(p)] for p in mine], coefficients, lr, wd)

    def _backoff_tensor(self, device: torch.device) -> Tensor:
        backoff = self.backoff
        if not isinstance(backoff, Tensor):
            backoff = torch.full((), backoff, dtype=torch.float32, device=device)  # once (a fill, no copy)
        elif backoff.device != device:
            backoff = backoff.to(device)
        self.backoff = backoff
        return backoff

    def _roots(self, params: list[Tensor], device: torch.device) -> Tensor:
        """``(n,)``: each tensor's ``sqrt(numel)`` (RMS <-> norm), built once per set of tensors."""
        key = tuple(map(id, params))
        if self._root_numel is None or self._root_numel[0] != key:
            roots = [torch.full((), math.sqrt(p.numel()), device=device) for p in params]  # fills, no copies
            self._root_numel = (key, torch.stack(roots))
        return self._root_numel[1]

    def _hit_tensors(self, optimizer: Optimizer, params: list[Tensor], device: torch.device) -> Tensor:
        """Per tensor: its gradient RMS is more than ``reset_ratio`` times ``sqrt(v_hat)``'s RMS (before the step)."""
        roots = self._roots(params, device)
        grad_rms = per_tensor_norms([p.grad for p in params]) / roots  # type: ignore[misc]
        # mean(v) from its 1-norm (v >= 0), whole tensors also when sharded
        mean_v = per_tensor_norms([optimizer.state[p]["exp_avg_sq"] for p in params], 1.0) / roots.square()
        corrections = []
        for p in params:
            beta2 = next(g["betas"][1] for g in optimizer.param_groups if any(q is p for q in g["params"]))
            step = torch.as_tensor(optimizer.state[p]["step"], dtype=torch.float32)  # where torch keeps it: no copy
            corrections.append(1 - torch.pow(float(beta2), step))
        # divided tensor by tensor: a step count kept on the host is a scalar there, not a copy to the device
        v_hat = torch.stack(_compat.foreach_div(list(mean_v.unbind()), corrections))
        return grad_rms > self.reset_ratio * v_hat.sqrt()

    def after_step(self, trainer: pl.Trainer, ledger: StepLedger) -> None:
        """After the update and its edits: the signals, the back-off's next factor, the figures."""
        open_step, self._open, self._fresh = self._open, None, True
        reads, self._reads = self._reads or self.is_logging_step, False
        if open_step is None:
            return
        applied = applied_flag(ledger.outcome, self._device(trainer))
        size = ledger.step.update if open_step.measured else None
        maxima = open_step.maxima if open_step.maxima is not None else self._attention_maxima()
        log_z = self._log_z.end_step() if self._log_z is not None else None
        signals = self._signals(size, maxima, log_z, applied, open_step.tick)
        if "update_ratio" in signals and self._uses_efficiency:
            efficiency = self._efficiency(signals["update_ratio"], ledger.step.scale.lrs, applied, open_step.tick)
            if efficiency is not None:
                signals["update_efficiency"] = efficiency
        if self._backoff_on and open_step.tick and self.lr_backoff is not None:
            self._move_backoff(signals.get(self.lr_backoff.signal), applied, signals.get("update_efficiency"))
        if reads:  # into callback_metrics at once; to the loggers on logging steps only (no transfer otherwise)
            self._record(open_step, size, maxima, log_z)
            if "update_efficiency" in signals:
                self.record_metric("stability/update_efficiency", signals["update_efficiency"])

    def _device(self, trainer: pl.Trainer) -> torch.device:
        return trainer.lightning_module.device if trainer.lightning_module is not None else torch.device("cpu")

    def _attention_maxima(self) -> dict[str, Tensor]:
        """Each module's ``(heads,)`` maxima of the step, max-reduced over ranks (one all-reduce for all)."""
        if self._logits is None or not self._logits.maxima:
            return {}
        maxima = self._logits.maxima
        if ranks.world_size() > 1:
            names = list(maxima)
            flat = ranks.max_(torch.cat([maxima[n] for n in names]))
            sizes = [maxima[n].numel() for n in names]
            maxima = dict(zip(names, flat.split(sizes), strict=True))
        return maxima

    def _signals(
        self,
        size: UpdateSize | None,
        maxima: dict[str, Tensor],
        log_z: tuple[Tensor, Tensor] | None,
        applied: Tensor,
        tick: bool,
    ) -> dict[str, Tensor]:
        """The step's precursor values (device tensors), those measured; each alike on every rank."""
        out: dict[str, Tensor] = {}
        if maxima:
            out["attention_logit"] = torch.stack([m.amax() for m in maxima.values()]).amax()
        if log_z is not None:
            out["log_z_drift"] = log_z[1].abs()
        if size is not None and size.ratio is not None and size.update_norm is not None:
            out["update_ratio"] = size.ratio  # max-reduced over ranks by the step
            total = size.update_norm
            ema = self._rms_ema
            if isinstance(ema, Tensor) and ema.device != total.device:  # resumed: restored on the CPU
                ema = self._rms_ema = ema.to(total.device)
            out["update_rms_jump"] = total / (ema if isinstance(ema, Tensor) else total)
            if tick:  # on the back-off's clock, applied updates only
                if not isinstance(ema, Tensor):
                    self._rms_ema = total.detach().clone()
                else:
                    ema.copy_(torch.where(applied.to(ema.device), ema * 0.99 + 0.01 * total, ema))
        return out

    @property
    def _uses_efficiency(self) -> bool:
        return self._backoff_on and self.lr_backoff is not None and self.lr_backoff.efficiency is not None

    def _efficiency(self, ratio: Tensor, lrs: list[Any] | None, applied: Tensor, tick: bool) -> Tensor | None:
        """The update per unit of LR applied, as a share of the largest of the run (the peak moves on the
        back-off's clock, applied updates only). The LR is the first param group's that is not 0 (a frozen group
        at 0 is passed over; the groups' LRs keep their proportions under the package's schedules). ``None`` when
        every LR is 0 or unknown."""
        lr = next((x for x in lrs or [] if isinstance(x, Tensor) or x > 0), None)
        if lr is None:
            return None
        per_lr = ratio / (lr.to(ratio.device) if isinstance(lr, Tensor) else lr)
        peak = self._peak_per_lr
        if isinstance(peak, Tensor) and peak.device != per_lr.device:  # resumed: restored on the CPU
            peak = self._peak_per_lr = peak.to(per_lr.device)
        if tick:  # applied updates only; a non-finite one never moves the baseline
            base = peak if isinstance(peak, Tensor) else torch.zeros_like(per_lr)
            seen = torch.maximum(base, torch.where(torch.isfinite(per_lr), per_lr, 0.0))
            peak = self._peak_per_lr = torch.where(applied.to(seen.device), seen, base)
        if not isinstance(peak, Tensor):
            return None
        return per_lr / peak.clamp(min=torch.finfo(torch.float32).tiny)

    def _move_backoff(self, signal: Tensor | None, applied: Tensor, efficiency: Tensor | None = None) -> None:
        """One tick of the back-off, on applied updates only: down by ``factor`` past the threshold, else up by
        ``recovery`` per applied update since the last tick, never past 1."""
        config = self.lr_backoff
        if config is None or signal is None:
            return
        factor = self._backoff_tensor(signal.device)  # every signal is alike on every rank (see _signals)
        past = signal > config.threshold
        if config.efficiency is not None:  # the run's own baseline; not measured (an LR of 0): no back-off
            low = efficiency < config.efficiency if efficiency is not None else torch.zeros_like(past)
            past = past & low
            if config.ceiling is not None:
                past = past | (signal > max(config.ceiling, config.threshold))
        up = config.recovery ** (config.every if config.measures_update else 1)
        moved = torch.where(past, (factor * config.factor).clamp(min=config.floor), (factor * up).clamp(max=1.0))
        # a new tensor: the step that used the old one keeps it in its record (``step.scale``)
        self.backoff = torch.where(applied.to(signal.device), moved, factor)

    def _record(
        self,
        open_step: _OpenStep,
        size: UpdateSize | None,
        maxima: dict[str, Tensor],
        log_z: tuple[Tensor, Tensor] | None,
    ) -> None:
        if maxima:
            self.record_metric("stability/attention_logit_max", torch.stack([m.amax() for m in maxima.values()]).amax())
            for name, heads in maxima.items():
                self.record_metric(f"stability/attention_logit_max_by_module/{name}", heads.amax())
        if log_z is not None:
            self.record_metric("stability/log_z", log_z[0])
            self.record_metric("stability/log_z_drift", log_z[1])
        if size is not None and size.ratio is not None and size.update_norms is not None:
            rms = size.update_norms / self._roots(size.params, size.update_norms.device)
            self.record_metric("stability/update_rms_max", rms.max())
            if is_adam(open_step.optimizer):
                self.record_metric("stability/adam_eps_share", adam_eps_share(open_step.optimizer, size.params))
        if self.qk_clip is not None:
            self.record_metric("stability/qk_clipped_heads", self.clipped_heads)
        if open_step.clip_coef is not None:
            self.record_metric("stability/update_clip_min", open_step.clip_coef.min())
        if self._backoff_on:
            sent = self.record_metric("stability/lr_backoff", self.backoff)
            if self.is_logging_step and not self._told:
                self._backoff_sent = sent  # read in on_host: the first time it is below 1, say so once
        if self.reset_moments:
            self.record_metric("stability/moment_resets", self.moment_resets)

    def on_host(self, trainer: pl.Trainer, record: OptimizerRecord) -> dict[str, float] | None:
        """Once per fit, the first logging step the back-off is found engaged: a warning saying why and how to
        change it (it scales the updates your LR makes; nothing else would tell you)."""
        sent, self._backoff_sent = self._backoff_sent, None
        if sent is None or self._told or self.lr_backoff is None:
            return None
        factor = sent.number()
        if factor < 1:
            self._told = True
            config = self.lr_backoff
            rank_zero_warn(
                f"PrecursorMonitor's LR back-off is on by step {record.steps}: {config.signal!r} passed its threshold "
                f"{config.threshold:g}{_while_efficiency(config)}, and the updates are scaled by {factor:.3g} "
                "(stability/lr_backoff logs the "
                "factor). With Adam, the update-to-weight ratio is at most about lr / RMS(weights), where the "
                "gradients keep their sign. If your LR is meant as it is, raise the threshold "
                "(LRBackoff(threshold=...); in a preset lr_backoff=...) or turn the back-off off (lr_backoff=None)."
            )
        return None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        log_z = self._log_z.state_dict() if self._log_z is not None else self._log_z_state
        return {
            "backoff": float(self.backoff),
            "clipped_heads": float(self.clipped_heads),
            "moment_resets": float(self.moment_resets),
            "rms_ema": None if self._rms_ema is None else float(self._rms_ema),
            "peak_per_lr": None if self._peak_per_lr is None else float(self._peak_per_lr),
            "log_z": {k: (None if v is None else float(v)) for k, v in log_z.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.backoff = float(state_dict.get("backoff", 1.0))
        self.clipped_heads = float(state_dict.get("clipped_heads", 0.0))
        self.moment_resets = float(state_dict.get("moment_resets", 0.0))
        rms = state_dict.get("rms_ema")
        self._rms_ema = None if rms is None else torch.tensor(float(rms))
        peak = state_dict.get("peak_per_lr")
        self._peak_per_lr = None if peak is None else torch.tensor(float(peak))
        ema = state_dict.get("log_z", {}).get("ema")
        self._log_z_state = {"ema": None if ema is None else torch.tensor(float(ema))}
        if self._log_z is not None:
            self._log_z.load_state_dict(self._log_z_state)

    def transient_state(self) -> dict[str, Any]:
        return {
            "_logits": None,
            "_log_z": None,
            "_open": None,
            "_projections": {},
            "_root_numel": None,
            "_fresh": True,
            "_reads": False,
            "_backoff_sent": None,
        }


class _OpenStep:
    """What :meth:`PrecursorMonitor.on_step` leaves for the edit after the update and for ``after_step``."""

    def __init__(self, optimizer: Optimizer, measured: bool, tick: bool) -> None:
        self.optimizer = optimizer
        self.measured = measured  # the step measures this update (ledger.step.update)
        self.tick = tick  # the back-off moves on this step
        self.params: list[Tensor] = []  # the tensors with Adam state and a gradient (the Adam actions')
        self.clip_coef: Tensor | None = None  # per tensor: the update clip
        self.hit: Tensor | None = None  # per tensor: its gradient spiked (moment reset)
        self.maxima: dict[str, Tensor] | None = None  # the step's attention maxima, over ranks (the edit's)


def _agree_across_ranks(open_step: _OpenStep) -> None:
    """The update-clip coefficients (their minimum) and the hit tensors (any rank's) alike on every rank: one
    all-reduce. Under DDP every rank computes them from the same reduced gradients and the same state, so this
    changes nothing unless one rank's gradients or state went their own way (then no rank acts on its own)."""
    parts = [t for t in (open_step.clip_coef,) if t is not None]
    if open_step.hit is not None:
        parts.append(1.0 - open_step.hit.float())  # min over ranks of "not hit": hit on any rank
    if ranks.world_size() == 1 or not parts:
        return
    flat = ranks.min_(torch.cat(parts))
    chunks = list(flat.split([t.numel() for t in parts]))
    if open_step.clip_coef is not None:
        open_step.clip_coef = chunks.pop(0)
    if open_step.hit is not None:
        open_step.hit = chunks.pop(0) < 0.5


def _while_efficiency(config: LRBackoff) -> str:
    """The back-off's condition beside the threshold, as the warning states it."""
    if config.efficiency is None:
        return ""
    ceiling = "" if config.ceiling is None else f", or {max(config.ceiling, config.threshold):g}"
    return (
        f" while the update per unit of LR fell under {config.efficiency:g} of the run's largest "
        f"(stability/update_efficiency){ceiling}"
    )


def _tensor_parallel(module: pl.LightningModule) -> str | None:
    """How a parameter is split other than by FSDP2 along its first dim (tensor parallelism), or ``None``."""
    for name, p in module.named_parameters():
        if not is_dtensor(p):
            continue
        mesh = p.device_mesh  # type: ignore[attr-defined]
        names = mesh.mesh_dim_names or ()
        for dim, placement in enumerate(p.placements):  # type: ignore[attr-defined]
            if mesh.size(dim) == 1 or placement.is_replicate() or placement.is_partial():
                continue
            tp = dim < len(names) and names[dim] == "tensor_parallel"
            if tp or not (isinstance(placement, Shard) and placement.dim == 0):
                return f"parameter {name!r} is split as {placement} over mesh dim {dim} of {mesh}"
    return None
