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
balancing bias     adds a per-expert bias ``b`` to the scores that  ``chosen = topk(scores + b)``, the weights
                   choose the experts, not to the weights that mix  ``scores[chosen]`` (normalized as the router
                   them (Wang et al. 2024, DeepSeek-V3); after      does); ``b_e += u * sign(mean(c) - c_e)``
                   each applied step, from the step's load ``c``    (:func:`balance_bias_delta`)
=================  ===============================================  ============================================

The balancing bias re-chooses the experts in a forward hook on the router (:func:`biased_routing`): it knows the
routers that score with a softmax and take the top-k of it (:data:`BIASABLE`: Hugging Face's Mixtral, Qwen2-MoE,
Qwen3-MoE and OLMoE routers; DeepSeek-V3's has a bias of its own, ``e_score_correction_bias``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_stability.moe.load import softmax_and_lse
from lightning_stability.norms import local_tensor
from lightning_stability.precursors.actions import qk_clip_factors


def z_loss_grad(logits: Tensor, coef: float) -> Tensor:
    """The gradient of ``coef * mean over tokens of logsumexp(logits)^2`` with respect to ``logits`` (fp32, the
    shape of ``logits``; tokens: every dim but the last)."""
    flat = logits.detach().float()
    tokens = max(flat.numel() // max(flat.shape[-1], 1), 1)
    softmax, lse = softmax_and_lse(flat)
    return softmax.mul_(lse).mul_(2.0 * coef / tokens)


def clip_routers_(params: Sequence[Sequence[Tensor]], maxima: Tensor, tau: float) -> Tensor:
    """Scale each router's parameters in place by ``eta = tau / max`` where its logit max passed ``tau``; returns
    ``eta`` (``(routers,)``, in ``(0, 1]``). ``params[i]``: router ``i``'s own parameters (its weight, and its bias
    if any), whole tensors or DTensors (each rank scales its shard). A non-finite max (a broken forward, whose step
    is skipped) scales nothing: ``tau / inf`` would zero the router."""
    finite = torch.isfinite(maxima)
    eta = torch.where(finite, qk_clip_factors(torch.where(finite, maxima, 0.0), tau), 1.0)
    with torch.no_grad():
        for router, factor in zip(params, eta.unbind(), strict=True):
            for p in router:
                local = local_tensor(p)
                local.mul_(factor.to(local.dtype))
    return eta


#: the routers whose choice :func:`biased_routing` can redo: softmax scores, top-k of them, weights the chosen
#: scores (normalized to sum to one unless the router's ``norm_topk_prob`` is false)
BIASABLE = frozenset({"MixtralTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "OlmoeTopKRouter"})


def biased_routing(module: Any, output: tuple[Any, ...], bias: Tensor) -> tuple[Any, ...]:
    """A :data:`BIASABLE` router's output ``(logits, weights, experts, ...)`` with the experts chosen by
    ``topk(softmax(logits) + bias)`` and the weights the chosen experts' scores, as the router computes them (the
    same output as the router's own where ``bias`` is zero)."""
    logits, weights, experts = output[0], output[1], output[2]
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    chosen = torch.topk(scores + bias, experts.shape[-1], dim=-1).indices
    mixed = scores.gather(-1, chosen)
    if getattr(module, "norm_topk_prob", True):
        mixed = mixed / mixed.sum(dim=-1, keepdim=True)
    return (logits, mixed.to(weights.dtype), chosen.to(experts.dtype), *output[3:])


def balance_bias_delta(counts: Tensor, rate: float) -> Tensor:
    """The bias's step from one step's load (``(E,)`` tokens routed to each expert): ``rate * sign(mean - c_e)``,
    up for the experts under the mean load, down for those above (fp32)."""
    load = counts.float()
    return torch.sign(load.mean() - load).mul_(rate)
