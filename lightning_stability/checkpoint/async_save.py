"""Asynchronous checkpoint saves that stay atomic: the step waits only for a copy of the state.

``StableCheckpoint(async_save=True)`` saves in two parts:

1. **In the step**: Lightning's checkpoint dict is built as for a synchronous save (every rank), and every tensor
   that rank writes is copied (:class:`HostCopy`): into pinned host memory with one device synchronize on CUDA, a
   plain copy on CPU, into buffers reused from save to save. Single device, DDP and ``state_dict_type="full"``:
   rank 0 only (it alone writes); sharded: every rank its shards. From here on the training step may change the
   weights: the file is written from the copy, so a NaN that appears after the save cannot reach it. This is what
   Lightning's ``AsyncCheckpointIO`` lacks: it writes the live tensors while training goes on, so a file can mix
   steps (Lightning issue #20953).
2. **In a background thread**: the write into the hidden sibling ``.lsckpt-partial-<token>`` (``torch.save`` by
   path: torch's C++ writer, which leaves the interpreter to the training thread) and its ``fsync``, then the
   publish by the same rename as a synchronous save (:mod:`~lightning_stability.checkpoint.atomic`).
   Single device and DDP: rank 0 writes the file. ``StableFSDPStrategy``: every rank writes its shards with
   ``torch.distributed.checkpoint.async_save`` on a gloo process group of its own (the training's collectives
   never wait for it), rank 0 adds ``meta.pt`` and publishes once every rank's shards are written.

At most one save is in flight: a save due while the previous one is still being written first waits for it (the
step then waits for the rest of that write; with ``every_n_train_steps`` longer than a write it never does).
Every save asked for is written; none is dropped. (With ``save_last=True`` a due save writes two checkpoints, and
the second waits for the first's write: leave ``save_last`` off, ``ckpt_path="last"`` reads the healthy list.)

A checkpoint enters the healthy list (``stable_checkpoints.json``) only once it is published and every rank
agrees its part succeeded. Ranks agree at step boundaries without blocking the step, as the preemption signals
do (``preemption.py``): while a save is in flight, each boundary launches one asynchronous all-reduce of one
small int per rank (pending, done, failed) on another gloo group, and reads the previous boundary's result. A
failure raises :class:`~lightning_stability.checkpoint.CheckpointError` naming the path on every rank at that
boundary, at the next save, or at the end of ``fit``, whichever comes first; the previous checkpoints stay. A
kill during the background write leaves the hidden sibling (deleted at the next start) and the previous
checkpoint as the newest listed: ``ckpt_path="last"`` resumes from it.

Design sources: torchtitan's ``CheckpointManager`` (``async_mode="async"``: a gloo group of its own for the
background DCP save, which the next save waits for), OLMo-core's trainer (asynchronous checkpoints by default) and
``torch.distributed.checkpoint.async_save``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_stability import _compat, ranks
from lightning_stability.checkpoint import atomic
from lightning_stability.checkpoint.atomic import CheckpointError
from lightning_stability.checkpoint.io import AtomicCheckpointIO, install_on
from lightning_stability.errors import config_error

if TYPE_CHECKING:
    from torch.distributed.checkpoint.staging import AsyncStager

_PENDING, _DONE, _FAILED = 0, 1, 2


@runtime_checkable
class ShardedAsyncSaver(Protocol):
    """A strategy that writes its own sharded checkpoints in the background (``StableFSDPStrategy``): every rank
    copies its shards now and hands back its background work."""

    def save_checkpoint_async(
        self, checkpoint: dict[str, Any], filepath: Path, saves: AsyncSaves
    ) -> list[Future[None]]: ...


@dataclass
class PendingSave:
    """A save whose background part has not been agreed finished yet."""

    path: Path  # where it is published
    step: int  # trainer.global_step at the save
    kind: str  # its healthy-list kind (ring.RING, BEST, LAST)
    futures: list[Future[None]] = field(default_factory=list)  # this rank's background work
    discard: bool = False  # not listed when done (a rollback found newer checkpoints damaged)


class AsyncSaves:
    """The background half of ``StableCheckpoint(async_save=True)``: one save in flight, agreed across ranks.

    Subclasses may override :meth:`write_then_publish` (it runs in the background thread) to observe or slow the
    write, e.g. in a test that kills the process in the middle of it.
    """

    def __init__(self) -> None:
        self.pending: PendingSave | None = None
        self.dcp_group: Any = None  # gloo group for StableFSDPStrategy's background DCP writes
        self._exchange_group: Any = None  # gloo group on which ranks agree that a save finished
        self._round: tuple[Any, torch.Tensor] | None = None  # the exchange launched at the last boundary
        self._copy = HostCopy()
        self._executor: ThreadPoolExecutor | None = None
        self._abandoned = False

    def __getstate__(self) -> dict[str, Any]:  # threads, groups and buffers stay with the process
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        AsyncSaves.__init__(self)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer) -> None:
        """Check the strategy can save asynchronously and atomically; create the gloo groups (every rank).

        The background save publishes through ``AtomicCheckpointIO`` (single device, DDP: installed where the user
        gave no ``CheckpointIO``) or a :class:`ShardedAsyncSaver`; any other writer is an error."""
        strategy = trainer.strategy
        atomic_io = install_on(strategy)
        if isinstance(strategy, ShardedAsyncSaver):
            if ranks.is_distributed() and self.dcp_group is None:
                self.dcp_group = dist.new_group(backend="gloo")
        elif not atomic_io:
            raise config_error(
                "async_save",
                True,
                f"needs a writer that publishes whole checkpoints; this Trainer saves with {type(strategy).__name__} "
                f"and {type(strategy.checkpoint_io).__name__}",
                "leave out the CheckpointIO plugin (single device, DDP: AtomicCheckpointIO is then installed) or pass "
                "plugins=[AtomicCheckpointIO()], or strategy=StableFSDPStrategy(), or async_save=False",
            )
        if ranks.world_size() > 1 and self._exchange_group is None:
            self._exchange_group = dist.new_group(backend="gloo")

    def close(self) -> None:
        """Release the thread, the groups and the buffers (after :meth:`wait` or :meth:`abandon`)."""
        if self._executor is not None:
            # a write still running finishes (and publishes) first; after an exception, without waiting here
            self._executor.shutdown(wait=not self._abandoned)
            self._executor = None
        if not self._abandoned and self.pending is None:
            for group in (self.dcp_group, self._exchange_group):
                if group is not None:
                    dist.destroy_process_group(group)
        self.dcp_group = self._exchange_group = None
        self._copy = HostCopy()
        self._abandoned = False

    # ------------------------------------------------------------------ the step's part
    def stager(self) -> AsyncStager:
        """The stager to give ``dcp.async_save``: :class:`HostCopy` (the same buffers from save to save)."""
        from torch.distributed.checkpoint.staging import AsyncStager

        copier = self._copy

        class HostStager(AsyncStager):
            _synchronize_after_execute = False  # the copy is complete when stage returns

            def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
                staged: dict[str, Any] = copier.copy(state_dict, "dcp")
                return staged

            def synchronize_staging(self) -> None:
                return None

            def close(self) -> None:
                return None

        return HostStager()

    def stage(self, state: Any, name: str = "torch.save") -> Any:
        """A copy of ``state`` (nested containers and tensors) in host memory; the device work is finished when it
        returns. Reuses the buffers of the previous save's copy under the same ``name``: call it only when no save
        is in flight."""
        assert self.pending is None, "a save is still in flight"
        return self._copy.copy(state, name)

    def start(self, trainer: pl.Trainer, path: Path, kind: str) -> None:
        """Every rank, where a synchronous save would write: build the checkpoint, copy it, hand the write to the
        background. The previous save must be finished (:meth:`wait`)."""
        assert self.pending is None, "a save is still in flight"
        checkpoint = _compat.dump_checkpoint(trainer)
        strategy = trainer.strategy
        if isinstance(strategy, ShardedAsyncSaver):
            futures = strategy.save_checkpoint_async(checkpoint, path, self)
        else:
            futures = []
            if trainer.is_global_zero:  # the only rank that writes
                staged = self.stage(checkpoint)
                io = strategy.checkpoint_io
                assert isinstance(io, AtomicCheckpointIO)
                path.parent.mkdir(parents=True, exist_ok=True)
                io.prepare_directory(path.parent)
                partial = atomic.partial_path(path, f"{atomic.new_token()}.pt")  # torch's writer wants a suffix
                futures.append(
                    self.submit(
                        lambda: atomic.torch_save_durably(partial, staged),
                        lambda: atomic.publish(partial, path),
                        partial,
                    )
                )
        self.pending = PendingSave(path, trainer.global_step, kind, futures)

    def submit(self, write: Callable[[], None], publish: Callable[[], None], partial: Path | None) -> Future[None]:
        """Run ``write`` then ``publish`` in the background thread; on failure delete ``partial``."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_stability-save")

        def job() -> None:
            try:
                self.write_then_publish(write, publish)
            except BaseException:
                if partial is not None:
                    atomic.delete(partial)
                raise

        return self._executor.submit(job)

    def write_then_publish(self, write: Callable[[], None], publish: Callable[[], None]) -> None:
        """In the background thread: write the hidden sibling (durably), then publish it."""
        write()
        publish()

    # ------------------------------------------------------------------ agreement
    def poll(self) -> PendingSave | None:
        """At a step boundary, every rank: the pending save once every rank agrees it is finished (then no longer
        pending), else ``None``; never waits for the write. Raises ``CheckpointError`` if it failed on some rank."""
        if self.pending is None:
            return None
        if self._exchange_group is None:
            return self._finish([self._local_status()]) if self._local_status() != _PENDING else None
        statuses = None
        if self._round is not None:
            work, buffer = self._round
            work.wait()  # launched a boundary ago: finished, unless another rank's host is behind
            self._round = None
            statuses = buffer.tolist()
            if _PENDING not in statuses:
                return self._finish(statuses)
        self._launch(async_op=True)
        return None

    def wait(self) -> PendingSave | None:
        """Every rank, where all ranks are (a save, the end of fit): wait for the pending save and agree on it;
        returns it (then no longer pending), ``None`` if none. Raises ``CheckpointError`` if it failed."""
        if self.pending is None:
            return None
        for future in self.pending.futures:
            future.exception()  # waits
        if self._exchange_group is None:
            return self._finish([self._local_status()])
        if self._round is not None:
            self._round[0].wait()
            self._round = None
        statuses = self._launch(async_op=False).tolist()
        return self._finish(statuses)

    def abandon(self) -> None:
        """After an exception in training: stop exchanging (other ranks may be gone); a write still running
        finishes in its thread and publishes, but is not listed (the next start finds it, or removes it)."""
        self.pending, self._round = None, None
        self._abandoned = True  # an exchange may still be in flight: its group is left to the process's end

    def _local_status(self) -> int:
        assert self.pending is not None
        if not all(f.done() for f in self.pending.futures):
            return _PENDING
        return _FAILED if any(f.exception() is not None for f in self.pending.futures) else _DONE

    def _launch(self, async_op: bool) -> torch.Tensor:
        buffer = torch.zeros(ranks.world_size(self._exchange_group), dtype=torch.int64)
        buffer[ranks.rank(self._exchange_group)] = self._local_status()
        work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self._exchange_group, async_op=async_op)
        if async_op:
            self._round = (work, buffer)
        return buffer

    def _finish(self, statuses: list[int]) -> PendingSave:
        pending, self.pending = self.pending, None
        assert pending is not None
        failed = [rank for rank, status in enumerate(statuses) if status == _FAILED]
        if failed:
            errors = [f.exception() for f in pending.futures if f.exception() is not None]
            here = f": {type(errors[0]).__name__}: {errors[0]}" if errors else " (see that rank's log)"
            where = f" on rank(s) {failed}" if len(statuses) > 1 else ""
            raise CheckpointError(
                f"The asynchronous save of the checkpoint {pending.path} (step {pending.step}) failed{where}{here}. "
                "It was not published; the previous checkpoints are untouched and ckpt_path='last' resumes from "
                "the newest of them. Fix: the cause above (disk space, permissions, a path every rank can reach), "
                "or save synchronously (async_save=False) to see the error at the save itself."
            ) from (errors[0] if errors else None)
        return pending


class HostCopy:
    """Copies nested state (dicts, lists, tuples) with every plain tensor in a host buffer kept from one copy to
    the next at the same place in the structure (pinned on CUDA, filled with non-blocking copies and one device
    synchronize). A ``DTensor`` keeps its mesh and placements around a copy of its local shard; other tensor types
    (sparse, other subclasses) get a fresh copy; other objects a ``copy.deepcopy``. Tensors that shared storage
    are copied separately (a file then holds both)."""

    def __init__(self) -> None:
        self._buffers: dict[str, dict[tuple[Any, ...], torch.Tensor]] = {}

    def copy(self, state: Any, name: str = "") -> Any:
        """A copy of ``state``; ``name`` keeps the buffers of different states apart (each reused at its next
        copy under the same name, which must come after the previous copy's data was written)."""
        from torch.distributed.tensor import DTensor

        buffers = self._buffers.get(name, {})
        used: dict[tuple[Any, ...], torch.Tensor] = {}
        devices: set[torch.device] = set()

        def walk(obj: Any, path: tuple[Any, ...]) -> Any:
            if isinstance(obj, DTensor):
                local = walk(obj.to_local(), path)
                return DTensor.from_local(
                    local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape, stride=obj.stride()
                )
            if isinstance(obj, torch.Tensor):
                if type(obj) is not torch.Tensor or obj.layout != torch.strided:
                    return obj.detach().to("cpu", copy=True)
                buffer = buffers.get(path)
                if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
                    buffer = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.is_cuda)
                buffer.copy_(obj.detach(), non_blocking=obj.is_cuda)
                if obj.is_cuda:
                    devices.add(obj.device)
                used[path] = buffer
                return buffer
            if isinstance(obj, dict):
                out = copy.copy(obj)  # the same mapping type and attributes (a state dict's ``_metadata``)
                for key, value in obj.items():
                    out[key] = walk(value, (*path, key))
                return out
            if isinstance(obj, list):
                return [walk(value, (*path, i)) for i, value in enumerate(obj)]
            if isinstance(obj, tuple):
                items = [walk(value, (*path, i)) for i, value in enumerate(obj)]
                return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
            if obj is None or isinstance(obj, bool | int | float | complex | str | bytes):
                return obj
            return copy.deepcopy(obj)

        staged = walk(state, ())
        for device in devices:
            torch.cuda.synchronize(device)  # the non-blocking copies are done: the weights may change now
        self._buffers[name] = used
        return staged
