"""Pure file-system work for checkpoints that are never seen half-written: write aside, publish by rename, verify.

A checkpoint (one file, or a directory of ``torch.distributed.checkpoint`` shards) is written into a hidden
sibling ``.lsckpt-partial-<token>`` of its final path, made durable (``fsync``), and published with one rename.
The previous checkpoint at that path is removed only after the new one is published. At every instant a
complete checkpoint is at the path, or (only in the fallback below, between two renames) recoverable:

* a file replaces a file with ``os.replace`` (atomic on POSIX and Windows);
* a directory (or a change of layout, file <-> directory) is swapped in with Linux's
  ``renameat2(RENAME_EXCHANGE)``; where that is unavailable (another OS, a file system without it), the old
  one is first renamed to ``.lsckpt-old-<token>`` next to a record ``.lsckpt-old-<token>.target`` naming the
  path, then the new one is renamed in. If the process dies between the two renames, :func:`resolve` (at load)
  reads the old one and :func:`clean_directory` (at the next save into that directory) puts it back.

The sibling names are hidden, contain no ``last`` and end in no ``.ckpt``: Lightning's
``ModelCheckpoint(save_last=...)`` never resolves one as the last checkpoint (``ckpt_path="last"``), and its
version counter never sees one. They never derive from the checkpoint's own name.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from lightning_stability import _compat
from lightning_stability.checkpoint import checksums
from lightning_stability.errors import check_instance, check_path

PARTIAL_PREFIX = ".lsckpt-partial-"
OLD_PREFIX = ".lsckpt-old-"
RECORD_SUFFIX = ".target"
DCP_METADATA = _compat.DCP_METADATA_FILE

_BROKEN_FIX = (
    "resume from another checkpoint (ckpt_path=...), or delete this one. A checkpoint written by "
    "AtomicCheckpointIO or StableFSDPStrategy is never left like this by a crash; this one was written in place "
    "by another writer, or copied or synced only in part"
)


class CheckpointError(RuntimeError):
    """A checkpoint on disk is incomplete or unreadable, or a save failed on some rank.

    The message names the path, what is missing, and what to do.
    """


# ---------------------------------------------------------------------- names
def new_token() -> str:
    """A fresh random token for the hidden siblings of one save (rank 0 draws it; the others receive it)."""
    return secrets.token_hex(8)


def partial_path(target: Path, token: str) -> Path:
    """Where a save of ``target`` is written before it is published."""
    return target.parent / f"{PARTIAL_PREFIX}{token}"


def is_sibling(name: str) -> bool:
    """Whether ``name`` is one of the hidden siblings this module writes (never a checkpoint to load)."""
    return name.startswith((PARTIAL_PREFIX, OLD_PREFIX))


# ---------------------------------------------------------------------- durability
def fsync_dir(directory: Path) -> None:
    """Make the entries of ``directory`` (created, renamed, removed) durable; a no-op where unsupported."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # Windows cannot open a directory
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory
    finally:
        os.close(fd)


def write_durably(path: Path, write: Callable[[BinaryIO], object], *, seal: bool = False) -> None:
    """Create ``path`` (which must not exist), fill it with ``write(file)``, and ``fsync`` it; with ``seal``
    (``write`` does a ``torch.save``), record its checksum in it first (:func:`checksums.seal`)."""
    with open(path, "xb") as f:
        write(f)
        f.flush()
        if seal:
            checksums.seal(path)
        os.fsync(f.fileno())


def torch_save_durably(path: Path, obj: object, *, seal: bool = True) -> None:
    """``torch.save(obj)`` into ``path`` (which must not exist and must have a suffix, e.g. ``.pt``: torch names
    the archive after the file's stem), then ``fsync``. Given a path, torch's own C++ writer writes the file
    without calling back into Python for every chunk, so a background save leaves the interpreter to the training
    thread. Its checksum is recorded in it (:func:`checksums.seal`) before the ``fsync``; ``seal=False`` (for
    comparisons) leaves it out."""
    import torch

    if os.path.lexists(path):
        raise FileExistsError(errno.EEXIST, "a checkpoint's hidden sibling already exists", str(path))
    torch.save(obj, str(path))
    if seal:
        checksums.seal(path)
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_file(target: Path, write: Callable[[BinaryIO], object], *, seal: bool = False) -> None:
    """Write one file atomically: ``write(file)`` into a hidden sibling, ``fsync``, then publish at ``target``;
    ``seal``: ``write`` does a ``torch.save``, whose checksum is recorded in the file (see :func:`write_durably`).

    Whatever happens, ``target`` holds the previous checkpoint or the new one, whole.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(target, new_token())
    try:
        write_durably(partial, write, seal=seal)
        publish(partial, target)
    except BaseException:
        delete(partial)
        raise


# ---------------------------------------------------------------------- publish and remove
def _rename_exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), ctypes.c_uint(rename_exchange)) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM, errno.EXDEV):
        return False  # this kernel or file system cannot swap: take the two-rename way
    raise OSError(err, os.strerror(err), str(b))


def publish(partial: Path, target: Path, *, exchange: bool = True) -> None:
    """Put the complete ``partial`` at ``target`` with one rename; then remove what was at ``target``.

    Args:
        partial: a hidden sibling (:func:`partial_path`) holding the complete new checkpoint, already synced.
        target: the checkpoint's path; whatever is there (file, directory, symlink) is replaced.
        exchange: try ``renameat2(RENAME_EXCHANGE)`` when a directory is involved (``False`` forces the
            two-rename fallback, which :func:`clean_directory` recovers from).
    """
    parent = target.parent
    if partial.is_dir():
        fsync_dir(partial)
    if not os.path.lexists(target):
        os.rename(partial, target)
    elif not partial.is_dir() and (target.is_symlink() or not target.is_dir()):
        os.replace(partial, target)
    elif exchange and _rename_exchange(partial, target):
        fsync_dir(parent)
        delete(partial)  # the previous checkpoint, now under the hidden name
    else:
        token = partial.name.removeprefix(PARTIAL_PREFIX)
        old, record = parent / f"{OLD_PREFIX}{token}", parent / f"{OLD_PREFIX}{token}{RECORD_SUFFIX}"
        write_durably(record, lambda f: f.write(os.fsencode(target.name)))
        fsync_dir(parent)
        os.rename(target, old)  # from here until the next rename, the checkpoint is `old` (see resolve)
        os.rename(partial, target)
        fsync_dir(parent)
        delete(old)
        record.unlink()
    fsync_dir(parent)


def delete(path: Path) -> None:
    """Remove a file, a symlink (not what it points to) or a directory tree; nothing if absent."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def remove(path: Path) -> None:
    """Remove a checkpoint so that no half-deleted one is ever left at ``path``: rename it away, then delete."""
    if not os.path.lexists(path):
        return
    old = path.parent / f"{OLD_PREFIX}{new_token()}"
    os.rename(path, old)
    fsync_dir(path.parent)
    delete(old)


def _records(directory: Path) -> list[tuple[Path, Path, Path]]:
    """``(record, old, target)`` for each two-rename publish in ``directory`` that did not finish."""
    found = []
    for record in directory.glob(f"{OLD_PREFIX}*{RECORD_SUFFIX}"):
        try:
            name = os.fsdecode(record.read_bytes())
        except OSError:
            continue
        if name and os.sep not in name:
            found.append((record, directory / record.name.removesuffix(RECORD_SUFFIX), directory / name))
    return found


def resolve(path: Path) -> Path:
    """The checkpoint to read for ``path``: ``path`` itself, or the previous one a crash left moved away.

    Raises:
        FileNotFoundError: nothing at ``path`` and nothing recoverable for it.
    """
    if os.path.lexists(path):
        return path
    if path.parent.is_dir():
        for _, old, target in _records(path.parent):
            if target.name == path.name and old.exists():
                return old
    raise FileNotFoundError(
        f"No checkpoint at {path} (neither a file nor a directory). Fix: pass the path of an existing checkpoint "
        "(ckpt_path=...), or ckpt_path='last' to let ModelCheckpoint find the newest."
    )


def clean_directory(directory: Path) -> list[str]:
    """Finish or undo what a crash left in ``directory``; return the names removed or put back.

    A checkpoint moved away by an unfinished two-rename publish goes back to its path when that path is empty;
    every other hidden sibling (never published, or already replaced) is deleted. Call it only where no other
    process is saving into ``directory`` at the same time (the writing rank, before its first save there).
    """
    if not directory.is_dir():
        return []
    done = []
    for record, old, target in _records(directory):
        if old.exists() and not os.path.lexists(target):
            try:
                verify_checkpoint(old)
            except (CheckpointError, FileNotFoundError):
                pass
            else:
                os.rename(old, target)
                done.append(f"{old.name} -> {target.name}")
        record.unlink(missing_ok=True)
    for entry in directory.iterdir():
        if is_sibling(entry.name):
            delete(entry)
            done.append(entry.name)
    fsync_dir(directory)
    return done


# ---------------------------------------------------------------------- completeness and content
def _broken(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"The checkpoint {path} is incomplete: {what}. Fix: {_BROKEN_FIX}.")


def _damaged(path: Path, err: checksums.DigestMismatch, within: bool = True) -> CheckpointError:
    what = f"{err.name}: {err.what}" if within else err.what
    return CheckpointError(
        f"The checkpoint {path} is damaged: {what}. It was published whole; its bytes changed "
        "since (storage, a copy tool, a quota cutting a file). Fix: resume from another checkpoint (ckpt_path='last' "
        "takes the newest that verifies), or delete this one."
    )


def verify_file(path: Path, shown: Path | None = None) -> bool:
    """Check that a ``torch.save`` file is whole (its zip directory, at the end, is there and fits the file) and,
    when it records a checksum, that its bytes match it. Returns whether a checksum was checked.

    Files in torch's legacy (non-zip) format pass.
    """
    shown = shown or path
    size = path.stat().st_size
    if size == 0:
        raise _broken(shown, "the file is empty (0 bytes)")
    with open(path, "rb") as f:
        is_zip = f.read(4) == b"PK\x03\x04"
    if not is_zip:
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            end = max((i.header_offset + i.compress_size for i in archive.infolist()), default=0)
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise _broken(shown, f"the file is truncated ({size} bytes; its zip directory is missing: {err})") from err
    if end > size:
        raise _broken(shown, f"the file is truncated ({size} bytes; its records need {end})")
    try:
        return checksums.check_file(path)
    except checksums.DigestMismatch as err:
        raise _damaged(shown, err, within=False) from None


def verify_sharded(path: Path, meta_file: str | None = "meta.pt", share: tuple[int, int] = (0, 1)) -> bool:
    """Check that a ``torch.distributed.checkpoint`` directory is whole and, when ``meta_file`` records
    checksums, that every file matches them. Returns whether checksums were checked.

    Its ``.metadata`` must be readable, every file that metadata references present and long enough, and
    ``meta_file`` (the rest of a Lightning checkpoint) present and whole. ``share``: ``(rank, world size)`` of a
    load whose ranks split the reading of the shards (see :func:`checksums.check_table`).
    """
    from torch.distributed.checkpoint import FileSystemReader

    metadata_file = path / DCP_METADATA
    if not metadata_file.is_file():
        raise _broken(path, f"{DCP_METADATA} is missing (the save never finished)")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # a pickle cut short raises anything from EOFError to UnpicklingError
        raise _broken(path, f"{DCP_METADATA} is unreadable ({type(err).__name__}: {err})") from err
    needed = _compat.dcp_file_extents(metadata)
    missing = sorted(name for name in needed if not (path / name).is_file())
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise _broken(path, f"{len(missing)} of the {len(needed)} shard files in {DCP_METADATA} are missing: {shown}")
    short = sorted(name for name, size in needed.items() if (path / name).stat().st_size < size)
    if short:
        name = short[0]
        raise _broken(
            path, f"shard file {name} is truncated ({(path / name).stat().st_size} bytes, {needed[name]} needed)"
        )
    if meta_file is None:
        return False
    if not (path / meta_file).is_file():
        raise _broken(path, f"{meta_file} (the loops, callbacks and ledger) is missing")
    verify_file(path / meta_file, shown=path / meta_file)
    recorded = checksums.read_table(path / meta_file)
    if recorded is None:
        return False
    try:
        checksums.check_table(path, recorded, share)
    except checksums.DigestMismatch as err:
        raise _damaged(path, err) from None
    return True


def verify(
    path: str | os.PathLike[str], meta_file: str | None = "meta.pt", share: tuple[int, int] = (0, 1)
) -> tuple[Path, bool]:
    """:func:`verify_checkpoint`, also saying whether checksums were checked (``False``: completeness only)."""
    found = resolve(Path(path))
    if found.is_dir():
        return found, verify_sharded(found, meta_file, share)
    return found, verify_file(found)


def verify_checkpoint(path: str | os.PathLike[str], *, meta_file: str | None = "meta.pt") -> Path:
    """Check that the checkpoint at ``path`` (a ``torch.save`` file or a sharded directory) is complete and that
    its bytes are those written.

    Checkpoints written by ``AtomicCheckpointIO``, ``StableCheckpoint`` and ``StableFSDPStrategy`` record a
    CRC-32 of every file (before, a SHA-256; see ``checkpoint/checksums.py``); each is recomputed. Checkpoints
    written without (older ones, other writers) are checked for completeness only.

    Args:
        path: a checkpoint file, or a directory written by ``torch.distributed.checkpoint``.
        meta_file: the file a sharded directory must also hold (``StableFSDPStrategy`` and Lightning's FSDP
            strategies write ``meta.pt``); ``None`` checks the shards' completeness only.

    Returns:
        The path to read: ``path``, or the previous checkpoint a crash left moved away (see :func:`resolve`).

    Raises:
        CheckpointError: the checkpoint is incomplete, or damaged (a file's size or checksum differs from what
            was written); the message names the path, the file and what differs.
        FileNotFoundError: there is no checkpoint at ``path``.

    Example::

        verify_checkpoint("checkpoints/last.ckpt")   # before handing the path to another job
    """
    check_path("path", path, "'checkpoints/last.ckpt'")
    if meta_file is not None:
        check_instance("meta_file", meta_file, str, "a file name or None", "'meta.pt'")
    return verify(path, meta_file)[0]
