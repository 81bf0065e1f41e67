"""adam_update_stats: each tensor's Adam step RMS and epsilon-dominated share, against the step torch applied."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_stability.errors import StabilityConfigError
from lightning_stability.precursors.adam import adam_update_stats
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


@pytest.mark.parametrize(
    ("optimizer_cls", "kwargs"),
    [
        (torch.optim.Adam, {"lr": 1e-2}),
        (torch.optim.Adam, {"lr": 1e-2, "foreach": False}),
        (torch.optim.AdamW, {"lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.95)}),
        (torch.optim.AdamW, {"lr": 3e-3, "weight_decay": 0.0, "fused": True}),
        (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
        (torch.optim.Adam, {"lr": torch.tensor(1e-2)}),
    ],
)
def test_the_update_rms_is_that_of_the_step_torch_applied(optimizer_cls: type, kwargs: dict[str, object]) -> None:
    _, optimizer, applied = model_and_steps(optimizer_cls, 4, **kwargs)
    stats = adam_update_stats(optimizer)
    expected = torch.stack([d.pow(2).mean().sqrt() for d in applied])
    torch.testing.assert_close(stats.update_rms, expected, rtol=1e-4, atol=1e-9)
    assert len(stats.params) == 4 and stats.eps_share.shape == (4,)


def test_the_eps_share_by_hand() -> None:
    # eps = 0.03 is above some coordinates' sqrt(v_hat): count them from the state directly
    _, optimizer, _ = model_and_steps(torch.optim.AdamW, 3, lr=1e-2, eps=0.03)
    stats = adam_update_stats(optimizer)
    expected = []
    for p in stats.params:
        state = optimizer.state[p]
        t = float(state["step"])
        root_v_hat = (state["exp_avg_sq"] / (1 - 0.999**t)).sqrt()
        expected.append((root_v_hat < 0.03).float().mean())
    torch.testing.assert_close(stats.eps_share, torch.stack(expected))
    assert 0 < float(stats.eps_share.max()) < 1  # the case is not trivial: some, not all
    assert float(adam_update_stats(model_and_steps(torch.optim.AdamW, 3, lr=1e-2, eps=1e-12)[1]).eps_share.max()) == 0


def test_no_host_sync_no_host_data_and_no_state_change() -> None:
    _, optimizer, _ = model_and_steps(torch.optim.AdamW, 2, lr=1e-2)
    saved = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    syncs, data = SyncCounter(), HostDataCounter()
    with syncs, data:
        stats = adam_update_stats(optimizer)
    assert stats.update_rms.numel() == 4 and syncs.count == 0 and data.count == 0
    for p, state in optimizer.state.items():
        for key, value in state.items():
            assert torch.equal(value, saved[id(p)][key])


def test_tensors_without_state_are_left_out_and_non_adam_is_refused() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    assert adam_update_stats(optimizer).params == []
    with pytest.raises(StabilityConfigError, match=r"needs an Adam-like optimizer .* got SGD"):
        adam_update_stats(torch.optim.SGD(model.parameters(), lr=0.1))
