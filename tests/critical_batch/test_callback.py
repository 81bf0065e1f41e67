"""CriticalBatchMonitor and BatchRamp on real Trainers: the estimate against a by-hand computation, the ramp with the
LR schedule and beta2, the incident, exact resume across a change, a run that never ramps, the refusals."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_stability import (
    BatchRamp,
    CriticalBatchMonitor,
    GradientAccumulation,
    GradientNormMonitor,
    StabilityConfigError,
    TrainingHealthMonitor,
    WarmupConstantCosineLR,
)
from lightning_stability.checkpoint.exact_resume import ExactResume
from lightning_stability.health import load_report
from lightning_stability.ledger import StepLedger
from lightning_stability.ledger.stages import Stage
from lightning_stability.schedules.specs import WarmupConstantCosineSchedule
from tests.critical_batch.helpers import Windows, by_hand
from tests.helpers import TinyModule, count_host_data_per_step, count_syncs_per_step, quiet_trainer


def _fit(callbacks: list[Any], module: pl.LightningModule | None = None, **kwargs: Any) -> pl.Trainer:
    pl.seed_everything(0)
    trainer = quiet_trainer(callbacks=callbacks, **kwargs)
    trainer.fit(module if module is not None else TinyModule(n=256, batch_size=4))
    return trainer


# ------------------------------------------------------------------ the estimate
def test_estimate_is_the_by_hand_computation_on_the_same_micro_batches() -> None:
    windows = Windows()
    monitor = CriticalBatchMonitor(ema_decay=0.8, log_every_n_steps=1)
    module = TinyModule(n=96, batch_size=4)
    trainer = _fit([GradientAccumulation(steps={0: 3, 4: 2}), monitor, windows], module, max_epochs=1)
    assert windows.sizes[:4] == [3, 3, 3, 3] and windows.sizes[4] == 2
    steps = [(w, [b]) for w, b in zip(windows.starts, windows.batches, strict=True)]
    value, stderr = by_hand(module.net, steps, micro=4, decay=0.8)
    logged = trainer.callback_metrics
    torch.testing.assert_close(logged["stability/critical_batch"], value, rtol=1e-4, atol=0)
    torch.testing.assert_close(logged["stability/critical_batch_stderr"], stderr, rtol=1e-3, atol=0)
    assert monitor.critical_batch == pytest.approx(value.item(), rel=1e-4)  # read on the host on logging steps


class _Location(pl.LightningModule):
    """The loss ``|w - z|^2 / 2`` of samples ``z ~ N(0, I)`` in 256 dimensions, at weights held still (LR 0): the
    per-sample gradient is ``w - z``, so ``|G|^2 = |w|^2`` and ``tr(Sigma) = 256``: a critical batch of
    ``256 / |w|^2`` samples (16 at ``w = 0.25``), known exactly."""

    def __init__(self, micro: int, w: float = 0.25, n: int = 2048) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((256,), w))
        self.micro, self.n = micro, n

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return 0.5 * (self.w - batch[0]).pow(2).sum(1).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> DataLoader:
        z = torch.randn(self.n, 256, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(z), batch_size=self.micro, shuffle=True)


@pytest.mark.parametrize(("micro", "steps"), [(1, 8), (4, 2), (4, 8)])
def test_estimate_is_the_known_noise_scale_in_samples(micro: int, steps: int) -> None:
    """Against the truth, not the same formula: whatever the micro-batch and the factor, the figure is in samples."""
    monitor = CriticalBatchMonitor(ema_decay=0.98, log_every_n_steps=1)
    _fit([GradientAccumulation(steps=steps), monitor], _Location(micro), max_epochs=1)
    assert monitor.critical_batch == pytest.approx(16.0, rel=0.1)
    assert abs(monitor.critical_batch - 16.0) < 4 * monitor.critical_batch_stderr


@pytest.mark.parametrize(("rule", "batches"), [({}, {8, 16, 32}), ({"fraction": 2.0, "confidence": 0.0}, {128})])
def test_the_batch_stays_below_half_a_known_critical_batch(rule: dict[str, float], batches: set[int]) -> None:
    """A critical batch of 64 samples: by default the batch grows from 4 to at most 32; the rule of the figure above
    the current batch (``fraction=growth, confidence=0``) takes it to 128, twice the figure."""
    accumulation = GradientAccumulation(steps=2, lr_scaling="linear")
    ramp = BatchRamp(max_factor=64, beta2_half_life=False, log_every_n_steps=5, **rule)  # type: ignore[arg-type]
    _fit([accumulation, ramp], _Location(micro=2, w=0.125, n=8192), max_epochs=1)
    assert ramp.critical_batch == pytest.approx(64.0, rel=0.25)
    assert accumulation.factor * 2 in batches  # global batch: factor x 2 samples


@pytest.mark.parametrize("counter", [count_syncs_per_step, count_host_data_per_step])
def test_no_host_sync_off_logging_steps(counter: Any) -> None:
    """Neither a host read nor a tensor made from host data (a blocking copy on a GPU) is added to a step."""

    def run(extra: list[Any]) -> list[int]:
        pl.seed_everything(0)
        trainer = quiet_trainer(max_steps=6, log_every_n_steps=50, callbacks=[GradientAccumulation(2), *extra])
        return counter(trainer, TinyModule(n=128, batch_size=4))  # type: ignore[no-any-return]

    assert run([CriticalBatchMonitor()]) == run([])


def test_a_run_whose_critical_batch_stays_small_never_ramps() -> None:
    """Every sample the same: no gradient noise, a critical batch of about 0, no change."""
    x = torch.ones(256, 8)
    data = TensorDataset(x, torch.full((256, 1), 3.0))

    class Noiseless(TinyModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(data, batch_size=4)

    windows = Windows()
    accumulation = GradientAccumulation(steps=2, lr_scaling="sqrt")
    ramp = BatchRamp(max_factor=16, warmup_steps=2, log_every_n_steps=2)
    trainer = _fit([accumulation, ramp, windows], Noiseless(), max_epochs=1)
    assert set(windows.sizes) == {2} and accumulation.revision == 0
    assert abs(ramp.critical_batch) < 1.0 and trainer.callback_metrics["stability/critical_batch"].abs() < 1.0
    assert set(windows.beta2s) == {0.999}


# ------------------------------------------------------------------ the ramp
def _ramp_run(
    root: Path, ckpt: Path | None = None, every: int = 5, extra: tuple[Any, ...] = (), optimizer: str = "adamw"
) -> tuple[Windows, GradientAccumulation, Any]:
    windows = Windows()
    accumulation = GradientAccumulation(steps=2, lr_scaling="sqrt")
    callbacks = [
        WarmupConstantCosineLR(warmup=0.1, decay=0.3),
        accumulation,
        # the rule of the figure above the current batch (fraction=growth, confidence=0): these tests are of a change
        BatchRamp(max_factor=8, warmup_steps=6, fraction=2.0, confidence=0.0, ema_decay=0.8, log_every_n_steps=2),
        windows,
        ExactResume(),
        ModelCheckpoint(dirpath=root, every_n_train_steps=every, save_top_k=-1),
        *extra,
    ]
    pl.seed_everything(0)
    module = TinyModule(n=320, batch_size=4, optimizer=optimizer)  # 80 micro-batches per epoch
    trainer = quiet_trainer(max_epochs=2, enable_checkpointing=True, default_root_dir=root, callbacks=callbacks)
    trainer.fit(module, ckpt_path=ckpt)
    return windows, accumulation, (trainer, module)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_the_ramp_grows_the_batch_with_its_lr_beta2_and_sample_clock(tmp_path: Path, optimizer: str) -> None:
    """With AdamW the counts stay on the host; with a fused AdamW and a skip vote they are decided on the device, and
    ScheduledLR reads the LR from its device table, rebuilt at each change."""
    extra = (TrainingHealthMonitor(report_dir=tmp_path), GradientNormMonitor(max_norm=10.0))
    windows, accumulation, (trainer, _) = _ramp_run(tmp_path, extra=extra, optimizer=optimizer)
    assert StepLedger.of(trainer).record_of().counted_on_host == (optimizer == "adamw")
    sizes = windows.sizes
    grown = sorted(accumulation.state_dict()["grown"])
    assert grown and [f for _, f in grown] == [4, 8][: len(grown)]  # doubles, never past max_factor
    assert max(sizes) == grown[-1][1] and sizes[: grown[0][0]] == [2] * grown[0][0]
    # the LR: base x schedule(samples in starting batches) x sqrt(k); beta2 at a fixed half-life in samples
    schedule = WarmupConstantCosineSchedule(warmup=0.1, decay=0.3)
    total = 80 // 2 * 2  # the run's steps at the starting factor: the schedule counts samples
    position, factor_of = 0, dict(grown)
    factor = 2
    for step, (size, lr, beta2) in enumerate(zip(sizes, windows.lrs, windows.beta2s, strict=True)):
        factor = factor_of.get(step, factor)
        if size == factor:  # a full window (the last one of an epoch may be shorter)
            assert lr == pytest.approx(0.05 * schedule(min(position, total), total) * math.sqrt(factor), rel=1e-6)
            assert beta2 == pytest.approx(0.999 ** (factor / 2), rel=1e-12)
        position += factor // 2
    # the change is in the incident log, the ledger's events and the stability report's incident list
    logged = [json.loads(line) for line in (tmp_path / "incidents" / "rank-0.jsonl").read_text().splitlines()]
    ramps = [i for i in logged if i["kind"] == "batch_ramp"]
    assert len(ramps) == len(grown) and "accumulation 2 -> 4" in ramps[0]["action"]
    assert "beta2 0.999 -> 0.998001" in ramps[0]["detail"] and "LR x1.414" in ramps[0]["detail"]
    assert [e["kind"] for e in StepLedger.of(trainer).events].count("batch_ramp") == len(grown)
    report = load_report(tmp_path / "stability_report.json")
    assert [i["action"] for i in report["incidents"] if i["kind"] == "batch_ramp"] == [i["action"] for i in ramps]


def test_resume_after_a_change_is_exact(tmp_path: Path) -> None:
    windows, accumulation, (_, module) = _ramp_run(tmp_path / "a")
    first_change = min(k for k, _ in accumulation.state_dict()["grown"])
    for step in (5 * (first_change // 5 + 1), 5 * (first_change // 5 + 2)):  # after the change, mid-epoch
        ckpt = next((tmp_path / "a").glob(f"*step={step}.ckpt"))
        resumed, _, (trainer, module_b) = _ramp_run(tmp_path / f"b{step}", ckpt)
        assert resumed.sizes == windows.sizes[step:]
        assert resumed.lrs == windows.lrs[step:] and resumed.beta2s == windows.beta2s[step:]
        for a, b in zip(module.parameters(), module_b.parameters(), strict=True):
            assert torch.equal(a, b)
        assert trainer.optimizers[0].param_groups[0]["betas"][1] == windows.beta2s[-1]


def test_the_ramp_decides_at_row_13_before_accumulation_and_the_schedule() -> None:
    with pytest.warns(UserWarning, match=r"BatchRamp with Trainer\(max_steps=1\).*Fix: bound the run by max_epochs"):
        trainer = _fit(
            [WarmupConstantCosineLR(), GradientAccumulation(2, lr_scaling="sqrt"), BatchRamp(max_factor=4)],
            max_steps=1,
        )
    names = list(StepLedger.of(trainer)._at[Stage.AFTER_STEP])
    assert names.index("CriticalBatchMonitor") < names.index("GradientAccumulation") < names.index("ScheduledLR")


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("callbacks", "match"),
    [
        (lambda: [CriticalBatchMonitor()], r"no GradientAccumulation is among the Trainer's callbacks"),
        (lambda: [GradientAccumulation({0: 2, 5: 4}), BatchRamp(8)], r"`GradientAccumulation\(steps\)=\{0: 2, 5: 4\}`"),
        (lambda: [GradientAccumulation(1, lr_scaling="sqrt"), BatchRamp(8)], r"gives one micro-batch per step"),
        (lambda: [GradientAccumulation(2), BatchRamp(8)], r"`GradientAccumulation\(lr_scaling\)='none'`"),
        (lambda: [GradientAccumulation(16, lr_scaling="sqrt"), BatchRamp(8)], r"`max_factor=8` is below"),
    ],
)
def test_refused_at_setup(callbacks: Any, match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        _fit(callbacks(), max_steps=1)


def test_beta2_rule_refuses_an_optimizer_without_betas() -> None:
    cbs = [GradientAccumulation(2, lr_scaling="linear"), BatchRamp(8)]
    with pytest.raises(
        StabilityConfigError, match=r"`beta2_half_life=True` .* SGD has no `betas`.*beta2_half_life=False"
    ):
        _fit(cbs, TinyModule(optimizer="sgd"), max_steps=1)
    _fit(
        [GradientAccumulation(2, lr_scaling="linear"), BatchRamp(8, beta2_half_life=False)],
        TinyModule(optimizer="sgd"),
        max_steps=2,
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_factor": 1}, r"`max_factor=1` must be an int >= 2"),
        ({"max_factor": 8, "growth": 1.5}, r"`growth=1.5` must be an int >= 2"),
        ({"max_factor": 8, "ema_decay": 1.0}, r"`ema_decay=1.0`"),
        ({"max_factor": 8, "micro_batch_size": 0}, r"`micro_batch_size=0` must be an int >= 1"),
        ({"max_factor": 8, "fraction": 0}, r"`fraction=0` must be a finite number > 0.0.*fraction=0.5"),
        ({"max_factor": 8, "confidence": -1}, r"`confidence=-1` must be a finite number >= 0.0.*confidence=1.0"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        BatchRamp(**kwargs)


def test_pickling_and_state() -> None:
    ramp = BatchRamp(max_factor=4, warmup_steps=1, log_every_n_steps=1)
    _fit([GradientAccumulation(2, lr_scaling="sqrt"), ramp], max_steps=4)
    clone = pickle.loads(pickle.dumps(ramp))
    assert clone.state_key == ramp.state_key and clone.max_factor == 4
    state = ramp.state_dict()
    assert len(state["state"]) == 7 and state["measured"] == 4 and state["base_beta2"] == [0.999]
    fresh = BatchRamp(max_factor=4)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


def test_the_preset_field_is_off_by_default_and_checked() -> None:
    from lightning_stability.presets import PRESETS, get_preset

    assert all(get_preset(name).batch_ramp is None for name in PRESETS)
    with pytest.raises(StabilityConfigError, match=r"`batch_ramp=8` grows the accumulation from 1 .* Fix: pass e\.g\."):
        get_preset("gpt").derive("ramped", "gpt with a ramp", batch_ramp=8)
    ramped = get_preset("gpt").derive("ramped", "gpt with a ramp", accumulation=2, lr_scaling="sqrt", batch_ramp=8)
    assert ramped.batch_ramp == 8
