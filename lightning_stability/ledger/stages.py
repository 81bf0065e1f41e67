"""The rows of one optimizer step, as code: :class:`Stage`, one member per row of the table in ``ledger/step.py``.

A callback that changes weights, optimizer state, buffers, RNG states or the LR does so from a stage that says so
(:attr:`Stage.writes`), registered with ``StepLedger.at(stage, name, fn)``; the ledger runs the registered functions
of a stage in the order of their names, so what a step does never depends on the order of the Trainer's callbacks.
Rows 4 to 7 are the callbacks' ``on_step`` (``LedgerCallback``) and Lightning's clip: they measure, clip the
gradients and vote, through ``StepLedger.gradients``, ``mark_skip`` and ``scale_update``.

With ``LIGHTNING_STABILITY_CHECK_STAGES=1`` in the environment (the test suite sets it) the ledger checks, at each
step, that no stage but those whose :attr:`~Stage.writes` name the weights changed a parameter
(:class:`StageCheck`); off by default, it costs nothing then.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from enum import Enum

import torch
from torch import Tensor

from lightning_stability import _compat

#: what a stage may change
WEIGHTS, OPTIMIZER_STATE, BUFFERS = "weights", "optimizer state", "buffers"
RNG, GRADIENTS, LR = "RNG", "gradients", "LR"
NOTHING: frozenset[str] = frozenset()

#: the environment variable that turns :class:`StageCheck` on
CHECK_ENV = "LIGHTNING_STABILITY_CHECK_STAGES"


class Stage(Enum):
    """One row of the step table (``ledger/step.py``): its label there, what it may change, whether ``StepLedger.at``
    registers functions there."""

    #: before each micro-batch's backward: ``fn(ledger)``, e.g. a tensor hook that adds a loss term's gradient (a
    #: router z-loss), times ``ledger.backward_factor()`` so that it lands as if the term were part of the loss
    BACKWARD = ("1", frozenset({GRADIENTS, BUFFERS, RNG}), True)
    UNSCALE = ("2", frozenset({GRADIENTS}), False)
    #: the step opens: ``fn(ledger)`` before anything measures it. The health monitor's rollback restores the
    #: weights, optimizer state and buffers here; StepReplay puts back the buffers of a stand-in batch; factors on
    #: the update known before the step (the LR back-off) are added here, so that an early read (3b) carries them
    OPEN = ("3", frozenset({WEIGHTS, OPTIMIZER_STATE, BUFFERS, GRADIENTS, LR}), True)
    #: a flagged step replayed (StepReplay, one function): ``fn(ledger)``; it reruns the step's micro-batches and
    #: puts the buffers and RNG states back around them
    REPLAY = ("3b", frozenset({GRADIENTS, BUFFERS, RNG}), True)
    MEASURE = ("4", NOTHING, False)
    CLIP = ("5", frozenset({GRADIENTS}), False)
    VOTE = ("6", NOTHING, False)
    LIGHTNING_CLIP = ("7", frozenset({GRADIENTS}), False)
    #: right before the update, after every clip and vote: ``fn(ledger)`` reads the gradients the update will use
    #: (PrecursorMonitor's update-clip coefficients and moment-reset test); then the votes are enforced and the
    #: update's factors go into the LRs
    ENFORCE = ("8", frozenset({GRADIENTS, LR}), True)
    UPDATE = ("9", frozenset({WEIGHTS, OPTIMIZER_STATE}), False)
    OUTCOME = ("10", frozenset({LR}), False)
    #: edits right after the update, applied or skipped (``ledger.outcome`` says which): ``fn(ledger)``
    #: (PrecursorMonitor's update clipping, QK-clip, moment reset; RouterHealthMonitor's router-logit clip and its
    #: balancing bias, a buffer of each router)
    AFTER_UPDATE = ("11", frozenset({WEIGHTS, OPTIMIZER_STATE, BUFFERS}), True)
    MEASURE_UPDATE = ("12", NOTHING, False)
    #: once the step closed: ``fn(ledger)``, each ``LedgerCallback``'s ``after_step`` (the LR schedule's next LR;
    #: BatchRamp's next accumulation factor and, a param-group hyperparameter like the LR, Adam's beta2)
    AFTER_STEP = ("13", frozenset({LR}), True)

    def __init__(self, row: str, writes: frozenset[str], registers: bool) -> None:
        #: the row's label in the table of ``ledger/step.py``
        self.row = row
        #: what the stage may change
        self.writes = writes
        #: whether ``StepLedger.at`` takes functions for this stage
        self.registers = registers

    @property
    def writes_weights(self) -> bool:
        return WEIGHTS in self.writes


class StageCheck:
    """The debug check: the parameters' version counters before and after the stages that must leave them alone.

    Version counters move with every in-place change of a tensor and are read without touching its data: no host
    sync, on any device. A stage that changed a parameter it may not change raises ``AssertionError`` naming it.
    """

    def __init__(self) -> None:
        self._seen: tuple[Stage, list[int]] | None = None

    @staticmethod
    def enabled() -> bool:
        return os.environ.get(CHECK_ENV, "") not in ("", "0")

    def mark(self, stage: Stage, params: Iterable[Tensor]) -> None:
        """The versions as ``stage`` starts; :meth:`check` compares them after the stages that may not write."""
        self._seen = (stage, _versions(params))

    def check(self, until: Stage, params: Iterable[Tensor]) -> None:
        """Raise if a parameter changed since :meth:`mark` (from its stage up to, not including, ``until``)."""
        if self._seen is None:
            return
        stage, before = self._seen
        self._seen = None
        after = _versions(params)
        if after != before:
            changed = sum(a != b for a, b in zip(after, before, strict=False)) + abs(len(after) - len(before))
            raise AssertionError(
                f"{changed} parameter(s) changed between row {stage.row} ({stage.name}) and row {until.row} "
                f"({until.name}) of the step table, where no stage may change the weights: a callback wrote them "
                "outside its row. Register the write with StepLedger.at(Stage.OPEN or Stage.AFTER_UPDATE, ...)."
            )


def _versions(params: Iterable[Tensor]) -> list[int]:
    with torch.no_grad():
        return [_compat.tensor_version(p) for p in params]
