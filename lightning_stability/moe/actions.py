"""Pure: the actions of :class:`~lightning_stability.moe.RouterHealthMonitor` on a router.

=================  ===============================================  ============================================
action             what it does                                     formula
=================  ===============================================  ============================================
router z-loss      adds the gradient of ``coef * mean over tokens   ``d/dl = coef * 2 * lse(l) * softmax(l) / T``
                   of lse(l)^2`` (ST-MoE, Zoph et al. 2022, eq. 5)  per router call of ``T`` tokens
                   to a router call's logits ``l``, in backward     (:func:`z_loss_grad`)
router-logit clip  scales a router's own parameters by ``eta``      ``eta = tau / max`` where the step's largest
                   right after the update (as QK-clip does for      logit ``max > tau``, else 1
                   attention): exact for a linear router, whose     (:func:`~lightning_stability.precursors.
                   logits then scale by ``eta``                     actions.qk_clip_factors`)
=================  ===============================================  ============================================
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_stability.norms import local_tensor
from lightning_stability.precursors.actions import qk_clip_factors


def z_loss_grad(logits: Tensor, coef: float) -> Tensor:
    """The gradient of ``coef * mean over tokens of logsumexp(logits)^2`` with respect to ``logits`` (fp32, the
    shape of ``logits``; tokens: every dim but the last)."""
    flat = logits.detach().float()
    tokens = max(flat.numel() // max(flat.shape[-1], 1), 1)
    lse = torch.logsumexp(flat, dim=-1, keepdim=True)
    return torch.softmax(flat, dim=-1).mul_(lse).mul_(2.0 * coef / tokens)


def clip_routers_(params: Sequence[Sequence[Tensor]], maxima: Tensor, tau: float) -> Tensor:
    """Scale each router's parameters in place by ``eta = tau / max`` where its logit max passed ``tau``; returns
    ``eta`` (``(routers,)``, in ``(0, 1]``). ``params[i]``: router ``i``'s own parameters (its weight, and its bias
    if any), whole tensors or DTensors (each rank scales its shard)."""
    eta = qk_clip_factors(maxima, tau)
    with torch.no_grad():
        for router, factor in zip(params, eta.unbind(), strict=True):
            for p in router:
                local = local_tensor(p)
                local.mul_(factor.to(local.dtype))
    return eta
