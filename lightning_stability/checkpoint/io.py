"""AtomicCheckpointIO: Lightning's ``TorchCheckpointIO`` with saves a crash cannot half-write, and clear load errors."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lightning_stability import _compat
from lightning_stability.checkpoint import atomic
from lightning_stability.errors import config_error


def local_path(path: _PATH) -> Path | None:
    """``path`` as a local path, or ``None`` for a remote URL (``s3://...``), which fsspec writes whole."""
    fs, local = url_to_fs(str(path))
    return Path(local) if isinstance(fs, LocalFileSystem) else None


def _weights_only(value: bool | None) -> dict[str, bool]:
    """``weights_only`` for ``TorchCheckpointIO.load_checkpoint``, only when given: Lightning 2.5 has no such
    argument (2.6 added it, and passes ``None`` unless asked)."""
    return {} if value is None else {"weights_only": value}


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoint files that are whole at every instant, for the single-device and DDP strategies.

    A save writes the checkpoint into a hidden sibling of its path (``.lsckpt-partial-<token>``), ``fsync``\\s
    it and publishes it with ``os.replace``: a process killed at any moment leaves the previous checkpoint
    or the new one, never a truncated file. (Lightning's ``TorchCheckpointIO`` writes into the system's temp
    directory and moves the file, a copy when that is another disk, without ``fsync``.) Removing a checkpoint
    (``ModelCheckpoint``'s previous top-k or last) renames it away before deleting it. Hidden siblings a crash
    left behind are deleted before the first save into their directory; their names never match
    ``ModelCheckpoint``'s ``last`` pattern, so ``ckpt_path="last"`` never picks one.

    A load first checks the file is complete (its zip directory is there and fits the file) and raises a
    :class:`~lightning_stability.checkpoint.CheckpointError` naming the path, instead of torch's
    ``OSError: [Errno 22] Invalid argument`` from inside the deserializer. Remote paths (``s3://...``) go
    through Lightning's own code: object stores publish a whole object anyway.

    ``StableTrainer.from_preset`` attaches it when the strategy is a single-device or DDP one and no
    ``CheckpointIO`` was given; ``StableFSDPStrategy`` saves atomically itself.

    Example::

        trainer = L.Trainer(plugins=[AtomicCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
        trainer.fit(model, ckpt_path="last")
    """

    def __init__(self) -> None:
        super().__init__()
        self._cleaned: set[Path] = set()

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise config_error(
                "storage_options", storage_options, "is not used by AtomicCheckpointIO", "drop storage_options"
            )
        target = local_path(path)
        if target is None:
            super().save_checkpoint(checkpoint, path)
            return
        self.prepare_directory(target.parent)
        atomic.save_file(target, lambda f: torch.save(checkpoint, f), seal=True)

    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        target = local_path(path)
        if target is None:
            return super().load_checkpoint(path, map_location=map_location, **_weights_only(weights_only))
        found = atomic.verify_checkpoint(target)
        return super().load_checkpoint(found, map_location=map_location, **_weights_only(weights_only))

    def remove_checkpoint(self, path: _PATH) -> None:
        target = local_path(path)
        if target is None:
            super().remove_checkpoint(path)
        else:
            atomic.remove(target)

    def prepare_directory(self, directory: Path) -> None:
        """Before the first save into ``directory``: clear what a crashed save left there (see ``atomic``)."""
        key = Path(os.path.abspath(directory))
        if key not in self._cleaned:
            atomic.clean_directory(key)
            self._cleaned.add(key)


def install_on(strategy: Any) -> bool:
    """Give a single-device or DDP ``strategy`` without a ``CheckpointIO`` of the user's an ``AtomicCheckpointIO``
    (in place of Lightning's default ``TorchCheckpointIO``, which the strategy would create on first use). Returns
    whether ``strategy`` now saves through one; a user's own ``CheckpointIO`` and other strategies are left alone."""
    if isinstance(strategy, SingleDeviceStrategy | DDPStrategy):
        if _compat.strategy_checkpoint_io(strategy) is None:
            strategy.checkpoint_io = AtomicCheckpointIO()
        return isinstance(strategy.checkpoint_io, AtomicCheckpointIO)
    return False
