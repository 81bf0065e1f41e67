"""adam_eps_share: the share of Adam's coordinates where epsilon dominates the denominator, against the state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_stability.errors import StabilityConfigError
from lightning_stability.precursors.adam import adam_eps_share, is_adam
from tests.helpers import HostDataCounter, SyncCounter


def model_and_steps(
    optimizer_cls: type[torch.optim.Optimizer], steps: int, **kwargs: object
) -> tuple[nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    """A small model after ``steps`` optimizer steps; the change the last step applied to each parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    optimizer = optimizer_cls(model.parameters(), **kwargs)  # type: ignore[call-arg]
    x, y = torch.randn(32, 6), torch.randn(32, 3)
    before: list[torch.Tensor] = []
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
    applied = [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]
    return model, optimizer, applied


def by_hand(optimizer: torch.optim.Optimizer, eps: float, beta2: float = 0.999, key: str = "exp_avg_sq") -> float:
    below, total = 0.0, 0
    for p, state in optimizer.state.items():
        t = float(state["step"])
        root_v_hat = (state[key] / (1 - beta2**t)).sqrt()
        below += float((root_v_hat < eps).sum())
        total += p.numel()
    return below / total


@pytest.mark.parametrize(
    ("optimizer_cls", "kwargs"),
    [
        (torch.optim.Adam, {"foreach": False}),
        (torch.optim.AdamW, {"betas": (0.8, 0.95)}),
        (torch.optim.AdamW, {"fused": True}),
        (torch.optim.Adam, {"amsgrad": True}),
    ],
)
def test_the_eps_share_by_hand(optimizer_cls: type, kwargs: dict[str, object]) -> None:
    # eps = 0.03 is above some coordinates' sqrt(v_hat): count them from the state directly
    model, optimizer, _ = model_and_steps(optimizer_cls, 3, lr=1e-2, eps=0.03, **kwargs)
    beta2 = kwargs.get("betas", (0.9, 0.999))[1]  # type: ignore[index]
    key = "max_exp_avg_sq" if kwargs.get("amsgrad") else "exp_avg_sq"
    share = float(adam_eps_share(optimizer, list(model.parameters())))
    assert share == pytest.approx(by_hand(optimizer, 0.03, beta2, key), rel=1e-6)
    assert 0 < share < 1  # the case is not trivial: some, not all
    model, optimizer, _ = model_and_steps(optimizer_cls, 3, lr=1e-2, eps=1e-12, **kwargs)
    assert float(adam_eps_share(optimizer, list(model.parameters()))) == 0


def test_no_host_sync_no_host_data_and_no_state_change() -> None:
    model, optimizer, _ = model_and_steps(torch.optim.AdamW, 2, lr=1e-2)
    saved = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    syncs, data = SyncCounter(), HostDataCounter()
    with syncs, data:
        adam_eps_share(optimizer, list(model.parameters()))
    assert syncs.count == 0 and data.count == 0
    for p, state in optimizer.state.items():
        for key, value in state.items():
            assert torch.equal(value, saved[id(p)][key])


def test_only_adam_and_adamw_are_adam() -> None:
    model = nn.Linear(2, 2)
    assert is_adam(torch.optim.Adam(model.parameters())) and is_adam(torch.optim.AdamW(model.parameters()))
    for other in (torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax):  # betas and eps, another update
        assert not is_adam(other(model.parameters()))
    with pytest.raises(StabilityConfigError, match=r"reads Adam's state; got SGD"):
        adam_eps_share(torch.optim.SGD(model.parameters(), lr=0.1), list(model.parameters()))
