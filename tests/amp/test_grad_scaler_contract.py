"""TunedGradScaler keeps torch's GradScaler contract where torch's own device-generic tests exercise it.

The cases follow PyTorch's grad-scaling tests (`test/test_torch.py`, `test_grad_scaling_*`), rewritten here:
each runs torch's `GradScaler` and `TunedGradScaler(hysteresis=1, min_scale=None)` (torch's rule) side by
side, and both must behave alike, including the calls torch's tests make before any `scale()`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_stability import TunedGradScaler

Factory = Callable[..., torch.amp.GradScaler]
SCALERS: dict[str, Factory] = {
    "torch": lambda **kw: torch.amp.GradScaler("cpu", **kw),
    "tuned": lambda **kw: TunedGradScaler("cpu", hysteresis=1, min_scale=None, **kw),
}


@pytest.fixture(params=sorted(SCALERS))
def make(request: pytest.FixtureRequest) -> Factory:
    return SCALERS[request.param]


def _mixed_grads(inject_inf: int) -> list[torch.Tensor]:
    """Gradients of mixed dtypes and layouts (dense fp32/fp16, sparse), each 4.0; optionally one inf."""
    grads = [
        torch.full((5, 5), 4.0, dtype=torch.float32),
        torch.full((5, 5), 4.0, dtype=torch.float16),
        torch.full((7,), 4.0, dtype=torch.float32),
        torch.full((3, 2), 4.0, dtype=torch.float16),
    ]
    if 0 <= inject_inf < len(grads):
        grads[inject_inf].view(-1)[1] = float("inf")
    return grads


def test_unscale_grads_before_any_scale_call(make: Factory) -> None:
    """torch's test calls `_unscale_grads_` on a fresh scaler (no `scale()` yet) and sums the flags."""
    inv_scale = torch.full((1,), 0.25)
    for inject_inf in range(-1, 4):
        scaler = make()
        grads = _mixed_grads(inject_inf)
        params = [torch.empty_like(g) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        optimizer = torch.optim.SGD(params, lr=1.0)
        found_inf = torch.full((1,), 0.0)
        per_device = scaler._unscale_grads_(optimizer, inv_scale, found_inf, True)
        total = sum(v.item() for v in per_device.values())
        if inject_inf < 0:
            assert total == 0
            assert all(torch.equal(p.grad, torch.ones_like(p.grad)) for p in params)
        else:
            assert total == 1, inject_inf


def test_unscale_sparse_gradients_before_any_scale_call(make: Factory) -> None:
    scaler = make()
    values = torch.tensor([4.0, 8.0])
    grad = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), values, (3,))
    p = torch.zeros(3, requires_grad=True)
    p.grad = grad
    per_device = scaler._unscale_grads_(torch.optim.SGD([p], lr=1.0), torch.full((1,), 0.5), torch.zeros(1), True)
    assert sum(v.item() for v in per_device.values()) == 0
    assert torch.equal(p.grad.coalesce().values(), torch.tensor([2.0, 4.0]))
    inf_grad = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([4.0, float("inf")]), (3,))
    p.grad = inf_grad
    per_device = scaler._unscale_grads_(torch.optim.SGD([p], lr=1.0), torch.full((1,), 0.5), torch.zeros(1), True)
    assert sum(v.item() for v in per_device.values()) == 1


def test_scale_of_nested_outputs_and_state_dict_round_trip(make: Factory) -> None:
    scaler = make(init_scale=2.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    out = scaler.scale([torch.ones(2), (torch.full((1,), 3.0), torch.ones(()))])
    assert torch.equal(out[0], torch.full((2,), 2.0)) and out[1][0].item() == 6.0 and out[1][1].item() == 2.0
    state = scaler.state_dict()
    assert state["scale"] == 2.0 and state["growth_factor"] == 4.0 and state["_growth_tracker"] == 0
    other = make(init_scale=3.0, growth_factor=3.0, backoff_factor=0.75, growth_interval=1)
    other.load_state_dict(state)
    assert other.get_scale() == 2.0 and other.get_growth_factor() == 4.0
    assert other.get_backoff_factor() == 0.5 and other.get_growth_interval() == 2
    # a disabled scaler's state dict is empty, as torch's
    assert make(enabled=False).state_dict() == {}


def _train(
    scaler: torch.amp.GradScaler, steps: int = 8, inf_at: tuple[int, ...] = (2, 5), **case: Any
) -> tuple[list[torch.Tensor], list[float]]:
    """The scaling cases of torch's tests, on CPU: plain, unscale_ + clip, a gradient penalty, two optimizers
    and accumulation. Returns the final weights and the scale after every update."""
    torch.manual_seed(0)
    models = [nn.Linear(4, 4), nn.Linear(4, 1)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    data = [(torch.randn(6, 4), torch.randn(6, 1)) for _ in range(steps)]
    scales = []
    for i, (x, y) in enumerate(data):
        loss = nn.functional.mse_loss(models[1](models[0](x)), y)
        if i in inf_at:
            loss = loss * float("inf")
        if case.get("penalty"):
            grads = torch.autograd.grad(scaler.scale(loss), list(models[0].parameters()), create_graph=True)
            inv = 1.0 / scaler.get_scale()
            loss = loss + sum((g * inv).pow(2).sum() for g in grads)
        scaler.scale(loss).backward()
        if case.get("accumulate") and i % 2 == 0:
            continue
        for opt in opts:
            if case.get("clip"):
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 0.5)
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        for opt in opts:
            opt.zero_grad()
    return [p.detach().clone() for m in models for p in m.parameters()], scales


@pytest.mark.parametrize("case", [{}, {"clip": True}, {"penalty": True}, {"accumulate": True}])
def test_training_cases_match_torch(case: dict[str, bool]) -> None:
    kw = {"init_scale": 2.0**8, "growth_interval": 3}
    weights_t, scales_t = _train(SCALERS["torch"](**kw), **case)
    weights_o, scales_o = _train(SCALERS["tuned"](**kw), **case)
    assert scales_o == scales_t
    assert all(torch.equal(a, b) for a, b in zip(weights_o, weights_t, strict=True))


def test_scale_never_grows_past_float32(make: Factory) -> None:
    scaler = make(init_scale=2.0**127, growth_factor=2.0, growth_interval=1)
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    for _ in range(3):
        scaler.scale((p * 0.0).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0**127
