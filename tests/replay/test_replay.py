"""StepReplay with real Trainers on one process: a bit flip is a transient fault (the run ends bit-exact with a
fault-free run), a poisoned sample is the data (quarantined, never trained on again), repeated faults stop the
run naming the device, a fault in the replay itself, nondeterminism."""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_stability import (
    GradientNormMonitor,
    LRBackoff,
    PrecursorMonitor,
    StableCheckpoint,
    StableTrainer,
    TrainingHealthMonitor,
    cli,
    read_incidents,
)
from lightning_stability.errors import StabilityConfigError
from lightning_stability.ledger import Outcome, Stage, StepLedger
from lightning_stability.replay import BitFlip, FailingDeviceError, PoisonedSamples, StepReplay, read_quarantine
from tests.helpers import TinyModule, count_syncs_per_step, make_data, quiet_trainer

ROOT = Path(__file__).resolve().parents[2]


class IndexedData(Dataset):  # type: ignore[type-arg]
    """A regression dataset whose samples carry their own index (to see what the run trained on)."""

    def __init__(self, n: int = 96) -> None:
        self.data = make_data(n)
        self.loaded: list[int] = []  # every index loaded, in order

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        x, y = self.data[i]
        self.loaded.append(int(i))
        return x, y, torch.tensor(i)


class Model(TinyModule):
    """TinyModule with dropout (the replay must restore the RNG) that logs from its training step."""

    def __init__(self, data: Dataset, batch_size: int = 8, shuffle: bool = True, norm: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        middle = nn.BatchNorm1d(16) if norm else nn.Dropout(0.1)  # running statistics: buffers the forward changes
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), middle, nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.data, self.bs, self.shuffle = data, batch_size, shuffle

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.bs, shuffle=self.shuffle)


def _fit(
    tmp_path: Path,
    data: Dataset | None = None,
    faults: dict[str, Any] | None = None,
    norm: bool = False,
    **trainer: Any,
) -> Any:
    torch.manual_seed(0)
    model = Model(data if data is not None else IndexedData(), norm=norm)
    flip = BitFlip(model, "net.5", **faults) if faults else None
    replay = StepReplay(quarantine_file=tmp_path / "quarantine.json")
    monitor = TrainingHealthMonitor(response="skip", warmup_steps=5, report=False)
    t = quiet_trainer(callbacks=[monitor, replay], default_root_dir=tmp_path, **{"max_epochs": 2, **trainer})
    t.fit(model)
    return model, replay, StepLedger.of(t), flip, t


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "setting",
    [{}, {"norm": True}, {"accumulate_grad_batches": 3, "max_epochs": 6}],
    ids=["dropout", "batchnorm", "accumulation"],
)
def test_a_bit_flip_is_a_transient_fault_and_the_run_ends_bit_exact(tmp_path: Path, setting: dict[str, Any]) -> None:
    clean, _, _, _, _ = _fit(tmp_path / "clean", **setting)
    model, replay, ledger, flip, _ = _fit(tmp_path / "flip", faults={"step": 15, "rank": 0}, **setting)
    assert flip.flipped == [(15, 0)]
    events = [e for e in ledger.events if e.get("kind") == "replay"]
    assert [e["cause"] for e in events] == ["transient"] and events[0]["ranks"] == [0]
    assert replay.counts["faults"] == 1 and not replay.quarantine.indices
    for a, b in zip([*clean.parameters(), *clean.buffers()], [*model.parameters(), *model.buffers()], strict=True):
        assert torch.equal(a, b)
    (incident,) = read_incidents(tmp_path / "flip")  # the incident log (no checkpoints: the root directory)
    assert incident.kind == "replay" and incident.step == events[0]["step"] and incident.lost == ""
    assert incident.action.endswith(": transient; applied") and "rank 0" in incident.detail


def test_with_accumulation_only_the_bad_micro_batch_is_dropped_and_quarantined(tmp_path: Path) -> None:
    """The poisoned micro-batch is told apart: its samples alone are quarantined, and the step is applied as the
    mean of the other two micro-batches, exactly what those two alone give."""
    data = PoisonedSamples(IndexedData(), [17])
    _, replay, ledger, _, _ = _fit(tmp_path, data, accumulate_grad_batches=3, max_epochs=3)
    (event,) = [e for e in ledger.events if e.get("kind") == "replay"]
    assert event["cause"] == "data" and len(replay.quarantine.indices) == 8 and 17 in replay.quarantine.indices
    (entry,) = replay.quarantine.entries
    assert entry["cause"] == "non-finite or spiking loss"
    (dropped,) = event["dropped_micro_batches"]
    assert dropped[0] == 0 and event["detail"].startswith("the data: the step reproduces its flag")
    assert "; applied without its bad micro-batch" in event["detail"]
    counts = ledger.record_of().counts.tolist()
    assert counts[Outcome.APPLIED] == ledger.record_of().steps  # nothing skipped


def test_a_poisoned_sample_is_quarantined_and_never_trained_on_again(tmp_path: Path) -> None:
    inner = IndexedData()
    data = PoisonedSamples(inner, [17])
    _model, replay, ledger, _, _ = _fit(tmp_path, data)
    events = [e for e in ledger.events if e.get("kind") == "replay"]
    assert [e["cause"] for e in events] == ["data"]
    quarantined = replay.quarantine.indices
    assert 17 in quarantined and len(quarantined) == 8  # the batch's samples
    assert data.served == [17]  # served once (the bad step), never again: not in epoch 2
    assert all(inner.loaded.count(i) == 1 for i in quarantined)  # the other samples of the batch neither
    assert sorted(set(inner.loaded) - quarantined) == sorted(set(range(96)) - quarantined)
    assert all(inner.loaded.count(i) == 2 for i in set(range(96)) - quarantined)  # every other one, each epoch
    manifest = read_quarantine(tmp_path / "quarantine.json")
    assert manifest[0]["indices"] and 17 in manifest[0]["indices"]
    replayed, quarantine = read_incidents(tmp_path)
    assert replayed.kind == "replay" and replayed.action.endswith(": data; skipped")
    assert replayed.lost == "this step's update"
    assert quarantine.kind == "quarantine" and quarantine.action == "8 sample(s) quarantined"
    assert json.loads((tmp_path / "quarantine.json").read_text())["indices"] == sorted(replay.quarantine.indices)


class Trained(pl.Callback):
    """Each batch's sample indices, its step's outcome, and whether the weights or buffers moved (put it last)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int, list[int], int, bool]] = []  # (epoch, batch_idx, indices, outcome, moved)
        self._before: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        self._before = [t.detach().clone() for t in (*pl_module.parameters(), *pl_module.buffers())]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        after = [*pl_module.parameters(), *pl_module.buffers()]
        moved = not all(torch.equal(a, b) for a, b in zip(self._before, after, strict=True))
        outcome = int(StepLedger.of(trainer).outcome)
        self.rows.append((trainer.current_epoch, batch_idx, batch[2].tolist(), outcome, moved))


def test_a_batch_whose_samples_are_all_quarantined_is_skipped_and_nothing_is_trained_twice(tmp_path: Path) -> None:
    """In order (shuffle=False), the batch of poisoned sample 17 (samples 16 to 23) is quarantined in the first
    epoch; in the next two, its position has no sample left. The step there is skipped: no update, its BatchNorm
    statistics put back, counted as SKIPPED_QUARANTINED. Every other sample is trained on once an epoch; the
    quarantined ones are never loaded again."""
    torch.manual_seed(0)
    inner = IndexedData()
    model = Model(PoisonedSamples(inner, [17]), shuffle=False, norm=True)
    replay = StepReplay(quarantine_file=None)
    seen = Trained()
    callbacks = [TrainingHealthMonitor(response="skip", warmup_steps=5, report=False), replay, seen]
    trainer = quiet_trainer(callbacks=callbacks, max_epochs=3)
    trainer.fit(model)
    bad = set(range(16, 24))
    assert replay.quarantine.indices == bad and replay.counts["quarantined_batches"] == 2
    for epoch in (1, 2):
        rows = [r for r in seen.rows if r[0] == epoch]
        assert [r[1] for r in rows] == list(range(12))  # the epoch keeps its 12 positions
        (skipped,) = [r for r in rows if r[3] != Outcome.APPLIED]
        assert skipped[1] == 2 and skipped[3] == Outcome.SKIPPED_QUARANTINED and not skipped[4]
        trained = [i for r in rows if r[3] == Outcome.APPLIED for i in r[2]]
        assert sorted(trained) == sorted(set(range(96)) - bad)  # each once
    assert StepLedger.of(trainer).record_of().counts.tolist()[Outcome.SKIPPED_QUARANTINED] == 2
    assert not bad & set(inner.loaded[96:])  # never loaded after the first epoch


def test_a_resume_right_before_a_batch_with_no_sample_left_ends_bit_exact(tmp_path: Path) -> None:
    """Stopped after the step before that batch's position in the second epoch and resumed with
    ckpt_path="last": the resumed run starts on the position with no sample left, skips it as the straight run
    does, and ends bit-exact with it."""

    def run(directory: Path, steps: int, ckpt_path: str | None = None) -> Model:
        torch.manual_seed(0)
        model = Model(PoisonedSamples(IndexedData(), [17]), shuffle=False, norm=True)
        callbacks = [
            TrainingHealthMonitor(response="skip", warmup_steps=5, report=False),
            StepReplay(quarantine_file=None),
            StableCheckpoint(dirpath=directory, every_n_train_steps=7, keep=3),
        ]
        trainer = quiet_trainer(callbacks=callbacks, max_steps=steps, enable_checkpointing=True)
        trainer.fit(model, ckpt_path=ckpt_path)
        return model

    straight = run(tmp_path / "straight", 36)
    run(tmp_path / "cut", 14)  # 12 steps of the first epoch, 2 of the second: saved at step 14
    resumed = run(tmp_path / "cut", 36, ckpt_path="last")
    ours, theirs = [*straight.parameters(), *straight.buffers()], [*resumed.parameters(), *resumed.buffers()]
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_a_fault_in_the_replay_itself_leaves_the_data_to_blame(tmp_path: Path) -> None:
    """A poisoned sample spikes the loss; the first replay is hit by a bit flip too: a second replay agrees with the
    original, so the data is blamed and the replay's fault is counted against the rank."""
    _, first, ledger, _, _ = _fit(tmp_path / "a", PoisonedSamples(IndexedData(), [17], value=30.0))
    (event,) = [e for e in ledger.events if e.get("kind") == "replay"]
    assert event["cause"] == "data" and event["runs"] == 2
    _, replay, ledger, flip, _ = _fit(
        tmp_path / "b", PoisonedSamples(IndexedData(), [17], value=30.0), faults={"step": event["step"], "runs": (1,)}
    )
    assert flip.flipped == [(event["step"], 1)]
    (again,) = [e for e in ledger.events if e.get("kind") == "replay"]
    assert again["cause"] == "data" and again["runs"] == 3 and again["replay_faults"] == [0]
    assert replay.quarantine.indices == first.quarantine.indices


def test_no_two_runs_agree_is_nondeterminism_and_the_step_is_skipped(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Model(IndexedData())
    flips = [BitFlip(model, "net.5", step=15, runs=(run,), element=run) for run in (0, 1)]
    monitor = TrainingHealthMonitor(response="skip", warmup_steps=5, report=False)
    trainer = quiet_trainer(callbacks=[monitor, StepReplay(quarantine_file=None)], max_steps=20)
    trainer.fit(model)
    assert [f.flipped for f in flips] == [[(15, 0)], [(15, 1)]]
    (event,) = [e for e in StepLedger.of(trainer).events if e.get("kind") == "replay"]
    assert event["cause"] == "nondeterministic" and event["runs"] == 3
    assert "one process: a device that fails differently each time looks like nondeterminism" in event["detail"]
    counts = StepLedger.of(trainer).record_of().counts.tolist()
    assert counts[Outcome.SKIPPED_SPIKE] + counts[Outcome.SKIPPED_NONFINITE] == 1


def test_on_one_process_a_device_that_fails_the_same_way_every_time_is_taken_for_the_data(tmp_path: Path) -> None:
    """One process has no other device to run the step on: a bit flipped the same way in every run of step 15 is
    the data's (quarantined, skipped), as before StepReplay could run a step on another rank, and the verdict says
    what one process cannot tell apart."""
    _, replay, ledger, flip, _ = _fit(tmp_path, faults={"step": 15, "rank": 0, "runs": (0, 1, 2)})
    assert flip.flipped == [(15, 0), (15, 1)]  # the original and the replay: they agree, bit for bit
    (event,) = [e for e in ledger.events if e.get("kind") == "replay"]
    assert event["cause"] == "data" and event["runs"] == 2 and event["quarantined"] == 8
    assert "elsewhere" not in event and len(replay.quarantine.indices) == 8 and replay.counts["devices"] == 0
    assert "one process: a device that fails the same way every time looks like bad data" in event["detail"]


class NumpyNoise(Model):
    """Draws a noise scale from NumPy and Python's random in its training step (torch's generators do not see it)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        scale = float(np.random.rand()) * random.random()
        return nn.functional.mse_loss(self(x + 0.01 * scale), y)


@pytest.mark.parametrize("rng_states", ["torch", "all"])
def test_numpy_and_python_draws_are_replayed_with_rng_states_all(tmp_path: Path, rng_states: str) -> None:
    """A bit flip in a step that draws from NumPy and Python: with rng_states="torch" its replays disagree, so the
    step is nondeterministic and skipped; with "all" it is a transient fault and the run ends bit-exact."""

    def run(flip: bool) -> tuple[Model, pl.Trainer]:
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        model = NumpyNoise(IndexedData())
        if flip:
            BitFlip(model, "net.5", step=15)
        monitor = TrainingHealthMonitor(response="skip", warmup_steps=5, report=False)
        replay = StepReplay(quarantine_file=None, rng_states=rng_states)
        trainer = quiet_trainer(callbacks=[monitor, replay], max_steps=20)
        trainer.fit(model)
        return model, trainer

    clean, _ = run(False)
    faulty, trainer = run(True)
    (event,) = [e for e in StepLedger.of(trainer).events if e.get("kind") == "replay"]
    if rng_states == "torch":
        assert event["cause"] == "nondeterministic" and "rng_states='all'" in event["detail"]
    else:
        assert event["cause"] == "transient"
        for a, b in zip(_weights(clean), _weights(faulty), strict=True):
            assert torch.equal(a, b)


def test_a_bit_flip_in_a_compiled_module_is_a_transient_fault_and_the_run_ends_bit_exact() -> None:
    """torch.compile'd after BitFlip is added: the flip happens (its hook runs outside the graph), the step is a
    transient fault, applied as replayed, and the run ends bit-exact with the same compiled run without a flip."""

    def run(flip: bool) -> tuple[Model, pl.Trainer, BitFlip | None]:
        torch.compiler.reset()  # a graph compiled earlier in the process does not see hooks added since
        torch.manual_seed(0)
        model = Model(IndexedData())
        fault = BitFlip(model, "net.5", step=15) if flip else None
        model.net = torch.compile(model.net, backend="aot_eager")
        monitor = TrainingHealthMonitor(response="skip", warmup_steps=5, report=False)
        trainer = quiet_trainer(callbacks=[monitor, StepReplay(quarantine_file=None)], max_steps=20)
        trainer.fit(model)
        return model, trainer, fault

    clean, _, _ = run(False)
    faulty, trainer, fault = run(True)
    assert fault is not None and fault.flipped == [(15, 0)]
    (event,) = [e for e in StepLedger.of(trainer).events if e.get("kind") == "replay"]
    assert event["cause"] == "transient" and event["step"] == 15
    for a, b in zip(_weights(clean), _weights(faulty), strict=True):
        assert torch.equal(a, b)


def test_three_faults_on_one_rank_stop_the_run_naming_it_and_it_resumes_elsewhere(tmp_path: Path) -> None:
    """The third fault within the window: the state after that (replayed, healthy) step is saved, the run stops
    naming the rank and its host; a new run resumes from it with ckpt_path="last" and ends bit-exact with a run
    that never faulted."""
    clean, _, _, _, _ = _fit(tmp_path / "clean", max_epochs=None, max_steps=30)

    def run(directory: Path, faults: dict[str, Any] | None, ckpt_path: str | None = None) -> Model:
        torch.manual_seed(0)
        model = Model(IndexedData())
        if faults:
            BitFlip(model, "net.5", **faults)
        callbacks = [
            TrainingHealthMonitor(response="skip", warmup_steps=5, report=False),
            StepReplay(quarantine_file=None),
            StableCheckpoint(dirpath=directory, every_n_train_steps=5, keep=3),
        ]
        quiet_trainer(callbacks=callbacks, max_steps=30, enable_checkpointing=True).fit(model, ckpt_path=ckpt_path)
        return model

    with pytest.raises(FailingDeviceError, match=r"rank 0 on .* at steps \[12, 14, 16\]") as err:
        run(tmp_path / "ckpts", {"step": [12, 14, 16], "rank": 0})
    assert err.value.rank == 0 and err.value.steps == [12, 14, 16] and err.value.checkpoint is not None
    assert "step=17" in err.value.checkpoint  # the state after the third fault's step, applied as replayed
    resumed = run(tmp_path / "ckpts", None, ckpt_path="last")
    for a, b in zip(_weights(clean), _weights(resumed), strict=True):
        assert torch.equal(a, b)


def test_refused_without_a_health_monitor(tmp_path: Path) -> None:
    with pytest.raises(StabilityConfigError, match="TrainingHealthMonitor"):
        quiet_trainer(callbacks=[StepReplay()], max_steps=2).fit(Model(IndexedData()))


def test_the_command_line_lists_the_quarantine_from_the_manifest_and_from_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = PoisonedSamples(IndexedData(), [17])
    torch.manual_seed(0)
    model = Model(data)
    callbacks = [
        TrainingHealthMonitor(response="skip", warmup_steps=5, report=False),
        StepReplay(),
        StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=12, keep=3),
    ]
    trainer = quiet_trainer(callbacks=callbacks, max_steps=24, default_root_dir=tmp_path, enable_checkpointing=True)
    trainer.fit(model)
    quarantined = sorted(callbacks[1].quarantine.indices)
    newest = callbacks[2].healthy_checkpoints()[0][0]
    capsys.readouterr()
    for source in (tmp_path / "quarantine.json", newest):
        returncode = cli.main(["quarantine", str(source)])
        done = capsys.readouterr()
        assert returncode == 0, done.err
        assert done.out.startswith(f"{len(quarantined)} sample(s) quarantined in 1 batch(es)")
        assert " ".join(str(i) for i in quarantined) in done.out
    with pytest.raises(SystemExit) as bad:
        cli.main(["quarantine", str(tmp_path / "nothing.json")])
    assert bad.value.code == 2 and "no such file" in capsys.readouterr().err


def test_a_healthy_run_is_the_same_with_and_without_it_and_replays_nothing(tmp_path: Path) -> None:
    with_it, replay, ledger, _, trainer = _fit(tmp_path, log_every_n_steps=4)
    assert replay.counts["replays"] == 0 and not [e for e in ledger.events if e.get("kind") == "replay"]
    assert trainer.callback_metrics["stability/replays"] == 0
    torch.manual_seed(0)
    without = Model(IndexedData())
    monitor = TrainingHealthMonitor(response="skip", warmup_steps=5, report=False)
    quiet_trainer(callbacks=[monitor], max_epochs=2).fit(without)
    for a, b in zip(_weights(with_it), _weights(without), strict=True):
        assert torch.equal(a, b)


def test_early_stopping_and_model_checkpoint_monitor_its_keys_at_the_trainer_s_defaults(tmp_path: Path) -> None:
    """log_every_n_steps=50 over a 24-step run: no step logs, the keys are monitorable on every step."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    torch.manual_seed(0)
    model = Model(PoisonedSamples(IndexedData(), [17]))
    stop = EarlyStopping(
        monitor="stability/quarantined", mode="max", stopping_threshold=1.0, check_on_train_epoch_end=True
    )
    best = ModelCheckpoint(dirpath=tmp_path, monitor="stability/replays", mode="max")
    callbacks = [TrainingHealthMonitor(response="skip", warmup_steps=5, report=False), StepReplay(), stop, best]
    trainer = quiet_trainer(callbacks=callbacks, max_epochs=5, enable_checkpointing=True, default_root_dir=tmp_path)
    trainer.fit(model)
    assert trainer.current_epoch == 1  # stopped at the first epoch's end: a sample was quarantined in it
    assert best.best_model_score == 1.0 and Path(best.best_model_path).exists()


def test_its_state_survives_a_checkpoint_and_a_pickle(tmp_path: Path) -> None:
    _, replay, _, _, trainer = _fit(tmp_path, PoisonedSamples(IndexedData(), [17]), log_every_n_steps=1)
    assert trainer.callback_metrics["stability/quarantined"] == 8
    clone = StepReplay()
    clone.load_state_dict(replay.state_dict())
    assert clone.quarantine.indices == replay.quarantine.indices and clone.counts == replay.counts
    copy = pickle.loads(pickle.dumps(replay))
    assert copy.quarantine.indices == replay.quarantine.indices and copy.inputs.micro == []


def test_refused_under_fp16_loss_scaling_and_with_manual_optimization(tmp_path: Path) -> None:
    monitor = TrainingHealthMonitor(report=False)
    with pytest.raises(StabilityConfigError, match="precision='bf16-mixed'"):
        fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
        quiet_trainer(callbacks=[monitor, StepReplay()], max_steps=2, plugins=[fp16]).fit(Model(IndexedData()))

    class Manual(Model):
        def __init__(self) -> None:
            super().__init__(IndexedData())
            self.automatic_optimization = False

    with pytest.raises(StabilityConfigError, match="automatic_optimization=False"):
        quiet_trainer(callbacks=[TrainingHealthMonitor(report=False), StepReplay()], max_steps=2).fit(Manual())
    with pytest.raises(StabilityConfigError, match="max_faults"):
        StepReplay(max_faults=0)


@pytest.mark.distributed  # training in subprocesses
def test_the_quarantine_survives_a_sigkill_and_the_resume_never_loads_it(tmp_path: Path) -> None:
    """Killed with SIGKILL three steps after the quarantine; resumed with ckpt_path="last" to the end of the third
    epoch: the quarantine is back, and no quarantined sample is loaded again, in that epoch or the next two."""
    script = Path(__file__).with_name("quarantine_kill_run.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.run([sys.executable, str(script), str(tmp_path), "first"], env=env, capture_output=True)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    quarantined = json.loads((tmp_path / "quarantined.0.json").read_text())
    assert 17 in quarantined
    resumed = subprocess.run([sys.executable, str(script), str(tmp_path), "resume"], env=env, capture_output=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads((tmp_path / "resume.0.json").read_text())
    assert result["quarantined"] == quarantined and result["steps"] == 36
    assert not set(result["loaded"]) & set(quarantined)
    assert len(result["loaded"]) > 2 * (96 - len(quarantined))  # it did train on: the rest of the epochs' samples


def test_a_preset_with_replay_applies_a_transient_fault_as_replayed(tmp_path: Path) -> None:
    """from_preset("gpt", replay=True) (bf16 autocast, the LR back-off, clipping): a bit flip is a transient fault
    and the run ends bit-exact with the same preset run without one."""

    def run(flip: bool) -> tuple[Model, pl.Trainer]:
        torch.manual_seed(0)
        model = Model(IndexedData())
        if flip:
            BitFlip(model, "net.5", step=15)
        trainer = StableTrainer.from_preset(
            "gpt",
            replay=True,
            accelerator="cpu",
            precision="bf16-mixed",  # asked for: a CPU without AMX-BF16 would run the preset in fp32
            max_steps=24,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            default_root_dir=tmp_path,
        )
        trainer.fit(model)
        return model, trainer

    clean, _ = run(False)
    faulty, trainer = run(True)
    (event,) = [e for e in StepLedger.of(trainer).events if e.get("kind") == "replay"]
    assert event["cause"] == "transient" and event["step"] == 15
    for a, b in zip(_weights(clean), _weights(faulty), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("optimizer", "others", "extra"),
    [
        ("adamw", False, 0),  # the early read is the step's one read: the votes are then host bools
        ("adamw", True, 0),  # also with GradientNormMonitor's vote and the LR back-off's factor on the update
        ("sgd", True, 0),
        ("adamw_fused", False, 1),  # a fused step reads nothing: the decision to replay is the one read
    ],
)
def test_a_healthy_step_pays_no_host_read_it_did_not_pay_already(optimizer: str, others: bool, extra: int) -> None:
    """The decision to replay is the host's: the step's flags are read as it opens. With a non-fused optimizer that
    read replaces the one row 8 makes of the votes (and the back-off's factor): no sync more than the same Trainer
    without StepReplay. A fused optimizer's step has no read to share: one more. Counted on steps that do not log."""

    def syncs(with_replay: bool) -> list[int]:
        torch.manual_seed(0)
        model = TinyModule(optimizer=optimizer)
        callbacks: list[pl.Callback] = [TrainingHealthMonitor(response="skip", warmup_steps=3, report=False)]
        if others:
            callbacks += [GradientNormMonitor(max_norm=1.0), PrecursorMonitor(lr_backoff=LRBackoff())]
        if with_replay:
            callbacks.append(StepReplay(quarantine_file=None))
        trainer = quiet_trainer(callbacks=callbacks, max_steps=12, log_every_n_steps=50)
        return count_syncs_per_step(trainer, model)

    without, with_it = syncs(False), syncs(True)
    assert min(without[1:-1]) >= (0 if optimizer == "adamw_fused" else 1)  # the votes' read, where there is one
    assert [b - a for a, b in zip(without, with_it, strict=True)][1:-1] == [extra] * (len(without) - 2)


def test_a_device_vote_cast_as_the_step_opens_rides_the_early_read() -> None:
    """A device vote cast as the step opens (StepReplay's under DDP, whether any rank holds a batch with no sample
    left) is read with the step's flags as it opens: not one read more than without it."""

    class OpenVote(pl.Callback):
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            flag = torch.zeros((), dtype=torch.bool)
            vote = lambda ledger: ledger.mark_skip(Outcome.SKIPPED_QUARANTINED, flag)  # noqa: E731
            StepLedger.of(trainer).at(Stage.OPEN, "test", vote)

    def syncs(vote: bool) -> list[int]:
        torch.manual_seed(0)
        callbacks: list[pl.Callback] = [TrainingHealthMonitor(response="skip", warmup_steps=3, report=False)]
        callbacks += [StepReplay(quarantine_file=None)] + ([OpenVote()] if vote else [])
        trainer = quiet_trainer(callbacks=callbacks, max_steps=12, log_every_n_steps=50)
        return count_syncs_per_step(trainer, TinyModule())

    without, with_vote = syncs(False), syncs(True)
    assert with_vote[1:-1] == without[1:-1]
