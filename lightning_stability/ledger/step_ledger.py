"""StepLedger: the record of every optimizer step, shared by every ``lightning_stability`` callback.

One ledger exists per ``Trainer`` (:meth:`StepLedger.of`), with one :class:`OptimizerRecord` per optimizer. For
each optimizer step it opens the step (reusing the fp16 scaler's overflow decision), holds the step's values and
gradient norms, takes skip votes from any callback, closes the step into one :class:`Outcome` counted on the
device, and routes the step's metrics: into ``trainer.callback_metrics`` at once, to the loggers in one transfer
on logging steps. Nothing here adds a host sync to a step that does not log, except one read of the skip votes
for a non-fused optimizer without a loss scaler. It is saved once in the checkpoint under
``checkpoint["lightning_stability"]["ledger"]``.

What a callback reads and writes here is in the "For callbacks" part of :class:`StepLedger`; the rest is driven
by :class:`~lightning_stability.ledger.callback.LedgerCallback`.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability import _compat, ranks
from lightning_stability.errors import check_instance
from lightning_stability.ledger.gradients import StepGradients
from lightning_stability.ledger.metrics import FlushHook, MetricQueue, OnHost
from lightning_stability.ledger.skips import Flag, loss_scaler
from lightning_stability.ledger.stages import Stage, StageCheck
from lightning_stability.ledger.step import OptimizerStep, enforce_before_update
from lightning_stability.ledger.track import OptimizerRecord, Outcome, device_of, optimizer_names
from lightning_stability.ledger.verdict import HealthVerdict

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["CHECKPOINT_KEY", "OptimizerRecord", "Outcome", "StepLedger"]

CHECKPOINT_KEY = "lightning_stability"


class StepLedger:
    """The record of every optimizer step: values and flags as tensors, outcome counts on the device.

    For callbacks (from ``on_step`` and ``after_step`` of a
    :class:`~lightning_stability.ledger.callback.LedgerCallback`):

    * :attr:`step`: the open step (``ledger/step.py``), e.g. ``step.loss``, ``step.grad_norm`` (tensors);
    * :meth:`gradients`: the open step's gradients and their global norm, computed once for all callbacks;
    * :meth:`mark_skip`: the one way to skip the update, with its reason;
    * :meth:`scale_update`: the one way to change the update's size (a factor on each param group's LR);
    * :meth:`at`: the one way to run at a row of the step table (:class:`~lightning_stability.ledger.Stage`): every
      change of the weights, optimizer state, buffers or LR outside the optimizer's own update;
    * :attr:`step_label`: Lightning's step label of the current step (the x axis of ``self.log``);
    * :meth:`any_rank`: a flag made the same on every rank, for every decision that skips;
    * :meth:`record_of`: one optimizer's :class:`OptimizerRecord` (steps, outcome counts, window sums);
    * :attr:`outcome`: the outcome of the last closed step (read it in ``after_step``);
    * :attr:`health`: ``TrainingHealthMonitor``'s :class:`~lightning_stability.ledger.verdict.HealthVerdict` of
      the last step it scored (``None`` without one);
    * :attr:`events` / :meth:`note`: events of the run (rollbacks), saved in checkpoints;
    * :attr:`published`: the last logged value of every metric, as host numbers;
    * :meth:`select` and :meth:`flush`: after training, queue a last report under an optimizer, then send it.

    :meth:`open_step` and :meth:`close_step` are called by the callbacks' template (or by hand when the
    ledger is driven without a Trainer).
    """

    _registry: ClassVar[weakref.WeakKeyDictionary[Any, StepLedger]] = weakref.WeakKeyDictionary()
    _last: ClassVar[weakref.ref[StepLedger] | None] = None  # the ledger `of` found last: every hook asks again

    def __init__(self, trainer: pl.Trainer | None = None) -> None:
        if trainer is not None:
            from lightning.pytorch import Trainer

            check_instance("trainer", trainer, Trainer, "a lightning Trainer or None", "trainer (or StepLedger.of)")
        self._trainer_ref = weakref.ref(trainer) if trainer is not None else None
        self._step: OptimizerStep | None = None  # the open step, or the last closed one
        self.outcome: Outcome | Tensor = Outcome.APPLIED
        self.health: HealthVerdict | None = None  # written by TrainingHealthMonitor at each step it scores
        self.events: list[dict[str, Any]] = []  # rollbacks and other events, with their step labels
        self.published: dict[str, float] = {}  # the last logged value of every metric (host numbers)
        self._records: dict[int, OptimizerRecord] = {}
        self._loaded: dict[int, dict[str, Any]] = {}
        self._current: OptimizerRecord | None = None
        self._open: Optimizer | None = None
        self._several: bool | None = None  # _several_optimizers, as of the step open now (None between steps)
        self._at: dict[Stage, dict[str, Any]] = {}  # see at()
        self._check = StageCheck() if StageCheck.enabled() else None  # the debug check of the stages' writes
        self._queue = MetricQueue()
        self._loss = StepLoss()
        self._rerun_factor: float | None = None  # backward_factor() inside run_backward_stage
        # id(optimizer) -> (weak reference, record index, hook handles); the reference tells a reused id apart
        self._hooked: dict[int, tuple[weakref.ref[Optimizer], int, tuple[Any, Any]]] = {}

    # ------------------------------------------------------------------ lookup
    @classmethod
    def of(cls, trainer: pl.Trainer) -> StepLedger:
        """The ledger of ``trainer``, created on first use."""
        last = cls._last() if cls._last is not None else None
        if last is not None and last._trainer_ref is not None and last._trainer_ref() is trainer:
            return last
        ledger = cls._registry.get(trainer)
        if ledger is None:
            ledger = cls._registry[trainer] = cls(trainer)
        StepLedger._last = weakref.ref(ledger)
        return ledger

    @property
    def step(self) -> OptimizerStep:
        """The open optimizer step (``ledger/step.py``), or the last closed one: ``step.loss``, ``step.grad_norm``,
        ``step.clip_coef``. Raises before the first step (:attr:`has_step`)."""
        if self._step is None:
            raise RuntimeError("ledger.step read before the first optimizer step; check ledger.has_step first")
        return self._step

    @property
    def has_step(self) -> bool:
        """Whether a step has opened (:attr:`step` can be read)."""
        return self._step is not None

    @property
    def trainer(self) -> pl.Trainer | None:
        return self._trainer_ref() if self._trainer_ref is not None else None

    def _optimizers(self) -> list[Optimizer]:
        trainer = self.trainer
        return trainer.optimizers if trainer is not None else []

    @property
    def _several_optimizers(self) -> bool:
        """Whether the trainer has more than one optimizer (metric keys then name the optimizer); read once per
        step while one is open (every metric asks), live between steps."""
        return self._several if self._several is not None else len(self._optimizers()) > 1

    def _record_at(self, index: int, name: str | None = None) -> OptimizerRecord:
        record = self._records.get(index)
        if record is None:
            record = OptimizerRecord(index, name or f"optimizer{index}", self._loaded.pop(index, None))
            self._records[index] = record
        return record

    def record_of(self, optimizer: Optimizer | None = None) -> OptimizerRecord:
        """The record of ``optimizer`` (default: the optimizer stepping now, or the last that stepped)."""
        if optimizer is None:
            return self._current if self._current is not None else self._record_at(0)
        hooked = self._hooked.get(id(optimizer))
        if hooked is not None and hooked[0]() is optimizer:
            return self._records[hooked[1]]
        optimizers = self._optimizers()
        index = next((i for i, o in enumerate(optimizers) if o is optimizer), None)
        if index is None:
            # Without a trainer (the ledger driven by hand) every optimizer shares record 0; an optimizer the
            # trainer does not know gets a record of its own.
            index = 0 if not optimizers else max(len(optimizers), max(self._records, default=-1) + 1)
        names = optimizer_names(optimizers)
        record = self._record_at(index)
        # named now, also when a metric logged before the first step made the record under a placeholder name
        record.name = names[index] if index < len(names) else type(optimizer).__name__
        record.place(device_of(optimizer))
        # Once per optimizer: the pre-hook enforces the step's votes right before the update, the post-hook
        # closes the step (ledger/step.py, steps 8 and 10).
        handles = (
            optimizer.register_step_pre_hook(self._before_optimizer_step),
            optimizer.register_step_post_hook(self._after_optimizer_step),
        )
        self._hooked[id(optimizer)] = (weakref.ref(optimizer), index, handles)
        return record

    def _watches(self, optimizer: Optimizer) -> bool:
        hooked = self._hooked.get(id(optimizer))
        return hooked is not None and hooked[0]() is optimizer

    def _watch(self, optimizers: Iterable[Optimizer]) -> None:
        """Hook ``optimizers`` before their first step (the template does it at ``on_train_batch_start``)."""
        for optimizer in optimizers:
            if not self._watches(optimizer):
                self.record_of(optimizer)

    def select(self, optimizer: Optimizer) -> OptimizerRecord:
        """Between steps (after training): make ``optimizer``'s record the current one, so that the metrics a
        callback records now are queued under it; :meth:`flush` sends them."""
        if self._open is None:
            self._current = self.record_of(optimizer)
        return self.record_of()

    @property
    def _device(self) -> torch.device:
        return self.record_of().device

    # ------------------------------------------------------------------ step lifecycle
    def open_step(self, optimizer: Optimizer) -> bool:
        """Open the record of the step ``optimizer`` is about to take. Returns ``False`` if already open."""
        if self._open is optimizer:
            return False
        if self._open is not None:
            self.close_step()
        # An optimizer met first inside its own step() (no template callback hooked it before): its pre-hook
        # runs from the next step on, so this step's votes are enforced as they come.
        late = not self._watches(optimizer)
        record = self.record_of(optimizer)
        self._current, self._open = record, optimizer
        record.steps += 1
        trainer = self.trainer
        self._several = len(self._optimizers()) > 1
        scaler = loss_scaler(trainer) if trainer is not None else None
        self._step = OptimizerStep(optimizer, record, scaler, self._loss.take(), enforce_each_vote=late)
        self._run(Stage.OPEN)  # 3. the rollback's restore, a stand-in's buffers, factors known before the step
        self._run(Stage.REPLAY)  # 3b. a flagged step replayed, before anything measures it (StepReplay)
        if self._check is not None:
            self._check.mark(Stage.MEASURE, self._params())
        return True

    def at(self, stage: Stage, name: str, fn: Callable[[StepLedger], None] | None) -> None:
        """Run ``fn(ledger)`` at ``stage`` of every step from now on (``None``: no more), under ``name`` (one function
        per name and stage: registering a name again replaces it).

        The functions of a stage run in the order of their names, whatever the order of the Trainer's callbacks.
        Stages that take functions (``stage.registers``): ``BACKWARD`` (before each micro-batch's backward; see
        :meth:`backward_factor`), ``OPEN`` (as the step opens, before anything measures it),
        ``REPLAY`` (StepReplay's), ``ENFORCE`` (right before the update, after every clip and vote: the gradients
        the update will use), ``AFTER_UPDATE`` (right after it, applied or skipped: ``ledger.outcome``) and
        ``AFTER_STEP`` (once the step closed). A bound method is held weakly: a callback's registration ends with it.
        """
        check_instance("stage", stage, Stage, "a Stage member, e.g. Stage.AFTER_UPDATE", "StepLedger.at")
        if not stage.registers:
            takes = ", ".join(f"Stage.{s.name}" for s in Stage if s.registers)
            raise ValueError(
                f"StepLedger.at: Stage.{stage.name} (row {stage.row}) runs no registered function. Fix: one of "
                f"{takes} (measure, clip and vote from a LedgerCallback's on_step)"
            )
        hooks = self._at.setdefault(stage, {})
        if fn is None:
            hooks.pop(name, None)
            return
        if stage is Stage.REPLAY and any(other != name for other in hooks):
            raise ValueError(
                f"StepLedger.at: Stage.REPLAY runs one function ({next(iter(hooks))!r}); {name!r} would be a second"
            )
        hooks[name] = weakref.WeakMethod(fn) if inspect.ismethod(fn) else fn
        self._at[stage] = dict(sorted(hooks.items()))  # run in the order of their names

    def _run(self, stage: Stage) -> None:
        hooks = self._at.get(stage)
        if not hooks:
            return
        for name, fn in list(hooks.items()):
            if isinstance(fn, weakref.WeakMethod):
                fn = fn()
                if fn is None:  # its callback is gone
                    del hooks[name]
                    continue
            fn(self)

    def _params(self) -> list[Tensor]:
        optimizer = self._open
        return [] if optimizer is None else [p for g in optimizer.param_groups for p in g["params"]]

    @property
    def is_open(self) -> bool:
        """Whether an optimizer step is open (between ``on_before_optimizer_step`` and the update)."""
        return self._open is not None

    def _want_loss(self) -> None:
        """Make ``step.loss`` available from ``open_step`` on: the update's loss, the mean over its
        micro-batches, unscaled, on the device."""
        self._loss.enabled = True

    def _before_backward(self, loss: Tensor) -> None:
        """Before each micro-batch's backward (the template calls it): row 1's functions (``Stage.BACKWARD``), and
        the micro-batch's loss recorded, as ``on_before_backward`` sees it."""
        self._run(Stage.BACKWARD)
        if not self._loss.enabled:
            return
        scale, normalize = self._loss_factors()
        if normalize is not None:
            self._loss.add(loss, scale, normalize)

    def run_backward_stage(self, factor: float) -> None:
        """Row 1's functions (``Stage.BACKWARD``) before a backward Lightning does not announce with
        ``on_before_backward``: a step run again (``replay/rerun.py`` calls the precision's ``backward`` directly),
        with :meth:`backward_factor` returning ``factor``, what that backward's loss was multiplied by. No loss is
        recorded."""
        self._rerun_factor = factor
        try:
            self._run(Stage.BACKWARD)
        finally:
            self._rerun_factor = None

    def _loss_factors(self) -> tuple[Tensor | None, int | None]:
        """The fp16 loss scale (``None`` without one) and Lightning's divisor of the coming backward's loss (the
        accumulation factor under automatic optimization, else 1; ``None`` without a trainer)."""
        trainer = self.trainer
        if trainer is None:
            return None, None
        scaler = loss_scaler(trainer)
        automatic = trainer.lightning_module.automatic_optimization
        scale = _compat.scaler_scale(scaler) if scaler is not None else None
        return scale, trainer.accumulate_grad_batches if automatic else 1

    def backward_factor(self) -> Tensor | float:
        """What the loss of the coming backward was multiplied by, before it: the fp16 loss scale (a 0-dim device
        tensor, read without a sync) over Lightning's accumulation divisor; 1.0 without either. A gradient that a
        ``Stage.BACKWARD`` function adds through a tensor hook is multiplied by it, to land as if its term were part
        of the loss."""
        if self._rerun_factor is not None:
            return self._rerun_factor
        scale, normalize = self._loss_factors()
        factor: Tensor | float = 1.0 / (normalize or 1)
        return factor if scale is None else scale * factor

    def gradients(self, norm_type: float = 2.0) -> StepGradients:
        """The open step's gradients and their global norm, computed once per step for all callbacks.

        Clip them with ``gradients().clip_(threshold)``: clips by several callbacks leave the smallest threshold.
        """
        if self._open is None or self._step is None:
            raise RuntimeError("gradients() called outside an optimizer step; call open_step(optimizer) first")
        return self._step.gradients(norm_type)

    @property
    def step_label(self) -> int:
        """Lightning's step label for the current step: ``self.log`` and ``LearningRateMonitor`` use it too."""
        trainer = self.trainer
        if trainer is not None:
            return _compat.batches_that_stepped(trainer)
        return max(self.record_of().steps - 1, 0)

    def is_logging_step(self, every_n_steps: int) -> bool:
        """Whether the current step logs by Lightning's rule for ``log_every_n_steps`` (0: never; the step on
        which the run is told to stop logs too)."""
        if every_n_steps <= 0:
            return False
        trainer = self.trainer
        # Lightning also logs the step on which the run is told to stop (`_LoggerConnector.should_update_logs`)
        return (self.step_label + 1) % every_n_steps == 0 or bool(trainer is not None and trainer.should_stop)

    def note(self, event: dict[str, Any]) -> None:
        """Record an event of the run (e.g. a rollback: ``{"step": 120, "kind": "rollback", ...}``); saved in
        checkpoints, so a resumed run keeps the whole record."""
        self.events.append(dict(event))

    def any_rank(self, flag: Tensor) -> Tensor:
        """``flag`` made rank-consistent: true on every rank when it is true on any (one 0-dim all-reduce
        over the default process group, no host sync). Use it for every decision that skips a step."""
        return ranks.any_rank(flag)

    def mark_skip(self, reason: Outcome, flag: Flag, optimizer: Optimizer | None = None) -> None:
        """Skip the current update when ``flag`` (a host bool or a 0-dim device tensor) is true, and say why.

        Any callback may vote, in any order, and the module too; the update is skipped if any vote says so.
        Weights and optimizer state are then left exactly as they were, and under fp16 the loss scale is not
        changed. Every vote cast before ``optimizer.step()`` counts the same: they are enforced together right
        before the update (``ledger/step.py``), at one host read at most, none under fp16 or with a fused
        optimizer. From a plain callback's ``on_before_optimizer_step``, pass that hook's ``optimizer``: it opens
        the step if no ``lightning_stability`` callback has yet. The decision must be the same on every rank:
        pass a flag from globally reduced values, or through :meth:`any_rank`.
        """
        if optimizer is not None:
            self.open_step(optimizer)
        if self._open is None:
            raise RuntimeError(
                "mark_skip() called outside an optimizer step. Fix: call it from `on_before_optimizer_step` and "
                "pass that hook's optimizer: ledger.mark_skip(reason, flag, optimizer)."
            )
        assert self._step is not None
        self._step.vote(reason, flag)

    def scale_update(self, source: str, factor: Tensor | float, optimizer: Optimizer | None = None) -> None:
        """Scale the current update by ``factor`` (a number >= 0 or a 0-dim device tensor), named by its
        ``source``: the one way to change an update's size for a step.

        The factors of every source multiply; right before ``optimizer.step()`` their product multiplies each param
        group's ``lr``, and right after it each ``lr`` is put back (``ledger/step.py``, rows 6, 8 and 10). So the
        optimizer applies exactly its own update at ``lr x factor``, whatever it is, and an LR schedule never sees
        the factor. ``step.scale.lrs`` holds the LRs the update used. Like a vote, the factor must be the same on
        every rank. From a plain callback's ``on_before_optimizer_step``, pass that hook's ``optimizer``.
        """
        if optimizer is not None:
            self.open_step(optimizer)
        if self._open is None or self._step is None:
            raise RuntimeError(
                "scale_update() called outside an optimizer step. Fix: call it from `on_before_optimizer_step` and "
                "pass that hook's optimizer: ledger.scale_update(source, factor, optimizer)."
            )
        self._step.scale_update(source, factor)

    def _before_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> Any:
        return enforce_before_update(args, kwargs, lambda: self._enforce(optimizer))

    def _enforce(self, optimizer: Optimizer) -> None:
        if self._open is optimizer and self._step is not None:
            if self._check is not None:  # rows 4 to 7 measure, clip and vote: the weights as they were
                self._check.check(Stage.ENFORCE, self._params())
            self._run(Stage.ENFORCE)  # 8. the gradients as the update will see them
            self._step.enforce(before_update=True)

    def _after_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self._open is optimizer and self._step is not None:
            self._step.stepped = True
            self.close_step()
            return
        if self._open is None:
            # An update no callback opened a step for (no LedgerCallback; a plain callback voted on an earlier
            # step, which hooked this optimizer): it ran without a vote. Counted, so that `outcome` and the
            # counts describe the last update, not the last vote (StableCheckpoint reads `outcome`).
            record = self.record_of(optimizer)
            record.steps += 1
            record.count(Outcome.APPLIED)
            self.outcome = Outcome.APPLIED

    def close_step(self) -> None:
        """Close the open step, rows 10 to 13 of the step table: its skip flags become one :class:`Outcome`, counted;
        the edits after the update (``Stage.AFTER_UPDATE``); the update measured; ``Stage.AFTER_STEP``. Idempotent."""
        optimizer = self._open
        if optimizer is None:
            return
        assert self._step is not None
        self.outcome = outcome = self._step.close()  # 10. the outcome; each group's LR put back
        self._run(Stage.AFTER_UPDATE)  # 11. edits of the weights and optimizer state
        measured = self._step.finish_update()  # 12. the update measured: what rows 9 and 11 left in the weights
        if measured is not None:  # the step's figure, whichever callbacks asked for it
            self._log((("stability/update_ratio", measured[0]),), to_loggers=measured[1])
        self.record_of().count(outcome)
        check = self._check
        params = self._params() if check is not None else []
        self._open = None
        if check is not None:
            check.mark(Stage.AFTER_STEP, params)
        self._run(Stage.AFTER_STEP)  # 13. each callback's after_step: the LR schedule's next LR, the monitors
        if check is not None:
            check.check(Stage.AFTER_STEP, params)
        self._several = None  # read live between steps (another fit may have other optimizers)

    # ------------------------------------------------------------------ metrics
    def _log(self, metrics: Iterable[tuple[str, Tensor | float]], to_loggers: bool) -> OnHost:
        """Metrics of the current step (see ``LedgerCallback.record_metric``). A scalar goes into
        ``trainer.callback_metrics`` at once (a device tensor stays on the device); with ``to_loggers`` it is also
        queued for the loggers. Returns the last one's host copy, filled by the next transfer."""
        return self._queue.route(self.trainer, self.record_of(), self._several_optimizers, metrics, to_loggers)

    def _send(self, value: Tensor) -> OnHost:
        """``value`` to the host with the next transfer (see ``LedgerCallback.to_host``)."""
        return self._queue.send(value)

    def _on_flush(self, hook: FlushHook) -> None:
        """Run ``hook(values)`` once at the next flush, with the current optimizer's queued values on the host
        (scalars as floats, vectors as lists); it may return extra metrics to log."""
        self._queue.add_hook(self.record_of().index, hook)

    def flush(self) -> dict[str, float]:
        """Move every queued tensor of every optimizer to the host in one transfer and log the metrics (the
        template does it at the end of each logging step; call it after training to send a last report).

        Returns them, under their final names. Scalar metrics also land in ``trainer.callback_metrics``, as
        0-dim views of the host copy, so a monitor reading them costs no further transfer.
        """
        return self._flush(with_module_metrics=False)

    def _flush_at_batch_end(self) -> dict[str, float]:
        """:meth:`flush` at the end of a training batch (``LedgerCallback.on_train_batch_end``): the metrics reach
        the loggers in Lightning's logger call of this step, on the same row as the module's ``self.log``
        metrics."""
        return self._flush(with_module_metrics=True)

    def _flush(self, with_module_metrics: bool) -> dict[str, float]:
        if not self._queue:
            return {}
        metrics = self._queue.publish(
            self.trainer, self._device, self._record_at, self._several_optimizers, self.step_label, with_module_metrics
        )
        self.published.update(metrics)
        return metrics

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        records = {i: r.state_dict() for i, r in self._records.items()}
        records.update({i: s for i, s in self._loaded.items() if i not in records})
        return {"version": 2, "tracks": {str(i): s for i, s in sorted(records.items())}, "events": list(self.events)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        loaded = {int(i): s for i, s in state["tracks"].items()}
        for index, record in self._records.items():
            record.load_state_dict(loaded.pop(index, {}))
        self._loaded = loaded
        self.events = list(state.get("events", []))

    def _save_into(self, checkpoint: dict[str, Any]) -> None:
        """Write the ledger into a Lightning checkpoint dict (idempotent: every callback may call it)."""
        checkpoint.setdefault(CHECKPOINT_KEY, {})["ledger"] = self.state_dict()

    def _load_from(self, checkpoint: dict[str, Any]) -> None:
        """Restore from a Lightning checkpoint dict; a checkpoint without a ledger leaves it as is."""
        state = checkpoint.get(CHECKPOINT_KEY, {}).get("ledger")
        if state is not None:
            self.load_state_dict(state)


class StepLoss:
    """The loss of the coming update, before the update.

    What ``on_before_backward`` sees is not that loss: Lightning divides each micro-batch's loss by the
    accumulation factor (automatic optimization) and the fp16 scaler multiplies it by the loss scale. This undoes
    both and averages over the micro-batches of the update, on the device; :meth:`take` gives the mean and starts
    the next.
    """

    def __init__(self) -> None:
        self.enabled = False  # a callback that needs the loss turns it on (it costs ~3 small ops per micro-batch)
        self._sum: Tensor | None = None
        self._count = 0

    def add(self, loss: Tensor, scale: Tensor | None, normalize: int) -> None:
        """Record one micro-batch's loss as passed to backward: times ``normalize`` (the factor Lightning
        divided it by), over ``scale`` (the fp16 loss scale it was multiplied by)."""
        value = loss.detach().to(torch.float32)
        if scale is not None:
            value = value / scale.to(value.device, non_blocking=True)
        if normalize != 1:
            value = value * normalize
        self._sum = value if self._sum is None else self._sum + value
        self._count += 1

    def take(self) -> Tensor | None:
        """The mean loss of the micro-batches since the last call (``None`` if there were none)."""
        total, count = self._sum, self._count
        self._sum, self._count = None, 0
        if total is None:
            return None
        return total / count if count > 1 else total
