"""Content checksums of checkpoints: recorded as a checkpoint is written, checked before it is read.

A checkpoint published whole can still come back wrong (a bit flipped on storage, a file cut short after the
rename, a shard replaced by a copy tool). Every file of a checkpoint written by ``AtomicCheckpointIO``,
``StableCheckpoint(async_save=True)`` or ``StableFSDPStrategy`` carries a SHA-256 digest of its bytes:

* **a ``torch.save`` file** (a single-file checkpoint, or ``meta.pt`` of a sharded one) holds the digest of
  its own bytes in its zip comment, the archive's last field, which torch leaves empty and every zip reader
  (torch's, Python's) skips: :func:`seal` appends it once the file is written, before its ``fsync``;
* **a sharded (``torch.distributed.checkpoint``) directory**: ``meta.pt`` holds, under :data:`KEY`, the size
  and digest of every other file (each rank hashes the shard files it wrote, :func:`hash_own_files`; rank 0 the
  ``.metadata``), and is itself sealed.

:func:`check_file` and :func:`check_table` recompute the digests and raise :class:`DigestMismatch` naming the
file, the digest recorded and the digest found (``atomic.py`` turns it into a ``CheckpointError`` naming the
checkpoint). A checkpoint written before checksums (or by another writer) has no digest: it is checked for
completeness only, and :func:`check_file` says so by returning ``False``.

The hash is ``hashlib``'s SHA-256 (why, and what it costs a save: ``checksum_cost`` in benchmarks/README.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from lightning_stability import _compat

#: the key of a sharded checkpoint's ``meta.pt`` holding ``{"algorithm", "files": {name: {"size", "digest"}}}``
KEY = "lightning_stability_checksums"
ALGORITHM = "sha256"
_CHUNK = 8 << 20
_OVERLAP_MIN = 1 << 20  # smaller writes are hashed in line
_EOCD = b"PK\x05\x06"  # the zip's end-of-central-directory record: its last 2 bytes are the comment's length
_EOCD_SIZE = 22
_PREFIX = f"lightning_stability {ALGORITHM} ".encode()
_COMMENT_SIZE = len(_PREFIX) + 64  # the prefix and the digest in hex


class DigestMismatch(Exception):
    """A file's bytes differ from what was written: ``what`` says how (size, or digest recorded vs found)."""

    def __init__(self, name: str, what: str) -> None:
        super().__init__(f"{name}: {what}")
        self.name, self.what = name, what


def digest_of(path: Path, limit: int | None = None, tail: bytes = b"") -> str:
    """The SHA-256 of ``path``'s first ``limit`` bytes (all by default) followed by ``tail``, read in chunks."""
    digest = hashlib.sha256()
    remaining = limit if limit is not None else -1
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while remaining:
            n = f.readinto(view if remaining < 0 or remaining >= _CHUNK else view[:remaining])
            if not n:
                break
            digest.update(view[:n])  # hashlib releases the GIL for large buffers: a background save leaves it free
            if remaining > 0:
                remaining -= n
    digest.update(tail)
    return digest.hexdigest()


def _short(digest: str) -> str:
    return f"{ALGORITHM}:{digest[:16]}..."


# ---------------------------------------------------------------------- one torch.save file
class HashingFile:
    """A file for ``torch.save(obj, f)`` that hashes what it writes. Each large buffer is hashed in a second
    thread while the first writes it (both release the GIL): where a core is free, the hash costs little beyond
    the write. Give :meth:`hexdigest` to :func:`seal`."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._digest = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_stability-hash")

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.nbytes < _OVERLAP_MIN:
            self._digest.update(view)
            return self._file.write(view)
        hashed = self._pool.submit(self._digest.update, view)  # the buffer stays valid until write returns
        try:
            return self._file.write(view)
        finally:
            hashed.result()

    def flush(self) -> None:
        self._file.flush()

    def hexdigest(self) -> str:
        """The digest of everything written; ends the hashing thread (call it once, when the writing is done)."""
        self._pool.shutdown()
        return self._digest.hexdigest()


def seal(path: Path, digest: str | None = None) -> None:
    """Record the digest of the ``torch.save`` file at ``path`` (just written, not yet synced) in its zip comment.

    The digest covers the file as torch wrote it (an empty comment): ``digest`` when the writer computed it
    (:class:`HashingFile`), else read back from the file. The comment then holds ``lightning_stability sha256
    <hex>``. A file that does not end in an empty-comment zip record (torch's legacy format) is left as is.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(size - _EOCD_SIZE, 0))
        end = f.read(_EOCD_SIZE)
    if len(end) != _EOCD_SIZE or not end.startswith(_EOCD) or end[-2:] != b"\x00\x00":
        return
    comment = _PREFIX + (digest or digest_of(path)).encode()
    with open(path, "r+b") as f:
        f.seek(size - 2)
        f.write(len(comment).to_bytes(2, "little") + comment)


def check_file(path: Path, name: str | None = None) -> bool:
    """Check a complete ``torch.save`` file against the digest in its zip comment.

    Returns ``True`` when it matches, ``False`` when the file records no digest (written without checksums).

    Raises:
        DigestMismatch: the digest differs, or the digest record itself is damaged.
    """
    name = name or path.name
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(size - _COMMENT_SIZE - _EOCD_SIZE, 0))
        end = f.read()
    record = end[-_COMMENT_SIZE - _EOCD_SIZE :]
    if len(record) < _COMMENT_SIZE + _EOCD_SIZE:
        return False
    eocd, comment = record[:_EOCD_SIZE], record[_EOCD_SIZE:]
    if eocd.startswith(_EOCD) and int.from_bytes(eocd[-2:], "little") == _COMMENT_SIZE:
        recorded = comment.removeprefix(_PREFIX).decode("ascii", "replace")
        if not comment.startswith(_PREFIX) or len(recorded) != 64 or not _is_hex(recorded):
            raise DigestMismatch(name, "its checksum record (the zip comment at the end of the file) is damaged")
        found = digest_of(path, size - _COMMENT_SIZE - 2, b"\x00\x00")
        if found != recorded:
            raise DigestMismatch(name, f"checksum {_short(recorded)} recorded when written, {_short(found)} now")
        return True
    if end[-_EOCD_SIZE:].startswith(_EOCD) and end[-2:] == b"\x00\x00":
        return False  # torch's own end record, no comment: written without checksums
    if _PREFIX[:12] in end:
        raise DigestMismatch(name, "its checksum record (the zip comment at the end of the file) is damaged")
    return False


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


# ---------------------------------------------------------------------- a sharded directory
def hash_own_files(directory: Path, rank: int) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "digest"}}`` of the files of the DCP ``directory`` (written, not yet published) that
    ``rank`` hashes: the shard files it wrote (``torch.distributed.checkpoint`` names them by rank), and on rank 0
    the ``.metadata`` and any file no rank's name claims."""
    from torch.distributed.checkpoint import FileSystemReader

    names = set(_compat.dcp_file_extents(FileSystemReader(str(directory)).read_metadata()))
    names.add(_compat.DCP_METADATA_FILE)
    own = sorted(n for n in names if (_compat.dcp_file_writer_rank(n) or 0) == rank)
    return {name: _entry(directory / name) for name in own}


def _entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "digest": digest_of(path)}


def table(files: Iterable[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """What ``meta.pt`` holds under :data:`KEY`: the files every rank hashed, merged."""
    merged: dict[str, dict[str, Any]] = {}
    for part in files:
        merged.update(part)
    return {"algorithm": ALGORITHM, "files": dict(sorted(merged.items()))}


def check_table(directory: Path, recorded: dict[str, Any], share: tuple[int, int] = (0, 1)) -> None:
    """Check the files of a sharded ``directory`` against the table its ``meta.pt`` recorded.

    Args:
        share: ``(rank, world size)``: check every ``world size``-th file from the ``rank``-th (the ranks of a
            load split the reading); ``(0, 1)``: every file.

    Raises:
        DigestMismatch: a file is missing, of another size, or of another digest than written.
    """
    files = recorded.get("files") if isinstance(recorded, dict) else None
    if recorded.get("algorithm") != ALGORITHM or not isinstance(files, dict):
        raise DigestMismatch("meta.pt", f"its checksum table is unreadable ({str(recorded)[:80]})")
    rank, world = share
    for name in sorted(files)[rank::world]:
        entry, path = files[name], directory / name
        if not path.is_file():
            raise DigestMismatch(name, "the file is missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise DigestMismatch(name, f"{size} bytes, {entry['size']} when written")
        found = digest_of(path)
        if found != entry["digest"]:
            raise DigestMismatch(name, f"checksum {_short(entry['digest'])} recorded when written, {_short(found)} now")


def read_table(meta: Path) -> dict[str, Any] | None:
    """The checksum table in a sharded checkpoint's ``meta.pt`` (``None``: written without checksums)."""
    import torch

    data = torch.load(meta, map_location="cpu", weights_only=False, mmap=True)
    found = data.get(KEY) if isinstance(data, dict) else None
    return found if isinstance(found, dict) else None
