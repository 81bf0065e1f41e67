"""The mechanisms that skip an update, used by ``step.OptimizerStep`` (which decides when and which).

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


def set_found_inf(optimizer: Optimizer, votes: dict[Outcome, Flag], device: torch.device, already: bool) -> bool:
    """Give a fused optimizer the votes as ``found_inf`` (its kernel leaves params, moments and step counts alone
    when it is 1), combined with a ``found_inf`` set before (``already``). Returns ``True``: ``found_inf`` is set
    (the step removes it when it closes)."""
    found = torch.zeros((), dtype=torch.float32, device=device)
    for flag in votes.values():
        if isinstance(flag, Tensor):
            found = torch.maximum(found, flag.to(device=device, dtype=torch.float32))
        elif flag:
            found = found + 1.0
    if already:
        found = torch.maximum(found, optimizer.found_inf)  # type: ignore[attr-defined]
    optimizer.found_inf = found  # type: ignore[attr-defined]
    optimizer.grad_scale = None  # type: ignore[attr-defined]
    return True


def read_votes_on_host(
    optimizer: Optimizer, votes: dict[Outcome, Flag], device: torch.device, also: Tensor | None = None
) -> tuple[dict[Outcome, Flag], float | None]:
    """The votes as host bools, and ``also`` (a 0-dim tensor) as a host number: one device-to-host copy for all of
    them (a HOST SYNC)."""
    _tell_about_the_host_read(optimizer)
    known: dict[Outcome, Flag] = dict(votes)
    reasons = [r for r, v in votes.items() if isinstance(v, Tensor)]
    parts = [votes[r].to(device).bool().float().reshape(()) for r in reasons]  # type: ignore[union-attr]
    if also is not None:
        parts.append(also.to(device).float().reshape(()))
    values = torch.stack(parts).to("cpu", copy=True).tolist()
    known.update(zip(reasons, (bool(v) for v in values[: len(reasons)]), strict=True))
    return known, (values[-1] if also is not None else None)


def drop_gradients(optimizer: Optimizer) -> None:
    """Skip ``optimizer``'s update: without gradients, every torch optimizer leaves a parameter and its state
    alone for the step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
