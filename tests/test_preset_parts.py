"""Every part of a preset reaches what it configures, can be turned off and replaced, and the planner plans what
``StableTrainer.from_preset`` builds."""

from __future__ import annotations

import csv
import logging
import math
import os
import re
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_stability import (
    AtomicCheckpointIO,
    BatchRamp,
    GradientAccumulation,
    GradientNormMonitor,
    LossScaleTuner,
    RouterHealthMonitor,
    ScheduledLR,
    StabilityConfigError,
    StableCheckpoint,
    StableFSDPStrategy,
    StableTrainer,
    StepReplay,
    TrainingHealthMonitor,
    WarmupConstantCosineSchedule,
    _compat,
)
from lightning_stability.cli import main
from lightning_stability.planner import plan_memory
from lightning_stability.precursors import LRBackoff, PrecursorMonitor
from lightning_stability.presets import FIELDS, PRESETS, batch_mismatch, get_preset, layout
from lightning_stability.trainer import EffectiveBatchCheck
from tests.helpers import QUIET, TinyModule, count_syncs_per_step
from tests.precursors.tiny_lm import TinyLM


def amx_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU as one with AMX-BF16 and AMX-FP16: a preset keeps its mixed precision on it."""
    monkeypatch.setattr(_compat, "cpu_amx_dtypes", lambda: frozenset({torch.bfloat16, torch.float16}))


def one(trainer: pl.Trainer, kind: type) -> Any:
    found = [cb for cb in trainer.callbacks if isinstance(cb, kind)]  # type: ignore[attr-defined]
    assert len(found) <= 1
    return found[0] if found else None


def plugins_of(trainer: pl.Trainer) -> list[Any]:
    return [trainer.strategy.checkpoint_io, trainer.precision_plugin]


# ------------------------------------------------------------------ a module with its own scheduler
class OwnSchedule(TinyModule):
    """AdamW with its own linear warmup then cosine decay (LambdaLR, per optimizer step)."""

    WARMUP, TOTAL = 2, 6

    @staticmethod
    def factor(step: int) -> float:
        if step < OwnSchedule.WARMUP:
            return (step + 1) / OwnSchedule.WARMUP
        progress = (step - OwnSchedule.WARMUP) / (OwnSchedule.TOTAL - OwnSchedule.WARMUP)
        return 0.5 * (1 + math.cos(math.pi * progress))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, self.factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class AppliedLR(Callback):
    """The LR each ``optimizer.step()`` applies."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.optimizers[0].register_step_pre_hook(lambda opt, *_: self.lrs.append(float(opt.param_groups[0]["lr"])))


@pytest.mark.parametrize("name", list(PRESETS))
def test_a_module_with_its_own_scheduler_trains_under_every_preset(name: str, tmp_path: Any) -> None:
    steps, lr = 4, 0.01
    accumulation = get_preset(name).accumulation
    dense = {"router": False} if get_preset(name).router else {}  # OwnSchedule has no experts
    module = OwnSchedule(lr=lr, batch_size=2, n=2 * accumulation * steps)
    with pytest.raises(StabilityConfigError, match=r"from_preset\(\.\.\., lr_schedule=False\) keeps your scheduler"):
        StableTrainer.from_preset(
            name, accelerator="cpu", devices=1, max_steps=1, default_root_dir=tmp_path, **dense, **QUIET
        ).fit(OwnSchedule())
    applied = AppliedLR()
    trainer = StableTrainer.from_preset(
        name,
        lr_schedule=False,
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        default_root_dir=tmp_path,
        callbacks=[applied],
        **dense,
        **QUIET,
    )
    assert one(trainer, ScheduledLR) is None
    trainer.fit(module)
    assert trainer.global_step == steps
    # the module's schedule, on the preset's applied steps (fp16's scaler may skip a step: then it repeats)
    expected = [lr * OwnSchedule.factor(i) for i in range(steps)]
    assert applied.lrs == pytest.approx(expected), (name, applied.lrs)


# ------------------------------------------------------------------ each part off, and replaced by yours
def test_each_part_can_be_turned_off(tmp_path: Any) -> None:
    trainer = StableTrainer.from_preset(
        "175b",
        accelerator="cpu",
        devices=2,
        lr_schedule=False,
        health=None,
        lr_backoff=None,
        max_norm=None,
        checkpoint=False,
        watchdog=False,
        default_root_dir=tmp_path,
        **QUIET,
    )
    assert one(trainer, ScheduledLR) is None and one(trainer, TrainingHealthMonitor) is None
    assert one(trainer, PrecursorMonitor) is None
    assert one(trainer, GradientNormMonitor).max_norm is None  # measured, not clipped
    assert one(trainer, StableCheckpoint) is None
    assert isinstance(trainer.strategy, StableFSDPStrategy) and trainer.strategy._timeout == default_pg_timeout
    single = StableTrainer.from_preset("gpt", accelerator="cpu", checkpoint=False, default_root_dir=tmp_path, **QUIET)
    assert one(single, StableCheckpoint) is None
    assert not any(isinstance(p, AtomicCheckpointIO) for p in plugins_of(single))


def test_watchdog_false_leaves_the_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("TORCH_NCCL", "TORCH_FR", "NCCL_")):
            monkeypatch.delenv(name)
    before = dict(os.environ)
    StableTrainer.from_preset("175b", accelerator="cpu", devices=2, watchdog=False, **QUIET)
    assert dict(os.environ) == before
    trainer = StableTrainer.from_preset("175b", accelerator="cpu", devices=2, **QUIET)
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and trainer.strategy._timeout == timedelta(minutes=10)


def test_a_part_turned_off_is_replaced_by_your_own(tmp_path: Any) -> None:
    from lightning_stability import WarmupConstantCosineLR

    mine = [
        TrainingHealthMonitor(response="warn"),
        WarmupConstantCosineLR(warmup=3),
        StableCheckpoint(dirpath=tmp_path / "mine"),
        GradientAccumulation(2, lr_scaling="sqrt"),
        PrecursorMonitor(qk_clip=100.0),
    ]
    trainer = StableTrainer.from_preset(
        "under-1b",
        accelerator="cpu",
        health=None,
        lr_backoff=None,
        lr_schedule=False,
        checkpoint=False,
        accumulation=1,
        callbacks=mine,
        default_root_dir=tmp_path,
        **QUIET,
    )
    for cb in mine:
        assert one(trainer, type(cb)) is cb


@pytest.mark.parametrize(
    ("callback", "switch"),
    [
        (lambda: TrainingHealthMonitor(response="warn"), r"turn the preset's off with health=None"),
        (lambda: ScheduledLR(WarmupConstantCosineSchedule()), r"turn the preset's off with lr_schedule=False"),
        (lambda: GradientAccumulation(2), r"turn the preset's off with accumulation=1"),
        (lambda: PrecursorMonitor(qk_clip=100.0), r"\(lr_backoff=\.\.\.\).*turn the preset's off with lr_backoff=None"),
    ],
)
def test_a_second_callback_of_a_kind_names_the_field_that_turns_the_presets_off(
    callback: Callable[[], Callback], switch: str
) -> None:
    with pytest.raises(StabilityConfigError, match=rf"already attaches a .*Fix: override the preset's.*{switch}"):
        StableTrainer.from_preset("under-1b", accelerator="cpu", callbacks=[callback()], **QUIET)


def test_the_switches_work_through_the_constructor_as_lightning_cli_passes_them(tmp_path: Any) -> None:
    trainer = StableTrainer(
        preset="gpt",
        preset_overrides={
            "lr_schedule": False,
            "health": None,
            "lr_backoff": None,
            "max_norm": None,
            "checkpoint": False,
        },
        accelerator="cpu",
        default_root_dir=tmp_path,
        **QUIET,  # type: ignore[arg-type]
    )
    assert one(trainer, ScheduledLR) is None and one(trainer, TrainingHealthMonitor) is None
    assert one(trainer, PrecursorMonitor) is None
    assert one(trainer, GradientNormMonitor).max_norm is None and one(trainer, StableCheckpoint) is None


# ------------------------------------------------------------------ every field reaches what it configures
def _schedule(trainer: pl.Trainer) -> Any:
    return one(trainer, ScheduledLR).schedule


def attr(kind: type, name: str) -> Callable[[pl.Trainer], Any]:
    """The attribute ``name`` of the Trainer's callback of ``kind`` (None: no such callback)."""
    return lambda trainer: getattr(one(trainer, kind), name, None)


#: field -> (preset, value, trainer arguments, what the built Trainer runs for it). Each value differs from the
#: preset's, so a field that never reaches its callback or strategy fails here.
REACHES: dict[str, tuple[str, Any, dict[str, Any], Callable[[pl.Trainer], Any]]] = {
    "max_norm": ("gpt", 0.3, {}, attr(GradientNormMonitor, "max_norm")),
    "warmup": ("gpt", 0.1, {}, lambda t: _schedule(t).warmup),
    "decay": ("gpt", 0.5, {}, lambda t: _schedule(t).decay),
    "min_lr_ratio": ("gpt", 0.1, {}, lambda t: _schedule(t).min_lr_ratio),
    "lr_schedule": ("gpt", False, {}, lambda t: one(t, ScheduledLR) is not None),
    "precision": ("gpt", "32-true", {}, lambda t: t.precision),
    "init_scale": ("175b", 1024.0, {}, lambda t: one(t, LossScaleTuner).settings.init_scale),
    "hysteresis": ("175b", 3, {}, lambda t: one(t, LossScaleTuner).settings.hysteresis),
    "accumulation": ("gpt", 3, {}, attr(GradientAccumulation, "steps")),
    "lr_scaling": ("under-1b", "sqrt", {}, attr(GradientAccumulation, "lr_scaling")),
    "batch_ramp": ("under-1b", 16, {"lr_scaling": "sqrt"}, attr(BatchRamp, "max_factor")),
    "effective_batch": ("gpt", 64, {}, attr(EffectiveBatchCheck, "effective_batch")),
    "fsdp": ("gpt", True, {"devices": 2}, lambda t: isinstance(t.strategy, StableFSDPStrategy)),
    "activation_checkpointing": (
        "over-10b",
        False,
        {"devices": 2},
        lambda t: t.strategy._cfg.activation_checkpointing,
    ),
    "tensor_parallel": ("over-10b", 2, {"devices": 2}, lambda t: t.strategy._cfg.tensor_parallel),
    "num_nodes": ("gpt", 2, {"env": {"SLURM_NNODES": "2"}}, lambda t: t.num_nodes),
    "health": ("gpt", "rollback", {}, attr(TrainingHealthMonitor, "response")),
    "skip_on": ("gpt", "any", {}, attr(TrainingHealthMonitor, "skip_on")),
    "lr_backoff": ("gpt", 0.05, {}, lambda t: getattr(attr(PrecursorMonitor, "lr_backoff")(t), "threshold", None)),
    "per_layer": ("gpt", 3, {}, attr(GradientNormMonitor, "per_layer")),
    "replay": ("gpt", True, {}, lambda t: one(t, StepReplay) is not None),
    "router": ("moe", False, {}, lambda t: one(t, RouterHealthMonitor) is not None),
    "router_balance_bias": ("moe", 1e-2, {}, attr(RouterHealthMonitor, "balance_bias")),
    "router_z_loss": ("moe", 1e-2, {}, attr(RouterHealthMonitor, "z_loss")),
    "checkpoint": ("gpt", False, {}, lambda t: one(t, StableCheckpoint) is not None),
    "watchdog": ("175b", False, {"devices": 2}, lambda t: t.strategy._timeout != default_pg_timeout),
}


def test_the_table_covers_every_field() -> None:
    assert set(REACHES) == set(FIELDS)


@pytest.mark.parametrize("field", list(REACHES))
def test_every_field_overridden_reaches_what_it_configures(
    field: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    amx_cpu(monkeypatch)  # the presets' own precisions run here, as on a GPU with bf16
    name, value, extra, probe = REACHES[field]
    extra = dict(extra)
    for key, setting in extra.pop("env", {}).items():
        monkeypatch.setenv(key, setting)
    assert getattr(get_preset(name), field) != value
    args = dict(accelerator="cpu", default_root_dir=tmp_path, **QUIET, **extra)
    assert probe(StableTrainer.from_preset(name, **args)) != value  # the probe tells the two apart
    trainer = StableTrainer.from_preset(name, **{field: value}, **args)
    assert probe(trainer) == value
    assert getattr(trainer.preset, field) == value


# ------------------------------------------------------------------ per_layer: the per-module figures, logged
def _logged_parts(tmp_path: Any, per_layer: bool | int) -> tuple[set[str], list[dict[str, set[str]]]]:
    """A real fit of the "gpt" preset with ``per_layer``: the model's modules that own parameters, and per
    CSV row (one per logging step) the parts logged under each ``stability/<figure>_by_module/``."""
    logger = CSVLogger(tmp_path, name="", version="")
    trainer = StableTrainer.from_preset(
        "gpt",
        per_layer=per_layer,
        precision="32-true",
        accelerator="cpu",
        devices=1,
        max_steps=4,
        log_every_n_steps=2,
        logger=logger,
        checkpoint=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    torch.manual_seed(0)
    model = TinyLM()
    trainer.fit(model)
    owners = {name for name, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None}
    with open(os.path.join(logger.log_dir, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    figures = ("grad_norm", "update_ratio")
    parts = [
        {
            fig: {k.split("/")[-1] for k, v in row.items() if v and k.startswith(f"stability/{fig}_by_module/")}
            for fig in figures
        }
        for row in rows
    ]
    return owners, parts


def test_per_layer_logs_every_modules_gradient_norm_and_update_ratio(tmp_path: Any) -> None:
    owners, rows = _logged_parts(tmp_path, True)
    assert len(owners) > 5 and len(rows) == 2  # more modules than the health monitor's default 5; 2 logging steps
    for row in rows:
        assert row == {"grad_norm": owners, "update_ratio": owners}


def test_per_layer_k_logs_the_k_largest_of_each_and_false_no_gradient_norm_per_module(tmp_path: Any) -> None:
    owners, rows = _logged_parts(tmp_path / "k", 2)
    assert [{fig: len(parts) for fig, parts in row.items()} for row in rows] == [
        {"grad_norm": 2, "update_ratio": 2}
    ] * 2
    assert all(parts <= owners for row in rows for parts in row.values())
    _, rows = _logged_parts(tmp_path / "off", False)
    assert [{fig: len(parts) for fig, parts in row.items()} for row in rows] == [
        {"grad_norm": 0, "update_ratio": 5}
    ] * 2


# ------------------------------------------------------------------ bad fields get the package's error
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("warmup", None),
        ("decay", -0.1),
        ("min_lr_ratio", 2.0),
        ("max_norm", "1"),
        ("init_scale", 0),
        ("hysteresis", 0),
        ("effective_batch", 0),
        ("lr_schedule", "no"),
        ("checkpoint", None),
        ("watchdog", 1),
        ("router", "yes"),
        ("health", "panic"),
        ("skip_on", "grad"),
        ("lr_backoff", 0),
        ("lr_backoff", "0.02"),
        ("router_balance_bias", 0),
        ("router_balance_bias", "1e-3"),
        ("router_z_loss", -1.0),
        ("per_layer", 0),
        ("per_layer", "all"),
    ],
)
def test_a_bad_field_is_an_error_naming_it(field: str, value: Any) -> None:
    with pytest.raises(StabilityConfigError, match=rf"`{field}={re.escape(repr(value))}`.*Fix: "):
        StableTrainer.from_preset("gpt", **{field: value})


@pytest.mark.parametrize(
    ("health", "expected"), [("skip", "loss"), ("rollback", "any"), ("warn", "any"), ("clip", "any")]
)
def test_skip_on_reaches_the_skip_response_only(health: str, expected: str) -> None:
    """The monitor takes skip_on="loss" under "skip" alone (it chooses what "skip" skips): another response keeps
    "any", and the preset's default never makes ``health=...`` an error."""
    trainer = StableTrainer.from_preset("gpt", accelerator="cpu", health=health, **QUIET)
    assert one(trainer, TrainingHealthMonitor).skip_on == expected


class Weights(Callback):
    """The weights after each batch."""

    def __init__(self) -> None:
        self.after: list[list[torch.Tensor]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.after.append([p.detach().clone() for p in trainer.lightning_module.parameters()])


def _fit(tmp_path: Any, optimizer: str = "adamw", **overrides: Any) -> tuple[pl.Trainer, Weights]:
    """``from_preset("tiny", **overrides)`` trained 8 steps from the same initial weights and batches every time."""
    pl.seed_everything(0)
    module = TinyModule(optimizer=optimizer)
    weights = Weights()
    callbacks = [*overrides.pop("callbacks", []), weights]
    trainer = StableTrainer.from_preset(
        "tiny", accelerator="cpu", max_steps=8, default_root_dir=tmp_path, callbacks=callbacks, **QUIET, **overrides
    )
    trainer.fit(module)
    return trainer, weights


def test_the_presets_lr_backoff_is_precursor_monitors_and_acts(tmp_path: Any) -> None:
    """The preset's back-off trains exactly as PrecursorMonitor(lr_backoff=LRBackoff("update_ratio", 0.02)) does
    beside the preset without it; AdamW at LR 0.05 on TinyModule moves the weights by more than 2% a step, so it
    backs off, and the run differs from one without it."""
    shipped, ours = _fit(tmp_path / "a")
    monitor = one(shipped, PrecursorMonitor)
    assert monitor.lr_backoff == LRBackoff("update_ratio", get_preset("tiny").lr_backoff)
    assert float(monitor.backoff) < 1.0
    own = PrecursorMonitor(lr_backoff=LRBackoff("update_ratio", 0.02))
    _, theirs = _fit(tmp_path / "b", lr_backoff=None, callbacks=[own])
    assert all(
        torch.equal(a, b) for x, y in zip(ours.after, theirs.after, strict=True) for a, b in zip(x, y, strict=True)
    )
    off, without = _fit(tmp_path / "c", lr_backoff=None)
    assert one(off, PrecursorMonitor) is None
    assert not all(torch.equal(a, b) for a, b in zip(ours.after[-1], without.after[-1], strict=True))


def test_the_presets_lr_backoff_adds_no_host_sync_on_steps_that_do_not_log(tmp_path: Any) -> None:
    """With fused AdamW (whose skip stays on the device), the preset as shipped syncs on a step that does not log
    exactly as often as the preset without its ``PrecursorMonitor``: never (steps 3 and 7 log, the last entry holds
    the end of the fit)."""
    counts = []
    for name, overrides in (("off", {"lr_backoff": None}), ("on", {})):
        pl.seed_everything(0)
        trainer = StableTrainer.from_preset(
            "tiny",
            accelerator="cpu",
            max_steps=9,
            log_every_n_steps=4,
            default_root_dir=tmp_path / name,
            checkpoint=False,
            **QUIET,
            **overrides,
        )
        counts.append(count_syncs_per_step(trainer, TinyModule(optimizer="adamw_fused")))
    quiet = [0, 1, 2, 4, 5, 6]
    assert [counts[1][i] for i in quiet] == [counts[0][i] for i in quiet] == [0] * len(quiet)


def test_the_presets_lr_backoff_runs_with_another_optimizer_through_its_lr(tmp_path: Any) -> None:
    """The back-off scales the update through the LR, so it runs with SGD as with AdamW: no warning, on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = _fit(tmp_path, "sgd")
    assert not [w for w in caught if "PrecursorMonitor" in str(w.message) and "off" in str(w.message)]
    assert trainer.global_step == 8 and one(trainer, PrecursorMonitor)._backoff_on


def test_a_module_with_two_optimizers_trains_with_the_health_monitor_and_the_back_off_off(tmp_path: Any) -> None:
    """Both act once per update of the whole module: with two optimizers each refuses the fit, as the presets page
    says; with both off the rest of the preset trains it."""
    from tests.ledger.test_several_optimizers import TwoOptimizerGAN

    common: dict[str, Any] = dict(accelerator="cpu", max_steps=4, default_root_dir=tmp_path, **QUIET)
    with pytest.raises(StabilityConfigError, match=r"PrecursorMonitor's early actions .* 2 optimizers"):
        StableTrainer.from_preset("tiny", health=None, **common).fit(TwoOptimizerGAN())
    trainer = StableTrainer.from_preset("tiny", health=None, lr_backoff=None, **common)
    trainer.fit(TwoOptimizerGAN())
    assert trainer.global_step == 4  # optimizer steps: two per batch


def test_activation_checkpointing_needs_fsdp() -> None:
    with pytest.raises(StabilityConfigError, match=r"`activation_checkpointing=True` needs fsdp=True.*Fix: pass fsdp"):
        StableTrainer.from_preset("gpt", activation_checkpointing=True)


# ------------------------------------------------------------------ precision and sharding by size
def test_size_presets_use_bf16_and_175b_keeps_the_recipes_fp16() -> None:
    for name in ("under-1b", "1b-10b", "over-10b", "100b"):
        assert get_preset(name).precision == "bf16-mixed", name
    b175 = get_preset("175b")
    assert (b175.precision, b175.init_scale) == ("16-mixed", 32768.0)


def test_bf16_becomes_fp16_on_a_gpu_without_bf16_and_says_so() -> None:
    # the decision is a pure function of the hardware: tested without such a GPU
    old = layout(get_preset("1b-10b"), world_size=8, devices_per_node=8, gpu=True, bf16=False)
    assert old.precision == "16-mixed" and "this GPU has no bf16" in old.notes[0]
    mine = layout(get_preset("1b-10b"), world_size=8, devices_per_node=8, gpu=True, bf16=False, own_precision=True)
    assert mine.precision == "bf16-mixed" and not mine.notes
    assert layout(get_preset("1b-10b"), world_size=8, devices_per_node=8, gpu=True).precision == "bf16-mixed"


#: the largest model each size preset is for
LARGEST = {"under-1b": 1e9, "1b-10b": 10e9, "over-10b": 100e9, "100b": 175e9, "175b": 175e9}


@pytest.mark.parametrize("name", list(LARGEST))
def test_a_size_preset_shards_where_its_model_states_do_not_fit_one_gpu(name: str) -> None:
    preset = get_preset(name)
    states = plan_memory(LARGEST[name], precision=preset.precision, sharding="none", overhead=0, seq_len=1)
    need = states.params_bytes + states.grads_bytes + states.optimizer_bytes
    assert preset.fsdp == (need > states.usable_bytes), (name, need / 2**30)


# ------------------------------------------------------------------ the planner plans what the Trainer runs
def planned(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, str]:
    main(argv)
    out = capsys.readouterr().out
    line = re.search(
        r"^preset \S+: precision (\S+), sharding (\S+), activation checkpointing (\S+), .*"
        r"tensor parallel (\d+)",
        out,
        re.M,
    )
    title = re.search(r"on 1 x (\d+) = \d+ GPUs, (?:TP \d+ x PP 1 x DP \d+, )?(\S+), adamw, sharding=(\S+) ", out)
    assert line and title, out
    assert (title.group(2), title.group(3)) == (line.group(1), line.group(2))  # the plan is of those settings
    return {"precision": line.group(1), "sharding": line.group(2), "ac": line.group(3), "tp": line.group(4)}


def runs(trainer: pl.Trainer) -> dict[str, str]:
    strategy = trainer.strategy
    fsdp = isinstance(strategy, StableFSDPStrategy)
    return {
        "precision": str(trainer.precision_plugin.precision) if not fsdp else strategy.precision_plugin.precision,
        "sharding": "full" if fsdp else "none",
        "ac": str(bool(fsdp and strategy._cfg.activation_checkpointing)),
        "tp": str(strategy._cfg.tensor_parallel if fsdp else 1),
    }


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("name", list(PRESETS))
def test_the_planners_plan_for_a_preset_is_what_from_preset_builds(
    name: str, devices: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    amx_cpu(monkeypatch)  # the plan is for GPUs with bf16: a CPU with AMX runs the same precisions
    argv = ["plan", "--preset", name, "--params", "1.3e9", "--nodes", "1", "--gpus-per-node", str(devices)]
    trainer = StableTrainer.from_preset(name, accelerator="cpu", devices=devices, num_nodes=1, **QUIET)
    assert planned(capsys, argv) == runs(trainer)
    if get_preset(name).fsdp and devices == 2:  # and with tensor parallelism
        tp = StableTrainer.from_preset(name, tensor_parallel=2, accelerator="cpu", devices=2, num_nodes=1, **QUIET)
        plan = planned(capsys, [*argv, "--tensor-parallel", "2"])
        assert plan == runs(tp) and plan["tp"] == "2"


def test_the_planner_suggests_plain_sharding_before_tensor_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--params", "7e9", "--sharding", "none", "--gpus-per-node", "8"])
    out = capsys.readouterr().out
    assert code == 1 and "DOES NOT FIT" in out
    assert re.search(r"^sharding: needed: plain full sharding fits \(\d+\.\d\d GiB of 72\.00 usable", out, re.M), out
    assert "tensor parallel: needed" not in out
    # the size preset for 7B shards, and fits on 8 GPUs
    assert main(["plan", "--preset", "1b-10b", "--params", "7e9", "--gpus-per-node", "8"]) == 0
    assert "sharding full, activation checkpointing True" in capsys.readouterr().out


def test_dropped_parts_are_said_with_the_way_to_change_them(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        StableTrainer.from_preset("1b-10b", accelerator="cpu", devices=1, **QUIET)
    lines = [r.getMessage() for r in caplog.records if "StableTrainer preset" in r.getMessage()]
    assert len(lines) == 1
    assert "FSDP off (one device: nothing to shard)" in lines[0]
    assert "activation checkpointing off (it comes with FSDP, off on one device)" in lines[0]


def test_tensor_parallelism_is_advised_only_where_plain_sharding_does_not_fit() -> None:
    from lightning_stability import ModelShape, advise_tensor_parallel

    gpt3 = ModelShape(175e9, 96, 12288, 96, 51200)
    kwargs: dict[str, Any] = dict(nodes=8, gpus_per_node=8, sequence_parallel=True, flash_attention=True)
    advice = advise_tensor_parallel(gpt3, sharding="none", **kwargs)
    assert advice.sharded is not None and not advice.sharded.fits  # full sharding alone: too large
    assert advice.smallest == advise_tensor_parallel(gpt3, sharding="full", **kwargs).smallest == 4
    assert all(p.title.count("sharding=full") for p in advice.plans[1:])  # TP runs with full sharding here
    assert advice.text().startswith("tensor parallel: needed: TP 4 with full sharding is the smallest size")
    assert "tensor_parallel=4 and fsdp=True" in advice.text()


# ------------------------------------------------------------------ the preset's clipping and gradient_clip_val
def test_gradient_clip_val_beside_the_presets_clipping_names_the_presets_override(tmp_path: Any) -> None:
    # was: "pass `max_norm=None` to GradientNormMonitor", a callback the preset's user never built
    args = dict(accelerator="cpu", default_root_dir=tmp_path, **QUIET)
    fix = r"Fix: .*StableTrainer\.from_preset\('gpt', max_norm=None, gradient_clip_val=1\.0\) clips with Lightning's"
    with pytest.raises(StabilityConfigError, match=r"from_preset\('gpt'\) clips the gradient norm at max_norm=0\.5"):
        StableTrainer.from_preset("gpt", gradient_clip_val=1.0, **args)
    with pytest.raises(StabilityConfigError, match=fix):
        StableTrainer.from_preset("gpt", gradient_clip_val=1.0, **args)
    with pytest.raises(StabilityConfigError, match=r"preset_overrides=\{'max_norm': None\}"):
        StableTrainer(preset="gpt", gradient_clip_val=1.0, **args)  # as LightningCLI builds it
    # the fix trains: Lightning clips, the preset's monitor measures
    trainer = StableTrainer.from_preset("tiny", max_norm=None, gradient_clip_val=0.01, max_steps=3, **args)
    assert one(trainer, GradientNormMonitor).max_norm is None and trainer.gradient_clip_val == 0.01
    trainer.fit(TinyModule())
    assert trainer.global_step == 3
    assert float(trainer.callback_metrics["stability/grad_norm"]) > 0.01  # measured before Lightning's clip


# ------------------------------------------------------------------ the preset's global batch, checked at fit start
def _batch_warnings(tmp_path: Any, batch_size: int, **overrides: Any) -> list[str]:
    """The warnings of a 2-step fit of under-1b (global batch 512, accumulation 4) on one CPU."""
    trainer = StableTrainer.from_preset(
        "under-1b", accelerator="cpu", devices=1, max_steps=2, default_root_dir=tmp_path, **QUIET, **overrides
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyModule(batch_size=batch_size, n=batch_size * 8))
    assert trainer.global_step == 2
    return [str(w.message) for w in caught if "global batch" in str(w.message)]


def test_a_run_that_misses_the_presets_global_batch_is_told_once_at_fit_start(tmp_path: Any) -> None:
    # was: under-1b's "global batch 512" read only by the planner; the run trained on 8 x 4 = 32, silently
    said = _batch_warnings(tmp_path / "a", batch_size=8)
    assert len(said) == 1, said
    assert said[0].startswith(
        "Preset 'under-1b' was written for a global batch of 512 samples per optimizer step (effective_batch=512); "
        "this run trains on 32 = 8 (the DataLoader's batch_size) x 4 (accumulation) x 1 (data-parallel processes)."
    )
    assert "Fix: to reach 512, accumulation=64 or a DataLoader batch_size of 128; or pass effective_batch=32" in said[0]
    assert _batch_warnings(tmp_path / "b", batch_size=128) == []  # 128 x 4 = 512
    assert _batch_warnings(tmp_path / "c", batch_size=16, accumulation=32) == []  # 16 x 32 = 512
    assert _batch_warnings(tmp_path / "d", batch_size=8, effective_batch=None) == []  # not checked


@pytest.mark.parametrize(
    ("batch_size", "accumulation", "data_parallel", "said"),
    [
        (128, 4, 1, None),
        (16, 4, 8, None),
        (8, 4, 2, "this run trains on 64 = 8 (the DataLoader's batch_size) x 4 (accumulation) x 2 (data-parallel"),
        (8, 4, 2, "to reach 512, accumulation=32 or a DataLoader batch_size of 64;"),
        (24, 4, 1, "to reach 512, a DataLoader batch_size of 128;"),  # 512 / 24 is no accumulation
        (8, 3, 1, "to reach 512, accumulation=64;"),
        (24, 3, 1, "to reach 512, a batch_size and an accumulation whose product is 512;"),
    ],
)
def test_the_batch_mismatch_message(batch_size: int, accumulation: int, data_parallel: int, said: str | None) -> None:
    message = batch_mismatch("under-1b", 512, batch_size, accumulation, data_parallel)
    assert message is None if said is None else said in message, message


def test_the_moe_preset_refuses_a_dense_model_naming_the_field(tmp_path: Any) -> None:
    trainer = StableTrainer.from_preset(
        "moe", accelerator="cpu", devices=1, max_steps=1, default_root_dir=tmp_path, **QUIET
    )
    with pytest.raises(StabilityConfigError, match=r"has no router RouterHealthMonitor knows.*a preset: router=False"):
        trainer.fit(OwnSchedule())
