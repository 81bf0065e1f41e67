"""PreemptionCheckpoint: on a preemption signal, every rank saves at one agreed step boundary and the Trainer stops;
the save goes where ``trainer.fit(model, ckpt_path="last")`` finds it."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_stability import incidents
from lightning_stability.checkpoint.preemption import PreemptionSignals, check_signals, default_signals
from lightning_stability.checkpoint.save_now import SaveNow, model_checkpoint, save_last
from lightning_stability.checkpoint.units import holders_of
from lightning_stability.errors import check_alone, config_error


class PreemptionCheckpoint(Callback):
    """Save and stop on a preemption signal: when any rank receives one of ``signals``, every rank saves the same
    step's state and the Trainer stops cleanly, so the job's restart resumes from it.

    Ranks agree on the signal one or two optimizer steps after it arrived, without a device sync or a blocking
    round trip (a signal may reach one rank only). The save is Lightning's ``trainer.save_checkpoint`` of that
    step's state, into the directory of the Trainer's ``ModelCheckpoint`` (``save_last=True``) as its ``last``
    checkpoint (``last.ckpt``, replaced), so the restart's ``trainer.fit(model, ckpt_path="last")`` resumes from
    it: Lightning resolves ``"last"`` to the newest ``last*.ckpt`` there. Add
    :class:`~lightning_stability.checkpoint.exact_resume.ExactResume` for a mid-epoch save to resume at the next
    batch with the same random draws.

    A signal handler installed before the Trainer's still runs; Lightning's own SIGTERM handler (which would end
    the run before the save) does not. Under ``SLURMEnvironment(auto_requeue=True)`` Lightning's requeue runs after
    the save. ``StableCheckpoint`` does all this itself (saving healthy states only): use one or the other.

    Args:
        signals: the signals that save and stop (default SIGTERM and SIGUSR1, where the platform has them).

    Raises:
        StabilityConfigError: a signal that cannot be caught; at setup, a Trainer without a ``ModelCheckpoint``,
            one whose ``save_last`` is not ``True`` (off: an older ``last.ckpt`` would outlive its later saves;
            ``"link"``: it links ``last.ckpt`` back to its newest step file when the epoch ends), or a callback
            next to it that holds a ``PreemptionCheckpoint`` of its own (``StableCheckpoint``).

    Example::

        from lightning.pytorch.callbacks import ModelCheckpoint

        trainer = L.Trainer(
            callbacks=[
                ModelCheckpoint(dirpath="ckpts", every_n_train_steps=500, save_last=True),
                PreemptionCheckpoint(),
                ExactResume(),
            ],
        )
        trainer.fit(model, ckpt_path="last")  # the state saved at the signal, after a preemption
    """

    def __init__(self, signals: Sequence[int] | None = None) -> None:
        self.signals = check_signals(default_signals() if signals is None else signals)
        self._owner = type(self).__name__
        self._save: SaveNow = self._save_last  # alone; a composing callback hands its own (part_of)
        self._tries = 0  # the later step boundaries a save that saved nothing is tried again at
        self._part = False
        self._signals = PreemptionSignals(self.signals)
        self._reset()

    @classmethod
    def part_of(cls, owner: str, signals: Sequence[int], save_now: SaveNow, tries: int = 0) -> PreemptionCheckpoint:
        """The unit inside another callback (``owner``, which drives its hooks): on a signal it saves with
        ``save_now(trainer)``; when that saves nothing (``None``), it tries again at each of the next ``tries``
        step boundaries, then stops without a save. Its messages name ``owner``."""
        unit = cls(signals)
        unit._owner, unit._save, unit._tries, unit._part = owner, save_now, tries, True
        return unit

    def _reset(self) -> None:
        self._stop: dict[signal.Signals, int] = {}  # the agreed signals (ranks per signal)
        self._stop_step = -1  # the boundary where every rank learned of them
        self._boundary = -1  # global_step at the last optimizer-step boundary seen

    @property
    def stopping(self) -> bool:
        """Whether every rank agreed on a signal in this fit (the Trainer stops at the save)."""
        return bool(self._stop)

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not self._part:
            self._check_trainer(trainer)
        self._reset()
        self._signals.open()  # every rank: the exchange's process group

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._boundary = trainer.global_step
        # after the Trainer installed its own handlers (at the start of fit), so that ours run first
        if self.signals and not self._signals.install():
            rank_zero_warn(
                f"{self._owner}: the Trainer runs outside the main thread, where Python cannot install signal "
                f"handlers; {', '.join(s.name for s in self.signals)} will not save and stop this run."
            )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.at_boundary(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._signals.finish()
        self._signals.restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._signals.restore()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._signals.restore()
        if stage == "fit":
            self._signals.close()

    # ------------------------------------------------------------------ the signal
    def at_boundary(self, trainer: pl.Trainer) -> bool:
        """At an optimizer-step boundary, every rank: learn the signals every rank agrees on (host only: a flag, or
        the previous boundary's exchange); after one, save and stop. Returns :attr:`stopping`.

        Once per boundary: a micro-batch that did not step the optimizer, or a second call at the same step (an
        owner calls it at a point of its own, then its ``on_train_batch_end`` reaches this unit), does nothing."""
        if trainer.global_step == self._boundary:
            return self.stopping
        self._boundary = trainer.global_step
        if not self._stop:
            agreed = self._signals.poll()
            if agreed:
                self._stop, self._stop_step = agreed, trainer.global_step
        if self._stop:
            self._save_and_stop(trainer)
        return self.stopping

    def _save_and_stop(self, trainer: pl.Trainer) -> None:
        step = trainer.global_step
        if trainer.fast_dev_run:  # type: ignore[attr-defined]
            done = "not saved (fast_dev_run)"
        else:
            path = self._save(trainer)
            if path is None and step - self._stop_step < self._tries:
                return  # tried again at the next boundary
            done = (
                f"saved {path} at step {step}"
                if path is not None
                else f"not saved: no state could be saved in the {self._tries + 1} step(s) from step {self._stop_step}"
            )
        self._signals.finish()
        self._signals.run_requeue(self._stop)  # Lightning's SLURM auto-requeue, after our save
        trainer.should_stop = True
        names = ", ".join(f"{sig.name} (on {n} rank{'s' if n > 1 else ''})" for sig, n in self._stop.items())
        incidents.record(
            trainer,
            "preemption",
            f"{names} received; {done}; stopped",
            lost="the steps since the newest healthy checkpoint" if done.startswith("not saved") else "",
        )
        rank_zero_info(
            f"{self._owner}: {names} received; {done}. Stopping the Trainer. Resume with "
            "trainer.fit(model, ckpt_path='last')."
        )

    def _save_last(self, trainer: pl.Trainer) -> str | None:
        """Alone: the state of this step as the Trainer's ``ModelCheckpoint``'s ``last`` checkpoint."""
        return save_last(trainer)

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        for holder in holders_of(PreemptionCheckpoint, callbacks):
            owner = type(holder).__name__
            raise config_error(
                "callbacks",
                [type(cb).__name__ for cb in callbacks],
                f"has two callbacks that save and stop on a preemption signal ({owner} does it, with its own save)",
                f"remove PreemptionCheckpoint and pass its signals to {owner}(signals=...)",
            )
        check_alone(
            self,
            PreemptionCheckpoint,
            callbacks,
            "has two PreemptionCheckpoint callbacks: each would save and stop",
            "keep one, with every signal in its signals=",
        )
        checkpoint = model_checkpoint(trainer)
        if checkpoint is None:
            raise config_error(
                "callbacks",
                [type(cb).__name__ for cb in callbacks],
                "has no ModelCheckpoint (enable_checkpointing=False, or none attached): PreemptionCheckpoint saves "
                "into its directory as last.ckpt, for trainer.fit(model, ckpt_path='last')",
                "add ModelCheckpoint(dirpath=..., save_last=True) to the callbacks",
            )
        if checkpoint.save_last is not True:
            why = (
                "makes ModelCheckpoint link last.ckpt back to its newest step file when the epoch ends, which "
                "undoes the save at the signal"
                if checkpoint.save_last == "link"
                else "leaves the ModelCheckpoint's last.ckpt unrefreshed: after a resume from the save at a signal, "
                "a later ckpt_path='last' would find that older state"
            )
            raise config_error(
                "save_last",
                checkpoint.save_last,
                why,
                "ModelCheckpoint(..., save_last=True) next to PreemptionCheckpoint",
            )
