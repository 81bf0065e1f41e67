"""Run the open optimizer step's forward and backward once more, from what it started from.

What a replay needs is kept as the step's micro-batches come (:class:`StepInputs`), at no copy of the weights or
the optimizer state, which the step has not touched yet when the replay runs (before the update):

* each micro-batch as the training step received it (a reference: the batch stays alive until the update), its
  ``batch_idx``, and the states of torch's generators right before it (CPU and CUDA: what dropout and
  ``torch.rand*`` draw from; a few kB, ~1 us). NumPy's and Python's generators are not kept (their capture costs
  ~50 us a step): a training step that draws from them makes its replay disagree, so the step is judged
  nondeterministic and skipped, never applied wrong;
* its loss as passed to backward (a reference);
* the buffers a forward changes, persistent or not (BatchNorm's running statistics, an MoE layer's token counts),
  copied before the first micro-batch (:class:`~lightning_stability.ledger.forward_state.ForwardState`: found by their
  version counters at the fit's first step, only those copied; constants such as attention masks and rotary
  caches are not). Most transformers have none or a few small ones.

:func:`rerun` then puts the buffers back and runs each micro-batch again as Lightning's loop runs it: the RNG states
put back, ``training_step`` through the strategy (DDP's or FSDP's forward, the precision's autocast), the loss
divided by the accumulation factor, the functions of row 1 of the step table (``Stage.BACKWARD``: a router
z-loss's gradient hook), backward through the precision plugin, the gradient sync of data parallelism
held back on all but the last micro-batch. What the training step logs is dropped. Afterwards the gradients, the
buffers and the RNG states are those of the replayed step, as a fault-free run leaves them.

:func:`shipped` and :func:`received` move one rank's micro-batches (on the CPU) and RNG states to another, which runs
them with ``rerun(..., sync=False)``: under DDP every rank holds the same weights, so a healthy rank computes what
the suspect's device should have.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import move_data_to_device
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_stability import _compat
from lightning_stability.checkpoint import rng
from lightning_stability.ledger.forward_state import ForwardState
from lightning_stability.ledger.step_ledger import StepLedger
from lightning_stability.norms import local_tensor


@dataclass
class MicroBatch:
    """One micro-batch of the open step: the batch, its ``batch_idx``, the RNG states before it, its loss as passed
    to backward (``None`` until then, or when ``training_step`` returned ``None``), its sample indices (``None``
    where the loader's sampler cannot tell) and whether it stands in for a batch whose samples are all
    quarantined (the step is then skipped)."""

    batch: Any
    batch_idx: int
    rng: dict[str, Any]
    indices: list[int] | None
    loss: Tensor | None = None
    stand_in: bool = False


class StepInputs:
    """What the open step started from, kept as its micro-batches come (see the module's doc)."""

    def __init__(self, every_generator: bool = False) -> None:
        #: also NumPy's and Python's generators, not torch's alone (~50 us a micro-batch)
        self.every_generator = every_generator
        self.micro: list[MicroBatch] = []
        self._state: ForwardState | None = None  # the module's buffers a forward changes

    def add_micro_batch(
        self, module: nn.Module, batch: Any, batch_idx: int, indices: list[int] | None, stand_in: bool = False
    ) -> None:
        """At ``on_train_batch_start``: keep the micro-batch and the RNG states before it; before the first of a
        step, copy the buffers its forward changes."""
        if not self.micro:
            self._state = ForwardState.of(module)
            self._state.begin(copy=True)
        states = rng.capture() if self.every_generator else rng.capture_torch()
        self.micro.append(MicroBatch(batch, batch_idx, states, indices, stand_in=stand_in))

    def add_loss(self, loss: Tensor) -> None:
        """At ``on_before_backward``: the current micro-batch's loss as passed to backward."""
        if self.micro:
            self.micro[-1].loss = loss.detach()

    def clear(self) -> None:
        """Once the step is over: let the batches go."""
        self.micro = []
        if self._state is not None:
            self._state.end()

    def restore_buffers(self) -> None:
        """Put back the buffers as they were before the step's first micro-batch."""
        if self._state is not None:
            with torch.no_grad():
                self._state.restore()

    def forget_module(self, module: nn.Module) -> None:
        """At a fit's start: find the module's buffers again at the first step."""
        ForwardState.of(module).forget()
        self._state, self.micro = None, []

    @property
    def nbytes(self) -> int:
        """Device bytes held by the buffer copies."""
        return 0 if self._state is None else self._state.nbytes


def rerun(
    trainer: pl.Trainer,
    optimizer: Optimizer,
    inputs: StepInputs,
    keep: Sequence[bool] | None = None,
    sync: bool = True,
) -> list[Tensor | None]:
    """Run the step's micro-batches again (see the module's doc); returns each one's loss as passed to backward.
    Every rank calls it together (data parallelism syncs the gradients in the last backward).

    With ``keep`` (a flag per micro-batch, at least one true), only the kept ones run, and each loss is divided by
    their number: the gradient is their mean (``None`` in the losses for the others). With ``sync=False`` the
    gradient sync is held back on every micro-batch: each rank's gradients are its own (a run of another rank's
    micro-batches, :func:`shipped`)."""
    module = trainer.lightning_module
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
    inputs.restore_buffers()
    kept = [True] * len(inputs.micro) if keep is None else list(keep)
    normalize = trainer.accumulate_grad_batches if keep is None else sum(kept)
    with_idx = is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2)  # as Lightning's loop
    losses: list[Tensor | None] = []
    last = max(i for i, k in enumerate(kept) if k)
    for i, micro in enumerate(inputs.micro):
        if not kept[i]:
            losses.append(None)
            continue
        rng.restore(micro.rng)
        with _sync_held_back(trainer, i < last or not sync), _compat.training_step_again(trainer, micro.batch):
            args = (micro.batch, micro.batch_idx) if with_idx else (micro.batch,)
            output = trainer.strategy.training_step(*args)
            loss = _closure_loss(output)
            if loss is None:
                losses.append(None)
                continue
            loss = loss / normalize
            StepLedger.of(trainer).run_backward_stage(1.0 / normalize)  # row 1 (a router z-loss's hook)
            trainer.precision_plugin.backward(loss, module, optimizer)
        losses.append(loss.detach())
    return losses


def shipped(inputs: StepInputs) -> list[tuple[Any, int, dict[str, Any], int | None]]:
    """The open step's micro-batches as another rank can run them (:func:`received`): each batch on the CPU, its
    ``batch_idx``, the RNG states before it and the index of this rank's CUDA device (``None`` on a CPU)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return [
        (apply_to_collection(m.batch, Tensor, lambda t: t.detach().cpu()), m.batch_idx, m.rng, device)
        for m in inputs.micro
    ]


def received(inputs: StepInputs, micro: list[tuple[Any, int, dict[str, Any], int | None]], device: Any) -> StepInputs:
    """Another rank's micro-batches (:func:`shipped`) to run here with :func:`rerun`: the batches moved to
    ``device``, the other rank's CUDA generator state put on this rank's device; the buffers to put back are
    ``inputs``' (this rank's, as the step started)."""
    mine = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    other = StepInputs(inputs.every_generator)
    other._state = inputs._state
    for batch, batch_idx, states, theirs in micro:
        states = dict(states)
        if "cuda" in states:
            if mine is None or theirs is None:
                del states["cuda"]
            else:
                cuda = list(torch.cuda.get_rng_state_all())
                cuda[mine] = states["cuda"][theirs]
                states["cuda"] = cuda
        other.micro.append(MicroBatch(move_data_to_device(batch, device), batch_idx, states, None))
    return other


def gradients(optimizer: Optimizer) -> list[Tensor | None]:
    """The optimizer's gradients (each rank's local part), in parameter order."""
    return [
        None if p.grad is None else local_tensor(p.grad) for group in optimizer.param_groups for p in group["params"]
    ]


def copies(tensors: Sequence[Tensor | None]) -> list[Tensor | None]:
    """Detached copies of ``tensors``."""
    return [None if t is None else t.detach().clone() for t in tensors]


def same_bits(a: Sequence[Tensor | None], b: Sequence[Tensor | None]) -> bool:
    """Whether ``a`` and ``b`` hold the same tensors bit for bit (a NaN equals the same NaN). One host read per
    tensor: for the rare replayed step only."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            if x is not y:
                return False
            continue
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(_bits(x), _bits(y)):
            return False
    return True


_INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def int_view(t: Tensor) -> Tensor:
    """``t``'s bits as the signed integers of its element size (a view: writing it writes ``t``)."""
    return t.view(_INT_OF[t.element_size()])


def _bits(t: Tensor) -> Tensor:
    t = t.detach()
    if t.is_complex():
        return t.contiguous().view(torch.int64)
    return int_view(t.contiguous()) if t.is_floating_point() else t


def _closure_loss(output: Any) -> Tensor | None:
    """The loss in what ``training_step`` returned, as Lightning's automatic optimization reads it."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict):
        loss = output.get("loss")
        return loss if isinstance(loss, Tensor) else None
    return None


@contextlib.contextmanager
def _sync_held_back(trainer: pl.Trainer, hold: bool) -> Iterator[None]:
    """Lightning's ``block_backward_sync`` on the micro-batches that only accumulate (data parallelism)."""
    block = getattr(trainer.strategy, "block_backward_sync", None)
    if hold and block is not None:
        with block():
            yield
    else:
        yield
