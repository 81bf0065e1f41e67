"""The loss-scale rule on the host: the steps whose overflow torch's ``step()`` already read there.

Host and device decisions must give the same scales, trackers, totals and checkpoints, step for step and
across every switch between them; a host-decided step runs no kernel unless the scale changes.
"""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from lightning_stability.amp.callback import LossScaleTuner
from lightning_stability.amp.rule import HostScaleState, ScaleRule, initial_state, update_scale, update_scale_host
from lightning_stability.amp.scaler import TunedGradScaler
from lightning_stability.grad_norm import GradientNormMonitor
from lightning_stability.ledger.skips import add_to_scaler_decision
from tests.helpers import OpCounter, TinyModule


def test_host_rule_equals_the_reference_step_for_step() -> None:
    rng = random.Random(0)
    rules = [ScaleRule(2.0, 0.5, 3, h, m, c) for h in (1, 2, 3) for m in (None, 1.0, 64.0) for c in (False, True)]
    # non-power-of-two factors round like float32 tensors; a growth past float32's range keeps the scale
    rules += [ScaleRule(1.5, 0.3, 1, 2, 0.7, False), ScaleRule(2.0**60, 0.5, 1, 1, None, False)]
    for rule in rules:
        for _ in range(10):
            reference = initial_state(256.0, rule)
            host = HostScaleState(256.0, 0, rule.hysteresis)
            for step in range(80):
                flag = rng.random() < 0.35
                expected = update_scale(reference, torch.tensor(float(flag)), rule)
                reference = expected.state
                floor_hit = update_scale_host(host, flag, rule)
                assert host.scale == float(reference.scale), (rule, step)
                assert host.growth_tracker == int(reference.growth_tracker), (rule, step)
                assert host.hysteresis_tracker == int(reference.hysteresis_tracker), (rule, step)
                assert floor_hit == bool(expected.floor_hit), (rule, step)


class _Stepper:
    """A scaler stepped as Lightning steps it: scale, backward, ``step`` (which unscales), ``update``.

    ``fused=True`` takes torch's fused-optimizer path, where the overflow stays on the device.
    """

    def __init__(self, fused: bool, **kwargs: Any) -> None:
        self.scaler = TunedGradScaler("cpu", **kwargs)
        self.param = nn.Parameter(torch.ones(3))
        self.opt = torch.optim.SGD([self.param], lr=0.0, fused=fused)

    def step(self, overflow: bool, vote: bool | None = None) -> None:
        self.opt.zero_grad()
        loss = self.param.sum() * (float("inf") if overflow else 1.0)
        self.scaler.scale(loss).backward()
        if vote is not None:  # a skip vote joins the flags, as the ledger casts one
            self.scaler.unscale_(self.opt)
            add_to_scaler_decision(self.scaler, self.opt, torch.tensor(vote))
        self.scaler.step(self.opt)
        self.scaler.update()

    def observed(self) -> dict[str, Any]:
        scaler = self.scaler
        state = scaler.state_dict()
        return {
            "scale": scaler.get_scale(),
            "state": {k: state[k] for k in ("scale", "_growth_tracker", "_hysteresis_tracker", "overflow_counts")},
            "overflows": int(scaler.overflow_steps),
            "floor_hits": int(scaler.floor_hits),
            "rate": float(scaler.overflow_rate()),
        }


def test_host_decided_steps_equal_device_decided_ones() -> None:
    kwargs = {"init_scale": 256.0, "growth_interval": 3, "hysteresis": 2, "min_scale": 64.0, "overflow_window": 4}
    host, device = _Stepper(False, **kwargs), _Stepper(True, **kwargs)
    flags = [1, 1, 1, 1, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]
    for step, flag in enumerate(flags):
        host.step(bool(flag))
        device.step(bool(flag))
        assert host.scaler.decides_on_host and not device.scaler.decides_on_host
        assert host.observed() == device.observed(), step


def test_a_vote_hands_the_state_to_the_device_and_a_logging_read_takes_it_back() -> None:
    kwargs = {"init_scale": 256.0, "growth_interval": 3, "hysteresis": 2, "min_scale": 64.0, "overflow_window": 4}
    mixed, device = _Stepper(False, **kwargs), _Stepper(True, **kwargs)
    for flag in (1, 0, 0, 0):
        mixed.step(bool(flag))
        device.step(bool(flag))
    assert mixed.scaler.decides_on_host
    # an overflow together with a vote: the host read cannot tell them apart, the device decides
    mixed.step(True, vote=True)
    device.step(True, vote=True)
    assert not mixed.scaler.decides_on_host
    mixed.step(False)  # stays on the device until a logging step reads the state back
    device.step(False)
    assert not mixed.scaler.decides_on_host
    state = mixed.scaler.device_state()
    assert state is not None
    mixed.scaler.to_host(state.tolist(), mixed.scaler.updates - 1)  # a read from before the last update: ignored
    assert not mixed.scaler.decides_on_host
    mixed.scaler.to_host(state.tolist(), mixed.scaler.updates)
    assert mixed.scaler.decides_on_host
    assert mixed.observed() == device.observed()
    for flag in (1, 1, 0, 0, 0, 1, 0, 0, 0, 0):
        mixed.step(bool(flag))
        device.step(bool(flag))
        assert mixed.observed() == device.observed()
    assert mixed.scaler.decides_on_host


def test_a_fused_optimizer_never_asks_for_the_state_back() -> None:
    device = _Stepper(True, init_scale=256.0)
    device.step(False)
    assert device.scaler.device_state() is None


def test_a_host_decided_update_runs_no_kernel_unless_the_scale_changes() -> None:
    stepper = _Stepper(False, init_scale=256.0, growth_interval=4)
    stepper.step(False)  # lazy initialisation
    ops = []
    for flag in (0, 0, 0, 1, 1, 0):  # the third finite step grows the scale; the second overflow backs off
        stepper.opt.zero_grad()
        stepper.scaler.scale(stepper.param.sum() * (float("inf") if flag else 1.0)).backward()
        stepper.scaler.step(stepper.opt)
        counter = OpCounter()
        with counter:
            stepper.scaler.update()
        ops.append(counter.count)
    assert ops == [0, 0, 1, 0, 1, 0]


def test_a_host_decided_checkpoint_and_pickle_carry_the_host_trackers() -> None:
    import pickle

    stepper = _Stepper(False, init_scale=256.0, growth_interval=10)
    for _ in range(5):
        stepper.step(False)
    stepper.step(True)  # one unit of hysteresis spent
    stepper.step(False)
    state = stepper.scaler.state_dict()
    assert (state["_growth_tracker"], state["_hysteresis_tracker"], state["overflow_steps"]) == (1, 1, 1)
    clone = pickle.loads(pickle.dumps(stepper.scaler))
    resumed = TunedGradScaler("cpu")
    resumed.load_state_dict(state)
    for scaler in (clone, resumed):
        other = _Stepper(False)
        other.scaler = scaler
        other.step(True)  # the second overflow backs off: the tracker came back as 1
        assert scaler.get_scale() == 128.0


class _Bursts(TinyModule):
    """Overflows in bursts, so hysteresis, backoffs and growth all happen within a short run."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.global_step in (3, 4, 9, 17, 18, 19) else loss


@pytest.mark.parametrize("votes", [False, True])
def test_lightning_runs_decide_alike_on_the_host_and_on_the_device(
    monkeypatch: pytest.MonkeyPatch, votes: bool
) -> None:
    """The whole stack (with GradientNormMonitor's skip votes joining the flags, or without): the same scales,
    overflow totals and weights whether the host decides or, with torch's own step read, the device does."""

    def run() -> tuple[list[float], list[float], torch.Tensor, list[bool]]:
        scales: list[float] = []
        overflows: list[float] = []
        on_host: list[bool] = []

        class Record(pl.Callback):
            def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
                metrics = trainer.callback_metrics
                scales.append(float(metrics["stability/loss_scale"]))
                overflows.append(float(metrics["stability/overflow_steps"]))
                on_host.append(tuner.scaler.decides_on_host)  # type: ignore[union-attr]

        torch.manual_seed(0)
        module = _Bursts(optimizer="adamw")
        tuner = LossScaleTuner(init_scale=2.0**8, growth_interval=3, fit_start_checks=False)
        callbacks: list[pl.Callback] = [tuner, Record()]
        if votes:
            callbacks.insert(0, GradientNormMonitor(max_norm=1.0))
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=30, log_every_n_steps=5, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        )  # fmt: skip
        trainer.fit(module)
        weights = torch.cat([p.detach().flatten() for p in module.parameters()])
        return scales, overflows, weights, on_host

    on_host = run()
    # with votes, an overflow step is decided on the device, and the next logging step takes the state back
    expected = [step not in (3, 17, 18) for step in range(30)] if votes else [True] * 30
    assert on_host[3] == expected
    monkeypatch.setattr(TunedGradScaler, "_maybe_opt_step", torch.amp.GradScaler._maybe_opt_step)
    on_device = run()
    assert on_host[0] == on_device[0]
    assert on_host[1] == on_device[1]
    assert on_host[1][-1] == 6.0
    assert torch.equal(on_host[2], on_device[2])
    assert not any(on_device[3])
