"""TrainingHealthMonitor(response="rollback") going back to a healthy checkpoint on disk when the rollbacks from
memory are spent: real Trainers, real checkpoints written by StableCheckpoint, one process here (the two-process
DDP and StableFSDPStrategy runs: ``rollback_to_disk_script.py``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import pytest
import torch

from lightning_stability import (
    AtomicCheckpointIO,
    Outcome,
    StabilityConfigError,
    StableCheckpoint,
    StepLedger,
    TrainingDivergedError,
    TrainingHealthMonitor,
)
from lightning_stability.checkpoint.ring import FILE_NAME
from tests.health.test_health import SkipLabels, Spiky, monitor
from tests.helpers import quiet_trainer, torchrun

SCRIPT = Path(__file__).with_name("rollback_to_disk_script.py")
SPIKED, ROLLED = int(Outcome.SKIPPED_SPIKE), int(Outcome.SKIPPED_ROLLBACK)
STEPS_APPLIED = 24 - 2 - 4  # 24 steps less the two spikes, the rollback step and the 3 skipped batches


class AfterRollback(pl.Callback):
    """The weights and AdamW state right after the monitor's on_before_optimizer_step at the given steps (it runs
    after the monitor in the callback list)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps
        self.states: dict[int, dict[str, Any]] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step in self.steps:
            opt = trainer.optimizers[0]
            self.states[trainer.global_step] = {
                "weights": {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                "optim": [
                    {k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]
                ],
                "lr": opt.param_groups[0]["lr"],
            }


def saved_at(tmp_path: Path, step: int) -> dict[str, Any]:
    """The ring's checkpoint of global step ``step``, loaded."""
    (path,) = (tmp_path / "ckpts").glob(f"epoch=*-step={step}.ckpt")
    return torch.load(path, weights_only=False)


def listed(directory: Path) -> list[int]:
    return sorted(e["step"] for e in json.loads((directory / FILE_NAME).read_text())["checkpoints"])


def run(
    tmp_path: Path, spikes: tuple[int, ...], probe: set[int] = frozenset(), every: int = 1, **kwargs: Any
) -> tuple[pl.Trainer, TrainingHealthMonitor, AfterRollback]:
    pl.seed_everything(0)
    settings: dict[str, Any] = dict(max_rollbacks=0)
    settings.update(kwargs)
    mon = monitor("rollback", **settings)
    after = AfterRollback(set(probe))
    ring = StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=every, keep=100)
    trainer = quiet_trainer(
        max_steps=24, enable_checkpointing=True, plugins=[AtomicCheckpointIO()], callbacks=[mon, after, ring]
    )
    trainer.fit(Spiky(spike_at=spikes))
    return trainer, mon, after


def test_spent_rollbacks_go_back_to_the_newest_healthy_checkpoint_before_the_damage(tmp_path: Path) -> None:
    """Spikes at 11 and 12 (the damage is in the state after step 10, saved at global step 11), decided at 13:
    with no rollback from memory allowed, the monitor loads the checkpoint saved at global step 10 (the state after
    step 9): the weights and AdamW state equal the file's bit for bit, the LR stays the run's; step 13's update is
    dropped and 3 batches skipped, then training goes on exactly as a run that never applied steps 10 to 16. The
    checkpoint holding the damage is taken off the healthy list."""
    with pytest.warns(UserWarning, match=r"rollback from disk 1/1: restored .*epoch=1-step=10\.ckpt \(the state "):
        trainer, mon, after = run(tmp_path, (11, 12), probe={13})
    checkpoint = saved_at(tmp_path, 10)
    restored = after.states[13]
    assert checkpoint["state_dict"].keys() == restored["weights"].keys()
    assert all(torch.equal(checkpoint["state_dict"][k], v) for k, v in restored["weights"].items())
    saved_optim = checkpoint["optimizer_states"][0]["state"]
    assert len(saved_optim) == len(restored["optim"])
    for i, state in enumerate(restored["optim"]):
        assert state.keys() == saved_optim[i].keys()
        assert all(torch.equal(state[k], saved_optim[i][k]) for k in state)
    assert restored["lr"] == 0.01
    outcomes = [int(o) for o in mon.history.series["outcome"]]
    assert outcomes == [0] * 11 + [SPIKED] * 2 + [ROLLED] * 4 + [0] * 7
    assert (mon.rollback.rollbacks, mon.rollback.disk_rollbacks, mon.rollback.disk_steps) == (1, 1, [10])
    assert float(trainer.callback_metrics["stability/rollbacks"]) == 1.0
    event = StepLedger.of(trainer).events[0]
    assert (event["step"], event["to_step"], Path(event["checkpoint"]).name) == (13, 9, "epoch=1-step=10.ckpt")
    # the checkpoint of the damaged state (global step 11) is off the list; training saved again after the window
    assert listed(tmp_path / "ckpts") == [*range(1, 11), *range(18, 25)]
    pl.seed_everything(0)
    reference = quiet_trainer(max_steps=24, callbacks=[SkipLabels(set(range(10, 17)))])
    reference.fit(Spiky(spike_at=(11, 12)))
    ours, theirs = trainer.lightning_module.parameters(), reference.lightning_module.parameters()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_a_second_disk_rollback_never_goes_to_the_same_checkpoint(tmp_path: Path) -> None:
    """Damage again right after the first disk rollback's window (spikes 17, 18, decided at 19), before any new
    save: the checkpoint of global step 10 was used, 11 is off the list, so the second one goes to 9."""
    with pytest.warns(UserWarning, match=r"rollback from disk 2/2: restored .*epoch=1-step=9\.ckpt"):
        trainer, mon, after = run(tmp_path, (11, 12, 17, 18), probe={19}, max_disk_rollbacks=2)
    checkpoint = saved_at(tmp_path, 9)
    assert all(torch.equal(checkpoint["state_dict"][k], v) for k, v in after.states[19]["weights"].items())
    assert mon.rollback.disk_steps == [10, 9]
    assert float(trainer.callback_metrics["stability/rollbacks"]) == 2.0


def test_past_max_disk_rollbacks_the_run_stops_and_says_so(tmp_path: Path) -> None:
    with pytest.raises(TrainingDivergedError, match=r"and 1 from disk \(max_disk_rollbacks=1\)"):
        run(tmp_path, (11, 12, 17, 18))


def test_memory_first_then_disk(tmp_path: Path) -> None:
    """max_rollbacks=1: the first lasting spike (11, 12) restores the snapshot in memory (after step 7), the
    second (19, 20, decided at 21) the newest checkpoint saved before its damage (global step 18)."""
    with pytest.warns(UserWarning, match="rollback from disk 1/1"):
        trainer, mon, after = run(tmp_path, (11, 12, 19, 20), probe={21}, max_rollbacks=1)
    assert [(e["step"], e["to_step"], "checkpoint" in e) for e in mon.events if e["kind"] == "rollback"] == [
        (13, 7, False),
        (21, 17, True),
    ]
    checkpoint = saved_at(tmp_path, 18)
    assert all(torch.equal(checkpoint["state_dict"][k], v) for k, v in after.states[21]["weights"].items())
    assert (mon.rollback.rollbacks, mon.rollback.disk_rollbacks) == (2, 1)
    assert float(trainer.callback_metrics["stability/rollbacks"]) == 2.0


def test_without_a_stable_checkpoint_the_error_says_what_to_add() -> None:
    trainer = quiet_trainer(max_steps=24, callbacks=[monitor("rollback", max_rollbacks=0)])
    with pytest.raises(TrainingDivergedError, match=r"no StableCheckpoint is attached \(add StableCheckpoint\("):
        trainer.fit(Spiky(spike_at=(11, 12)))


def test_without_a_checkpoint_before_the_damage_the_error_says_so(tmp_path: Path) -> None:
    """Saves every 50 steps: none on disk by step 13."""
    with pytest.raises(TrainingDivergedError, match=r"no healthy checkpoint saved at or before global step 10"):
        run(tmp_path, (11, 12), every=50)


def test_disk_rollbacks_off_stop_as_before(tmp_path: Path) -> None:
    with pytest.raises(TrainingDivergedError, match=r"after 0 rollback\(s\) \(max_rollbacks=0\) and 0 from disk"):
        run(tmp_path, (11, 12), max_disk_rollbacks=0)


def test_a_fresh_run_never_rolls_back_to_an_earlier_runs_checkpoints(tmp_path: Path) -> None:
    """A first run leaves healthy checkpoints in the directory; a second run from scratch in it (no ckpt_path)
    saves only from step 50 on, so it has none of its own before the damage and stops."""
    run(tmp_path, ())
    assert listed(tmp_path / "ckpts")
    with pytest.raises(TrainingDivergedError, match="no healthy checkpoint saved at or before"):
        run(tmp_path, (11, 12), every=50)


def test_the_disk_rollback_count_and_targets_survive_a_resume(tmp_path: Path) -> None:
    mon = TrainingHealthMonitor(response="rollback")
    mon.rollback.disk_rollbacks, mon.rollback.disk_steps, mon.rollback.rollbacks = 1, [10], 2
    other = TrainingHealthMonitor(response="rollback")
    other.load_state_dict(mon.state_dict())
    assert (other.rollback.rollbacks, other.rollback.disk_rollbacks, other.rollback.disk_steps) == (2, 1, [10])


@pytest.mark.parametrize(("value", "match"), [(-1, "max_disk_rollbacks"), (True, "max_disk_rollbacks")])
def test_bad_max_disk_rollbacks(value: Any, match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        TrainingHealthMonitor(response="rollback", max_disk_rollbacks=value)


# ---------------------------------------------------------------------- two processes
def _load(out: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return json.loads((out / f"rank{rank}.json").read_text()), torch.load(out / f"rank{rank}.pt", weights_only=False)


def _same(a: dict[Any, Any], b: dict[Any, Any]) -> bool:
    return a.keys() == b.keys() and all(
        _same(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k]))
        for k in a
    )


@pytest.mark.distributed
def test_ddp_both_ranks_load_the_same_checkpoint_and_go_on_alike(tmp_path: Path) -> None:
    """A spike on rank 1 only, at steps 11 and 12: both ranks roll back at 13 to the file of global step 10, equal
    to it bit for bit (weights and AdamW state), skip 3 batches, and end equal to each other and to a 2-process run
    that skipped updates 10 to 16."""
    results = torchrun(SCRIPT, 2, tmp_path, "ddp", timeout=300)
    (r0, s0), (r1, s1) = _load(tmp_path, 0), _load(tmp_path, 1)
    assert r0 == r1 == results[0]
    assert r0["outcomes"] == [0] * 11 + [SPIKED] * 2 + [ROLLED] * 4 + [0] * 7
    assert r0["rollbacks"] == 1.0 and r0["disk"] == [1, [10]]
    assert [(e["step"], e["to_step"], Path(e["checkpoint"]).name) for e in r0["events"]] == [
        (13, 9, "epoch=0-step=10.ckpt")
    ]
    assert 11 not in r0["listed"] and r0["listed"][-1] == 24
    checkpoint = torch.load(tmp_path / "ckpts" / "epoch=0-step=10.ckpt", weights_only=False)
    for saved in (s0, s1):
        assert _same(saved["after_rollback"]["weights"], checkpoint["state_dict"])
        assert _same(saved["after_rollback"]["optim"]["state"], checkpoint["optimizer_states"][0]["state"])
        assert _same(saved["final"]["weights"], saved["reference"])
        assert not _same(saved["final"]["weights"], checkpoint["state_dict"])  # training went on
    assert _same(s0["final"]["weights"], s1["final"]["weights"])
    assert _same(s0["final"]["optim"], s1["final"]["optim"])


@pytest.mark.distributed
def test_fsdp_sharded_checkpoint_loads_in_place_on_both_ranks(tmp_path: Path) -> None:
    """StableFSDPStrategy, sharded checkpoints (DCP directories): the rollback at 13 loads global step 10's
    directory into the sharded module and optimizer; the whole weights and AdamW state then equal the directory's
    (consolidated here in one process) bit for bit, and training goes on alike on both ranks."""
    from lightning_stability.strategies.fsdp_checkpoint import consolidate_checkpoint

    torchrun(SCRIPT, 2, tmp_path, "fsdp", timeout=300)
    (r0, s0), (r1, _) = _load(tmp_path, 0), _load(tmp_path, 1)
    assert r0 == r1
    assert r0["outcomes"] == [0] * 11 + [SPIKED] * 2 + [ROLLED] * 4 + [0] * 7
    assert r0["rollbacks"] == 1.0 and r0["disk"] == [1, [10]]
    (target,) = (tmp_path / "ckpts").glob("epoch=*-step=10.ckpt")
    assert target.is_dir() and [Path(e["checkpoint"]).name for e in r0["events"]] == [target.name]
    assert 11 not in r0["listed"] and r0["listed"][-1] == 24
    merged = torch.load(consolidate_checkpoint(target, tmp_path / "merged.ckpt"), weights_only=False)
    restored = s0["after_rollback"]
    assert restored["weights"].keys() <= merged["state_dict"].keys()
    assert all(torch.equal(v, merged["state_dict"][k]) for k, v in restored["weights"].items())
    assert _same(restored["optim"]["state"], merged["optimizer_states"][0]["state"])
    assert not all(torch.equal(v, merged["state_dict"][k]) for k, v in s0["final"]["weights"].items())
    assert r0["counts"][0] == STEPS_APPLIED


def test_a_damaged_checkpoint_is_skipped_for_an_older_one(tmp_path: Path) -> None:
    """The newest checkpoint before the damage is truncated before the rollback: it is skipped with a warning
    naming it, and the rollback loads the one before (global step 9)."""

    class Truncate(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 13:
                (path,) = (tmp_path / "ckpts").glob("epoch=*-step=10.ckpt")
                path.write_bytes(path.read_bytes()[:100])

    pl.seed_everything(0)
    mon = monitor("rollback", max_rollbacks=0)
    after = AfterRollback({13})
    ring = StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, keep=100)
    trainer = quiet_trainer(
        max_steps=24,
        enable_checkpointing=True,
        plugins=[AtomicCheckpointIO()],
        callbacks=[Truncate(), mon, after, ring],
    )
    with pytest.warns(UserWarning, match=r"skipping a damaged checkpoint for the rollback: .*step=10\.ckpt"):
        trainer.fit(Spiky(spike_at=(11, 12)))
    assert mon.rollback.disk_steps == [9]
    assert all(torch.equal(saved_at(tmp_path, 9)["state_dict"][k], v) for k, v in after.states[13]["weights"].items())


def test_the_docs_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rollback example of docs/concepts/health-monitor.md, run as written but for a shorter run (60 steps, a
    save every step) on a model whose loss spikes lastingly four times: three rollbacks from memory, then one from
    disk."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "concepts" / "health-monitor.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "max_disk_rollbacks" in b]
    assert '# trainer.fit(model, ckpt_path="last")' in block
    block = block.replace("max_steps=10_000", "max_steps=60").replace(
        "every_n_train_steps=200", "every_n_train_steps=1"
    )
    block = block.replace('# trainer.fit(model, ckpt_path="last")', 'trainer.fit(model, ckpt_path="last")')
    monkeypatch.chdir(tmp_path)
    model = Spiky(spike_at=(27, 28, 31, 32, 35, 36, 39, 40))
    namespace: dict[str, Any] = {"L": lightning, "model": model}
    with pytest.warns(UserWarning, match=r"rollback from disk 1/1: restored .*ckpts"):
        exec(compile(block, "health-monitor.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert float(trainer.callback_metrics["stability/rollbacks"]) == 4.0
    mon = next(cb for cb in trainer.callbacks if isinstance(cb, TrainingHealthMonitor))
    assert (mon.rollback.rollbacks, mon.rollback.disk_rollbacks) == (4, 1)


def test_right_after_a_resume_the_rollback_goes_to_the_checkpoint_before_the_resumed_one(tmp_path: Path) -> None:
    """A run stops after 12 steps (its last save: global step 12); resumed with ckpt_path="last", it spikes at 12
    and 13. The snapshot in memory is the resumed state, the damaged one: the rollback at 14 loads the previous
    run's checkpoint of global step 11 (this run's own lineage), although rollbacks from memory are left."""

    def fit(max_steps: int, spikes: tuple[int, ...], ckpt_path: str | None) -> tuple[TrainingHealthMonitor, Any]:
        pl.seed_everything(0)
        mon = monitor("rollback")
        after = AfterRollback({14})
        ring = StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, keep=100)
        trainer = quiet_trainer(
            max_steps=max_steps, enable_checkpointing=True, plugins=[AtomicCheckpointIO()], callbacks=[mon, after, ring]
        )
        trainer.fit(Spiky(spike_at=spikes), ckpt_path=ckpt_path)
        return mon, after

    fit(12, (), None)
    with pytest.warns(UserWarning, match=r"rollback from disk 1/1: restored .*step=11\.ckpt"):
        mon, after = fit(24, (12, 13), "last")
    assert (mon.rollback.rollbacks, mon.rollback.disk_rollbacks, mon.rollback.disk_steps) == (1, 1, [11])
    assert all(torch.equal(saved_at(tmp_path, 11)["state_dict"][k], v) for k, v in after.states[14]["weights"].items())
    assert 12 not in listed(tmp_path / "ckpts")  # the resumed state held the damage
