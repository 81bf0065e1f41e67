"""A copy of the weights and optimizer state in host memory, restored in place: the rollback of PaLM's recipe.

Each rank keeps its own local shard (a DTensor's local part under FSDP2), so the copy costs host memory of one
shard of the model and its optimizer state per rank, and taking or restoring it needs no collective. Restoring
writes into the existing tensors, so the optimizer, the strategy's wrappers and any reference to a parameter
stay valid.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _copy(t: Tensor) -> Tensor:
    return _local(t).detach().to("cpu", copy=True)


class Snapshot:
    """Weights (parameters and buffers) and optimizer state, copied to the host.

    Args:
        module: the module whose parameters and buffers are copied.
        optimizers: the optimizers whose state is copied.
        step: a label for the copy (the step it was taken at).
    """

    def __init__(self, module: nn.Module, optimizers: Iterable[Optimizer], step: int) -> None:
        self.step = step
        # HOST SYNC: device-to-host copies (taken on logging steps only)
        self._tensors = [_copy(t) for t in _weights(module)]
        self._optim: list[dict[int, dict[str, Any]]] = []
        for opt in optimizers:
            states: dict[int, dict[str, Any]] = {}
            for index, p in enumerate(_params(opt)):
                state = opt.state.get(p)
                if state:
                    states[index] = {k: _copy(v) if isinstance(v, Tensor) else v for k, v in state.items()}
            self._optim.append(states)

    @property
    def nbytes(self) -> int:
        """Host bytes held by the copy."""
        total = sum(t.numel() * t.element_size() for t in self._tensors)
        for states in self._optim:
            for state in states.values():
                total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, Tensor))
        return total

    def restore(self, module: nn.Module, optimizers: Iterable[Optimizer]) -> None:
        """Write the copy back into ``module`` and ``optimizers`` in place."""
        with torch.no_grad():
            for target, saved in zip(_weights(module), self._tensors, strict=True):
                _local(target).copy_(saved, non_blocking=False)
            for opt, states in zip(optimizers, self._optim, strict=True):
                for index, p in enumerate(_params(opt)):
                    saved_state = states.get(index)
                    if saved_state is None:
                        opt.state.pop(p, None)  # the parameter had no state yet at the copy
                        continue
                    state = opt.state[p]
                    for key in list(state):
                        if key not in saved_state:
                            del state[key]
                    for key, value in saved_state.items():
                        current = state.get(key)
                        if isinstance(value, Tensor) and isinstance(current, Tensor):
                            _local(current).copy_(value)
                        else:
                            state[key] = value.to(_local(p).device, copy=True) if isinstance(value, Tensor) else value


def _weights(module: nn.Module) -> list[Tensor]:
    return [*module.parameters(), *module.buffers()]


def _params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
