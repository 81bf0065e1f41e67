"""Adam's own figures, read from the state of ``torch.optim.Adam``/``AdamW`` after the step, on the device.

* :func:`is_adam`: whether an optimizer is ``torch.optim.Adam`` or ``AdamW`` (or a subclass): the optimizers whose
  state the update clipping, the moment reset and these figures read (``exp_avg`` = m, ``exp_avg_sq`` = v,
  ``step`` = t, fused, foreach or single-tensor alike).
* :func:`adam_eps_share`: the share of coordinates where ``sqrt(v_hat) < eps``, with ``v_hat = v / (1 - beta2^t)``,
  i.e. where epsilon is the larger term of Adam's denominator and the update is damped below Adam's
  ``lr * sign``-like size. Wortsman et al. 2023 (arXiv 2309.14322, "AdamW epsilon") show that as gradients shrink
  with scale, ``sqrt(v_hat)`` falls to ``eps`` and the updates vanish; this share measures how much of a tensor is
  there.

The per-tensor math is fused (``torch._foreach_*`` through :mod:`lightning_stability._compat`) and stays on the
device: no host sync. Sharded ``DTensor`` state (FSDP2) is worked on shard by shard and its norms reduced over the
mesh (:func:`lightning_stability.norms.per_tensor_norms_of_parts`), so the figure is that of the whole tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_stability import _compat
from lightning_stability.errors import StabilityConfigError
from lightning_stability.norms import local_tensor, per_tensor_norms_of_parts


def is_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is ``torch.optim.Adam`` or ``AdamW`` (or a subclass of either)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def adam_eps_share(optimizer: torch.optim.Optimizer, params: Sequence[Tensor]) -> Tensor:
    """0-dim fp32 in [0, 1]: the share of the coordinates of ``params`` (those with state) where ``sqrt(v_hat) <
    eps``, over all of them (each tensor weighted by its size). ``max_exp_avg_sq`` under ``amsgrad``.

    Raises:
        StabilityConfigError: when ``optimizer`` is not Adam or AdamW (:func:`is_adam`).
    """
    if not is_adam(optimizer):
        raise StabilityConfigError(
            f"adam_eps_share reads Adam's state; got {type(optimizer).__name__}. Fix: use torch.optim.Adam or AdamW."
        )
    wanted = {id(p) for p in params}
    below: list[Tensor] = []
    total = 0
    for group in optimizer.param_groups:
        have = [p for p in group["params"] if id(p) in wanted and "exp_avg_sq" in optimizer.state.get(p, {})]
        if not have:
            continue
        states = [optimizer.state[p] for p in have]
        second = "max_exp_avg_sq" if group.get("amsgrad", False) else "exp_avg_sq"
        beta2 = float(group["betas"][1])
        steps = torch.stack([torch.as_tensor(s["step"], dtype=torch.float32) for s in states])
        c2 = (1 - torch.pow(beta2, steps)).sqrt()  # sqrt(1 - beta2^t), every tensor at once
        roots = list(_compat.foreach_sqrt([local_tensor(s[second]) for s in states]))  # sqrt(v)
        flags = list(_compat.foreach_div(roots, list(c2.unbind())))  # sqrt(v_hat)
        _compat.foreach_below_(flags, float(group["eps"]))  # -1 where below eps, else 0
        below.append(per_tensor_norms_of_parts(flags, [s[second] for s in states], 1.0))  # their 1-norms: the counts
        total += sum(p.numel() for p in have)
    if not below:
        return torch.zeros(())
    return torch.cat(below).sum() / max(total, 1)
