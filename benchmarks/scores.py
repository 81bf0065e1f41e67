"""Pure: the stability scores of a learning-rate sweep, on host floats (the stability benchmark's figures).

* :func:`lr_sensitivity` -- Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
  instabilities" (arXiv 2309.14322): over a grid of learning rates,
  ``mean over the grid of min(final loss, initial loss)  -  min over the grid of the final loss``. A run that does
  better than not training at all counts at its final loss; a diverged one (NaN, inf, or above the initial loss)
  counts as the initial loss. Low is good: the loss hardly depends on the LR.
* :func:`spike_score` -- OLMo 2 (Team OLMo 2024, "2 OLMo 2 Furious", arXiv 2501.00656): the share of a run's
  steps whose value is more than ``sigmas`` standard deviations above the rolling mean of the ``window`` steps
  before it.
* :func:`max_trainable_lr` -- the largest LR of a grid at which every seed trains, "trains" being an explicit
  threshold the caller chooses (the benchmark's: the final loss finite and below the held-out bigram loss).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lightning_stability.errors import check_int, check_number, config_error


def capped_loss(final_loss: float, initial_loss: float) -> float:
    """``min(final_loss, initial_loss)``, a non-finite final loss counting as ``initial_loss`` (Wortsman et al.)."""
    return final_loss if math.isfinite(final_loss) and final_loss < initial_loss else initial_loss


def lr_sensitivity(final_losses: Sequence[Sequence[float]], initial_loss: float) -> float:
    """Wortsman et al. 2023's LR sensitivity of one arm of a sweep.

    Args:
        final_losses: per learning rate of the grid, the final losses of its seeds. Each LR's loss is the mean over
            its seeds of :func:`capped_loss` (a seed that diverged counts as ``initial_loss``).
        initial_loss: the loss before training (the same model at initialization).

    Returns:
        ``mean_lr(loss(lr)) - min_lr(loss(lr))``, >= 0.

    Raises:
        StabilityConfigError: for an empty grid, an LR without seeds or a non-finite ``initial_loss``.
    """
    per_lr = capped_means(final_losses, initial_loss)
    return sum(per_lr) / len(per_lr) - min(per_lr)


def best_final_loss(final_losses: Sequence[Sequence[float]], initial_loss: float) -> float:
    """The lowest over the grid of each LR's mean capped final loss (:func:`lr_sensitivity`'s minimum)."""
    return min(capped_means(final_losses, initial_loss))


def capped_means(final_losses: Sequence[Sequence[float]], initial_loss: float) -> list[float]:
    """Per LR, the mean over its seeds of :func:`capped_loss`."""
    if not math.isfinite(initial_loss):
        raise config_error("initial_loss", initial_loss, "must be finite", "pass the loss of the untrained model")
    if not final_losses or any(len(seeds) == 0 for seeds in final_losses):
        raise config_error(
            "final_losses", final_losses, "needs at least one LR and one seed per LR", "pass [[loss, ...], ...]"
        )
    return [sum(capped_loss(x, initial_loss) for x in seeds) / len(seeds) for seeds in final_losses]


def max_trainable_lr(lrs: Sequence[float], final_losses: Sequence[Sequence[float]], threshold: float) -> float | None:
    """The largest learning rate at which every seed trains: its final loss is finite and below ``threshold``.

    Args:
        lrs: the grid, in any order.
        final_losses: per LR (in the order of ``lrs``), the final losses of its seeds.
        threshold: the loss a run must end below to count as trained.

    Returns:
        That LR, or ``None`` when no LR of the grid trains on every seed.

    Raises:
        StabilityConfigError: when ``lrs`` and ``final_losses`` differ in length or an LR has no seeds.
    """
    if len(lrs) != len(final_losses) or any(len(seeds) == 0 for seeds in final_losses):
        raise config_error(
            "final_losses",
            final_losses,
            f"must hold one non-empty list of seeds per LR ({len(lrs)})",
            "pass one per LR",
        )
    trained = [
        lr
        for lr, seeds in zip(lrs, final_losses, strict=True)
        if all(math.isfinite(x) and x < threshold for x in seeds)
    ]
    return max(trained, default=None)


def spike_score(values: Sequence[float], window: int = 50, sigmas: float = 6.0) -> float:
    """The share of steps whose value is more than ``sigmas`` standard deviations above the rolling mean.

    Step ``t`` (from ``window`` on) is scored against the ``window`` values before it: it is a spike when
    ``values[t] > mean + sigmas * std`` (population standard deviation of the finite values of the window) or
    when ``values[t]`` is NaN/inf. Steps before the first full window are not scored.

    OLMo 2 rolls over the last 1,000 values of a run of hundreds of thousands of steps; a window of 50 suits the
    benchmark's runs of a few hundred.

    Args:
        values: a run's per-step losses (or gradient norms), in step order.
        window: how many previous steps make the rolling statistics.
        sigmas: how many standard deviations above the mean is a spike.

    Returns:
        spikes / scored steps, in [0, 1]; 0.0 when no step has a full window before it.
    """
    window = check_int("window", window, minimum=2, example="window=50")
    sigmas = check_number("sigmas", sigmas, example="6.0")
    scored = spikes = 0
    for t in range(window, len(values)):
        scored += 1
        value = values[t]
        if not math.isfinite(value):
            spikes += 1
            continue
        recent = [x for x in values[t - window : t] if math.isfinite(x)]
        if len(recent) < 2:
            continue
        mean = sum(recent) / len(recent)
        std = math.sqrt(sum((x - mean) ** 2 for x in recent) / len(recent))
        spikes += value > mean + sigmas * std
    return spikes / scored if scored else 0.0
