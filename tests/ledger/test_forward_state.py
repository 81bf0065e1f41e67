"""State a forward changes besides the parameters (an MoE layer's token counts in a non-persistent buffer): put
back by StepReplay's replay and by TrainingHealthMonitor's rollback, on real Trainers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_stability import StableCheckpoint, StepLedger, TrainingHealthMonitor
from lightning_stability.replay import BitFlip, PoisonedSamples, StepReplay
from tests.health.test_health import SkipLabels
from tests.helpers import TinyModule, make_data, quiet_trainer


class TokenCountingMoE(nn.Module):
    """Top-1 routing over a few linear experts, as torchtitan's and Megatron's MoE layers count tokens for load
    balancing: the tokens sent to each expert are added to a non-persistent buffer in the forward, and the router
    reads the counts (a busier expert is chosen less), so a count that is off changes the weights too."""

    experts: nn.ModuleList
    tokens_per_expert: torch.Tensor

    def __init__(self, dim: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        self.register_buffer("tokens_per_expert", torch.zeros(experts), persistent=False)
        self.counting = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        load = self.tokens_per_expert / self.tokens_per_expert.sum().clamp(min=1.0)
        logits = self.router(x) - load
        if self.counting:
            with torch.no_grad():
                self.tokens_per_expert += torch.bincount(logits.argmax(-1), minlength=len(self.experts)).float()
        out = torch.stack([expert(x) for expert in self.experts], dim=-1)
        return (out * logits.softmax(-1).unsqueeze(1)).sum(-1)


class MoEModel(TinyModule):
    """TinyModule with the MoE layer in the middle; ``uncounted``: global steps whose forward counts nothing."""

    def __init__(self, uncounted: set[int] | None = None, spike_at: tuple[int, ...] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), TokenCountingMoE(), nn.Tanh(), nn.Linear(16, 1))
        self.uncounted = uncounted or set()
        self.spike_at = set(spike_at)

    @property
    def moe(self) -> TokenCountingMoE:
        return self.net[2]  # type: ignore[return-value]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.moe.counting = self.global_step not in self.uncounted
        loss = super().training_step(batch, batch_idx)
        return loss * 100 if self.global_step in self.spike_at else loss


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def test_a_replayed_step_counts_its_tokens_once_and_the_run_ends_bit_exact() -> None:
    """A bit flip at step 15 is replayed: the replay puts the token counts back before it runs the step again, so
    every token is counted once and the run ends bit-equal, buffer included, to a run without the flip."""

    def run(flip: bool) -> tuple[MoEModel, pl.Trainer]:
        torch.manual_seed(0)
        model = MoEModel()
        if flip:
            BitFlip(model, "net.4", step=15)
        monitor = TrainingHealthMonitor(response="skip", warmup_steps=5, report=False)
        trainer = quiet_trainer(callbacks=[monitor, StepReplay(quarantine_file=None)], max_steps=24)
        trainer.fit(model)
        return model, trainer

    clean, _ = run(False)
    faulty, trainer = run(True)
    (event,) = [e for e in StepLedger.of(trainer).events if e.get("kind") == "replay"]
    assert event["cause"] == "transient" and event["step"] == 15
    assert float(clean.moe.tokens_per_expert.sum()) == 24 * 8  # every token of the 24 steps, once
    assert float(faulty.moe.tokens_per_expert.sum()) == 24 * 8
    for a, b in zip(_state(clean), _state(faulty), strict=True):
        assert torch.equal(a, b)


class BufferAtStart(pl.Callback):
    """The token counts as each batch starts (before its forward), by global step."""

    def __init__(self) -> None:
        self.at: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.at[trainer.global_step] = pl_module.moe.tokens_per_expert.clone()


@pytest.mark.parametrize("first", [11, 12])
def test_a_rollback_puts_the_token_counts_back_to_the_snapshot(first: int) -> None:
    """Spikes at ``first`` and ``first + 1`` roll back at ``first + 2`` to the snapshot after step 7 and skip the
    next 3 batches: the counts go back to their value as step 8 started, and the skipped batches count nothing.
    The run ends bit-equal, counts included, to one that never trained on nor counted batches 8 to ``first + 5``."""
    pl.seed_everything(0)
    monitor = TrainingHealthMonitor(
        response="rollback", warmup_steps=5, snapshot_every=4, skip_batches=3, log_every_n_steps=2, report=False
    )
    seen = BufferAtStart()
    trainer = quiet_trainer(max_steps=24, callbacks=[monitor, seen])
    with pytest.warns(UserWarning, match="rollback 1/3: restored the state after step 7"):
        trainer.fit(MoEModel(spike_at=(first, first + 1), lr=0.01))
    model = trainer.lightning_module
    assert [(e["step"], e["to_step"]) for e in StepLedger.of(trainer).events] == [(first + 2, 7)]
    for step in range(first + 3, first + 7):  # after the rollback step, and after each skipped batch
        assert torch.equal(seen.at[step], seen.at[8]), step
    pl.seed_everything(0)
    uncounted = set(range(8, first + 6))
    reference = quiet_trainer(max_steps=24, callbacks=[SkipLabels(uncounted)])
    reference.fit(MoEModel(uncounted=uncounted, spike_at=(first, first + 1), lr=0.01))
    for a, b in zip(_state(model), _state(reference.lightning_module), strict=True):
        assert torch.equal(a, b)


def test_buffers_a_forward_changes_are_found_at_the_first_steps_and_only_those_are_copied() -> None:
    """BatchNorm's statistics (its kernel writes them without bumping their version counters: found by value) and
    the token counts are copied before each step; a constant non-persistent mask is not."""
    torch.manual_seed(0)
    model = MoEModel()
    model.net[1] = nn.Sequential(nn.BatchNorm1d(16), nn.Tanh())
    model.register_buffer("mask", torch.ones(64), persistent=False)  # a constant: never copied once found
    monitor = TrainingHealthMonitor(response="skip", warmup_steps=5, report=False)
    trainer = quiet_trainer(callbacks=[monitor, StepReplay(quarantine_file=None)], max_steps=6)
    trainer.fit(model)
    from lightning_stability.ledger.forward_state import ForwardState

    state = ForwardState.of(model)
    norm = ["net.1.0.running_mean", "net.1.0.running_var", "net.1.0.num_batches_tracked"]
    assert state.tracked() == [*norm, "net.2.tokens_per_expert"]
    assert state.tracked(persistent=False) == ["net.2.tokens_per_expert"]
    assert state.nbytes == 16 * 4 + 16 * 4 + 8 + 4 * 4


def test_a_rollback_from_disk_names_the_non_persistent_buffers_it_cannot_restore(tmp_path: Path) -> None:
    pl.seed_everything(0)
    monitor = TrainingHealthMonitor(
        response="rollback", warmup_steps=5, snapshot_every=4, skip_batches=3, max_rollbacks=0, report=False
    )
    ring = StableCheckpoint(dirpath=tmp_path, every_n_train_steps=1, keep=100)
    trainer = quiet_trainer(max_steps=24, enable_checkpointing=True, callbacks=[monitor, ring])
    with pytest.warns(UserWarning, match=r"net\.2\.tokens_per_expert .*persistent=False.*leaves them as they were"):
        trainer.fit(MoEModel(spike_at=(12, 13), lr=0.01))
    assert monitor.rollback.disk_rollbacks == 1


def test_a_step_skipped_after_its_replay_leaves_no_trace_in_the_buffers() -> None:
    """A NaN sample: the step reproduces, the data is blamed and the step skipped. Its forwards' changes to the
    buffers are put back with it: BatchNorm's statistics stay finite (they were NaN to the end of the run), and
    the poisoned batch's tokens are not counted."""
    torch.manual_seed(0)
    model = MoEModel()
    model.net[1] = nn.Sequential(nn.BatchNorm1d(16), nn.Tanh())
    data = PoisonedSamples(make_data(64), [17])
    model.train_dataloader = lambda: DataLoader(data, batch_size=8)  # type: ignore[method-assign]
    monitor = TrainingHealthMonitor(response="skip", warmup_steps=5, report=False)
    replay = StepReplay(quarantine_file=None)
    trainer = quiet_trainer(callbacks=[monitor, replay], max_steps=8)  # one epoch: 7 batches counted
    trainer.fit(model)
    assert replay.counts["data"] == 1 and replay.quarantine.indices == set(range(16, 24))
    assert all(bool(torch.isfinite(b.float()).all()) for b in model.buffers())
    assert float(model.moe.tokens_per_expert.sum()) == 7 * 8


def test_buffers_written_back_at_the_first_step_are_still_found() -> None:
    """A NaN sample in the first batch: the first step is skipped and its BatchNorm statistics written back, so
    they look unchanged as the second step starts; they are still found as changing (compared before the write
    back), so a bit flip at step 15 is replayed with them put back, and the run ends bit-equal to the same run
    without the flip."""
    from tests.replay.test_replay import IndexedData, Model

    def run(flip: bool) -> tuple[Model, pl.Trainer]:
        torch.manual_seed(0)
        model = Model(PoisonedSamples(IndexedData(), [3]), shuffle=False, norm=True)
        if flip:
            BitFlip(model, "net.5", step=15)
        monitor = TrainingHealthMonitor(response="skip", warmup_steps=5, report=False)
        trainer = quiet_trainer(callbacks=[monitor, StepReplay(quarantine_file=None)], max_steps=20)
        trainer.fit(model)
        return model, trainer

    clean, _ = run(False)
    faulty, trainer = run(True)
    events = [e for e in StepLedger.of(trainer).events if e.get("kind") == "replay"]
    assert [(e["step"], e["cause"]) for e in events] == [(0, "data"), (15, "transient")]
    for a, b in zip(_state(clean), _state(faulty), strict=True):
        assert torch.equal(a, b)


class PlainCounter(TinyModule):
    """Keeps a step count and a running sum in plain attributes (not buffers) that the forward changes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.running = torch.zeros(1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        self.running.add_(1.0)
        return super().training_step(batch, batch_idx)


def test_state_kept_in_plain_attributes_is_named_in_a_warning_with_the_fix() -> None:
    torch.manual_seed(0)
    monitor = TrainingHealthMonitor(response="skip", warmup_steps=5, report=False)
    trainer = quiet_trainer(callbacks=[monitor, StepReplay(quarantine_file=None)], max_steps=4)
    with pytest.warns(UserWarning, match=r"calls, running.*register_buffer") as seen:
        trainer.fit(PlainCounter())
    assert len([w for w in seen if "register_buffer" in str(w.message)]) == 1  # said once
