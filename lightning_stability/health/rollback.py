"""PaLM's recovery from a loss spike: go back to the last good snapshot and skip the data that follows.

When to roll back. A spike's own update is always skipped (``response="rollback"`` skips like ``"skip"``), so a
spike caused by one bad batch never reaches the weights, and nothing needs restoring. The damage got into the
weights when a spike *outlasts its skipped update*: the step after a spike spikes too, although the weights it
was scored with are the very weights of the spike (its update was skipped), on a new batch. The cause is then in
the weights (the updates applied before the first spike), not in one batch: :class:`Rollback` restores the last
good snapshot, drops the step's own update (its gradient is of the damaged weights) and skips the next
``skip_batches`` batches.

When it acts, without a host sync. The flag "this step and the one before spiked" is formed on the device at
step ``t + 1`` of a spike at ``t``, copied to the host without waiting (:class:`HostFlag`: pinned memory on a
GPU, an event recorded after the copy) and read at step ``t + 2``, before its update: the rollback comes two
steps after the first spike. The flag is computed from the loss and gradient norm averaged over ranks (one
all-reduce shared with the spike scores), so every rank reads the same flag and rolls back at the same step.

Which snapshot. A snapshot is taken every ``snapshot_every`` steps (at steps that are multiples of it, so a
resumed run takes the same ones), as a *candidate*: it becomes the good snapshot only once its own step and the
next are known not to form such a lasting spike, two steps later (the state it copied is then clean by the rule
above). A rollback restores the good one. Two copies exist only while a candidate waits (two steps).

A :class:`Snapshot` is a copy of the weights and optimizer state in host memory. Each rank keeps its own local
shard (a DTensor's local part under FSDP2), so it costs host memory of one shard of the model and its optimizer
state per rank, and taking or restoring it needs no collective. On a GPU the copy goes to pinned memory without
blocking the host (the copy is ordered on the stream like any kernel, and restoring is too). Restoring writes
into the existing tensors, so the optimizer, the strategy's wrappers and any reference to a parameter stay
valid.

From disk, when memory is not enough. After ``max_rollbacks`` rollbacks from memory (or when the good snapshot is
not older than the damage: the resumed state, right after a resume), and with a ``StableCheckpoint`` attached, the
rollback goes to the newest healthy checkpoint on disk that is older than the damage (saved at a global step at
most that of the newest clean state, :func:`newest_clean_step` + 1), and never twice to the same one: its weights
and optimizer state are loaded in place through the Trainer's strategy (:func:`restore_checkpoint`), every rank
alike; the rest is as from memory (this step's update dropped, ``skip_batches`` batches skipped, the data, the LR
schedule, the loss scale and every callback's state going on forward). At most ``max_disk_rollbacks`` of them;
then, or with no such checkpoint, :class:`TrainingDivergedError` says what to add. After any rollback, the
checkpoints saved after the newest clean state are taken off the healthy list: they hold the damage.

Defaults that fit the run (:func:`scaled_defaults`): PaLM (Chowdhery et al. 2022, section 5.1) restarted from a
checkpoint ~100 steps before a spike and skipped 200-500 batches, in a run of 255k steps; those numbers stand
from 100k steps on. A shorter run gets a snapshot every 1% of its steps (so a rollback loses about 1% of the
updates at most, besides the skipped window) and a window of 0.2% of its steps (PaLM's 200 batches at 100k
steps), at least one step each.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_stability.health.spike_stats import NEW_LEVEL_AFTER
from lightning_stability.norms import local_tensor

#: PaLM's numbers (restart ~100 steps before the spike, skip 200-500 batches): the defaults of long runs
PALM_SNAPSHOT_EVERY, PALM_SKIP_BATCHES = 100, 200
#: the share of a shorter run between snapshots, and skipped after a rollback
SNAPSHOT_FRACTION, SKIP_FRACTION = 0.01, 0.002
#: steps a candidate snapshot waits before it is good: its own step and the next are scored, and the flag of the
#: second is read one step later
CONFIRM_STEPS = 2
#: a rollback comes this many steps after the first spike of a lasting one (the flag of the second is read a step
#: later)
ROLLBACK_DELAY = 2


def newest_clean_step(step: int) -> int:
    """The last step whose state is known clean at a rollback decided at ``step``: the first spike, at ``step - 2``,
    scored the state after ``step - 3`` (the damage); the state after ``step - 4`` scored at ``step - 3`` without a
    lasting spike. A checkpoint saved at global step ``S`` holds the state after step ``S - 1``."""
    return step - ROLLBACK_DELAY - 2


def scaled_defaults(total_steps: float | None) -> tuple[int, int]:
    """``(snapshot_every, skip_batches)`` for a run of ``total_steps`` optimizer steps (``None`` or infinite: not
    known, PaLM's 100 and 200).

    ==========  ===============  ============
    run         snapshot_every   skip_batches
    ==========  ===============  ============
    200         2                1
    1,000       10               2
    10,000      100              20
    100,000+    100              200
    ==========  ===============  ============
    """
    if total_steps is None or not total_steps < float("inf") or total_steps <= 0:
        return PALM_SNAPSHOT_EVERY, PALM_SKIP_BATCHES
    every = min(PALM_SNAPSHOT_EVERY, max(1, int(total_steps * SNAPSHOT_FRACTION)))
    skip = min(PALM_SKIP_BATCHES, max(1, int(total_steps * SKIP_FRACTION)))
    return every, skip


class TrainingDivergedError(RuntimeError):
    """Training kept spiking after ``max_rollbacks`` rollbacks (and ``max_disk_rollbacks`` from disk)."""


class Rollback:
    """Snapshots, restores and the data window to skip.

    Args:
        snapshot_every: steps between snapshots; ``None``: scaled to the run by :meth:`fit_to_run`.
        skip_batches: batches skipped after a rollback; ``None``: scaled to the run by :meth:`fit_to_run`.
        max_rollbacks: rollbacks from memory allowed.
        max_disk_rollbacks: rollbacks from a checkpoint on disk allowed, once those from memory are spent; the next
            one raises :class:`TrainingDivergedError`.
    """

    def __init__(
        self, snapshot_every: int | None, skip_batches: int | None, max_rollbacks: int, max_disk_rollbacks: int = 0
    ) -> None:
        self.asked = (snapshot_every, skip_batches)
        every, skip = scaled_defaults(None)
        self.snapshot_every = every if snapshot_every is None else snapshot_every
        self.skip_batches = skip if skip_batches is None else skip_batches
        self.max_rollbacks = max_rollbacks
        self.max_disk_rollbacks = max_disk_rollbacks
        self.disk_rollbacks = 0  # of `rollbacks`, those from disk
        self.disk_steps: list[int] = []  # the global steps of the checkpoints rolled back to: never twice the same
        self.snapshot: Snapshot | None = None  # the good snapshot: what a rollback restores
        self.candidate: Snapshot | None = None  # the newest snapshot, good once CONFIRM_STEPS steps passed clean
        self._spare: Snapshot | None = None  # a dropped snapshot whose buffers the next one reuses
        self.rollbacks = 0
        self.skip_left = 0

    def fit_to_run(self, total_steps: float | None) -> tuple[int, int]:
        """Scale the settings left at ``None`` to a run of ``total_steps`` steps; returns the settings in use."""
        every, skip = scaled_defaults(total_steps)
        asked_every, asked_skip = self.asked
        self.snapshot_every = every if asked_every is None else asked_every
        self.skip_batches = skip if asked_skip is None else asked_skip
        return self.snapshot_every, self.skip_batches

    def start(self, module: nn.Module, optimizers: Sequence[Optimizer], step: int) -> None:
        """The good snapshot at the start of training (labelled with the last step taken, -1 at the very start)."""
        self.snapshot, self.candidate, self._spare = Snapshot(module, optimizers, step), None, None

    def take_skip(self) -> bool:
        """Whether this batch belongs to the skipped data window (and count it)."""
        if self.skip_left <= 0:
            return False
        self.skip_left -= 1
        return True

    def wants_copy(self, step: int) -> bool:
        """Whether step ``step`` needs the buffers its forward changes copied as it starts: it may take a snapshot
        (:meth:`advance`), or its batch is skipped (:meth:`take_skip`), the forward undone."""
        return self.skip_left > 0 or (step > 0 and step % self.snapshot_every == 0)

    def advance(
        self, module: nn.Module, optimizers: Sequence[Optimizer], step: int, as_started: dict[int, Tensor] | None = None
    ) -> None:
        """At step ``step``, known clean up to ``step - 2``: make a waiting candidate good once it is confirmed,
        and take a new candidate (the state after ``step - 1``) when ``step`` is a multiple of ``snapshot_every``.
        ``as_started``: the buffers this step's forward changed, as the step started (by ``id`` of the buffer;
        ``ForwardState.as_started``), taken for the snapshot in place of their current values."""
        if self.candidate is not None and step >= self.candidate.step + 1 + CONFIRM_STEPS:
            self._spare, self.snapshot, self.candidate = self.snapshot, self.candidate, None
        if self.candidate is None and step > 0 and step % self.snapshot_every == 0:
            self.candidate = Snapshot(module, optimizers, step - 1, reuse=self._spare, as_started=as_started)
            self._spare = None

    @property
    def memory_rollbacks(self) -> int:
        return self.rollbacks - self.disk_rollbacks

    def from_memory(self, step: int) -> bool:
        """Whether a rollback decided at ``step`` restores the good snapshot: some of ``max_rollbacks`` are left
        and the snapshot is older than the damage (the resumed state, right after a resume, may not be)."""
        return (
            self.memory_rollbacks < self.max_rollbacks
            and self.snapshot is not None
            and self.snapshot.step <= newest_clean_step(step)
        )

    def roll_back(
        self, module: nn.Module, optimizers: Sequence[Optimizer], step: int, skip: bool = True
    ) -> dict[str, Any]:
        """Restore the good snapshot and (with ``skip``) start skipping; returns the event to record."""
        if self.snapshot is None:
            raise RuntimeError("roll_back() before any snapshot")
        self.snapshot.restore(module, optimizers)
        if self.candidate is not None:  # taken after the damage got in
            self._spare, self.candidate = self.candidate, None
        self.rollbacks += 1
        where = "the state at the start" if self.snapshot.step < 0 else f"the state after step {self.snapshot.step}"
        return self._start_skipping(step, self.snapshot.step, f"restored {where}", skip)

    def rolled_back_to_disk(
        self, module: nn.Module, optimizers: Sequence[Optimizer], step: int, path: Path, saved_at: int, skip: bool
    ) -> dict[str, Any]:
        """After :func:`restore_checkpoint` loaded the checkpoint at ``path`` (saved at global step ``saved_at``):
        count it, keep its state as the good snapshot, (with ``skip``) start skipping; returns the event."""
        reuse = self.snapshot or self._spare
        self.snapshot, self.candidate, self._spare = Snapshot(module, optimizers, saved_at - 1, reuse=reuse), None, None
        self.rollbacks += 1
        self.disk_rollbacks += 1
        self.disk_steps.append(saved_at)
        event = self._start_skipping(step, saved_at - 1, f"restored {path} (the state after step {saved_at - 1})", skip)
        return {**event, "checkpoint": str(path)}

    def _start_skipping(self, step: int, to_step: int, restored: str, skip: bool) -> dict[str, Any]:
        self.skip_left = self.skip_batches if skip else 0
        detail = f"{restored}; " + (
            f"dropped this step's update and skipping the next {self.skip_batches} batches"
            if skip
            else "training ended, nothing left to skip"
        )
        return {"step": step, "kind": "rollback", "to_step": to_step, "detail": detail}

    def diverged(self, step: int, why_not_disk: str) -> TrainingDivergedError:
        """The error that stops the run: no rollback is left, or none can go back far enough."""
        return TrainingDivergedError(
            f"TrainingHealthMonitor: training spiked again at step {step} after {self.memory_rollbacks} rollback(s) "
            f"(max_rollbacks={self.max_rollbacks}) and {why_not_disk}. Fix: lower the learning rate, clip harder "
            "(GradientNormMonitor(max_norm=...)), or look at the data around these steps; raise max_rollbacks "
            "(max_disk_rollbacks) to retry more. If the loss settled at a new level for a reason (new data, layers "
            f'unfrozen), response="skip" learns a new level after {NEW_LEVEL_AFTER} steps above the threshold.'
        )

    def __getstate__(self) -> dict[str, Any]:
        # host copies of the weights stay out of pickles
        return {**self.__dict__, "snapshot": None, "candidate": None, "_spare": None}

    def state_dict(self) -> dict[str, Any]:
        return {
            "rollbacks": self.rollbacks,
            "skip_left": self.skip_left,
            "disk_rollbacks": self.disk_rollbacks,
            "disk_steps": list(self.disk_steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollbacks = int(state.get("rollbacks", 0))
        self.skip_left = int(state.get("skip_left", 0))
        self.disk_rollbacks = int(state.get("disk_rollbacks", 0))
        self.disk_steps = [int(s) for s in state.get("disk_steps", [])]


def restore_checkpoint(trainer: pl.Trainer, path: Path) -> None:
    """Load the weights and optimizer state of the checkpoint at ``path`` into the running Trainer, in place,
    through its strategy; every rank calls it, at the same step.

    As Lightning's own resume does: ``strategy.load_checkpoint`` (``StableFSDPStrategy`` first checks on every rank
    that the checkpoint is whole, a clear ``CheckpointError`` otherwise, then loads each rank's shards into the
    sharded module and optimizer; ``AtomicCheckpointIO`` checks the file), then ``load_model_state_dict`` (into
    the existing parameters and buffers) and ``load_optimizer_state_dict``. The optimizers' hyperparameters
    (LR, betas, weight decay) are put back as they were: the LR follows the run's schedule, as after a rollback
    from memory. Nothing else of the checkpoint is used (loops, callbacks, loss scale, ledger).
    """
    strategy, module = trainer.strategy, trainer.lightning_module
    kept = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in trainer.optimizers]
    checkpoint = strategy.load_checkpoint(path)
    strategy.load_model_state_dict(checkpoint, strict=module.strict_loading)
    strategy.load_optimizer_state_dict(checkpoint)
    for opt, groups in zip(trainer.optimizers, kept, strict=True):
        for group, hyper in zip(opt.param_groups, groups, strict=True):
            group.update(hyper)


class HostFlag:
    """A 0-dim device flag sent to the host at one step and read at the next, without waiting for the device.

    :meth:`send` starts the copy into a host buffer (pinned on a GPU) and records an event after it;
    :meth:`read` (one step later) waits for that event, which the device has long passed by then, and reads the
    buffer. On a CPU the copy is a plain one. A flag sent and not yet read survives a checkpoint (:meth:`peek`,
    :meth:`load`).
    """

    def __init__(self) -> None:
        self._buf: Tensor | None = None
        self._view: np.ndarray[Any, Any] | None = None  # the buffer as host memory: read without a tensor op
        self._event: torch.cuda.Event | None = None
        self._sent = False
        self._loaded = False

    def send(self, flag: Tensor) -> None:
        if self._buf is None:
            cuda = flag.device.type == "cuda"
            self._buf = torch.zeros(1, dtype=torch.bool, pin_memory=cuda)
            self._view = self._buf.numpy()
        self._buf.copy_(flag.reshape(1), non_blocking=True)
        if flag.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._sent = True

    def read(self) -> bool:
        """The flag sent last (``False`` if none was sent since the last read); forgets it."""
        value = self.peek()
        self._sent = self._loaded = False
        return value

    def peek(self) -> bool:
        """The flag sent last, not forgotten (for checkpoints)."""
        if self._loaded:
            return True
        if not self._sent or self._view is None:
            return False
        if self._event is not None:
            self._event.synchronize()  # the copy was queued a step ago: done, or about to be
        return bool(self._view[0])

    def load(self, value: bool) -> None:
        """A flag sent before a checkpoint: :meth:`read` gives it once."""
        self._loaded, self._sent = bool(value), False

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_buf": None, "_view": None, "_event": None, "_sent": False}


def _copy(t: Tensor, old: Tensor | None) -> Tensor:
    """``t``'s local part in host memory, written into ``old`` when it fits (pinned and without waiting on a
    GPU)."""
    src = local_tensor(t).detach()
    cuda = src.device.type == "cuda"
    if old is None or old.shape != src.shape or old.dtype != src.dtype or old.is_pinned() != cuda:
        old = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=cuda)
    return old.copy_(src, non_blocking=True)


class Snapshot:
    """Weights (parameters and buffers) and optimizer state, copied to the host.

    Args:
        module: the module whose parameters and buffers are copied.
        optimizers: the optimizers whose state is copied.
        step: a label for the copy (the last step whose state it holds).
        reuse: a snapshot no longer needed whose host buffers are written into where they fit.
        as_started: buffers (by ``id``) to copy as they were when the step began, before its forward changed them.
    """

    _tensors: list[Tensor]
    _optim: list[dict[int, dict[str, Any]]]

    def __init__(
        self,
        module: nn.Module,
        optimizers: Iterable[Optimizer],
        step: int,
        reuse: Snapshot | None = None,
        as_started: dict[int, Tensor] | None = None,
    ) -> None:
        self.step = step
        old_tensors = reuse._tensors if reuse is not None else []
        old_optim = reuse._optim if reuse is not None else []
        weights = [as_started.get(id(t), t) for t in _weights(module)] if as_started else _weights(module)
        self._tensors: list[Tensor] = [
            _copy(t, old_tensors[i] if i < len(old_tensors) else None) for i, t in enumerate(weights)
        ]
        self._optim = []
        for o, opt in enumerate(optimizers):
            old_states = old_optim[o] if o < len(old_optim) else {}
            states: dict[int, dict[str, Any]] = {}
            for index, p in enumerate(_params(opt)):
                state = opt.state.get(p)
                if state:
                    old = old_states.get(index, {})
                    states[index] = {
                        k: _copy(v, old.get(k) if isinstance(old.get(k), Tensor) else None)
                        if isinstance(v, Tensor)
                        else v
                        for k, v in state.items()
                    }
            self._optim.append(states)

    @property
    def nbytes(self) -> int:
        """Host bytes held by the copy."""
        total = sum(t.numel() * t.element_size() for t in self._tensors)
        for states in self._optim:
            for state in states.values():
                total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, Tensor))
        return total

    def restore(self, module: nn.Module, optimizers: Iterable[Optimizer]) -> None:
        """Write the copy back into ``module`` and ``optimizers`` in place."""
        with torch.no_grad():
            for target, saved in zip(_weights(module), self._tensors, strict=True):
                local_tensor(target).copy_(saved, non_blocking=True)
            for opt, states in zip(optimizers, self._optim, strict=True):
                for index, p in enumerate(_params(opt)):
                    saved_state = states.get(index)
                    if saved_state is None:
                        opt.state.pop(p, None)  # the parameter had no state yet at the copy
                        continue
                    state = opt.state[p]
                    for key in list(state):
                        if key not in saved_state:
                            del state[key]
                    for key, value in saved_state.items():
                        current = state.get(key)
                        if isinstance(value, Tensor) and isinstance(current, Tensor):
                            local_tensor(current).copy_(value, non_blocking=True)
                        else:
                            state[key] = (
                                value.to(local_tensor(p).device, copy=True) if isinstance(value, Tensor) else value
                            )


def _weights(module: nn.Module) -> list[Tensor]:
    return [*module.parameters(), *module.buffers()]


def _params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
