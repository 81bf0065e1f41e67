"""Run Lightning's tuner searches (LR finder, batch-size finder) inside a context the caller provides.

``Tuner(trainer).lr_find(...)``, ``Tuner(trainer).scale_batch_size(...)`` and the callback forms
(``LearningRateFinder``, ``BatchSizeFinder``, and subclasses that search at later epochs) all run their
search from one public method of the tuner callback: ``lr_find(trainer, pl_module)`` or
``scale_batch_size(trainer, pl_module)``. During the search Lightning swaps ``trainer.callbacks`` for its
own, so no other callback hook runs; a callback that has changed the Trainer (here: the accumulation
factor, the "last micro-batch" decision) gets no chance to undo it. :class:`TunerSearchGuard` wraps that
method on the tuner callback instances attached to the Trainer, for one fit, so the search runs inside a
context manager of the caller's choosing.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BatchSizeFinder, Callback, LearningRateFinder

__all__ = ["SEARCHES", "TunerSearchGuard"]

#: The tuner callbacks and the public method that runs each one's search.
# private: relies on Lightning calling these through the instance (`LearningRateFinder.on_fit_start` ->
# `self.lr_find`, `BatchSizeFinder.on_fit_start` -> `self.scale_batch_size`) and on the search replacing
# `trainer.callbacks` while it runs (lightning/pytorch/tuner/lr_finder.py, batch_size_scaling.py).
SEARCHES: tuple[tuple[type[Callback], str], ...] = (
    (LearningRateFinder, "lr_find"),
    (BatchSizeFinder, "scale_batch_size"),
)

Guard = Callable[[pl.Trainer], AbstractContextManager[Any]]


class _Guarded:
    """A tuner callback's search method, run inside ``guard(trainer)``."""

    def __init__(self, search: Callable[..., Any], guard: Guard, replaced: Any) -> None:
        self.search = search
        self.guard = guard
        self.replaced = replaced  # the instance attribute this one replaced (None: the class's method)

    def __call__(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
        with self.guard(trainer):
            return self.search(trainer, *args, **kwargs)


class TunerSearchGuard:
    """Wraps the searches of the tuner callbacks attached to a Trainer; :meth:`remove` undoes it."""

    def __init__(self) -> None:
        self._wrapped: list[tuple[Callback, str]] = []

    def install(self, trainer: pl.Trainer, guard: Guard) -> None:
        """Wrap every attached tuner callback's search in ``guard`` (once per instance; idempotent)."""
        self.remove()
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            for kind, name in SEARCHES:
                if not isinstance(cb, kind):
                    continue
                own = vars(cb).get(name)
                if isinstance(own, _Guarded):  # left over from a fit that did not reach teardown
                    wrapper = _Guarded(own.search, guard, own.replaced)
                else:
                    wrapper = _Guarded(getattr(cb, name), guard, own)
                setattr(cb, name, wrapper)
                self._wrapped.append((cb, name))

    def remove(self) -> None:
        for cb, name in self._wrapped:
            own = vars(cb).get(name)
            if not isinstance(own, _Guarded):
                continue
            if own.replaced is None:
                delattr(cb, name)
            else:
                setattr(cb, name, own.replaced)
        self._wrapped = []
