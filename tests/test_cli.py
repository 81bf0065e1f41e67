"""The command line, run in-process as a user would run it."""

from __future__ import annotations

import pytest

from lightning_stability.cli import main
from lightning_stability.demo import run_demo


def test_demo_command_reports_a_skipped_step_and_a_falling_loss(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "30", "--nan-at-step", "10"]) == 0
    out = capsys.readouterr().out
    assert "applied / skipped (NaN) 29 / 1" in out
    assert "weights finite          True" in out
    assert "demo OK" in out


def test_demo_lr_holds_still_on_the_skipped_step() -> None:
    # the NaN step falls inside the warmup (3 of 30 updates), where every applied update raises the LR
    result = run_demo(steps=30, nan_at_step=1)
    assert result.applied == 29 and result.skipped_nonfinite == 1
    assert result.lrs[2] == result.lrs[1]  # the update after the skipped one reuses its LR
    assert result.lrs[1] > result.lrs[0] and result.lrs[3] > result.lrs[2]


def test_unknown_command_exits_with_usage() -> None:
    with pytest.raises(SystemExit):
        main(["bogus"])


def test_presets_lists_them_and_describes_one(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_stability.cli import main

    assert main(["presets"]) == 0
    listing = capsys.readouterr().out
    assert "175b      the seed's 175B recipe" in listing and "gpt       GPT-like decoders" in listing
    assert main(["presets", "175b"]) == 0
    assert "accumulation              32            seed row 24 (accumulation 32)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["presets", "gtp"])
    assert exit_info.value.code == 2
    assert "Did you mean 'gpt'?" in capsys.readouterr().err


def test_plan_175b_on_8_nodes_of_8_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_stability.cli import main

    args = ["plan", "--preset", "175b", "--params", "175e9", "--layers", "96", "--hidden", "12288"]
    args += ["--heads", "96", "--vocab", "51200", "--gpus-per-node", "8", "--gpu-memory", "80GiB"]
    assert main(args) == 0  # exit code 0: it fits
    out = capsys.readouterr().out
    assert "preset 175b: precision 16-mixed, sharding full, activation checkpointing True" in out
    assert "on 8 x 8 = 64 GPUs" in out  # the preset's 8 nodes
    # 16 bytes per parameter (ZeRO, mixed-precision Adam) over 64 GPUs
    assert "optimizer                   30.56  12P/64" in out and "params                       5.09  2P/64" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--params", "7e9", "--sharding", "zero9"])
    assert exit_info.value.code == 2 and "`sharding='zero9'` is not supported" in capsys.readouterr().err
