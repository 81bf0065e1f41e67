"""The skip decision of one optimizer step: the fp16 loss scaler's own, and the votes of any callback.

:class:`SkipDecision` lives from ``StepLedger.open_step`` to ``close_step``. It reuses the scaler's overflow
decision, takes votes in any order (:meth:`SkipDecision.vote`), enforces them together right before the update
(:meth:`SkipDecision.enforce`) and turns everything into one :class:`~lightning_stability.ledger.track.Outcome`
when the step closes (:meth:`SkipDecision.outcome`).

How a skip is enforced at the least cost: torch's ``GradScaler`` records one overflow flag per device in
``unscale_`` and decides the step from them in ``step``: on the host for ordinary optimizers (it calls
``optimizer.step()`` only without overflow), as the ``found_inf`` tensor for fused ones. A vote is added to
those flags, so the scaler's one decision covers it without another sync, and the flags as they were are handed
back to the scaler's ``update``, so a vote neither lowers the scale nor counts as an overflow. Without a scaler,
a fused optimizer takes the vote as ``found_inf``; any other optimizer loses its gradients for the step, after
one host read of the votes.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability import _compat
from lightning_stability.ledger.track import Outcome

if TYPE_CHECKING:
    import lightning.pytorch as pl


class SkipDecision:
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


Flag = bool | Tensor


def either(a: Flag, b: Flag) -> Flag:
    """``a or b`` for host bools and 0-dim device flags alike, without a sync."""
    # No tensor is made from host data here: on a GPU that would be a blocking host-to-device copy.
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.bool() | b.to(a.device, non_blocking=True).bool()
    if isinstance(a, Tensor):
        return True if b else a.bool()
    if isinstance(b, Tensor):
        return True if a else b.bool()
    return a or b


def loss_scaler(trainer: pl.Trainer) -> Any | None:
    """The enabled ``GradScaler`` of the trainer's precision plugin, if any."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler


def supports_found_inf(optimizer: Optimizer) -> bool:
    """Fused Adam/AdamW/SGD read ``found_inf`` in their kernel and decide the skip on the device."""
    return _compat.step_supports_amp_scaling(optimizer)


def scaler_found_inf(scaler: Any, optimizer: Optimizer) -> Tensor | None:
    """The scaler's overflow decision for ``optimizer`` this step, as a 0-dim bool tensor (no sync)."""
    values = list(_compat.scaler_found_inf(scaler, optimizer).values())
    if not values:
        return None
    total = values[0]
    for v in values[1:]:
        total = total + v.to(total.device, non_blocking=True)
    return total > 0


def add_to_scaler_decision(scaler: Any, optimizer: Optimizer, flag: Tensor) -> bool:
    """Make the scaler's ``step`` skip ``optimizer`` when ``flag`` is true, without touching the loss scale.

    The vote joins the overflow flags that ``step`` reads (on the host for ordinary optimizers, as
    ``found_inf`` for fused ones), so the scaler's one decision covers it with no sync of its own. ``update``
    then sees the flags as they were before any vote (:func:`restore_overflow_flags`): a skipped loss spike
    neither lowers the scale nor counts as an overflow. Returns ``False`` when the scaler has not unscaled
    this optimizer yet (nothing to add to).
    """
    found = _compat.scaler_found_inf(scaler, optimizer)
    if not found:
        return False
    saved: dict[int, dict[torch.device, Tensor]] = scaler.__dict__.setdefault(_OVERFLOW_FLAGS, {})
    saved.setdefault(id(optimizer), dict(found))
    if not getattr(type(scaler), "restores_overflow_flags", False) and not isinstance(
        scaler.__dict__.get("update"), _UpdateWithOverflowFlags
    ):
        scaler.update = _UpdateWithOverflowFlags(scaler)  # torch's own GradScaler: restore, then its update
    device, current = next(iter(found.items()))
    found[device] = torch.maximum(current, flag.to(device=current.device, dtype=current.dtype, non_blocking=True))
    return True


_OVERFLOW_FLAGS = "_stability_overflow_flags"


def has_votes_in_flags(scaler: Any, optimizer: Optimizer) -> bool:
    """Whether skip votes joined ``optimizer``'s overflow flags this step (see :func:`add_to_scaler_decision`)."""
    return id(optimizer) in scaler.__dict__.get(_OVERFLOW_FLAGS, ())


def restore_overflow_flags(scaler: Any) -> None:
    """Give ``update`` the overflow flags of the gradients alone, without the skip votes that ``step`` obeyed."""
    saved = scaler.__dict__.pop(_OVERFLOW_FLAGS, None)
    for key, flags in (saved or {}).items():
        state = _compat.scaler_optimizer_state_by_id(scaler, key)
        if state is not None:
            state["found_inf_per_device"] = flags


class _UpdateWithOverflowFlags:
    """``scaler.update`` of a torch ``GradScaler`` that received skip votes: restore its flags, then update.

    A module-level class rather than a closure, so the scaler stays picklable.
    """

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler

    def __call__(self, new_scale: float | Tensor | None = None) -> None:
        restore_overflow_flags(self.scaler)
        type(self.scaler).update(self.scaler, new_scale)


def unscale_if_deferred(scaler: Any, optimizer: Optimizer) -> None:
    """Unscale now the gradients of an optimizer that would unscale inside ``step()`` (fused ones)."""
    if supports_found_inf(optimizer) and _compat.scaler_is_ready(scaler, optimizer):
        # The scaler records the overflow flags and later hands them to the fused step as `found_inf`
        # with `grad_scale=None`, so the fused kernel does not unscale a second time.
        scaler.unscale_(optimizer)


_TOLD: weakref.WeakSet[Optimizer] = weakref.WeakSet()  # optimizers whose user heard about the host read


def _tell_about_the_host_read(optimizer: Optimizer) -> None:
    """Once per optimizer: why its skip votes cost a host read, and how to avoid it."""
    if optimizer in _TOLD:
        return
    _TOLD.add(optimizer)
    name = type(optimizer).__name__
    fix = (
        f"Construct it with {name}(..., fused=True) to keep the decision on the device."
        if "fused" in optimizer.defaults and not optimizer.defaults.get("fused")
        else "An optimizer with a fused implementation (e.g. AdamW(fused=True)) keeps it on the device."
    )
    rank_zero_info(
        f"lightning_stability: the skip decision for {name} is read on the host once per optimizer step (one "
        f"host-device sync), since torch lets only fused optimizers skip an update on the device. {fix}"
    )


def found_inf_is_safe(optimizer: Optimizer) -> bool:
    """Whether a ``found_inf`` skip leaves this fused optimizer exactly as it was.

    torch's fused SGD with momentum (2.13) leaves ``momentum_buffer`` uninitialised when its very first
    step is skipped through ``found_inf``; until every buffer exists, skip by dropping gradients instead.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return True
    return all(
        not group.get("momentum")
        or all(optimizer.state.get(p, {}).get("momentum_buffer") is not None for p in group["params"])
        for group in optimizer.param_groups
    )


def enforce_skip(
    optimizer: Optimizer, votes: dict[Outcome, Flag], scaler: Any | None, device: torch.device, found_inf_set: bool
) -> tuple[dict[Outcome, Flag], bool]:
    """Make ``optimizer`` skip this update when any vote is true, leaving weights and state as they were.

    Called once per step, right before the update, with every vote cast for it. Returns the votes as they
    are now known (host ``bool`` s once read on the host, so the outcome stays host-known) and whether
    ``found_inf`` is set on the optimizer (the ledger removes it when the step closes).
    """
    tensors = [v for v in votes.values() if isinstance(v, Tensor)]
    fused = supports_found_inf(optimizer) and found_inf_is_safe(optimizer)
    if tensors and scaler is None and fused:
        # Fused optimizers read `found_inf` in their kernel and leave params, moments and step counts
        # untouched when it is 1: the decision stays on the device.
        found = torch.zeros((), dtype=torch.float32, device=device)
        for flag in votes.values():
            if isinstance(flag, Tensor):
                found = torch.maximum(found, flag.to(device=device, dtype=torch.float32))
            elif flag:
                found = found + 1.0
        if found_inf_set:
            found = torch.maximum(found, optimizer.found_inf)  # type: ignore[attr-defined]
        optimizer.found_inf = found  # type: ignore[attr-defined]
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        return votes, True
    known: dict[Outcome, Flag] = dict(votes)
    if tensors:
        _tell_about_the_host_read(optimizer)
        # HOST SYNC (one for all votes): any other optimizer can only be told on the host.
        reasons = [r for r, v in votes.items() if isinstance(v, Tensor)]
        stacked = torch.stack([votes[r].to(device).bool().reshape(()) for r in reasons])  # type: ignore[union-attr]
        values = stacked.to("cpu", copy=True).tolist()
        known.update(zip(reasons, (bool(v) for v in values), strict=True))
    if any(known.values()):
        # Without gradients, every torch optimizer leaves the parameter and its state alone for this step.
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
    return known, found_inf_set
