"""Faults to rehearse with, on a CPU: a bit flipped in one layer's output on one rank at one step, and poisoned
samples in a dataset. The tests inject the same faults; run them against your own model to see what
``StepReplay`` does before a real chip or a real batch goes bad.

Example::

    flip = BitFlip(model, "layer.0", step=40, rank=1)  # the exponent's top bit of one output element
    trainer = StableTrainer.from_preset("gpt", replay=True, max_steps=100)
    trainer.fit(model, DataLoader(PoisonedSamples(dataset, [17]), batch_size=8, shuffle=True))
    flip.remove()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from lightning_stability.errors import StabilityConfigError, check_instance, check_int, config_error
from lightning_stability.replay.rerun import int_view


class BitFlip:
    """Flip one bit of one element of a submodule's output, on one rank, at given optimizer steps: a silent data
    corruption as a faulty chip makes one (a forward hook; :meth:`remove` takes it off).

    Args:
        module: the ``LightningModule`` being trained (it tells the step and the rank).
        layer: the name of the submodule whose output is corrupted (as in ``module.named_modules()``).
        step: the optimizer step (``trainer.global_step`` while the step runs), or several.
        rank: the rank whose output is corrupted.
        bit: which bit of the element, 0 the lowest; ``None``: the highest exponent bit of the output's dtype (30 for
            float32, 14 for bfloat16 and float16, 62 for float64), which multiplies the value by 2**128 (float32 and
            bfloat16) or sends it to a tiny one.
        element: which element of the output (its flat index); ``None``: the first whose ``bit`` is 0, so the flip
            sets it (for bit 30 of a float32: the value grows by 2**128, whatever it was).
        runs: which runs of the step are corrupted: 0 the step itself, 1 its first replay, 2 a second one. Each run
            is counted at the layer's first forward call of that run (the first micro-batch's).

    With ``torch.compile``, add it before the module is compiled: the hook runs outside the compiled graph, but a
    graph compiled earlier in the process does not see a hook added later (``torch.compiler.reset()`` clears
    them). :attr:`flipped` lists the flips made, as ``(step, run)``.
    """

    def __init__(
        self,
        module: pl.LightningModule,
        layer: str,
        step: int | Iterable[int],
        rank: int = 0,
        bit: int | None = None,
        element: int | None = None,
        runs: Iterable[int] = (0,),
    ) -> None:
        check_instance("module", module, pl.LightningModule, "the LightningModule being trained", "model")
        modules = dict(module.named_modules())
        if not isinstance(layer, str) or layer not in modules:
            raise config_error(
                "layer",
                layer,
                f"is not a submodule of {type(module).__name__}",
                f"pass one of {sorted(n for n in modules if n)[:8]} (the names of module.named_modules())",
            )
        self.module, self.rank = module, check_int("rank", rank, 0, "rank=1")
        self.bit = None if bit is None else check_int("bit", bit, 0, "bit=30 (float32's top exponent bit), or None")
        self.element = None if element is None else check_int("element", element, 0, "element=0, or None")
        self.steps = _ints("step", step, "step=40 or step=[40, 80]")
        self.runs = _ints("runs", runs, "runs=(0,) (the step itself) or runs=(1,) (its first replay)")
        self.flipped: list[tuple[int, int]] = []  # (step, run) of each flip made
        self._calls: dict[int, int] = {}  # step -> forward calls of the layer at that step
        self._per_run = 1
        # outside any torch.compile graph: traced, the hook would be specialised to the steps it saw when compiled
        self._handle = modules[layer].register_forward_hook(torch.compiler.disable(self._hook))

    def _hook(self, _module: nn.Module, _inputs: Any, output: Any) -> Any:
        try:
            trainer = self.module.trainer
        except RuntimeError:  # not attached to a Trainer
            return None
        if not torch.is_grad_enabled():
            return None
        step = trainer.global_step
        if step not in self.steps or self.module.global_rank != self.rank:
            return None
        call = self._calls.get(step, 0)
        self._calls[step] = call + 1
        per_run = max(1, trainer.accumulate_grad_batches)
        if call % per_run != 0 or call // per_run not in self.runs:
            return None
        if not isinstance(output, Tensor) or not output.is_floating_point():
            raise StabilityConfigError("BitFlip: the layer's output is not a floating-point tensor; pick another layer")
        bits = output.element_size() * 8
        bit = bits - 2 if self.bit is None else self.bit
        if not 0 <= bit < bits:
            raise StabilityConfigError(f"BitFlip: bit={bit} is not a bit of {output.dtype}. Fix: 0 to {bits - 1}")
        self.flipped.append((step, call // per_run))
        return flip_bit(output, self.element, bit)

    def remove(self) -> None:
        """Take the hook off."""
        self._handle.remove()


def _ints(argument: str, value: object, example: str) -> set[int]:
    """An int >= 0 or an iterable of them, as a set; else a config error naming ``argument``."""
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise config_error(argument, value, "must be an int >= 0 or a list of them", f"pass e.g. {example}")
    listed = list(items)
    if not listed or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in listed):
        raise config_error(argument, value, "must be an int >= 0 or a list of them", f"pass e.g. {example}")
    return set(listed)


def flip_bit(tensor: Tensor, element: int | None, bit: int) -> Tensor:
    """A copy of ``tensor`` with bit ``bit`` of its element ``element`` (flat index; ``None``: the first element
    whose bit is 0) flipped."""
    out = tensor.clone()
    flat = int_view(out.view(-1))
    mask = 1 << bit if bit < out.element_size() * 8 - 1 else -(1 << bit)
    if element is None:
        clear = ((flat & mask) == 0).nonzero()
        element = int(clear[0]) if len(clear) else 0
    flat[element] ^= mask
    return out


class PoisonedSamples(Dataset):
    """``dataset`` with some samples poisoned: each floating-point tensor of a poisoned sample is filled with
    ``value`` (NaN: the loss of any batch holding it is NaN; a large number: a loss spike).

    Args:
        dataset: a map-style dataset.
        indices: the indices of the poisoned samples.
        value: what their floating-point tensors are filled with.
    """

    def __init__(self, dataset: Any, indices: Iterable[int], value: float = float("nan")) -> None:
        if not (callable(getattr(dataset, "__getitem__", None)) and callable(getattr(dataset, "__len__", None))):
            raise config_error(
                "dataset", dataset, "is not a map-style dataset", "pass one with __getitem__ and __len__"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise config_error("value", value, "must be a number", "pass e.g. value=float('nan') or value=30.0")
        self.dataset, self.indices, self.value = dataset, _ints("indices", indices, "indices=[17]"), float(value)
        self.served: list[int] = []  # poisoned indices handed out, in order (what the run trained on)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        sample = self.dataset[index]
        if int(index) not in self.indices:
            return sample
        self.served.append(int(index))
        return _fill(sample, self.value)


def _fill(sample: Any, value: float) -> Any:
    if isinstance(sample, Tensor):
        return torch.full_like(sample, value) if sample.is_floating_point() else sample
    if isinstance(sample, tuple):
        return tuple(_fill(s, value) for s in sample)
    if isinstance(sample, list):
        return [_fill(s, value) for s in sample]
    if isinstance(sample, dict):
        return {k: _fill(v, value) for k, v in sample.items()}
    return sample
