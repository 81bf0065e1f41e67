"""Content checksums of checkpoints: recorded as a checkpoint is written, checked before it is read.

A checkpoint published whole can still come back wrong (a bit flipped on storage, a file cut short after the
rename, a shard replaced by a copy tool). Every file of a checkpoint written by ``AtomicCheckpointIO``,
``StableCheckpoint(async_save=True)`` or ``StableFSDPStrategy`` carries a CRC-32 of all its bytes:

* **a ``torch.save`` file** (a single-file checkpoint, or ``meta.pt`` of a sharded one) holds the checksum of
  its own bytes in its zip comment, the archive's last field, which torch leaves empty and every zip reader
  (torch's, Python's) skips: :func:`seal` appends it once the file is written, before its ``fsync``;
* **a sharded (``torch.distributed.checkpoint``) directory**: ``meta.pt`` holds, under :data:`KEY`, the size
  and checksum of every other file (each rank those of the shard files it wrote, :func:`hash_own_files`; rank 0
  the ``.metadata``), and is itself sealed.

The checksum is taken as the file is written, not by reading it again: ``torch.save`` already computes the
CRC-32 of every record it writes (the zip format's own, in the archive's directory), and the CRC-32 of a whole
file follows from those and the CRC-32 of the few bytes between the records (headers, directory), which are all
that :func:`seal` reads back (:func:`crc32_combine`). A flipped byte (any damage within 32 consecutive bits) is
always caught, other damage but for a chance of 2**-32; a file cut short or a shard swapped for another's shows
in its size or its checksum. The checksum guards against accidents, not tampering (no checksum stored beside the
data could). Why CRC-32 and what it costs a save: ``checksum_cost`` in benchmarks/README.md.

:func:`check_file` and :func:`check_table` recompute the checksums and raise :class:`DigestMismatch` naming the
file, the checksum recorded and the one found (``atomic.py`` turns it into a ``CheckpointError`` naming the
checkpoint). A record names its algorithm: checkpoints sealed with SHA-256 (before CRC-32) verify as they were
written. A checkpoint written before checksums (or by another writer) has none: it is checked for completeness
only, and :func:`check_file` says so by returning ``False``.
"""

from __future__ import annotations

import functools
import hashlib
import io
import struct
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning_stability import _compat

#: the key of a sharded checkpoint's ``meta.pt`` holding ``{"algorithm", "files": {name: {"size", "digest"}}}``
KEY = "lightning_stability_checksums"
#: the algorithm of the checksums written now; :data:`_HEX_DIGITS` lists those that verify
ALGORITHM = "crc32"
_HEX_DIGITS = {"crc32": 8, "sha256": 64}
_CHUNK = 8 << 20
_RECORD_MIN = 64 << 10  # records this long or longer take torch's CRC-32; shorter ones are read (as cheap)
_AVERAGE_MIN = 16 << 10  # an archive's records shorter on average: read it all (parsing costs ~3 us a record)
_EOCD = b"PK\x05\x06"  # the zip's end-of-central-directory record: its last 2 bytes are the comment's length
_EOCD_SIZE = 22
_LOCAL_HEADER = b"PK\x03\x04"
_PREFIX = b"lightning_stability "
_COMMENT_SIZES = {len(_PREFIX) + len(name) + 1 + digits: name for name, digits in _HEX_DIGITS.items()}


class DigestMismatch(Exception):
    """A file's bytes differ from what was written: ``what`` says how (size, or checksum recorded vs found)."""

    def __init__(self, name: str, what: str) -> None:
        super().__init__(f"{name}: {what}")
        self.name, self.what = name, what


class _Crc32:
    """zlib's CRC-32 with ``hashlib``'s interface."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def update(self, data: Any) -> None:
        self.value = zlib.crc32(data, self.value)  # releases the GIL for large buffers, as hashlib does

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _hasher(algorithm: str) -> Any:
    return _Crc32() if algorithm == "crc32" else hashlib.new(algorithm)


def digest_of(path: Path, limit: int | None = None, tail: bytes = b"", algorithm: str = ALGORITHM) -> str:
    """The checksum of ``path``'s first ``limit`` bytes (all by default) followed by ``tail``, read in chunks."""
    digest = _hasher(algorithm)
    with open(path, "rb", buffering=0) as f:
        _read_into(f, digest, 0, limit)
    digest.update(tail)
    return str(digest.hexdigest())


def _read_into(f: io.RawIOBase, digest: Any, start: int, stop: int | None) -> None:
    """Feed ``digest`` the bytes ``[start, stop)`` of ``f`` (to the end when ``stop`` is ``None``)."""
    f.seek(start)
    remaining = -1 if stop is None else stop - start
    buffer = bytearray(min(_CHUNK, remaining) if remaining >= 0 else _CHUNK)
    view = memoryview(buffer)
    while remaining:
        n = f.readinto(view if remaining < 0 or remaining >= len(view) else view[:remaining])
        if not n:
            break
        digest.update(view[:n])
        if remaining > 0:
            remaining -= n


def _short(algorithm: str, digest: str) -> str:
    return f"{algorithm}:{digest if len(digest) <= 16 else digest[:16] + '...'}"


# ---------------------------------------------------------------------- CRC-32 of a whole from its parts
def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial (reflected bit order, as zlib's ``multmodp``)."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ 0xEDB88320 if b & 1 else b >> 1
    return product


_POWERS = [1 << 30]  # x**(2**k) modulo the polynomial, k = 0..31
for _ in range(31):
    _POWERS.append(_multiply(_POWERS[-1], _POWERS[-1]))


@functools.lru_cache(maxsize=1024)
def _shift(length: int) -> int:
    """x**(8 * length) modulo the polynomial: what appending ``length`` bytes does to a CRC."""
    power, k, n = 1 << 31, 3, length
    while n:
        if n & 1:
            power = _multiply(_POWERS[k % 32], power)
        n >>= 1
        k += 1
    return power


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)`` (zlib's ``crc32_combine``)."""
    return _multiply(_shift(length2), crc1) ^ crc2


class _Window(io.RawIOBase):
    """The bytes ``[base, base + length)`` of an open file, as a file of their own (for ``zipfile``)."""

    def __init__(self, f: io.RawIOBase, base: int, length: int) -> None:
        super().__init__()
        self._f, self._base, self._length, self._pos = f, base, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(start + offset, self._length))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)[: self._length - self._pos]
        self._f.seek(self._base + self._pos)
        n = self._f.readinto(view) or 0
        self._pos += n
        return n


def _torch_records(f: io.RawIOBase, base: int, length: int) -> list[tuple[int, int, int]]:
    """``(offset, size, crc)`` of the long records of the zip archive (a ``torch.save``) at ``[base, base +
    length)`` of ``f``: stored as they are, whose CRC-32 torch computed as it wrote them. ``[]`` if no archive,
    or if its records are short on average (reading them costs less than parsing the archive's directory)."""
    f.seek(base + length - _EOCD_SIZE)
    end = f.read(_EOCD_SIZE)
    if length < _RECORD_MIN or not end.startswith(_EOCD):
        return []
    entries = int.from_bytes(end[10:12], "little")  # 0xFFFF: more, counted in the zip64 record
    if length < entries * _AVERAGE_MIN:
        return []
    try:
        with zipfile.ZipFile(io.BufferedReader(_Window(f, base, length))) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return []  # raw bytes (a bytes item of a sharded checkpoint): read
    found = []
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size < _RECORD_MIN or info.CRC == 0:
            continue  # short; or torch.serialization.set_crc32_options(False) left the CRC out: read
        f.seek(base + info.header_offset)
        header = f.read(30)
        if len(header) < 30 or not header.startswith(_LOCAL_HEADER):
            continue
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        found.append((base + info.header_offset + 30 + name_length + extra_length, info.compress_size, info.CRC))
    return found


def _crc_as_written(path: Path, archives: Iterable[tuple[int, int]], size: int) -> str:
    """The CRC-32 of ``path``'s ``size`` bytes, the ``torch.save`` ``archives`` (``(offset, length)``) in it
    taken by their records' own CRC-32s: only the bytes between the records are read."""
    with open(path, "rb", buffering=0) as f:
        records = sorted(r for base, length in archives for r in _torch_records(f, base, length))
        crc, position = _Crc32(), 0
        for offset, length, record_crc in records:
            if offset < position or offset + length > size:
                continue  # not where a record can be (a damaged directory): its bytes are read with the rest
            _read_into(f, crc, position, offset)
            crc.value = crc32_combine(crc.value, record_crc, length)
            position = offset + length
        _read_into(f, crc, position, size)
    return crc.hexdigest()


# ---------------------------------------------------------------------- one torch.save file
def seal(path: Path) -> None:
    """Record the checksum of the ``torch.save`` file at ``path`` (just written, not yet synced) in its zip
    comment: ``lightning_stability crc32 <hex>``, the CRC-32 of the file as torch wrote it (an empty comment).
    A file that does not end in an empty-comment zip record (torch's legacy format) is left as is."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(size - _EOCD_SIZE, 0))
        end = f.read(_EOCD_SIZE)
    if len(end) != _EOCD_SIZE or not end.startswith(_EOCD) or end[-2:] != b"\x00\x00":
        return
    comment = _PREFIX + f"{ALGORITHM} {_crc_as_written(path, [(0, size)], size)}".encode()
    with open(path, "r+b") as f:
        f.seek(size - 2)
        f.write(len(comment).to_bytes(2, "little") + comment)


def check_file(path: Path, name: str | None = None) -> bool:
    """Check a complete ``torch.save`` file against the checksum in its zip comment.

    Returns ``True`` when it matches, ``False`` when the file records none (written without checksums).

    Raises:
        DigestMismatch: the checksum differs, or the checksum record itself is damaged.
    """
    name = name or path.name
    size = path.stat().st_size
    longest = _EOCD_SIZE + max(_COMMENT_SIZES)
    with open(path, "rb") as f:
        f.seek(max(size - longest, 0))
        end = f.read()
    for comment_size in _COMMENT_SIZES:
        record = end[-comment_size - _EOCD_SIZE :]
        eocd, comment = record[:_EOCD_SIZE], record[_EOCD_SIZE:]
        if len(record) < comment_size + _EOCD_SIZE or not eocd.startswith(_EOCD):
            continue
        if int.from_bytes(eocd[-2:], "little") != comment_size:
            continue
        algorithm, _, recorded = comment.removeprefix(_PREFIX).decode("ascii", "replace").partition(" ")
        if not comment.startswith(_PREFIX) or len(recorded) != _HEX_DIGITS.get(algorithm) or not _is_hex(recorded):
            raise DigestMismatch(name, "its checksum record (the zip comment at the end of the file) is damaged")
        found = digest_of(path, size - comment_size - 2, b"\x00\x00", algorithm)
        if found != recorded:
            raise DigestMismatch(
                name, f"checksum {_short(algorithm, recorded)} recorded when written, {_short(algorithm, found)} now"
            )
        return True
    if end[-_EOCD_SIZE:].startswith(_EOCD):
        if end[-2:] == b"\x00\x00":
            return False  # torch's own end record, no comment: written without checksums
        announced = int.from_bytes(end[-2:], "little")
        raise DigestMismatch(
            name,
            f"it ends where its zip end record announces a {announced}-byte comment (the checksum record): the "
            "file was cut short after it was written",
        )
    if _PREFIX[:12] in end:
        raise DigestMismatch(name, "its checksum record (the zip comment at the end of the file) is damaged")
    return False


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


# ---------------------------------------------------------------------- a sharded directory
def hash_own_files(directory: Path, rank: int) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "digest"}}`` of the files of the DCP ``directory`` (written, not yet published) that
    ``rank`` hashes: the shard files it wrote (``torch.distributed.checkpoint`` names them by rank), and on rank 0
    the ``.metadata`` and any file no rank's name claims. A shard's tensors are ``torch.save`` archives: their
    records' CRC-32s are taken as torch wrote them (see the module's docstring)."""
    from torch.distributed.checkpoint import FileSystemReader

    items = _compat.dcp_item_ranges(FileSystemReader(str(directory)).read_metadata())
    names = set(items) | {_compat.DCP_METADATA_FILE}
    own = sorted(n for n in names if (_compat.dcp_file_writer_rank(n) or 0) == rank)
    files = {}
    for name in own:
        path = directory / name
        size = path.stat().st_size
        files[name] = {"size": size, "digest": _crc_as_written(path, items.get(name, []), size)}
    return files


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
        DigestMismatch: a file is missing, of another size, or of another checksum than written.
    """
    files = recorded.get("files") if isinstance(recorded, dict) else None
    algorithm = recorded.get("algorithm") if isinstance(recorded, dict) else None
    if algorithm not in _HEX_DIGITS or not isinstance(files, dict):
        raise DigestMismatch("meta.pt", f"its checksum table is unreadable ({str(recorded)[:80]})")
    rank, world = share
    for name in sorted(files)[rank::world]:
        entry, path = files[name], directory / name
        if not path.is_file():
            raise DigestMismatch(name, "the file is missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise DigestMismatch(name, f"{size} bytes, {entry['size']} when written")
        found = digest_of(path, algorithm=algorithm)
        if found != entry["digest"]:
            raise DigestMismatch(
                name,
                f"checksum {_short(algorithm, entry['digest'])} recorded when written, {_short(algorithm, found)} now",
            )


def read_table(meta: Path) -> dict[str, Any] | None:
    """The checksum table in a sharded checkpoint's ``meta.pt`` (``None``: written without checksums)."""
    import torch

    data = torch.load(meta, map_location="cpu", weights_only=False, mmap=True)
    found = data.get(KEY) if isinstance(data, dict) else None
    return found if isinstance(found, dict) else None
