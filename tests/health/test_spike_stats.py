"""The health monitor's device statistics: ZClip's estimator with values left out, the scores, runs of spikes taken
as a new level, the std's floor, the interval mean, checkpoints of the earlier layout, and what a step costs in
kernels."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_stability import GradientNormMonitor, TrainingHealthMonitor
from lightning_stability.health.spike_stats import IntervalMean, SpikeStats
from tests.helpers import OpCounter, TinyModule, quiet_trainer


def feed(stats: SpikeStats, values: list[float], include: list[bool] | None = None) -> None:
    for i, v in enumerate(values):
        keep = True if include is None else include[i]
        stats.update(stats.zscore(torch.tensor([v]))[1], torch.tensor([keep]))


def test_values_left_out_do_not_count_towards_the_warmup_or_the_ema() -> None:
    """A left-out value (a spike, a NaN) changes nothing: the warmup's moments are those of the included values,
    and the EMA after it follows ZClip's update on the included values only."""
    values = [1.0, math.nan, 1.4, 50.0, 0.8, 1.2, math.inf, 1.1, 0.9, 30.0, 1.0]
    include = [True, False, True, False, True, True, False, True, True, False, True]
    stats = SpikeStats(1, alpha=0.8, warmup=4)
    feed(stats, values, include)
    kept = [v for v, k in zip(values, include, strict=True) if k]  # 1.0 1.4 0.8 1.2 | 1.1 0.9 1.0
    mean = sum(kept[:4]) / 4
    var = sum((x - mean) ** 2 for x in kept[:4]) / 4
    for x in kept[4:]:
        mean = 0.8 * mean + 0.2 * x
        var = 0.8 * var + 0.2 * (x - mean) ** 2
    got_mean, got_std = stats.mean_std(torch.device("cpu"))
    assert got_mean.item() == pytest.approx(mean, rel=1e-6)
    assert got_std.item() == pytest.approx(math.sqrt(var), rel=1e-5)


def test_scores_flag_spikes_and_non_finite_values_apart() -> None:
    stats = SpikeStats(2, alpha=0.9, warmup=3)
    during = stats.score(torch.tensor([100.0, math.nan]), spike_z=3.0)
    assert during.z[0].item() == 0.0 and not during.spikes.any()  # no spike is called during the warmup
    assert during.deviation[0].item() == 100.0  # nor capped: the warmup takes values as they come
    assert during.nonfinite.item() and during.finite.tolist() == [True, False]
    feed_both = [[1.0, 2.0], [1.1, 2.2], [0.9, 1.8], [1.0, 2.0]]
    for row in feed_both:
        scored = stats.score(torch.tensor(row), spike_z=3.0)
        stats.update(scored.deviation, scored.include, scored.run)
    mean, std = stats.mean_std(torch.device("cpu"))
    scored = stats.score(torch.tensor([10.0, math.inf]), spike_z=3.0)
    assert scored.spikes.tolist() == [True, False]  # inf is non-finite, not a spike
    assert scored.finite.tolist() == [True, False] and scored.nonfinite.item()
    assert scored.include.tolist() == [False, False] and scored.run.tolist() == [1.0, 0.0]  # a spike: left out
    # capped at the threshold, mean + 3 std, for when a run of spikes enters (as ZClip enters a clipped value)
    assert scored.deviation[0].item() == pytest.approx(3.0 * (std[0].item() + 1e-6), rel=1e-5)
    calm = stats.score(torch.tensor([1.0, 2.0]), spike_z=3.0)
    assert calm.include.tolist() == [True, True] and not calm.nonfinite.item() and not calm.spikes.any()
    assert calm.deviation.tolist() == pytest.approx((torch.tensor([1.0, 2.0]) - mean).tolist())  # not capped
    # a signal without a value this step (its placeholder): neither scored, nor folded in, nor non-finite
    masked = stats.score(torch.tensor([0.0, 2.0]), spike_z=3.0, watched=torch.tensor([False, True]))
    assert masked.include.tolist() == [False, True] and masked.finite.tolist() == [False, True]
    assert not masked.spikes.any() and not masked.nonfinite.item()


def run(stats: SpikeStats, values: list[float], spike_z: float = 6.0) -> list[bool]:
    """Score and fold in each value as the health monitor does; returns which were spikes."""
    spikes = []
    for v in values:
        scored = stats.score(torch.tensor([v]), spike_z)
        stats.update(scored.deviation, scored.include, scored.run)
        spikes.append(bool(scored.spikes.item()))
    return spikes


def test_a_lasting_shift_of_the_level_is_learnt_after_a_run_of_spikes() -> None:
    """A loss that settles 20% higher (new data, unfrozen layers) is a spike for ``new_level_after`` steps, then a
    new level, not a spike for ever: with response="skip" every later step would be skipped and the run would stop
    learning without an error."""
    g = torch.Generator().manual_seed(0)
    noise = (0.01 * torch.randn(300, generator=g)).tolist()
    values = [1.0 + n + (0.2 if i >= 100 else 0.0) for i, n in enumerate(noise)]
    spikes = run(SpikeStats(1, alpha=0.97, warmup=25, new_level_after=10), values)
    assert not any(spikes[:100])
    assert all(spikes[100:110]), spikes[100:110]  # ten spikes in a row, left out
    assert not any(spikes[110:]), [i for i, s in enumerate(spikes) if s]  # then a new level, taken in


def test_a_burst_of_spikes_leaves_the_statistics_as_they_were() -> None:
    """Ten consecutive outliers (a bad data shard) are left out: the next spike is found as if they never were."""
    g = torch.Generator().manual_seed(1)
    values = [1.0 + 0.01 * x for x in torch.randn(150, generator=g).tolist()]
    for i in range(60, 70):
        values[i] = 100.0
    values[120] = 1.2  # a 20-sigma spike, 50 steps after the burst
    stats = SpikeStats(1, alpha=0.97, warmup=25, new_level_after=10)
    spikes = run(stats, values)
    assert [i for i, s in enumerate(spikes) if s] == [*range(60, 70), 120]
    mean, std = stats.mean_std(torch.device("cpu"))
    assert abs(mean.item() - 1.0) < 0.01 and std.item() < 0.02


def test_a_signal_flat_through_the_warmup_does_not_make_every_later_change_a_spike() -> None:
    """Zero spread in the warmup: the std's floor (0.1% of the mean) keeps small moves from scoring as spikes,
    and a real jump that lasts is a run of spikes, then learnt."""
    flat = SpikeStats(1, alpha=0.97, warmup=25)
    assert not any(run(flat, [2.0] * 25 + [2.0 + 0.001 * (i % 5) for i in range(50)]))
    jump = SpikeStats(1, alpha=0.97, warmup=25)
    spikes = run(jump, [2.0] * 25 + [2.5] * 75)
    assert spikes[25] and not any(spikes[60:])


def test_a_checkpoint_from_before_the_std_floor_gets_it_on_resume() -> None:
    """A four-row checkpoint of a loss that never moved holds 1/(0 + eps) = 1e6: recomputed with the floor on load,
    a move of 0.1% is not a 2000-sigma spike on the first resumed step."""
    stats = SpikeStats(1, alpha=0.97, warmup=25)
    stats.load_state_dict({"alpha": 0.97, "warmup": 25, "state": [[2.0], [0.0], [30.0], [1e6]]})
    scored = stats.score(torch.tensor([2.002]), spike_z=6.0)
    assert scored.z.item() == pytest.approx(1.0, rel=1e-3) and not scored.spikes.item()


def test_a_signal_without_a_value_keeps_its_run() -> None:
    """No loss on every other step (e.g. manual optimization calling loss.backward() itself): the run of spikes
    of the steps that have one still reaches the limit, so a new level is still learnt."""
    stats = SpikeStats(2, alpha=0.97, warmup=5, new_level_after=3)
    both, grad_only = torch.tensor([True, True]), torch.tensor([False, True])
    spikes = []
    for i in range(40):
        loss = 1.0 + 0.01 * (i % 3) + (9.0 if i >= 10 else 0.0)
        watched = both if i % 2 == 0 else grad_only
        scored = stats.score(torch.tensor([loss if i % 2 == 0 else 0.0, 1.0 + 0.01 * (i % 2)]), 6.0, watched)
        stats.update(scored.deviation, scored.include, scored.run)
        spikes.append(bool(scored.spikes[0].item()))
    assert [i for i, s in enumerate(spikes) if s] == [10, 12, 14]


def test_a_checkpoint_restores_the_float32_state_exactly() -> None:
    """The 1/(std + eps) row is recomputed on load with the same float32 ops as in a step: a resumed run scores
    its first step exactly as the run that wrote the checkpoint would have."""
    g = torch.Generator().manual_seed(2)
    stats = SpikeStats(2, alpha=0.97, warmup=5)
    run(stats, [])  # nothing yet
    for v in (1.0 + 0.3 * torch.randn(200, 2, generator=g)).tolist():
        scored = stats.score(torch.tensor(v), 6.0)
        stats.update(scored.deviation, scored.include, scored.run)
    resumed = SpikeStats(2, alpha=0.97, warmup=5)
    resumed.load_state_dict(stats.state_dict())
    cpu = torch.device("cpu")
    assert torch.equal(resumed._ensure(cpu), stats._ensure(cpu))


def test_the_count_ignores_non_finite_values_and_can_be_off_per_signal() -> None:
    """A NaN is not below the threshold: the count stays. With ``new_level_after=(10, None)`` (the health monitor
    under response="clip", where ZClip always folds the clipped norm in) the second signal never becomes a new
    level: every value above its threshold stays a spike."""
    stats = SpikeStats(2, alpha=0.97, warmup=5, new_level_after=(3, None))
    for v in [1.0, 1.1, 0.9, 1.0, 1.05]:
        scored = stats.score(torch.tensor([v, v]), 6.0)
        stats.update(scored.deviation, scored.include, scored.run)
    spikes = []
    for v in [9.0, 9.0, math.nan, 9.0, 9.0, 9.0, 9.0]:
        scored = stats.score(torch.tensor([v, v]), 6.0)
        stats.update(scored.deviation, scored.include, scored.run)
        spikes.append(scored.spikes.tolist())
    assert [s[0] for s in spikes] == [True, True, False, True, False, False, False]  # NaN: no spike, count kept
    assert [s[1] for s in spikes] == [True, True, False, True, True, True, True]


def test_a_checkpoint_keeps_the_run_of_spikes() -> None:
    stats = SpikeStats(1, alpha=0.97, warmup=5, new_level_after=3)
    run(stats, [1.0, 1.1, 0.9, 1.0, 1.05, 9.0, 9.0])  # two spikes of a run so far
    resumed = SpikeStats(1, alpha=0.97, warmup=5, new_level_after=3)
    resumed.load_state_dict(stats.state_dict())
    assert run(resumed, [9.0, 9.0]) == run(stats, [9.0, 9.0])
    assert resumed.state_dict() == stats.state_dict()


def test_interval_mean_counts_finite_values_and_restarts_at_reset() -> None:
    mean = IntervalMean()
    mean.add(torch.tensor([1.0, math.nan]), torch.tensor([True, False]))
    got = mean.add(torch.tensor([math.inf, 4.0]), torch.tensor([False, True]))
    assert got[0].item() == 1.0 and got[1].item() == 4.0
    saved = mean.state_dict()
    mean.reset()
    assert math.isnan(mean.add(torch.tensor([0.0, 0.0]), torch.tensor([False, False]))[0].item())
    again = IntervalMean()
    again.load_state_dict(saved)
    assert again.add(torch.tensor([3.0, 0.0]), torch.tensor([True, False])).tolist() == [2.0, 4.0]


class HookOps(pl.Callback):
    """Counts the kernels each callback's ``on_before_optimizer_step`` dispatches, per step."""

    def __init__(self, callbacks: list[pl.Callback]) -> None:
        self.ops: dict[str, list[int]] = {type(cb).__name__: [] for cb in callbacks}
        for cb in callbacks:
            hook = cb.on_before_optimizer_step

            def counted(*args: Any, _hook: Any = hook, _name: str = type(cb).__name__) -> None:
                counter = OpCounter()
                with counter:
                    _hook(*args)
                self.ops[_name].append(counter.count)

            cb.on_before_optimizer_step = counted  # type: ignore[method-assign]


def test_a_step_of_the_monitors_costs_a_few_dozen_small_kernels() -> None:
    """The per-step device work of the preset's monitors, counted in a real fit: each op is a kernel launch on
    a GPU and a few microseconds of dispatch on a CPU. Budgets with a little headroom over today's count
    (GradientNormMonitor 13, TrainingHealthMonitor 61 with the ledger's vote enforcement, of which the count of
    values above the threshold, the cap at the threshold, the std's floor and the history's new-level flag are
    17): a change that adds ops to every step fails here and has to say why."""
    pl.seed_everything(0)
    callbacks: list[pl.Callback] = [GradientNormMonitor(max_norm=1.0), TrainingHealthMonitor(response="skip")]
    ops = HookOps(callbacks)
    trainer = quiet_trainer(max_steps=12, callbacks=callbacks, log_every_n_steps=50)
    trainer.fit(TinyModule())
    later = {name: counts[2:] for name, counts in ops.ops.items()}  # the first steps build constants
    assert max(later["GradientNormMonitor"]) <= 16, later
    assert max(later["TrainingHealthMonitor"]) <= 64, later


def test_a_huge_finite_value_in_the_warmup_does_not_switch_spike_detection_off() -> None:
    stats = SpikeStats(1, alpha=0.97, warmup=25)
    feed(stats, [1.0] * 10 + [1e20] + [1.0 + 0.01 * (i % 3) for i in range(4000)])
    assert math.isfinite(stats.mean_std(torch.device("cpu"))[1].item())
    assert stats.score(torch.tensor([10.0]), spike_z=6.0).spikes.item()  # the EMA has decayed the huge value


def test_statistics_keep_working_after_a_plain_pickle_round_trip() -> None:
    import pickle

    stats = SpikeStats(1, alpha=0.9, warmup=3)
    feed(stats, [1.0, 1.2, 0.9, 1.1])
    copy = pickle.loads(pickle.dumps(stats))
    feed(stats, [1.3])
    feed(copy, [1.3])
    assert copy.state_dict()["state"] == stats.state_dict()["state"]
    assert copy.mean_std(torch.device("cpu"))[0].item() == stats.mean_std(torch.device("cpu"))[0].item()
