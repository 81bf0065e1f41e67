"""The skip decision of one optimizer step: the fp16 loss scaler's own, and the votes of any callback.

:class:`StepVotes` lives from ``StepLedger.open_step`` to ``close_step``. It reuses the scaler's overflow
decision, takes votes in any order (:meth:`StepVotes.vote`), enforces them together right before the update
(:meth:`StepVotes.enforce`, see :func:`~lightning_stability.skips.enforce_skip`) and turns everything into one
:class:`~lightning_stability.track.Outcome` when the step closes (:meth:`StepVotes.outcome`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability.skips import (
    Flag,
    add_to_scaler_decision,
    either,
    enforce_skip,
    scaler_found_inf,
    supports_found_inf,
    unscale_if_deferred,
)
from lightning_stability.track import Outcome


class StepVotes:
    """Why the open step of ``optimizer`` is skipped, if it is.

    Args:
        optimizer: the optimizer about to step.
        scaler: the enabled fp16 ``GradScaler``, or ``None``.
        device: where the votes of a fused optimizer are combined (its track's device).
    """

    def __init__(self, optimizer: Optimizer, scaler: Any | None, device: torch.device) -> None:
        self.optimizer, self.scaler, self.device = optimizer, scaler, device
        self._known: dict[Outcome, Flag] = {}  # reasons decided so far (host bools or device flags)
        self._pending: dict[Outcome, Flag] = {}  # votes not yet enforced
        self._folded: dict[Outcome, Flag] = {}  # votes added to the fp16 scaler's decision
        self._enforced = False  # the votes were enforced; a later vote is enforced at once
        self._found_inf_set = False  # `found_inf` is set on the optimizer (removed when the step closes)
        self._on_host = False  # the scaler decides this step on the host (non-fused optimizer)
        self._host_overflow: Tensor | None = None  # its overflow flag, kept when a vote joined its decision
        if scaler is None:
            return
        unscale_if_deferred(scaler, optimizer)
        if supports_found_inf(optimizer):
            found_inf = scaler_found_inf(scaler, optimizer)
            if found_inf is not None:
                self._known[Outcome.SKIPPED_SCALER] = found_inf
        else:
            # The scaler reads its overflow flag on the host itself and calls `optimizer.step()` only when it
            # found none: whether the step post-hook ran is the outcome, known without another sync.
            self._on_host = True

    def vote(self, reason: Outcome, flag: Flag) -> None:
        """Skip the step when ``flag`` is true (see ``StepLedger.mark_skip``)."""
        if reason is Outcome.APPLIED:
            raise ValueError("Outcome.APPLIED is not a skip reason")
        if reason is Outcome.SKIPPED_SCALER:
            self._known[reason] = either(self._known.get(reason, False), flag)
            return
        scaler = self.scaler
        if scaler is not None and isinstance(flag, Tensor):
            overflow = scaler_found_inf(scaler, self.optimizer)
            # Under fp16 the vote joins the flags the scaler's step obeys (and its update ignores), now.
            if add_to_scaler_decision(scaler, self.optimizer, flag):
                self._folded[reason] = either(self._folded.get(reason, False), flag)
                if self._on_host and self._host_overflow is None:
                    self._host_overflow = overflow  # the gradients' own overflow, told apart from the votes
                return
        self._pending[reason] = either(self._pending.get(reason, False), flag)
        if self._enforced:
            self.enforce()

    def enforce(self) -> None:
        """Make the step skip if any vote so far says so: at most one host read for all of them."""
        self._enforced = True
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        known, self._found_inf_set = enforce_skip(
            self.optimizer, pending, self.scaler, self.device, self._found_inf_set
        )
        for reason, flag in known.items():
            self._known[reason] = either(self._known.get(reason, False), flag)

    def outcome(self, stepped: bool) -> Outcome | Tensor:
        """The step's :class:`Outcome` (a tensor when decided on the device), once ``optimizer.step()`` ran or
        was skipped by the scaler (``stepped``). Removes ``found_inf`` from the optimizer."""
        if self._found_inf_set:
            del self.optimizer.found_inf  # type: ignore[attr-defined]
            del self.optimizer.grad_scale  # type: ignore[attr-defined]
            self._found_inf_set = False
        known = dict(self._known)
        if self._on_host:
            # The scaler stepped only without overflow and without a true vote: both known on the host.
            if stepped:
                folded: dict[Outcome, Flag] = {}
            else:
                folded = self._folded
                # skipped by the overflow or by a vote: without a vote, surely the overflow
                known[Outcome.SKIPPED_SCALER] = True if self._host_overflow is None else self._host_overflow
        else:
            folded = self._folded
        for reason, flag in folded.items():
            known[reason] = either(known.get(reason, False), flag)
        outcome: Outcome | Tensor = Outcome.APPLIED
        for reason in sorted(known, reverse=True):  # the lowest reason that applies wins
            flag = known[reason]
            if isinstance(flag, Tensor):
                # scalars, not host-made tensors: on a GPU those would be blocking host-to-device copies
                other = outcome if isinstance(outcome, Tensor) else int(outcome)
                outcome = torch.where(flag.to(self.device, non_blocking=True).bool(), int(reason), other)
            elif flag:
                outcome = reason
        return outcome
