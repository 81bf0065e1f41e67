"""The update of one optimizer step: its scale (a factor on each param group's LR) and its size (``||Δθ|| / ||θ||``).

* :class:`UpdateScale`: the factors callbacks put on the coming update (``StepLedger.scale_update``), multiplied
  together, written into every param group's ``lr`` right before ``optimizer.step()`` and put back right after it.
  Every optimizer that reads ``group["lr"]`` at its step (all of ``torch.optim``, fused, foreach or single-tensor,
  and most optimizers from elsewhere) then applies exactly its own update at ``lr x factor``. An LR schedule
  never sees the factor: it writes the next step's LR after the step, on the put-back value.
* :class:`UpdateSize`: each tensor's update norm and weight norm across one update, for any optimizer: a
  transient copy of this rank's part of the weights is taken before the update and turned into the update in
  place after it (sharded tensors count whole). Taken only on the steps a callback asks for it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability import _compat, ranks
from lightning_stability.errors import config_error
from lightning_stability.norms import DTensor, combine_norms, is_dtensor, local_tensor, per_tensor_norms

__all__ = ["UpdateScale", "UpdateSize", "supports_tensor_lr"]


def supports_tensor_lr(optimizer: Optimizer) -> bool:
    """Whether every param group of ``optimizer`` can take a device tensor ``lr`` without host syncs.

    Fused Adam/AdamW/SGD and capturable Adam/AdamW read a tensor LR inside their kernels. The other
    implementations turn it into a Python number once per parameter (a host sync each), or refuse it (foreach).
    """
    return all(bool(g.get("fused")) or bool(g.get("capturable")) for g in optimizer.param_groups)


class UpdateScale:
    """The factors on one coming update, by source; their product scales every param group's LR for that update.

    A factor is a positive host number or a 0-dim device tensor. For an optimizer that takes a tensor LR
    (:func:`supports_tensor_lr`) a device factor stays on the device; for any other, the product is read on the host
    once, in the same transfer as the step's skip votes when there is one (``step.py``, row 8).
    """

    def __init__(self) -> None:
        self.factors: dict[str, Tensor | float] = {}
        #: each param group's LR as the update used it (set by :meth:`apply`, or at :meth:`close` without one)
        self.lrs: list[Any] | None = None
        self._saved: list[Any] = []
        self._applied: list[Any] = []
        self._version = 0  # factors added so far
        self._read: tuple[int, float] | None = None  # (version, product) read on the host early (see ``read_as``)

    def add(self, source: str, factor: Tensor | float) -> None:
        """Multiply the update by ``factor``; a source that adds twice gets the product of both."""
        if not isinstance(source, str) or not source:
            raise config_error("source", source, "is not a name", "pass the callback's name, e.g. 'lr_backoff'")
        if isinstance(factor, Tensor):
            if factor.numel() != 1 or factor.is_floating_point() is False:
                raise config_error(
                    "factor", tuple(factor.shape), "must be a floating 0-dim tensor", "pass e.g. torch.tensor(0.5)"
                )
            factor = factor.reshape(())
        elif (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not (factor >= 0 and math.isfinite(factor))
        ):
            raise config_error("factor", factor, "must be a finite number >= 0", "pass e.g. 0.5")
        else:
            factor = float(factor)
        earlier = self.factors.get(source)
        self.factors[source] = factor if earlier is None else earlier * factor
        self._version += 1

    def read_as(self, value: float) -> None:
        """The product of the factors added so far was read on the host as ``value`` (the step's early read)."""
        self._read = (self._version, value)

    def on_host(self) -> float | None:
        """The product as read on the host, if it was read and no factor came since; else ``None``."""
        return self._read[1] if self._read is not None and self._read[0] == self._version else None

    @property
    def total(self) -> Tensor | float:
        """The product of every factor (1.0 with none)."""
        total: Tensor | float = 1.0
        for factor in self.factors.values():
            total = factor * total if isinstance(factor, Tensor) else total * factor
        return total

    def needs_host(self, optimizer: Optimizer) -> bool:
        """Whether the product must be read on the host before it can go into ``optimizer``'s LRs."""
        return isinstance(self.total, Tensor) and not supports_tensor_lr(optimizer)

    def apply(self, optimizer: Optimizer, on_host: float | None = None) -> None:
        """Write ``lr x product`` into every param group (``on_host``: the product, already read on the host)."""
        total = self.total if on_host is None else on_host
        self._saved = [g["lr"] for g in optimizer.param_groups]
        if isinstance(total, float) and total == 1.0:
            self.lrs, self._applied = list(self._saved), []
            return
        if isinstance(total, Tensor):
            total = total.to(_lr_device(optimizer), non_blocking=True)
        for group in optimizer.param_groups:
            lr = group["lr"]
            group["lr"] = total * lr if isinstance(total, Tensor) and not isinstance(lr, Tensor) else lr * total
        self._applied = [g["lr"] for g in optimizer.param_groups]
        self.lrs = list(self._applied)

    def close(self, optimizer: Optimizer) -> None:
        """After the update: each group's LR as it was before :meth:`apply` (an LR written since stays), and
        :attr:`lrs` set also when :meth:`apply` never ran (the fp16 scaler skipped ``step()``): what they would have
        been."""
        for group, saved, applied in zip(optimizer.param_groups, self._saved, self._applied, strict=False):
            if group["lr"] is applied:
                group["lr"] = saved
        self._applied = []
        if self.lrs is None:
            self.lrs = self.used_lrs(optimizer)

    def used_lrs(self, optimizer: Optimizer) -> list[Any]:
        """The LRs of the update: as applied, or (before it) what they will be."""
        if self.lrs is not None:
            return self.lrs
        total = self.total
        if isinstance(total, float) and total == 1.0:
            return [g["lr"] for g in optimizer.param_groups]
        return [g["lr"] * total for g in optimizer.param_groups]


def _lr_device(optimizer: Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        lr = group["lr"]
        if isinstance(lr, Tensor):
            return lr.device
        for p in group["params"]:
            return local_tensor(p).device
    return torch.device("cpu")


class UpdateSize:
    """Each tensor's update across one update, measured from a copy of the weights taken before it.

    Args:
        params: the tensors the update changes (those with a gradient).

    After :meth:`finish`: :attr:`update_norms` and :attr:`weight_norms` (``(n,)`` fp32, whole tensors also when
    sharded; the weights before the update), :attr:`ratio` (``||Δθ|| / ||θ||`` over all of them) and
    :attr:`update_norm` (``||Δθ||``), both max-reduced over ranks, so every rank decides on the same numbers.
    """

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params
        with torch.no_grad():
            self.weight_norms = per_tensor_norms([p.detach() for p in params])
            #: this rank's part of each tensor before the update (one transient copy; freed by :meth:`finish`)
            self.before: list[Tensor] = [local_tensor(p).detach().clone() for p in params]
        self.update_norms: Tensor | None = None
        self.ratio: Tensor | None = None
        self.update_norm: Tensor | None = None

    def finish(self) -> None:
        """Right after the update (and any edit after it): the norms of what changed; frees the copy."""
        if self.update_norms is not None:
            return
        with torch.no_grad():
            after = [local_tensor(p).detach() for p in self.params]
            _compat.foreach_sub_(self.before, after)  # before - after: the update, negated, in place
            deltas = [
                DTensor.from_local(d, p.device_mesh, p.placements, run_check=False) if is_dtensor(p) else d  # type: ignore[attr-defined]
                for d, p in zip(self.before, self.params, strict=True)
            ]
            self.update_norms = per_tensor_norms(deltas)
        self.before = []
        total = combine_norms(self.update_norms)
        ratio = total / combine_norms(self.weight_norms).clamp(min=torch.finfo(torch.float32).tiny)
        both = torch.stack([ratio, total])
        ranks.max_(both)  # alike on every rank, also if one rank's weights strayed
        self.ratio, self.update_norm = both.unbind()
