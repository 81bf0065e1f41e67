"""GradientAccumulation on real Trainers: step counts, full-batch gradient, LR scaling, BatchNorm, resume."""

from __future__ import annotations

import csv
import logging
import math
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, LearningRateFinder, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.tuner import Tuner
from torch import nn
from torch.func import functional_call

from lightning_stability.accumulation.callback import GradientAccumulation
from lightning_stability.accumulation.schedule import AccumulationSchedule
from lightning_stability.errors import StabilityConfigError
from lightning_stability.grad_norm import GradientNormMonitor
from lightning_stability.schedules import warmup_constant_cosine
from lightning_stability.schedules.callback import WarmupConstantCosineLR
from tests.helpers import TinyModule, count_syncs_per_step, make_data, quiet_trainer


class StepRecorder(Callback):
    """Per optimizer step: the batch indices it accumulated, its LR, weights before it and its gradients."""

    def __init__(self, keep_tensors: bool = False) -> None:
        self.keep_tensors = keep_tensors
        self.windows: list[list[tuple[int, int]]] = []
        self.lrs: list[float] = []
        self.weights: list[dict[str, torch.Tensor]] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self._current: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._current.append((trainer.current_epoch, batch_idx))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.windows.append(self._current)
        self._current = []
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))
        if self.keep_tensors:
            named = dict(pl_module.net.named_parameters())
            self.weights.append({k: p.detach().clone() for k, p in named.items()})
            self.grads.append({k: p.grad.detach().clone() for k, p in named.items()})

    @property
    def sizes(self) -> list[int]:
        return [len(w) for w in self.windows]


def fit(
    module: pl.LightningModule, callbacks: list[Callback], **trainer_kwargs: Any
) -> tuple[pl.Trainer, StepRecorder]:
    rec = next((cb for cb in callbacks if isinstance(cb, StepRecorder)), None)
    if rec is None:
        rec = StepRecorder()
        callbacks = [*callbacks, rec]
    trainer = quiet_trainer(callbacks=callbacks, **trainer_kwargs)
    trainer.fit(module)
    return trainer, rec


# ------------------------------------------------------------------ counts
def test_accumulation_4_over_40_batches_gives_10_steps_and_10_lrs() -> None:
    acc = GradientAccumulation(steps=4, lr_scaling="none")
    trainer, rec = fit(TinyModule(n=160, batch_size=4, lr=0.05), [acc, WarmupConstantCosineLR()], max_epochs=1)
    assert trainer.num_training_batches == 40
    assert trainer.global_step == 10
    assert rec.sizes == [4] * 10
    assert rec.lrs == pytest.approx([0.05 * warmup_constant_cosine(n, 10) for n in range(10)])


@pytest.mark.parametrize(
    ("steps", "n", "epochs", "expected"),
    [
        # switch at update 3 from 2 to 4 after 6 batches (6 % 4 != 0: Lightning's modulo rule gets this wrong)
        ({0: 2, 3: 4}, 160, 1, [2, 2, 2] + [4] * 8 + [2]),
        # before the first key the factor is 1; the last window of each epoch is shorter
        ({2: 3, 5: 2}, 40, 2, [1, 1, 3, 3, 2] + [2] * 5),
        ({0: 3}, 40, 2, [3, 3, 3, 1] * 2),
    ],
)
def test_changing_schedule_gives_the_expected_counts(steps: Any, n: int, epochs: int, expected: list[int]) -> None:
    acc = GradientAccumulation(steps=steps, lr_scaling="none")
    trainer, rec = fit(TinyModule(n=n, batch_size=4), [acc], max_epochs=epochs)
    assert rec.sizes == expected
    assert trainer.global_step == len(expected)
    if not acc.is_constant:
        assert acc.estimated_optimizer_steps(trainer) == len(expected)


@pytest.mark.parametrize(
    ("steps", "per_epoch", "max_steps", "max_epochs", "expected"),
    [
        ({0: 2, 3: 4}, 40, -1, 1, 12),
        ({2: 3, 5: 2}, 10, -1, 2, 10),
        ({0: 3}, 10, -1, 2, 8),
        ({0: 3}, 10, 5, 2, 5),
        ({0: 1, 3: 2}, 10, -1, -1, None),  # endless
        ({0: 1, 3: 2}, float("inf"), 100, None, None),  # unknown epoch length
        ({0: 1, 3: 2}, 0, -1, 3, 0),
    ],
)
def test_run_length_is_a_pure_function_of_the_trainer_limits(
    steps: Any, per_epoch: float, max_steps: int, max_epochs: int | None, expected: int | None
) -> None:
    assert AccumulationSchedule.parse(steps).optimizer_steps(per_epoch, max_steps, max_epochs) == expected


def test_the_pure_modules_import_no_lightning() -> None:
    import ast

    import lightning_stability.accumulation.batchnorm as batchnorm_module
    import lightning_stability.accumulation.schedule as schedule_module

    for module in (schedule_module, batchnorm_module):
        tree = ast.parse(Path(module.__file__ or "").read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] == "lightning"], module.__name__


def test_callers_dict_is_not_changed() -> None:
    steps = {2: 3}
    GradientAccumulation(steps=steps)
    assert steps == {2: 3}


# ------------------------------------------------------------------ the gradient
def _full_batch_grads(
    module: TinyModule, weights: dict[str, torch.Tensor], batches: list[int]
) -> dict[str, torch.Tensor]:
    data = make_data(module.n, module.dim)
    idx = torch.cat([torch.arange(b * module.batch_size, min((b + 1) * module.batch_size, module.n)) for b in batches])
    x, y = data.tensors[0][idx], data.tensors[1][idx]
    params = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
    loss = nn.functional.mse_loss(functional_call(module.net, params, (x,)), y)
    grads = torch.autograd.grad(loss, list(params.values()))
    return dict(zip(params, grads, strict=True))


@pytest.mark.parametrize("steps", [4, {0: 2, 3: 4}])
def test_gradient_equals_the_full_batch_gradient(steps: Any) -> None:
    rec = StepRecorder(keep_tensors=True)
    module = TinyModule(n=80, batch_size=4, lr=0.05)  # 20 batches; the shorter last window is tested below
    fit(module, [GradientAccumulation(steps=steps, lr_scaling="none"), rec], max_epochs=1)
    assert len(rec.windows) >= 5
    for window, weights, grads in zip(rec.windows, rec.weights, rec.grads, strict=True):
        reference = _full_batch_grads(module, weights, [b for _, b in window])
        for name in grads:
            torch.testing.assert_close(grads[name], reference[name], rtol=1e-5, atol=1e-7)


def test_shorter_last_window_is_still_the_mean() -> None:
    rec = StepRecorder(keep_tensors=True)
    module = TinyModule(n=40, batch_size=4, lr=0.05)  # 10 batches, factor 4: windows 4, 4, 2
    fit(module, [GradientAccumulation(steps=4, lr_scaling="none"), rec], max_epochs=1)
    assert rec.sizes == [4, 4, 2]
    reference = _full_batch_grads(module, rec.weights[-1], [8, 9])
    for name, grad in rec.grads[-1].items():
        torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ the clock: applied updates
@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_skipped_step_delays_the_switch(optimizer: str) -> None:
    # inf loss at global step 2 (the third attempt): the factor changes after 3 *applied* updates
    module = TinyModule(n=64, batch_size=4, optimizer=optimizer, inf_at_step=[2])
    _, rec = fit(module, [GradientNormMonitor(), GradientAccumulation(steps={3: 2}, lr_scaling="none")], max_steps=6)
    assert rec.sizes == [1, 1, 1, 1, 2, 2]


# ------------------------------------------------------------------ LR scaling
@pytest.mark.parametrize(("scaling", "scale"), [("linear", lambda k: k), ("sqrt", math.sqrt), ("none", lambda k: 1.0)])
def test_lr_follows_the_factor(scaling: str, scale: Any) -> None:
    acc = GradientAccumulation(steps={2: 4, 4: 2}, lr_scaling=scaling)
    _, rec = fit(TinyModule(n=64, batch_size=4, lr=0.01), [acc], max_steps=7)
    factors = [1, 1, 4, 4, 2, 2, 2]
    assert rec.sizes == factors
    assert rec.lrs == pytest.approx([0.01 * scale(k) for k in factors])


def test_default_keeps_the_configured_lr_and_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    # AdamW(lr=1e-2) with steps=4: the default steps at 1e-2, as accumulate_grad_batches=4 does
    with caplog.at_level(logging.INFO):
        _, rec = fit(TinyModule(n=64, batch_size=4, lr=1e-2, optimizer="adamw"), [GradientAccumulation(4)], max_steps=3)
    assert rec.sizes == [4, 4, 4] and rec.lrs == [1e-2] * 3
    assert not [r for r in caplog.records if "lr_scaling" in r.getMessage()]


@pytest.mark.parametrize(
    ("scaling", "line"),
    [
        ("linear", r"scales the LR .*: 0\.01 -> 0\.04 \(x4\)\. To keep the LR as configured, pass lr_scaling='none'"),
        ("sqrt", r"scales the LR .*: 0\.01 -> 0\.02 \(x2\)\. To keep the LR as configured, pass lr_scaling='none'"),
    ],
)
def test_a_scaling_rule_says_what_lr_became_what(scaling: str, line: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        _, rec = fit(
            TinyModule(n=64, batch_size=4, lr=1e-2), [GradientAccumulation(4, lr_scaling=scaling)], max_steps=2
        )
    assert rec.lrs == pytest.approx([0.04 if scaling == "linear" else 0.02] * 2)
    said = [r.getMessage() for r in caplog.records if "lr_scaling=" in r.getMessage()]
    assert len(said) == 1 and re.search(line, said[0]), said


def test_lr_scaling_composes_with_the_schedule() -> None:
    acc = GradientAccumulation(steps={0: 1, 3: 4}, lr_scaling="sqrt")
    trainer, rec = fit(TinyModule(n=160, batch_size=4, lr=0.01), [WarmupConstantCosineLR(), acc], max_epochs=1)
    total = 3 + math.ceil(37 / 4)
    assert trainer.global_step == total
    factors = [1, 1, 1] + [4] * (total - 3)
    expected = [0.01 * warmup_constant_cosine(n, total) * math.sqrt(k) for n, k in enumerate(factors)]
    assert rec.lrs == pytest.approx(expected)


# ------------------------------------------------------------------ conflicts and bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, r"`steps=0` must be an int >= 1"),
        ({"steps": True}, r"`steps=True` must be an int >= 1"),
        ({"steps": {}}, r"`steps={}` is an empty schedule"),
        ({"steps": {-1: 2}}, r"`steps={-1: 2}` has key -1"),
        ({"steps": {0: 0}}, r"`steps={0: 0}` maps 0 to 0"),
        ({"steps": {0.5: 2}}, r"has key 0.5"),
        ({"lr_scaling": "cubic"}, r"`lr_scaling='cubic'` is not one of"),
        ({"batchnorm": "layer_norm"}, r"`batchnorm='layer_norm'` is not one of"),
        ({"log_every_n_steps": 0}, r"`log_every_n_steps=0` must be an int >= 1"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        GradientAccumulation(**kwargs)


def test_trainer_accumulation_is_a_conflict() -> None:
    trainer = quiet_trainer(max_steps=2, accumulate_grad_batches=2, callbacks=[GradientAccumulation(4)])
    with pytest.raises(StabilityConfigError, match=r"Trainer\(accumulate_grad_batches=2\) and .* Fix: remove"):
        trainer.fit(TinyModule())


def test_lightning_scheduler_is_a_conflict() -> None:
    cbs = [GradientAccumulationScheduler({0: 2}), GradientAccumulation(4)]
    with pytest.raises(StabilityConfigError, match="GradientAccumulationScheduler and GradientAccumulation"):
        quiet_trainer(max_steps=2, callbacks=cbs).fit(TinyModule())


def test_two_instances_are_a_conflict() -> None:
    with pytest.raises(StabilityConfigError, match=r"2 GradientAccumulation callbacks are attached.*keep exactly one"):
        quiet_trainer(max_steps=2, callbacks=[GradientAccumulation(2), GradientAccumulation(3)]).fit(TinyModule())


class Manual(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        return loss


def test_manual_optimization_is_an_error() -> None:
    with pytest.raises(StabilityConfigError, match=r"`automatic_optimization = False`"):
        quiet_trainer(max_steps=2, callbacks=[GradientAccumulation(2)]).fit(Manual())


class WithLambdaLR(TinyModule):
    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_lr_scaling_beside_the_modules_own_scheduler_is_an_error() -> None:
    # Both would write the LR: the scheduler recomputes it from its own base and drops the scaling.
    with pytest.raises(StabilityConfigError, match=r"`lr_scaling='linear'` writes the LR.*\['LambdaLR'\].*Fix: let"):
        acc = GradientAccumulation({0: 1, 1: 2}, lr_scaling="linear")
        quiet_trainer(max_steps=2, callbacks=[acc]).fit(WithLambdaLR())
    # with lr_scaling="none" the module's scheduler alone writes the LR: allowed
    _, rec = fit(WithLambdaLR(lr=0.1, n=64), [GradientAccumulation({0: 1, 1: 2}, lr_scaling="none")], max_steps=3)
    assert rec.lrs == pytest.approx([0.1, 0.05, 0.1 / 3])


def test_endless_run_with_a_schedule_asks_for_the_length() -> None:
    # max_epochs=-1 without max_steps never ends: the run length must be given, not crash on infinity
    trainer = quiet_trainer(
        max_epochs=-1, callbacks=[GradientAccumulation({0: 1, 3: 2}), WarmupConstantCosineLR(warmup=0.1)]
    )
    with pytest.raises(StabilityConfigError, match=r"needs the run length.*Fix: pass `total_steps=`"):
        trainer.fit(TinyModule())


def test_trainer_is_clean_after_fit() -> None:
    acc = GradientAccumulation({0: 2, 2: 3})
    trainer, _ = fit(TinyModule(), [acc], max_steps=3)
    assert trainer.accumulate_grad_batches == 1
    assert "_accumulated_batches_reached" not in vars(trainer.fit_loop.epoch_loop)
    trainer.fit(TinyModule())  # a second fit on the same Trainer: no false conflict


# ------------------------------------------------------------------ BatchNorm
class BNModule(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


def test_batchnorm_warns_by_default() -> None:
    with pytest.warns(UserWarning, match=r"BatchNorm layers \['net.1'\] under gradient accumulation"):
        quiet_trainer(max_steps=2, callbacks=[GradientAccumulation(2)]).fit(BNModule())


def test_no_warning_without_accumulation_or_when_ignored() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        quiet_trainer(max_steps=2, callbacks=[GradientAccumulation(1)]).fit(BNModule())
        quiet_trainer(max_steps=2, callbacks=[GradientAccumulation(2, batchnorm="ignore")]).fit(BNModule())


def test_group_norm_conversion_happens_before_the_optimizer_is_built() -> None:
    module = BNModule()
    module.lr = 1e-4
    bn_weight = torch.linspace(0.5, 2.0, 16)
    with torch.no_grad():
        module.net[1].weight.copy_(bn_weight)
    trainer = quiet_trainer(max_steps=1, callbacks=[GradientAccumulation(2, batchnorm="group_norm")])
    trainer.fit(module)
    gn = module.net[1]
    assert isinstance(gn, nn.GroupNorm) and gn.num_channels == 16 and gn.num_groups == 16
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
    optimized = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert optimized == {id(p) for p in module.parameters()}
    # the affine weights were carried over (then one AdamW step moved them by about lr)
    assert torch.allclose(gn.weight.detach(), bn_weight, atol=1e-3)


def test_sync_batchnorm_needs_ddp() -> None:
    cb = GradientAccumulation(2, batchnorm="sync_batchnorm")
    with pytest.raises(StabilityConfigError, match=r"`batchnorm='sync_batchnorm'` needs DDP"):
        quiet_trainer(max_steps=1, callbacks=[cb]).fit(BNModule())


# ------------------------------------------------------------------ resume
def _resume_run(tmp_path: Path, ckpt: Path | None) -> tuple[list[float], list[int], list[torch.Tensor]]:
    pl.seed_everything(0)
    module = TinyModule(n=48, batch_size=4, lr=0.02)  # 12 batches per epoch
    rec = StepRecorder()
    # epochs 0-1: factor 2 (6 steps each), epochs 2-3: factor 3 (4 steps each); update 12 ends epoch 1
    callbacks = [
        WarmupConstantCosineLR(warmup=0.1, decay=0.5),
        GradientAccumulation(steps={0: 2, 12: 3}, lr_scaling="sqrt"),
        rec,
        ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=12, save_top_k=-1),
    ]
    trainer = quiet_trainer(max_steps=20, enable_checkpointing=True, callbacks=callbacks)
    trainer.fit(module, ckpt_path=ckpt)
    return rec.lrs, rec.sizes, [p.detach().clone() for p in module.parameters()]


def test_resume_is_exact(tmp_path: Path) -> None:
    lrs, sizes, weights = _resume_run(tmp_path / "a", None)
    assert sizes == [2] * 12 + [3] * 8
    ckpt = tmp_path / "a" / "epoch=1-step=12.ckpt"
    resumed_lrs, resumed_sizes, resumed_weights = _resume_run(tmp_path / "b", ckpt)
    assert resumed_sizes == sizes[12:]
    assert resumed_lrs == lrs[12:]
    assert all(torch.equal(a, b) for a, b in zip(weights, resumed_weights, strict=True))


def test_pickling_and_state() -> None:
    acc = GradientAccumulation({0: 2, 3: 4}, lr_scaling="sqrt")
    fit(TinyModule(), [acc], max_steps=4)
    clone = pickle.loads(pickle.dumps(acc))
    assert clone.factor_at(3) == 4 and clone.state_key == acc.state_key
    state = acc.state_dict()
    # factor 4 from update 3 on; the window is cut to the 2 batches left in the epoch
    assert state["factor"] == 4 and state["size"] == 2 and "applied_steps" not in state  # the count is the ledger's


# ------------------------------------------------------------------ host syncs
def test_no_host_sync_beyond_lightnings_own_accumulation() -> None:
    pl.seed_everything(0)
    native = count_syncs_per_step(
        quiet_trainer(max_steps=4, accumulate_grad_batches=4), TinyModule(n=128, batch_size=4)
    )
    pl.seed_everything(0)
    ours = count_syncs_per_step(
        quiet_trainer(max_steps=4, callbacks=[GradientAccumulation(4)]), TinyModule(n=128, batch_size=4)
    )
    assert ours == native
    pl.seed_everything(0)
    scheduled = count_syncs_per_step(
        quiet_trainer(max_steps=4, callbacks=[GradientAccumulation({0: 2, 2: 6})]),
        TinyModule(n=128, batch_size=4),
    )
    assert len(scheduled) == 16 and sum(scheduled) == sum(native)


# ------------------------------------------------------------------ AdaScale (optional extra)
class SameBatch(TinyModule):
    """Every batch is the same 4 samples: all micro-batch gradients agree (no gradient noise)."""

    def train_dataloader(self) -> Any:
        data = make_data(4, self.dim)
        x, y = data.tensors
        repeated = torch.utils.data.TensorDataset(x.repeat(16, 1), y.repeat(16, 1))
        return torch.utils.data.DataLoader(repeated, batch_size=4, shuffle=False)


def _gains(module: TinyModule, tmp_path: Path) -> list[float]:
    logger = CSVLogger(tmp_path)
    acc = GradientAccumulation(steps=4, lr_scaling="adascale", log_every_n_steps=1)
    quiet_trainer(max_steps=4, logger=logger, callbacks=[acc]).fit(module)
    logger.save()
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        return [float(r["stability/lr_scale"]) for r in csv.DictReader(f) if r.get("stability/lr_scale")]


def test_adascale_gain_is_one_without_noise_and_above_one_with_noise(tmp_path: Path) -> None:
    pytest.importorskip("fairscale")
    pl.seed_everything(0)
    quiet = _gains(SameBatch(), tmp_path / "quiet")
    pl.seed_everything(0)
    noisy = _gains(TinyModule(n=64, batch_size=4), tmp_path / "noisy")
    assert len(quiet) == len(noisy) == 4
    assert all(abs(g - 1.0) < 1e-3 for g in quiet), quiet
    assert all(1.05 < g <= 4.0 for g in noisy), noisy


def test_adascale_without_fairscale_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_fairscale(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("fairscale"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fairscale)
    with pytest.raises(StabilityConfigError, match=r"pip install -e \"\.\[fairscale\]\""):
        GradientAccumulation(4, lr_scaling="adascale")


# ------------------------------------------------------------------ Lightning's tuner
class FactorSpy(TinyModule):
    """Records ``trainer.accumulate_grad_batches`` at every training_step, tuner searches included."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.factors: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.factors.append(self.trainer.accumulate_grad_batches)
        return super().training_step(batch, batch_idx)


LR_FIND: dict[str, Any] = {"min_lr": 1e-5, "max_lr": 1.0, "early_stop_threshold": None}
SEARCH_STEPS = 30


def _reference_search(tmp_path: Path) -> Any:
    """The same LR search on a Trainer without GradientAccumulation."""
    pl.seed_everything(0)
    trainer = quiet_trainer(max_steps=2, default_root_dir=tmp_path / "reference")
    finder = Tuner(trainer).lr_find(FactorSpy(n=256, batch_size=4), num_training=SEARCH_STEPS, **LR_FIND)
    assert finder is not None and finder.suggestion() is not None
    return finder


def test_tuner_lr_find_searches_as_configured_and_fit_scales_the_found_lr_once(tmp_path: Path) -> None:
    k = 4
    reference = _reference_search(tmp_path)
    pl.seed_everything(0)
    module, rec = FactorSpy(n=256, batch_size=4), StepRecorder()
    acc = GradientAccumulation(steps=k, lr_scaling="linear")
    trainer = quiet_trainer(max_steps=2, default_root_dir=tmp_path, callbacks=[acc, rec])
    finder = Tuner(trainer).lr_find(module, num_training=SEARCH_STEPS, **LR_FIND)
    assert finder is not None
    found = finder.suggestion()
    # The search saw the Trainer as configured (one micro-batch per step): the very same search as without
    # the callback, so `found` is the LR for one micro-batch.
    assert module.factors == [1] * SEARCH_STEPS
    assert finder.results == reference.results and found == reference.suggestion()
    assert module.lr == found and trainer.accumulate_grad_batches == 1
    module.factors.clear()
    trainer.fit(module)
    assert rec.sizes == [k, k] and module.factors == [k] * (2 * k)
    assert rec.lrs == [found * k, found * k]  # scaled once, not found * k**2


def test_learning_rate_finder_callback_searches_as_configured_then_trains_at_found_times_k(tmp_path: Path) -> None:
    k = 2
    reference = _reference_search(tmp_path)
    pl.seed_everything(0)
    module, rec = FactorSpy(n=256, batch_size=4), StepRecorder()
    finder = LearningRateFinder(num_training_steps=SEARCH_STEPS, **LR_FIND)
    trainer = quiet_trainer(
        max_steps=3,
        default_root_dir=tmp_path,
        callbacks=[GradientAccumulation(steps=k, lr_scaling="linear"), rec, finder],
    )
    trainer.fit(module)  # searches at fit start, then trains
    assert finder.optimal_lr is not None
    found = finder.optimal_lr.suggestion()
    assert module.factors == [1] * SEARCH_STEPS + [k] * (3 * k)
    assert finder.optimal_lr.results == reference.results
    assert rec.sizes == [k] * 3 and rec.lrs == [found * k] * 3
    assert "lr_find" not in vars(finder)  # the Lightning callback is as it was


class InStepLR(Callback):
    """The LR each ``optimizer.step()`` applies (seen by a step pre-hook registered after every other one)."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.optimizers[0].register_step_pre_hook(lambda opt, *_: self.lrs.append(float(opt.param_groups[0]["lr"])))


class SearchAtEpoch1(LearningRateFinder):
    """Lightning's documented fine-tuning form: search again at a later epoch, in the middle of the fit."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        return

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            self.lr_find(trainer, pl_module)


@pytest.mark.parametrize("lr_scaling", ["linear", "adascale"])
def test_lr_search_during_training_runs_without_accumulation(lr_scaling: str, tmp_path: Path) -> None:
    if lr_scaling == "adascale":
        pytest.importorskip("fairscale")
    k, lr = 2, 0.01
    module, rec = FactorSpy(n=32, batch_size=4, lr=lr), StepRecorder()  # 8 batches: 4 steps per epoch
    finder = SearchAtEpoch1(num_training_steps=SEARCH_STEPS, **LR_FIND)
    acc = GradientAccumulation(steps={0: k, 100: 4}, lr_scaling=lr_scaling)
    in_step = InStepLR()
    quiet_trainer(max_steps=8, default_root_dir=tmp_path, callbacks=[finder, acc, rec, in_step]).fit(module)
    assert finder.optimal_lr is not None
    found = finder.optimal_lr.suggestion()
    # epoch 0 accumulates, the search steps on every micro-batch, epoch 1 accumulates again
    assert module.factors == [k] * 8 + [1] * SEARCH_STEPS + [k] * 8
    # the search's steps use the search's LRs: no accumulation scaling, no AdaScale gain
    assert len(in_step.lrs) == 4 + SEARCH_STEPS + 4
    assert in_step.lrs[4 : 4 + SEARCH_STEPS] == finder.optimal_lr.results["lr"]
    assert rec.sizes == [k] * 8
    if lr_scaling == "linear":  # the LR the search found is the new base for one micro-batch
        assert rec.lrs == [lr * k] * 4 + [found * k] * 4


def test_tuner_scale_batch_size_tries_single_micro_batches(tmp_path: Path) -> None:
    k = 4
    search = {"mode": "power", "steps_per_trial": 2, "init_val": 2, "max_trials": 3}
    bare_module = FactorSpy(n=256, batch_size=4)
    bare = Tuner(quiet_trainer(max_steps=2, default_root_dir=tmp_path / "bare")).scale_batch_size(bare_module, **search)
    module, rec = FactorSpy(n=256, batch_size=4), StepRecorder()
    trainer = quiet_trainer(max_steps=2, default_root_dir=tmp_path, callbacks=[GradientAccumulation(steps=k), rec])
    size = Tuner(trainer).scale_batch_size(module, **search)
    # the same search as on a Trainer without the callback (how far it goes is Lightning's own business)
    assert size == module.batch_size == bare
    assert module.factors == bare_module.factors and set(module.factors) == {1}  # one micro-batch per step
    module.factors.clear()
    trainer.fit(module)
    assert rec.sizes == [k, k] and module.factors == [k] * (2 * k)


def test_adascale_gain_reaches_the_update_through_the_step_and_the_lr_comes_back() -> None:
    """The gain is one factor on the step's update scale: the update uses lr x gain, the optimizer's LR is the
    schedule's again after it (so LR schedules never see the gain)."""
    pytest.importorskip("fairscale")
    from lightning_stability import StepLedger

    class Seen(pl.Callback):
        """Each update's LR as used, its gain, and the optimizer's LR right after it."""

        def __init__(self) -> None:
            self.steps: list[Any] = []
            self.used: list[float] = []
            self.after: list[float] = []
            self.gains: list[float] = []

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            ledger = StepLedger.of(trainer)
            if not ledger.has_step or ledger.step.scale.lrs is None or any(s is ledger.step for s in self.steps):
                return  # a micro-batch that did not step
            self.steps.append(ledger.step)
            self.used.append(float(ledger.step.scale.lrs[0]))
            self.gains.append(float(ledger.step.scale.factors["adascale"]))
            self.after.append(float(trainer.optimizers[0].param_groups[0]["lr"]))

    pl.seed_everything(0)
    seen = Seen()
    module = TinyModule(n=64, batch_size=4)
    quiet_trainer(max_steps=4, callbacks=[GradientAccumulation(steps=4, lr_scaling="adascale"), seen]).fit(module)
    base = module.lr
    assert len(seen.used) == 4 and all(g > 1.05 for g in seen.gains), seen.gains
    assert seen.used == pytest.approx([base * g for g in seen.gains])
    assert seen.after == [base] * 4
