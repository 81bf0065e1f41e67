"""The command line, run in-process as a user would run it."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_stability.cli import main
from lightning_stability.demo.model import load_corpus
from lightning_stability.demo.run import judge
from lightning_stability.health.report import figure_class
from tests.helpers import REPO


def test_demo_shows_the_bare_run_fail_where_the_preset_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    # 80 steps: long enough that the preset's run clears the stall bound with a margin (40 did not always)
    assert main(["demo", "--steps", "80", "--out", str(out), "--no-progress-bar"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^bare +diverged +49 +nan +- ", text, re.M), text  # NaN at step 48 -> NaN weights
    assert re.search(r"^tiny +trained +- +\d\.\d+ +\d+ ", text, re.M), text
    # one thread: a second spins against other work on a busy machine (benchmarks/demo_load.py)
    assert "1 CPU thread(s) per process" in text
    assert "OK: the plain Trainer diverged" in text and "Checked: a run diverged if" in text
    assert (out / "bare" / "metrics.csv").is_file() and (out / "tiny" / "metrics.csv").is_file()
    report = json.loads((out / "tiny" / "stability_report.json").read_text())
    assert report["summary"]["skipped_steps"]["nonfinite_grad"] == 1
    if figure_class() is not None:
        assert (out / "comparison.png").stat().st_size > 10_000 and f"{out / 'comparison.png'}" in text


def test_demo_prints_the_same_figures_whatever_thread_count_it_starts_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The demo twice, started on 1 thread then on 2 (as OMP_NUM_THREADS=1 or another core count would): the
    # float sums split among the threads differ in their last bits, which this fragile run grows into other
    # figures unless the demo fixes its own threads (demo.run.repeatable)
    import torch

    before = torch.get_num_threads()
    tables, logged = [], []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = tmp_path / f"threads{threads}"
            main(["demo", "--steps", "40", "--out", str(out), "--no-progress-bar"])
            assert torch.get_num_threads() == threads  # restored after the runs
            text = capsys.readouterr().out
            tables.append(re.findall(r"^(bare|tiny) +(\w+) +(\S+) +(\S+) +(\S+) ", text, re.M))
            # every logged column but the process's peak memory (an RSS reading, not a training figure)
            with (out / "bare" / "metrics.csv").open() as bare, (out / "tiny" / "metrics.csv").open() as tiny:
                rows = [row for f in (bare, tiny) for row in csv.DictReader(f)]
            logged.append([{k: v for k, v in row.items() if "memory" not in k} for row in rows])
    finally:
        torch.set_num_threads(before)
    assert len(tables[0]) == 2, tables  # result, at step, final loss, skipped of each run
    assert tables[0] == tables[1]
    assert logged[0] == logged[1]  # each run's logged losses, gradient norms, skips, to the last digit


def test_the_demos_judge() -> None:
    corpus = load_corpus()
    assert judge([4.0, 3.0, float("nan"), 3.0], corpus).status == "diverged"
    assert judge([4.0, 3.0, corpus.uniform_loss + 1.5], corpus).step == 2
    stalled = judge([4.0] + [corpus.unigram_loss] * 19, corpus)
    assert stalled.status == "stalled" and "no better than letter frequencies" in stalled.detail
    assert judge([4.0] + [corpus.unigram_loss - 0.5] * 19, corpus).status == "trained"
    assert 3.0 < corpus.unigram_loss < corpus.uniform_loss


def test_demo_argument_errors_say_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--steps", "60", "--nan-at-step", "100"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--nan-at-step: 100 is outside the run (steps 0..59)" in err and "Fix:" in err
    with pytest.raises(SystemExit):
        main(["demo", "--steps", "0"])
    assert "must be an integer >= 1, got 0" in capsys.readouterr().err


def test_help_and_the_pure_commands_do_not_import_torch() -> None:
    code = (
        "import sys, contextlib, io\n"
        "from lightning_stability.cli import main\n"
        "for argv in (['--help'], ['demo', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "    assert '--preset' in out.getvalue() or 'demo' in out.getvalue()\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['presets', 'gpt']) == 0\n"
        "    main(['plan', '--params', '7e9'])\n"
        "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.distributed  # training in two processes
def test_demo_on_two_cpu_processes(tmp_path: Path) -> None:
    args = ["demo", "--devices", "2", "--steps", "40", "--out", str(tmp_path), "--no-progress-bar"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "lightning_stability.cli", *args],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("run        result") == 1  # one table: only rank 0 prints
    assert re.search(r"^bare +diverged +25 ", done.stdout, re.M) and re.search(r"^tiny +trained ", done.stdout, re.M)
    assert (tmp_path / "tiny" / "stability_report.json").is_file()


def test_unknown_command_exits_with_usage() -> None:
    with pytest.raises(SystemExit):
        main(["bogus"])


def test_presets_lists_them_and_describes_one(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_stability.cli import main

    assert main(["presets"]) == 0
    listing = capsys.readouterr().out
    assert "175b      a common recipe for 175B-scale models" in listing and "gpt       GPT-like decoders" in listing
    assert main(["presets", "175b"]) == 0
    assert "accumulation              32            a common 175B recipe: accumulation 32" in capsys.readouterr().out
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


def test_plan_175b_from_a_parameter_count_alone_takes_gpt3s_shape_and_fits(capsys: pytest.CaptureFixture[str]) -> None:
    # was: ~979 GiB of "buffers" (the whole model as one FSDP unit) and DOES NOT FIT
    args = ["plan", "--preset", "175b", "--params", "175e9", "--nodes", "8", "--gpus-per-node", "8"]
    assert main([*args, "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "(shape: GPT-3 175B assumed)" in out and "note: shape not given: GPT-3 175B's assumed" in out
    assert re.search(r"^buffers +11\.13  3 x 2B x unit of 1\.81e\+09 params", out, re.M), out
    assert re.search(r"^total +59\.\d\d  fits in 72\.00 GiB", out, re.M), out
    assert "tensor parallel: not needed: TP 1 fits" in out and "DOES NOT FIT" not in out


def test_plan_prints_the_tensor_parallel_advice(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--params", "175e9", "--layers", "96", "--hidden", "12288", "--heads", "96", "--vocab", "51200"]
    args += ["--nodes", "8", "--gpus-per-node", "8", "--sequence-parallel", "--flash-attention", "--sharding", "full"]
    assert main(args) == 1  # TP 1 does not fit without activation checkpointing
    out = capsys.readouterr().out
    assert "tensor parallel: needed: TP 4 is the smallest size that fits" in out  # 129, 85, 64, 53 GiB in 72
    assert "pass --tensor-parallel 4" in out
    assert main([*args, "--tensor-parallel", "4"]) == 0
    out = capsys.readouterr().out
    assert "TP 4 + sequence parallel x PP 1 x DP 16" in out and "L*s*b*h*(16e+2)/4 + L*4*a*s*b/4" in out
    assert main([*args, "--tp", "8", "--pp", "4"]) == 0
    out = capsys.readouterr().out
    assert "TP 8 + sequence parallel x PP 4 x DP 2" in out and "planned on paper only" in out
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--tensor-parallel", "3"])
    assert exit_info.value.code == 2
    assert "`tensor_parallel=3` does not divide gpus_per_node=8" in capsys.readouterr().err


def test_plan_without_a_shape_says_what_it_did_not_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["plan", "--params", "70e9", "--gpus-per-node", "8", "--gpu-memory", "80GiB", "--sharding", "full"]) == 1
    )
    out = capsys.readouterr().out
    assert "not counted: activations, FSDP gather buffers (the model's shape is unknown)" in out
    assert "buffers                      1.00" in out  # the overhead alone: no guessed unit


def test_a_gpu_memory_without_a_unit_is_gib_and_says_so_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    # was: 80 bytes, "DOES NOT FIT in 0.00 GiB"
    args = ["plan", "--params", "7e9", "--gpus-per-node", "8", "--sharding", "full"]
    assert main([*args, "--gpu-memory", "80"]) == 0
    bare = capsys.readouterr().out
    assert re.search(r"^total +\d+\.\d\d  fits in 72\.00 GiB usable of 80\.00 GiB", bare, re.M), bare
    assert main([*args, "--gpu-memory", "80GiB"]) == 0
    assert capsys.readouterr().out == bare
    assert main([*args]) == 0  # the default: 80 GiB
    assert capsys.readouterr().out == bare
    assert main([*args, "--gpu-memory", "40GB"]) == 1  # a unit given is kept: 37.25 GiB
    assert "of 37.25 GiB" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "a bare number is GiB" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("argument", "value", "said"),
    [
        ("--gpu-memory", "80G", "'80G' is not a memory size. Fix: a number of GiB (--gpu-memory 80)"),
        ("--gpu-memory", "eighty", "'eighty' is not a memory size. Fix:"),
        ("--gpu-memory", "0", "'0' is no memory. Fix:"),
        ("--gpu-memory", "-5", "'-5' is not a memory size. Fix:"),
        ("--params", "7", "7 is 7 parameters, below the 1e+06 this planner plans (a slip for billions?). Fix:"),
        ("--params", "7X", "'7X' is not a parameter count. Fix: e.g. --params 7e9 or --params 7B"),
        ("--micro-batch", "0", "must be an integer >= 1, got 0"),
        ("--effective-batch", "0", "must be an integer >= 1, got 0"),
        ("--seq-len", "2k", "must be an integer >= 1, got 2k"),
        ("--gpus-per-node", "-1", "must be an integer >= 1, got -1"),
    ],
)
def test_a_bad_size_is_refused_naming_the_argument_the_value_and_the_fix(
    argument: str, value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--params", "7e9", argument, value])
    assert exit_info.value.code == 2
    assert f"argument {argument}: {said}" in capsys.readouterr().err


def test_params_takes_a_suffix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--params", "7e9"]) == main(["plan", "--params", "7B"])
    counted, suffixed = capsys.readouterr().out.split("no preset:")[1:]
    assert counted == suffixed and "Memory plan per GPU: 7B params" in counted
    main(["plan", "--params", "350M"])
    assert "Memory plan per GPU: 0.35B params (shape: GPT-3 Medium assumed)" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["plan", "--params", "7e9"], ["presets"], ["presets", "175b"]])
def test_a_reader_that_goes_away_ends_the_command_quietly(argv: list[str]) -> None:
    """`lightning-stability plan | head`: the pipe's reader is gone before the command writes (its read end is
    closed before the command starts): no traceback, the exit status of a tool that SIGPIPE stopped."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "lightning_stability.cli", *argv],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            cwd=REPO,
        )
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


def test_plan_without_a_preset_plans_a_plain_trainer_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    # was: full sharding assumed without a word ("46 GiB, fits" for 7B on 8 GPUs, where a plain Trainer needs 134)
    args = ["plan", "--params", "7e9", "--gpus-per-node", "8"]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert out.startswith("no preset: precision bf16-mixed, sharding none (one replica per GPU, as a plain Trainer")
    assert "sharding=none (no sharding (DDP))" in out and re.search(r"^total +134\.23  DOES NOT FIT", out, re.M)
    assert "sharding: needed: plain full sharding fits (46.07 GiB of 72.00 usable; unsharded 134.23)" in out
    # the same plan as a preset that does not shard ("gpt": bf16, one replica per GPU) on those GPUs
    assert main(["plan", "--preset", "gpt", "--params", "7e9", "--gpus-per-node", "8"]) == 1
    assert capsys.readouterr().out.split("\n", 1)[1] == out.split("\n", 1)[1]
    assert main([*args, "--sharding", "full"]) == 0
    assert "sharding full (--sharding)" in capsys.readouterr().out
    # tensor parallelism runs inside StableFSDPStrategy: with it, full sharding is what runs
    assert main([*args, "--tensor-parallel", "2"]) == 0
    out = capsys.readouterr().out
    assert "sharding full (StableFSDPStrategy, which tensor parallelism runs in)" in out and "sharding=full" in out
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "without --preset none, one replica per GPU" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("kind", ["missing", "file", "empty"])
def test_verify_refuses_a_bad_directory_naming_it_and_the_fix(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "ckpts"
    if kind == "file":
        target.write_bytes(b"x")
    elif kind == "empty":
        target.mkdir()
    with pytest.raises(SystemExit) as info:
        main(["verify", str(target)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(f"lightning-stability verify: {target} ")
    assert {"missing": "does not exist", "file": "is a file", "empty": "holds no checkpoint"}[kind] in err
    assert "Fix: pass the directory the checkpoints are saved in" in err
