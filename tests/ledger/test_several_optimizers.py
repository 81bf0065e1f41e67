"""Two optimizers (a GAN under manual optimization): each has its own record, clock, metrics and schedule."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader

from lightning_stability import (
    GradientAccumulation,
    GradientNormMonitor,
    LossScaleTuner,
    StabilityConfigError,
    StepLedger,
    WarmupConstantCosineLR,
)
from lightning_stability.schedules import warmup_constant_cosine
from tests.helpers import make_data, quiet_trainer


class TwoOptimizerGAN(pl.LightningModule):
    """A toy GAN: the discriminator (SGD) and the generator (Adam) each step once per batch.

    ``nan_d_at`` puts a NaN into the discriminator's loss at these batch indices (its gradient turns NaN).
    """

    def __init__(self, nan_d_at: tuple[int, ...] = (), lr_d: float = 0.1, lr_g: float = 0.01) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.disc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.gen = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.nan_d_at = set(nan_d_at)
        self.lr_d, self.lr_g = lr_d, lr_g
        self.d_before: dict[int, list[torch.Tensor]] = {}
        self.d_after: dict[int, list[torch.Tensor]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_d, opt_g = self.optimizers()  # type: ignore[misc]
        # Both inputs follow batch_idx, not the loader's position: Lightning restarts a plain DataLoader from
        # its first batch on a mid-epoch resume, so only this keeps a resumed run on the same data.
        gen = torch.Generator().manual_seed(batch_idx)
        real = torch.randn(8, 8, generator=gen)
        z = torch.randn(real.shape[0], 4, generator=gen)
        fake = self.gen(z)
        d_loss = self.disc(real).mean() - self.disc(fake.detach()).mean() + (self.disc(real) ** 2).mean()
        if batch_idx in self.nan_d_at:
            d_loss = d_loss * float("nan")
        self.d_before[batch_idx] = [p.detach().clone() for p in self.disc.parameters()]
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.d_after[batch_idx] = [p.detach().clone() for p in self.disc.parameters()]
        g_loss = -self.disc(self.gen(z)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.log_dict({"d_loss": d_loss.detach(), "g_loss": g_loss.detach()})

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SGD(self.disc.parameters(), lr=self.lr_d),
            torch.optim.Adam(self.gen.parameters(), lr=self.lr_g),
        ]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(64, 8), batch_size=8)  # 8 batches


class PerOptimizerProbe(pl.Callback):
    """Placed BEFORE the stability callbacks: each optimizer's LR and true gradient norm, per step."""

    def __init__(self) -> None:
        self.lrs: dict[str, list[float]] = {"SGD": [], "Adam": []}
        self.norms: dict[str, list[float]] = {"SGD": [], "Adam": []}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        name = type(optimizer).__name__
        self.lrs[name].append(float(optimizer.param_groups[0]["lr"]))
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.norms[name].append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_each_optimizer_has_its_own_norm_clock_schedule_and_keys(tmp_path: Path) -> None:
    probe = PerOptimizerProbe()
    logger = CSVLogger(tmp_path, name="gan")
    trainer = quiet_trainer(
        max_epochs=1,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[
            probe,
            GradientNormMonitor(max_norm=1.0),
            WarmupConstantCosineLR(warmup=0.25, decay=0.5),
            LearningRateMonitor(),
        ],
    )
    trainer.fit(TwoOptimizerGAN())
    ledger = StepLedger.of(trainer)
    d, g = trainer.optimizers
    assert ledger.record_of(d).steps == ledger.record_of(g).steps == 8
    assert ledger.record_of(d).counts.tolist() == ledger.record_of(g).counts.tolist() == [8, 0, 0, 0, 0, 0]

    # each optimizer's run length is its own 8 updates: the LR decays over the whole epoch, never 0 early
    for name, base in (("SGD", 0.1), ("Adam", 0.01)):
        expected = [base * warmup_constant_cosine(n, 8, 0.25, 0.5) for n in range(8)]
        assert probe.lrs[name] == pytest.approx(expected, rel=1e-6), name
        assert min(probe.lrs[name]) > 0

    rows = _rows(Path(logger.log_dir) / "metrics.csv")
    by_step: dict[int, dict[str, str]] = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if v != ""})
    # the step labels are Lightning's: the same rows as `self.log` and LearningRateMonitor, 0..7
    assert sorted(by_step) == list(range(8))
    for step, row in by_step.items():
        assert {"d_loss", "lr-SGD", "lr-Adam"} <= row.keys(), step
        assert float(row["stability/grad_norm/SGD"]) == pytest.approx(probe.norms["SGD"][step], rel=1e-5)
        assert float(row["stability/grad_norm/Adam"]) == pytest.approx(probe.norms["Adam"][step], rel=1e-5)
        # LearningRateMonitor sees the LR the update used, and so does stability/lr/<optimizer>
        assert float(row["stability/lr/SGD"]) == pytest.approx(float(row["lr-SGD"]), rel=1e-6)
        assert float(row["stability/lr/Adam"]) == pytest.approx(float(row["lr-Adam"]), rel=1e-6)
    assert "stability/grad_norm" not in rows[0]  # no unnamed key that one optimizer would overwrite
    metrics = trainer.callback_metrics
    assert {"stability/grad_norm/SGD", "stability/grad_norm/Adam", "stability/lr/SGD", "stability/lr/Adam"} <= set(
        metrics
    )


def test_a_skip_belongs_to_the_optimizer_whose_gradient_was_bad() -> None:
    probe = PerOptimizerProbe()
    model = TwoOptimizerGAN(nan_d_at=(3,))
    trainer = quiet_trainer(
        max_epochs=1, callbacks=[probe, GradientNormMonitor(max_norm=1.0), WarmupConstantCosineLR(warmup=0.25)]
    )
    with pytest.warns(RuntimeWarning, match="Non-finite gradient norm"):
        trainer.fit(model)
    ledger = StepLedger.of(trainer)
    d, g = trainer.optimizers
    assert ledger.record_of(d).counts.tolist() == [7, 0, 1, 0, 0, 0]
    assert ledger.record_of(g).counts.tolist() == [8, 0, 0, 0, 0, 0]
    # the discriminator's weights did not move on the bad step, and its clock did not advance
    assert all(torch.equal(a, b) for a, b in zip(model.d_before[3], model.d_after[3], strict=True))
    assert probe.lrs["SGD"][4] == probe.lrs["SGD"][3]
    # the generator's schedule went on as if nothing happened
    expected = [0.01 * warmup_constant_cosine(n, 8, 0.25, 0.2) for n in range(8)]
    assert probe.lrs["Adam"] == pytest.approx(expected, rel=1e-6)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp16_loss_scaling_with_two_optimizers() -> None:
    tuner = LossScaleTuner(init_scale=2.0**8)
    trainer = quiet_trainer(
        max_epochs=1,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        callbacks=[GradientNormMonitor(max_norm=1.0), tuner],
    )
    trainer.fit(TwoOptimizerGAN())
    ledger = StepLedger.of(trainer)
    d, g = trainer.optimizers
    assert ledger.record_of(d).steps == ledger.record_of(g).steps == 8
    assert {"stability/loss_scale/SGD", "stability/loss_scale/Adam"} <= set(trainer.callback_metrics)
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


def test_run_lengths_per_optimizer_and_a_warning_past_the_end() -> None:
    class FiveToOne(TwoOptimizerGAN):
        """The discriminator steps twice per batch: 16 updates in an 8-batch epoch."""

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt_d, _ = self.optimizers()  # type: ignore[misc]
            for _ in range(2):
                opt_d.zero_grad()
                self.manual_backward(self.disc(batch[0]).pow(2).mean())
                opt_d.step()
            super().training_step(batch, batch_idx)

    probe = PerOptimizerProbe()
    trainer = quiet_trainer(max_epochs=1, callbacks=[probe, WarmupConstantCosineLR(warmup=0.25, decay=0.5)])
    with pytest.warns(UserWarning, match=r"Optimizer 0 \(SGD\) has taken 9 steps, more than .* run length of 8"):
        trainer.fit(FiveToOne())
    probe = PerOptimizerProbe()
    schedule = WarmupConstantCosineLR(warmup=0.25, decay=0.5, total_steps=[24, 8])
    trainer = quiet_trainer(max_epochs=1, callbacks=[probe, schedule])
    with warnings.catch_warnings(record=True) as caught:  # [24, 8] is exactly right: nothing to warn about
        warnings.simplefilter("always")
        trainer.fit(FiveToOne())
    assert not [w for w in caught if "total_steps" in str(w.message) or "run length" in str(w.message)]
    assert probe.lrs["SGD"] == pytest.approx([0.1 * warmup_constant_cosine(n, 24, 0.25, 0.5) for n in range(24)])
    with pytest.raises(StabilityConfigError, match=r"gives 3 run lengths for 2 optimizer"):
        quiet_trainer(max_epochs=1, callbacks=[WarmupConstantCosineLR(total_steps=[8, 8, 8])]).fit(TwoOptimizerGAN())


def test_resume_mid_epoch_continues_every_optimizer_exactly(tmp_path: Path) -> None:
    def run(max_steps: int, ckpt: str | None = None) -> tuple[pl.Trainer, PerOptimizerProbe]:
        probe = PerOptimizerProbe()
        trainer = quiet_trainer(
            max_steps=max_steps,
            enable_checkpointing=True,
            default_root_dir=tmp_path,
            callbacks=[probe, GradientNormMonitor(max_norm=1.0), WarmupConstantCosineLR(warmup=0.25, total_steps=16)],
        )
        torch.manual_seed(0)
        trainer.fit(TwoOptimizerGAN(nan_d_at=(2,)), ckpt_path=ckpt)
        return trainer, probe

    # manual optimization: global_step counts every optimizer step, so 16 == 8 batches of two steps
    straight, full = run(32)
    first, _ = run(10)  # stops mid-epoch (batch 5 of 8)
    path = tmp_path / "mid.ckpt"
    first.save_checkpoint(path)
    resumed, rest = run(32, str(path))
    for name in ("SGD", "Adam"):
        assert full.lrs[name][5:] == pytest.approx(rest.lrs[name], rel=1e-7), name
    for opt_a, opt_b in zip(straight.optimizers, resumed.optimizers, strict=True):
        assert (
            StepLedger.of(straight).record_of(opt_a).counts.tolist()
            == StepLedger.of(resumed).record_of(opt_b).counts.tolist()
        )
    for a, b in zip(straight.lightning_module.parameters(), resumed.lightning_module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_accumulation_refuses_manual_optimization_at_setup() -> None:
    trainer = quiet_trainer(max_epochs=1, callbacks=[GradientAccumulation(steps=2)])
    with pytest.raises(StabilityConfigError, match="automatic_optimization = False"):
        trainer.fit(TwoOptimizerGAN())


def test_names_follow_learning_rate_monitor_for_repeated_classes() -> None:
    from lightning_stability.ledger.track import optimizer_names

    params = [nn.Parameter(torch.zeros(1))]
    opts = [torch.optim.Adam(params), torch.optim.SGD(params, lr=1.0), torch.optim.Adam(params)]
    assert optimizer_names(opts) == ["Adam", "SGD", "Adam-1"]


def test_fp16_metrics_of_each_optimizer_keep_the_value_of_its_own_step(tmp_path: Path) -> None:
    """Both optimizers overflow at batch 2: D's update halves the scale, G's halves it again. Each optimizer's
    `stability/loss_scale/<name>` must be the scale after its own update, not the scaler's live value."""

    class BothOverflow(TwoOptimizerGAN):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            self.batch_idx = batch_idx
            super().training_step(batch, batch_idx)

        def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            super().manual_backward(loss * float("inf") if self.batch_idx == 2 else loss, *args, **kwargs)

    class SeenByMonitor(pl.Callback):
        def __init__(self) -> None:
            self.seen: dict[str, float] = {}

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 6:  # after batch 2 (two optimizer steps per batch)
                self.seen = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("stability/")}

    seen = SeenByMonitor()
    trainer = quiet_trainer(
        max_epochs=1,
        logger=CSVLogger(tmp_path, name="", version=""),
        log_every_n_steps=1,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        callbacks=[LossScaleTuner(init_scale=2.0**8, hysteresis=1, growth_interval=1000), seen],
    )
    trainer.fit(BothOverflow())
    assert seen.seen["stability/loss_scale/SGD"] == 128.0
    assert seen.seen["stability/loss_scale/Adam"] == 64.0
    assert seen.seen["stability/overflow_steps/SGD"] == 1.0
    assert seen.seen["stability/overflow_steps/Adam"] == 2.0
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    sgd = [float(r["stability/loss_scale/SGD"]) for r in rows if r.get("stability/loss_scale/SGD")]
    adam = [float(r["stability/loss_scale/Adam"]) for r in rows if r.get("stability/loss_scale/Adam")]
    assert sgd == [256.0, 256.0, 128.0, 64.0, 64.0, 64.0, 64.0, 64.0]
    assert adam == [256.0, 256.0, 64.0, 64.0, 64.0, 64.0, 64.0, 64.0]
