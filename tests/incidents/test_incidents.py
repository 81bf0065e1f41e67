"""The incident log with real Trainers, files and signals: a night of faults in one directory (a NaN step skipped, a
crash, a damaged checkpoint passed over, the restart, a preemption), read back as one page by
``lightning-stability incidents DIR`` and in the stability report; and the log's own file format."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_stability import GradientNormMonitor, StableCheckpoint, TrainingHealthMonitor, cli
from lightning_stability.incidents import Incident, format_incidents, read_incidents
from lightning_stability.incidents.log import append, cut_short, log_dir, mark_fit
from tests.helpers import SendSignal, TinyModule, quiet_trainer


class Crash(pl.Callback):
    def __init__(self, at: int = 7) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            raise RuntimeError("the node went away")


def fit(root: Path, callbacks: list[pl.Callback], ckpt_path: str | None = None, max_steps: int = 12) -> pl.Trainer:
    pl.seed_everything(0)
    trainer = quiet_trainer(
        max_steps=max_steps,
        enable_checkpointing=True,
        default_root_dir=root,
        callbacks=[
            GradientNormMonitor(),
            TrainingHealthMonitor(response="skip", warmup_steps=3, report_dir=root),
            StableCheckpoint(dirpath=root / "ckpts", every_n_train_steps=2, keep=3),
            *callbacks,
        ],
    )
    trainer.fit(TinyModule(inf_at_step=4), ckpt_path=ckpt_path)
    return trainer


def test_a_night_of_faults_reads_as_one_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "ckpts"
    with pytest.raises(RuntimeError, match="the node went away"):
        fit(tmp_path, [Crash()])  # the NaN of step 4 skipped; saves at 2, 4, 6; crashes as step 7 starts
    newest = directory / "epoch=0-step=6.ckpt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10
    newest.write_bytes(bytes(data))  # damaged while the job was down
    resumed = fit(tmp_path, [SendSignal(signal.SIGTERM, 8)], ckpt_path="last")
    assert resumed.global_step < 12  # stopped at the signal

    found = read_incidents(directory)
    kinds = [i.kind for i in found]
    # the resumed run trains step 4 again, and skips its NaN again (read on the host at the end of the fit)
    assert kinds == ["skip", "damaged_checkpoint", "restart", "preemption", "skip"], format_incidents(found)
    skip, damaged, restart, preemption, again = found
    assert skip.step == again.step == 4 and "non-finite" in skip.detail and skip.lost == "this step's update"
    assert damaged.step == 6 and newest.name in damaged.detail and "is damaged" in damaged.detail
    assert restart.step == 4 and restart.action == "resumed from epoch=0-step=4.ckpt (step 4)"
    assert "ended without finishing" in restart.detail
    assert "SIGTERM" in preemption.action and "saved" in preemption.action and preemption.lost == ""
    assert all(i.rank == 0 and i.host for i in found)
    assert cut_short(directory) is None  # the stop at the signal is a clean end

    assert cli.main(["incidents", str(directory)]) == 0
    page = capsys.readouterr()
    assert page.out.startswith("5 incident(s): 1 restart, 1 preemption, 1 damaged_checkpoint, 2 skip")
    assert "resumed from epoch=0-step=4.ckpt (step 4); lost: the steps the previous run trained" in page.out

    report = json.loads((tmp_path / "stability_report.json").read_text())
    assert [i["kind"] for i in report["incidents"]] == kinds


def fit_saving_every_4(root: Path, callbacks: list[pl.Callback], ckpt_path: str | None = None) -> None:
    """10 steps, a NaN at step 2 skipped, a save every 4 steps, the health read every 5 (step 2's at step 4's end,
    after its save)."""
    pl.seed_everything(0)
    trainer = quiet_trainer(
        max_steps=10,
        log_every_n_steps=5,
        enable_checkpointing=True,
        default_root_dir=root,
        callbacks=[
            TrainingHealthMonitor(response="skip", warmup_steps=3, report=False),
            StableCheckpoint(dirpath=root / "ckpts", every_n_train_steps=4, keep=3),
            *callbacks,
        ],
    )
    trainer.fit(TinyModule(inf_at_step=2), ckpt_path=ckpt_path)


def test_a_resume_records_no_fault_of_before_its_checkpoint_again(tmp_path: Path) -> None:
    """The health monitor reads a step's outcome (and records its skip) at the next logging step. Killed after that
    step and resumed from a checkpoint saved before it, the run reads the restored outcome of a step it does not
    train again: the same fault, recorded once (seen in benchmarks/chaos.py: every skip of the first epoch twice)."""
    with pytest.raises(RuntimeError, match="the node went away"):
        fit_saving_every_4(tmp_path, [Crash()])  # saved at 4; step 2's skip recorded; crashes as step 7 starts
    assert [(i.kind, i.step) for i in read_incidents(tmp_path / "ckpts")] == [("skip", 2)]
    fit_saving_every_4(tmp_path, [], ckpt_path="last")  # resumed at step 4: step 2 is not trained again
    found = read_incidents(tmp_path / "ckpts")
    assert [(i.kind, i.step) for i in found] == [("skip", 2), ("restart", 4)], format_incidents(found)


def test_a_restart_with_no_checkpoint_to_resume_is_recorded(tmp_path: Path) -> None:
    """Killed before the first save, the job starts again from step 0: the death is in the log all the same (seen in
    benchmarks/chaos.py: a kill before step 10, or inside the first save, left no trace)."""
    with pytest.raises(RuntimeError, match="the node went away"):
        fit_saving_every_4(tmp_path, [Crash(at=3)])
    fit_saving_every_4(tmp_path, [], ckpt_path="last")
    restarts = [i for i in read_incidents(tmp_path / "ckpts") if i.kind == "restart"]
    assert len(restarts) == 1, format_incidents(read_incidents(tmp_path / "ckpts"))
    assert restarts[0].step == 0 and restarts[0].action == "started from step 0: no checkpoint resumed"
    assert restarts[0].lost == "every step the previous run trained" and "ended without finishing" in restarts[0].detail


def test_the_command_refuses_a_directory_without_a_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["incidents", str(tmp_path)])
    said = capsys.readouterr().err
    assert exited.value.code == 2 and "holds no incident log" in said and "Fix: pass the directory" in said


def test_each_rank_appends_to_its_own_file_and_a_line_cut_by_a_kill_is_left_out(tmp_path: Path) -> None:
    append(tmp_path, Incident("replay", 3, "transient: applied as replayed", rank=1, time=2.0))
    append(tmp_path, Incident("quarantine", 3, "samples 4, 9 quarantined", lost="2 samples", rank=0, time=1.0))
    with open(log_dir(tmp_path) / "rank-1.jsonl", "a") as f:
        f.write('{"kind": "skip", "step": 4, "act')  # killed mid-write
    assert sorted(p.name for p in log_dir(tmp_path).iterdir()) == ["rank-0.jsonl", "rank-1.jsonl"]
    found = read_incidents(tmp_path)
    assert [(i.kind, i.rank) for i in found] == [("quarantine", 0), ("replay", 1)]  # in time order
    page = format_incidents(found)
    assert "samples 4, 9 quarantined; lost: 2 samples" in page and "applied as replayed; nothing lost" in page
    assert format_incidents([]) == "No incidents: no fault was handled in this run."


def test_a_fit_that_never_ended_is_told_from_one_that_did(tmp_path: Path) -> None:
    assert cut_short(tmp_path) is None
    mark_fit(tmp_path, running=True, step=10)
    assert cut_short(tmp_path) == {"running": True, "step": 10, "time": pytest.approx(cut_short(tmp_path)["time"])}
    mark_fit(tmp_path, running=False, step=20)
    assert cut_short(tmp_path) is None
