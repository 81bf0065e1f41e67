"""The presets' LR back-off with every torch.optim optimizer that takes an LR: each fits, and where the back-off acts
the weights after the step are those of the same optimizer stepped by hand, from the same weights, state and
gradients, at ``lr x factor``."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor

from lightning_stability import StabilityConfigError, StableTrainer
from lightning_stability.ledger import Outcome, StepLedger
from lightning_stability.precursors import LRBackoff, PrecursorMonitor
from tests.precursors.tiny_lm import TinyLM

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False)

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "AdamW-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "AdamW-single": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
    "AdamW-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "SGD-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=1e-2),
    "Adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
}


class WithOptimizer(TinyLM):
    def __init__(self, name: str) -> None:
        super().__init__(batches=12)
        self.name = name

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.name](self.parameters())


class Replay(pl.Callback):
    """Last in the list: right before each update, a copy of the weights, the gradients and the optimizer's state;
    after it, the same optimizer (a copy) stepped by hand from them at the LR the update used."""

    def __init__(self) -> None:
        self.compared: list[float] = []  # the back-off factor of each applied update compared
        self.largest_difference = 0.0
        self._before: tuple[list[Tensor], list[Tensor | None], dict[str, Any]] | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        self._before = ([p.detach().clone() for p in params], grads, copy.deepcopy(optimizer.state_dict()))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        ledger = StepLedger.of(trainer)
        optimizer, step = trainer.optimizers[0], ledger.step
        factor = step.scale.total
        if self._before is None or int(ledger.outcome) != Outcome.APPLIED or float(factor) == 1.0:
            return
        weights, grads, state = self._before
        copies = [w.clone().requires_grad_(True) for w in weights]
        for c, g in zip(copies, grads, strict=True):
            c.grad = g
        by_hand = type(optimizer)(
            [
                {**{k: v for k, v in g.items() if k != "params"}, "params": copies[i : i + len(g["params"])]}
                for i, g in _offsets(optimizer.param_groups)
            ]
        )
        by_hand.load_state_dict(state)
        for group, lr in zip(by_hand.param_groups, step.scale.used_lrs(optimizer), strict=True):
            group["lr"] = lr  # the LR the update used: the optimizer's LR x the back-off's factor
        by_hand.step()
        actual = [p.detach() for g in optimizer.param_groups for p in g["params"]]
        for a, b in zip(actual, copies, strict=True):
            self.largest_difference = max(self.largest_difference, float((a - b.detach()).abs().max()))
        self.compared.append(float(factor))


def _offsets(groups: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    out, i = [], 0
    for g in groups:
        out.append((i, g))
        i += len(g["params"])
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_gpt_preset_backs_off_every_optimizer_through_its_own_update(name: str) -> None:
    """A threshold every update passes (1e-6, without the run's baseline), so the back-off acts from its first
    measurement (step 4) on, beside the rest of the "gpt" preset."""
    replay = Replay()
    backoff = PrecursorMonitor(lr_backoff=LRBackoff("update_ratio", 1e-6, efficiency=None), other_optimizers="warn")
    trainer = StableTrainer.from_preset(
        "gpt",
        accelerator="cpu",
        precision="32-true",
        lr_backoff=None,
        checkpoint=False,
        watchdog=False,
        max_steps=12,
        callbacks=[replay, backoff],
        **QUIET,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        trainer.fit(WithOptimizer(name))
    assert trainer.global_step == 12
    # measured every 4th step: x0.5 after steps 4 and 8 (a step the health monitor skipped would not count)
    assert replay.compared == [0.5] * 4 + [0.25] * 4
    assert replay.largest_difference == 0.0  # bit for bit: the optimizer's own step at lr x factor
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(
        OPTIMIZERS[name]([torch.zeros(1, requires_grad=True)]).param_groups[0]["lr"] * _schedule_at(trainer)
    )


def _schedule_at(trainer: pl.Trainer) -> float:
    """The LR schedule's multiplier for the next update (the optimizer's LR is the schedule's: the factor is
    put back after each update)."""
    from lightning_stability import ScheduledLR

    schedule = next(cb for cb in trainer.callbacks if isinstance(cb, ScheduledLR))  # type: ignore[attr-defined]
    return schedule.multiplier(int(StepLedger.of(trainer).record_of().applied_steps), 0)


def test_rprop_is_refused_by_the_backoff_and_left_to_the_others_in_a_preset() -> None:
    """Rprop takes its LR as its first step sizes only: a factor on later LRs would do nothing. The preset turns
    the back-off off for it, in one line; a PrecursorMonitor of your own refuses it."""

    class RpropLM(TinyLM):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Rprop(self.parameters(), lr=1e-3)

    trainer = StableTrainer.from_preset(
        "gpt", accelerator="cpu", precision="32-true", checkpoint=False, watchdog=False, max_steps=4, **QUIET
    )
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="Rprop reads its LR only once, as its first step sizes, so it is off"):
        trainer.fit(RpropLM(batches=4))
    assert trainer.global_step == 4
    monitor = next(cb for cb in trainer.callbacks if isinstance(cb, PrecursorMonitor))  # type: ignore[attr-defined]
    assert float(monitor.backoff) == 1.0
    with pytest.raises(StabilityConfigError, match="Rprop"):
        pl.Trainer(
            accelerator="cpu", max_steps=1, callbacks=[PrecursorMonitor(lr_backoff=monitor.lr_backoff)], **QUIET
        ).fit(RpropLM(batches=4))
