"""The output logits' log-partition (mean log-sum-exp over the vocabulary) and its drift, on the device.

Output-logit divergence is the second instability Wortsman et al. 2023 reproduce at small scale (arXiv
2309.14322): the logits drift away from zero, ``log Z = logsumexp(logits)`` grows in magnitude, and the loss
diverges; z-loss (PaLM, Chowdhery et al. 2022: ``1e-4 * log(Z)^2``) is their fix. :class:`LogPartition` watches
``log Z`` from a forward hook on the LM head, without touching the model's code or its loss.

* ``log_partition(logits)``: the mean over every position of ``logsumexp`` over the last (vocabulary) dimension,
  in fp32.
* drift: the step's ``log Z`` minus its exponential moving average before the step (``ema = decay * ema + (1 -
  decay) * log Z``; the first value starts the average, with drift 0).

Over several data-parallel ranks (DDP, FSDP2) the step's ``log Z`` is the mean of the ranks' (one all-reduce, the
mean over the global batch when the ranks' batches are of one size), taken before the EMA moves, so every rank
keeps the same EMA. A vocabulary-sharded head (tensor parallelism) is not supported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_stability import ranks
from lightning_stability.errors import StabilityConfigError, check_ratio, config_error

#: The names an LM head usually has, tried in this order when no ``module`` is given.
HEAD_NAMES = ("lm_head", "head", "output", "output_layer", "decoder")

#: ``fn(output) -> logits``: the logits tensor from the head module's output.
LogitsFn = Callable[[Any], Tensor]


def log_partition(logits: Tensor) -> Tensor:
    """0-dim fp32 tensor: the mean over every position of ``logsumexp`` over the last dimension of ``logits``."""
    return torch.logsumexp(logits.detach().float(), dim=-1).mean()


def _default_logits(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    raise StabilityConfigError(
        f"the LM head returned a {type(output).__name__}, not the logits. Fix: pass "
        "LogPartition(model, logits_fn=lambda output: <the logits tensor>)."
    )


def find_head(model: nn.Module, module: str | None = None) -> tuple[str, nn.Module]:
    """``(name, module)`` of the LM head: ``module`` by name, else the first of :data:`HEAD_NAMES` found.

    Raises:
        StabilityConfigError: when the named module does not exist, or none of the usual names does.
    """
    modules = dict(model.named_modules())
    if module is not None:
        if module not in modules:
            raise config_error("module", module, f"is not a module of {type(model).__name__}", _head_fix(modules))
        return module, modules[module]
    for name in HEAD_NAMES:
        for candidate in (name, f"model.{name}"):
            if candidate in modules:
                return candidate, modules[candidate]
    raise config_error(
        "module", None, f"found no LM head named {HEAD_NAMES} in {type(model).__name__}", _head_fix(modules)
    )


def _head_fix(modules: dict[str, nn.Module]) -> str:
    linears = [name for name, m in modules.items() if isinstance(m, nn.Linear)]
    return f"pass module=<the name of the module that outputs the logits> (its Linear layers: {linears[-3:]})"


class LogPartition:
    """A forward hook on the LM head keeping the step's log-partition and its drift, as device tensors.

    Args:
        model: the model.
        module: the name of the module whose output is the logits (default: the first of :data:`HEAD_NAMES`).
        logits_fn: how to get the logits from that module's output (default: the output itself, or its
            ``.logits``).
        decay: the EMA's decay per :meth:`end_step` (0.99: about the last 100 steps).

    Several forwards in one step (micro-batches) are averaged. :meth:`end_step` closes the step: it returns
    ``(log_z, drift)`` and updates the EMA; no host sync anywhere.

    Raises:
        StabilityConfigError: for an unknown ``module`` or a ``decay`` outside [0, 1].
    """

    def __init__(
        self, model: nn.Module, module: str | None = None, logits_fn: LogitsFn | None = None, decay: float = 0.99
    ) -> None:
        self.name, head = find_head(model, module)
        self.decay = check_ratio("decay", decay, example="0.99")
        self.logits_fn = logits_fn or _default_logits
        self.active = True  #: False: the hook returns at once
        self.ema: Tensor | None = None
        self._sum: Tensor | None = None
        self._count = 0
        self._device = next(head.parameters(), torch.empty(0)).device
        self._handle = head.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self.active:
            return
        with torch.no_grad():
            value = log_partition(self.logits_fn(output))
        self._sum = value if self._sum is None else self._sum + value
        self._count += 1

    def end_step(self) -> tuple[Tensor, Tensor] | None:
        """``(log_z, drift)`` of the step's forwards, then the EMA moves on; ``None`` when nothing was seen."""
        if self._sum is None:
            return None
        log_z = self._sum / self._count
        self._sum, self._count = None, 0
        # the mean over ranks before the EMA moves: every rank keeps the same EMA (rank 0's checkpoint resumes all)
        log_z = ranks.mean(log_z)
        if self.ema is None:
            self.ema = log_z.clone()
        drift = log_z - self.ema
        self.ema = self.decay * self.ema + (1 - self.decay) * log_z
        return log_z, drift

    def state_dict(self) -> dict[str, Any]:
        """The EMA (a checkpoint resumes the drift where it was)."""
        return {"ema": None if self.ema is None else self.ema.detach().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s EMA, on the head's device."""
        ema = state.get("ema")
        self.ema = None if ema is None else ema.to(self._device)

    def remove(self) -> None:
        """Remove the hook."""
        self._handle.remove()
