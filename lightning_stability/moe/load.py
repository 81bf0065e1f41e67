"""Pure: the routing figures of a mixture of experts, from its routers' logits and chosen experts.

For one router (an MoE layer) over a window of tokens (the optimizer steps since the last logging step), with
``c_e`` the tokens routed to expert ``e`` (each token counts once for each of its ``top_k`` experts), ``T`` the
tokens, ``E`` the experts and ``l`` a token's logits:

==================  ==============================================================================================
figure              formula
==================  ==============================================================================================
load share          ``c_e / sum(c)``, per expert (sums to 1)
MaxVio              ``max(c) / mean(c) - 1``: 0 when balanced, ``E - 1`` when one expert takes every token
                    (top-1), ``E / top_k - 1`` when ``top_k`` experts take them all
dead experts        the experts with ``c_e = 0`` (no token routed to them in the window)
routing entropy     the mean over tokens of ``-sum_e p_e log p_e``, ``p`` the token's scores (softmax of ``l``, or
                    sigmoid of ``l`` normalized to sum to 1): ``log E`` uniform, 0 one-hot
router logit max    the largest logit of any token and expert
router z-loss       the mean over tokens of ``logsumexp(l)^2`` (ST-MoE, Zoph et al. 2022, eq. 5)
==================  ==============================================================================================

:func:`routing_stats` is one forward's share of these (sums, counts, a maximum); :class:`RouterWindow` adds them up
on the device, per layer, and :meth:`RouterWindow.figures` sums them over the data-parallel ranks (one collective)
and turns them into the figures (:class:`LayerFigures`), so that N processes equal one process on the same global
batch. Nothing here reads a value on the host except :meth:`RouterWindow.state_dict`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_stability import ranks
from lightning_stability.errors import StabilityConfigError


def softmax_and_lse(flat: Tensor) -> tuple[Tensor, Tensor]:
    """``(softmax, logsumexp)`` over the last dim of ``flat`` (fp32 logits), the log-sum-exp kept (``keepdim``).
    The softmax is taken from the log-sum-exp: on a CPU, ``torch.softmax`` over a last dim of a few experts takes
    several times as long as this subtraction and exp."""
    lse = torch.logsumexp(flat, dim=-1, keepdim=True)
    return (flat - lse).exp_(), lse


def routing_stats(logits: Tensor, experts: Tensor, num_experts: int, scores: str = "softmax") -> tuple[Tensor, ...]:
    """One router call's share of the figures: ``(counts, sums, logit_max)``.

    Args:
        logits: ``(..., num_experts)``: each token's routing logits.
        experts: ``(..., top_k)``: the experts chosen for each token (integers in ``[0, num_experts)``).
        num_experts: ``E``.
        scores: ``"softmax"`` or ``"sigmoid"`` (how the logits become scores, for the entropy).

    Returns:
        ``counts``: ``(E,)`` int64, tokens routed to each expert; ``sums``: ``(2,)`` fp32, the sums over tokens of
        the routing entropy and of ``logsumexp(l)^2``; ``logit_max``: 0-dim fp32 (``-inf`` for no token).
    """
    flat = logits.detach().reshape(-1, num_experts).float()
    chosen = experts.detach().reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, chosen, torch.ones_like(chosen))  # no bincount: on CUDA it reads the maximum on the host
    if scores == "sigmoid":  # the log-sum-exp for the router z, the scores for the entropy
        lse = torch.logsumexp(flat, dim=-1, keepdim=True)
        p = torch.sigmoid(flat)
        p = p / p.sum(dim=-1, keepdim=True)
    else:
        p, lse = softmax_and_lse(flat)
    entropy = torch.special.entr(p).sum()  # over tokens and experts: the sum of the tokens' entropies; entr(0) = 0
    top = flat.amax() if flat.numel() else torch.full((), -math.inf, device=flat.device)
    return counts, torch.stack([entropy, lse.square().sum()]), top


@dataclass
class LayerFigures:
    """One layer's figures over a window (device tensors, alike on every rank): see the module's table.

    Attributes:
        load_share: ``(E,)``. max_vio, dead (a float count), entropy, logit_max, z_loss, tokens: 0-dim.
    """

    load_share: Tensor
    max_vio: Tensor
    dead: Tensor
    entropy: Tensor
    logit_max: Tensor
    z_loss: Tensor
    tokens: Tensor


def layer_figures(counts: Tensor, entropy_sum: Tensor, z_sum: Tensor, logit_max: Tensor, top_k: int) -> LayerFigures:
    """The figures of one layer from its window's totals (summed over ranks); ``NaN`` where it saw no token."""
    counts = counts.double() if counts.device.type != "mps" else counts.float()
    total = counts.sum()
    tokens = total / top_k
    return LayerFigures(
        load_share=counts / total,
        max_vio=counts.amax() / counts.mean() - 1,
        dead=(counts == 0).sum().to(counts.dtype),
        entropy=entropy_sum / tokens,
        logit_max=logit_max,
        z_loss=z_sum / tokens,
        tokens=tokens,
    )


class _Layer:
    def __init__(self, num_experts: int, top_k: int, scores: str) -> None:
        self.num_experts, self.top_k, self.scores = num_experts, top_k, scores
        self.counts: Tensor | None = None  # (E,) int64
        self.sums: Tensor | None = None  # (2,) entropy and z sums, float64 (float32 on MPS)
        self.logit_max: Tensor | None = None  # 0-dim fp32

    def place(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """The totals ``(counts, sums, logit_max)`` on ``device``: zeros, or moved there (once, after a checkpoint
        loaded them on the host)."""
        if self.counts is None or self.sums is None or self.logit_max is None:
            self.counts = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
            self.sums = torch.zeros(2, dtype=_float(device), device=device)
            self.logit_max = torch.full((), -math.inf, device=device)
        elif self.counts.device != device:
            self.counts, self.logit_max = self.counts.to(device), self.logit_max.to(device)
            self.sums = self.sums.to(device, _float(device))
        return self.counts, self.sums, self.logit_max


def _float(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


class RouterWindow:
    """Each layer's routing totals since the last :meth:`reset`, on the device.

    Example::

        window = RouterWindow()
        window.add_layer("layers.0.mlp.gate", num_experts=8, top_k=2)
        window.add("layers.0.mlp.gate", logits, experts)  # each forward
        figures = window.figures()  # {"layers.0.mlp.gate": LayerFigures}, summed over ranks
        window.reset()
    """

    def __init__(self) -> None:
        self.layers: dict[str, _Layer] = {}
        #: a forward was counted since the last reset (a host flag, alike on every rank in data parallelism)
        self.seen = False

    def add_layer(self, name: str, num_experts: int, top_k: int, scores: str = "softmax") -> None:
        """Count ``name`` (a router of ``num_experts`` experts choosing ``top_k``); its totals kept if known."""
        layer = self.layers.get(name)
        if layer is None or (layer.num_experts, layer.top_k) != (num_experts, top_k):
            self.layers[name] = _Layer(num_experts, top_k, scores)
        else:
            layer.scores = scores

    def add(self, name: str, logits: Tensor, experts: Tensor) -> None:
        """Add one router call of layer ``name`` (no host read)."""
        layer = self.layers[name]
        if logits.shape[-1] != layer.num_experts or experts.shape[-1] != layer.top_k:
            raise StabilityConfigError(
                f"Router {name!r} routed logits of shape {tuple(logits.shape)} and experts of shape "
                f"{tuple(experts.shape)}; its spec says {layer.num_experts} experts, top-{layer.top_k}. Fix: its "
                "RouterSpec (register_router(..., spec=...)) or its routing function (routing=...)."
            )
        total_counts, total_sums, total_max = layer.place(logits.device)
        counts, sums, top = routing_stats(logits, experts, layer.num_experts, layer.scores)
        total_counts.add_(counts)
        total_sums.add_(sums.to(total_sums.dtype))
        layer.logit_max = torch.maximum(total_max, top)
        self.seen = True

    def figures(self, group: Any = None) -> dict[str, LayerFigures]:
        """Each layer's figures, its totals summed (the maxima max-reduced) over the ranks of ``group``: ONE
        all-gather of a small vector when distributed (every rank calls it together), no host read."""
        placed = [layer.counts.device for layer in self.layers.values() if layer.counts is not None]
        if not placed:
            return {}
        device = placed[0]
        dtype = _float(device)
        layers = list(self.layers.items())
        totals = [layer.place(device) for _, layer in layers]
        sums = [torch.cat([counts.to(dtype), layer_sums]) for counts, layer_sums, _ in totals]
        maxima = torch.stack([top for _, _, top in totals]).to(dtype)
        flat = torch.cat([*sums, maxima])
        if ranks.world_size(group) > 1:
            every = ranks.gather(flat, group)
            split = flat.numel() - maxima.numel()
            flat = torch.cat([every[:, :split].sum(dim=0), every[:, split:].amax(dim=0)])
        parts = list(flat.split([s.numel() for s in sums] + [maxima.numel()]))
        top = parts.pop().float()
        out = {}
        for i, ((name, layer), part) in enumerate(zip(layers, parts, strict=True)):
            counts, totals = part[:-2], part[-2:]
            out[name] = layer_figures(counts, totals[0], totals[1], top[i], layer.top_k)
        return out

    def reset(self) -> None:
        """Start the next window (in place: the figures taken before are copies)."""
        for layer in self.layers.values():
            if layer.counts is not None and layer.sums is not None and layer.logit_max is not None:
                layer.counts.zero_()
                layer.sums.zero_()
                layer.logit_max = torch.full_like(layer.logit_max, -math.inf)
        self.seen = False

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The totals as host numbers (a host read: at a checkpoint, not in the step)."""
        layers = {}
        for name, layer in self.layers.items():
            if layer.counts is None or layer.sums is None or layer.logit_max is None:
                continue
            layers[name] = {
                "num_experts": layer.num_experts,
                "top_k": layer.top_k,
                "counts": layer.counts.tolist(),
                "sums": layer.sums.tolist(),
                "logit_max": float(layer.logit_max),
            }
        return {"version": 1, "seen": self.seen, "layers": layers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Totals saved by :meth:`state_dict`, on the host until the next forward moves them to its device; a
        layer the state does not hold starts from zero."""
        saved_layers = state.get("layers", {})
        for name, layer in list(self.layers.items()):
            if name not in saved_layers:
                self.layers[name] = _Layer(layer.num_experts, layer.top_k, layer.scores)
        for name, saved in saved_layers.items():
            known = self.layers.get(name)
            layer = _Layer(int(saved["num_experts"]), int(saved["top_k"]), known.scores if known else "softmax")
            layer.counts = torch.tensor(saved["counts"], dtype=torch.int64)
            layer.sums = torch.tensor(saved["sums"], dtype=torch.float64)
            layer.logit_max = torch.tensor(float(saved["logit_max"]), dtype=torch.float32)
            self.layers[name] = layer
        self.seen = bool(state.get("seen", False))
