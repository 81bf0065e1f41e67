"""The sweep scores, on hand-computed cases."""

from __future__ import annotations

import math

import pytest

from benchmarks.scores import (
    best_final_loss,
    capped_loss,
    lr_sensitivity,
    max_trainable_lr,
    spike_score,
)
from lightning_stability.errors import StabilityConfigError


def test_capped_loss_counts_a_diverged_run_as_the_initial_loss() -> None:
    assert capped_loss(2.0, 4.0) == 2.0
    assert capped_loss(5.0, 4.0) == 4.0
    assert capped_loss(math.nan, 4.0) == 4.0
    assert capped_loss(math.inf, 4.0) == 4.0


def test_lr_sensitivity_by_hand() -> None:
    # LR 1: seeds 2.0 and 3.0 -> 2.5; LR 2: 1.5 and NaN (-> 4.0) -> 2.75; LR 3: 6.0 (-> 4.0) and 4.0 -> 4.0
    losses = [[2.0, 3.0], [1.5, math.nan], [6.0, 4.0]]
    mean = (2.5 + 2.75 + 4.0) / 3
    assert lr_sensitivity(losses, 4.0) == pytest.approx(mean - 2.5)
    assert best_final_loss(losses, 4.0) == pytest.approx(2.5)
    # a flat sweep is insensitive; a sweep where every LR diverges is too (nothing trained)
    assert lr_sensitivity([[1.0], [1.0]], 4.0) == 0.0
    assert lr_sensitivity([[math.nan], [9.0]], 4.0) == 0.0


def test_lr_sensitivity_refuses_an_empty_grid_or_a_bad_initial_loss() -> None:
    with pytest.raises(StabilityConfigError, match="final_losses"):
        lr_sensitivity([], 4.0)
    with pytest.raises(StabilityConfigError, match="final_losses"):
        lr_sensitivity([[1.0], []], 4.0)
    with pytest.raises(StabilityConfigError, match="initial_loss"):
        lr_sensitivity([[1.0]], math.nan)


def test_max_trainable_lr_needs_every_seed_below_the_threshold() -> None:
    lrs = [1e-3, 1e-2, 1e-1, 3e-1]
    losses = [[2.0, 2.1], [1.8, 1.9], [1.7, 3.5], [math.nan, 1.0]]
    assert max_trainable_lr(lrs, losses, 3.3) == 1e-2  # 1e-1: one seed at 3.5; 3e-1: one NaN
    assert max_trainable_lr(lrs, losses, 1.5) is None
    assert max_trainable_lr(list(reversed(lrs)), list(reversed(losses)), 3.3) == 1e-2  # order does not matter
    with pytest.raises(StabilityConfigError, match="one non-empty list of seeds per LR"):
        max_trainable_lr(lrs, losses[:2], 3.3)


def test_spike_score_by_hand() -> None:
    # window 4 of alternating 1, 3: mean 2, population std 1; 2 + 6 * 1 = 8
    base = [1.0, 3.0, 1.0, 3.0]
    assert spike_score([*base, 8.0], window=4) == 0.0  # 8 is not above 8
    assert spike_score([*base, 8.5], window=4) == 1.0
    # step 4 spikes; step 5 is scored against [3, 1, 3, 8.5]: mean 3.875, std ~2.74, no spike: 1 of 2
    assert spike_score([*base, 8.5, 3.0], window=4) == 0.5
    assert spike_score([*base, math.nan, 1.0], window=4) == 0.5  # a NaN step is a spike; NaN left out of the window
    assert spike_score(base, window=4) == 0.0  # no step has a full window before it
    assert spike_score([*base, 2.5], window=4, sigmas=0.4) == 1.0  # 2.5 > 2 + 0.4


def test_spike_score_refuses_bad_arguments() -> None:
    with pytest.raises(StabilityConfigError, match="window"):
        spike_score([1.0], window=1)
    with pytest.raises(StabilityConfigError, match="sigmas"):
        spike_score([1.0], sigmas=-1.0)
