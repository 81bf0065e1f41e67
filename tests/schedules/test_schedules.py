"""The pure LR multiplier functions: exact values at phase boundaries, errors, transformers definitions."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lightning_stability.errors import StabilityConfigError
from lightning_stability.schedules import (
    CosineSchedule,
    InverseSqrtSchedule,
    LinearSchedule,
    Schedule,
    StepSchedule,
    WarmupConstantCosineSchedule,
    check_multiplier,
    check_schedule_callable,
    cosine,
    inverse_sqrt,
    linear,
    resolve_steps,
    step_decay,
    warmup_constant_cosine,
)

HALF_COS_095 = 0.5 * (1 + math.cos(math.pi * 0.95))


# ------------------------------------------------------------------ boundary tables
@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.2),  # first update: 1/warmup, never 0
        (1, 0.4),
        (4, 1.0),  # last warmup update reaches the peak
        (5, 1.0),  # constant phase starts
        (79, 1.0),  # last constant update
        (80, 1.0),  # first decay update: progress 0
        (90, 0.5),  # half-way through the cosine
        (99, HALF_COS_095),  # last update of the run
        (100, 0.0),  # past the end: the floor
        (150, 0.0),
    ],
)
def test_warmup_constant_cosine_defaults(step: int, expected: float) -> None:
    # total 100: warmup 5 (5%), constant 75, cosine over the last 20 (the 100B-scale recipe)
    assert warmup_constant_cosine(step, 100) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("step", "expected"), [(0, 0.2), (80, 1.0), (90, 0.55), (99, 0.1 + 0.9 * HALF_COS_095), (100, 0.1)]
)
def test_warmup_constant_cosine_floor(step: int, expected: float) -> None:
    assert warmup_constant_cosine(step, 100, min_lr_ratio=0.1) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("step", "expected"), [(0, 0.1), (9, 1.0), (10, 1.0), (105, 0.5), (200, 0.0)])
def test_175b_recipe_is_cosine_with_warmup(step: int, expected: float) -> None:
    # warmup=0.05, decay=0.95 of 200 steps: 10 warmup, no constant phase, 190 cosine steps (the 175b preset)
    assert warmup_constant_cosine(step, 200, warmup=0.05, decay=0.95) == pytest.approx(expected, abs=1e-12)
    assert warmup_constant_cosine(step, 200, warmup=0.05, decay=0.95) == pytest.approx(
        cosine(step, 200, warmup=0.05), abs=1e-15
    )


@pytest.mark.parametrize(
    ("step", "expected"),
    [(0, 0.5), (1, 1.0), (2, 1.0), (6, 0.5), (9, 0.5 * (1 + math.cos(math.pi * 7 / 8))), (10, 0.0)],
)
def test_cosine(step: int, expected: float) -> None:
    assert cosine(step, 10, warmup=2) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("step", "expected"), [(0, 0.5), (1, 1.0), (2, 1.0), (6, 0.6), (9, 0.2 + 0.8 / 8), (10, 0.2), (11, 0.2)]
)
def test_linear(step: int, expected: float) -> None:
    assert linear(step, 10, warmup=2, min_lr_ratio=0.2) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("step", "expected"), [(0, 0.5), (1, 1.0), (2, 1.0), (4, 1.0), (5, 0.5), (7, 0.5), (8, 0.25), (11, 0.125)]
)
def test_step_every(step: int, expected: float) -> None:
    # warmup 2, then x0.5 every 3 updates counted from the end of warmup
    assert step_decay(step, gamma=0.5, every=3, warmup=2) == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize(("step", "expected"), [(0, 1.0), (3, 1.0), (4, 0.1), (5, 0.1), (6, 0.01), (100, 0.01)])
def test_step_milestones(step: int, expected: float) -> None:
    assert step_decay(step, gamma=0.1, milestones=[6, 4]) == pytest.approx(expected, rel=1e-12)


def test_step_floor_and_fractions() -> None:
    assert step_decay(8, gamma=0.5, every=3, warmup=2, min_lr_ratio=0.3) == 0.3
    # milestones as fractions of a 100-step run: drops at 50 and 75
    assert [step_decay(s, 0.5, milestones=[0.5, 0.75], total_steps=100) for s in (49, 50, 74, 75)] == [
        1,
        0.5,
        0.5,
        0.25,
    ]


@pytest.mark.parametrize(("step", "expected"), [(0, 0.25), (3, 1.0), (4, 1.0), (16, 0.5), (64, 0.25), (10_000, 0.02)])
def test_inverse_sqrt(step: int, expected: float) -> None:
    assert inverse_sqrt(step, warmup=4) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(("step", "expected"), [(0, 1.0), (3, 0.5), (99, 0.1)])
def test_inverse_sqrt_without_warmup(step: int, expected: float) -> None:
    assert inverse_sqrt(step) == pytest.approx(expected, abs=1e-12)
    assert inverse_sqrt(step, min_lr_ratio=0.4) == pytest.approx(max(0.4, expected), abs=1e-12)


def test_phases_never_overlap_and_first_update_nonzero() -> None:
    for total in (1, 2, 3, 7, 20, 101, 1000):
        values = [warmup_constant_cosine(s, total) for s in range(total)]
        assert values[0] > 0
        w = resolve_steps(0.05, total)
        # warmup strictly rising to exactly 1, then never above 1 and never rising again
        assert values[:w] == sorted(values[:w]) and (w == 0 or values[w - 1] == 1.0)
        assert all(a >= b for a, b in zip(values[w:], values[w + 1 :], strict=False))


def test_resolve_steps() -> None:
    assert resolve_steps(0.05, 1000) == 50
    assert resolve_steps(0.05, 10) == 0  # round(0.5) -> 0: no warmup on a 10-step run
    assert resolve_steps(0.0, None) == 0
    assert resolve_steps(7, None) == 7
    assert resolve_steps(7.0, 3) == 7


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: warmup_constant_cosine(0, 100, warmup=0.5, decay=0.6),
            r"`warmup \+ decay='50 \+ 60 steps'`.*overlap",
        ),
        (lambda: warmup_constant_cosine(0, 100, warmup=2.5), r"`warmup=2.5` is >= 1 but not a whole number"),
        (lambda: cosine(0, 100, warmup=-1), r"`warmup=-1` must be a fraction"),
        (lambda: cosine(0, 0), r"`total_steps=0` must be an int >= 1"),
        (lambda: linear(0, 10, min_lr_ratio=1.5), r"`min_lr_ratio=1.5` must be in \[0, 1\]"),
        (lambda: step_decay(0, gamma=0.0, every=3), r"`gamma=0.0` must be a finite number in \(0.0, 1.0\]"),
        (lambda: step_decay(0, gamma=0.5), r"`every/milestones=.*` must give exactly one"),
        (lambda: step_decay(0, gamma=0.5, every=2, milestones=[3]), r"must give exactly one"),
        (
            lambda: step_decay(5, gamma=0.5, milestones=[2], warmup=4),
            r"`milestones=\[2\]` has a drop at step 2, inside",
        ),
        (
            lambda: step_decay(0, gamma=0.5, every=0.1),
            r"`every=0.1` is a fraction of the run but the run length",
        ),
        (lambda: inverse_sqrt(0, warmup=0.1), r"`warmup=0.1` is a fraction .* Fix: pass total_steps"),
        (
            lambda: WarmupConstantCosineSchedule(warmup=0.5, decay=0.6),
            r"`warmup \+ decay=1.1` is more than the whole run",
        ),
        (lambda: WarmupConstantCosineSchedule()(0, None), r"`total_steps=None` is needed"),
        (lambda: CosineSchedule(warmup=1.5), r"`warmup=1.5` is >= 1 but not a whole number"),
        (lambda: LinearSchedule(min_lr_ratio=-0.1), r"`min_lr_ratio=-0.1` must be in"),
        (lambda: StepSchedule(gamma=2.0, every=10), r"`gamma=2.0` must be a finite number in"),
        (lambda: StepSchedule(), r"must give exactly one"),
        (lambda: InverseSqrtSchedule(warmup=True), r"`warmup=True` must be a fraction"),
    ],
)
def test_errors(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(StabilityConfigError, match=match):
        call()


def test_specs_match_functions_and_need_total() -> None:
    assert WarmupConstantCosineSchedule()(42, 100) == warmup_constant_cosine(42, 100)
    assert CosineSchedule(warmup=3, min_lr_ratio=0.1)(7, 20) == cosine(7, 20, 3, 0.1)
    assert LinearSchedule(warmup=0.1)(7, 20) == linear(7, 20, 0.1)
    assert StepSchedule(gamma=0.5, every=3)(7, None) == step_decay(7, 0.5, every=3)
    assert InverseSqrtSchedule(warmup=4)(16, None) == 0.5
    assert WarmupConstantCosineSchedule().needs_total_steps
    assert not StepSchedule(gamma=0.5, every=3).needs_total_steps
    assert StepSchedule(gamma=0.5, milestones=(0.5,)).needs_total_steps
    assert not InverseSqrtSchedule(warmup=100).needs_total_steps
    assert InverseSqrtSchedule(warmup=0.1).needs_total_steps


# ------------------------------------------------------------------ the transformers definitions
# Written from the formulas documented for transformers' schedules (LambdaLR factors at scheduler step s;
# the n-th update uses s = n). The importorskip test below checks them against transformers itself.
def hf_linear(s: int, warmup: int, total: int) -> float:
    if s < warmup:
        return s / max(1, warmup)
    return max(0.0, (total - s) / max(1, total - warmup))


def hf_cosine(s: int, warmup: int, total: int, min_lr_rate: float = 0.0) -> float:
    if s < warmup:
        return s / max(1, warmup)
    progress = (s - warmup) / max(1, total - warmup)
    factor = max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return factor * (1 - min_lr_rate) + min_lr_rate


def hf_wsd(s: int, warmup: int, stable: int, decay: int, min_lr_ratio: float = 0.0) -> float:
    if s < warmup:
        return (s / max(1, warmup)) * (1 - min_lr_ratio) + min_lr_ratio
    if s < warmup + stable:
        return 1.0
    if s < warmup + stable + decay:
        progress = (s - warmup - stable) / max(1, decay)
        return 0.5 * (1 + math.cos(math.pi * progress)) * (1 - min_lr_ratio) + min_lr_ratio
    return min_lr_ratio


def hf_inverse_sqrt(s: int, warmup: int) -> float:
    if s < warmup:
        return s / max(1, warmup)
    return 1.0 / math.sqrt((s + 0) / warmup)  # timescale = warmup: shift = 0


def _ours_vs_hf(ours, hf, warmup: int, steps: int) -> None:  # type: ignore[no-untyped-def]
    for n in range(steps):
        # the documented difference: during warmup ours is one step ahead (first update non-zero)
        expected = hf(n + 1) if n < warmup else hf(n)
        assert ours(n) == pytest.approx(expected, abs=1e-12), n


def test_matches_transformers_definitions_after_warmup() -> None:
    t, w = 50, 5
    _ours_vs_hf(lambda n: linear(n, t, warmup=w), lambda s: hf_linear(s, w, t), w, t)
    _ours_vs_hf(lambda n: cosine(n, t, warmup=w), lambda s: hf_cosine(s, w, t), w, t)
    _ours_vs_hf(lambda n: cosine(n, t, warmup=w, min_lr_ratio=0.1), lambda s: hf_cosine(s, w, t, 0.1), w, t)
    # WSD: warmup 5, stable 35, decay 10 (plus steps past the end, where both hold the floor)
    _ours_vs_hf(lambda n: warmup_constant_cosine(n, 50, warmup=5, decay=10), lambda s: hf_wsd(s, 5, 35, 10), 5, 60)
    _ours_vs_hf(lambda n: inverse_sqrt(n, warmup=w), lambda s: hf_inverse_sqrt(s, w), w, 200)


def test_wsd_floor_difference_is_only_in_warmup() -> None:
    # transformers' WSD lifts warmup to start at min_lr_ratio; ours does not floor warmup.
    ours = [warmup_constant_cosine(n, 50, warmup=5, decay=10, min_lr_ratio=0.2) for n in range(60)]
    theirs = [hf_wsd(n, 5, 35, 10, 0.2) for n in range(60)]
    assert ours[5:] == pytest.approx(theirs[5:], abs=1e-12)
    assert ours[0] == pytest.approx(0.2) and theirs[0] == pytest.approx(0.2)  # coincidence at n=0 ...
    assert ours[1] == pytest.approx(0.4) and theirs[1] == pytest.approx(0.2 + 0.8 * 0.2)  # ... not after


def _lambda_values(scheduler, steps: int) -> list[float]:  # type: ignore[no-untyped-def]
    return [scheduler.lr_lambdas[0](s) for s in range(steps)]


def test_reference_formulas_equal_transformers() -> None:
    opt_mod = pytest.importorskip("transformers.optimization")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    t, w = 50, 5
    cases = [
        (opt_mod.get_linear_schedule_with_warmup(opt, w, t), lambda s: hf_linear(s, w, t), t),
        (opt_mod.get_cosine_schedule_with_warmup(opt, w, t), lambda s: hf_cosine(s, w, t), t),
        (
            opt_mod.get_cosine_with_min_lr_schedule_with_warmup(opt, w, t, min_lr_rate=0.1),
            lambda s: hf_cosine(s, w, t, 0.1),
            t,
        ),
        (
            opt_mod.get_wsd_schedule(opt, w, 10, num_stable_steps=35, min_lr_ratio=0.2),
            lambda s: hf_wsd(s, w, 35, 10, 0.2),
            60,
        ),
        (opt_mod.get_inverse_sqrt_schedule(opt, w, timescale=w), lambda s: hf_inverse_sqrt(s, w), 200),
    ]
    for scheduler, reference, steps in cases:
        assert _lambda_values(scheduler, steps) == pytest.approx([reference(s) for s in range(steps)], abs=1e-12)


# ---------------------------------------------------------------------------------------------- every run length
FRACTION_PAIRS = [(0.1, 0.9), (0.5, 0.5), (0.05, 0.95), (0.05, 0.2), (0.3, 0.7), (0.0, 1.0), (0.25, 0.75)]


def _check_curve(values: list[float], warmup_end: int, decay_start: int) -> None:
    """Finite, in [0, 1]; rising through warmup, flat at the peak, then never rising again."""
    assert all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in values), values
    assert all(a < b for a, b in itertools.pairwise(values[:warmup_end]))
    assert all(v == 1.0 for v in values[warmup_end:decay_start])
    tail = values[decay_start:]
    assert all(b <= a for a, b in itertools.pairwise(tail))


@pytest.mark.parametrize(("warmup", "decay"), FRACTION_PAIRS)
def test_fractions_adding_up_to_at_most_one_work_for_every_run_length(warmup: float, decay: float) -> None:
    spec = WarmupConstantCosineSchedule(warmup=warmup, decay=decay)
    for total in range(1, 5001):
        w = round(warmup * total)
        first = spec(0, total)
        assert 0.0 < first <= 1.0 or (w == 0 and first == 1.0), (total, first)  # never 0 on the first update
        if total <= 300:  # the whole curve
            values = [spec(n, total) for n in range(total)]
            decay_start = next((n for n in range(w, total) if values[n] < 1.0), total)
            _check_curve(values, w, decay_start)
            assert min(values[:w], default=1.0) == values[0]
        else:  # phase boundaries
            for n in {0, max(w - 1, 0), w, total - 1}:
                assert 0.0 <= spec(n, total) <= 1.0


@pytest.mark.parametrize(
    "spec",
    [CosineSchedule(warmup=0.1), LinearSchedule(warmup=0.3, min_lr_ratio=0.1), CosineSchedule(warmup=0.05)],
)
def test_decay_schedules_with_fractional_warmup_work_for_every_run_length(spec: Schedule) -> None:
    for total in range(1, 2001):
        values = [spec(n, total) for n in (0, total // 2, total - 1)]
        assert all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in values), total
        assert values[0] > 0.0


def test_step_and_inverse_sqrt_with_fractional_warmup_for_every_run_length() -> None:
    steps, inv = StepSchedule(gamma=0.5, every=0.25, warmup=0.1), InverseSqrtSchedule(warmup=0.1)
    for total in range(1, 2001):
        for n in (0, total // 3, total - 1):
            assert 0.0 < steps(n, total) <= 1.0 and 0.0 < inv(n, total) <= 1.0, (total, n)


def test_a_real_overlap_is_still_an_error() -> None:
    with pytest.raises(StabilityConfigError, match=r"warmup \+ decay.*exceeds total_steps=1000"):
        WarmupConstantCosineSchedule(warmup=500, decay=0.9)(0, 1000)


def test_rounding_gives_the_overshooting_step_to_the_warmup() -> None:
    # 0.1 + 0.9 of 15 steps: 2 warmup steps (1.5 rounds to 2), then the decay over the 13 steps left
    spec = WarmupConstantCosineSchedule(warmup=0.1, decay=0.9)
    assert [spec(n, 15) for n in (0, 1)] == [0.5, 1.0]
    assert spec(2, 15) == 1.0 and spec(3, 15) < 1.0


# ---------------------------------------------------------------------------------------------- user schedules
def test_check_schedule_callable() -> None:
    import functools

    check_schedule_callable(lambda step, total: 1.0)
    check_schedule_callable(lambda step, total=None: 1.0)
    check_schedule_callable(lambda *args: 1.0)
    check_schedule_callable(functools.partial(lambda a, step, total: a, 1.0))
    check_schedule_callable(CosineSchedule())
    check_schedule_callable(max)  # a builtin without a readable signature: accepted, checked at the first call
    for bad in (lambda step: 1.0, lambda: 1.0, lambda step, total, extra: 1.0, lambda step, *, total: 1.0):
        with pytest.raises(
            StabilityConfigError, match=r"`schedule=.*cannot be called as schedule\(step, total_steps\)"
        ):
            check_schedule_callable(bad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5, "1.0", None, True])
def test_check_multiplier_rejects_what_is_not_a_usable_multiplier(bad: object) -> None:
    with pytest.raises(StabilityConfigError, match=r"step 7"):
        check_multiplier(bad, 7, "my_schedule")


def test_check_multiplier_accepts_numbers_and_0_dim_tensors() -> None:
    assert check_multiplier(0, 0, "s") == 0.0
    assert check_multiplier(0.5, 0, "s") == 0.5
    assert check_multiplier(torch.tensor(0.25), 0, "s") == 0.25
