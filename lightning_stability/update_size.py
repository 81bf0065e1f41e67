"""The size of one optimizer update relative to the weights, ``‖Δθ‖ / ‖θ‖``, in total and per module.

Measured on logging steps only: :class:`UpdateSize` keeps one transient copy of the local shard of the
parameters from before the update, turns it into the update in place afterwards, and takes the norms (sharded
parameters are reduced across their mesh, as for gradient norms). Other steps get no extra memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_stability import _compat
from lightning_stability.norms import DTensor, _is_dtensor, combine_norms, group_norms, per_tensor_norms


def _local(t: Tensor) -> Tensor:
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]


class UpdateSize:
    """Started right before an update (:meth:`__init__`), finished right after it (:meth:`finish`).

    Args:
        params: the parameters the optimizer updates.
        module_index: each parameter's module, as an int64 vector on the device.
        n_modules: the number of modules.
    """

    def __init__(self, params: list[Tensor], module_index: Tensor, n_modules: int) -> None:
        self.params, self.module_index, self.n_modules = params, module_index, n_modules
        with torch.no_grad():
            self.weight_norms = per_tensor_norms([p.detach() for p in params])
            self._before = [_local(p).detach().clone() for p in params]  # the one transient copy

    def finish(self) -> tuple[Tensor, Tensor]:
        """``(total, per_module)`` update-to-weight ratios (device tensors); frees the copy."""
        with torch.no_grad():
            after = [_local(p).detach() for p in self.params]
            _compat.foreach_sub_(self._before, after)  # before - after: the update, negated, in place
            deltas = [
                DTensor.from_local(d, p.device_mesh, p.placements, run_check=False) if _is_dtensor(p) else d  # type: ignore[attr-defined]
                for d, p in zip(self._before, self.params, strict=True)
            ]
            update_norms = per_tensor_norms(deltas)
        self._before = []
        eps = torch.finfo(torch.float32).tiny
        total = combine_norms(update_norms) / combine_norms(self.weight_norms).clamp(min=eps)
        per_module = group_norms(update_norms, self.module_index, self.n_modules) / group_norms(
            self.weight_norms, self.module_index, self.n_modules
        ).clamp(min=eps)
        return total, per_module
