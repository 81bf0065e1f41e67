"""StableCheckpoint: Lightning's ``ModelCheckpoint`` that saves only healthy states, keeps a ring of them, resumes
from the newest with ``ckpt_path="last"``, and saves and stops cleanly on a preemption signal."""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_stability import _compat, incidents, ranks
from lightning_stability.checkpoint import atomic, recover
from lightning_stability.checkpoint.arguments import check_model_checkpoint_arguments
from lightning_stability.checkpoint.async_save import AsyncSaves, PendingSave, ShardedAsyncSaver
from lightning_stability.checkpoint.exact_resume import ExactResume
from lightning_stability.checkpoint.io import install_on, local_path
from lightning_stability.checkpoint.preemption import check_signals, default_signals
from lightning_stability.checkpoint.preemption_checkpoint import PreemptionCheckpoint
from lightning_stability.checkpoint.ring import BEST, LAST, RING, Entry, HealthyCheckpoints
from lightning_stability.checkpoint.units import drives_units
from lightning_stability.errors import check_bool, check_int, config_error
from lightning_stability.ledger.step_ledger import StepLedger
from lightning_stability.ledger.track import Outcome
from lightning_stability.norms import local_tensor

#: on a signal in an unhealthy state, the step boundaries tried before stopping without a save
SIGNAL_DEFER_STEPS = 5


@drives_units  # each hook: its own body, then its units'
class StableCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` that saves only healthy states, keeps the newest ``keep``, resumes exactly with
    ``trainer.fit(model, ckpt_path="last")`` and saves and stops on a preemption signal.

    * **Healthy states only.** A due save (``every_n_train_steps``, ``every_n_epochs``, ``train_time_interval``,
      the end of training, a signal) waits for the next optimizer step whose update was applied, whose loss and
      weights are finite and that ``TrainingHealthMonitor`` (if attached) did not call a spike (its verdict in the
      step ledger: a signal settled at a new level is not one), and says so once.
    * **A list of healthy checkpoints.** ``stable_checkpoints.json`` in ``dirpath`` lists the newest ``keep``;
      older ones are removed. ``ckpt_path="last"`` resolves to the newest listed one that passes
      :func:`~lightning_stability.checkpoint.atomic.verify_checkpoint` (or none: a fresh start), after taking back one a
      crash kept off the list.
    * **Exact mid-epoch resume** for a plain ``DataLoader`` over a map-style dataset: each checkpoint holds the
      data position and every rank's RNG states. What cannot be exact is said once at fit start. (It composes
      :class:`~lightning_stability.checkpoint.exact_resume.ExactResume`, which does this alone beside Lightning's
      ``ModelCheckpoint``.)
    * **Preemption.** On any of ``signals``, every rank saves at the same step boundary (a healthy state) and the
      Trainer stops. (It composes
      :class:`~lightning_stability.checkpoint.preemption_checkpoint.PreemptionCheckpoint` with its own save.)
    * **Asynchronous saves** (``async_save=True``): the step waits only for a copy of the state in host memory.

    Checkpoints are written by the Trainer's strategy, atomically and with checksums by ``AtomicCheckpointIO``
    (single device, DDP: installed at setup when the Trainer has no ``CheckpointIO`` plugin) or
    ``StableFSDPStrategy``; with any other writer a warning says what is lost. ``StableTrainer.from_preset``
    attaches this callback in ``<default_root_dir>/checkpoints``. Details: the checkpoints concept page of the
    documentation.

    Args:
        dirpath: the directory (local or mounted). Pass a fixed one to resume with ``ckpt_path="last"``:
            Lightning's default (the logger's version directory) changes from run to run.
        filename: as for ``ModelCheckpoint`` (default ``epoch=E-step=S``).
        monitor: as for ``ModelCheckpoint``: Lightning's top ``save_top_k`` by this value are kept besides the
            newest ``keep``.
        verbose: as for ``ModelCheckpoint``.
        save_last: as for ``ModelCheckpoint`` (``last.ckpt``). Not needed to resume: ``ckpt_path="last"`` reads
            the healthy list.
        save_top_k: as for ``ModelCheckpoint`` with ``monitor``. Without it, ``-1`` keeps every save and ``0``
            none but ``last``.
        keep: how many of the newest healthy checkpoints are kept.
        signals: the signals that save and stop (default SIGTERM and SIGUSR1; ``()``: none).
        save_at_end: also save the state training ends in, when healthy and not saved at that step already.
        async_save: write checkpoints in a background thread. Needs ``AtomicCheckpointIO`` (single device, DDP:
            installed at setup when the Trainer has no ``CheckpointIO`` plugin) or ``StableFSDPStrategy``, and host
            memory for one copy of each rank's state.
        save_weights_only: must stay ``False`` (a checkpoint without optimizer state cannot be resumed from).
        mode: as for ``ModelCheckpoint``.
        auto_insert_metric_name: as for ``ModelCheckpoint``.
        every_n_train_steps: as for ``ModelCheckpoint``.
        train_time_interval: as for ``ModelCheckpoint``.
        every_n_epochs: as for ``ModelCheckpoint``.
        save_on_train_epoch_end: as for ``ModelCheckpoint``.
        enable_version_counter: as for ``ModelCheckpoint``.

    Raises:
        StabilityConfigError: ``keep`` is not an int >= 1, a signal cannot be caught, ``save_weights_only=True``,
            or ``dirpath`` is remote (``s3://...``); at setup, ``async_save=True`` with a strategy or a
            ``CheckpointIO`` plugin that does not publish whole checkpoints.
        CheckpointError: a save failed (on every rank); with ``async_save=True``, at the next step boundary, save
            or the end of ``fit``.

    Example::

        trainer = L.Trainer(
            callbacks=[StableCheckpoint(dirpath="ckpts", every_n_train_steps=500, keep=3)],
        )
        trainer.fit(model, ckpt_path="last")  # the newest healthy checkpoint, if any
    """

    def __init__(
        self,
        dirpath: _PATH | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | Literal["link"] | None = None,
        save_top_k: int = 1,
        keep: int = 3,
        signals: Sequence[int] | None = None,
        save_at_end: bool = False,
        async_save: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
    ) -> None:
        lightning_args: dict[str, Any] = dict(  # ModelCheckpoint's own arguments: checked here, then passed on
            dirpath=dirpath,
            filename=filename,
            monitor=monitor,
            verbose=verbose,
            save_last=save_last,
            save_top_k=save_top_k,
            mode=mode,
            auto_insert_metric_name=auto_insert_metric_name,
            every_n_train_steps=every_n_train_steps,
            train_time_interval=train_time_interval,
            every_n_epochs=every_n_epochs,
            save_on_train_epoch_end=save_on_train_epoch_end,
            enable_version_counter=enable_version_counter,
        )
        check_model_checkpoint_arguments(signals=signals, **lightning_args)
        check_int("keep", keep, 1, "keep=3 (the newest healthy checkpoints)")
        if save_weights_only:
            raise config_error(
                "save_weights_only",
                save_weights_only,
                "would make checkpoints a run cannot resume from (no optimizer, loop or ledger state)",
                "keep save_weights_only=False here, and add a plain ModelCheckpoint(save_weights_only=True) for "
                "weight files",
            )
        if dirpath is not None and _local_dir(dirpath) is None:
            raise config_error(
                "dirpath", dirpath, "is not a local or mounted path", "pass a local or mounted directory"
            )
        super().__init__(save_weights_only=False, **lightning_args)
        check_bool("save_at_end", save_at_end)
        check_bool("async_save", async_save)
        self.keep = keep
        self.async_save = async_save
        self._async = AsyncSaves() if async_save else None
        self.save_at_end = save_at_end
        self.signals = check_signals(default_signals() if signals is None else signals)
        # save and stop on a signal, with the healthy save of _save_on_signal
        self._preemption = PreemptionCheckpoint.part_of(
            "StableCheckpoint", self.signals, self._save_on_signal, tries=SIGNAL_DEFER_STEPS
        )
        self._healthy_list = HealthyCheckpoints(Path("."))
        self._kind = BEST  # what the next _save_checkpoint writes
        self._taken_back: list[Entry] = []  # see _find_last_checkpoints
        self._hidden: list[Any] = []  # Lightning's warning hidden where it does not hold (shown again at setup)
        self._exact_resume = ExactResume.part_of("StableCheckpoint")  # the data position and RNG states
        self._reset_run_state()

    @property
    def units(self) -> tuple[PreemptionCheckpoint, ExactResume]:
        """The callbacks it is made of, whose hooks run after its own (``drives_units``): ExactResume last, as it
        puts back the RNG states."""
        return (self._preemption, self._exact_resume)

    def _reset_run_state(self) -> None:
        self._health: tuple[int, list[str]] | None = None  # (global_step, reasons) of the last check
        self._deferred_from: int | None = None  # the step whose save waits for a healthy step
        self._boundary = -1  # global_step at the last optimizer-step boundary seen
        self._batch_loss: Tensor | None = None  # the last batch's loss as training_step returned it
        self._saved_names: set[str] = set()  # the checkpoints this fit wrote
        self._resumed_step = -1  # the listed checkpoint this fit resumed from, if any: it and older ones are its own
        self._removals: list[str] = []  # removals asked for while an asynchronous save was in flight
        self._run_id = recover.new_run_id()  # this fit's identity, in the list and in its checkpoints
        self._saving: tuple[str, str] | None = None  # (name, kind) of the checkpoint being written

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_batch_loss": None, "_hidden": []}

    # ------------------------------------------------------------------ setup and teardown
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _compat.check_model_checkpoint_supported()
        super().setup(trainer, pl_module, stage)
        directory = _local_dir(self.dirpath or "")
        if directory is None:
            raise config_error("dirpath", self.dirpath, "is not a local or mounted path", "pass a local directory")
        self._healthy_list = HealthyCheckpoints(directory).load()
        for entry in self._taken_back:  # what resolving ckpt_path="last" put back on the list (rank 0 wrote it)
            self._healthy_list.add(entry.name, entry.step, entry.kind, write=False)
        self._taken_back = []
        self._show_lightning_warnings()  # resolving "last" is over
        self._check_writer(trainer.strategy)
        if stage == "fit":
            self._reset_run_state()
            if self._async is not None:
                self._async.setup(trainer)

    @staticmethod
    def _check_writer(strategy: Any) -> None:
        """Atomic, checksummed files: ``AtomicCheckpointIO`` installed on a single-device or DDP strategy without
        a ``CheckpointIO`` of the user's (before anything is loaded or saved); any other writer said once."""
        if install_on(strategy) or isinstance(strategy, ShardedAsyncSaver):
            return
        rank_zero_warn(
            f"StableCheckpoint: this Trainer writes checkpoints with {type(strategy).__name__} and "
            f"{type(strategy.checkpoint_io).__name__}, which write no checksums and may leave a half-written file "
            "when killed mid-save: a damaged checkpoint is neither reported by `lightning-stability verify` nor "
            "skipped by ckpt_path='last'. Leave out the CheckpointIO plugin (single device, DDP: AtomicCheckpointIO "
            "is then installed), or pass plugins=[AtomicCheckpointIO()], or use strategy=StableFSDPStrategy()."
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._boundary = trainer.global_step
        self._resumed_step = self._listed_step(trainer.ckpt_path)
        self._forget_other_timelines(trainer)
        self._healthy_list.claim(self._run_id, write=trainer.is_global_zero)

    def _show_lightning_warnings(self) -> None:
        """Lightning's warning hidden while it could not hold (see :meth:`_find_last_checkpoints`) shows again."""
        for entry in self._hidden:
            _compat.show_lightning_warning(entry)
        self._hidden = []

    def _forget_other_timelines(self, trainer: pl.Trainer) -> None:
        """Listed checkpoints newer than the step this fit starts from belong to another run (a fresh fit in a used
        directory) or to a continuation this fit abandoned (a resume from an older one): off the list, so that
        ``ckpt_path="last"`` after a crash resumes this run, never theirs. The files stay."""
        gone = self.discard_newer_than(trainer, trainer.global_step)
        if gone:
            rank_zero_warn(
                f"StableCheckpoint: {len(gone)} checkpoint(s) in {self._healthy_list.directory} were saved after "
                f"step {trainer.global_step}, where this fit starts ({', '.join(p.name for p in gone)}): another "
                "run's, or the continuation of the resumed checkpoint that this fit replaces. They are off the "
                "healthy list, so ckpt_path='last' resumes this run; the files stay. To go on from them instead, "
                "resume with ckpt_path='last' (or their path)."
            )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if (
            self.save_at_end
            and not trainer.fast_dev_run  # type: ignore[attr-defined]
            and step > 0
            and _compat.model_checkpoint_saved_at(self) != step
            and self._healthy(trainer)
        ):
            self.save_now(trainer)
        super().on_train_end(trainer, pl_module)
        self._wait_for_save(trainer)
        if self._deferred_from is not None:
            newest = self._newest_name()
            rank_zero_warn(
                f"StableCheckpoint: training ended in an unhealthy state ({', '.join(self._reasons(trainer))}); "
                f"the save due at step {self._deferred_from} was not written. ckpt_path='last' resumes from "
                f"{newest or 'nothing (no healthy checkpoint yet)'}."
            )

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._saving is not None:  # one of ours (not another writer's save through the Trainer)
            name, kind = self._saving
            checkpoint[recover.RUN_KEY] = recover.record(self._run_id, name, trainer.global_step, kind)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # not ModelCheckpoint's (which may save the state the exception left)
        if self._async is not None:
            self._async.abandon()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._async is not None:
            self._async.close()

    # ------------------------------------------------------------------ each optimizer step
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self._batch_loss = loss if isinstance(loss, Tensor) else None
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # the due save, if healthy
        step = trainer.global_step
        if step == self._boundary:
            return  # a micro-batch that did not step the optimizer
        self._boundary = step
        if self._async is not None:
            self._saved(trainer, self._async.poll())  # an asynchronous save every rank finished: listed now
        if self._preemption.at_boundary(trainer):  # before the deferred save; its own on_train_batch_end then skips
            return  # a signal every rank agrees on: saved (or trying again) and stopping
        if self._deferred_from is not None and _compat.model_checkpoint_saved_at(self) != step:
            self._save_deferred(trainer)

    def _save_deferred(self, trainer: pl.Trainer) -> None:
        """A save that waited for a healthy step: try it on this one (a host read, only while a save waits)."""
        deferred = self._deferred_from
        if not self._healthy(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
        if self.verbose:
            rank_zero_info(f"StableCheckpoint: saved at step {trainer.global_step}, deferred from step {deferred}.")

    def _save_on_signal(self, trainer: pl.Trainer) -> str | None:
        """The save its PreemptionCheckpoint is handed: :meth:`save_now` when this step's state is healthy (or a
        due save of it was written), else ``None`` (said once): the unit tries again at the next boundary, up to
        SIGNAL_DEFER_STEPS, and the end of fit says why nothing was saved."""
        if _compat.model_checkpoint_saved_at(self) != trainer.global_step and not self._healthy(trainer):
            return None
        return self.save_now(trainer)

    # ------------------------------------------------------------------ health
    def _healthy(self, trainer: pl.Trainer) -> bool:
        """Whether the state after the current step may be saved; a save that may not waits (said once)."""
        reasons = self._reasons(trainer)
        if not reasons:
            self._deferred_from = None
            return True
        if self._deferred_from is None:
            self._deferred_from = trainer.global_step
            rank_zero_info(
                f"StableCheckpoint: the state at step {trainer.global_step} is not healthy ({', '.join(reasons)}); "
                "its checkpoint waits for the next healthy step."
            )
        return False

    def _reasons(self, trainer: pl.Trainer) -> list[str]:
        """Why the current state is not healthy (empty: it is), the same on every rank; one check per step."""
        step = trainer.global_step
        if self._health is None or self._health[0] != step:
            self._health = (step, state_problems(trainer, self._batch_loss))
        return self._health[1]

    # ------------------------------------------------------------------ saving and removing
    def _save_topk_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, Tensor]) -> None:
        if not self._healthy(trainer):
            return
        self._save_ring(trainer, monitor_candidates)
        if self.monitor is not None:
            super()._save_topk_checkpoint(trainer, monitor_candidates)

    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, Tensor]) -> None:
        if not self.save_last or not self._healthy(trainer):
            return
        self._kind = LAST
        try:
            super()._save_last_checkpoint(trainer, monitor_candidates)
        finally:
            self._kind = BEST

    def _save_ring(self, trainer: pl.Trainer, monitor_candidates: dict[str, Tensor], force: bool = False) -> None:
        """Write one ring checkpoint (unless the ring is off: ``save_top_k=0`` without monitor), then remove the
        oldest beyond ``keep``."""
        if self.monitor is None and self.save_top_k == 0 and not force:
            return
        filepath = self._get_metric_interpolated_filepath_name(monitor_candidates, trainer)
        self._kind = RING
        try:
            self._save_checkpoint(trainer, filepath)
        finally:
            self._kind = BEST

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if self._async is not None:
            self._wait_for_save(trainer)  # at most one save in flight
        # while Lightning builds the checkpoint, on_save_checkpoint writes this fit's identity into it
        self._saving = (Path(filepath).name, self._kind)
        try:
            if self._async is None:
                super()._save_checkpoint(trainer, filepath)  # every rank; the strategy publishes it whole
            else:
                self._async.start(trainer, Path(filepath), self._kind)
        finally:
            self._saving = None
        if self._async is None:
            self._list(trainer, Path(filepath).name, trainer.global_step, self._kind)
        else:
            _compat.record_model_checkpoint_save(self, trainer, filepath)

    def _list(self, trainer: pl.Trainer, name: str, step: int, kind: str) -> None:
        """A published checkpoint onto the healthy list; a ring one then pushes out the oldest beyond ``keep``."""
        self._healthy_list.add(name, step, kind, write=trainer.is_global_zero)
        self._saved_names.add(name)
        if kind != RING or (self.monitor is None and self.save_top_k == -1):
            return  # save_top_k=-1 without monitor: keep every one
        ring = self._healthy_list.ring()
        for old in ring[: max(len(ring) - self.keep, 0)]:
            self._remove_checkpoint(trainer, str(self._healthy_list.directory / old))

    def _wait_for_save(self, trainer: pl.Trainer) -> None:
        """Every rank: wait for the asynchronous save in flight, if any, and list it."""
        if self._async is not None:
            self._saved(trainer, self._async.wait())

    def _saved(self, trainer: pl.Trainer, done: PendingSave | None) -> None:
        """An asynchronous save every rank finished: listed (unless discarded meanwhile), then the removals that
        waited for it."""
        if done is None:
            return
        if not done.discard:
            self._list(trainer, done.path.name, done.step, done.kind)
        removals, self._removals = self._removals, []
        for filepath in removals:
            self._remove_checkpoint(trainer, filepath)

    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        if self._async is not None and self._async.pending is not None:
            self._removals.append(filepath)  # after the save in flight is published: never fewer checkpoints
            return
        self._healthy_list.drop(Path(filepath).name, write=trainer.is_global_zero)  # off the list, then deleted
        super()._remove_checkpoint(trainer, filepath)

    # ------------------------------------------------------------------ rollback from disk
    def healthy_checkpoints(self, up_to_step: int | None = None) -> list[tuple[Path, int]]:
        """This run's listed healthy checkpoints, newest first, as ``(path, global_step at the save)``; with
        ``up_to_step``, those saved at or before that global step (``TrainingHealthMonitor`` rolls back to them).

        This run's: those this fit saved and, when it resumed from a listed checkpoint, that one and the older
        ones listed: a fresh run in the directory of an earlier run never sees the earlier run's. The same on
        every rank, without reading the disk.
        """
        return [
            (self._healthy_list.directory / e.name, e.step)
            for e in self._healthy_list.newest_first()
            if (e.name in self._saved_names or e.step <= self._resumed_step)
            and (up_to_step is None or e.step <= up_to_step)
        ]

    def discard_newer_than(self, trainer: pl.Trainer, step: int) -> list[Path]:
        """Take the checkpoints saved after global step ``step`` off the list (a rollback found the state they hold
        damaged, or this fit starts before them): ``ckpt_path="last"`` and later rollbacks skip them; the files
        stay. Every rank calls it, rank 0 writes the list. Returns their paths."""
        gone = self._healthy_list.forget_after(step, write=trainer.is_global_zero)
        if self._async is not None and self._async.pending is not None and self._async.pending.step > step:
            self._async.pending.discard = True
        self._saved_names.difference_update(e.name for e in gone)
        return [self._healthy_list.directory / e.name for e in gone]

    def save_now(self, trainer: pl.Trainer) -> str | None:
        """Save the current state at once as a listed healthy checkpoint (and ``last``, with ``save_last``), and
        wait until it is published: what ``ckpt_path="last"`` resumes from (see ``checkpoint/save_now.py``). For a
        caller that knows the state is healthy (``StepReplay`` before it names a failing device; its own
        preemption unit and ``save_at_end`` check first). Every rank calls it. Returns the checkpoint's path
        (``None`` when nothing was saved)."""
        if _compat.model_checkpoint_saved_at(self) != trainer.global_step:
            candidates = self._monitor_candidates(trainer)
            self._save_ring(trainer, candidates, force=True)
            self._save_last_checkpoint(trainer, candidates)
        self._wait_for_save(trainer)
        return self._newest_name()

    def _listed_step(self, resumed: _PATH | None) -> int:
        """The global step of the listed checkpoint at ``resumed`` (-1: none, or not one of this directory)."""
        path = _local_dir(resumed) if resumed else None
        for entry in self._healthy_list.entries:
            if path is not None and self._healthy_list.directory / entry.name == path:
                return entry.step
        return -1

    def _newest_name(self) -> str | None:
        newest = self._healthy_list.newest_first()
        return str(self._healthy_list.directory / newest[0].name) if newest else None

    # ------------------------------------------------------------------ resume
    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """What ``ckpt_path="last"`` may use: the newest listed healthy checkpoint that verifies (or nothing: a
        fresh start, where Lightning's warning and its hint to set ``save_last`` do not apply, hidden until setup)."""
        found = self._newest_healthy(trainer)
        if not found:
            self._hidden.append(_compat.hide_lightning_warning(_compat.NO_LAST_CHECKPOINT))
        return found

    def _newest_healthy(self, trainer: pl.Trainer) -> set[str]:
        directory = _local_dir(_compat.model_checkpoint_dir(self, trainer))
        if directory is None or not directory.is_dir():
            return set()
        if trainer.is_global_zero:
            # Lightning resolves "last" before any hook: finish or undo what a crashed save left here first
            atomic.clean_directory(directory)
        listed = HealthyCheckpoints(directory).load()
        # published, then killed before the list was rewritten: back on the list (every rank finds the same)
        self._taken_back, damaged = recover.unlisted_newer(listed)
        for message in damaged:
            incidents.record(
                trainer, "damaged_checkpoint", "not taken back onto the healthy list", detail=message, step=-1
            )
        if damaged:
            rank_zero_warn(
                f"StableCheckpoint: {len(damaged)} checkpoint(s) in {directory} written after the healthy list was "
                "last written (published, then the run ended before listing them) fail verification and are not "
                "taken back: " + " | ".join(damaged)
            )
        for entry in self._taken_back:
            listed.add(entry.name, entry.step, entry.kind, write=trainer.is_global_zero)
        if self._taken_back:
            rank_zero_warn(
                f"StableCheckpoint: {', '.join(e.name for e in self._taken_back)} in {directory} was published by the "
                "run that last wrote the healthy list, which ended before listing it; it is whole and was healthy "
                "when saved: back on the list."
            )
        refused: list[str] = []

        def passed_over(path: Path, step: int, err: Exception) -> None:
            if isinstance(err, FileNotFoundError):
                return  # taken off the disk since the list was written
            refused.append(str(err))
            incidents.record(
                trainer,
                "damaged_checkpoint",
                "passed over by ckpt_path='last'",
                lost=f"the steps after the next older checkpoint that verifies, up to step {step}",
                detail=str(err),
                step=step,
            )

        candidates = [(directory / entry.name, entry.step) for entry in listed.newest_first()]
        found = recover.newest_verified(candidates, passed_over)
        if found is not None:
            if refused:
                rank_zero_warn(
                    f"StableCheckpoint: ckpt_path='last' resumes from {found.path} (step {found.step}), the newest "
                    f"healthy checkpoint of this run that verifies; {len(refused)} newer one(s) failed "
                    "verification: " + " | ".join(refused)
                )
            return {str(found.read)}
        if refused:
            rank_zero_warn(
                f"StableCheckpoint: no healthy checkpoint in {directory} verifies ({' | '.join(refused)}); "
                "ckpt_path='last' finds nothing to resume from. Fix: pass ckpt_path= a checkpoint you trust, or "
                "start fresh (ckpt_path=None)."
            )
        return set()


def _local_dir(path: _PATH) -> Path | None:
    """``path`` as an absolute local path, or ``None`` for a remote URL."""
    local = local_path(path)
    return Path(os.path.abspath(local)) if local is not None else None


def state_problems(trainer: pl.Trainer, batch_loss: Tensor | None = None) -> list[str]:
    """Why the state after the last optimizer step must not be saved (empty: it may), the same on every rank.

    Reads the step ledger's last outcome, the update's loss (the ledger's when a callback records it, else
    ``batch_loss``), every weight (this rank's shards) and the ledger's health verdict (``StepLedger.health``,
    written by ``TrainingHealthMonitor`` if attached: whether it called the last step it scored a spike);
    max-reduced over ranks with one all-reduce of four numbers. HOST SYNC: one read; call it only where a save
    is due (which syncs anyway).
    """
    module = trainer.lightning_module
    params = [local_tensor(p.detach()) for p in module.parameters()]
    device = params[0].device if params else module.device
    ledger = StepLedger.of(trainer)
    outcome = ledger.outcome
    flags = [torch.as_tensor(outcome, device=device).reshape(()).float()]
    loss = ledger.step.loss if ledger.has_step and ledger.step.loss is not None else batch_loss
    flags.append(
        (~torch.isfinite(loss.detach().float())).any().to(device)
        if loss is not None
        else torch.zeros((), device=device, dtype=torch.bool)
    )
    finite = [torch.isfinite(p).all() for p in params]
    flags.append(~torch.stack(finite).all() if finite else torch.zeros((), device=device, dtype=torch.bool))
    verdict = ledger.health
    flags.append(verdict.spike.to(device) if verdict is not None else torch.zeros((), device=device, dtype=torch.bool))
    values = ranks.max_(torch.stack([f.float() for f in flags]))
    code, loss_bad, weights_bad, spiked = values.tolist()  # HOST SYNC: a save is due
    problems = []
    if code != Outcome.APPLIED:
        problems.append(f"the last update was skipped: {Outcome(int(code)).name}")
    if loss_bad:
        problems.append("the loss is not finite")
    if weights_bad:
        problems.append("a weight is not finite")
    if spiked:
        problems.append("TrainingHealthMonitor flags a spike")
    return problems
