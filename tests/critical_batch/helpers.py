"""The estimator by hand: each window's micro-batch gradients recomputed from the weights the window started from."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_stability.critical_batch.noise_scale import critical_batch, ema_update, new_state, two_batch_estimates


class Windows(Callback):
    """Per optimizer step: the weights of a TinyModule's net at its window's start, its micro-batches, its LR and
    beta2."""

    def __init__(self) -> None:
        self.starts: list[dict[str, torch.Tensor]] = []
        self.batches: list[list[Any]] = []
        self.lrs: list[float] = []
        self.beta2s: list[float] = []
        self._current: list[Any] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._current:
            self.starts.append({k: v.detach().clone() for k, v in pl_module.net.state_dict().items()})
        self._current.append([t.clone() for t in batch])

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.batches.append(self._current)
        self._current = []
        group = optimizer.param_groups[0]
        self.lrs.append(float(group["lr"]))
        self.beta2s.append(float(group["betas"][1]) if "betas" in group else float("nan"))

    @property
    def sizes(self) -> list[int]:
        return [len(b) for b in self.batches]


def squared_norm_of_gradient(module: nn.Module, weights: dict[str, torch.Tensor], batches: list[Any]) -> torch.Tensor:
    """|mean over ``batches`` of each one's mean-loss gradient|^2 at ``weights`` (``module``: a TinyModule's net)."""
    model = copy.deepcopy(module)
    model.load_state_dict(weights)
    model.zero_grad(set_to_none=True)
    for x, y in batches:
        (nn.functional.mse_loss(model(x).float(), y) / len(batches)).backward()
    return sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None)  # type: ignore[return-value]


def by_hand(module: nn.Module, steps: list[tuple[dict[str, torch.Tensor], list[list[Any]]]], micro: int, decay: float):  # type: ignore[no-untyped-def]
    """The critical batch and its error after ``steps``: each a window's start weights and, per rank, its
    micro-batches; the small gradient is each rank's first micro-batch (squared norms averaged over ranks), the big
    one all micro-batches of all ranks."""
    state = new_state()
    for weights, per_rank in steps:
        if len(per_rank[0]) < 2:
            continue
        small_sq = sum(squared_norm_of_gradient(module, weights, rank[:1]) for rank in per_rank) / len(per_rank)
        every = [b for rank in per_rank for b in rank]
        big_sq = squared_norm_of_gradient(module, weights, every)
        g2, trace = two_batch_estimates(small_sq.float(), big_sq.float(), micro, micro * len(every))
        state = ema_update(state, g2, trace, decay)
    return critical_batch(state)
