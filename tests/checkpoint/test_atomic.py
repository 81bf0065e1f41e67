"""The file-system pieces of atomic checkpoints, on real files and real DCP directories (one process)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_stability.checkpoint import atomic
from lightning_stability.checkpoint.atomic import CheckpointError, verify_checkpoint

# Lightning's rule for a "last" checkpoint (ModelCheckpoint._find_last_checkpoints): suffix .ckpt, stem ^last
LAST = re.compile(rf"^{ModelCheckpoint.CHECKPOINT_NAME_LAST}(-(\d+))?")


def save_tensors(path: Path, value: float, meta: bool = True) -> None:
    """A real sharded checkpoint (``dcp.save`` in one process writes ``__0_0.distcp``), with ``meta.pt``."""
    dcp.save({"state_dict": {"w": torch.full((1000,), value), "b": torch.full((10,), value)}}, checkpoint_id=path)
    if meta:
        torch.save({"global_step": int(value)}, path / "meta.pt")


def read_value(path: Path) -> float:
    target = {"state_dict": {"w": torch.zeros(1000), "b": torch.zeros(10)}}
    dcp.load(target, checkpoint_id=path)
    return float(target["state_dict"]["w"][0])


def looks_like_last(name: str) -> bool:
    p = Path(name)
    return p.suffix == ModelCheckpoint.FILE_EXTENSION and bool(LAST.match(p.stem))


# ---------------------------------------------------------------------- names
def test_sibling_names_never_look_like_a_last_checkpoint() -> None:
    target = Path("/ckpts/last.ckpt")
    for _ in range(200):
        token = atomic.new_token()
        for name in (atomic.partial_path(target, token).name, f"{atomic.OLD_PREFIX}{token}{atomic.RECORD_SUFFIX}"):
            assert name.startswith(".") and "last" not in name and not name.endswith(".ckpt")
            assert not looks_like_last(name)
            assert atomic.is_sibling(name)
    assert looks_like_last("last.ckpt") and looks_like_last("last-v1.ckpt")  # the rule itself is right


# ---------------------------------------------------------------------- files
def test_save_file_replaces_the_file_whole_and_leaves_no_sibling(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "last.ckpt"
    atomic.save_file(target, lambda f: torch.save({"step": 1}, f))
    atomic.save_file(target, lambda f: torch.save({"step": 2}, f))
    assert torch.load(target)["step"] == 2
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]


def test_a_failing_write_leaves_the_previous_file_and_no_sibling(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    atomic.save_file(target, lambda f: torch.save({"step": 1}, f))

    def fail(f: object) -> None:
        torch.save({"step": 2}, f)  # type: ignore[arg-type]
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic.save_file(target, fail)
    assert torch.load(target)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_truncated_file_gives_an_error_naming_the_path(tmp_path: Path) -> None:
    target = tmp_path / "epoch=0-step=3.ckpt"
    torch.save({"w": torch.randn(10_000)}, target)
    size = target.stat().st_size
    with open(target, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(target))} is incomplete: the file is truncated"):
        verify_checkpoint(target)
    target.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"is incomplete: the file is empty .* Fix: resume from another"):
        verify_checkpoint(target)
    with pytest.raises(FileNotFoundError, match=rf"No checkpoint at {re.escape(str(tmp_path / 'none.ckpt'))}"):
        verify_checkpoint(tmp_path / "none.ckpt")


# ---------------------------------------------------------------------- directories
@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_publish_swaps_a_directory_in_and_removes_the_old_one_after(tmp_path: Path, exchange: bool) -> None:
    target = tmp_path / "last.ckpt"
    save_tensors(target, 1.0)
    partial = atomic.partial_path(target, atomic.new_token())
    save_tensors(partial, 2.0)
    atomic.publish(partial, target, exchange=exchange)
    assert read_value(target) == 2.0
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    # a layout change: a file replaces the directory, and back
    partial = atomic.partial_path(target, atomic.new_token())
    atomic.write_durably(partial, lambda f: torch.save({"step": 3}, f))
    atomic.publish(partial, target, exchange=exchange)
    assert target.is_file() and torch.load(target)["step"] == 3
    partial = atomic.partial_path(target, atomic.new_token())
    save_tensors(partial, 4.0)
    atomic.publish(partial, target, exchange=exchange)
    assert read_value(target) == 4.0 and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_renameat2_exchange_is_used_on_this_machine(tmp_path: Path) -> None:
    if os.uname().sysname != "Linux":
        pytest.skip("renameat2 is Linux's")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.write_text("b")
    assert atomic._rename_exchange(a, b)
    assert a.read_text() == "b" and b.is_dir()


def test_a_crash_between_the_two_renames_is_recovered(tmp_path: Path) -> None:
    """The state the two-rename fallback leaves when killed between its renames, rebuilt on disk."""
    target = tmp_path / "last.ckpt"
    token = atomic.new_token()
    old = tmp_path / f"{atomic.OLD_PREFIX}{token}"
    save_tensors(old, 1.0)  # the previous checkpoint, moved away
    (tmp_path / f"{atomic.OLD_PREFIX}{token}{atomic.RECORD_SUFFIX}").write_bytes(b"last.ckpt")
    save_tensors(atomic.partial_path(target, token), 2.0)  # the new one, never published
    assert not target.exists()
    # a load reads the moved-away checkpoint; the next save's clean-up puts it back and deletes the rest
    assert verify_checkpoint(target) == old
    assert read_value(old) == 1.0
    assert atomic.clean_directory(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert read_value(target) == 1.0


def test_clean_directory_deletes_never_published_siblings_and_keeps_checkpoints(tmp_path: Path) -> None:
    save_tensors(tmp_path / "last.ckpt", 1.0)
    torch.save({"step": 1}, tmp_path / "epoch=0-step=1.ckpt")
    save_tensors(atomic.partial_path(tmp_path / "last.ckpt", "aa"), 2.0, meta=False)
    (tmp_path / f"{atomic.PARTIAL_PREFIX}bb").write_bytes(b"PK\x03\x04 cut")
    (tmp_path / f"{atomic.OLD_PREFIX}cc").mkdir()
    removed = atomic.clean_directory(tmp_path)
    assert len(removed) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=1.ckpt", "last.ckpt"]


def test_remove_never_leaves_a_half_deleted_checkpoint_at_its_path(tmp_path: Path) -> None:
    save_tensors(tmp_path / "epoch=0-step=1.ckpt", 1.0)
    os.symlink("epoch=0-step=1.ckpt", tmp_path / "last.ckpt")
    atomic.remove(tmp_path / "last.ckpt")  # a link: removed, not what it points to
    assert read_value(tmp_path / "epoch=0-step=1.ckpt") == 1.0
    atomic.remove(tmp_path / "epoch=0-step=1.ckpt")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- completeness of a sharded directory
@pytest.fixture()
def sharded(tmp_path: Path) -> Path:
    path = tmp_path / "epoch=0-step=3.ckpt"
    save_tensors(path, 1.0)
    return path


def test_a_complete_sharded_checkpoint_verifies(sharded: Path) -> None:
    assert verify_checkpoint(sharded) == sharded


def test_a_missing_shard_gives_an_error_naming_the_path_and_the_file(sharded: Path) -> None:
    (sharded / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(sharded)
    message = str(info.value)
    assert f"The checkpoint {sharded} is incomplete: 1 of the 1 shard files in .metadata are missing: __0_0.distcp" in (
        message
    )
    assert "Fix: resume from another checkpoint" in message


def test_a_truncated_shard_gives_an_error(sharded: Path) -> None:
    shard = sharded / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=r"shard file __0_0.distcp is truncated \(\d+ bytes, \d+ needed\)"):
        verify_checkpoint(sharded)


def test_missing_or_cut_metadata_gives_an_error(sharded: Path) -> None:
    metadata = sharded / ".metadata"
    content = metadata.read_bytes()
    metadata.write_bytes(content[: len(content) // 2])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(sharded))} is incomplete: .metadata is unreadable"):
        verify_checkpoint(sharded)
    metadata.unlink()
    with pytest.raises(CheckpointError, match=r"is incomplete: .metadata is missing \(the save never finished\)"):
        verify_checkpoint(sharded)


def test_missing_meta_file_gives_an_error(sharded: Path) -> None:
    (sharded / "meta.pt").unlink()
    with pytest.raises(CheckpointError, match=r"meta.pt \(the loops, callbacks and ledger\) is missing"):
        verify_checkpoint(sharded)
    assert verify_checkpoint(sharded, meta_file=None) == sharded
