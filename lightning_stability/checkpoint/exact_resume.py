"""ExactResume: a mid-epoch checkpoint resumes with the batches and random draws of an uninterrupted run, whoever
writes it (Lightning's ``ModelCheckpoint``, ``trainer.save_checkpoint``, ``StableCheckpoint``)."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_stability import _compat, incidents
from lightning_stability.checkpoint.loader_state import KEY, LoaderResume
from lightning_stability.checkpoint.units import holders_of
from lightning_stability.errors import check_alone
from lightning_stability.incidents import restarts


class ExactResume(Callback):
    """Exact mid-epoch resume: every checkpoint the Trainer writes holds the data position and every rank's RNG
    states, and a fit resumed from one (``trainer.fit(model, ckpt_path=...)``) trains on the batches and draws the
    random numbers an uninterrupted run would have: the same weights and optimizer state, bit for bit.

    Lightning resumes mid-epoch only for a loader with ``state_dict`` (torchdata's ``StatefulDataLoader``); a plain
    ``DataLoader`` starts its epoch again at the first batch, and the RNG states are not saved. With this callback
    a plain ``DataLoader`` over a map-style dataset (``shuffle=True`` or not, Lightning's ``DistributedSampler``, a
    sampler that draws its order from its epoch or when its iteration starts) resumes at the batch after the
    checkpoint's, without loading the skipped samples; torch's (CPU and CUDA), NumPy's and Python's generators and
    the loader's ``generator`` are put back on every rank. What cannot be exact (an ``IterableDataset``, several
    training loaders, draws inside loader workers) is said once at fit start, with the fix. Details: the resume
    how-to of the documentation.

    It works with any checkpoint the Trainer writes: add it next to Lightning's ``ModelCheckpoint`` (any
    ``every_n_train_steps``), ``OnExceptionCheckpoint`` or your own ``trainer.save_checkpoint`` calls. The state goes
    under ``checkpoint["lightning_stability_resume"]``, the key ``StableCheckpoint`` writes: a checkpoint of either
    resumes with either. ``StableCheckpoint`` does all this itself: next to it this callback does nothing (said
    once). Lightning's warning that a plain loader cannot resume mid-epoch is hidden at a resume it makes exact.

    Raises:
        StabilityConfigError: at setup, when the Trainer has two ``ExactResume`` callbacks.

    Example::

        from lightning.pytorch.callbacks import ModelCheckpoint

        trainer = L.Trainer(
            callbacks=[ModelCheckpoint(dirpath="ckpts", every_n_train_steps=500, save_last=True), ExactResume()],
        )
        trainer.fit(model, ckpt_path="last")  # mid-epoch too: the next batch of the interrupted run
    """

    def __init__(self) -> None:
        self._owner = type(self).__name__
        self._part = False  # composed into another callback (StableCheckpoint), which drives it
        self._active = True  # False next to a callback that holds an ExactResume of its own (StableCheckpoint)
        self._loader_resume = LoaderResume(self._owner)
        self._hidden: Any = None  # Lightning's warning filter while its warning does not hold

    @classmethod
    def part_of(cls, owner: str) -> ExactResume:
        """The unit inside another callback (``owner``, which drives its hooks: ``StableCheckpoint``); its messages
        name ``owner``, and it is always active."""
        unit = cls()
        unit._owner = unit._loader_resume.owner = owner
        unit._part = True
        return unit

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_hidden": None}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._show_lightning_warning()
        if stage != "fit":
            return
        self._loader_resume.pending = None  # set by on_load_checkpoint, which comes after setup
        problem = restarts.shared_store_problem(os.environ)
        if problem:
            rank_zero_warn(f"{self._owner}: {problem}")
        if self._part:
            return
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        check_alone(
            self,
            ExactResume,
            callbacks,
            "holds two ExactResume callbacks: each would save and restore the data position and RNG states",
            "keep one ExactResume",
        )
        holders = holders_of(ExactResume, callbacks)
        self._active = not holders
        if holders:
            rank_zero_info(
                f"ExactResume: {type(holders[0]).__name__} already saves and restores the data position and RNG "
                "states in every checkpoint the Trainer writes; ExactResume does nothing in this fit. You can "
                "remove it."
            )

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._active:
            self._loader_resume.load(checkpoint)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._active:
            checkpoint[KEY] = self._loader_resume.capture(trainer)  # every rank: one all-gather

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        if self._loader_resume.pending is not None and self._hidden is None:
            # Lightning warns next (its epoch loop's reset) that a plain loader cannot resume mid-epoch: this one does
            self._hidden = _compat.hide_lightning_warning(_compat.LOADER_NOT_RESUMABLE)
        self._loader_resume.start(trainer)  # the data position and RNG states of a resumed checkpoint
        incidents.fit_started(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active:
            incidents.fit_ended(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active:
            self._loader_resume.epoch_start(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._show_lightning_warning()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._show_lightning_warning()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._show_lightning_warning()

    def _show_lightning_warning(self) -> None:
        """Lightning's warning, hidden while it could not hold, shows again (from the first batch on)."""
        if self._hidden is not None:
            _compat.show_lightning_warning(self._hidden)
            self._hidden = None
