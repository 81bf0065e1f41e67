"""Presets and StableTrainer.from_preset with real Trainers on this CPU."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor

from lightning_stability import (
    GradientAccumulation,
    GradientNormMonitor,
    LossScaleTuner,
    StabilityConfigError,
    StableTrainer,
    TrainingHealthMonitor,
    WarmupConstantCosineLR,
    _compat,
    describe_preset,
    list_presets,
)
from lightning_stability.precursors import PrecursorMonitor
from lightning_stability.presets import FIELDS, PRESETS, get_preset
from lightning_stability.strategies import StableFSDPStrategy
from tests.helpers import TinyModule, torchrun


def quiet(**kwargs: object) -> dict[str, object]:
    return dict(
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, **kwargs
    )


def test_the_table_has_every_family_and_size_and_each_value_cites_its_source() -> None:
    assert set(list_presets()) == {"tiny", "bert", "gpt", "moe", "under-1b", "1b-10b", "over-10b", "100b", "175b"}
    assert (get_preset("bert").max_norm, get_preset("gpt").max_norm, get_preset("moe").max_norm) == (1.0, 0.5, 2.0)
    sizes = [(get_preset(n).accumulation, get_preset(n).effective_batch) for n in ("under-1b", "1b-10b", "over-10b")]
    assert sizes == [(4, 512), (16, 2048), (32, 4096)]
    b175 = get_preset("175b")
    assert (b175.max_norm, b175.warmup, b175.decay, b175.precision) == (1.0, 0.05, 0.95, "16-mixed")
    assert (b175.init_scale, b175.accumulation, b175.fsdp, b175.num_nodes) == (32768.0, 32, True, 8)
    assert all(p.tensor_parallel == 1 for p in PRESETS.values())  # 175b: the source's FSDP-only recipe
    for preset in PRESETS.values():
        assert set(preset.sources) >= set(FIELDS), f"{preset.name}: no source for {set(FIELDS) - set(preset.sources)}"
    text = describe_preset("175b")
    assert len(text.splitlines()) == 1 + len(FIELDS)
    assert "init_scale                32768.0       a common 175B recipe: initial loss scale 32768 (2**15)" in text


def test_an_unknown_preset_lists_the_known_ones_and_suggests_the_closest() -> None:
    with pytest.raises(
        StabilityConfigError,
        match=r"`preset='gtp'` is not a preset\. Did you mean 'gpt'\? Known presets: tiny.*Fix: pass one of them",
    ):
        StableTrainer.from_preset("gtp")


def test_from_preset_is_a_trainer_with_the_recipes_callbacks_and_trains(tmp_path: Path) -> None:
    trainer = StableTrainer.from_preset("tiny", accelerator="cpu", max_steps=4, default_root_dir=tmp_path, **quiet())
    assert isinstance(trainer, pl.Trainer) and trainer.preset is not None
    kinds = [type(cb) for cb in trainer.callbacks if not type(cb).__module__.startswith("lightning.")]
    assert kinds == [GradientNormMonitor, WarmupConstantCosineLR, TrainingHealthMonitor, PrecursorMonitor]
    trainer.fit(TinyModule())
    assert trainer.global_step == 4
    assert (tmp_path / "stability_report.json").is_file()  # the preset's health report, in default_root_dir


def test_overrides_go_to_the_preset_or_the_trainer_and_callbacks_are_appended() -> None:
    monitor = LearningRateMonitor()
    trainer = StableTrainer.from_preset(
        "gpt", accelerator="cpu", max_norm=0.3, health="rollback", max_steps=2, callbacks=[monitor], **quiet()
    )
    norm = next(cb for cb in trainer.callbacks if isinstance(cb, GradientNormMonitor))
    health = next(cb for cb in trainer.callbacks if isinstance(cb, TrainingHealthMonitor))
    assert norm.max_norm == 0.3 and health.response == "rollback" and trainer.max_steps == 2
    ours = [cb for cb in trainer.callbacks if cb is norm or cb is monitor]
    assert ours == [norm, monitor]  # the user's after the preset's


def test_unknown_overrides_and_duplicate_callbacks_are_errors_that_say_what_to_do() -> None:
    with pytest.raises(StabilityConfigError, match=r"unknown override\(s\) \['max_nrom'\].*max_norm"):
        StableTrainer.from_preset("gpt", max_nrom=0.3)
    with pytest.raises(StabilityConfigError, match=r"already attaches a GradientNormMonitor.*max_norm=\.\.\."):
        StableTrainer.from_preset("gpt", callbacks=[GradientNormMonitor(max_norm=2.0)])
    with pytest.raises(StabilityConfigError, match=r"`max_norm=-1.0`"):
        StableTrainer.from_preset("gpt", max_norm=-1.0)


def test_175b_on_one_cpu_adapts_and_says_so_in_one_line(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    with caplog.at_level(logging.INFO):
        trainer = StableTrainer.from_preset(  # fp16 on a CPU without AMX-FP16 is asked for: the loss-scale path
            "175b",
            accelerator="cpu",
            devices=1,
            precision="16-mixed",
            max_steps=2,
            default_root_dir=tmp_path,
            **quiet(),
        )
    notes = [r.getMessage() for r in caplog.records if "StableTrainer preset" in r.getMessage()]
    assert len(notes) == 1
    assert "num_nodes 8 -> 1" in notes[0] and "FSDP off" in notes[0] and "fp16 on the CPU" in notes[0]
    kinds = {type(cb) for cb in trainer.callbacks}
    assert {GradientAccumulation, LossScaleTuner, TrainingHealthMonitor} <= kinds
    trainer.fit(TinyModule(n=512))  # 2 updates of 32 micro-batches each
    assert trainer.global_step == 2
    scaler = next(cb for cb in trainer.callbacks if isinstance(cb, LossScaleTuner)).scaler
    assert scaler is not None and scaler.get_scale() == 32768.0  # the recipe's initial scale, on a CPU


@pytest.mark.distributed
def test_175b_on_two_cpu_processes_shards_with_fsdp_and_trains(tmp_path: Path) -> None:
    rank0, rank1 = torchrun(Path(__file__).parent / "distributed" / "preset_script.py", 2, tmp_path)
    assert rank0["strategy"] == "StableFSDPStrategy" and rank0["global_step"] == 2
    assert rank0["weights"] == rank1["weights"]  # gathered full weights, identical on both ranks
    assert rank0["loss_scale"] == 32768.0
    # the preset's LR back-off runs on both ranks (AdamW), alike
    assert rank0["precursors"]["backoff_on"] and rank0["precursors"] == rank1["precursors"]


def test_preset_fields_are_checked_and_lightnings_short_precisions_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    # a CPU that runs bf16 fast: the recipe's bf16 holds on it, so that precision=None is seen not to replace it
    monkeypatch.setattr(_compat, "cpu_amx_dtypes", lambda: frozenset({torch.bfloat16, torch.float16}))
    with pytest.raises(StabilityConfigError, match=r"`precision='fp8'` is not a preset precision"):
        StableTrainer.from_preset("gpt", precision="fp8")
    with pytest.raises(StabilityConfigError, match=r"`accumulation=0` must be an int >= 1"):
        StableTrainer.from_preset("gpt", accumulation=0)
    trainer = StableTrainer.from_preset("gpt", accelerator="cpu", precision="16", **quiet())
    assert trainer.preset is not None and trainer.preset.precision == "16-mixed"
    assert any(isinstance(cb, LossScaleTuner) for cb in trainer.callbacks)
    # the constructor route (LightningCLI's) treats precision as the preset's too
    same = StableTrainer(preset="gpt", accelerator="cpu", precision="16-mixed", **quiet())  # type: ignore[arg-type]
    assert same.preset is not None and same.preset.precision == "16-mixed"
    assert type(same.precision_plugin).__name__ == "MixedPrecision" and same.precision_plugin.precision == "16-mixed"
    # LightningCLI passes every Trainer argument, precision=None (Lightning's default) included: the recipe's holds
    cli = StableTrainer(preset="gpt", accelerator="cpu", precision=None, **quiet())  # type: ignore[arg-type]
    assert cli.preset is not None and cli.preset.precision == get_preset("gpt").precision


def tensor_parallel_of(trainer: pl.Trainer) -> int | None:
    strategy = trainer.strategy
    return strategy._cfg.tensor_parallel if isinstance(strategy, StableFSDPStrategy) else None


@pytest.mark.parametrize(
    ("tensor_parallel", "devices", "expected", "note"),
    [
        (2, 1, None, "tensor parallelism off (one device; the recipe's tensor_parallel=2)"),
        (2, 2, 2, None),
        (8, 4, 4, "tensor_parallel 8 -> 4 (it must divide the 4 devices per node)"),
        (3, 2, 1, "tensor_parallel 3 -> 1: tensor parallelism off (it must divide the 2 devices per node)"),
        (1, 2, 1, None),
    ],
)
def test_tensor_parallel_adapts_to_the_devices_and_says_so(
    tensor_parallel: int, devices: int, expected: int | None, note: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        trainer = StableTrainer.from_preset(
            "175b", tensor_parallel=tensor_parallel, accelerator="cpu", devices=devices, **quiet()
        )
    assert tensor_parallel_of(trainer) == expected
    lines = [r.getMessage() for r in caplog.records if "StableTrainer preset" in r.getMessage()]
    if note is None:
        assert not any("tensor" in line for line in lines), lines
    else:
        assert len(lines) == 1 and note in lines[0], lines


def test_tensor_parallel_off_under_the_users_strategy_and_refused_without_fsdp(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO):
        StableTrainer.from_preset("175b", tensor_parallel=2, accelerator="cpu", devices=2, strategy="ddp", **quiet())
    assert any("tensor parallelism off (your strategy= replaces the preset's" in r.getMessage() for r in caplog.records)
    with pytest.raises(StabilityConfigError, match=r"`tensor_parallel=2` needs fsdp=True.*Fix: pass fsdp=True too"):
        StableTrainer.from_preset("gpt", tensor_parallel=2)
    with pytest.raises(StabilityConfigError, match=r"`tensor_parallel=0` must be an int >= 1"):
        StableTrainer.from_preset("175b", tensor_parallel=0)
    assert (
        "  tensor_parallel           1             1: a common 175B recipe shards with FSDP alone"
        in describe_preset("175b")
    )


def test_presets_set_the_watchdog_a_long_multi_process_run_wants_and_keep_the_users(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from datetime import timedelta

    from lightning_stability import StableFSDPStrategy

    for name in list(os.environ):
        if name.startswith(("TORCH_NCCL", "TORCH_FR", "NCCL_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # the user's choice
    single = StableTrainer.from_preset("175b", accelerator="cpu", devices=1, max_steps=1, logger=False)
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ and not isinstance(single.strategy, StableFSDPStrategy)
    with caplog.at_level(logging.INFO):
        trainer = StableTrainer.from_preset("175b", accelerator="cpu", devices=2, max_steps=1, logger=False)
    assert isinstance(trainer.strategy, StableFSDPStrategy)
    assert trainer.strategy._timeout == timedelta(minutes=10)  # torch's default is 30
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # kept
    assert "process-group watchdog: timeout 10 min" in caplog.text and "kept yours: TORCH_NCCL_ASYNC" in caplog.text


@pytest.mark.parametrize("name", [None, 3])
def test_from_preset_without_a_preset_is_an_error_naming_the_presets(name: object) -> None:
    # was: from_preset(None) returned a plain Trainer, without one stability callback
    said = rf"`name={name!r}` is not a preset: from_preset builds one of tiny, "
    with pytest.raises(StabilityConfigError, match=said):
        StableTrainer.from_preset(name, accelerator="cpu", **quiet())  # type: ignore[arg-type]
    with pytest.raises(StabilityConfigError, match=r"gpt, moe, under-1b.*Fix: .*or StableTrainer\(\.\.\.\)"):
        StableTrainer.from_preset(name)  # type: ignore[arg-type]
