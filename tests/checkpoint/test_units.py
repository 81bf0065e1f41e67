"""A callback made of units (``checkpoint/units.py``): every Lightning hook a unit overrides reaches it through the
callback that composes it, after the owner's own body; a unit alone finds a callback holding one of its kind
without knowing that callback's class; the save-now protocol (``checkpoint/save_now.py``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_stability import AtomicCheckpointIO, ExactResume, PreemptionCheckpoint, StableCheckpoint
from lightning_stability.checkpoint.save_now import SavesNow, save_now
from lightning_stability.checkpoint.units import HOOKS, drives_units, holders_of, overrides
from tests.helpers import TinyModule, quiet_trainer


def record(calls: Counter[tuple[str, str]], who: str, hook: str, call: Callable[..., Any]) -> Callable[..., Any]:
    def recorded(*args: Any, **kwargs: Any) -> Any:
        calls[who, hook] += 1
        return call(*args, **kwargs)

    return recorded


def instrumented(calls: Counter[tuple[str, str]], **kwargs: Any) -> StableCheckpoint:
    """A StableCheckpoint whose every hook, and every hook its units override, counts its calls."""
    owner = StableCheckpoint(**kwargs)
    for hook in HOOKS:
        setattr(owner, hook, record(calls, "owner", hook, getattr(owner, hook)))
        for unit in owner.units:
            if overrides(unit, hook):
                setattr(unit, hook, record(calls, type(unit).__name__, hook, getattr(unit, hook)))
    return owner


class FailAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("stop here")


def test_every_hook_a_unit_overrides_reaches_it_through_stable_checkpoint(tmp_path: Path) -> None:
    """A fit that saves, then a resume that fails: each hook its units override is called on each unit as often
    as Lightning calls it on StableCheckpoint (load and exception included)."""
    calls: Counter[tuple[str, str]] = Counter()

    def trainer(*callbacks: Callback, steps: int) -> pl.Trainer:
        return quiet_trainer(
            max_steps=steps, enable_checkpointing=True, plugins=[AtomicCheckpointIO()], callbacks=list(callbacks)
        )

    trainer(instrumented(calls, dirpath=tmp_path, every_n_train_steps=2), steps=4).fit(TinyModule())
    with pytest.raises(RuntimeError, match="stop here"):
        resumed = trainer(instrumented(calls, dirpath=tmp_path), FailAt(5), steps=8)
        resumed.fit(TinyModule(), ckpt_path="last")
    units = (PreemptionCheckpoint.part_of("owner", [], lambda trainer: None), ExactResume.part_of("owner"))
    for unit in units:
        overridden = [hook for hook in HOOKS if overrides(unit, hook)]
        assert {"setup", "on_train_start", "on_exception", "teardown"} <= set(overridden)
        for hook in overridden:
            assert calls[type(unit).__name__, hook] == calls["owner", hook] > 0, (type(unit).__name__, hook)


def test_the_units_run_after_the_owners_own_body_in_their_order() -> None:
    order: list[str] = []

    class Unit(Callback):
        def __init__(self, name: str) -> None:
            self.name = name

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            order.append(self.name)

    @drives_units
    class Owner(Callback):
        def __init__(self) -> None:
            self.units = (Unit("first"), Callback(), Unit("second"))

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            order.append("owner")

    owner = Owner()
    owner.on_train_start(None, None)
    owner.on_train_end(None, None)  # overridden by no unit: nothing to reach
    assert order == ["owner", "first", "second"]
    assert holders_of(Unit, [Callback(), owner]) == [owner] and holders_of(ExactResume, [owner]) == []


def test_alone_the_units_find_a_holder_of_their_kind_by_its_units(tmp_path: Path) -> None:
    """Not by its class: any callback that holds one (here StableCheckpoint)."""
    stable = StableCheckpoint(dirpath=tmp_path)
    assert holders_of(ExactResume, [stable]) == [stable] and holders_of(PreemptionCheckpoint, [stable]) == [stable]


def test_save_now_is_the_checkpoint_callbacks_own_else_the_model_checkpoints_last(tmp_path: Path) -> None:
    """StableCheckpoint serves save_now itself; a plain ModelCheckpoint gets its ``last`` checkpoint, recorded as
    its own save of the step; no ModelCheckpoint: nothing saved."""
    assert isinstance(StableCheckpoint(dirpath=tmp_path), SavesNow)
    assert not isinstance(ModelCheckpoint(dirpath=tmp_path), SavesNow)
    saved: list[str | None] = []

    class SaveAt(Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 2:
                saved.append(save_now(trainer))

    plain = ModelCheckpoint(dirpath=tmp_path / "plain", save_last=True, every_n_train_steps=100)
    quiet_trainer(max_steps=3, enable_checkpointing=True, callbacks=[SaveAt(), plain]).fit(TinyModule())
    stable = StableCheckpoint(dirpath=tmp_path / "stable", every_n_train_steps=100)
    quiet_trainer(max_steps=3, enable_checkpointing=True, callbacks=[SaveAt(), stable]).fit(TinyModule())
    quiet_trainer(max_steps=3, callbacks=[SaveAt()]).fit(TinyModule())
    assert saved == [str(tmp_path / "plain" / "last.ckpt"), str(tmp_path / "stable" / "epoch=0-step=2.ckpt"), None]
    assert stable.healthy_checkpoints() == [(tmp_path / "stable" / "epoch=0-step=2.ckpt", 2)]


class InfFrom(TinyModule):
    """Every step from global step 2 on has an infinite loss (its update skipped: never a healthy state)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.global_step >= 2 else loss


def test_a_signal_in_a_state_that_stays_unhealthy_stops_without_a_save_after_the_tries(tmp_path: Path) -> None:
    """StableCheckpoint hands its PreemptionCheckpoint a save that saves nothing while the state is unhealthy: the
    unit tries at the boundary every rank learned of the signal and at SIGNAL_DEFER_STEPS more, then stops."""
    import os
    import signal

    from lightning_stability import GradientNormMonitor, read_incidents
    from lightning_stability.checkpoint.callback import SIGNAL_DEFER_STEPS

    class Signal(Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.getsignal(signal.SIGUSR1)
    try:
        stable = StableCheckpoint(dirpath=tmp_path, every_n_train_steps=100, signals=[signal.SIGUSR1])
        trainer = quiet_trainer(
            max_steps=20,
            enable_checkpointing=True,
            plugins=[AtomicCheckpointIO()],
            callbacks=[GradientNormMonitor(), Signal(), stable],
        )
        trainer.fit(InfFrom())
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert trainer.global_step == 4 + SIGNAL_DEFER_STEPS  # learned at the boundary of step 4
    assert stable.healthy_checkpoints() == []
    (preemption,) = [i for i in read_incidents(tmp_path) if i.kind == "preemption"]
    assert "not saved" in preemption.action and preemption.lost
