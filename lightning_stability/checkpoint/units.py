"""A callback made of units: whole callbacks (``ExactResume``, ``PreemptionCheckpoint``) that another callback
(``StableCheckpoint``) holds and drives.

The composing callback is decorated with :func:`drives_units` and lists its units in ``units``: every hook
Lightning calls on it runs its own body, then the same hook on each unit whose class overrides it, in the order of
``units``. No hook is forwarded by hand, so none can be forgotten. A unit is handed what it needs of its owner (a
``save_now``, see ``save_now.py``) and never looks for the class that composes it; alone on a Trainer, a unit finds
the callbacks that already hold one of its kind with :func:`holders_of`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from lightning.pytorch.callbacks import Callback

#: every hook a Trainer calls on a ``Callback`` (its ``state_dict`` aside: a unit's state is its owner's)
HOOKS: tuple[str, ...] = tuple(
    sorted(name for name in vars(Callback) if name.startswith("on_") or name in ("setup", "teardown"))
)

C = TypeVar("C", bound=type[Callback])


@runtime_checkable
class Composed(Protocol):
    """A callback made of units (``StableCheckpoint``): the callbacks it drives, in the order their hooks run."""

    @property
    def units(self) -> Sequence[Callback]: ...


def overrides(unit: Callback, hook: str) -> bool:
    """Whether ``unit``'s class has a hook of its own by that name (not ``Callback``'s, which does nothing)."""
    return getattr(type(unit), hook) is not getattr(Callback, hook)


def drives_units(cls: C) -> C:
    """Class decorator: each of :data:`HOOKS` of ``cls`` runs its own body, then the hook of each of ``self.units``
    that overrides it. A unit whose hook the owner calls at a point of its own
    (:meth:`~lightning_stability.checkpoint.preemption_checkpoint.PreemptionCheckpoint.at_boundary`) does its work
    once per step whoever calls it first."""
    for hook in HOOKS:
        setattr(cls, hook, _then_units(hook, getattr(cls, hook)))
    return cls


def _then_units(hook: str, own: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(own)
    def run(self: Composed, *args: Any, **kwargs: Any) -> None:
        own(self, *args, **kwargs)
        for unit in self.units:
            if overrides(unit, hook):
                getattr(unit, hook)(*args, **kwargs)

    return run


def holders_of(kind: type[Callback], callbacks: Iterable[Callback]) -> list[Callback]:
    """The callbacks among ``callbacks`` that hold a unit of ``kind`` (each does that unit's job itself)."""
    return [cb for cb in callbacks if isinstance(cb, Composed) and any(isinstance(u, kind) for u in cb.units)]
