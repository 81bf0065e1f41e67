"""PaLM's recovery from a loss spike: go back to the last good snapshot and skip the data that follows.

:class:`Rollback` keeps the snapshot, takes a new one every ``snapshot_every`` steps once the steps since the last
one are known to be clean, restores it on demand, counts down the batches to skip, and bounds the retries. Every
decision is taken from rank-consistent values, so every rank rolls back together.

A :class:`Snapshot` is a copy of the weights and optimizer state in host memory. Each rank keeps its own local
shard (a DTensor's local part under FSDP2), so it costs host memory of one shard of the model and its optimizer
state per rank, and taking or restoring it needs no collective. Restoring writes into the existing tensors, so the
optimizer, the strategy's wrappers and any reference to a parameter stay valid.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_stability.health.spike_stats import NEW_LEVEL_AFTER
from lightning_stability.norms import local_tensor


class TrainingDivergedError(RuntimeError):
    """Training kept spiking after ``max_rollbacks`` rollbacks."""


class Rollback:
    """Snapshots, restores and the data window to skip.

    Args:
        snapshot_every: steps between snapshots (PaLM restarted from ~100 steps before a spike).
        skip_batches: batches skipped after a rollback (PaLM skipped 200-500).
        max_rollbacks: rollbacks allowed; the next spike raises :class:`TrainingDivergedError`.
    """

    def __init__(self, snapshot_every: int, skip_batches: int, max_rollbacks: int) -> None:
        self.snapshot_every, self.skip_batches, self.max_rollbacks = snapshot_every, skip_batches, max_rollbacks
        self.snapshot: Snapshot | None = None
        self.rollbacks = 0
        self.skip_left = 0

    def take_skip(self) -> bool:
        """Whether this batch belongs to the skipped data window (and count it)."""
        if self.skip_left <= 0:
            return False
        self.skip_left -= 1
        return True

    def maybe_snapshot(self, module: nn.Module, optimizers: Sequence[Optimizer], step: int) -> None:
        """Take a snapshot at ``step`` if the last one is ``snapshot_every`` steps old (the caller knows the steps
        since are clean)."""
        if self.skip_left > 0:
            return
        if self.snapshot is None or step - self.snapshot.step >= self.snapshot_every:
            self.snapshot = Snapshot(module, optimizers, step)  # HOST SYNC: device-to-host copies

    def roll_back(
        self, module: nn.Module, optimizers: Sequence[Optimizer], step: int, skip: bool = True
    ) -> dict[str, Any]:
        """Restore the snapshot and (with ``skip``) start skipping; returns the event to record."""
        if self.snapshot is None:
            raise RuntimeError("roll_back() before any snapshot")
        if self.rollbacks >= self.max_rollbacks:
            raise TrainingDivergedError(
                f"TrainingHealthMonitor: training spiked again at step {step} after {self.rollbacks} rollback(s) "
                f"(max_rollbacks={self.max_rollbacks}). Fix: lower the learning rate, clip harder "
                "(GradientNormMonitor(max_norm=...)), or look at the data around these steps; raise max_rollbacks "
                "to retry more. If the loss settled at a new level for a reason (new data, layers unfrozen), "
                f'response="skip" learns a new level after {NEW_LEVEL_AFTER} steps above the threshold.'
            )
        self.snapshot.restore(module, optimizers)
        self.rollbacks += 1
        self.skip_left = self.skip_batches if skip else 0
        where = "the state at the start" if self.snapshot.step < 0 else f"the state after step {self.snapshot.step}"
        detail = f"restored {where}; " + (
            f"skipping {self.skip_batches} batches" if skip else "training ended, nothing left to skip"
        )
        return {"step": step, "kind": "rollback", "to_step": self.snapshot.step, "detail": detail}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "snapshot": None}  # host copies of the weights stay out of pickles

    def state_dict(self) -> dict[str, Any]:
        return {"rollbacks": self.rollbacks, "skip_left": self.skip_left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollbacks = int(state.get("rollbacks", 0))
        self.skip_left = int(state.get("skip_left", 0))


def _copy(t: Tensor) -> Tensor:
    return local_tensor(t).detach().to("cpu", copy=True)


class Snapshot:
    """Weights (parameters and buffers) and optimizer state, copied to the host.

    Args:
        module: the module whose parameters and buffers are copied.
        optimizers: the optimizers whose state is copied.
        step: a label for the copy (the step it was taken at).
    """

    def __init__(self, module: nn.Module, optimizers: Iterable[Optimizer], step: int) -> None:
        self.step = step
        # HOST SYNC: device-to-host copies (taken on logging steps only)
        self._tensors = [_copy(t) for t in _weights(module)]
        self._optim: list[dict[int, dict[str, Any]]] = []
        for opt in optimizers:
            states: dict[int, dict[str, Any]] = {}
            for index, p in enumerate(_params(opt)):
                state = opt.state.get(p)
                if state:
                    states[index] = {k: _copy(v) if isinstance(v, Tensor) else v for k, v in state.items()}
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
                local_tensor(target).copy_(saved, non_blocking=False)
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
                            local_tensor(current).copy_(value)
                        else:
                            state[key] = (
                                value.to(local_tensor(p).device, copy=True) if isinstance(value, Tensor) else value
                            )


def _weights(module: nn.Module) -> list[Tensor]:
    return [*module.parameters(), *module.buffers()]


def _params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
