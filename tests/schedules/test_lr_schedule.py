"""ScheduledLR / WarmupConstantCosineLR on real Trainers: the applied-update clock, monitors, resume."""

from __future__ import annotations

import csv
import pickle
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, IterableDataset

from lightning_stability.errors import StabilityConfigError
from lightning_stability.grad_norm import GradientNormMonitor
from lightning_stability.ledger.update import supports_tensor_lr
from lightning_stability.schedules import (
    CosineSchedule,
    InverseSqrtSchedule,
    LinearSchedule,
    StepSchedule,
    cosine,
    linear,
    warmup_constant_cosine,
)
from lightning_stability.schedules.callback import ScheduledLR, WarmupConstantCosineLR
from tests.helpers import TinyModule, count_host_data_per_step, count_syncs_per_step, quiet_trainer


class Recorder(Callback):
    """The LR each optimizer step uses, per param group (tensor LRs are copied, read on the host after fit,
    so that the recorder adds no host sync of its own)."""

    def __init__(self) -> None:
        self._lrs: list[list[float | torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._lrs.append([g["lr"].clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in optimizer.param_groups])

    @property
    def lrs(self) -> list[list[float]]:
        return [[float(lr) for lr in step] for step in self._lrs]


class TwoGroupModule(TinyModule):
    """Two param groups with their own base LRs."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        first, rest = list(self.net[0].parameters()), [p for m in list(self.net)[1:] for p in m.parameters()]
        fused = self.optimizer_name.endswith("_fused") or None
        return torch.optim.AdamW([{"params": first, "lr": 0.1}, {"params": rest, "lr": 0.01}], fused=fused)


def applied_before_each_step(attempts: int, skipped: set[int]) -> list[int]:
    out, applied = [], 0
    for i in range(attempts):
        out.append(applied)
        applied += i not in skipped
    return out


# ------------------------------------------------------------------ the curve
@pytest.mark.parametrize(
    ("schedule", "fn"),
    [
        (CosineSchedule(warmup=3, min_lr_ratio=0.1), lambda n: cosine(n, 12, 3, 0.1)),
        (LinearSchedule(warmup=0.25), lambda n: linear(n, 12, 0.25)),
        (
            StepSchedule(gamma=0.5, every=4, warmup=2),
            lambda n: 0.5 ** ((n - 2) // 4) if n >= 2 else (n + 1) / 2,
        ),
        (InverseSqrtSchedule(warmup=4), lambda n: (n + 1) / 4 if n < 4 else (4 / n) ** 0.5),
    ],
)
def test_each_group_follows_schedule_from_its_own_base(schedule: Any, fn: Any) -> None:
    rec = Recorder()
    module = TwoGroupModule()
    trainer = quiet_trainer(max_steps=12, callbacks=[ScheduledLR(schedule), rec])
    trainer.fit(module)
    assert len(rec.lrs) == 12
    for n, (lr0, lr1) in enumerate(rec.lrs):
        assert lr0 == pytest.approx(0.1 * fn(n), rel=1e-12), n
        assert lr1 == pytest.approx(0.01 * fn(n), rel=1e-12), n
    assert rec.lrs[0][0] > 0  # the first update is never spent at LR 0
    # the optimizer's own defaults (the user's arguments) are untouched
    assert trainer.optimizers[0].defaults["lr"] == 0.001


def test_total_defaults_to_estimated_stepping_batches() -> None:
    rec = Recorder()
    # 64 samples / batch 8 = 8 batches per epoch, 3 epochs: 24 optimizer steps
    trainer = quiet_trainer(max_epochs=3, callbacks=[WarmupConstantCosineLR(), rec])
    trainer.fit(TinyModule(lr=0.05))
    assert trainer.estimated_stepping_batches == 24
    assert [x[0] for x in rec.lrs] == pytest.approx([0.05 * warmup_constant_cosine(n, 24) for n in range(24)])


def test_skipped_steps_hold_the_lr_still(tmp_path: Path) -> None:
    # inf loss at steps 3 and 4: GradientNormMonitor skips both; the schedule must not advance on them
    rec = Recorder()
    module = TinyModule(lr=0.05, inf_at_step=[3, 4])
    trainer = quiet_trainer(
        max_steps=10, callbacks=[GradientNormMonitor(), WarmupConstantCosineLR(warmup=4, decay=4), rec]
    )
    trainer.fit(module)
    applied = applied_before_each_step(10, {3, 4})
    assert applied == [0, 1, 2, 3, 3, 3, 4, 5, 6, 7]
    expected = [0.05 * warmup_constant_cosine(n, 10, 4, 4) for n in applied]
    assert [x[0] for x in rec.lrs] == pytest.approx(expected, rel=1e-12)
    assert rec.lrs[3] == rec.lrs[4] == rec.lrs[5]


def test_skipped_steps_on_device_use_a_tensor_lr_without_syncs() -> None:
    # fused AdamW skips on the device (found_inf): the count never reaches the host, the LR is a tensor
    rec = Recorder()
    module = TinyModule(lr=0.05, optimizer="adamw_fused", inf_at_step=[3, 4])
    trainer = quiet_trainer(
        max_steps=10, callbacks=[GradientNormMonitor(), WarmupConstantCosineLR(warmup=4, decay=4), rec]
    )
    trainer.fit(module)
    assert isinstance(trainer.optimizers[0].param_groups[0]["lr"], torch.Tensor)
    assert supports_tensor_lr(trainer.optimizers[0])
    expected = [0.05 * warmup_constant_cosine(n, 10, 4, 4) for n in applied_before_each_step(10, {3, 4})]
    assert [x[0] for x in rec.lrs] == pytest.approx(expected, rel=1e-6)  # float32 on the device


# ------------------------------------------------------------------ what monitors see
def _csv_rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_lr_monitor_and_stability_lr_see_the_schedule(tmp_path: Path, optimizer: str) -> None:
    logger = CSVLogger(tmp_path)
    module = TinyModule(lr=0.05, optimizer=optimizer, inf_at_step=[2])
    callbacks = [
        GradientNormMonitor(),
        WarmupConstantCosineLR(warmup=4, decay=4),
        LearningRateMonitor("step"),
    ]
    trainer = quiet_trainer(max_steps=10, logger=logger, log_every_n_steps=1, callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LearningRateMonitor copy-constructs a tensor LR
        trainer.fit(module)
    logger.save()
    rows = _csv_rows(logger)
    expected = [0.05 * warmup_constant_cosine(n, 10, 4, 4) for n in applied_before_each_step(10, {2})]
    monitored = {int(r["step"]): float(r["lr-AdamW"]) for r in rows if r.get("lr-AdamW")}
    ours = {int(r["step"]): float(r["stability/lr"]) for r in rows if r.get("stability/lr")}
    # the LR of each update, logged for the same updates under the same labels
    assert list(monitored) == list(range(10)) and list(ours) == list(range(10))
    assert list(monitored.values()) == pytest.approx(expected, rel=1e-6)
    assert list(ours.values()) == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------------------------ errors
class WithScheduler(TinyModule):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)}


def test_module_with_its_own_scheduler_is_an_error() -> None:
    trainer = quiet_trainer(max_steps=2, callbacks=[WarmupConstantCosineLR()])
    with pytest.raises(StabilityConfigError, match=r"returns LR scheduler\(s\) \['CosineAnnealingLR'\].*Fix: return"):
        trainer.fit(WithScheduler())


def test_two_schedules_are_an_error() -> None:
    trainer = quiet_trainer(max_steps=2, callbacks=[WarmupConstantCosineLR(), ScheduledLR(CosineSchedule())])
    with pytest.raises(StabilityConfigError, match=r"2 ScheduledLR callbacks are attached .*overwrite"):
        trainer.fit(TinyModule())


class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        for _ in range(16):
            yield torch.randn(8), torch.randn(1)


class StreamModule(TinyModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(Stream(), batch_size=4)


def test_unknown_run_length_is_an_error_unless_given() -> None:
    trainer = quiet_trainer(max_epochs=1, callbacks=[WarmupConstantCosineLR()])
    with pytest.raises(StabilityConfigError, match=r"run length but the training data is an iterable dataset .*Fix"):
        trainer.fit(StreamModule())
    rec = Recorder()
    quiet_trainer(max_epochs=1, callbacks=[WarmupConstantCosineLR(total_steps=4), rec]).fit(StreamModule())
    assert len(rec.lrs) == 4
    # a schedule without an end needs no length at all
    rec = Recorder()
    quiet_trainer(max_epochs=1, callbacks=[ScheduledLR(InverseSqrtSchedule(warmup=2)), rec]).fit(StreamModule())
    assert [x[0] for x in rec.lrs] == pytest.approx([0.025, 0.05, 0.05 * (2 / 2) ** 0.5, 0.05 * (2 / 3) ** 0.5])


def test_an_endless_run_names_its_real_cause() -> None:
    trainer = quiet_trainer(max_epochs=-1, max_time={"seconds": 30}, callbacks=[WarmupConstantCosineLR()])
    with pytest.raises(StabilityConfigError, match=r"no set length \(max_epochs=-1 and no max_steps; it stops") as err:
        trainer.fit(TinyModule())
    assert "iterable" not in str(err.value)


@pytest.mark.parametrize(("total", "how"), [(16, "ends early"), (64, "will not reach its end")])
def test_total_steps_that_disagrees_with_the_run_warns_once(total: int, how: str) -> None:
    rec = Recorder()
    trainer = quiet_trainer(max_steps=32, callbacks=[WarmupConstantCosineLR(total_steps=total), rec])
    with pytest.warns(
        UserWarning, match=rf"total_steps={total}\) but the Trainer will run 32 optimizer steps.*{how}"
    ) as w:
        trainer.fit(TinyModule(n=512))
    assert sum("LR" in str(x.message) or "schedule" in str(x.message) for x in w) == 1  # said once, at the start
    assert len(rec.lrs) == 32
    if total == 16:  # the schedule ended at its floor (0) and stayed there, as the warning said
        assert [x[0] for x in rec.lrs[16:]] == [0.0] * 16


def test_a_schedule_that_does_not_take_step_and_total_is_refused_at_construction() -> None:
    with pytest.raises(StabilityConfigError, match=r"`schedule=.*\(step, total_steps\)"):
        ScheduledLR(lambda step: 1.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_non_finite_or_negative_multiplier_stops_the_run_before_it_is_used(bad: float) -> None:
    rec = Recorder()
    model = TinyModule()
    trainer = quiet_trainer(max_steps=6, callbacks=[ScheduledLR(lambda s, t: 1.0 if s < 2 else bad), rec])
    with pytest.raises(StabilityConfigError, match=rf"(?s)(?=.*step 2\b)(?=.*{bad})"):
        trainer.fit(model)
    assert [x[0] for x in rec.lrs] == [0.05, 0.05]  # two good updates, the bad LR never reached the optimizer
    assert all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(StabilityConfigError, match=rf"(?s)(?=.*step 0\b)(?=.*{bad})"):
        quiet_trainer(max_steps=2, callbacks=[ScheduledLR(lambda s, t: bad)]).fit(TinyModule())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": 3}, r"`schedule=3` is not a schedule"),
        ({"schedule": CosineSchedule(), "total_steps": 0}, r"`total_steps=0` must be an int >= 1"),
        (
            {"schedule": CosineSchedule(), "log_every_n_steps": 0},
            r"`log_every_n_steps=0` must be an int >= 1",
        ),
        (
            {"schedule": CosineSchedule(warmup=20), "total_steps": 10},
            r"`warmup=20` is longer than the run \(total_steps=10\)",
        ),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        ScheduledLR(**kwargs)


def test_warmup_constant_cosine_lr_bad_arguments() -> None:
    with pytest.raises(StabilityConfigError, match=r"`warmup \+ decay=1.15` is more than the whole run"):
        WarmupConstantCosineLR(warmup=0.2, decay=0.95)


# ------------------------------------------------------------------ resume
def _run(tmp_path: Path, optimizer: str, ckpt: Path | None) -> tuple[list[float], list[torch.Tensor]]:
    pl.seed_everything(0)
    rec = Recorder()
    module = TinyModule(lr=0.05, optimizer=optimizer, inf_at_step=[3, 13], n=80)  # 10 batches per epoch
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=10, save_top_k=-1)
    trainer = quiet_trainer(
        max_steps=20,
        enable_checkpointing=True,
        callbacks=[GradientNormMonitor(), WarmupConstantCosineLR(warmup=0.2, decay=0.5), rec, saver],
    )
    trainer.fit(module, ckpt_path=ckpt)
    return [x[0] for x in rec.lrs], [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_resume_continues_the_curve_exactly(tmp_path: Path, optimizer: str) -> None:
    straight_lrs, straight_weights = _run(tmp_path / "a", optimizer, None)
    ckpt = tmp_path / "a" / "epoch=0-step=10.ckpt"
    assert ckpt.exists()
    resumed_lrs, resumed_weights = _run(tmp_path / "b", optimizer, ckpt)
    assert len(straight_lrs) == 20 and len(resumed_lrs) == 10
    assert resumed_lrs == straight_lrs[10:]
    assert all(torch.equal(a, b) for a, b in zip(straight_weights, resumed_weights, strict=True))
    # and the straight run held still on its skipped steps (3 and 13)
    assert straight_lrs[3] == straight_lrs[4] and straight_lrs[13] == straight_lrs[14]


def _make_schedule() -> Any:
    # A new function object on every call, as in a new process: the same name, another address.
    def halve_every_two(step: int, total_steps: int | None) -> float:
        return 0.5 ** (step // 2)

    return halve_every_two


def _run_function_schedule(tmp_path: Path, ckpt: Path | None) -> tuple[list[float], list[torch.Tensor]]:
    pl.seed_everything(0)
    rec = Recorder()
    module = TinyModule(lr=0.05, n=32)  # 4 batches per epoch
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    callbacks = [ScheduledLR(_make_schedule()), rec, saver]
    trainer = quiet_trainer(max_steps=8, enable_checkpointing=True, callbacks=callbacks)
    trainer.fit(module, ckpt_path=ckpt)
    return [x[0] for x in rec.lrs], [p.detach().clone() for p in module.parameters()]


def test_resume_with_a_plain_function_schedule(tmp_path: Path) -> None:
    """The callback's state (the base LRs) is found again although the function's repr (its address) changed;
    otherwise the resumed run would take the scheduled LR for the base and shrink it once more."""
    straight_lrs, straight_weights = _run_function_schedule(tmp_path / "a", None)
    resumed_lrs, resumed_weights = _run_function_schedule(tmp_path / "b", tmp_path / "a" / "epoch=0-step=4.ckpt")
    assert straight_lrs == pytest.approx([0.05 * 0.5 ** (n // 2) for n in range(8)], rel=1e-12)
    assert resumed_lrs == straight_lrs[4:]
    assert all(torch.equal(a, b) for a, b in zip(straight_weights, resumed_weights, strict=True))


def test_state_dict_round_trip_and_pickling() -> None:
    cb = WarmupConstantCosineLR(warmup=2, decay=4)
    trainer = quiet_trainer(max_steps=6, callbacks=[cb])
    trainer.fit(TinyModule(lr=0.05))
    state = cb.state_dict()
    assert state == {"base_lrs": [[0.05]], "total_steps": [6]}  # the applied count travels in the ledger
    fresh = WarmupConstantCosineLR(warmup=2, decay=4)
    fresh.load_state_dict(state)
    assert fresh.state_dict()["base_lrs"] == [[0.05]]
    clone = pickle.loads(pickle.dumps(cb))
    assert clone.schedule == cb.schedule and clone.state_key == cb.state_key
    assert WarmupConstantCosineLR(decay=0.5).state_key != cb.state_key


# ------------------------------------------------------------------ host syncs
def _syncs(callbacks: list[Callback], optimizer: str, inf_at_step: list[int] | None = None) -> list[int]:
    pl.seed_everything(0)
    trainer = quiet_trainer(max_steps=8, callbacks=callbacks)
    return count_syncs_per_step(trainer, TinyModule(optimizer=optimizer, inf_at_step=inf_at_step))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "adamw_fused", "sgd_fused"])
def test_no_host_sync_added_to_the_step(optimizer: str) -> None:
    bare = _syncs([], optimizer)
    scheduled = _syncs([WarmupConstantCosineLR(warmup=2, decay=3)], optimizer)
    assert scheduled == bare


@pytest.mark.parametrize("optimizer", ["adamw_fused", "sgd_fused"])
def test_device_path_adds_no_sync_to_device_decided_skips(optimizer: str) -> None:
    # GradientNormMonitor skips on the device here; the LR follows the device count as a tensor
    monitor_only = _syncs([GradientNormMonitor()], optimizer, [3])
    scheduled = _syncs([GradientNormMonitor(), WarmupConstantCosineLR(warmup=2, decay=3)], optimizer, [3])
    assert scheduled == monitor_only


def test_device_path_builds_no_tensor_from_host_data() -> None:
    # on a GPU `torch.tensor(x, device="cuda")` blocks like a sync; the device path must not build any
    bare = _host_data([], "adamw_fused", [3])
    scheduled = _host_data([GradientNormMonitor(), WarmupConstantCosineLR(warmup=2, decay=3)], "adamw_fused", [3])
    assert scheduled[1:] == bare[1:]  # the first step builds the schedule's table (and the ledger's counters) once


def _host_data(callbacks: list[Callback], optimizer: str, inf_at_step: list[int]) -> list[int]:
    pl.seed_everything(0)
    trainer = quiet_trainer(max_steps=8, callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return count_host_data_per_step(trainer, TinyModule(optimizer=optimizer, inf_at_step=inf_at_step))


def test_non_fused_optimizer_adds_no_sync_when_the_skip_was_decided_on_the_host() -> None:
    # A non-fused optimizer's skip is read on the host by the ledger (GradientNormMonitor's one sync),
    # so the applied count stays a host integer and the schedule adds nothing on top.
    monitor_only = _syncs([GradientNormMonitor()], "adamw", [3])
    scheduled = _syncs([GradientNormMonitor(), WarmupConstantCosineLR(warmup=2, decay=3)], "adamw", [3])
    assert scheduled == monitor_only


def _fp16(callbacks: list[Callback], optimizer: str, rec: Recorder | None = None) -> list[int]:
    pl.seed_everything(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer = quiet_trainer(
        max_steps=8,
        callbacks=[*callbacks, *([rec] if rec else [])],
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )
    return count_syncs_per_step(trainer, TinyModule(lr=0.05, optimizer=optimizer, inf_at_step=[3, 4]))


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_fp16_scaler_skips_hold_the_lr_still_without_syncs(optimizer: str) -> None:
    """Steps 3 and 4 overflow: the loss scaler skips them and the LR holds still. The schedule adds no host
    sync to a bare fp16 Trainer: for non-fused optimizers the scaler's own host decision is reused (the
    optimizer stepped or not), for fused ones the LR is a device tensor."""
    bare = _fp16([], optimizer)
    rec = Recorder()
    scheduled = _fp16([WarmupConstantCosineLR(warmup=4, decay=4)], optimizer, rec)
    expected = [0.05 * warmup_constant_cosine(n, 8, 4, 4) for n in applied_before_each_step(8, {3, 4})]
    assert [x[0] for x in rec.lrs] == pytest.approx(expected, rel=1e-6)
    assert rec.lrs[3] == rec.lrs[4] == rec.lrs[5]
    assert scheduled == bare


def test_a_plain_function_holds_its_final_value_past_total_steps() -> None:
    """Past `total_steps` the function is not called with steps it was not written for: the LR holds the
    value at the end, as the device table does (here the function would turn negative)."""
    rec = Recorder()
    schedule = ScheduledLR(lambda s, t: (t - s) / t, total_steps=4)
    trainer = quiet_trainer(max_steps=6, callbacks=[schedule, rec])
    with pytest.warns(UserWarning, match=r"total_steps=4\) but the Trainer will run 6 .*ends early"):
        trainer.fit(TinyModule())
    assert [x[0] for x in rec.lrs] == pytest.approx([0.05, 0.0375, 0.025, 0.0125, 0.0, 0.0])


def test_passing_the_end_of_a_run_without_a_known_length_warns() -> None:
    trainer = quiet_trainer(max_epochs=1, callbacks=[ScheduledLR(CosineSchedule(), total_steps=2)])
    with pytest.warns(UserWarning, match=r"has taken 3 steps, more than the LR schedule's run length of 2"):
        trainer.fit(StreamModule())  # 4 batches of an iterable dataset without a length


def test_total_steps_of_the_wrong_type_and_numpy_multipliers() -> None:
    import numpy as np

    with pytest.raises(StabilityConfigError, match=r"`total_steps=4.0` must be an int >= 1"):
        ScheduledLR(lambda s, t: 1.0, total_steps=4.0)  # type: ignore[arg-type]
    rec = Recorder()
    quiet_trainer(max_steps=2, callbacks=[ScheduledLR(lambda s, t: np.float32(0.5)), rec]).fit(TinyModule())
    assert [x[0] for x in rec.lrs] == [0.025, 0.025]
