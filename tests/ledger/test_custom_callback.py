"""A callback written by a user with only ``lightning_stability.ledger`` open: skip the update when the loss is
above a threshold. It must behave like the package's own callbacks: skipped on every rank alike, the weights and
optimizer state untouched, the LR schedule held still, its metric monitorable and logged."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_stability import WarmupConstantCosineLR
from lightning_stability.ledger import LedgerCallback, OnHost, OptimizerRecord, Outcome, StepLedger
from tests.helpers import TinyModule, quiet_trainer


class SkipHighLoss(LedgerCallback):
    """Skip every update whose loss is above ``max_loss``; count them."""

    needs_loss = True  # ledger.step.loss: the update's loss, on the device

    def __init__(self, max_loss: float) -> None:
        super().__init__()
        self.max_loss = max_loss
        self.warned_at: list[int] = []
        self.sent: OnHost | None = None

    def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: torch.optim.Optimizer) -> None:
        too_high = ledger.any_rank(ledger.step.loss > self.max_loss)  # the same decision on every rank
        ledger.mark_skip(Outcome.SKIPPED_SPIKE, too_high)
        self.record_metric("stability/loss_too_high", too_high.float())
        if self.is_logging_step:
            self.sent = self.to_host(ledger.step.loss)

    def after_step(self, trainer: pl.Trainer, ledger: StepLedger) -> None:
        self.record_metric("stability/high_loss_skips", ledger.record_of().counts[Outcome.SKIPPED_SPIKE])

    def on_host(self, trainer: pl.Trainer, record: OptimizerRecord) -> dict[str, float]:
        assert self.sent is not None
        loss = self.sent.number()
        if loss > self.max_loss:
            self.warned_at.append(record.steps)
        return {"stability/loss_seen": loss}


class HighLossAt(TinyModule):
    """A loss 1000x too high at the given steps."""

    def __init__(self, steps: set[int]) -> None:
        super().__init__()
        self.high = steps

    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 1000.0 if self.global_step in self.high else loss


def test_a_users_skip_callback_skips_exactly_the_high_loss_steps(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    callback = SkipHighLoss(max_loss=100.0)
    schedule = WarmupConstantCosineLR(warmup=0.25)
    weights: list[list[torch.Tensor]] = []
    lrs: list[float] = []

    class Watch(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
            weights.append([p.detach().clone() for p in pl_module.parameters()])
            lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))

    trainer = quiet_trainer(max_steps=8, log_every_n_steps=2, logger=logger, callbacks=[schedule, callback, Watch()])
    trainer.fit(HighLossAt({3, 5}))

    assert StepLedger.of(trainer).record_of().counts.tolist() == [6, 0, 0, 2, 0, 0]
    for step in (3, 5):  # a skipped update left every weight as it was, and the LR did not move on
        assert all(torch.equal(a, b) for a, b in zip(weights[step], weights[step + 1], strict=True))
        assert lrs[step + 1] == lrs[step]
    assert not all(torch.equal(a, b) for a, b in zip(weights[2], weights[3], strict=True))
    assert trainer.callback_metrics["stability/high_loss_skips"].item() == 2
    # logging steps are 1, 3, 5, 7 (labels of log_every_n_steps=2): the host saw the high losses of 3 and 5
    assert callback.warned_at == [4, 6]
    logger.save()
    logged = (Path(logger.log_dir) / "metrics.csv").read_text()
    assert "stability/loss_seen" in logged and "stability/loss_too_high" in logged


class _VoteOnce(pl.Callback):
    """A plain Lightning callback (no LedgerCallback anywhere in the Trainer) that votes to skip one step."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == self.at:
            StepLedger.of(trainer).mark_skip(Outcome.SKIPPED_SPIKE, True, optimizer)


def test_a_plain_callbacks_vote_leaves_the_ledger_describing_the_last_update(tmp_path: Path) -> None:
    """Without any LedgerCallback, a plain callback's one vote skips that update only: the updates after it are
    counted as applied, so StableCheckpoint (which reads the ledger's outcome) saves again at the next due step
    instead of taking every later state for one after a skipped update."""
    from lightning_stability import StableCheckpoint

    checkpoint = StableCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, keep=10)
    trainer = quiet_trainer(max_steps=10, callbacks=[_VoteOnce(at=3), checkpoint], enable_checkpointing=True)
    trainer.fit(TinyModule())
    ledger = StepLedger.of(trainer)
    assert ledger.outcome is Outcome.APPLIED
    counts = ledger.record_of().counts.tolist()
    assert counts[Outcome.SKIPPED_SPIKE] == 1
    assert counts[Outcome.APPLIED] == 6  # steps 4..9, after the vote hooked the optimizer
    saved = sorted(int(p.stem.split("step=")[1]) for p in (tmp_path / "ckpt").glob("*.ckpt"))
    assert saved == [2, 5, 6, 8, 10], saved  # step 4's save waited for the next applied update (5)
