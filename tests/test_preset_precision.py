"""A preset's precision on a CPU: bf16 or fp16 only where the CPU runs it faster than fp32 (AMX tiles), fp32
elsewhere, said in the preset's one info line; the user's precision kept whatever the CPU."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from lightning.pytorch.accelerators import MPSAccelerator
from lightning.pytorch.plugins import MixedPrecision

from lightning_stability import LossScaleTuner, StableFSDPStrategy, StableTrainer, _compat
from lightning_stability.presets import PRESETS, get_preset, layout
from lightning_stability.trainer import _cpu_fast

QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
BOTH = frozenset({torch.bfloat16, torch.float16})
NO_BF16 = "bf16-mixed -> 32-true (this CPU has no AMX-BF16: bf16 autocast runs slower than fp32 without it; " + (
    "precision='bf16-mixed' keeps bf16)"
)
NO_FP16 = "16-mixed -> 32-true (this CPU has no AMX-FP16: fp16 autocast runs slower than fp32 without it; " + (
    "precision='16-mixed' keeps fp16 with a loss scaler)"
)
BF16_KEPT = "bf16-mixed kept on this CPU (AMX-BF16: bf16 matmuls run faster than fp32)"
FP16_KEPT = "16-mixed kept on this CPU (AMX-FP16: fp16 matmuls run faster than fp32)"


def cpu_with(monkeypatch: pytest.MonkeyPatch, dtypes: frozenset[torch.dtype]) -> None:
    """This CPU as one whose AMX tiles multiply ``dtypes``."""
    monkeypatch.setattr(_compat, "cpu_amx_dtypes", lambda: dtypes)


def info_line(caplog: pytest.LogCaptureFixture, name: str, **kwargs: Any) -> tuple[StableTrainer, str]:
    """The preset's Trainer on one CPU, and its one info line ("" when it has none)."""
    caplog.clear()
    with caplog.at_level(logging.INFO):
        trainer = StableTrainer.from_preset(name, accelerator="cpu", devices=1, **QUIET, **kwargs)
    lines = [r.getMessage() for r in caplog.records if "StableTrainer preset" in r.getMessage()]
    assert len(lines) <= 1
    return trainer, lines[0] if lines else ""


def test_the_check_reads_torchs_capability_flags() -> None:
    flags = torch.cpu.get_capabilities()
    found = _compat.cpu_amx_dtypes()
    assert found <= BOTH
    assert (torch.bfloat16 in found) <= bool(flags.get("amx_bf16") and flags.get("amx_tile"))
    assert (torch.float16 in found) <= bool(flags.get("amx_fp16") and flags.get("amx_tile"))


def test_this_cpu_gets_what_its_check_says(caplog: pytest.LogCaptureFixture) -> None:
    found = _compat.cpu_amx_dtypes()
    gpt, line = info_line(caplog, "gpt")
    bf16 = torch.bfloat16 in found
    assert (gpt.precision, gpt.preset.precision) == (("bf16-mixed",) * 2 if bf16 else ("32-true",) * 2)
    assert (BF16_KEPT if bf16 else NO_BF16) in line
    b175, line = info_line(caplog, "175b")
    fp16 = torch.float16 in found
    assert b175.preset is not None and b175.preset.precision == ("16-mixed" if fp16 else "32-true")
    assert any(isinstance(cb, LossScaleTuner) for cb in b175.callbacks) == fp16
    assert (FP16_KEPT if fp16 else NO_FP16) in line


@pytest.mark.parametrize("fast", [False, True], ids=["no-amx", "amx"])
@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_on_a_cpu_with_and_without_amx(
    name: str, fast: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cpu_with(monkeypatch, BOTH if fast else frozenset())
    recipe = get_preset(name).precision
    trainer, line = info_line(caplog, name)
    expected = recipe if fast else "32-true"
    assert trainer.preset is not None and trainer.preset.precision == expected
    assert str(trainer.precision_plugin.precision) == expected
    assert any(isinstance(cb, LossScaleTuner) for cb in trainer.callbacks) == (expected == "16-mixed")
    notes = {("bf16-mixed", False): NO_BF16, ("bf16-mixed", True): BF16_KEPT}
    notes.update({("16-mixed", False): NO_FP16, ("16-mixed", True): FP16_KEPT})
    if recipe == "32-true":
        assert "32-true" not in line and "kept on this CPU" not in line
    else:
        assert notes[recipe, fast] in line


def test_one_format_fast_keeps_only_that_one(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cpu_with(monkeypatch, frozenset({torch.bfloat16}))  # AMX-BF16 without AMX-FP16 (Sapphire Rapids)
    gpt, line = info_line(caplog, "gpt")
    assert gpt.precision == "bf16-mixed" and BF16_KEPT in line
    b175, line = info_line(caplog, "175b")
    assert b175.precision == "32-true" and NO_FP16 in line


def test_the_users_precision_is_kept_whatever_the_cpu(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cpu_with(monkeypatch, frozenset())
    trainer, line = info_line(caplog, "gpt", precision="bf16-mixed")
    assert trainer.precision == "bf16-mixed" and "32-true" not in line and "kept on this CPU" not in line
    trainer, line = info_line(caplog, "gpt", precision="bf16")  # Lightning's short spelling
    assert trainer.precision == "bf16-mixed"
    trainer, line = info_line(caplog, "175b", precision="16-mixed")  # the loss-scale path, on any CPU
    assert trainer.precision == "16-mixed" and any(isinstance(cb, LossScaleTuner) for cb in trainer.callbacks)
    assert "fp16 on the CPU through an explicit loss-scaler plugin" in line and "-> 32-true" not in line
    plugin = MixedPrecision("bf16-mixed", "cpu")
    trainer, line = info_line(caplog, "gpt", plugins=[plugin])
    assert trainer.precision_plugin is plugin and "-> 32-true" not in line
    built = StableTrainer(preset="gpt", accelerator="cpu", precision="bf16-mixed", **QUIET)  # type: ignore[arg-type]
    assert built.precision == "bf16-mixed"
    cpu_with(monkeypatch, BOTH)
    trainer, line = info_line(caplog, "gpt", precision="32-true")
    assert trainer.precision == "32-true" and "kept on this CPU" not in line


def test_a_sharded_preset_on_cpus_shards_in_fp32_without_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_with(monkeypatch, frozenset())
    trainer = StableTrainer.from_preset("over-10b", accelerator="cpu", devices=2, **QUIET)
    assert isinstance(trainer.strategy, StableFSDPStrategy)
    assert trainer.strategy.precision_plugin.precision == "32-true"


def test_layout_leaves_a_gpu_and_other_accelerators_as_they_were() -> None:
    preset = get_preset("1b-10b")
    for kwargs in ({"gpu": True}, {"gpu": False}, {"gpu": False, "cpu_fast": None}):
        plan = layout(preset, world_size=1, devices_per_node=1, **kwargs)  # type: ignore[arg-type]
        assert plan.precision == "bf16-mixed" and not any("CPU" in n for n in plan.notes)
    plan = layout(preset, world_size=1, devices_per_node=1, gpu=False, cpu_fast=())
    assert plan.precision == "32-true" and NO_BF16 in plan.notes
    plan = layout(get_preset("tiny"), world_size=1, devices_per_node=1, gpu=False, cpu_fast=())
    assert plan.precision == "32-true" and not plan.notes


def test_auto_on_a_machine_with_mps_is_not_a_cpu_run(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu_with(monkeypatch, frozenset())
    assert _cpu_fast("cpu") == frozenset() and _cpu_fast("mps") is None
    monkeypatch.setattr(MPSAccelerator, "is_available", staticmethod(lambda: True))
    assert _cpu_fast("auto") is None
    cpu_with(monkeypatch, BOTH)
    assert _cpu_fast("cpu") == {"bf16-mixed", "16-mixed"}


def test_the_benchmark_runs_and_names_the_precision_each_arm_ran(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import preset_precision

    preset_precision.main(["--steps", "1", "--warmup", "0", "--repeats", "1", "--configs", "gpt", "gpt bf16"])
    table = capsys.readouterr().out.splitlines()[-3:]  # config (12 wide), precision (11 wide), figures
    rows = {line[:12].strip(): line[13:24].strip() for line in table}
    gpt = "bf16-mixed" if torch.bfloat16 in _compat.cpu_amx_dtypes() else "32-true"
    assert rows == {"plain fp32": "32-true", "gpt": gpt, "gpt bf16": "bf16-mixed"}
