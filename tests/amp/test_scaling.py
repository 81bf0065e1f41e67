"""The pure loss-scale rule of lightning_stability.amp.rule, step by step, without a Trainer."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lightning_stability.amp.rule import (
    AUTO_EMPTY_SCALE,
    AUTO_MAX_SCALE,
    ScaleRule,
    ScaleState,
    auto_initial_scale,
    initial_state,
    update_scale,
)
from lightning_stability.errors import StabilityConfigError
from tests.helpers import SyncCounter


def run_rule(rule: ScaleRule, init: float, flags: list[int]) -> list[tuple[float, int, int, bool]]:
    """(scale, growth tracker, hysteresis tracker, floor hit) after each step."""
    state = initial_state(init, rule)
    out = []
    for flag in flags:
        state, overflow, _, floor_hit = update_scale(state, torch.tensor(float(flag)), rule)
        assert bool(overflow) == bool(flag)
        out.append((state.scale.item(), int(state.growth_tracker), int(state.hysteresis_tracker), bool(floor_hit)))
    return out


class MegatronStyleReference:
    """A host-side transcription of the rule as Megatron-LM / DeepSpeed describe it, used as an oracle."""

    def __init__(self, rule: ScaleRule, init: float) -> None:
        self.rule, self.scale, self.growth, self.hyst = rule, init, 0, rule.hysteresis

    def update(self, overflow: bool) -> tuple[float, bool]:
        r, floor_hit = self.rule, False
        if overflow:
            self.growth = 0
            self.hyst -= 1
            if self.hyst <= 0:
                self.hyst = 0
                lowered = self.scale * r.backoff_factor
                if r.min_scale is not None and lowered < r.min_scale:
                    floor_hit, lowered = True, r.min_scale
                self.scale = lowered
        else:
            self.growth += 1
            if r.consecutive_hysteresis:
                self.hyst = r.hysteresis
            if self.growth == r.growth_interval:
                self.growth = 0
                self.hyst = r.hysteresis
                if self.scale * r.growth_factor <= torch.finfo(torch.float32).max:  # finite in fp32
                    self.scale *= r.growth_factor
        return self.scale, floor_hit


# ---------------------------------------------------------------------- exact tables
# flags: 1 = the step overflowed. Expected: the scale after each step.
FLAGS = [0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0]
TABLE = [
    # hysteresis 1 = torch: every overflow halves, 3 finite steps double
    (1, [256, 128, 64, 32, 32, 32, 64, 32, 16, 16, 16, 32]),
    # hysteresis 2: the first overflow after a growth is tolerated
    (2, [256, 256, 128, 64, 64, 64, 128, 128, 64, 64, 64, 128]),
    # hysteresis 3: two tolerated
    (3, [256, 256, 256, 128, 128, 128, 256, 256, 256, 256, 256, 512]),
]


@pytest.mark.parametrize(("hysteresis", "expected"), TABLE)
def test_scale_trace_table(hysteresis: int, expected: list[float]) -> None:
    rule = ScaleRule(growth_interval=3, hysteresis=hysteresis, min_scale=None)
    assert [s for s, *_ in run_rule(rule, 256.0, FLAGS)] == expected


def test_trackers_step_by_step_hysteresis_2() -> None:
    rule = ScaleRule(growth_interval=3, hysteresis=2, min_scale=None)
    got = [(g, h) for _, g, h, _ in run_rule(rule, 256.0, FLAGS)]
    assert got == [
        (1, 2),
        (0, 1),
        (0, 0),
        (0, 0),
        (1, 0),
        (2, 0),
        (0, 2),
        (0, 1),
        (0, 0),
        (1, 0),
        (2, 0),
        (0, 2),
    ]


def test_consecutive_hysteresis_refills_after_every_finite_step() -> None:
    rule = ScaleRule(growth_interval=100, hysteresis=2, min_scale=None, consecutive_hysteresis=True)
    # overflow, finite, overflow: never two in a row, so never a backoff
    assert [s for s, *_ in run_rule(rule, 64.0, [1, 0, 1, 0, 1, 1])] == [64, 64, 64, 64, 64, 32]
    plain = ScaleRule(growth_interval=100, hysteresis=2, min_scale=None)
    assert [s for s, *_ in run_rule(plain, 64.0, [1, 0, 1, 0, 1, 1])] == [64, 64, 32, 32, 16, 8]


def test_floor_clamps_and_reports_the_stopped_backoff() -> None:
    rule = ScaleRule(growth_interval=1000, hysteresis=1, min_scale=4.0)
    got = run_rule(rule, 16.0, [1, 1, 1, 1])
    assert [s for s, *_ in got] == [8, 4, 4, 4]
    assert [hit for *_, hit in got] == [False, False, True, True]


def test_floor_hit_only_when_the_backoff_is_due() -> None:
    # at the floor, a tolerated overflow (hysteresis) is not a floor hit; the second one is
    rule = ScaleRule(growth_interval=1000, hysteresis=2, min_scale=1.0)
    got = run_rule(rule, 1.0, [1, 1])
    assert [hit for *_, hit in got] == [False, True]
    assert [s for s, *_ in got] == [1.0, 1.0]


def test_growth_never_overflows_fp32() -> None:
    rule = ScaleRule(growth_interval=1, hysteresis=1, min_scale=None)
    got = run_rule(rule, 3e38, [0, 0])
    assert [s for s, *_ in got] == pytest.approx([3e38, 3e38])
    assert [g for _, g, _, _ in got] == [0, 0]  # the tracker restarts, as in torch


# ---------------------------------------------------------------------- torch equivalence
@pytest.mark.parametrize("seed", range(6))
def test_hysteresis_1_without_floor_equals_torch(seed: int) -> None:
    rng = random.Random(seed)
    interval = rng.choice([1, 2, 3, 5])
    init = rng.choice([2.0**16, 1.0, 3e38])
    flags = [int(rng.random() < 0.3) for _ in range(200)]
    rule = ScaleRule(growth_interval=interval, hysteresis=1, min_scale=None)
    ours = [(s, g) for s, g, _, _ in run_rule(rule, init, flags)]

    scale = torch.full((), init, dtype=torch.float32)
    growth = torch.zeros((), dtype=torch.int32)
    theirs = []
    for flag in flags:
        torch._amp_update_scale_(scale, growth, torch.tensor(float(flag)), 2.0, 0.5, interval)
        theirs.append((scale.item(), int(growth)))
    assert ours == theirs


@pytest.mark.parametrize("seed", range(8))
def test_matches_megatron_style_reference(seed: int) -> None:
    rng = random.Random(100 + seed)
    rule = ScaleRule(
        growth_factor=rng.choice([2.0, 4.0]),
        backoff_factor=rng.choice([0.5, 0.25]),
        growth_interval=rng.choice([1, 2, 4]),
        hysteresis=rng.choice([1, 2, 3]),
        min_scale=rng.choice([None, 1.0, 64.0]),
        consecutive_hysteresis=rng.choice([False, True]),
    )
    flags = [int(rng.random() < 0.4) for _ in range(300)]
    ref = MegatronStyleReference(rule, 2.0**10)
    expected = [ref.update(bool(f)) for f in flags]
    got = [(s, hit) for s, _, _, hit in run_rule(rule, 2.0**10, flags)]
    assert got == expected


def test_update_is_pure_and_sync_free() -> None:
    rule = ScaleRule(growth_interval=2, hysteresis=2)
    state = initial_state(8.0, rule)
    before = [t.clone() for t in state]
    with SyncCounter() as counter:
        result = update_scale(state, torch.tensor(1.0), rule)
        result = update_scale(result.state, torch.tensor(0.0), rule)
    assert counter.count == 0
    assert all(torch.equal(a, b) for a, b in zip(before, state, strict=True))
    assert isinstance(result.state, ScaleState)


# ---------------------------------------------------------------------- auto initial scale
@pytest.mark.parametrize(
    ("max_abs", "expected"),
    [
        (100.0, 64.0),  # 65504 / 800 = 81.9 -> 64
        (65504.0 / 8 / 2**10, 2.0**10),  # exactly on a power of two
        (65504.0 / 8 / 2**10 * 1.001, 2.0**9),  # just above it
        (1.0, 4096.0),
        (1e-3, 2.0**22),  # 65504 / 8e-3 = 8.19e6 < 2**23
        (1e-20, AUTO_MAX_SCALE),  # capped
        (0.0, AUTO_EMPTY_SCALE),  # nothing measurable
        (1e6, 2.0**-7),  # huge gradients: below 1 without a floor
    ],
)
def test_auto_initial_scale_table(max_abs: float, expected: float) -> None:
    assert auto_initial_scale(torch.tensor(max_abs)).item() == expected


def test_auto_initial_scale_keeps_headroom_and_respects_the_floor() -> None:
    rng = random.Random(0)
    peaks = [3e-6, 0.02, 7.5, 123.0, 4000.0] + [10 ** rng.uniform(-5, 3.5) for _ in range(300)]
    peaks += [65504.0 / 8 / 2.0**k for k in range(-2, 16)]  # exact boundaries
    for peak in peaks:
        peak = torch.tensor(peak).item()  # the float32 value the function sees
        s = auto_initial_scale(torch.tensor(peak), headroom=8.0).item()
        assert 8 * peak * s <= 65504 < 8 * peak * s * 2  # the largest power of two that fits
        assert math.log2(s).is_integer()
    assert auto_initial_scale(torch.tensor(1e6), min_scale=1.0).item() == 1.0
    assert auto_initial_scale(torch.tensor(100.0), headroom=1.0).item() == 512.0


# ---------------------------------------------------------------------- configuration errors
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"growth_factor": 1.0}, r"`growth_factor=1.0` must be a finite number > 1"),
        ({"growth_factor": "2"}, r"`growth_factor='2'`"),
        ({"backoff_factor": 1.0}, r"`backoff_factor=1.0` must be a finite number in \(0.0, 1.0\)"),
        ({"backoff_factor": 0}, r"`backoff_factor=0`"),
        ({"growth_interval": 0}, r"`growth_interval=0` must be an int >= 1"),
        ({"growth_interval": 2.5}, r"`growth_interval=2.5`"),
        ({"hysteresis": 0}, r"`hysteresis=0` must be an int >= 1"),
        ({"hysteresis": True}, r"`hysteresis=True`"),
        ({"min_scale": 0.0}, r"`min_scale=0.0` must be a finite number > 0.*or None"),
        ({"min_scale": math.inf}, r"`min_scale=inf`"),
        ({"consecutive_hysteresis": 1}, r"`consecutive_hysteresis=1` must be a bool"),
    ],
)
def test_rule_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        ScaleRule(**kwargs)  # type: ignore[arg-type]


def test_in_place_fused_rule_equals_the_reference_step_for_step() -> None:
    """update_scale_ (torch's fused kernel + a few ops, what the scaler runs) == update_scale (the reference)."""
    import random

    from lightning_stability.amp.rule import fused_state, update_scale_

    rng = random.Random(0)
    rules = [ScaleRule(2.0, 0.5, 3, h, m, c) for h in (1, 2, 3) for m in (None, 1.0, 64.0) for c in (False, True)]
    rules.append(ScaleRule(4.0, 0.25, 2, 2, 0.5, False))
    for rule in rules:
        for _ in range(10):
            reference = initial_state(256.0, rule)
            fused = fused_state(torch.tensor(256.0), torch.zeros((), dtype=torch.int32), rule.hysteresis, rule)
            counts = torch.zeros(61, 2)
            overflows = floor_hits = 0
            for step in range(60):
                flag = torch.tensor(float(rng.random() < 0.35))
                expected = update_scale(reference, flag, rule)
                reference = expected.state
                update_scale_(fused, flag, rule, counts[step], counts[step + 1])
                assert torch.equal(reference.scale, fused.scale), (rule, step)
                assert torch.equal(reference.growth_tracker, fused.growth_tracker), (rule, step)
                # the in-place tracker is floored at 1: the reference's 0 and 1 both mean "the next overflow backs off"
                assert max(int(reference.hysteresis_tracker), 1) == int(fused.hysteresis_tracker), (rule, step)
                overflows += int(expected.overflow)
                floor_hits += int(expected.floor_hit)
                assert counts[step + 1].tolist() == [overflows, floor_hits], (rule, step)
