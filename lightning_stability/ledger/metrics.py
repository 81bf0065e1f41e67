"""The ``stability/`` metrics of a step: monitorable at once, logged in one transfer, named per optimizer.

:class:`MetricQueue` holds what callbacks queue on a logging step, one queue per optimizer (a *track*), and
:meth:`MetricQueue.transfer` stacks every queued tensor of every track, and every value a callback sent with
``to_host``, and copies them to the host at once; each :class:`OnHost` handle then holds its host numbers.
:func:`monitor` puts a step's scalar into ``trainer.callback_metrics`` without any transfer, and
:func:`publish` hands a transfer's values to the loggers under their final names: at the end of a training batch,
in Lightning's own logger call of that step, on the same row as the module's ``self.log`` metrics.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_stability import _compat

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_stability.ledger.track import OptimizerRecord


FlushValues = dict[str, float | list[float]]
FlushHook = Callable[[FlushValues], dict[str, float] | None]


class OnHost:
    """A value on its way to the host with the logging step's one transfer (``LedgerCallback.to_host``,
    ``record_metric``); read it in ``on_host``: :meth:`number` for a 0-dim value, :meth:`numbers` for a vector."""

    __slots__ = ("_value",)

    def __init__(self, value: float | list[float] | None = None) -> None:
        self._value = value

    def _get(self) -> float | list[float]:
        if self._value is None:
            raise RuntimeError(
                "a value read before the logging step's transfer: read it in on_host (a metric recorded on a step "
                "that does not log never travels to the host)"
            )
        return self._value

    def number(self) -> float:
        """The value of a 0-dim tensor (or a host number)."""
        value = self._get()
        return value[0] if isinstance(value, list) else value

    def numbers(self) -> list[float]:
        """The values of a tensor, flattened."""
        value = self._get()
        return value if isinstance(value, list) else [value]


class MetricQueue:
    """Queued metrics and flush hooks, per track (optimizer index)."""

    def __init__(self) -> None:
        self._pending: dict[int, dict[str, Tensor | float]] = defaultdict(dict)
        self._sent: list[tuple[Tensor, OnHost]] = []  # to_host values, by any track
        self._handles: dict[tuple[int, str], OnHost] = {}  # queued metrics a callback reads back on the host
        self._hooks: dict[int, list[FlushHook]] = defaultdict(list)
        # host numbers logged as monitorable metrics: the last value and its tensor, reused while unchanged
        self._host_metrics: dict[str, tuple[float, Tensor]] = {}

    def route(
        self,
        trainer: pl.Trainer | None,
        track: OptimizerRecord,
        several_optimizers: bool,
        metrics: Iterable[tuple[str, Tensor | float]],
        to_loggers: bool,
    ) -> OnHost:
        """Scalars into ``trainer.callback_metrics`` at once; with ``to_loggers``,
        every value also queued for the next :meth:`publish`. Returns the last value's host copy (filled by the
        transfer; a host number at once)."""
        handle = OnHost()
        for key, value in metrics:
            if trainer is not None:
                name = metric_name(key, track, several_optimizers)
                if isinstance(value, Tensor):
                    monitor(trainer, name, value)
                else:  # a new tensor only when the number changes (a tensor once made is never written to)
                    cached = self._host_metrics.get(name)
                    if cached is None or cached[0] != value:
                        cached = self._host_metrics[name] = (value, torch.full((), float(value)))
                    monitor(trainer, name, cached[1])
            if to_loggers:
                self.put(track.index, key, value)
                handle = OnHost(float(value)) if not isinstance(value, Tensor) else OnHost()
                if isinstance(value, Tensor):  # a key two callbacks record in one step: one value, one handle
                    handle = self._handles.setdefault((track.index, key), handle)
        return handle

    def publish(
        self,
        trainer: pl.Trainer | None,
        device: torch.device,
        track_of: Callable[[int], OptimizerRecord],
        several_optimizers: bool,
        step: int,
        with_module_metrics: bool = False,
    ) -> dict[str, float]:
        """Empty the queue in one transfer and log it at ``step`` (see :func:`publish`)."""
        return publish(trainer, self.transfer(device), track_of, several_optimizers, step, with_module_metrics)

    def put(self, track: int, key: str, value: Tensor | float) -> None:
        self._pending[track][key] = value

    def send(self, value: Tensor) -> OnHost:
        """``value`` to the host with the next transfer; the handle holds it then."""
        handle = OnHost()
        self._sent.append((value, handle))
        return handle

    def add_hook(self, track: int, hook: FlushHook) -> None:
        self._hooks[track].append(hook)

    def __bool__(self) -> bool:
        return any(self._pending.values()) or any(self._hooks.values()) or bool(self._sent)

    def transfer(self, device: torch.device) -> dict[int, tuple[FlushValues, dict[str, Tensor]]]:
        """Empty the queue: per track, the host values (after its hooks ran) and 0-dim host tensors of the
        scalar tensor metrics (for ``trainer.callback_metrics``). **One** device-to-host copy in all."""
        pending, self._pending = self._pending, defaultdict(dict)
        hooks, self._hooks = self._hooks, defaultdict(list)
        sent, self._sent = self._sent, []
        handles, self._handles = self._handles, {}
        order = [(t, k) for t, values in pending.items() for k, v in values.items() if isinstance(v, Tensor)]
        tensors = [v for t, values in pending.items() for v in values.values() if isinstance(v, Tensor)]
        tensors += [value for value, _ in sent]
        host: list[float] = []
        host_tensor = torch.zeros(0)
        sizes: list[int] = []
        if tensors:
            flat = [x.detach().reshape(-1).to(torch.float64) for x in tensors]
            flat = [x if x.device == device else x.to(device, non_blocking=True) for x in flat]
            sizes = [x.numel() for x in flat]
            # HOST SYNC: the one batched device-to-host transfer of a logging step.
            host_tensor = torch.cat(flat).to("cpu", copy=True)
            host = host_tensor.tolist()
        result: dict[int, tuple[FlushValues, dict[str, Tensor]]] = {t: ({}, {}) for t in set(pending) | set(hooks)}
        offset = 0
        for (t, key), size in zip(order, sizes[: len(order)], strict=True):
            values, scalars = result[t]
            if pending[t][key].dim() == 0:  # type: ignore[union-attr]
                values[key] = host[offset]
                scalars[key] = host_tensor[offset].float()
            else:
                values[key] = host[offset : offset + size]
            handle = handles.get((t, key))
            if handle is not None:
                handle._value = values[key]
            offset += size
        for (value, handle), size in zip(sent, sizes[len(order) :], strict=True):
            handle._value = host[offset] if value.dim() == 0 else host[offset : offset + size]
            offset += size
        for t, queued in pending.items():
            result[t][0].update({k: float(v) for k, v in queued.items() if not isinstance(v, Tensor)})
        for t, track_hooks in hooks.items():
            values = result[t][0]
            for hook in track_hooks:
                extra = hook(values)
                if extra:
                    values.update(extra)
        return result


def metric_name(key: str, track: OptimizerRecord, several_optimizers: bool) -> str:
    """``key``, or ``key/<optimizer>`` when the trainer has several optimizers."""
    return f"{key}/{track.name}" if several_optimizers else key


def monitor(trainer: pl.Trainer, name: str, value: Tensor | float) -> None:
    """Put a scalar into ``trainer.callback_metrics``, where ``ModelCheckpoint``/``EarlyStopping`` look.

    A device tensor stays on the device: nothing moves until a monitor reads it. A host value becomes a CPU
    tensor (a fill from a Python float: no device involved, no copy).
    """
    if isinstance(value, Tensor):
        if value.dim() != 0:
            return
        metric = value.detach() if value.requires_grad else value
    else:
        metric = torch.full((), float(value), dtype=torch.float32)
    _compat.callback_metrics(trainer)[name] = metric


def publish(
    trainer: pl.Trainer | None,
    transferred: dict[int, tuple[FlushValues, dict[str, Tensor]]],
    track_of: Callable[[int], OptimizerRecord],
    several_optimizers: bool,
    step: int,
    with_module_metrics: bool = False,
) -> dict[str, float]:
    """Log a transfer's metrics to every logger at Lightning's ``step`` label and refresh the monitored
    scalars with their host copies. Returns the metrics under their final names.

    ``with_module_metrics`` (in ``on_train_batch_end``): they go out in Lightning's logger call of this step, with
    the module's ``self.log`` metrics and ``epoch`` (``_compat.log_with_module_metrics``), one row per step for
    ``CSVLogger``; otherwise (after training) each logger gets them at once, alone."""
    metrics: dict[str, float] = {}
    monitored: dict[str, Tensor] = {}
    for index, (values, scalars) in transferred.items():
        track = track_of(index)
        for key, value in values.items():
            if isinstance(value, float):
                metrics[metric_name(key, track, several_optimizers)] = value
        for key, value in values.items():  # host numbers (also those flush hooks added): monitorable too
            if isinstance(value, float):
                # a host tensor from a fill, not from host data: never a host-to-device copy
                monitored[metric_name(key, track, several_optimizers)] = torch.full((), value, dtype=torch.float32)
        monitored.update({metric_name(k, track, several_optimizers): v for k, v in scalars.items()})
    if trainer is not None:
        _compat.callback_metrics(trainer).update(monitored)
        if metrics and with_module_metrics:  # host numbers: Lightning's .item() of a tensor would not be needed
            _compat.log_with_module_metrics(trainer, metrics, step)
        elif metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
    return metrics
