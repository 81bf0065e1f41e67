"""GradientNormMonitor with real Lightning Trainers on CPU."""

from __future__ import annotations

import csv
import math
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision

from lightning_stability import GradientNormMonitor, Outcome, StabilityConfigError, StepLedger
from tests.helpers import TinyModule, count_host_data_per_step, count_syncs_per_step, quiet_trainer


class GradCapture(pl.Callback):
    """Placed BEFORE the monitor: copies the gradients it is about to see, and the loss scale."""

    def __init__(self) -> None:
        self.grads: list[list[torch.Tensor]] = []
        self.scales: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.grads.append([p.grad.detach().clone() for p in pl_module.parameters()])
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(scaler.get_scale() if scaler is not None else 1.0)


class LedgerCapture(pl.Callback):
    """Placed AFTER the monitor: copies what the ledger recorded and the gradients as clipped."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.coefs: list[float] = []
        self.clipped: list[list[torch.Tensor]] = []
        self.outcomes: list[int] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        ledger = StepLedger.of(trainer)
        self.norms.append(ledger.step.grad_norm.item())
        if ledger.step.clip_coef is not None:
            self.coefs.append(ledger.step.clip_coef.item())
        self.clipped.append([p.grad.detach().clone() if p.grad is not None else None for p in pl_module.parameters()])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        ledger = StepLedger.of(trainer)
        ledger.close_step()
        self.outcomes.append(int(ledger.outcome))


class StateSnapshot(pl.Callback):
    """Snapshots weights and optimizer state before the update of every step, and after it."""

    def __init__(self) -> None:
        self.before: list[dict[str, torch.Tensor]] = []
        self.after: list[dict[str, torch.Tensor]] = []

    @staticmethod
    def _snap(pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        out = {f"param/{n}": p.detach().clone() for n, p in pl_module.named_parameters()}
        for i, p in enumerate(pl_module.parameters()):
            for k, v in optimizer.state.get(p, {}).items():
                out[f"state/{i}/{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
        return out

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.before.append(self._snap(pl_module, trainer.optimizers[0]))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.after.append(self._snap(pl_module, trainer.optimizers[0]))


def _reference_norm(grads: list[torch.Tensor], norm_type: float) -> float:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    return torch.nn.utils.clip_grad_norm_(params, max_norm=1e12, norm_type=norm_type).item()


# ---------------------------------------------------------------------------------------------- ground truth
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_norm_and_clipping_match_torch(norm_type: float, optimizer: str) -> None:
    before, after = GradCapture(), LedgerCapture()
    monitor = GradientNormMonitor(max_norm=0.05, norm_type=norm_type)
    trainer = quiet_trainer(max_steps=5, callbacks=[before, monitor, after])
    trainer.fit(TinyModule(optimizer=optimizer))
    assert len(after.norms) == 5
    for grads, norm, coef, clipped in zip(before.grads, after.norms, after.coefs, after.clipped, strict=True):
        assert norm == pytest.approx(_reference_norm(grads, norm_type), rel=1e-5)
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(params, max_norm=0.05, norm_type=norm_type)
        for p, c in zip(params, clipped, strict=True):
            torch.testing.assert_close(c, p.grad)
        assert coef == pytest.approx(min(1.0, 0.05 / (norm + 1e-6)), rel=1e-5)


def test_monitor_only_leaves_gradients_alone() -> None:
    before, after = GradCapture(), LedgerCapture()
    trainer = quiet_trainer(max_steps=3, callbacks=[before, GradientNormMonitor(), after])
    trainer.fit(TinyModule())
    for grads, clipped in zip(before.grads, after.clipped, strict=True):
        for g, c in zip(grads, clipped, strict=True):
            assert torch.equal(g, c)
    assert after.coefs == []


# ---------------------------------------------------------------------------------------------- fp16
@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_fp16_norm_is_of_unscaled_gradients(optimizer: str) -> None:
    """Lightning unscales before the hook for plain optimizers; for fused ones the ledger does."""
    before, after = GradCapture(), LedgerCapture()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    trainer = quiet_trainer(
        max_steps=4,
        callbacks=[before, GradientNormMonitor(max_norm=1.0), after],
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )
    trainer.fit(TinyModule(optimizer=optimizer))
    assert len(after.norms) == 4
    for grads, scale, norm in zip(before.grads, before.scales, after.norms, strict=True):
        raw = _reference_norm(grads, 2.0)
        # fused optimizers reach the hook still scaled; the measured norm must divide the scale out
        expected = raw / scale if optimizer.endswith("_fused") else raw
        assert norm == pytest.approx(expected, rel=1e-4)
        assert norm < 1e3  # a scaled norm would be ~4096x larger
    assert all(o == Outcome.APPLIED for o in after.outcomes)


@pytest.mark.parametrize("skip_nonfinite", [True, False])
def test_fp16_overflow_is_skipped_by_the_scaler_and_recorded(skip_nonfinite: bool) -> None:
    after = LedgerCapture()
    snap = StateSnapshot()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer = quiet_trainer(
        max_steps=5,
        callbacks=[snap, GradientNormMonitor(max_norm=1.0, skip_nonfinite=skip_nonfinite), after],
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )
    # the scaler skips whatever skip_nonfinite says, and the warning tells so
    with pytest.warns(RuntimeWarning, match="the update was skipped by the fp16 loss scaler"):
        trainer.fit(TinyModule(inf_at_step=2))
    assert after.outcomes == [0, 0, int(Outcome.SKIPPED_SCALER), 0, 0]
    for key, value in snap.before[2].items():
        assert torch.equal(value, snap.after[2][key]), key
    assert int(StepLedger.of(trainer).record_of().applied_steps) == 4


# ---------------------------------------------------------------------------------------------- skipping
@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused", "sgd", "sgd_fused"])
def test_nan_step_leaves_weights_and_optimizer_state_unchanged(optimizer: str) -> None:
    snap, after = StateSnapshot(), LedgerCapture()
    trainer = quiet_trainer(max_steps=6, callbacks=[snap, GradientNormMonitor(max_norm=1.0), after])
    with pytest.warns(RuntimeWarning, match="Non-finite gradient norm"):
        trainer.fit(TinyModule(optimizer=optimizer, inf_at_step=3, weight_decay=0.1))
    assert after.outcomes == [0, 0, 0, int(Outcome.SKIPPED_NONFINITE), 0, 0]
    bad_before, bad_after = snap.before[3], snap.after[3]
    assert bad_before.keys() == bad_after.keys()
    for key in bad_before:
        assert torch.equal(bad_before[key], bad_after[key]), f"{key} changed on the skipped step"
    # the other steps did update, and training went on with finite weights
    assert not torch.equal(snap.before[4]["param/net.0.weight"], snap.after[4]["param/net.0.weight"])
    assert all(torch.isfinite(v).all() for v in snap.after[-1].values())
    ledger = StepLedger.of(trainer)
    assert int(ledger.record_of().applied_steps) == 5 and int(ledger.record_of().skipped_steps) == 1
    assert ledger.record_of().steps == 6
    if optimizer.startswith("adamw"):
        assert snap.after[-1]["state/0/step"].item() == 5  # Adam's step count did not advance on the bad step


def test_skipping_the_very_first_step_of_fused_sgd_with_momentum() -> None:
    """torch's fused SGD leaves its momentum buffer uninitialised when its first step is skipped through
    `found_inf`; the ledger skips that step another way, so the run equals the non-fused one."""
    finals = {}
    for optimizer in ("sgd", "sgd_fused"):
        pl.seed_everything(0)
        trainer = quiet_trainer(max_steps=4, callbacks=[GradientNormMonitor(max_norm=1.0)])
        with pytest.warns(RuntimeWarning, match="Non-finite gradient norm"):
            trainer.fit(TinyModule(optimizer=optimizer, inf_at_step=0))
        assert StepLedger.of(trainer).record_of().counts.tolist() == [3, 0, 1, 0, 0, 0]
        finals[optimizer] = [p.detach().clone() for p in trainer.lightning_module.parameters()]
    for a, b in zip(finals["sgd"], finals["sgd_fused"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_skip_nonfinite_false_applies_the_bad_update() -> None:
    snap = StateSnapshot()
    trainer = quiet_trainer(max_steps=3, callbacks=[snap, GradientNormMonitor(skip_nonfinite=False)])
    with pytest.warns(RuntimeWarning, match="NOT skipped"):
        trainer.fit(TinyModule(inf_at_step=1))
    assert not torch.isfinite(snap.after[1]["param/net.0.weight"]).all()


class InfInOneLayer(pl.Callback):
    """Placed before the monitor: makes one module's gradient inf at one step."""

    def __init__(self, step: int, module: str) -> None:
        self.step, self.module = step, module

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == self.step:
            pl_module.get_submodule(self.module).weight.grad[0, 0] = float("inf")


def test_warning_names_the_first_nonfinite_layer() -> None:
    monitor = GradientNormMonitor(max_norm=1.0, log_every_n_steps=3)
    trainer = quiet_trainer(max_steps=6, callbacks=[InfInOneLayer(4, "net.2"), monitor])
    with pytest.warns(
        RuntimeWarning,
        match=r"First module with a non-finite gradient: 'net\.2' \(1 of 3 modules non-finite\)\. "
        r"Largest finite gradient norms at that step: net\.\d=\d",
    ):
        trainer.fit(TinyModule())


# ---------------------------------------------------------------------------------------------- accumulation
def test_one_measurement_per_optimizer_step_under_accumulation() -> None:
    before, after = GradCapture(), LedgerCapture()
    trainer = quiet_trainer(
        max_steps=3, accumulate_grad_batches=4, callbacks=[before, GradientNormMonitor(max_norm=10.0), after]
    )
    trainer.fit(TinyModule(n=96))
    assert len(after.norms) == 3 and StepLedger.of(trainer).record_of().steps == 3
    # the norm is of the gradient accumulated over the 4 micro-batches
    for grads, norm in zip(before.grads, after.norms, strict=True):
        assert norm == pytest.approx(_reference_norm(grads, 2.0), rel=1e-5)


# ---------------------------------------------------------------------------------------------- logging
def _read_csv(log_dir: Path) -> list[dict[str, str]]:
    (metrics,) = log_dir.rglob("metrics.csv")
    with metrics.open() as f:
        return list(csv.DictReader(f))


def test_logged_keys_and_values(tmp_path: Path) -> None:
    after = LedgerCapture()
    monitor = GradientNormMonitor(max_norm=0.05, log_every_n_steps=2, per_layer=True)
    trainer = quiet_trainer(max_steps=6, callbacks=[monitor, after], logger=CSVLogger(tmp_path), log_every_n_steps=50)
    with pytest.warns(RuntimeWarning):
        trainer.fit(TinyModule(inf_at_step=2))
    rows = [r for r in _read_csv(tmp_path) if r.get("stability/grad_norm")]
    assert [int(r["step"]) for r in rows] == [1, 3, 5]  # optimizer steps 2, 4, 6 under Lightning's labels
    for row, step in zip(rows, [2, 4, 6], strict=True):  # the bad step (3) is not a logging step
        assert float(row["stability/grad_norm"]) == pytest.approx(after.norms[step - 1], rel=1e-5)
    assert [float(r["stability/skipped_steps"]) for r in rows] == [0.0, 1.0, 1.0]
    assert float(rows[0]["stability/clip_fraction"]) == 1.0
    for module in ("net.0", "net.2", "net.4"):
        assert f"stability/grad_norm_by_module/{module}" in rows[0]
    per_layer = [float(rows[0][f"stability/grad_norm_by_module/{m}"]) for m in ("net.0", "net.2", "net.4")]
    assert math.sqrt(sum(v * v for v in per_layer)) == pytest.approx(float(rows[0]["stability/grad_norm"]), rel=1e-5)


def test_clip_fraction_is_the_share_of_clipped_steps_since_the_last_log(tmp_path: Path) -> None:
    # lr=0: the weights never move, so both runs see the same gradients whatever the clipping does
    probe = LedgerCapture()
    pl.seed_everything(0)
    quiet_trainer(max_steps=8, callbacks=[GradientNormMonitor(), probe]).fit(TinyModule(lr=0.0))
    max_norm = sorted(probe.norms)[4]  # the four largest norms clip
    after = LedgerCapture()
    monitor = GradientNormMonitor(max_norm=max_norm, log_every_n_steps=4)
    pl.seed_everything(0)
    quiet_trainer(max_steps=8, callbacks=[monitor, after], logger=CSVLogger(tmp_path)).fit(TinyModule(lr=0.0))
    assert after.norms == probe.norms
    clipped = [c < 1.0 for c in after.coefs]
    # 3 then 1 of 4: a window that was not reset at the first log would read 4/8 at the second
    assert sum(clipped[:4]) == 3 and sum(clipped[4:]) == 1
    rows = [r for r in _read_csv(tmp_path) if r.get("stability/clip_fraction")]
    assert [float(r["stability/clip_fraction"]) for r in rows] == [sum(clipped[:4]) / 4, sum(clipped[4:]) / 4]


def _layer_rows(tmp_path: Path, per_layer: bool | int) -> list[dict[str, float]]:
    pl.seed_everything(0)
    monitor = GradientNormMonitor(log_every_n_steps=1, per_layer=per_layer)
    quiet_trainer(max_steps=3, callbacks=[monitor], logger=CSVLogger(tmp_path)).fit(TinyModule())
    rows = [r for r in _read_csv(tmp_path) if r.get("stability/grad_norm")]
    return [{k: float(v) for k, v in r.items() if k.startswith("stability/grad_norm_by_module/") and v} for r in rows]


def test_per_layer_top_k(tmp_path: Path) -> None:
    every = _layer_rows(tmp_path / "all", True)
    top = _layer_rows(tmp_path / "top", 2)
    assert len(every) == len(top) == 3
    for full, two in zip(every, top, strict=True):
        assert len(full) == 3  # net.0, net.2, net.4
        largest = dict(sorted(full.items(), key=lambda kv: kv[1], reverse=True)[:2])
        assert two == pytest.approx(largest, rel=1e-6)  # the two largest layers, with their norms


class LoggingModule(TinyModule):
    """Logs its loss with ``self.log``: Lightning's own step labels, to compare ours with."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize("accumulate", [1, 2])
def test_default_log_interval_is_the_trainers(tmp_path: Path, accumulate: int) -> None:
    """Logged on the same optimizer steps as Lightning's own metrics, under the same labels (Lightning labels
    the k-th optimizer step k - 1), also under gradient accumulation."""
    trainer = quiet_trainer(
        max_steps=6,
        callbacks=[GradientNormMonitor()],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=3,
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(LoggingModule(n=96))
    rows = _read_csv(tmp_path)
    ours = [int(r["step"]) for r in rows if r.get("stability/grad_norm")]
    lightnings = [int(r["step"]) for r in rows if r.get("train_loss")]
    assert ours == [2, 5]  # optimizer steps 3 and 6
    assert lightnings == ours


# ---------------------------------------------------------------------------------------------- host syncs
@pytest.mark.parametrize(
    ("optimizer", "skip_nonfinite", "extra_per_step"),
    [("adamw_fused", True, 0), ("sgd_fused", True, 0), ("adamw", False, 0), ("adamw", True, 1)],
)
def test_host_syncs_against_a_bare_trainer(optimizer: str, skip_nonfinite: bool, extra_per_step: int) -> None:
    """Non-logging steps add no sync (one only where a non-fused optimizer must be told to skip on the host);
    a logging step adds exactly one batched transfer."""
    pl.seed_everything(0)
    bare = count_syncs_per_step(quiet_trainer(max_steps=8, log_every_n_steps=4), TinyModule(optimizer=optimizer))
    monitor = GradientNormMonitor(max_norm=1.0, skip_nonfinite=skip_nonfinite, per_layer=True)
    pl.seed_everything(0)
    ours = count_syncs_per_step(
        quiet_trainer(max_steps=8, log_every_n_steps=4, callbacks=[monitor]), TinyModule(optimizer=optimizer)
    )
    assert len(bare) == len(ours) == 8
    for step, (b, o) in enumerate(zip(bare, ours, strict=True), start=1):
        logging = step % 4 == 0
        # fused SGD with momentum skips its very first step on the host (see skips.found_inf_is_safe)
        first_step_host_skip = optimizer == "sgd_fused" and skip_nonfinite and step == 1
        expected = extra_per_step + (1 if logging else 0) + (1 if first_step_host_skip else 0)
        assert o - b == expected, f"step {step}: bare {b}, with monitor {o}"


@pytest.mark.parametrize(
    ("optimizer", "fp16"), [("adamw", False), ("adamw_fused", False), ("adamw", True), ("adamw_fused", True)]
)
def test_no_tensor_is_built_from_host_data_in_the_step(optimizer: str, fp16: bool) -> None:
    """On a GPU, `torch.tensor(x, device="cuda")` blocks the host like `.item()`. After the first step (which
    builds two small one-time tables), the monitor builds no tensor from host data: not on logging steps, not
    with skips decided on the device (fused `found_inf`, the fp16 scaler's flag)."""

    def trainer(callbacks: list[pl.Callback]) -> pl.Trainer:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)] if fp16 else []
        return quiet_trainer(max_steps=8, log_every_n_steps=4, callbacks=callbacks, plugins=plugins)

    pl.seed_everything(0)
    bare = count_host_data_per_step(trainer([]), TinyModule(optimizer=optimizer, inf_at_step=3))
    pl.seed_everything(0)
    monitor = GradientNormMonitor(max_norm=1.0, per_layer=True)
    with pytest.warns(RuntimeWarning, match="Non-finite gradient norm"):
        ours = count_host_data_per_step(trainer([monitor]), TinyModule(optimizer=optimizer, inf_at_step=3))
    assert len(ours) == len(bare) == 8
    assert ours[1:] == bare[1:]


def test_host_syncs_fp16_reuse_the_scaler_decision() -> None:
    def plugins() -> list[Any]:
        return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]

    pl.seed_everything(0)
    bare = count_syncs_per_step(quiet_trainer(max_steps=8, log_every_n_steps=4, plugins=plugins()), TinyModule())
    monitor = GradientNormMonitor()  # measure only: the same trajectory (and overflows) as the bare run
    pl.seed_everything(0)
    ours = count_syncs_per_step(
        quiet_trainer(max_steps=8, log_every_n_steps=4, plugins=plugins(), callbacks=[monitor]), TinyModule()
    )
    for step, (b, o) in enumerate(zip(bare, ours, strict=True), start=1):
        assert o - b == (1 if step % 4 == 0 else 0), f"step {step}: bare {b}, with monitor {o}"


# ---------------------------------------------------------------------------------------------- checkpoints
def test_resume_restores_the_ledger(tmp_path: Path) -> None:
    """One epoch (4 steps), save, resume for a second == two epochs straight: same counts, same weights."""
    pl.seed_everything(0)
    first = quiet_trainer(max_epochs=1, callbacks=[GradientNormMonitor(max_norm=1.0)])
    with pytest.warns(RuntimeWarning):
        first.fit(TinyModule(inf_at_step=1, optimizer="adamw_fused", n=32))  # 4 batches: one epoch
    first.save_checkpoint(tmp_path / "stop.ckpt")
    saved = torch.load(tmp_path / "stop.ckpt", weights_only=False)
    assert saved["lightning_stability"]["ledger"]["tracks"]["0"]["counts"] == [3, 0, 1, 0, 0, 0]

    second = quiet_trainer(max_epochs=2, callbacks=[GradientNormMonitor(max_norm=1.0)])
    second.fit(TinyModule(optimizer="adamw_fused", n=32), ckpt_path=tmp_path / "stop.ckpt")
    ledger = StepLedger.of(second)
    assert ledger.record_of().steps == 8
    assert ledger.record_of().counts.tolist() == [7, 0, 1, 0, 0, 0]

    pl.seed_everything(0)
    straight = quiet_trainer(max_epochs=2, callbacks=[GradientNormMonitor(max_norm=1.0)])
    with pytest.warns(RuntimeWarning):
        straight.fit(TinyModule(inf_at_step=1, optimizer="adamw_fused", n=32))
    assert StepLedger.of(straight).record_of().counts.tolist() == [7, 0, 1, 0, 0, 0]
    for p, q in zip(second.lightning_module.parameters(), straight.lightning_module.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_pickle_and_state_key() -> None:
    monitor = GradientNormMonitor(max_norm=0.5, norm_type="inf", per_layer=3)
    clone = pickle.loads(pickle.dumps(monitor))
    assert clone.max_norm == 0.5 and math.isinf(clone.norm_type) and clone.per_layer == 3
    trainer = quiet_trainer(max_steps=2, callbacks=[monitor])
    trainer.fit(TinyModule())
    clone = pickle.loads(pickle.dumps(monitor))  # still picklable after a run (device tensors are dropped)
    # the checkpoint key follows the settings, once setup has made sure the callback is the only one
    assert clone.state_key == monitor.state_key == "GradientNormMonitor{'max_norm': 0.5, 'norm_type': inf}"


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_norm": -1.0}, r"`max_norm=-1.0` must be a finite number > 0.*Fix"),
        ({"max_norm": 0}, r"`max_norm=0` must be a finite number > 0"),
        ({"max_norm": float("nan")}, r"`max_norm=nan`"),
        ({"max_norm": "1"}, r"`max_norm='1'` must be a finite number"),
        ({"norm_type": 0}, r"`norm_type=0` must be a number > 0.0, or inf.*Fix"),
        ({"norm_type": -2.0}, r"`norm_type=-2.0`"),
        ({"norm_type": "fro"}, r"`norm_type='fro'` is not a norm order"),
        ({"norm_type": True}, r"`norm_type=True` must be a norm order"),
        ({"log_every_n_steps": 0}, r"`log_every_n_steps=0` must be an int >= 1"),
        ({"per_layer": 0}, r"`per_layer=0` must be an int >= 1.*per_layer=True"),
        ({"per_layer": "all"}, r"`per_layer='all'`"),
        ({"skip_nonfinite": "yes"}, r"`skip_nonfinite='yes'` must be a bool"),
        ({"warn_top_k": -1}, r"`warn_top_k=-1`"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        GradientNormMonitor(**kwargs)


def test_clipping_twice_is_a_configuration_error() -> None:
    trainer = quiet_trainer(max_steps=1, gradient_clip_val=1.0, callbacks=[GradientNormMonitor(max_norm=1.0)])
    with pytest.raises(StabilityConfigError, match=r"would clip twice.*remove `gradient_clip_val`"):
        trainer.fit(TinyModule())


def test_measuring_beside_the_trainers_clipping_is_allowed() -> None:
    after = LedgerCapture()
    trainer = quiet_trainer(max_steps=2, gradient_clip_val=0.01, callbacks=[GradientNormMonitor(), after])
    trainer.fit(TinyModule())
    assert len(after.norms) == 2 and after.norms[0] > 0.01  # measured before the Trainer clipped


def test_two_clipping_monitors_are_an_error() -> None:
    trainer = quiet_trainer(
        max_steps=1, callbacks=[GradientNormMonitor(max_norm=1.0), GradientNormMonitor(max_norm=2.0)]
    )
    with pytest.raises(StabilityConfigError, match="keep exactly one GradientNormMonitor"):
        trainer.fit(TinyModule())


def test_stability_metrics_can_be_monitored_by_early_stopping() -> None:
    """Scalar `stability/` metrics reach trainer.callback_metrics, so EarlyStopping can watch them."""
    from lightning.pytorch.callbacks import EarlyStopping

    after = LedgerCapture()
    stopper = EarlyStopping(
        monitor="stability/grad_norm", mode="max", stopping_threshold=1e-9, check_on_train_epoch_end=True
    )
    trainer = quiet_trainer(
        max_epochs=3, log_every_n_steps=2, callbacks=[GradientNormMonitor(max_norm=1.0), after, stopper]
    )
    trainer.fit(TinyModule(n=32))  # 4 steps per epoch: steps 2 and 4 log
    metric = trainer.callback_metrics["stability/grad_norm"]
    assert isinstance(metric, torch.Tensor) and metric.device.type == "cpu"
    assert metric.item() == pytest.approx(after.norms[3], rel=1e-5)  # the last logging step's norm
    assert trainer.callback_metrics["stability/skipped_steps"].item() == 0.0
    assert trainer.current_epoch == 1 and stopper.stopped_epoch == 0  # the threshold stopped it after epoch 1


def test_ledger_hooks_a_new_optimizer_even_when_python_reuses_an_id() -> None:
    """An optimizer of a second fit may get the id of a freed one; its step must still close the record."""
    ledger = StepLedger()
    old = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    new = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    ledger.open_step(old)
    old.step()  # the post-hook closes the step
    assert not ledger.is_open
    ledger._hooked[id(new)] = ledger._hooked.pop(id(old))  # what a reused id looks like to the ledger
    ledger.open_step(new)
    new.step()
    assert not ledger.is_open and ledger.record_of().counts.tolist() == [2, 0, 0, 0, 0, 0]
