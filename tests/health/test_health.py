"""TrainingHealthMonitor on real Trainers: spikes found on the device, and each response's exact effect."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_stability import (
    GradientNormMonitor,
    Outcome,
    StabilityConfigError,
    StepLedger,
    TrainingDivergedError,
    TrainingHealthMonitor,
)
from lightning_stability.health.rollback import scaled_defaults
from lightning_stability.health.spike_stats import SpikeStats, zclip_threshold
from tests.helpers import TinyModule, count_syncs_per_step, quiet_trainer

SPIKE = 11  # the optimizer step whose loss (hence gradient) is multiplied by 100


class Spiky(TinyModule):
    def __init__(self, spike_at: tuple[int, ...] = (SPIKE,), **kwargs: Any) -> None:
        super().__init__(lr=0.01, **kwargs)
        self.spike_at = set(spike_at)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 100 if self.global_step in self.spike_at else loss


def monitor(response: str, **kwargs: Any) -> TrainingHealthMonitor:
    settings: dict[str, Any] = dict(warmup_steps=5, snapshot_every=4, skip_batches=3, log_every_n_steps=2, report=False)
    settings.update(kwargs)
    return TrainingHealthMonitor(response=response, **settings)  # type: ignore[arg-type]


class StepStates(pl.Callback):
    """Weights and AdamW state before and after every batch."""

    def __init__(self) -> None:
        self.before: list[list[torch.Tensor]] = []
        self.after: list[list[torch.Tensor]] = []

    @staticmethod
    def _state(trainer: pl.Trainer) -> list[torch.Tensor]:
        opt = trainer.optimizers[0]
        tensors = [p.detach().clone() for p in trainer.lightning_module.parameters()]
        for p in trainer.lightning_module.parameters():
            tensors += [v.detach().clone() for v in opt.state.get(p, {}).values() if torch.is_tensor(v)]
        return tensors

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.before.append(self._state(trainer))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        StepLedger.of(trainer).close_step()
        self.after.append(self._state(trainer))


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_spike_stats_follow_zclips_estimator() -> None:
    """Warmup moments, then EMA mean and variance (the variance around the new mean), as ZClip computes them."""
    values = [1.0, 1.2, 0.9, 1.1, 1.05, 1.3, 0.95, 5.0, 1.1, 1.0]
    stats = SpikeStats(1, alpha=0.9, warmup=4)
    alpha, buffer, mean, var = 0.9, [], None, None
    for v in values:
        stats.update(stats.zscore(torch.tensor([v]))[1], torch.tensor([True]))
        if mean is None:
            buffer.append(v)
            if len(buffer) == 4:
                mean = sum(buffer) / 4
                var = sum((x - mean) ** 2 for x in buffer) / 4
        else:
            mean = alpha * mean + (1 - alpha) * v
            var = alpha * var + (1 - alpha) * (v - mean) ** 2
        if mean is not None:
            got_mean, got_std = stats.mean_std(torch.device("cpu"))
            assert got_mean.item() == pytest.approx(mean, rel=1e-6)
            assert got_std.item() == pytest.approx(math.sqrt(var), rel=1e-6)
    z = stats.zscore(torch.tensor([10.0]))[0]
    assert z.item() == pytest.approx((10.0 - mean) / (math.sqrt(var) + 1e-6), rel=1e-5)
    # ZClip's adaptive threshold: mean + z_thresh * std / (z / z_thresh)
    got = zclip_threshold(torch.tensor(1.0), torch.tensor(0.5), torch.tensor(5.0), 2.5)
    assert got.item() == pytest.approx(1.0 + 2.5 * 0.5 / (5.0 / 2.5))


def test_warn_names_the_step_and_changes_nothing() -> None:
    pl.seed_everything(0)
    mon = monitor("warn")
    trainer = quiet_trainer(max_steps=16, callbacks=[mon])
    with pytest.warns(UserWarning, match=rf"spike .* at step\(s\) \[{SPIKE}\]: no action"):
        trainer.fit(Spiky())
    assert [int(o) for o in mon.history.series["outcome"]] == [0] * 16
    assert [e["step"] for e in mon.events if e["kind"] == "spike"] == [SPIKE]


class Shifted(TinyModule):
    """The loss (and so the gradient) settles 30 times higher from step ``at`` on: a new level, not a spike."""

    def __init__(self, at: int) -> None:
        super().__init__(lr=0.01)
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 30 if self.global_step >= self.at else loss


def test_skip_learns_a_lasting_shift_instead_of_skipping_every_later_step() -> None:
    """Past a count of 10 values above the threshold (up one above it, down one below) a signal is at a new level:
    its values enter the statistics (capped at the threshold). Before, the new level scored as a spike on every
    step, so response="skip" skipped every later update, and the run stopped learning, silently."""
    pl.seed_everything(0)
    mon = TrainingHealthMonitor(response="skip", warmup_steps=10, report=False)
    trainer = quiet_trainer(max_steps=90, callbacks=[mon])
    with pytest.warns(UserWarning, match="spike"):
        trainer.fit(Shifted(at=40))
    outcomes = [int(o) for o in mon.history.series["outcome"]]
    skipped = [i for i, o in enumerate(outcomes) if o == Outcome.SKIPPED_SPIKE]
    assert skipped and skipped[0] >= 40 and len(skipped) <= 25, skipped
    assert outcomes[75:] == [Outcome.APPLIED] * 15
    levels = [e for e in mon.events if e["kind"] == "new_level"]  # said once per signal, where it starts
    assert levels and all(e["step"] > 40 for e in levels), levels
    assert sorted(e["detail"].split()[1] for e in levels) in (["gradient"], ["loss"], ["gradient", "loss"]), levels
    assert "new level" in levels[0]["detail"]


class BurstThenSpike(TinyModule):
    """Loss x100 on steps 30-59 (a bad stretch of data), then x10 once, at step 95."""

    def __init__(self) -> None:
        super().__init__(lr=0.01)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if 30 <= self.global_step < 60:
            return loss * 100
        return loss * 10 if self.global_step == 95 else loss


def test_under_rollback_a_long_burst_never_enters_the_statistics() -> None:
    """30 bad steps in a row are rolled back, not taken as a new level: the statistics stay as they were, so the
    spike at step 95 is found (had the burst entered them, capped, it was missed). Each pair of spikes in the
    burst rolls back two steps after its first (30-31 at 32, 36-37 at 38, ...) to the snapshot after step 19 (the
    one after 29 was taken on the spike's weights); the lone spike at 95 is skipped, no rollback."""
    pl.seed_everything(0)
    mon = monitor("rollback", snapshot_every=10, skip_batches=3, log_every_n_steps=10, max_rollbacks=10)
    trainer = quiet_trainer(max_steps=120, callbacks=[mon])
    with pytest.warns(UserWarning, match="rollback"):
        trainer.fit(BurstThenSpike())
    assert 95 in {e["step"] for e in mon.events if e["kind"] == "spike"}
    rollbacks = [(e["step"], e["to_step"]) for e in mon.events if e["kind"] == "rollback"]
    assert rollbacks == [(32, 19), (38, 19), (44, 19), (50, 19), (56, 19)]
    assert int(mon.history.series["outcome"][95]) == int(Outcome.SKIPPED_SPIKE)


def test_under_rollback_a_lasting_new_level_stops_with_an_error_that_names_skip() -> None:
    pl.seed_everything(0)
    mon = monitor("rollback", snapshot_every=10, skip_batches=3, log_every_n_steps=10, max_rollbacks=2)
    trainer = quiet_trainer(max_steps=120, callbacks=[mon])
    with pytest.raises(TrainingDivergedError, match=r'after 2 rollback.*response="skip" learns a new level'):
        trainer.fit(Shifted(at=40))


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_skip_leaves_weights_and_optimizer_state_bit_identical(optimizer: str) -> None:
    pl.seed_everything(0)
    states = StepStates()
    trainer = quiet_trainer(max_steps=16, callbacks=[monitor("skip"), states])
    with pytest.warns(UserWarning, match=r"those updates were skipped"):
        trainer.fit(Spiky(optimizer=optimizer))
    assert same(states.before[SPIKE], states.after[SPIKE])
    assert all(not same(states.before[i], states.after[i]) for i in range(16) if i != SPIKE)
    assert StepLedger.of(trainer).record_of().counts.tolist() == [15, 0, 0, 1, 0, 0]


class SkipLabels(pl.Callback):
    """The reference: skip these steps through the ledger, nothing else."""

    def __init__(self, labels: set[int]) -> None:
        self.labels = labels

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        skip = trainer.global_step in self.labels
        StepLedger.of(trainer).mark_skip(Outcome.SKIPPED_SPIKE, skip, optimizer)


@pytest.mark.parametrize("first", [11, 12])
def test_a_lasting_spike_rolls_back_two_steps_later_and_skips_the_data_window(first: int) -> None:
    """Snapshots every 4 steps (after steps 3, 7, 11, ...; each good once two more steps passed clean): spikes at
    ``first`` and ``first + 1`` (the second on the weights of the first, whose update was skipped) roll back at
    ``first + 2`` to the snapshot after step 7 (the one after 11 holds the spike's weights when ``first`` is 12,
    and is not yet confirmed when it is 11), drop that step's update and skip the next 3. Training then goes on
    exactly as a run that never trained on batches 8 to ``first + 5``."""
    pl.seed_everything(0)
    mon = monitor("rollback")
    trainer = quiet_trainer(max_steps=24, callbacks=[mon])
    detail = r"restored the state after step 7; dropped this step's update and skipping the next 3 batches"
    with pytest.warns(UserWarning, match=rf"rollback 1/3: {detail}"):
        trainer.fit(Spiky(spike_at=(first, first + 1)))
    outcomes = [int(o) for o in mon.history.series["outcome"]]
    spike, rollback = int(Outcome.SKIPPED_SPIKE), int(Outcome.SKIPPED_ROLLBACK)
    assert outcomes == [0] * first + [spike] * 2 + [rollback] * 4 + [0] * (18 - first)
    assert mon.rollback.rollbacks == 1
    assert [(e["step"], e["to_step"]) for e in StepLedger.of(trainer).events] == [(first + 2, 7)]
    pl.seed_everything(0)
    reference = quiet_trainer(max_steps=24, callbacks=[SkipLabels(set(range(8, first + 6)))])
    reference.fit(Spiky(spike_at=(first, first + 1)))
    ours, theirs = trainer.lightning_module.parameters(), reference.lightning_module.parameters()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_a_spike_whose_skipped_update_kept_the_damage_out_does_not_roll_back() -> None:
    """One bad batch at step 11: its update is skipped and step 12 scores normally on the same weights, so the
    weights are clean: no rollback, the run ends as one that skipped step 11 alone."""
    pl.seed_everything(0)
    mon = monitor("rollback")
    trainer = quiet_trainer(max_steps=24, callbacks=[mon])
    with pytest.warns(UserWarning, match=r"at step\(s\) \[11\]"):
        trainer.fit(Spiky())
    assert mon.rollback.rollbacks == 0 and not StepLedger.of(trainer).events
    assert StepLedger.of(trainer).record_of().counts.tolist() == [23, 0, 0, 1, 0, 0]
    pl.seed_everything(0)
    reference = quiet_trainer(max_steps=24, callbacks=[SkipLabels({SPIKE})])
    reference.fit(Spiky())
    ours, theirs = trainer.lightning_module.parameters(), reference.lightning_module.parameters()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_the_rollback_counter_is_true_at_the_end_of_fit() -> None:
    """No logging step in the run (log every 50 of 24 steps): the rollback at step 13 is in callback_metrics."""
    pl.seed_everything(0)
    trainer = quiet_trainer(max_steps=24, callbacks=[monitor("rollback", log_every_n_steps=50)])
    with pytest.warns(UserWarning, match="rollback 1/3"):
        trainer.fit(Spiky(spike_at=(11, 12)))
    assert float(trainer.callback_metrics["stability/rollbacks"]) == 1.0


@pytest.mark.parametrize(
    ("total", "expected"),
    [
        (None, (100, 200)),
        (math.inf, (100, 200)),
        (50, (1, 1)),
        (200, (2, 1)),
        (1_000, (10, 2)),
        (10_000, (100, 20)),
        (100_000, (100, 200)),
        (1_000_000, (100, 200)),
    ],
)
def test_rollback_defaults_scale_with_the_run(total: float | None, expected: tuple[int, int]) -> None:
    assert scaled_defaults(total) == expected


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [({}, (2, 1)), ({"snapshot_every": 20}, (20, 1)), ({"skip_batches": 5}, (2, 5))],
)
def test_a_monitor_left_at_its_defaults_fits_them_to_the_run(kwargs: dict[str, Any], expected: tuple[int, int]) -> None:
    """200 steps: a snapshot every 2 steps and 1 batch skipped; a value the user set is kept."""
    mon = TrainingHealthMonitor(response="rollback", report=False, **kwargs)
    quiet_trainer(max_steps=200, callbacks=[mon]).fit(TinyModule())
    assert (mon.rollback.snapshot_every, mon.rollback.skip_batches) == expected


def test_rollbacks_are_bounded() -> None:
    mon = monitor("rollback", max_rollbacks=1, skip_batches=1)
    trainer = quiet_trainer(max_steps=24, callbacks=[mon])
    with pytest.raises(TrainingDivergedError, match=r"after 1 rollback\(s\) \(max_rollbacks=1\)"):
        trainer.fit(Spiky(spike_at=(11, 12, 17, 18)))


def test_clip_uses_zclips_adaptive_threshold() -> None:
    pl.seed_everything(0)
    mon = monitor("clip")

    class Norms(pl.Callback):
        def __init__(self) -> None:
            self.after_clip: list[float] = []

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            pass

    trainer = quiet_trainer(max_steps=16, callbacks=[mon])
    with pytest.warns(UserWarning, match="ZClip"):
        trainer.fit(Spiky())
    thresholds = mon.history.series["clip_threshold"]
    norms = mon.history.series["grad_norm"]
    assert [i for i, t in enumerate(thresholds) if math.isfinite(t)] == [SPIKE]
    assert norms[SPIKE] > 10 * thresholds[SPIKE]  # the raw norm, clipped hard
    assert [int(o) for o in mon.history.series["outcome"]] == [0] * 16  # clipped, not skipped


def test_a_non_finite_loss_is_never_applied_whatever_the_response() -> None:
    states = StepStates()
    trainer = quiet_trainer(max_steps=8, callbacks=[monitor("warn"), states])
    trainer.fit(TinyModule(inf_at_step=3))
    assert same(states.before[3], states.after[3])
    assert StepLedger.of(trainer).record_of().counts.tolist()[Outcome.SKIPPED_NONFINITE] == 1


def test_update_ratio_matches_a_hand_computation() -> None:
    class Hand(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self.before = [p.detach().clone() for p in trainer.lightning_module.parameters()]

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            after = list(trainer.lightning_module.parameters())
            delta = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(after, self.before, strict=True)))
            weight = torch.sqrt(sum((b**2).sum() for b in self.before))
            self.ratio = float(delta / weight)
            # the first Linear, weight and bias together
            d0 = torch.sqrt((after[0] - self.before[0]).pow(2).sum() + (after[1] - self.before[1]).pow(2).sum())
            self.first = float(d0 / torch.sqrt(self.before[0].pow(2).sum() + self.before[1].pow(2).sum()))

    hand = Hand()
    trainer = quiet_trainer(max_steps=4, callbacks=[monitor("warn", log_every_n_steps=4), hand])
    trainer.fit(TinyModule())
    metrics = trainer.callback_metrics
    assert float(metrics["stability/update_ratio"]) == pytest.approx(hand.ratio, rel=1e-4)
    assert float(metrics["stability/update_ratio_by_module/net.0"]) == pytest.approx(hand.first, rel=1e-4)


def test_memory_warning_and_metrics() -> None:
    trainer = quiet_trainer(max_steps=4, callbacks=[monitor("warn", memory_warn_fraction=1e-6, log_every_n_steps=2)])
    with pytest.warns(UserWarning, match=r"peak memory .* GiB is .* close to out-of-memory"):
        trainer.fit(TinyModule())
    assert float(trainer.callback_metrics["stability/memory_peak_gb"]) > 0.01


@pytest.mark.parametrize("response", ["warn", "clip", "skip", "rollback"])
def test_no_host_sync_added_on_steps_that_do_not_log(response: str) -> None:
    """A fused optimizer: the spike decision and the skip stay on the device."""
    pl.seed_everything(0)
    bare = count_syncs_per_step(quiet_trainer(max_steps=6, log_every_n_steps=50), TinyModule(optimizer="adamw_fused"))
    pl.seed_everything(0)
    ours = count_syncs_per_step(
        quiet_trainer(max_steps=6, log_every_n_steps=50, callbacks=[monitor(response, log_every_n_steps=50)]),
        TinyModule(optimizer="adamw_fused"),
    )
    assert ours == bare


def test_a_rollback_adds_no_host_sync_on_steps_that_do_not_log() -> None:
    """Spikes at 7 and 8, no logging step: the flag formed at step 8 is copied to the host without a sync and read
    at step 9, which rolls back; the snapshots (steps 4, 8, 12) are copies into host buffers, no sync either."""
    pl.seed_everything(0)
    bare = count_syncs_per_step(
        quiet_trainer(max_steps=16, log_every_n_steps=50), Spiky(spike_at=(7, 8), optimizer="adamw_fused")
    )
    pl.seed_everything(0)
    mon = monitor("rollback", log_every_n_steps=50)
    with pytest.warns(UserWarning, match="rollback 1/3"):
        ours = count_syncs_per_step(
            quiet_trainer(max_steps=16, log_every_n_steps=50, callbacks=[mon]),
            Spiky(spike_at=(7, 8), optimizer="adamw_fused"),
        )
    assert [(e["step"], e["to_step"]) for e in mon.events if e["kind"] == "rollback"] == [(9, 3)]
    assert ours == bare


def test_a_resume_between_two_spikes_still_rolls_back(tmp_path: Path) -> None:
    """Saved after step 17, between spikes at 17 and 18: the checkpoint keeps the spike flag of step 17, so the
    resumed run rolls back at step 19 as the straight run does and skips the same steps. (It restores the resumed
    state: snapshots are not saved; the straight run restores the one after step 15.)"""
    spikes = (17, 18)
    pl.seed_everything(0)
    straight = monitor("rollback")
    with pytest.warns(UserWarning, match="rollback 1/3"):
        quiet_trainer(max_steps=24, callbacks=[straight]).fit(Spiky(spike_at=spikes))
    pl.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=18, save_top_k=-1)
    first = quiet_trainer(max_steps=18, callbacks=[monitor("rollback"), ckpt], enable_checkpointing=True)
    with pytest.warns(UserWarning):
        first.fit(Spiky(spike_at=spikes))
    resumed_monitor = monitor("rollback")
    resumed = quiet_trainer(max_steps=24, callbacks=[resumed_monitor])
    with pytest.warns(UserWarning, match="rollback 1/3: restored the state after step"):
        resumed.fit(Spiky(spike_at=spikes), ckpt_path=str(tmp_path / "epoch=2-step=18.ckpt"))
    assert resumed_monitor.history.series["outcome"] == straight.history.series["outcome"]
    assert [(e["step"], e["to_step"]) for e in straight.events if e["kind"] == "rollback"] == [(19, 15)]
    assert [e["step"] for e in resumed_monitor.events if e["kind"] == "rollback"] == [19]


def test_a_resume_before_a_rollback_ends_as_the_straight_run(tmp_path: Path) -> None:
    """Saved after step 7; spikes at 17 and 18 roll back at 19 to the snapshot after step 15 in both runs (the
    snapshot schedule is the same after a resume): the same weights and events."""
    spikes = (17, 18)
    pl.seed_everything(0)
    straight = monitor("rollback")
    trainer = quiet_trainer(max_steps=24, callbacks=[straight])
    with pytest.warns(UserWarning, match="rollback 1/3: restored the state after step 15"):
        trainer.fit(Spiky(spike_at=spikes))
    pl.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=8, save_top_k=-1)
    quiet_trainer(max_steps=8, callbacks=[monitor("rollback"), ckpt], enable_checkpointing=True).fit(
        Spiky(spike_at=spikes)
    )
    resumed = quiet_trainer(max_steps=24, callbacks=[monitor("rollback")])
    with pytest.warns(UserWarning, match="rollback 1/3: restored the state after step 15"):
        resumed.fit(Spiky(spike_at=spikes), ckpt_path=str(tmp_path / "epoch=0-step=8.ckpt"))
    ours, theirs = trainer.lightning_module.parameters(), resumed.lightning_module.parameters()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert StepLedger.of(resumed).events == StepLedger.of(trainer).events


def test_resume_mid_run_with_spikes_gives_the_straight_runs_outcome(tmp_path: Path) -> None:
    """Interrupted at step 16 (between a spike at 11 and one at 18): the running statistics, the history and the
    ledger continue, so the resumed run skips the same steps and ends with the same weights."""
    spikes = (11, 18)
    pl.seed_everything(0)
    straight = monitor("skip")
    trainer = quiet_trainer(max_steps=24, callbacks=[straight])
    with pytest.warns(UserWarning):
        trainer.fit(Spiky(spike_at=spikes))
    pl.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=16, save_top_k=-1)
    first = quiet_trainer(max_steps=16, callbacks=[monitor("skip"), ckpt], enable_checkpointing=True)
    with pytest.warns(UserWarning):
        first.fit(Spiky(spike_at=spikes))
    resumed_monitor = monitor("skip")
    resumed = quiet_trainer(max_steps=24, callbacks=[resumed_monitor])
    with pytest.warns(UserWarning, match=r"at step\(s\) \[18\]"):
        resumed.fit(Spiky(spike_at=spikes), ckpt_path=str(tmp_path / "epoch=1-step=16.ckpt"))
    for a, b in zip(trainer.lightning_module.parameters(), resumed.lightning_module.parameters(), strict=True):
        assert torch.equal(a, b)
    assert resumed_monitor.history.series["outcome"] == straight.history.series["outcome"]
    assert resumed_monitor.history.series["loss"] == straight.history.series["loss"]
    assert (
        StepLedger.of(resumed).record_of().counts.tolist()
        == StepLedger.of(trainer).record_of().counts.tolist()
        == [22, 0, 0, 2, 0, 0]
    )


def test_the_interval_loss_mean_continues_across_a_mid_interval_checkpoint(tmp_path: Path) -> None:
    """Logging every 5 steps, saved at step 16 and stopped at 18: the mean over steps 15-17 is the straight run's."""
    pl.seed_everything(0)
    straight_monitor = monitor("skip", log_every_n_steps=5)
    trainer = quiet_trainer(max_steps=18, callbacks=[straight_monitor])
    trainer.fit(Spiky(spike_at=()))
    pl.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=16, save_top_k=-1)
    first_monitor = monitor("skip", log_every_n_steps=5)
    first = quiet_trainer(max_steps=16, callbacks=[first_monitor, ckpt], enable_checkpointing=True)
    first.fit(Spiky(spike_at=()))
    resumed = quiet_trainer(max_steps=18, callbacks=[monitor("skip", log_every_n_steps=5)])
    resumed.fit(Spiky(spike_at=()), ckpt_path=str(tmp_path / "epoch=1-step=16.ckpt"))
    straight, got = trainer.callback_metrics["stability/loss_mean"], resumed.callback_metrics["stability/loss_mean"]
    assert got == straight
    assert got.item() == pytest.approx(sum(straight_monitor.history.series["loss"][15:18]) / 3, rel=1e-6)


def test_works_beside_gradient_norm_monitor_in_any_order() -> None:
    for order in ("first", "last"):
        pl.seed_everything(0)
        mon, gnm = monitor("skip"), GradientNormMonitor(max_norm=1.0)
        trainer = quiet_trainer(max_steps=16, callbacks=[mon, gnm] if order == "first" else [gnm, mon])
        with pytest.warns(UserWarning):
            trainer.fit(Spiky())
        assert StepLedger.of(trainer).record_of().counts.tolist() == [15, 0, 0, 1, 0, 0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"response": "panic"}, r"`response='panic'` is not a response"),
        ({"spike_z": 0}, r"`spike_z=0` must be a number > 0"),
        ({"alpha": 1.0}, r"`alpha=1.0` must be a finite number in \(0.0, 1.0\)"),
        ({"skip_batches": -1}, r"`skip_batches=-1` must be an int >= 0"),
        ({"warmup_steps": 0}, r"warmup_steps"),
        ({"warmup_steps": 1}, r"`warmup_steps=1` must be >= 2"),
        ({"skip_on": "grad"}, r"`skip_on='grad'` is not a choice. Fix: pass 'any'"),
        ({"response": "skip", "skip_on": None}, r"`skip_on=None` is not a choice"),
        ({"response": "rollback", "skip_on": "loss"}, r"`skip_on='loss'` chooses what response='skip' skips"),
        ({"response": "warn", "skip_on": "loss"}, r"response='warn' takes 'any' only"),
        ({"response": "clip", "skip_on": "loss"}, r"response='clip' takes 'any' only"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        TrainingHealthMonitor(**kwargs)


def test_a_resume_inside_the_skipped_window_does_not_replay_it(tmp_path: Path) -> None:
    """Spikes at 12 and 13, rollback at step 14, batches 15-18 skipped; the run is interrupted after step 15 and
    resumed: 16-18 are still skipped, and the run ends as the straight one."""
    kwargs = dict(skip_batches=4)
    spikes = (12, 13)
    pl.seed_everything(0)
    straight = monitor("rollback", **kwargs)
    trainer = quiet_trainer(max_steps=24, callbacks=[straight])
    with pytest.warns(UserWarning, match="rollback 1/3"):
        trainer.fit(Spiky(spike_at=spikes))
    rollback = int(Outcome.SKIPPED_ROLLBACK)
    assert [int(o) for o in straight.history.series["outcome"]][12:20] == [3, 3] + [rollback] * 5 + [0]
    pl.seed_everything(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=16, save_top_k=-1)
    first = quiet_trainer(max_steps=16, callbacks=[monitor("rollback", **kwargs), ckpt], enable_checkpointing=True)
    with pytest.warns(UserWarning, match="rollback 1/3"):
        first.fit(Spiky(spike_at=spikes))
    resumed_monitor = monitor("rollback", **kwargs)
    resumed = quiet_trainer(max_steps=24, callbacks=[resumed_monitor])
    resumed.fit(Spiky(spike_at=spikes), ckpt_path=str(tmp_path / "epoch=1-step=16.ckpt"))
    assert resumed_monitor.history.series["outcome"] == straight.history.series["outcome"]
    ours, theirs = trainer.lightning_module.parameters(), resumed.lightning_module.parameters()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert StepLedger.of(resumed).events == StepLedger.of(trainer).events


def test_cuda_memory_readings_use_the_allocators_peaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: the CUDA branch is checked against stand-ins for torch.cuda's allocator statistics (the CPU
    branch runs for real in the tests above)."""
    from lightning_stability.health import signals as memory

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 30 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 36 * gib)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device=None: type("Props", (), {"total_memory": 40 * gib})()
    )
    cuda = torch.device("cuda", 0)
    assert memory.peak_memory(cuda) == (30.0, 36.0)
    assert memory.capacity(cuda) == 40.0
    assert memory.memory_warning(36.0, 40.0, 0.9) is not None
    assert memory.memory_warning(30.0, 40.0, 0.9) is None


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_under_fp16_the_skip_votes_ride_the_scalers_decision_without_syncs(optimizer: str) -> None:
    """Even a non-fused optimizer: the votes join the flags the scaler reads once anyway."""
    from lightning.pytorch.plugins import MixedPrecision

    def trainer(callbacks: list[pl.Callback]) -> pl.Trainer:
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))
        return quiet_trainer(max_steps=6, log_every_n_steps=50, plugins=[plugin], callbacks=callbacks)

    pl.seed_everything(0)
    bare = count_syncs_per_step(trainer([]), TinyModule(optimizer=optimizer))
    pl.seed_everything(0)
    callbacks = [GradientNormMonitor(max_norm=1.0), monitor("skip", log_every_n_steps=50)]
    assert count_syncs_per_step(trainer(callbacks), TinyModule(optimizer=optimizer)) == bare


def test_with_the_callbacks_real_projects_combine(tmp_path: Path) -> None:
    """Trainer defaults (log_every_n_steps=50, max_epochs), EarlyStopping and ModelCheckpoint on stability/ keys,
    LearningRateMonitor, a CSV logger and Tuner.lr_find before fit: the report lands in the logger's directory."""
    from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.tuner import Tuner

    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=3,
        default_root_dir=tmp_path,
        logger=CSVLogger(tmp_path),
        enable_progress_bar=False,
        callbacks=[
            GradientNormMonitor(max_norm=1.0),
            TrainingHealthMonitor(response="rollback"),
            LearningRateMonitor(),
            EarlyStopping(monitor="stability/loss_mean", patience=100),
            ModelCheckpoint(monitor="stability/loss_z", dirpath=tmp_path / "ckpt"),
        ],
    )
    model = Spiky(spike_at=())
    Tuner(trainer).lr_find(model, num_training=20)
    trainer.fit(model)
    assert trainer.global_step == 24
    assert (Path(trainer.logger.log_dir) / "stability_report.json").is_file()  # type: ignore[union-attr]
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 1


def test_several_optimizers_are_refused_at_fit_start() -> None:
    from tests.ledger.test_several_optimizers import TwoOptimizerGAN

    trainer = quiet_trainer(max_steps=2, callbacks=[TrainingHealthMonitor(report=False)])
    with pytest.raises(StabilityConfigError, match=r"watches one optimizer's updates; this module has 2"):
        trainer.fit(TwoOptimizerGAN())


class GradNorm2(pl.Callback):
    """The 2-norm of the gradients as they are when this callback's hook runs (tests only: host reads)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads))))


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
@pytest.mark.parametrize("health_first", [True, False])
def test_a_fixed_and_an_adaptive_clip_compose_in_either_order(health_first: bool, norm_type: float) -> None:
    """Each monitor sees the raw gradient norm, whatever clipped before it (also for another norm type), and
    the logged clip coefficient is the one applied by both clips together."""
    pl.seed_everything(0)
    raw, final = GradNorm2(), GradNorm2()
    mon, gnm = monitor("clip"), GradientNormMonitor(max_norm=5.0, norm_type=norm_type, log_every_n_steps=1)

    class Coef(pl.Callback):
        def __init__(self) -> None:
            self.coefs: list[float] = []

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            self.coefs.append(float(trainer.callback_metrics["stability/clip_coef"]))

    coefs = Coef()
    ours = [mon, gnm] if health_first else [gnm, mon]
    trainer = quiet_trainer(max_steps=16, callbacks=[raw, *ours, final, coefs])
    with pytest.warns(UserWarning):
        trainer.fit(Spiky())
    assert mon.history.series["grad_norm"] == pytest.approx(raw.norms, rel=1e-4)
    threshold = mon.history.series["clip_threshold"][SPIKE]
    assert math.isfinite(threshold)
    if norm_type == 2.0:
        assert final.norms[SPIKE] == pytest.approx(min(5.0, threshold), rel=1e-4)
    assert coefs.coefs == pytest.approx([f / r for f, r in zip(final.norms, raw.norms, strict=True)], rel=1e-4)


def test_a_checkpoint_between_logging_steps_loses_no_spike(tmp_path: Path) -> None:
    """Lightning's epoch-end checkpoint saves the monitor in the middle of a logging interval: the spike in it
    is still warned about and recorded at the next logging step."""
    mon = monitor("warn", log_every_n_steps=20)
    trainer = quiet_trainer(max_steps=32, callbacks=[mon, ModelCheckpoint(dirpath=tmp_path)], enable_checkpointing=True)
    with pytest.warns(UserWarning, match=rf"at step\(s\) \[{SPIKE}\]"):
        trainer.fit(Spiky())
    assert [e["step"] for e in mon.events] == [SPIKE]


@pytest.mark.parametrize("response", ["warn", "rollback"])
def test_a_spike_after_the_last_logging_step_is_still_answered(response: str) -> None:
    """Logging steps 4 and 9; spikes at 11 and 12, the last step: the warning names both, and under rollback
    the flag sent at step 12 is read at the end of fit, which restores the snapshot after step 7 (the one after
    11 was not yet confirmed) and counts it."""
    pl.seed_everything(0)
    mon = monitor(response, log_every_n_steps=5)
    trainer = quiet_trainer(max_steps=13, callbacks=[mon])
    with pytest.warns(UserWarning, match=rf"at step\(s\) \[{SPIKE}, {SPIKE + 1}\]"):
        trainer.fit(Spiky(spike_at=(SPIKE, SPIKE + 1)))
    if response == "rollback":
        assert mon.rollback.rollbacks == 1
        assert mon.events[-1]["detail"] == "restored the state after step 7; training ended, nothing left to skip"
        assert float(trainer.callback_metrics["stability/rollbacks"]) == 1.0


def test_parameters_without_gradients_are_measured_without_them() -> None:
    """An unused head and a frozen layer, both in the optimizer: the update ratio covers what was trained."""

    class Partial(TinyModule):
        def __init__(self) -> None:
            super().__init__()
            self.unused = torch.nn.Linear(8, 1)
            self.net[0].requires_grad_(False)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    mon = monitor("warn", log_every_n_steps=2)
    quiet_trainer(max_steps=4, callbacks=[mon]).fit(Partial())
    ratios = [r for r in mon.history.series["update_ratio"] if math.isfinite(r)]
    assert len(ratios) == 2 and all(r > 0 for r in ratios)


class ManualNoLoss(TinyModule):
    """Manual optimization that calls ``loss.backward()`` itself: the ledger never sees the step's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_a_step_without_a_known_loss_records_nan_not_the_placeholder() -> None:
    pl.seed_everything(0)
    mon = monitor("warn")
    trainer = quiet_trainer(max_steps=8, callbacks=[mon])
    trainer.fit(ManualNoLoss())
    assert len(mon.history.series["loss"]) == 8
    assert all(math.isnan(v) for v in mon.history.series["loss"])
    assert all(math.isfinite(v) for v in mon.history.series["grad_norm"])
    assert math.isnan(trainer.callback_metrics["stability/loss_z"].item())


class VerdictLog(pl.Callback):
    """The monitor's verdict of every step from the step ledger, by its step label (host reads: tests only)."""

    def __init__(self) -> None:
        self.flags: list[list[float]] = []
        self.spike: list[bool] = []
        self.pending: list[bool] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        verdict = StepLedger.of(trainer).health
        assert verdict is not None
        self.flags.append(verdict.flags.tolist())
        self.spike.append(bool(verdict.spike))
        self.pending.append(bool(verdict.rollback_pending))


def test_the_verdict_in_the_ledger_is_what_the_history_and_the_report_record() -> None:
    """One definition of a spike: the flags StableCheckpoint reads from the ledger are the history's, step by step,
    and the steps called spikes are those the monitor skipped and the warning names."""
    pl.seed_everything(0)
    log = VerdictLog()
    mon = monitor("skip", log_every_n_steps=4)
    trainer = quiet_trainer(max_steps=16, callbacks=[mon, log])
    with pytest.warns(UserWarning, match=rf"spike .* at step\(s\) \[{SPIKE}\]"):
        trainer.fit(Spiky())
    series = mon.history.series
    assert log.flags == [[a, b] for a, b in zip(series["loss_spike"], series["grad_spike"], strict=True)]
    assert [i for i, s in enumerate(log.spike) if s] == [SPIKE]
    assert [i for i, o in enumerate(series["outcome"]) if o == Outcome.SKIPPED_SPIKE] == [SPIKE]
    assert not any(log.pending)  # no rollback under "skip"


def test_the_verdict_says_when_a_rollback_is_pending() -> None:
    """Two spikes in a row under "rollback": the second one is on the weights the first left (its update was
    skipped), so the damage is in: the verdict of that step says a rollback follows, and the next step rolls back."""
    pl.seed_everything(0)
    log = VerdictLog()
    mon = monitor("rollback", log_every_n_steps=50)
    trainer = quiet_trainer(max_steps=24, callbacks=[mon, log])
    with pytest.warns(UserWarning, match="rollback 1/3"):
        trainer.fit(Spiky(spike_at=(11, 12)))
    assert [i for i, p in enumerate(log.pending) if p] == [12]
    assert [e["step"] for e in mon.events if e["kind"] == "rollback"] == [13]


@pytest.mark.parametrize("health_first", [True, False])
def test_the_report_draws_the_fixed_clip_the_steps_were_clipped_to(health_first: bool) -> None:
    """GradientNormMonitor's clip is read from each step's record (whichever of the two runs first), not from the
    callback: the history's clip threshold is max_norm on every scored step; NaN without a fixed clip."""
    pl.seed_everything(0)
    mon, gnm = monitor("warn"), GradientNormMonitor(max_norm=0.5)
    trainer = quiet_trainer(max_steps=8, callbacks=[mon, gnm] if health_first else [gnm, mon])
    trainer.fit(Spiky(spike_at=()))
    assert mon.history.series["clip_threshold"] == [0.5] * 8
    pl.seed_everything(0)
    alone = monitor("warn")
    quiet_trainer(max_steps=8, callbacks=[alone]).fit(Spiky(spike_at=()))
    assert all(math.isnan(t) for t in alone.history.series["clip_threshold"])


GRAD_SPIKE = 14  # the optimizer step whose gradient (not its loss) is multiplied by 100


class GradOnlySpiky(Spiky):
    """Spiky's loss spike at ``SPIKE``, and at ``GRAD_SPIKE`` a gradient 100x as large with the loss's value unchanged
    (the loss plus 99 times its own value's deviation from a detached copy of it)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss + 99 * (loss - loss.detach()) if self.global_step == GRAD_SPIKE else loss


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_skip_on_loss_applies_a_gradient_norm_spike_alone_and_still_skips_a_loss_spike(optimizer: str) -> None:
    pl.seed_everything(0)
    states, mon = StepStates(), monitor("skip", skip_on="loss")
    trainer = quiet_trainer(max_steps=18, callbacks=[mon, states])
    with pytest.warns(UserWarning) as record:
        trainer.fit(GradOnlySpiky(optimizer=optimizer))
    messages = [str(w.message) for w in record]
    series = mon.history.series
    # both found: the loss spike at SPIKE, the gradient-norm spike alone at GRAD_SPIKE
    assert [i for i, f in enumerate(series["loss_spike"]) if f == 1] == [SPIKE]
    assert [i for i, f in enumerate(series["grad_spike"]) if f == 1] == [SPIKE, GRAD_SPIKE]
    # only the loss spike skipped: weights and AdamW state untouched there, the gradient-norm spike applied
    assert same(states.before[SPIKE], states.after[SPIKE])
    assert not same(states.before[GRAD_SPIKE], states.after[GRAD_SPIKE])
    assert [int(o) for o in series["outcome"]] == [int(Outcome.SKIPPED_SPIKE) if i == SPIKE else 0 for i in range(18)]
    assert StepLedger.of(trainer).record_of().counts.tolist() == [17, 0, 0, 1, 0, 0]
    # each warned about and in the events as what was done
    assert any(f"at step(s) [{SPIKE}]: those updates were skipped" in m for m in messages)
    assert any(
        f"without a loss spike at step(s) [{GRAD_SPIKE}]: applied, as skip_on='loss' asks" in m for m in messages
    )
    details = {e["step"]: e["detail"] for e in mon.events if e["kind"] == "spike"}
    assert details[SPIKE] == "those updates were skipped"
    assert details[GRAD_SPIKE].startswith("a gradient-norm spike without a loss spike: applied, not clipped")


def test_skip_on_any_skips_both_spikes() -> None:
    """The reference for the test above: the default skips the gradient-norm spike too."""
    pl.seed_everything(0)
    states, mon = StepStates(), monitor("skip")
    trainer = quiet_trainer(max_steps=18, callbacks=[mon, states])
    with pytest.warns(UserWarning) as record:
        trainer.fit(GradOnlySpiky())
    for step in (SPIKE, GRAD_SPIKE):
        assert any(f"at step(s) [{step}]: those updates were skipped" in str(w.message) for w in record)
    assert same(states.before[GRAD_SPIKE], states.after[GRAD_SPIKE])
    assert StepLedger.of(trainer).record_of().counts.tolist() == [16, 0, 0, 2, 0, 0]


def test_skip_on_loss_names_the_fixed_clip_the_applied_spike_got() -> None:
    """With GradientNormMonitor(max_norm) attached, the applied gradient-norm spike's update is the clipped one: the
    same update as a run that clips that step with the same max_norm and no health monitor."""
    pl.seed_everything(0)
    states, mon = StepStates(), monitor("skip", skip_on="loss")
    trainer = quiet_trainer(max_steps=16, callbacks=[GradientNormMonitor(max_norm=0.5), mon, states])
    with pytest.warns(UserWarning, match="applied, as skip_on='loss' asks"):
        trainer.fit(GradOnlySpiky(spike_at=()))
    (detail,) = [e["detail"] for e in mon.events if e["step"] == GRAD_SPIKE]
    norm = mon.history.series["grad_norm"][GRAD_SPIKE]
    assert norm > 0.5 and detail.endswith(f"applied, its gradient norm {norm:.4g} clipped to 0.5 (skip_on='loss')")
    pl.seed_everything(0)
    clipped = StepStates()
    quiet_trainer(max_steps=16, callbacks=[GradientNormMonitor(max_norm=0.5), clipped]).fit(GradOnlySpiky(spike_at=()))
    assert same(states.after[GRAD_SPIKE], clipped.after[GRAD_SPIKE])


def test_skip_on_loss_still_skips_a_non_finite_loss() -> None:
    states = StepStates()
    trainer = quiet_trainer(max_steps=8, callbacks=[monitor("skip", skip_on="loss"), states])
    trainer.fit(TinyModule(inf_at_step=6))
    assert same(states.before[6], states.after[6])
    assert StepLedger.of(trainer).record_of().counts.tolist()[Outcome.SKIPPED_NONFINITE] == 1


def test_skip_on_loss_adds_no_host_sync_on_steps_that_do_not_log() -> None:
    pl.seed_everything(0)
    bare = count_syncs_per_step(quiet_trainer(max_steps=6, log_every_n_steps=50), TinyModule(optimizer="adamw_fused"))
    pl.seed_everything(0)
    ours = count_syncs_per_step(
        quiet_trainer(
            max_steps=6, log_every_n_steps=50, callbacks=[monitor("skip", skip_on="loss", log_every_n_steps=50)]
        ),
        TinyModule(optimizer="adamw_fused"),
    )
    assert ours == bare


class RatioSeen(pl.Callback):
    """``stability/update_ratio`` in ``callback_metrics`` after each step (``None`` where not there)."""

    def __init__(self) -> None:
        self.seen: list[float | None] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        value = trainer.callback_metrics.get("stability/update_ratio")
        self.seen.append(None if value is None else float(value))


@pytest.mark.parametrize(("health_every", "precursor_every"), [(2, 2), (4, 2), (2, 4)])
def test_update_ratio_is_the_steps_figure_logged_on_either_monitors_logging_steps(
    health_every: int, precursor_every: int
) -> None:
    """``stability/update_ratio`` is recorded once, by the ledger, for every callback that measured the update: the
    loggers get it on the logging steps of either monitor, ``callback_metrics`` holds it from the first measured
    step on, and it is the ratio the health history keeps."""
    from lightning_stability import PrecursorMonitor
    from tests.amp.test_loss_scale import MemoryLogger

    mon, logger, seen = monitor("warn", log_every_n_steps=health_every), MemoryLogger(), RatioSeen()
    callbacks = [mon, PrecursorMonitor(log_every_n_steps=precursor_every), seen]
    torch.manual_seed(0)
    quiet_trainer(max_steps=12, callbacks=callbacks, logger=logger, limit_train_batches=5).fit(TinyModule())
    logged = logger.series("stability/update_ratio")
    every = {step for step in range(12) if (step + 1) % health_every == 0 or (step + 1) % precursor_every == 0}
    assert set(logged) == every
    assert all(value is not None for value in seen.seen[min(health_every, precursor_every) - 1 :])
    history = dict(zip(mon.history.series["step"], mon.history.series["update_ratio"], strict=True))
    for step in range(health_every - 1, 12, health_every):  # the health monitor's logging steps: the same figure
        assert logged[step] == pytest.approx(history[step], rel=1e-6)
    package = Path(__file__).parents[2] / "lightning_stability"
    recorders = [p for p in package.rglob("*.py") if '"stability/update_ratio"' in p.read_text()]
    assert [p.relative_to(package).as_posix() for p in recorders] == ["ledger/step_ledger.py"]
