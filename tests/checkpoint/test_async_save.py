"""StableCheckpoint(async_save=True) in one process, with real Trainers and real files: the same checkpoints as a
synchronous save, listed only once published, written from a copy (a NaN put into the live weights right after the
save never reaches the file), one save in flight, errors raised as CheckpointError naming the path, and a resume
equal bit for bit to an uninterrupted run. The SIGKILL during a background write is in test_async_kill.py; two
processes (DDP, StableFSDPStrategy) in test_async_kill.py and the soak."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_stability import AtomicCheckpointIO, CheckpointError, StabilityConfigError, StableCheckpoint
from lightning_stability.checkpoint.async_save import AsyncSaves
from lightning_stability.checkpoint.ring import FILE_NAME
from tests.helpers import QUIET, TinyModule, quiet_trainer


class GatedSaves(AsyncSaves):
    """Background writes that wait for ``gate`` before writing (a slow disk the test controls), then record when
    they published."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.published: list[float] = []

    def write_then_publish(self, write: Callable[[], None], publish: Callable[[], None]) -> None:
        self.gate.wait(60)
        write()
        publish()
        self.published.append(time.monotonic())


def gated(callback: StableCheckpoint) -> GatedSaves:
    saves = GatedSaves()
    callback._async = saves
    return saves


def listed(directory: Path) -> list[str]:
    path = directory / FILE_NAME
    return [e["name"] for e in json.loads(path.read_text())["checkpoints"]] if path.exists() else []


def params_of(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=False)["state_dict"]


def fit(tmp_path: Path, async_save: bool, max_steps: int, ckpt_path: str | None = None, **kwargs: Any) -> Any:
    pl.seed_everything(0, verbose=False)
    module = TinyModule(n=8)  # one batch per epoch: the same data at every step, whatever the resume
    callback = StableCheckpoint(
        dirpath=tmp_path / "ckpts", every_n_train_steps=2, keep=2, async_save=async_save, **kwargs
    )
    trainer = quiet_trainer(
        max_steps=max_steps, plugins=[AtomicCheckpointIO()], callbacks=[callback], enable_checkpointing=True
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module, callback


def test_async_checkpoints_equal_sync_ones(tmp_path: Path) -> None:
    _, _, _ = fit(tmp_path / "sync", async_save=False, max_steps=7)
    _, _, callback = fit(tmp_path / "async", async_save=True, max_steps=7)
    sync_dir, async_dir = tmp_path / "sync" / "ckpts", tmp_path / "async" / "ckpts"
    assert listed(async_dir) == listed(sync_dir) == ["epoch=3-step=4.ckpt", "epoch=5-step=6.ckpt"]
    assert sorted(p.name for p in async_dir.iterdir()) == sorted(p.name for p in sync_dir.iterdir())
    for name in listed(sync_dir):
        a, s = torch.load(async_dir / name, weights_only=False), torch.load(sync_dir / name, weights_only=False)
        assert a["global_step"] == s["global_step"]
        for key, value in s["state_dict"].items():
            assert torch.equal(a["state_dict"][key], value), key
        for p, state in s["optimizer_states"][0]["state"].items():
            for key, value in state.items():
                assert torch.equal(a["optimizer_states"][0]["state"][p][key], value)
    assert callback._async.pending is None


def test_listed_only_once_published_and_nan_after_the_copy_never_reaches_the_file(tmp_path: Path) -> None:
    """The write waits on a gate; meanwhile the live weights become NaN and training goes on: the file (published
    when the gate opens) holds the weights of the step it was saved at, and is listed only after that."""
    seen: dict[str, Any] = {}

    class Poison(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
            if trainer.global_step == 2:  # StableCheckpoint saved step 2 at the end of the previous batch
                seen["weights"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
                seen["listed_during_write"] = listed(tmp_path / "ckpts")
                seen["files_during_write"] = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
                with torch.no_grad():
                    for p in module.parameters():
                        p.fill_(float("nan"))  # the live weights, right after the save returned
                saves.gate.set()

    pl.seed_everything(0, verbose=False)
    callback = StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, async_save=True)
    saves = gated(callback)
    saves.gate.clear()
    trainer = quiet_trainer(
        max_steps=3, plugins=[AtomicCheckpointIO()], callbacks=[callback, Poison()], enable_checkpointing=True
    )
    trainer.fit(TinyModule())
    assert seen["listed_during_write"] == []
    assert "epoch=0-step=2.ckpt" not in seen["files_during_write"]  # only its hidden sibling was there
    saved = params_of(tmp_path / "ckpts" / "epoch=0-step=2.ckpt")
    for key, value in seen["weights"].items():
        assert torch.equal(saved[key], value), key
    assert listed(tmp_path / "ckpts") == ["epoch=0-step=2.ckpt"]


def test_one_save_in_flight_the_next_waits(tmp_path: Path) -> None:
    """A save due while the previous write is still running waits for it: step 2's save starts only after step
    1's was published (its write waits for a gate that opens 0.3 s into step 2)."""
    started: list[tuple[int, float]] = []

    class Watch(AsyncSaves):
        def start(self, trainer: pl.Trainer, path: Path, kind: str) -> None:
            assert self.pending is None
            started.append((trainer.global_step, time.monotonic()))
            super().start(trainer, path, kind)

    class Opener(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 1 and not saves.gate.is_set():
                threading.Timer(0.3, saves.gate.set).start()

    pl.seed_everything(0, verbose=False)
    callback = StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, keep=5, async_save=True)
    saves = type("S", (GatedSaves, Watch), {})()
    callback._async = saves
    saves.gate.clear()
    trainer = quiet_trainer(
        max_steps=5, plugins=[AtomicCheckpointIO()], callbacks=[Opener(), callback], enable_checkpointing=True
    )
    trainer.fit(TinyModule())
    steps = [s for s, _ in started]
    assert steps == [1, 2, 3, 4, 5]
    # step 2's save waited for step 1's publish, which waited for the gate
    assert started[1][1] >= saves.published[0]
    assert listed(tmp_path / "ckpts") == [f"epoch=0-step={s}.ckpt" for s in (1, 2, 3, 4, 5)]


def test_a_failed_background_write_raises_checkpoint_error_naming_the_path(tmp_path: Path) -> None:
    class Failing(AsyncSaves):
        def write_then_publish(self, write: Callable[[], None], publish: Callable[[], None]) -> None:
            raise OSError(28, "No space left on device")

    pl.seed_everything(0, verbose=False)
    callback = StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, async_save=True)
    callback._async = Failing()
    trainer = quiet_trainer(
        max_steps=6, plugins=[AtomicCheckpointIO()], callbacks=[callback], enable_checkpointing=True
    )
    with pytest.raises(CheckpointError, match=r"epoch=0-step=2\.ckpt.*No space left on device"):
        trainer.fit(TinyModule())
    # raised at a boundary after the failure, at the latest when the next save (step 4) waits for it
    assert trainer.global_step <= 4, trainer.global_step
    assert listed(tmp_path / "ckpts") == []
    assert not any(p.name.endswith(".ckpt") for p in (tmp_path / "ckpts").iterdir())
    assert not any(p.name.startswith(".lsckpt") for p in (tmp_path / "ckpts").iterdir())


def test_resume_from_async_checkpoints_equals_uninterrupted(tmp_path: Path) -> None:
    _, reference, _ = fit(tmp_path / "ref", async_save=False, max_steps=8)
    fit(tmp_path / "run", async_save=True, max_steps=5)  # saves 2 and 4
    trainer, resumed, _ = fit(tmp_path / "run", async_save=True, max_steps=8, ckpt_path="last")
    assert trainer.global_step == 8
    for (name, a), b in zip(resumed.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_on_a_plain_trainer_it_installs_its_writer_and_resumes(tmp_path: Path) -> None:
    """``lightning.Trainer(callbacks=[StableCheckpoint(async_save=True)])``, no plugin: it saves through
    ``AtomicCheckpointIO``, which it installs itself (it stopped with "pass plugins=[AtomicCheckpointIO()]"), and a
    resume from its checkpoints equals the run never interrupted."""
    import lightning

    def run(directory: Path, max_steps: int, ckpt_path: str | None = None, **kwargs: Any) -> Any:
        pl.seed_everything(0, verbose=False)
        module = TinyModule(n=8)  # one batch per epoch: the same data at every step, whatever the resume
        trainer = lightning.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=max_steps,
            **QUIET,
            **kwargs,
        )
        trainer.fit(module, ckpt_path=ckpt_path)
        return trainer, module

    _, reference = run(tmp_path / "ref", 8, enable_checkpointing=False)
    stable = StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, async_save=True)
    trainer, _ = run(tmp_path, 5, callbacks=[stable])
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    assert listed(tmp_path / "ckpts") == ["epoch=1-step=2.ckpt", "epoch=3-step=4.ckpt"]
    stable = StableCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, async_save=True)
    trainer, resumed = run(tmp_path, 8, ckpt_path="last", callbacks=[stable])
    assert trainer.global_step == 8 and isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    assert listed(tmp_path / "ckpts")[-1] == "epoch=7-step=8.ckpt"
    for (name, a), b in zip(resumed.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_async_save_refuses_a_writer_of_the_users_that_does_not_publish_whole_files(tmp_path: Path) -> None:
    from lightning.pytorch.plugins import TorchCheckpointIO

    callback = StableCheckpoint(dirpath=tmp_path, every_n_train_steps=1, async_save=True)
    trainer = quiet_trainer(max_steps=1, callbacks=[callback], enable_checkpointing=True, plugins=[TorchCheckpointIO()])
    said = r"`async_save=True` needs a writer .* SingleDeviceStrategy and TorchCheckpointIO\. Fix: leave out the"
    with pytest.raises(StabilityConfigError, match=said):
        trainer.fit(TinyModule())
    with pytest.raises(StabilityConfigError, match="async_save"):
        StableCheckpoint(async_save="yes")  # type: ignore[arg-type]


def test_pickles_without_its_thread(tmp_path: Path) -> None:
    import pickle

    _, _, callback = fit(tmp_path, async_save=True, max_steps=3)
    copy = pickle.loads(pickle.dumps(callback))
    assert copy.async_save and copy._async.pending is None


def test_host_copy_is_isolated_reuses_its_buffers_and_keeps_the_structure() -> None:
    from collections import OrderedDict, namedtuple

    from lightning_stability.checkpoint.async_save import HostCopy

    Pair = namedtuple("Pair", "a b")
    weights = OrderedDict(w=torch.arange(6.0).reshape(2, 3), t=torch.arange(6.0).reshape(2, 3).t())
    weights._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    state = {"state_dict": weights, "pair": Pair(torch.ones(2), 3), "lists": [1.5, "x", None], "step": 7}
    copier = HostCopy()
    first = copier.copy(state)
    assert type(first["state_dict"]) is OrderedDict and first["state_dict"]._metadata == {"": {"version": 1}}
    assert isinstance(first["pair"], Pair) and first["pair"].b == 3
    assert first["lists"] == [1.5, "x", None] and first["step"] == 7
    assert torch.equal(first["state_dict"]["t"], weights["t"])  # a transposed view copied as its values
    weights["w"].fill_(float("nan"))  # the live tensor changes after the copy
    assert torch.equal(first["state_dict"]["w"], torch.arange(6.0).reshape(2, 3))
    buffer = first["state_dict"]["w"].data_ptr()
    second = copier.copy(state)  # the next save: the same buffers, refilled
    assert second["state_dict"]["w"].data_ptr() == buffer and second["state_dict"]["w"].isnan().all()


def test_no_host_sync_on_the_steps_between_saves(tmp_path: Path) -> None:
    """Polling the save in flight reads host flags only: the steps that do not save sync as often as without any
    checkpointing."""
    from tests.helpers import count_syncs_per_step

    pl.seed_everything(0, verbose=False)
    bare = count_syncs_per_step(quiet_trainer(max_steps=12, log_every_n_steps=50), TinyModule())
    pl.seed_everything(0, verbose=False)
    callback = StableCheckpoint(dirpath=tmp_path, every_n_train_steps=4, async_save=True)
    trainer = quiet_trainer(
        max_steps=12,
        log_every_n_steps=50,
        plugins=[AtomicCheckpointIO()],
        callbacks=[callback],
        enable_checkpointing=True,
    )
    ours = count_syncs_per_step(trainer, TinyModule())
    saving = {3, 7, 11}  # the batches whose end saves (steps 4, 8, 12): the health check reads the host there
    assert [n for i, n in enumerate(ours) if i not in saving] == [n for i, n in enumerate(bare) if i not in saving]
    assert listed(tmp_path) == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "epoch=1-step=12.ckpt"]
