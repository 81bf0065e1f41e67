"""Checkpoints whose bytes changed after they were published whole are refused, naming the file and what differs.

Real files written by the package's own writers (``AtomicCheckpointIO``, the sharded writer of
``StableFSDPStrategy`` in one process), then damaged as storage or a copy tool would: a byte flipped, a file cut
short after the rename, a shard or a whole checkpoint replaced by another step's.
"""

from __future__ import annotations

import hashlib
import shutil
import zlib
from pathlib import Path
from typing import BinaryIO

import pytest
import torch

from lightning_stability.checkpoint import AtomicCheckpointIO, CheckpointError, atomic, checksums, recover
from lightning_stability.checkpoint.ring import Entry
from lightning_stability.strategies import fsdp_checkpoint


def flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


def checkpoint(step: int) -> dict[str, object]:
    torch.manual_seed(step)
    return {
        "state_dict": {"w": torch.randn(64, 64), "b": torch.randn(64)},
        "optimizer_states": [],
        "global_step": step,
        recover.RUN_KEY: recover.record("fit", f"step={step}.ckpt", step, "ring"),
    }


def save_file(directory: Path, step: int) -> Path:
    path = directory / f"step={step}.ckpt"
    AtomicCheckpointIO().save_checkpoint(checkpoint(step), path)
    return path


def save_sharded(directory: Path, step: int) -> Path:
    path = directory / f"step={step}.ckpt"
    partial = atomic.partial_path(path, atomic.new_token())
    partial.mkdir(parents=True)
    fsdp_checkpoint.save(checkpoint(step), partial, full=False, is_global_zero=True)
    atomic.publish(partial, path)
    return path


def refused(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        atomic.verify_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"The checkpoint {path}"), message
    return message


# ---------------------------------------------------------------------- one file
def test_a_file_records_its_checksum_and_loads_as_before(tmp_path: Path) -> None:
    path = save_file(tmp_path, 1)
    assert atomic.verify(path) == (path, True)
    loaded = AtomicCheckpointIO().load_checkpoint(path)
    assert torch.equal(loaded["state_dict"]["w"], checkpoint(1)["state_dict"]["w"])  # type: ignore[index]
    assert torch.load(path, weights_only=False, mmap=True)["global_step"] == 1  # torch's reader skips the comment


@pytest.mark.parametrize("at", [0.3, 0.5, 0.9])
def test_a_flipped_byte_in_a_file_is_refused_with_both_checksums(tmp_path: Path, at: float) -> None:
    path = save_file(tmp_path, 1)
    flip_byte(path, at)
    message = refused(path)
    assert "is damaged" in message or "is incomplete" in message  # a flip in the zip's own records: cut short
    if "is damaged" in message:
        assert "recorded when written" in message and message.count("crc32:") == 2
    with pytest.raises(CheckpointError, match=str(path)):
        AtomicCheckpointIO().load_checkpoint(path)


@pytest.mark.parametrize("cut", [0.5, 20, len(checksums._PREFIX) + len("crc32 ") + 8], ids=["half", "20", "record"])
def test_a_file_cut_after_publish_is_refused(tmp_path: Path, cut: float) -> None:
    """Half the file, part of its checksum record, or the whole record (what is left is a valid zip that announces
    a comment it no longer has: not a file written without checksums)."""
    path = save_file(tmp_path, 1)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * cut) if cut < 1 else size - int(cut))  # half, or the end of the checksum record
    message = refused(path)
    assert ("is incomplete: the file is truncated" if cut < 1 else "checksum record") in message
    if cut == 34:
        assert "cut short" in message, message


def test_a_damaged_checksum_record_is_refused(tmp_path: Path) -> None:
    path = save_file(tmp_path, 1)
    flip_byte(path, at=1 - 10 / path.stat().st_size)  # inside the digest's hex
    assert "its checksum record" in refused(path) or "recorded when written" in refused(path)


def test_a_file_written_without_checksums_is_checked_for_completeness_only(tmp_path: Path) -> None:
    path = tmp_path / "plain.ckpt"
    torch.save(checkpoint(1), path)
    assert atomic.verify(path) == (path, False)


def test_a_file_replaced_by_another_steps_is_refused_against_its_list_entry(tmp_path: Path) -> None:
    path, other = save_file(tmp_path, 2), save_file(tmp_path, 1)
    shutil.copyfile(other, path)  # whole and self-consistent: only the name and step it records tell
    assert atomic.verify(path) == (path, True)
    with pytest.raises(CheckpointError, match=r"names it step=2.ckpt of step 2, it holds step=1.ckpt of step 1"):
        recover.check_listed(path, Entry(path.name, 2, "ring"))


# ---------------------------------------------------------------------- a sharded directory
def test_a_sharded_checkpoint_records_every_files_checksum(tmp_path: Path) -> None:
    path = save_sharded(tmp_path, 1)
    assert atomic.verify(path) == (path, True)
    table = checksums.read_table(path / "meta.pt")
    assert table is not None
    names = {p.name for p in path.iterdir()} - {"meta.pt"}
    assert set(table["files"]) == names and ".metadata" in names and any(n.endswith(".distcp") for n in names)
    module = torch.nn.Module()
    module.w, module.b = torch.nn.Parameter(torch.zeros(64, 64)), torch.nn.Parameter(torch.zeros(64))
    meta = fsdp_checkpoint.load(path, module, [])
    assert torch.equal(module.w.detach(), checkpoint(1)["state_dict"]["w"])  # type: ignore[index]
    assert checksums.KEY not in meta and meta["global_step"] == 1  # what Lightning gets back is unchanged


def shard_of(path: Path) -> Path:
    return sorted(path.glob("*.distcp"))[0]


def test_a_flipped_byte_in_a_shard_is_refused_naming_the_shard(tmp_path: Path) -> None:
    path = save_sharded(tmp_path, 1)
    shard = shard_of(path)
    flip_byte(shard)
    message = refused(path)
    assert f"is damaged: {shard.name}: checksum crc32:" in message and "recorded when written" in message


def test_a_shard_cut_after_publish_is_refused(tmp_path: Path) -> None:
    path = save_sharded(tmp_path, 1)
    shard = shard_of(path)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    assert shard.name in refused(path)


@pytest.mark.parametrize("name", ["shard", ".metadata", "meta.pt"])
def test_a_file_swapped_for_another_steps_is_refused(tmp_path: Path, name: str) -> None:
    path, other = save_sharded(tmp_path, 2), save_sharded(tmp_path, 1)
    swapped = shard_of(path).name if name == "shard" else name
    shutil.copyfile(other / swapped, path / swapped)
    message = refused(path)
    if name == "meta.pt":  # a whole meta.pt of step 1: its table names step 1's shards
        assert "is damaged: " in message
    else:
        assert f"is damaged: {swapped}: " in message


def test_ranks_of_a_load_share_the_files_and_together_check_them_all(tmp_path: Path) -> None:
    path = save_sharded(tmp_path, 1)
    flip_byte(shard_of(path))
    outcomes = []
    for rank in range(2):
        try:
            atomic.verify(path, share=(rank, 2))
            outcomes.append(None)
        except CheckpointError as err:
            outcomes.append(str(err))
    assert sum(o is not None for o in outcomes) == 1, outcomes


# ---------------------------------------------------------------------- the checksum taken as the file is written
def whole_crc(path: Path) -> str:
    """The CRC-32 of a sealed file as torch wrote it: its zip comment taken off, the comment's length 0."""
    data = path.read_bytes()
    eocd = data.rindex(b"PK\x05\x06")
    return f"{zlib.crc32(data[: eocd + 20] + bytes(2)):08x}"


@pytest.mark.parametrize("torch_crc", [True, False])
def test_a_files_checksum_is_the_crc32_of_its_bytes(tmp_path: Path, torch_crc: bool) -> None:
    """Composed from torch's record CRC-32s and the bytes between (or read, where torch computed none)."""
    state = {"big": torch.randn(300_000), "small": torch.randn(10), "many": [torch.randn(20_000) for _ in range(8)]}
    path = tmp_path / "a.pt"
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(torch_crc)
    try:
        atomic.write_durably(path, lambda f: torch.save(state, f), seal=True)
    finally:
        torch.serialization.set_crc32_options(previous)
    assert path.read_bytes().endswith(f"lightning_stability crc32 {whole_crc(path)}".encode())
    assert checksums.check_file(path)


def test_the_checksum_is_what_torch_wrote_not_what_is_read_back(tmp_path: Path) -> None:
    """A record changed between torch's write and the seal (storage already lying) is caught at load: the
    checksum of a long record is torch's own, taken as it wrote it, not read back from the file."""
    path = tmp_path / "a.pt"
    tensor = torch.arange(1 << 18, dtype=torch.float32)

    def save_then_damage(f: BinaryIO) -> None:
        torch.save({"w": tensor}, f)
        f.flush()
        data = bytearray(path.read_bytes())
        at = data.index(tensor[1000:1002].numpy().tobytes())
        data[at] ^= 0x01
        path.write_bytes(bytes(data))

    atomic.write_durably(path, save_then_damage, seal=True)
    with pytest.raises(checksums.DigestMismatch, match="recorded when written"):
        checksums.check_file(path)


def test_a_shards_checksum_is_the_crc32_of_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "sharded.ckpt"
    path.mkdir()
    state = {"state_dict": {"big": torch.randn(300_000), "small": torch.randn(10)}, "optimizer_states": []}
    fsdp_checkpoint.save(state, path, full=False, is_global_zero=True)
    table = checksums.read_table(path / "meta.pt")
    assert table is not None and table["algorithm"] == "crc32"
    for name, entry in table["files"].items():
        assert entry["digest"] == f"{zlib.crc32((path / name).read_bytes()):08x}", name


def test_crc32_combine_matches_zlib() -> None:
    for a, b in [(b"", b""), (b"x", b""), (b"", b"y"), (b"abc" * 1000, bytes(range(256)) * 700)]:
        assert checksums.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


# ---------------------------------------------------------------------- checkpoints sealed with SHA-256 before
def seal_sha256(path: Path) -> None:
    """Seal a torch.save file as this package did before CRC-32: ``lightning_stability sha256 <hex>``."""
    data = path.read_bytes()
    comment = f"lightning_stability sha256 {hashlib.sha256(data).hexdigest()}".encode()
    path.write_bytes(data[:-2] + len(comment).to_bytes(2, "little") + comment)


def test_a_file_sealed_with_sha256_still_verifies_and_a_flip_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.ckpt"
    torch.save(checkpoint(1), path)
    seal_sha256(path)
    assert atomic.verify(path) == (path, True)
    flip_byte(path, 0.5)
    message = refused(path)
    assert "is incomplete" in message or message.count("sha256:") == 2


def test_a_sharded_checkpoint_with_a_sha256_table_still_verifies(tmp_path: Path) -> None:
    path = save_sharded(tmp_path, 1)
    meta = torch.load(path / "meta.pt", weights_only=False)
    files = {
        p.name: {"size": p.stat().st_size, "digest": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in path.iterdir()
        if p.name != "meta.pt"
    }
    meta[checksums.KEY] = {"algorithm": "sha256", "files": files}
    (path / "meta.pt").unlink()
    torch.save(meta, path / "meta.pt")
    seal_sha256(path / "meta.pt")
    assert atomic.verify(path) == (path, True)
    flip_byte(shard_of(path))
    assert f"is damaged: {shard_of(path).name}: checksum sha256:" in refused(path)
