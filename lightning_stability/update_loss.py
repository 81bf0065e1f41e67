"""The loss of the coming optimizer update, on the device, before the update.

What ``on_before_backward`` sees is not that loss: Lightning divides each micro-batch's loss by the
accumulation factor (automatic optimization) and the fp16 scaler multiplies it by the loss scale. This
undoes both and averages over the micro-batches of the update, with no host sync.
"""

from __future__ import annotations

import torch
from torch import Tensor


class UpdateLoss:
    """Collects the micro-batch losses of one update; :meth:`take` gives their mean and starts the next."""

    def __init__(self) -> None:
        self.enabled = False  # a callback that needs the loss turns it on (it costs ~3 small ops per micro-batch)
        self._sum: Tensor | None = None
        self._count = 0

    def add(self, loss: Tensor, scale: Tensor | None, normalize: int) -> None:
        """Record one micro-batch's loss as passed to backward: times ``normalize`` (the factor Lightning
        divided it by), over ``scale`` (the fp16 loss scale it was multiplied by)."""
        value = loss.detach().to(torch.float32)
        if scale is not None:
            value = value / scale.to(value.device, non_blocking=True)
        if normalize != 1:
            value = value * normalize
        self._sum = value if self._sum is None else self._sum + value
        self._count += 1

    def take(self) -> Tensor | None:
        """The mean loss of the micro-batches since the last call (``None`` if there were none)."""
        total, count = self._sum, self._count
        self._sum, self._count = None, 0
        if total is None:
            return None
        return total / count if count > 1 else total
