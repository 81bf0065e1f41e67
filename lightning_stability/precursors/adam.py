"""Per-tensor statistics of an Adam-like optimizer's update, read from its state after the step, on the device.

For each tensor with Adam state (``exp_avg`` = m, ``exp_avg_sq`` = v, ``step`` = t, as torch's ``Adam`` and
``AdamW`` keep it, fused, foreach or single-tensor alike; ``max_exp_avg_sq`` under ``amsgrad``), with the bias
corrections ``m_hat = m / (1 - beta1^t)``, ``v_hat = v / (1 - beta2^t)`` and torch's denominator
``sqrt(v_hat) + eps``:

* **update RMS**: the root mean square of ``lr * m_hat / (sqrt(v_hat) + eps)``, the step Adam just applied to the
  tensor (decoupled weight decay left out). Marin's 32B run saw this norm double before its loss spikes.
* **epsilon-dominated share**: the share of coordinates where ``sqrt(v_hat) < eps``, i.e. where epsilon is the
  larger term of the denominator and the update is damped below Adam's ``lr * sign``-like size. Wortsman et al.
  2023 (arXiv 2309.14322, "AdamW epsilon") show that as gradients shrink with scale, ``sqrt(v_hat)`` falls to
  ``eps`` and the updates vanish; this share measures how much of a tensor is there.

All per-tensor math is fused (``torch._foreach_*`` through :mod:`lightning_stability._compat`, one group of
kernels per param group) and stays on the device: no host sync. Sharded ``DTensor`` state (FSDP2) is worked on
shard by shard and its norms reduced over the mesh (:func:`lightning_stability.norms.per_tensor_norms_of_parts`),
so both figures are those of the whole tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence, Set
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_stability import _compat
from lightning_stability.errors import StabilityConfigError
from lightning_stability.norms import local_tensor, per_tensor_norms_of_parts


@dataclass
class AdamUpdates:
    """The step Adam just applied to each tensor, ``lr * m_hat / (sqrt(v_hat) + eps)``, recomputed from its state.

    Attributes:
        params: the tensors with Adam state, in param-group order.
        updates: this rank's part of each one's update (a ``DTensor``'s local shard; the tensor's dtype).
        norms: ``(n,)`` fp32, each update's 2-norm (of the whole tensor when sharded).
        eps_share: ``(n,)`` fp32 in [0, 1], the share of its coordinates where ``sqrt(v_hat) < eps``; ``None``
            when not asked for.
    """

    params: list[Tensor]
    updates: list[Tensor]
    norms: Tensor
    eps_share: Tensor | None


@dataclass
class AdamUpdateStats:
    """One optimizer step's figures, one entry per tensor with Adam state, in param-group order.

    Attributes:
        params: the tensors (to name them).
        update_rms: ``(n,)`` fp32, the RMS of each tensor's Adam step (``lr`` included).
        eps_share: ``(n,)`` fp32 in [0, 1], the share of its coordinates where ``sqrt(v_hat) < eps``.
    """

    params: list[Tensor]
    update_rms: Tensor
    eps_share: Tensor


def is_adam_like(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every param group has ``betas`` and ``eps`` (the state's ``exp_avg``/``exp_avg_sq`` come with them)."""
    return all("betas" in g and "eps" in g for g in optimizer.param_groups)


def adam_updates(
    optimizer: torch.optim.Optimizer,
    lrs: Sequence[float | Tensor] | None = None,
    eps_share: bool = False,
    only: Set[int] | None = None,
) -> AdamUpdates:
    """Each tensor's Adam step, recomputed from ``optimizer``'s state right after its step, with its norm.

    ``u = lr * m_hat / (sqrt(v_hat) + eps)`` is computed as ``m / (sqrt(v) + eps * c2) * (lr * c2 / c1)`` with
    ``c1 = 1 - beta1^t`` and ``c2 = sqrt(1 - beta2^t)``, in one new tensor per parameter (the returned updates).
    Tensors without state yet (no step taken) are left out. ``lrs``: each param group's LR as the step used it
    (default: the groups' ``lr`` now; an LR schedule that sets the next step's LR right after the step needs
    them). ``eps_share``: also the epsilon-dominated share (two more passes). ``only``: the ids of the tensors the
    step updated (those with a gradient: Adam leaves the others, whose state still holds an older step); default:
    every tensor with state.

    Raises:
        StabilityConfigError: when ``optimizer`` is not Adam-like (:func:`is_adam_like`).
    """
    if not is_adam_like(optimizer):
        raise StabilityConfigError(
            f"adam_updates needs an Adam-like optimizer (param groups with 'betas' and 'eps', state "
            f"'exp_avg'/'exp_avg_sq'), got {type(optimizer).__name__}. Fix: use torch.optim.Adam or AdamW, or "
            "leave the Adam statistics off for this optimizer."
        )
    params: list[Tensor] = []
    updates: list[Tensor] = []
    norms: list[Tensor] = []
    shares: list[Tensor] = []
    for i, group in enumerate(optimizer.param_groups):
        have = [
            p for p in group["params"] if "exp_avg" in optimizer.state.get(p, {}) and (only is None or id(p) in only)
        ]
        if not have:
            continue
        states = [optimizer.state[p] for p in have]
        second = "max_exp_avg_sq" if group.get("amsgrad", False) else "exp_avg_sq"
        beta1, beta2 = group["betas"]
        eps = float(group["eps"])
        # the bias corrections of every tensor at once, where torch keeps the step counts (host or device)
        steps = torch.stack([torch.as_tensor(s["step"], dtype=torch.float32) for s in states])
        c1 = 1 - torch.pow(float(beta1), steps)  # 1 - beta1^t
        c2 = (1 - torch.pow(float(beta2), steps)).sqrt()  # sqrt(1 - beta2^t)
        lr = group["lr"] if lrs is None else lrs[i]
        scale = c2 / c1 if isinstance(lr, Tensor) else c2 / c1 * float(lr)
        # element-wise on each rank's part (a DTensor's local shard); the norms count the whole tensors
        denom = list(_compat.foreach_sqrt([local_tensor(s[second]) for s in states]))  # sqrt(v)
        if eps_share:  # sqrt(v_hat) < eps: ||sign(min(sqrt(v_hat) - eps, 0))||_1 / numel
            below = list(_compat.foreach_div(denom, list(c2.unbind())))
            _compat.foreach_below_(below, eps)
            _compat.foreach_mul_scalars_(below, [1.0 / p.numel() for p in have])
            shares.append(per_tensor_norms_of_parts(below, [s[second] for s in states], 1.0))
        _compat.foreach_add_(denom, list((c2 * eps).unbind()))  # sqrt(v) + eps * c2
        # m / denom written over denom: one tensor the size of the weights at a time, like the optimizer's own step
        update = denom
        _compat.foreach_reciprocal_(update)
        _compat.foreach_mul_list_(update, [local_tensor(s["exp_avg"]) for s in states])
        _compat.foreach_mul_scalars_(update, list(scale.unbind()))
        if isinstance(lr, Tensor):  # capturable, or a schedule that writes tensors: used where it is, no host read
            _compat.foreach_mul_(update, lr)
        norms.append(per_tensor_norms_of_parts(update, [s["exp_avg"] for s in states]))
        params.extend(have)
        updates.extend(update)
    if not params:
        return AdamUpdates([], [], torch.zeros(0), torch.zeros(0) if eps_share else None)
    return AdamUpdates(params, updates, torch.cat(norms), torch.cat(shares) if eps_share else None)


def adam_update_stats(optimizer: torch.optim.Optimizer, lrs: Sequence[float | Tensor] | None = None) -> AdamUpdateStats:
    """The update RMS and epsilon-dominated share of each tensor, from ``optimizer``'s state after its step.

    Tensors without state yet (no step taken) are left out. ``lrs``: as :func:`adam_updates` takes them.

    Raises:
        StabilityConfigError: when ``optimizer`` is not Adam-like (:func:`is_adam_like`).
    """
    found = adam_updates(optimizer, lrs, eps_share=True)
    assert found.eps_share is not None
    if not found.params:
        return AdamUpdateStats([], found.norms, found.eps_share)
    device = found.norms.device
    roots = torch.stack([torch.full((), math.sqrt(p.numel()), device=device) for p in found.params])  # fills
    return AdamUpdateStats(found.params, found.norms / roots, found.eps_share)
