"""Checkpoints of FSDP2 models: sharded (``torch.distributed.checkpoint``) or one full file.

Layouts:

* **sharded** (default): a directory. Every rank writes its own shards of the weights and the
  optimizer state through ``torch.distributed.checkpoint`` (keys ``state_dict`` and ``optimizer_<i>``,
  the same layout as Lightning's ``ModelParallelStrategy``); rank 0 adds ``meta.pt`` with the rest of
  the Lightning checkpoint (loops, callbacks, the ``lightning_stability`` ledger, the loss scale, the LR
  schedulers). Tensors are addressed by parameter name, so the directory loads into any world size.
* **full**: one ``torch.save`` file in Lightning's usual format (``state_dict`` with whole tensors,
  ``optimizer_states`` keyed by parameter index like ``Optimizer.state_dict()``), gathered on rank 0.
  A plain single-device Lightning run or ``LightningModule.load_from_checkpoint`` can read it.

:func:`consolidate_checkpoint` turns a sharded directory into the full file, without processes.

Both layouts are written into a hidden sibling of the path and published with one rename by
``StableFSDPStrategy.save_checkpoint`` (see ``lightning_stability/checkpoint/atomic.py``); :func:`save` writes
that sibling, :func:`load` reads a checkpoint the strategy has verified.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_stability import _compat, ranks
from lightning_stability.checkpoint import atomic, checksums
from lightning_stability.errors import check_bool, check_path

META_FILE = "meta.pt"
_MODEL_KEY = "state_dict"
_OPTIM_KEY = "optimizer_{}"
_DCP_METADATA = _compat.DCP_METADATA_FILE


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a directory written by ``torch.distributed.checkpoint``."""
    path = Path(path)
    return path.is_dir() and (path / _DCP_METADATA).is_file()


def _options(full: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=True)


# ---------------------------------------------------------------------- optimizer keys
def index_keyed(osd: dict[str, Any]) -> dict[str, Any]:
    """Re-key a name-keyed optimizer state dict by parameter position (``Optimizer.state_dict()`` form)."""
    names = [name for group in osd["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in osd["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]],
    }


def name_keyed(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Inverse of :func:`index_keyed`, given the parameter names in optimizer order."""
    if osd["state"] and not isinstance(next(iter(osd["state"])), int):
        return osd  # already by name
    return {
        "state": {names[i]: value for i, value in osd["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]],
    }


def optimizer_param_names(module: nn.Module, optimizer: Optimizer) -> list[str]:
    """The names of ``optimizer``'s parameters inside ``module``, in optimizer order."""
    names = {id(p): name for name, p in module.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


# ---------------------------------------------------------------------- gather (all ranks call)
def model_state(module: nn.Module, full: bool) -> dict[str, Any]:
    """The module's state dict: local shards, or (``full``) whole tensors on rank 0 and ``{}`` elsewhere."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_options(full))


def optimizer_state(module: nn.Module, optimizer: Optimizer, full: bool) -> dict[str, Any]:
    """The optimizer's state dict keyed by parameter name (sharded) or by index (``full``, rank 0)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(module, optimizer, options=_options(full))
    return index_keyed(osd) if full and osd else osd


# ---------------------------------------------------------------------- save (all ranks call)
def save(checkpoint: dict[str, Any], partial: Path, *, full: bool, is_global_zero: bool) -> None:
    """Write a Lightning checkpoint dict gathered by :func:`model_state` / :func:`optimizer_state` into ``partial``.

    ``partial`` is the hidden sibling the strategy publishes afterwards: a new file (``full``, written by rank
    0) or an existing empty directory (sharded: every rank writes its shards, rank 0 adds ``meta.pt``). Every
    file is ``fsync``-ed before this returns, and its checksum recorded (``checkpoint/checksums.py``): each rank
    hashes the shards it wrote, rank 0 records them all in ``meta.pt``.
    """
    if full:
        if is_global_zero:
            atomic.write_durably(partial, lambda f: torch.save(checkpoint, f), seal=True)
        return
    import torch.distributed.checkpoint as dcp

    tensors, rest = split_sharded(checkpoint)
    dcp.save(tensors, checkpoint_id=partial)  # FileSystemWriter fsyncs each shard file and .metadata
    files = gather_checksums(partial)
    if is_global_zero:
        write_meta(rest, partial, files)


def gather_checksums(partial: Path, group: Any = None) -> dict[str, Any]:
    """Every rank (after the shards are written): hash this rank's files of the sharded ``partial``; returns the
    table of every rank's (one all-gather on ``group``). A rank that fails to hash raises on every rank."""
    rank = ranks.rank(group)
    try:
        mine: tuple[dict[str, Any], str | None] = (checksums.hash_own_files(partial, rank), None)
    except Exception as err:
        mine = ({}, f"{type(err).__name__}: {err}")
    parts = ranks.gather_objects(mine, group)
    failed = [(r, error) for r, (_, error) in enumerate(parts) if error is not None]
    if failed:
        raise atomic.CheckpointError(f"Hashing the shards of {partial} failed on rank {failed[0][0]}: {failed[0][1]}")
    return checksums.table(files for files, _ in parts)


def split_sharded(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Lightning checkpoint dict as (what DCP writes: weights and optimizer states, the rest: ``meta.pt``)."""
    rest = dict(checkpoint)
    tensors: dict[str, Any] = {_MODEL_KEY: rest.pop(_MODEL_KEY)}
    for i, osd in enumerate(rest.pop("optimizer_states", [])):
        tensors[_OPTIM_KEY.format(i)] = osd
    return tensors, rest


def write_meta(rest: dict[str, Any], partial: Path, files: dict[str, Any]) -> None:
    """Rank 0: ``meta.pt`` (the checkpoint without weights and optimizer states, with the checksums of every other
    file, ``files``) into the sharded ``partial``, sealed with its own checksum."""
    meta = {**rest, checksums.KEY: files}
    atomic.write_durably(partial / META_FILE, lambda f: torch.save(meta, f), seal=True)


# ---------------------------------------------------------------------- load (all ranks call)
def _saved_optimizer_keys(path: Path) -> set[str]:
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {key.split(".", 1)[0] for key in keys if key.startswith("optimizer_")}


def load(path: Path, module: nn.Module, optimizers: list[Optimizer], *, strict: bool = True) -> dict[str, Any]:
    """Load weights and optimizer states into the sharded ``module`` in place, at any world size.

    ``path`` is a checkpoint :func:`~lightning_stability.checkpoint.verify_checkpoint` found complete. Returns
    the rest of the checkpoint (loops, callbacks, ...), as Lightning expects.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if is_sharded_checkpoint(path):
        import torch.distributed.checkpoint as dcp

        saved = _saved_optimizer_keys(path)
        target: dict[str, Any] = {_MODEL_KEY: get_model_state_dict(module)}
        for i, optimizer in enumerate(optimizers):
            if _OPTIM_KEY.format(i) in saved:
                target[_OPTIM_KEY.format(i)] = get_optimizer_state_dict(module, optimizer)
        dcp.load(target, checkpoint_id=path)  # reads the slices this rank's shards need
        set_model_state_dict(module, target[_MODEL_KEY], options=StateDictOptions(strict=strict))
        for i, optimizer in enumerate(optimizers):
            if _OPTIM_KEY.format(i) in target:
                set_optimizer_state_dict(module, optimizer, target[_OPTIM_KEY.format(i)])
        meta: dict[str, Any] = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
        meta.pop(checksums.KEY, None)
        return meta
    checkpoint: dict[str, Any] = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    full = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(module, checkpoint.pop(_MODEL_KEY), options=full)
    for optimizer, osd in zip(optimizers, checkpoint.pop("optimizer_states", []), strict=False):
        osd = name_keyed(osd, optimizer_param_names(module, optimizer))
        set_optimizer_state_dict(module, optimizer, osd, options=StateDictOptions(full_state_dict=True))
    return checkpoint


# ---------------------------------------------------------------------- export (one process)
def consolidate_checkpoint(sharded_dir: str | Path, out_file: str | Path, *, weights_only: bool = False) -> Path:
    """Merge a sharded checkpoint directory into one file, in one process, without a process group.

    Args:
        sharded_dir: the directory a ``StableFSDPStrategy`` (``state_dict_type="sharded"``) wrote.
        out_file: where to write the single file.
        weights_only: write only the model's state dict (``{name: tensor}``) for export, instead of a
            full Lightning checkpoint (weights, optimizer states by index, loops, callbacks, ledger).

    Returns:
        ``Path(out_file)``.

    Raises:
        FileNotFoundError: if ``sharded_dir`` is not a sharded checkpoint directory.
        CheckpointError: if it is incomplete (a shard, ``.metadata`` or ``meta.pt`` missing or cut short).

    Example::

        consolidate_checkpoint("checkpoints/epoch=0-step=100.ckpt", "model.ckpt")
        model = MyModule.load_from_checkpoint("model.ckpt")   # any device, no FSDP
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    check_path("sharded_dir", sharded_dir, "'checkpoints/epoch=0-step=100.ckpt'")
    check_path("out_file", out_file, "'model.pt'")
    check_bool("weights_only", weights_only)
    src, out = atomic.resolve(Path(sharded_dir)), Path(out_file)
    if not src.is_dir():
        raise FileNotFoundError(f"{sharded_dir} is not a sharded checkpoint directory (it is a file).")
    atomic.verify_sharded(src, META_FILE)
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
        merged_file = Path(tmp) / "merged.pt"
        dcp_to_torch_save(src, merged_file)
        merged: dict[str, Any] = torch.load(merged_file, map_location="cpu", weights_only=False)
    model = merged.pop(_MODEL_KEY)
    out.parent.mkdir(parents=True, exist_ok=True)
    if weights_only:
        atomic.save_file(out, lambda f: torch.save(model, f), seal=True)
        return out
    checkpoint: dict[str, Any] = torch.load(src / META_FILE, map_location="cpu", weights_only=False)
    checkpoint.pop(checksums.KEY, None)
    checkpoint[_MODEL_KEY] = model
    optimizer_keys = sorted((k for k in merged if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [index_keyed(merged[k]) for k in optimizer_keys]
    atomic.save_file(out, lambda f: torch.save(checkpoint, f), seal=True)
    return out
