"""LossScaleTuner and TunedGradScaler in real fp16 Trainers on the CPU."""

from __future__ import annotations

import logging
import pickle
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins import MixedPrecision

from lightning_stability.amp.callback import FusedClipMixedPrecision, LossScaleFloorError, LossScaleTuner
from lightning_stability.amp.rule import auto_initial_scale
from lightning_stability.amp.scaler import TunedGradScaler
from lightning_stability.errors import StabilityConfigError
from lightning_stability.grad_norm import GradientNormMonitor
from lightning_stability.ledger.step_ledger import Outcome, StepLedger
from lightning_stability.schedules import warmup_constant_cosine
from lightning_stability.schedules.callback import WarmupConstantCosineLR
from tests.helpers import TinyModule, count_syncs_per_step, quiet_trainer

# Injected overflows (the loss times inf) at these steps; at scale 256 TinyModule never overflows by itself.
INF_STEPS = [1, 2, 3, 7, 8]
TRACES = {
    1: [256, 128, 64, 32, 32, 32, 64, 32, 16, 16, 16, 32],
    2: [256, 256, 128, 64, 64, 64, 128, 128, 64, 64, 64, 128],
    3: [256, 256, 256, 128, 128, 128, 256, 256, 256, 256, 256, 512],
}


def fp16_plugin(**scaler_kwargs: Any) -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **scaler_kwargs))


class ScaledLossModule(TinyModule):
    """TinyModule whose loss (hence every gradient) is multiplied by ``loss_mult``."""

    def __init__(self, loss_mult: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loss_mult = loss_mult

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * self.loss_mult


class Recorder(pl.Callback):
    """Per step: the scale after the update, whether the parameters moved, the first step's max |grad|."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.moved: list[bool] = []
        self.first_peak: float | None = None
        self._before: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self._before = [p.detach().clone() for p in pl_module.parameters()]

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.first_peak is None:
            self.first_peak = max(p.grad.abs().max().item() for p in pl_module.parameters() if p.grad is not None)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())  # type: ignore[attr-defined]
        after = list(pl_module.parameters())
        self.moved.append(any(not torch.equal(a, b) for a, b in zip(self._before, after, strict=True)))


class MemoryLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((int(step or 0), dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def series(self, key: str) -> dict[int, float]:
        return {step: m[key] for step, m in self.records if key in m}


def fit(module: pl.LightningModule, callbacks: list[pl.Callback], max_steps: int, **kwargs: Any) -> pl.Trainer:
    trainer = quiet_trainer(max_steps=max_steps, plugins=[fp16_plugin()], callbacks=callbacks, **kwargs)
    trainer.fit(module)
    return trainer


# ---------------------------------------------------------------------- the trace
@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_scale_trace_under_forced_overflows(hysteresis: int, optimizer: str) -> None:
    rec = Recorder()
    tuner = LossScaleTuner(init_scale=256, growth_interval=3, hysteresis=hysteresis, min_scale=None)
    trainer = fit(TinyModule(inf_at_step=INF_STEPS, optimizer=optimizer), [tuner, rec], max_steps=12)
    assert rec.scales == TRACES[hysteresis]
    # every overflow step is skipped, whatever the hysteresis; every other step is applied
    assert rec.moved == [i not in INF_STEPS for i in range(12)]
    ledger = StepLedger.of(trainer)
    assert int(ledger.record_of().applied_steps) == 12 - len(INF_STEPS)
    assert ledger.record_of().counts.tolist() == [12 - len(INF_STEPS), len(INF_STEPS), 0, 0, 0, 0]
    assert int(tuner.scaler.overflow_steps) == len(INF_STEPS)  # type: ignore[union-attr]


def test_accumulation_updates_once_per_optimizer_step() -> None:
    rec = Recorder()
    tuner = LossScaleTuner(init_scale=256, growth_interval=3, hysteresis=2, min_scale=None)
    trainer = fit(TinyModule(inf_at_step=INF_STEPS), [tuner, rec], max_steps=12, accumulate_grad_batches=2)
    assert tuner.scaler is not None and tuner.scaler.updates == 12  # 24 micro-batches, 12 optimizer steps
    assert rec.scales[1::2] == TRACES[2]  # recorded after every micro-batch; the odd ones end a step
    assert int(StepLedger.of(trainer).record_of().applied_steps) == 12 - len(INF_STEPS)


def test_hysteresis_1_without_floor_equals_torch_gradscaler() -> None:
    # init 2**16: TinyModule's own first steps overflow too, so both scalers calibrate as well
    kwargs = dict(init_scale=2.0**16, growth_interval=2)
    torch_rec, ours_rec = Recorder(), Recorder()
    torch.manual_seed(0)
    theirs = TinyModule(inf_at_step=[4, 5, 9])
    trainer = quiet_trainer(max_steps=14, plugins=[fp16_plugin(**kwargs)], callbacks=[torch_rec])
    trainer.fit(theirs)
    torch.manual_seed(0)
    ours = TinyModule(inf_at_step=[4, 5, 9])
    fit(ours, [LossScaleTuner(hysteresis=1, min_scale=None, **kwargs), ours_rec], max_steps=14)  # type: ignore[arg-type]
    assert ours_rec.scales == torch_rec.scales
    assert ours_rec.moved == torch_rec.moved
    assert sum(not m for m in torch_rec.moved) > 3  # the run really overflowed beyond the injected steps
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class LRs(pl.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_overflow_skips_hold_the_lr_schedule_still(optimizer: str) -> None:
    # the tuner's skips reach the LR schedule only through the shared ledger (Outcome.SKIPPED_SCALER)
    rec = LRs()
    callbacks = [LossScaleTuner(init_scale=256, hysteresis=1), WarmupConstantCosineLR(warmup=4, decay=4), rec]
    fit(TinyModule(lr=0.05, optimizer=optimizer, inf_at_step=[3, 4, 6]), callbacks, max_steps=10)
    applied_before = [0, 1, 2, 3, 3, 3, 4, 4, 5, 6]
    expected = [0.05 * warmup_constant_cosine(n, 10, 4, 4) for n in applied_before]
    assert rec.lrs == pytest.approx(expected, rel=1e-6)  # fused: a float32 tensor LR on the device
    attempted = [0.05 * warmup_constant_cosine(n, 10, 4, 4) for n in range(10)]
    assert rec.lrs[-1] != pytest.approx(attempted[-1], rel=1e-3)  # what counting attempts would have given


# ---------------------------------------------------------------------- floor
def test_floor_raise_stops_the_run_at_the_next_logging_step() -> None:
    tuner = LossScaleTuner(init_scale=256, hysteresis=1, min_scale=64, log_every_n_steps=2)
    module = TinyModule(inf_at_step=[1, 2, 3, 4, 5])
    # 256 -> 128 (step 1) -> 64 (step 2) -> floor stops the backoff at step 3, logged at ledger step 4
    with pytest.raises(LossScaleFloorError, match=r"at its floor \(min_scale=64.0\).*1 more time\(s\) by step 4"):
        trainer = quiet_trainer(max_steps=20, plugins=[fp16_plugin()], callbacks=[tuner])
        trainer.fit(module)
    assert trainer.global_step == 4
    assert trainer.interrupted


def test_floor_warn_keeps_training_and_warns_once_about_struggling() -> None:
    tuner = LossScaleTuner(init_scale=256, hysteresis=1, min_scale=64, log_every_n_steps=2, on_min_scale="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(TinyModule(inf_at_step=[1, 2, 3, 4, 5]), [tuner], max_steps=10)
    floor = [w for w in caught if "at its floor" in str(w.message)]
    struggling = [w for w in caught if "struggling" in str(w.message)]
    assert trainer.global_step == 10
    assert [str(w.message).split(" by step ")[1][:1] for w in floor] == ["4", "6"]  # 1 hit by step 4, 2 by 6
    # the first logging step after an overflow: 128 is within 4 backoffs of the floor
    assert len(struggling) == 1 and "step 2: 50.0% of the last 2 steps overflowed" in str(struggling[0].message)
    assert "loss scale is 128" in str(struggling[0].message)
    assert int(tuner.scaler.floor_hits) == 3  # type: ignore[union-attr]


def test_floor_hit_after_the_last_logging_step_is_reported_at_train_end() -> None:
    tuner = LossScaleTuner(init_scale=256, hysteresis=1, min_scale=128, log_every_n_steps=50)
    trainer = quiet_trainer(max_steps=4, plugins=[fp16_plugin()], callbacks=[tuner])
    with pytest.raises(LossScaleFloorError, match="by step 4"):
        trainer.fit(TinyModule(inf_at_step=[1, 2]))


def test_high_overflow_rate_warns_once_and_a_healthy_run_not_at_all() -> None:
    def run(inf_steps: list[int]) -> list[str]:
        tuner = LossScaleTuner(
            init_scale=2.0**12, hysteresis=3, min_scale=None, overflow_window=4, max_overflow_rate=0.25,
            log_every_n_steps=2,
        )  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(TinyModule(inf_at_step=inf_steps), [tuner], max_steps=12)
        return [str(w.message) for w in caught if "struggling" in str(w.message)]

    bad = run([0, 2, 3, 5, 6, 7])
    assert len(bad) == 1 and "of the last 4 steps overflowed" in bad[0]
    assert run([]) == []


# ---------------------------------------------------------------------- logging
def test_logged_keys_and_values() -> None:
    logger, rec = MemoryLogger(), Recorder()
    tuner = LossScaleTuner(init_scale=256, growth_interval=3, hysteresis=2, min_scale=None, overflow_window=4)
    fit(TinyModule(inf_at_step=INF_STEPS), [tuner, rec], max_steps=12, logger=logger, log_every_n_steps=3)
    scales = logger.series("stability/loss_scale")  # optimizer steps 3, 6, 9, 12 under Lightning's labels
    assert sorted(scales) == [2, 5, 8, 11]
    assert scales == {s - 1: rec.scales[s - 1] for s in (3, 6, 9, 12)}
    flags = [int(i in INF_STEPS) for i in range(12)]
    assert logger.series("stability/overflow_steps") == {s - 1: sum(flags[:s]) for s in (3, 6, 9, 12)}
    rates = logger.series("stability/overflow_rate")
    assert rates == pytest.approx({s - 1: sum(flags[max(0, s - 4) : s]) / min(s, 4) for s in (3, 6, 9, 12)})
    assert set(logger.series("stability/loss_scale_floor_hits").values()) == {0.0}


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
@pytest.mark.parametrize("with_grad_norm", [False, True])
def test_sync_counts_match_a_bare_fp16_trainer(optimizer: str, with_grad_norm: bool) -> None:
    bare = count_syncs_per_step(
        quiet_trainer(max_steps=10, plugins=[fp16_plugin(init_scale=256.0)], log_every_n_steps=5),
        TinyModule(inf_at_step=[3], optimizer=optimizer),
    )
    callbacks: list[pl.Callback] = [LossScaleTuner(init_scale=256, fit_start_checks=False)]
    if with_grad_norm:  # its metrics and ours share the ledger's one transfer
        callbacks.append(GradientNormMonitor(max_norm=1.0))
    tuned = count_syncs_per_step(
        quiet_trainer(max_steps=10, plugins=[fp16_plugin()], log_every_n_steps=5, callbacks=callbacks),
        TinyModule(inf_at_step=[3], optimizer=optimizer),
    )
    logging_steps = {4, 9}  # ledger steps 5 and 10: the one batched transfer each
    assert tuned == [b + (i in logging_steps) for i, b in enumerate(bare)], (bare, tuned)


# ---------------------------------------------------------------------- auto initial scale
def test_auto_on_huge_gradients_applies_the_first_step() -> None:
    def run(init: float | str) -> Recorder:
        rec = Recorder()
        fit(ScaledLossModule(loss_mult=500.0), [LossScaleTuner(init_scale=init), rec], max_steps=30)  # type: ignore[arg-type]
        return rec

    auto, fixed = run("auto"), run(2.0**16)
    assert auto.moved[0]  # the probe step at scale 1 is a normal update
    assert auto.scales[0] == auto_initial_scale(torch.tensor(auto.first_peak)).item()
    assert 1 <= auto.scales[0] <= 64
    assert auto.moved == [True] * 30  # no overflow at all
    assert fixed.moved.index(True) >= 10  # 2**16 backs off (hysteresis 2) for many steps first


def test_auto_on_tiny_gradients_picks_a_large_scale() -> None:
    rec = Recorder()
    fit(ScaledLossModule(loss_mult=1e-4), [LossScaleTuner(init_scale="auto"), rec], max_steps=6)
    assert rec.first_peak is not None and 0 < rec.first_peak < 1e-3
    assert rec.scales[0] == auto_initial_scale(torch.tensor(rec.first_peak)).item()
    assert rec.scales[0] > 2.0**16
    assert rec.moved == [True] * 6


def test_auto_when_every_gradient_underflows_skips_the_probe_step() -> None:
    rec = Recorder()
    tuner = LossScaleTuner(init_scale="auto")
    trainer = fit(ScaledLossModule(loss_mult=1e-12), [tuner, rec], max_steps=4)
    assert rec.first_peak == 0.0  # fp16 flushed everything to zero at scale 1
    assert rec.scales[0] == 2.0**24
    assert rec.moved == [False, True, True, True]
    assert StepLedger.of(trainer).record_of().counts.tolist()[: Outcome.SKIPPED_SCALER + 1] == [3, 1]
    assert int(tuner.scaler.overflow_steps) == 0  # type: ignore[union-attr]  # an empty probe is no overflow


# ---------------------------------------------------------------------- resume
def test_resume_continues_the_exact_trace(tmp_path: Path) -> None:
    def tuner() -> LossScaleTuner:
        return LossScaleTuner(init_scale=256, growth_interval=3, hysteresis=3, min_scale=None, overflow_window=5)

    inf = [2, 6, 9, 10, 13]
    # one batch per epoch: every step sees the same data, whatever Lightning's epoch bookkeeping on resume
    torch.manual_seed(0)
    full_rec, full = Recorder(), TinyModule(inf_at_step=inf, n=8)
    every_epoch = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True)
    fit(full, [tuner(), full_rec, every_epoch], max_steps=16, enable_checkpointing=True)
    ckpt = tmp_path / "epoch=7-step=8.ckpt"
    state = torch.load(ckpt, weights_only=False)["MixedPrecision"]
    assert state["_hysteresis_tracker"] == 2 and state["_growth_tracker"] == 1  # mid-hysteresis, mid-growth

    rec, second = Recorder(), TinyModule(inf_at_step=inf, n=8)
    resumed_tuner = tuner()
    t2 = quiet_trainer(max_steps=16, plugins=[fp16_plugin()], callbacks=[resumed_tuner, rec])
    t2.fit(second, ckpt_path=ckpt)
    assert rec.scales == full_rec.scales[8:]
    assert rec.moved == full_rec.moved[8:]
    for a, b in zip(second.parameters(), full.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    full_state = full.trainer.precision_plugin.state_dict()
    assert t2.precision_plugin.state_dict() == full_state
    assert full_state["overflow_steps"] == len(inf)
    assert StepLedger.of(t2).record_of().counts.tolist() == StepLedger.of(full.trainer).record_of().counts.tolist()


def test_a_torch_gradscaler_checkpoint_loads_into_the_tuner(tmp_path: Path) -> None:
    module = TinyModule()
    t1 = quiet_trainer(max_steps=3, plugins=[fp16_plugin(init_scale=512.0, growth_interval=2)])
    t1.fit(module)
    t1.save_checkpoint(tmp_path / "torch.ckpt")
    tuner = LossScaleTuner(init_scale="auto", growth_interval=2)
    t2 = quiet_trainer(max_steps=4, plugins=[fp16_plugin()], callbacks=[tuner])
    t2.fit(TinyModule(), ckpt_path=tmp_path / "torch.ckpt")
    assert tuner.scaler is not None and not tuner.scaler.probing  # the checkpoint's scale wins over "auto"
    # t1: 512 grew after steps 0-1 and counted step 2; t2's step 3 completes the next interval
    assert tuner.scaler.get_scale() == 2048.0


# ---------------------------------------------------------------------- fused optimizers and clipping
def _clipped_params(optimizer: str, callbacks: list[pl.Callback], **trainer_kwargs: Any) -> list[torch.Tensor]:
    torch.manual_seed(0)
    module = TinyModule(optimizer=optimizer, inf_at_step=[3], lr=0.1)
    fit(module, callbacks, max_steps=8, **trainer_kwargs)
    return [p.detach() for p in module.parameters()]


@pytest.mark.parametrize("via", ["gradient_clip_val", "GradientNormMonitor"])
def test_fused_optimizer_with_clipping_matches_the_unfused_one(via: str) -> None:
    def clip_callbacks() -> list[pl.Callback]:
        return [GradientNormMonitor(max_norm=0.05)] if via == "GradientNormMonitor" else []

    kwargs = {"gradient_clip_val": 0.05} if via == "gradient_clip_val" else {}
    fused = _clipped_params("sgd_fused", [LossScaleTuner(init_scale=256), *clip_callbacks()], **kwargs)
    plain = _clipped_params("sgd", [LossScaleTuner(init_scale=256), *clip_callbacks()], **kwargs)
    unclipped = _clipped_params("sgd", [LossScaleTuner(init_scale=256)])
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(a, b) for a, b in zip(fused, unclipped, strict=True))


def test_gradient_clip_val_installs_the_fused_clip_plugin_and_keeps_the_checkpoint_key(
    tmp_path: Path,
) -> None:
    tuner = LossScaleTuner(init_scale=256)
    trainer = fit(TinyModule(optimizer="adamw_fused"), [tuner], max_steps=3, gradient_clip_val=1.0)
    assert type(trainer.precision_plugin) is FusedClipMixedPrecision
    assert trainer.precision_plugin.scaler is tuner.scaler
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    ckpt = torch.load(tmp_path / "c.ckpt", weights_only=False)
    assert "MixedPrecision" in ckpt and "FusedClipMixedPrecision" not in ckpt
    # and it resumes into a plain MixedPrecision run without the tuner
    t2 = quiet_trainer(max_steps=4, plugins=[fp16_plugin()])
    t2.fit(TinyModule(optimizer="adamw_fused"), ckpt_path=tmp_path / "c.ckpt")
    assert t2.precision_plugin.scaler.get_scale() == ckpt["MixedPrecision"]["scale"]  # type: ignore[attr-defined]


def test_fused_clipping_without_the_tuner_is_refused_by_lightning() -> None:
    # what FusedClipMixedPrecision exists for
    trainer = quiet_trainer(max_steps=2, plugins=[fp16_plugin()], gradient_clip_val=1.0)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        trainer.fit(TinyModule(optimizer="adamw_fused"))


# ---------------------------------------------------------------------- no-op precisions
@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_bf16_and_fp32_are_a_no_op(precision: str, caplog: pytest.LogCaptureFixture) -> None:
    logger = MemoryLogger()
    tuner = LossScaleTuner()
    with caplog.at_level(logging.INFO):
        trainer = quiet_trainer(max_steps=4, precision=precision, callbacks=[tuner], logger=logger, log_every_n_steps=1)
        trainer.fit(TinyModule())
    messages = [r.getMessage() for r in caplog.records if "LossScaleTuner" in r.getMessage()]
    assert messages == [
        f"LossScaleTuner: precision={precision!r} uses no fp16 loss scaling (bf16 and fp32 need none), so the "
        "tuner stays inactive."
    ]
    assert tuner.scaler is None
    assert getattr(trainer.precision_plugin, "scaler", None) is None
    assert not any(k.startswith("stability/loss_scale") for _, m in logger.records for k in m)


# ---------------------------------------------------------------------- the scaler on its own
def test_scaler_state_dict_round_trip_and_pickling() -> None:
    module = TinyModule(inf_at_step=[1, 2])
    tuner = LossScaleTuner(init_scale=256, growth_interval=4, hysteresis=3)
    fit(module, [tuner], max_steps=5)
    scaler = tuner.scaler
    assert scaler is not None
    state = scaler.state_dict()
    assert state["_hysteresis_tracker"] == 1 and state["overflow_steps"] == 2 and state["updates"] == 5
    fresh = TunedGradScaler("cpu")
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == state
    # torch's own scaler reads our state dict (it ignores the extra entries)
    plain = torch.amp.GradScaler("cpu")
    plain.load_state_dict(state)
    assert plain.get_scale() == state["scale"]


class _Driver:
    """Drives a scaler's update by hand with one overflow flag per step (what `unscale_` would record)."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self.param = torch.nn.Parameter(torch.ones(2))
        self.opt = torch.optim.SGD([self.param], lr=0.0)
        scaler.scale(self.param.sum())  # creates the scale and the trackers

    def step(self, overflow: bool) -> None:
        state = self.scaler._per_optimizer_states[id(self.opt)]
        state["found_inf_per_device"] = {torch.device("cpu"): torch.tensor(float(overflow))}
        self.scaler.update()


def test_counts_and_rate_across_ring_laps_and_a_resume_mid_lap() -> None:
    """Overflow and floor-hit totals and the rate come from the ring of records: exact across laps and a resume."""
    from lightning_stability.amp.rule import ScaleRule, initial_state, update_scale

    kwargs: dict[str, Any] = {"init_scale": 256.0, "growth_interval": 3, "hysteresis": 2, "min_scale": 64.0}
    rule = ScaleRule(growth_interval=3, hysteresis=2, min_scale=64.0)
    flags = [bool(b) for b in [1, 1, 1, 1, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1]]
    reference, overflows, floor_hits = initial_state(256.0, rule), 0, 0
    driver = _Driver(TunedGradScaler("cpu", overflow_window=4, **kwargs))
    resumed: _Driver | None = None
    for step, flag in enumerate(flags):
        update = update_scale(reference, torch.tensor(float(flag)), rule)
        reference, overflows, floor_hits = update.state, overflows + flag, floor_hits + bool(update.floor_hit)
        for d in (driver, resumed):
            if d is None:
                continue
            d.step(flag)
            scaler = d.scaler
            assert isinstance(scaler, TunedGradScaler)
            assert scaler.get_scale() == reference.scale.item(), step
            assert (int(scaler.overflow_steps), int(scaler.floor_hits)) == (overflows, floor_hits), step
            recent = flags[max(0, step - 3) : step + 1]
            assert scaler.overflow_rate().item() == pytest.approx(sum(recent) / len(recent)), step
        if step == 9:  # mid-lap (10 updates, window 4): a checkpoint, loaded into a fresh scaler
            resumed = _Driver(TunedGradScaler("cpu", overflow_window=4, **kwargs))
            resumed.scaler.load_state_dict(driver.scaler.state_dict())
    assert floor_hits > 0 and resumed is not None
    assert resumed.scaler.state_dict() == driver.scaler.state_dict()


def test_an_overflow_on_two_devices_is_one_overflow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients on two devices (e.g. CPU offload) that both overflow spend one unit of hysteresis, not two."""
    scaler = TunedGradScaler("cpu", init_scale=256.0, hysteresis=2)
    driver = _Driver(scaler)
    both = {torch.device("cpu", 0): torch.ones(()), torch.device("cpu", 1): torch.ones(())}
    monkeypatch.setattr(torch.amp.GradScaler, "_unscale_grads_", lambda *args: dict(both))
    driver.param.grad = torch.ones(2)
    scaler.unscale_(driver.opt)
    scaler.update()
    assert scaler.get_scale() == 256.0 and int(scaler.overflow_steps) == 1  # tolerated by hysteresis
    scaler.unscale_(driver.opt)
    scaler.update()
    assert scaler.get_scale() == 128.0 and int(scaler.overflow_steps) == 2


def test_a_rule_loaded_mid_run_takes_effect_at_the_next_update() -> None:
    scaler = TunedGradScaler("cpu", init_scale=256.0, growth_interval=1, hysteresis=2)
    driver = _Driver(scaler)
    driver.step(False)  # grows (interval 1) and refills the hysteresis
    assert scaler.get_scale() == 512.0
    scaler.load_state_dict({**scaler.state_dict(), "hysteresis": 1, "min_scale": 300.0})
    driver.step(True)  # no hysteresis any more: backs off at once, to the new floor
    assert scaler.get_scale() == 300.0 and int(scaler.floor_hits) == 1


def test_a_saved_scale_below_the_floor_starts_at_the_floor() -> None:
    plain = torch.amp.GradScaler("cpu", init_scale=0.25)
    _Driver(plain)
    tuned = TunedGradScaler("cpu", min_scale=1.0)
    tuned.load_state_dict(plain.state_dict())
    assert tuned.get_scale() == 1.0
    driver = _Driver(tuned)
    driver.step(False)
    assert int(tuned.floor_hits) == 0 and tuned.get_scale() == 1.0


def test_tuner_pickles_before_and_after_fit() -> None:
    tuner = LossScaleTuner(init_scale="auto")
    assert pickle.loads(pickle.dumps(tuner)).settings == tuner.settings
    fit(TinyModule(), [tuner], max_steps=2)
    restored = pickle.loads(pickle.dumps(tuner))
    assert restored.scaler is None and restored.state_dict() == tuner.state_dict()


@pytest.mark.parametrize("second", [{}, {"hysteresis": 1}])
def test_two_tuners_are_refused_with_the_packages_own_message(second: dict[str, Any]) -> None:
    # identical settings used to meet Lightning's generic "more than one stateful callback" error first
    trainer = quiet_trainer(
        max_steps=1, plugins=[fp16_plugin()], callbacks=[LossScaleTuner(), LossScaleTuner(**second)]
    )
    with pytest.raises(
        StabilityConfigError, match=r"2 LossScaleTuner callbacks are attached.*would own the loss scale"
    ):
        trainer.fit(TinyModule())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_scale": -1.0}, r"`init_scale=-1.0` must be a finite number > 0"),
        ({"init_scale": "big"}, r"`init_scale='big'` must be a finite number > 0.*or 'auto'"),
        ({"init_scale": float("nan")}, r"`init_scale=nan` must be a finite number"),
        ({"init_scale": True}, r"`init_scale=True` must be a finite number"),
        ({"init_scale": 0.5}, r"`init_scale=0.5` is below min_scale=1.0. Fix: raise init_scale, or lower min_scale"),
        ({"growth_factor": 0.5}, r"`growth_factor=0.5` must be a finite number > 1"),
        ({"backoff_factor": 2}, r"`backoff_factor=2` must be a finite number in \(0.0, 1.0\)"),
        ({"growth_interval": 0}, r"`growth_interval=0` must be an int >= 1"),
        ({"hysteresis": 0}, r"`hysteresis=0` must be an int >= 1"),
        ({"min_scale": -1}, r"`min_scale=-1` must be a finite number > 0"),
        ({"on_min_scale": "stop"}, r"`on_min_scale='stop'` is not 'raise' or 'warn'"),
        ({"consecutive_hysteresis": "yes"}, r"`consecutive_hysteresis='yes'` must be a bool"),
        ({"overflow_window": 0}, r"`overflow_window=0` must be an int >= 1"),
        ({"max_overflow_rate": 0}, r"`max_overflow_rate=0` must be a finite number in \(0.0, 1.0\]"),
        ({"max_overflow_rate": 1.5}, r"`max_overflow_rate=1.5`"),
        ({"auto_headroom": 0.5}, r"`auto_headroom=0.5` must be a finite number >= 1"),
        ({"log_every_n_steps": 0}, r"`log_every_n_steps=0` must be an int >= 1"),
        ({"fit_start_checks": 1}, r"`fit_start_checks=1` must be a bool"),
    ],
)
def test_config_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        LossScaleTuner(**kwargs)


def test_scaler_config_errors() -> None:
    with pytest.raises(StabilityConfigError, match=r"`overflow_window=-3` must be an int >= 1"):
        TunedGradScaler("cpu", overflow_window=-3)
    with pytest.raises(StabilityConfigError, match=r"`hysteresis=1.5` must be an int >= 1"):
        TunedGradScaler("cpu", hysteresis=1.5)  # type: ignore[arg-type]


def test_the_scaler_settings_are_one_definition_for_the_scaler_and_the_tuner() -> None:
    """``TunedGradScaler`` and ``LossScaleTuner`` take the settings of ``ScalerSettings``, with its defaults."""
    import dataclasses
    import inspect

    from lightning_stability.amp import ScalerSettings

    defaults = {f.name: f.default for f in dataclasses.fields(ScalerSettings)}
    for cls in (TunedGradScaler, LossScaleTuner):
        parameters = inspect.signature(cls).parameters
        assert {name: parameters[name].default for name in defaults} == defaults, cls
    tuner = LossScaleTuner(init_scale="auto", hysteresis=3)
    assert tuner.settings == ScalerSettings(init_scale="auto", hysteresis=3)
    scaler = tuner.settings.scaler("cpu")
    assert isinstance(scaler, TunedGradScaler) and scaler.probing and scaler.rule.hysteresis == 3
