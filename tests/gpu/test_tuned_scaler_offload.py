"""TunedGradScaler with gradients in CPU memory and the scale on the GPU (the layout of ``cpu_offload=True``).

Skipped without CUDA. Run on a GPU machine with ``python -m pytest -q tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_stability.amp.scaler import TunedGradScaler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("inf", [False, True])
def test_the_overflow_flag_of_cpu_offloaded_gradients_stays_on_the_scale_device(inf: bool) -> None:
    param = torch.nn.Parameter(torch.ones(4))  # on the CPU, like an offloaded shard
    optimizer = torch.optim.SGD([param], lr=0.5)
    scaler = TunedGradScaler("cuda", init_scale=256.0, hysteresis=1, min_scale=None)
    scaler.scale(torch.ones((), device="cuda"))  # creates the scale on the GPU
    grad = torch.full((4,), 256.0)
    if inf:
        grad[1] = float("inf")
    param.grad = grad
    scaler.unscale_(optimizer)
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    # one flag, on the GPU: no non-blocking copy back to the host for step() to read too early
    assert list(found) == [scaler.loss_scale.device]
    assert found[scaler.loss_scale.device].item() == float(inf)
    scaler.step(optimizer)
    scaler.update()
    expected = torch.ones(4) if inf else torch.full((4,), 0.5)  # skipped, or one SGD step on unscaled grads of 1
    assert torch.equal(param.detach(), expected)
    assert scaler.get_scale() == (128.0 if inf else 256.0)
