"""A publish never leaves the path without a whole checkpoint, and the data is on disk before it is published.

Each file-system step of a publish (a rename, a swap, an unlink, a tree removal) is made to crash in turn (an
exception raised in place of the step: what the disk holds then is what a process killed there leaves). After each
crash the path must resolve to a whole checkpoint holding the old step or the new one (``verify_checkpoint``, then
``clean_directory`` as the next run does); before and after every step it must too. A publish that deletes the old
checkpoint and then renames the new one in fails here: a crash between the two leaves nothing.

The order of ``fsync`` and rename is checked by recording both: the new file's data must be synced before the
rename that publishes it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_stability.checkpoint import atomic
from lightning_stability.checkpoint.atomic import verify_checkpoint


class Crash(BaseException):
    """Raised in place of a file-system step: the process "dies" there."""


def write_file(path: Path, step: int) -> None:
    with open(path, "wb") as f:  # a file object: torch names the archive after a path's stem, which is hidden here
        torch.save({"step": step, "w": torch.full((1000,), float(step))}, f)


def write_dir(path: Path, step: int) -> None:
    dcp.save({"state_dict": {"w": torch.full((1000,), float(step))}}, checkpoint_id=path)
    torch.save({"step": step}, path / "meta.pt")


def read_step(path: Path) -> int:
    """The step of the whole checkpoint at ``path`` (a file or a DCP directory): verify, then read."""
    found = verify_checkpoint(path)
    if found.is_dir():
        target = {"state_dict": {"w": torch.zeros(1000)}}
        dcp.load(target, checkpoint_id=found)
        step = int(torch.load(found / "meta.pt")["step"])
        assert bool((target["state_dict"]["w"] == step).all()), f"{found} mixes two steps"
        return step
    data = torch.load(found)
    assert bool((data["w"] == data["step"]).all())
    return int(data["step"])


class Steps:
    """Wraps every file-system step a publish takes; checks the path before each; crashes at step ``crash_at``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, target: Path, crash_at: int | None) -> None:
        self.target, self.crash_at, self.count = target, crash_at, 0
        self.checked: list[int] = []
        for module, name in ((os, "rename"), (os, "replace"), (os, "unlink"), (shutil, "rmtree")):
            monkeypatch.setattr(module, name, self._wrap(getattr(module, name)))
        monkeypatch.setattr(atomic, "_rename_exchange", self._wrap(atomic._rename_exchange))

    def _wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            if self.count == self.crash_at:
                self.count += 1
                raise Crash
            self.count += 1
            self.checked.append(read_step(self.target))  # whole before this step
            return real(*args, **kwargs)

        return step


LAYOUTS = {
    # (old layout, new layout, exchange): file -> file, directory -> directory (swap, and the two-rename way),
    # file -> directory
    "file": (write_file, write_file, True),
    "dir-exchange": (write_dir, write_dir, True),
    "dir-two-renames": (write_dir, write_dir, False),
    "file-to-dir": (write_file, write_dir, True),
}


def publish_new(tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch, crash_at: int | None) -> Steps:
    old, new, exchange = LAYOUTS[layout]
    target = tmp_path / "last.ckpt"
    old(target, 1)
    partial = atomic.partial_path(target, atomic.new_token())
    new(partial, 2)
    steps = Steps(monkeypatch, target, crash_at)
    try:
        atomic.publish(partial, target, exchange=exchange)
    finally:
        monkeypatch.undo()
    return steps


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_step_of_a_publish_leaves_a_whole_checkpoint(
    tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = publish_new(tmp_path, layout, monkeypatch, crash_at=None)
    assert steps.count >= 1 and set(steps.checked) <= {1, 2}
    assert read_step(tmp_path / "last.ckpt") == 2
    for crash_at in range(steps.count):  # a crash in place of each step in turn
        directory = tmp_path / f"crash{crash_at}"
        directory.mkdir()
        with pytest.raises(Crash):
            publish_new(directory, layout, monkeypatch, crash_at)
        target = directory / "last.ckpt"
        assert read_step(target) in (1, 2), f"crash at step {crash_at}"  # what a load reads now
        atomic.clean_directory(directory)  # what the next run does first
        assert read_step(target) in (1, 2), f"crash at step {crash_at}, after clean_directory"
        assert verify_checkpoint(target) == target
        assert not [p for p in directory.iterdir() if atomic.is_sibling(p.name)]


@pytest.fixture
def sync_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    """``[("fsync", path), ("rename", source), ...]`` in order, for every fsync and rename in the process."""
    log: list[tuple[str, str]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src: Any, dst: Any) -> None:
        log.append(("rename", os.fspath(src)))
        real_rename(src, dst)

    def replace(src: Any, dst: Any) -> None:
        log.append(("rename", os.fspath(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    yield log


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name a file descriptor's path")
@pytest.mark.parametrize("exists", [False, True])
def test_the_data_is_synced_before_the_rename_that_publishes_it(
    tmp_path: Path, sync_log: list[tuple[str, str]], exists: bool
) -> None:
    target = tmp_path / "last.ckpt"
    if exists:
        target.write_bytes(b"old")
    sync_log.clear()
    atomic.save_file(target, lambda f: torch.save({"step": 2}, f))
    published = [i for i, (what, path) in enumerate(sync_log) if what == "rename" and Path(path).parent == tmp_path]
    assert published, sync_log
    source = sync_log[published[-1]][1]  # the hidden sibling renamed onto the target
    assert atomic.is_sibling(Path(source).name)
    synced = [i for i, entry in enumerate(sync_log) if entry == ("fsync", source)]
    assert synced and synced[0] < published[-1], f"{source} was not fsynced before its rename: {sync_log}"
    assert ("fsync", str(tmp_path)) in sync_log[published[-1] :], "the directory entry was not made durable"


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name a file descriptor's path")
def test_the_background_write_syncs_its_file_before_the_rename_that_publishes_it(
    tmp_path: Path, sync_log: list[tuple[str, str]]
) -> None:
    """The same order for ``StableCheckpoint(async_save=True)``, whose background thread writes the file by path
    (torch's own writer) and seals and syncs it itself."""
    import lightning.pytorch as pl

    from lightning_stability import AtomicCheckpointIO, StableCheckpoint
    from tests.helpers import TinyModule, quiet_trainer

    directory = tmp_path / "ckpts"
    pl.seed_everything(0, verbose=False)
    callback = StableCheckpoint(dirpath=directory, every_n_train_steps=1, keep=2, async_save=True)
    trainer = quiet_trainer(
        max_steps=1, plugins=[AtomicCheckpointIO()], callbacks=[callback], enable_checkpointing=True
    )
    trainer.fit(TinyModule(n=8))
    target = directory / "epoch=0-step=1.ckpt"
    published = [  # the checkpoint's sibling (a .pt: torch's writer wants a suffix), not the list's
        i
        for i, (what, path) in enumerate(sync_log)
        if what == "rename" and atomic.is_sibling(Path(path).name) and path.endswith(".pt")
    ]
    assert target.is_file() and len(published) == 1, sync_log
    source = sync_log[published[0]][1]
    synced = [i for i, entry in enumerate(sync_log) if entry == ("fsync", source)]
    assert synced and synced[0] < published[0], f"{source} was not fsynced before its rename: {sync_log}"
    assert ("fsync", str(directory)) in sync_log[published[0] :], "the directory entry was not made durable"
    assert atomic.verify(target) == (target, True)
