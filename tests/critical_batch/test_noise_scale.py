"""The pure parts: the two-batch estimator, its averages and ratio, and the ramp's rules, without a Trainer."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_stability.critical_batch.noise_scale import (
    FIELDS,
    critical_batch,
    ema_update,
    new_state,
    two_batch_estimates,
)
from lightning_stability.critical_batch.ramp import beta2_at, grown_factor, half_life_samples


def test_two_batch_estimates_invert_the_expected_norms() -> None:
    """E|G_b|^2 = |G|^2 + tr(Sigma)/b: given the expected norms at two sizes, the estimator gives both parts back."""
    g2, trace = 3.0, 48.0
    small, big = 4, 32
    small_sq = torch.tensor(g2 + trace / small)
    big_sq = torch.tensor(g2 + trace / big)
    est_g2, est_trace = two_batch_estimates(small_sq, big_sq, small, big)
    torch.testing.assert_close(est_g2, torch.tensor(g2))
    torch.testing.assert_close(est_trace, torch.tensor(trace))


def test_two_batch_estimates_are_unbiased_on_sampled_gradients() -> None:
    """Per-sample gradients drawn around a true gradient: the averaged estimates approach |G|^2 and tr(Sigma)."""
    gen = torch.Generator().manual_seed(0)
    dim, small, big, trials = 16, 2, 16, 4000
    true = torch.randn(dim, generator=gen, dtype=torch.float64)
    scale = 3.0
    samples = true + scale * torch.randn(trials, big, dim, generator=gen, dtype=torch.float64)
    small_sq = samples[:, :small].mean(1).pow(2).sum(1)
    big_sq = samples.mean(1).pow(2).sum(1)
    g2, trace = two_batch_estimates(small_sq, big_sq, small, big)
    assert abs(g2.mean().item() - true.pow(2).sum().item()) / true.pow(2).sum().item() < 0.1
    assert abs(trace.mean().item() - scale**2 * dim) / (scale**2 * dim) < 0.05


def test_two_batch_estimates_need_a_smaller_batch() -> None:
    with pytest.raises(ValueError, match="needs 0 < small < big"):
        two_batch_estimates(torch.tensor(1.0), torch.tensor(1.0), 8, 8)


def test_averages_follow_the_ema_and_the_ratio_has_no_bias_correction_left() -> None:
    state = new_state()
    assert state.shape == (len(FIELDS),)
    for g2, trace in [(2.0, 10.0), (4.0, 12.0), (3.0, 9.0)]:
        state = ema_update(state, torch.tensor(g2), torch.tensor(trace), 0.5)
    # weights 0.125, 0.25, 0.5 for the three steps, sum 0.875
    g = (0.125 * 2 + 0.25 * 4 + 0.5 * 3) / 0.875
    t = (0.125 * 10 + 0.25 * 12 + 0.5 * 9) / 0.875
    value, stderr = critical_batch(state)
    torch.testing.assert_close(value, torch.tensor(t / g))
    assert math.isfinite(stderr.item()) and stderr.item() > 0
    torch.testing.assert_close(state[0], torch.tensor(0.875))
    torch.testing.assert_close(state[1], torch.tensor(0.328125))  # 0.5^2 + 0.25^2 + 0.125^2


def test_constant_estimates_have_no_error() -> None:
    state = new_state()
    for _ in range(5):
        state = ema_update(state, torch.tensor(2.0), torch.tensor(64.0), 0.9)
    value, stderr = critical_batch(state)
    torch.testing.assert_close(value, torch.tensor(32.0))
    assert stderr.item() == pytest.approx(0.0, abs=1e-3)


def test_invalid_or_non_finite_steps_leave_the_averages() -> None:
    state = ema_update(new_state(), torch.tensor(2.0), torch.tensor(8.0), 0.9)
    assert torch.equal(ema_update(state, torch.tensor(5.0), torch.tensor(5.0), 0.9, torch.tensor(False)), state)
    assert torch.equal(ema_update(state, torch.tensor(5.0), torch.tensor(5.0), 0.9, False), state)
    assert torch.equal(ema_update(state, torch.tensor(float("inf")), torch.tensor(5.0), 0.9), state)
    assert torch.equal(ema_update(state, torch.tensor(1.0), torch.tensor(float("nan")), 0.9), state)


def test_no_gradient_signal_is_an_infinite_critical_batch_and_none_yet_is_nan() -> None:
    state = ema_update(new_state(), torch.tensor(-1.0), torch.tensor(8.0), 0.9)
    value, stderr = critical_batch(state)
    assert math.isinf(value.item()) and math.isinf(stderr.item())
    assert math.isnan(critical_batch(new_state())[0].item())


@pytest.mark.parametrize(
    ("factor", "critical", "expected"),
    [
        (2, 300.0, 4),  # 4 x 64 <= 300: doubles
        (4, 300.0, 4),  # 8 x 64 > 300: stays (the batch never passes the figure)
        (4, 512.0, 8),  # 8 x 64 <= 512
        (8, 300.0, 8),  # 300 <= 8 x 64
        (4, 200.0, 4),  # 200 <= 256: stays
        (16, 1e9, 16),  # at the bound
        (12, 1e9, 16),  # capped at the bound
        (2, math.nan, 2),  # nothing measured: stays
        (2, math.inf, 2),  # the averaged |G|^2 is not positive yet: stays
    ],
)
def test_grown_factor(factor: int, critical: float, expected: int) -> None:
    assert grown_factor(factor, critical, global_micro_batch=64, max_factor=16, growth=2) == expected


@pytest.mark.parametrize(
    ("critical", "stderr", "fraction", "confidence", "expected"),
    [
        (512.0, 0.0, 0.5, 0.0, 4),  # 4 x 64 = 256 <= 0.5 x 512: doubles
        (500.0, 0.0, 0.5, 0.0, 2),  # 256 > 250: stays
        (1024.0, 200.0, 0.5, 1.0, 4),  # 256 <= 0.5 x (1024 - 200)
        (1024.0, 600.0, 0.5, 1.0, 2),  # 256 > 0.5 x (1024 - 600): too uncertain
        (1024.0, 2000.0, 0.5, 1.0, 2),  # the lower bound below 0: stays
        (1024.0, math.nan, 0.5, 1.0, 2),  # no error known: stays
        (1024.0, math.nan, 0.5, 0.0, 4),  # ... unless no confidence is asked
    ],
)
def test_grown_factor_keeps_the_batch_below_a_share_of_the_lower_bound(
    critical: float, stderr: float, fraction: float, confidence: float, expected: int
) -> None:
    """From 2 micro-batches of 64 samples: grown to 4 (256 samples) or kept."""
    assert grown_factor(2, critical, 64, 16, 2, stderr=stderr, fraction=fraction, confidence=confidence) == expected


def test_beta2_keeps_its_half_life_in_samples() -> None:
    for factor in (2, 4, 8, 32):
        beta2 = beta2_at(0.95, factor, base_factor=2)
        assert half_life_samples(beta2, factor * 64) == pytest.approx(half_life_samples(0.95, 2 * 64))
    assert beta2_at(0.999, 2, 2) == 0.999
    assert half_life_samples(1.0, 8) == math.inf
