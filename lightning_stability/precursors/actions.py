"""Pure math of the early actions: QK-clip, StableAdamW's update clipping, a momentum reset. In place, on the device.

Each is an edit right after the update (row 11 of ``lightning_stability/ledger/step.py``).

* **QK-clip** (Kimi K2, arXiv 2507.20534, MuonClip; Megatron-Core ``clip_qk`` of its attention modules,
  ``qk_clip_threshold`` / ``qk_clip_alpha``): after the optimizer step, for each head ``h`` whose largest
  pre-softmax logit ``S_h`` exceeded ``tau``, ``eta_h = tau / S_h``; that head's query projection (weights and
  bias) is multiplied by ``eta_h ** alpha`` and its key projection by ``eta_h ** (1 - alpha)``, so the head's
  logits shrink by ``eta_h`` and its largest is brought back to ``tau``. Heads at or below ``tau`` are untouched
  (``eta_h = 1``). K2's defaults: ``tau = 100``, ``alpha = 0.5``. With grouped-query attention a key head serves
  several query heads; it is scaled by the smallest ``eta`` of its group (each query head's logits then shrink
  by at least its own ``eta``: the clip never falls short). Only the projection weights change, not the
  optimizer state (as in K2 and Megatron-Core).
* **Update clipping** (StableAdamW, Wortsman et al. 2023, "Stable and low-precision training for large-scale
  vision-language models", arXiv 2304.13013, Algorithm 2, from Adafactor): per tensor,
  ``RMS_t = sqrt(mean(g_t^2 / max(u_t, eps^2)))`` with ``u_t`` the bias-corrected second moment *including*
  ``g_t``, and the tensor's learning rate ``lr / max(1, RMS_t / d)`` (``d = 1``). :func:`update_clip_coefficients`
  computes ``1 / max(1, RMS_t / d)`` from the gradients and the state before the step; :func:`clip_updates_`
  applies it after an ordinary (Adam)W step, from a copy of the weights taken before it, so the optimizer is not
  replaced.
* **Momentum reset** (SPAM, Huang et al., ICLR 2025: a gradient spike poisons Adam's moments for many steps):
  :func:`reset_moments_` zeroes the moments of the tensors a spike hit and leaves the step count alone.
  OLMo-core's ``SkipStepAdamW`` once left its step count unincremented, which fixed the bias correction at step
  1 and made the effective LR ``sqrt(1 - beta2) / (1 - beta1)`` times the set one (2.2x at betas (0.9, 0.95);
  OLMo-core PR 317). With the count left at ``t``, the first update after a reset is
  :func:`first_update_gain` times a settled Adam update (``((1 - beta1) / (1 - beta1^t)) / sqrt((1 - beta2) /
  (1 - beta2^t))``: 0.45 at (0.9, 0.95), 3.2 at (0.9, 0.999) for large ``t``), which a caller may offset by
  that tensor's LR, as SPAM warms its LR up again after each reset.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from lightning_stability import _compat
from lightning_stability.errors import StabilityConfigError, check_number, config_error
from lightning_stability.norms import is_dtensor, local_tensor, per_tensor_norms_of_parts
from lightning_stability.precursors.attention import registered_projection

#: Kimi K2's threshold on the max attention logit, and its split of the clip between W_q and W_k.
QK_CLIP_TAU, QK_CLIP_ALPHA = 100.0, 0.5


# ---------------------------------------------------------------------------------------------- QK-clip
def qk_clip_factors(max_logits: Tensor, tau: float = QK_CLIP_TAU) -> Tensor:
    """``eta`` per head: ``tau / S`` where the max logit ``S > tau``, else 1 (so always in ``(0, 1]``)."""
    tau = check_number("tau", tau, example="100.0")
    logits = max_logits.float()
    # `tau / logits.clamp(min=tau)` is not exactly 1 at the clamp (a double scalar over its float32 rounding)
    return torch.where(logits > tau, tau / logits, torch.ones_like(logits))


class HeadBlocks(NamedTuple):
    """Consecutive blocks of ``head_dim`` along ``axis`` of ``tensor``, one per head, from index ``start``.

    ``tensor`` is the whole parameter (a plain tensor, or an FSDP2 ``DTensor``: each rank then scales the blocks
    its shard holds), so a packed projection (q | k | v in one weight) names the same tensor with another ``start``.
    """

    tensor: Tensor
    axis: int
    start: int


@dataclass
class QKProjection:
    """Where a module's query and key projections are, head by head.

    Attributes:
        query: the :class:`HeadBlocks` of the query projection (its weight, and its bias if any): ``heads`` blocks.
        key: the same for the key projection, over ``kv_heads`` blocks.
        heads: query heads.
        kv_heads: key heads (fewer under grouped-query attention).
        head_dim: each head's width (the length of one block).
    """

    query: list[HeadBlocks]
    key: list[HeadBlocks]
    heads: int
    kv_heads: int
    head_dim: int


def qk_projection(module: nn.Module) -> QKProjection:
    """The query and key projections of a known attention module (see :mod:`.attention`).

    Build it after a strategy has sharded the module (FSDP2 replaces its parameters).

    Raises:
        StabilityConfigError: for a module QK-clip cannot rescale (unknown, or with q/k norms that would undo it).
    """
    m: object = module
    name = type(module).__name__
    registered = registered_projection(module)
    if registered is not None:
        projection = registered(module)
        if not isinstance(projection, QKProjection):
            raise config_error(
                "projection", projection, f"is not a QKProjection ({name}'s)", "return QKProjection(...) from it"
            )
        return projection
    if isinstance(module, nn.MultiheadAttention):
        e, h = module.embed_dim, module.num_heads
        if module.in_proj_weight is not None:
            query, key = [HeadBlocks(module.in_proj_weight, 0, 0)], [HeadBlocks(module.in_proj_weight, 0, e)]
        else:
            query, key = [HeadBlocks(module.q_proj_weight, 0, 0)], [HeadBlocks(module.k_proj_weight, 0, 0)]
        if module.in_proj_bias is not None:
            query.append(HeadBlocks(module.in_proj_bias, 0, 0))
            key.append(HeadBlocks(module.in_proj_bias, 0, e))
        return QKProjection(query, key, h, h, e // h)
    if name == "GPT2Attention":  # Conv1D: weight (in, 3 * embed), q | k | v along the columns
        e, c_attn, h = m.embed_dim, m.c_attn, m.num_heads  # type: ignore[attr-defined]
        weight, bias = c_attn.weight, c_attn.bias
        query = [HeadBlocks(weight, 1, 0), HeadBlocks(bias, 0, 0)]
        key = [HeadBlocks(weight, 1, e), HeadBlocks(bias, 0, e)]
        return QKProjection(query, key, h, h, e // h)
    if name == "BertSelfAttention":
        h, d = m.num_attention_heads, m.attention_head_size  # type: ignore[attr-defined]
        return QKProjection(_linear(m.query), _linear(m.key), h, h, d)  # type: ignore[attr-defined]
    if name in ("LlamaAttention", "MistralAttention", "Qwen2Attention"):
        d = m.head_dim  # type: ignore[attr-defined]
        heads = m.q_proj.out_features // d  # type: ignore[attr-defined]
        kv_heads = m.k_proj.out_features // d  # type: ignore[attr-defined]
        return QKProjection(_linear(m.q_proj), _linear(m.k_proj), heads, kv_heads, d)  # type: ignore[attr-defined]
    if hasattr(module, "q_norm") or hasattr(module, "k_norm"):
        raise config_error(
            "module",
            name,
            "normalizes q and k after their projections, which would undo QK-clip's rescaling",
            "leave QK-clip off for it (its q/k norms already bound the logits)",
        )
    raise StabilityConfigError(
        f"QK-clip does not know where {name}'s query and key projections are. Fix: register them with "
        f"register_attention({name}, fn, projection=...) (a function returning its QKProjection), or leave qk_clip "
        "off."
    )


def _linear(linear: nn.Linear) -> list[HeadBlocks]:
    return [HeadBlocks(linear.weight, 0, 0)] + ([HeadBlocks(linear.bias, 0, 0)] if linear.bias is not None else [])


def scale_heads_(blocks: HeadBlocks, factors: Tensor, head_dim: int) -> None:
    """Multiply block ``h`` of ``blocks`` by ``factors[h]``, in place, on the part of the tensor this rank holds.

    A ``DTensor`` is scaled on its local shard, over the blocks (or parts of blocks) that shard holds: an
    element-wise product, so the whole tensor ends as if it had been scaled whole. No collective, no host sync.
    """
    tensor, axis, start = blocks
    local, first = tensor, 0
    if is_dtensor(tensor):
        local, first = local_tensor(tensor), _compat.dtensor_global_offset(tensor)[axis]
    end = start + factors.numel() * head_dim  # the blocks span [start, end) along axis; the shard [first, last)
    lo, hi = max(start, first), min(end, first + local.shape[axis])
    if lo >= hi:
        return
    per_index = factors.to(local.dtype).repeat_interleave(head_dim)[lo - start : hi - start]
    shape = [1] * local.dim()
    shape[axis] = hi - lo
    local.narrow(axis, lo - first, hi - lo).mul_(per_index.view(shape))


def apply_qk_clip_(
    projection: QKProjection, max_logits: Tensor, tau: float = QK_CLIP_TAU, alpha: float = QK_CLIP_ALPHA
) -> Tensor:
    """QK-clip one attention module in place, from its ``(heads,)`` max logits; returns ``eta`` per head.

    Raises:
        StabilityConfigError: for ``alpha`` outside [0, 1], or ``max_logits`` not of ``(heads,)``.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise config_error("alpha", alpha, "must be in [0, 1]", "pass alpha=0.5 (Kimi K2's)")
    if max_logits.shape != (projection.heads,):
        raise config_error(
            "max_logits", tuple(max_logits.shape), f"must have shape ({projection.heads},)", "pass one per head"
        )
    eta = qk_clip_factors(max_logits, tau)
    group = eta.view(projection.kv_heads, -1).amin(dim=1)  # a key head serves this group of query heads
    with torch.no_grad():
        for blocks in projection.query:
            scale_heads_(blocks, eta.pow(alpha), projection.head_dim)
        for blocks in projection.key:
            scale_heads_(blocks, group.pow(1 - alpha), projection.head_dim)
    return eta


# ---------------------------------------------------------------------------------------------- update clipping
def update_clip_coefficients(
    grads: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    beta2: float,
    eps: float,
    threshold: float = 1.0,
) -> Tensor:
    """StableAdamW's per-tensor LR factor ``1 / max(1, RMS_t / threshold)``, computed before the step.

    Args:
        grads: the gradients ``g_t`` the step will use (unscaled).
        exp_avg_sqs: each tensor's ``exp_avg_sq`` before the step (``v_{t-1}``).
        steps: each tensor's step count before the step (``t - 1``; 0-dim tensors, as torch keeps them).
        beta2, eps: the optimizer's.
        threshold: ``d`` (1.0 in the paper).

    Returns:
        ``(n,)`` fp32 in ``(0, 1]``, where ``RMS_t = sqrt(mean(g_t^2 / max(u_t, eps^2)))`` and ``u_t =
        (beta2 v_{t-1} + (1 - beta2) g_t^2) / (1 - beta2^t)``. No host sync.
    """
    threshold = check_number("threshold", threshold, example="1.0")
    grads, vs = list(grads), list(exp_avg_sqs)
    squares = [local_tensor(g).float().square() for g in grads]  # element-wise on each rank's part
    u = [local_tensor(v).float() * beta2 + (1 - beta2) * s for v, s in zip(vs, squares, strict=True)]
    bc2 = list(_compat.foreach_pow(float(beta2), [torch.as_tensor(t, dtype=torch.float32) + 1 for t in steps]))
    _compat.foreach_one_minus_(bc2)
    u = list(_compat.foreach_div(u, bc2))
    ratio = [s / x.clamp(min=eps * eps) for s, x in zip(squares, u, strict=True)]
    _compat.foreach_mul_scalars_(ratio, [1.0 / g.numel() for g in grads])
    rms = per_tensor_norms_of_parts(ratio, grads, 1.0).sqrt()  # the ratios are >= 0: their 1-norm / n is their mean
    return 1.0 / (rms / threshold).clamp(min=1.0)


def clip_updates_(
    params: Sequence[Tensor],
    before: Sequence[Tensor],
    coefficients: Tensor,
    lr: float | Tensor,
    weight_decay: float = 0.0,
) -> None:
    """Turn the (Adam)W step just taken into StableAdamW's: the Adam part of each update scaled by its coefficient.

    torch's AdamW computes ``p = p0 (1 - lr wd) - lr u``; StableAdamW takes ``p0 (1 - lr wd) - c lr u`` (the decay
    at the full LR, as in the paper's reference code). So ``p <- c p + (1 - c) p0 (1 - lr wd)``. ``before``: this
    rank's part of each parameter from before the step (a sharded parameter is edited on its local shard);
    ``lr``: the LR the step used; ``weight_decay``: 0 for Adam (decay folded into the gradient). No host sync.
    """
    with torch.no_grad():
        for p, p0, c in zip(params, before, coefficients.unbind(), strict=True):
            local = local_tensor(p)
            c = c.to(local.dtype)
            local.mul_(c).add_(p0 * ((1 - lr * weight_decay) * (1 - c)))


# ---------------------------------------------------------------------------------------------- momentum reset
def reset_moments_(optimizer: torch.optim.Optimizer, params: Sequence[Tensor], hit: Tensor) -> None:
    """Zero the Adam moments (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) of the ``params`` where ``hit`` (a
    ``(len(params),)`` bool tensor) is true, on each rank's part of them; ``step`` untouched. No host sync.

    Raises:
        StabilityConfigError: when a parameter is not one of ``optimizer``'s.
    """
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    keep = (~hit).to(torch.float32)
    with torch.no_grad():
        for p, k in zip(params, keep.unbind(), strict=True):
            if id(p) not in owned:
                raise config_error(
                    "params", tuple(p.shape), "holds a tensor the optimizer does not update", "pass its params"
                )
            state = optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in state:
                    moment = local_tensor(state[key])
                    moment.mul_(k.to(moment.dtype))


def first_update_gain(beta1: float, beta2: float, step: int) -> float:
    """The first update after :func:`reset_moments_` at step count ``step``, over a settled Adam update.

    The next step is ``step + 1``: ``m = (1 - beta1) g``, ``v = (1 - beta2) g^2``, so Adam's update is
    ``[(1 - beta1) / (1 - beta1^(step+1))] / sqrt((1 - beta2) / (1 - beta2^(step+1)))`` times ``lr sign(g)`` (eps
    aside), where a settled Adam on a steady gradient moves ``lr sign(g)``.
    """
    t = step + 1
    return ((1 - beta1) / (1 - beta1**t)) / math.sqrt((1 - beta2) / (1 - beta2**t))
