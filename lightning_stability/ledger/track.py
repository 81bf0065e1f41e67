"""One optimizer's record in the ledger (:class:`OptimizerRecord`) and the :class:`Outcome` of a step."""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability.norms import local_tensor


class Outcome(IntEnum):
    """What happened to one optimizer step. Lower values win when several reasons apply."""

    APPLIED = 0
    SKIPPED_SCALER = 1  # the fp16 loss scaler found inf/NaN in the scaled gradients
    SKIPPED_NONFINITE = 2  # a non-finite gradient norm (GradientNormMonitor)
    SKIPPED_SPIKE = 3  # a loss or gradient spike (health monitoring)
    SKIPPED_ROLLBACK = 4  # a batch of the data window skipped after a rollback (health monitoring)
    SKIPPED_QUARANTINED = 5  # a micro-batch of the step has no sample left that is not quarantined (StepReplay)


def applied_flag(outcome: Outcome | Tensor, device: torch.device) -> Tensor:
    """0-dim bool on ``device``: a step of this ``outcome`` (``ledger.outcome``: an :class:`Outcome`, or a tensor when
    decided on the device) applied its update. No host read."""
    if isinstance(outcome, Tensor):
        return (outcome == int(Outcome.APPLIED)).to(device)
    return torch.full((), outcome == Outcome.APPLIED, dtype=torch.bool, device=device)


def device_of(optimizer: Optimizer) -> torch.device:
    """The device of the optimizer's first parameter (its local shard's, for a sharded one)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            return local_tensor(p).device
    return torch.device("cpu")


class OptimizerRecord:
    """One optimizer's record in the ledger: attempted steps, outcome counts on the device, window sums.

    Attributes:
        index: the optimizer's position in ``trainer.optimizers``.
        name: its metric suffix when there are several optimizers (``LearningRateMonitor``'s naming:
            the class name, ``-1``, ``-2``, ... for repeats).
        steps: optimizer steps attempted so far (host integer, skipped ones included).
    """

    def __init__(self, index: int, name: str, state: dict[str, Any] | None = None) -> None:
        self.index = index
        self.name = name
        self.device = torch.device("cpu")
        self._placed = False
        self.steps = 0
        self._counts: Tensor | None = None
        self._per_outcome: tuple[Tensor, ...] = ()
        self._skipped_view: Tensor | None = None  # counts[1:], every outcome but APPLIED
        self._one: Tensor | None = None
        self._loaded_counts = [0] * len(Outcome)
        self._host_counts: list[int] | None = [0] * len(Outcome)
        self._unsent = [0] * len(Outcome)  # host-decided steps not yet added to the device counts
        self._any_unsent = False
        self._window: dict[str, Tensor] = {}
        if state is not None:
            self.load_state_dict(state)

    def place(self, device: torch.device) -> None:
        """Keep the counters on ``device`` (the optimizer's), once."""
        if self._placed:
            return
        self._placed, self.device = True, device
        self._window = {k: v.to(device) for k, v in self._window.items()}
        if self._counts is not None:
            self._counts = self._counts.to(device)
            self._bind_counts()

    def __getstate__(self) -> dict[str, Any]:
        # views would come back as copies of their own: rebuilt on the next read of `counts`
        return {**self.__dict__, "_per_outcome": (), "_skipped_view": None, "_one": None}

    @property
    def counts(self) -> Tensor:
        """Steps per :class:`Outcome` since the start of training (int64 tensor on the device)."""
        if self._counts is not None and self._skipped_view is None:
            self._bind_counts()
        if self._counts is None:
            # once per run: a resumed run's counts come from the checkpoint, before the first step
            self._counts = torch.tensor(self._loaded_counts, dtype=torch.int64, device=self.device)
            self._bind_counts()
        if self._any_unsent:
            # Host-decided steps reach the device when read, not in the step: one add of a host number per
            # outcome (a kernel argument, no copy), however many steps passed.
            for outcome, n in enumerate(self._unsent):
                if n:
                    self._per_outcome[outcome].add_(n)
            self._unsent, self._any_unsent = [0] * len(Outcome), False
        return self._counts

    def _bind_counts(self) -> None:
        """Views and a constant made once per counts table, not per step."""
        assert self._counts is not None
        self._per_outcome = self._counts.unbind(0)  # one in-place add per outcome brings them up to date
        self._skipped_view = self._counts[Outcome.APPLIED + 1 :]  # every outcome but APPLIED (APPLIED is 0)
        self._one = torch.ones(1, dtype=self._counts.dtype, device=self._counts.device)

    @property
    def counted_on_host(self) -> bool:
        """Whether every outcome so far was decided on the host: :attr:`applied_steps` and :attr:`skipped_steps`
        are then host ints (no device op to read them)."""
        return self._host_counts is not None

    @property
    def applied_steps(self) -> int | Tensor:
        """Optimizer updates actually applied: a host ``int`` while every outcome so far was decided on the host,
        else a 0-dim int64 tensor on the device. ``int(record.applied_steps)`` gives a number either way (a
        HOST SYNC when it is a tensor: for setup and checkpoints, not for the step)."""
        if self._host_counts is not None:
            return self._host_counts[Outcome.APPLIED]
        return self.counts[Outcome.APPLIED]

    @property
    def skipped_steps(self) -> int | Tensor:
        """Optimizer steps skipped for any reason: a host ``int`` or a device tensor, as :attr:`applied_steps`."""
        if self._host_counts is not None:
            return sum(self._host_counts) - self._host_counts[Outcome.APPLIED]
        self.counts  # noqa: B018 -- brings the table up to date
        assert self._skipped_view is not None
        return self._skipped_view.sum()

    def count(self, outcome: Outcome | Tensor) -> None:
        if isinstance(outcome, Tensor):
            counts = self.counts
            assert self._one is not None
            counts.index_add_(0, outcome.view(1), self._one)
            self._host_counts = None
        else:
            if self._counts is None:
                self.counts  # noqa: B018 -- the device table is built from host data once, on the first step
            self._unsent[outcome] += 1
            self._any_unsent = True
            if self._host_counts is not None:
                self._host_counts[outcome] += 1

    def accumulate(self, key: str, value: Tensor | float) -> None:
        """Add ``value`` to this optimizer's window sum ``key`` (on the device, saved in checkpoints)."""
        current = self._window.get(key)
        if isinstance(value, Tensor):
            value = value.to(torch.float32)
        if current is None:
            # a fill plus a scalar, never torch.tensor(value, device=...): on a GPU that is a blocking copy
            current = torch.zeros((), dtype=torch.float32, device=self.device)
        self._window[key] = current + value

    def pop_window(self, key: str) -> Tensor:
        """The window sum ``key``, reset to zero."""
        value = self._window.pop(key, None)
        return value if value is not None else torch.zeros((), dtype=torch.float32, device=self.device)

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "counts": self.counts.tolist(),
            "host_counts_exact": self._host_counts is not None,
            "window": {k: v.detach().cpu() for k, v in self._window.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))
        counts = [int(c) for c in state.get("counts", [0] * len(Outcome))]
        counts += [0] * (len(Outcome) - len(counts))
        self._loaded_counts, self._counts = counts, None
        self._unsent, self._any_unsent = [0] * len(Outcome), False
        self._host_counts = list(counts) if state.get("host_counts_exact", True) else None
        self._window = {k: v.to(self.device) for k, v in state.get("window", {}).items()}


def optimizer_names(optimizers: list[Optimizer]) -> list[str]:
    """``LearningRateMonitor``'s names: the class name, then ``-1``, ``-2``, ... for repeated classes."""
    seen: dict[str, int] = {}
    names = []
    for opt in optimizers:
        base = type(opt).__name__
        k = seen.get(base, 0)
        seen[base] = k + 1
        names.append(base if k == 0 else f"{base}-{k}")
    return names
