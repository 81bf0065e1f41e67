"""The per-optimizer-step outcome ledger that every ``lightning_stability`` callback shares.

One :class:`StepLedger` exists per ``Trainer`` (:meth:`StepLedger.of`). During one optimizer step:

1. The first callback to reach ``on_before_optimizer_step`` calls :meth:`StepLedger.open_step`
   (every callback calls it; only the first call opens). Opening unscales fp16 gradients for
   optimizers that would otherwise unscale inside ``step()`` (fused Adam/AdamW/SGD), and records
   the loss scaler's overflow decision as a skip reason, so every callback sees unscaled gradients
   and nobody checks for overflow twice. For fused optimizers that decision is the scaler's
   ``found_inf`` tensor; for the others the scaler reads it on the host itself and calls
   ``optimizer.step()`` only without overflow, so whether the step ran *is* the decision (host-known).
2. Callbacks write the step's values with :meth:`put` (gradient norm, clip coefficient, ...) and
   ask for the update to be skipped with :meth:`mark_skip` (a ``bool`` or a 0-dim bool tensor).
   The ledger enforces the skip: on a fused optimizer as the ``found_inf`` tensor the optimizer
   itself honours (no host sync); otherwise by removing every gradient for this step, which costs
   one host sync to read the flag. Either way weights and optimizer state (moments, step counts,
   weight decay) stay exactly as they were.
3. After ``optimizer.step()`` (a step post-hook), or at ``on_train_batch_end`` when the loss scaler
   skipped the call altogether, :meth:`close_step` turns the flags into one :class:`Outcome`, counts
   it on the device and runs the hooks registered with :meth:`on_close`.
4. On logging steps callbacks queue values with :meth:`log`; :meth:`flush` stacks every queued
   tensor, moves them to the host in **one** transfer and hands them to every Lightning logger.

Nothing here calls ``.item()`` on a step that does not log, except where a non-fused optimizer
must be told on the host to skip (documented above), and no tensor is built from host data in the
step (on a GPU that is a blocking copy too). The ledger is saved once in the checkpoint under
``checkpoint["lightning_stability"]["ledger"]``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from enum import IntEnum
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

if TYPE_CHECKING:
    import lightning.pytorch as pl

CHECKPOINT_KEY = "lightning_stability"

Flag = bool | Tensor
FlushValues = dict[str, float | list[float]]
FlushHook = Callable[[FlushValues], dict[str, float] | None]


class Outcome(IntEnum):
    """What happened to one optimizer step. Lower values win when several reasons apply."""

    APPLIED = 0
    SKIPPED_SCALER = 1  # the fp16 loss scaler found inf/NaN in the scaled gradients
    SKIPPED_NONFINITE = 2  # a non-finite gradient norm (GradientNormMonitor)
    SKIPPED_SPIKE = 3  # a loss or gradient spike (health monitoring)


def _or(a: Flag, b: Flag) -> Flag:
    # No tensor is made from host data here: on a GPU that would be a blocking host-to-device copy.
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.bool() | b.to(a.device, non_blocking=True).bool()
    if isinstance(a, Tensor):
        return a.bool() | bool(b)
    if isinstance(b, Tensor):
        return b.bool() | bool(a)
    return a or b


def loss_scaler(trainer: pl.Trainer) -> Any | None:
    """The enabled ``GradScaler`` of the trainer's precision plugin, if any."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler


def _scaler_found_inf(scaler: Any, optimizer: Optimizer) -> Tensor | None:
    # torch keeps the overflow flags of `unscale_` in a private per-optimizer dict and offers no public
    # accessor; reading them here is what lets the ledger reuse the scaler's decision without a sync.
    state = scaler._per_optimizer_states.get(id(optimizer))
    found = state["found_inf_per_device"] if state else {}
    if not found:
        return None
    values = list(found.values())
    total = values[0]
    for v in values[1:]:
        total = total + v.to(total.device, non_blocking=True)
    return total > 0


def _unscale_if_deferred(scaler: Any, optimizer: Optimizer) -> None:
    """Unscale now for optimizers that Lightning leaves scaled (they unscale inside ``step()``)."""
    from torch.amp.grad_scaler import OptState

    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.READY:
        # The scaler records the overflow flags and later hands them to the fused step as `found_inf`
        # with `grad_scale=None`, so the fused kernel does not unscale a second time.
        scaler.unscale_(optimizer)


def _found_inf_is_safe(optimizer: Optimizer) -> bool:
    """Whether a ``found_inf`` skip leaves this fused optimizer exactly as it was.

    torch's fused SGD with momentum (2.13) leaves ``momentum_buffer`` uninitialised when its very first
    step is skipped through ``found_inf``; until every buffer exists, skip by dropping gradients instead.
    """
    if not isinstance(optimizer, torch.optim.SGD):
        return True
    return all(
        not group.get("momentum")
        or all(optimizer.state.get(p, {}).get("momentum_buffer") is not None for p in group["params"])
        for group in optimizer.param_groups
    )


class StepLedger:
    """The record of every optimizer step: values and flags as tensors, outcome counts on the device.

    Attributes:
        steps: optimizer steps attempted so far (host integer, skipped ones included).
        record: the current step's values, e.g. ``record["grad_norm"]`` (tensors).
        outcome: the outcome of the last closed step (an :class:`Outcome`, or an int64 tensor
            when the decision was never brought to the host).
    """

    _registry: ClassVar[weakref.WeakKeyDictionary[Any, StepLedger]] = weakref.WeakKeyDictionary()

    def __init__(self, trainer: pl.Trainer | None = None) -> None:
        self._trainer_ref = weakref.ref(trainer) if trainer is not None else None
        self.steps = 0
        self.record: dict[str, Tensor] = {}
        self.outcome: Outcome | Tensor = Outcome.APPLIED
        self._device: torch.device | None = None
        self._counts: Tensor | None = None
        self._loaded_counts: list[int] = [0] * len(Outcome)
        self._host_counts: list[int] | None = [0] * len(Outcome)
        self._window: dict[str, Tensor] = {}
        self._open: Optimizer | None = None
        self._skip: dict[Outcome, Flag] = {}
        self._found_inf_set = False
        self._stepped = False  # the optimizer's step() ran for the open step
        self._scaler_on_host = False  # the scaler decides this step on the host (non-fused optimizer)
        self._close_hooks: list[Callable[[StepLedger], None]] = []
        self._pending: dict[str, Tensor | float] = {}
        self._flush_hooks: list[FlushHook] = []
        # id(optimizer) -> (weak reference, hook handle); the reference tells a reused id from the same optimizer
        self._hooked: dict[int, tuple[weakref.ref[Optimizer], Any]] = {}

    # ------------------------------------------------------------------ lookup
    @classmethod
    def of(cls, trainer: pl.Trainer) -> StepLedger:
        """The ledger of ``trainer``, created on first use."""
        ledger = cls._registry.get(trainer)
        if ledger is None:
            ledger = cls._registry[trainer] = cls(trainer)
        return ledger

    @property
    def trainer(self) -> pl.Trainer | None:
        return self._trainer_ref() if self._trainer_ref is not None else None

    @property
    def device(self) -> torch.device:
        return self._device if self._device is not None else torch.device("cpu")

    # ------------------------------------------------------------------ step lifecycle
    def open_step(self, optimizer: Optimizer) -> bool:
        """Open the record of the step ``optimizer`` is about to take. Returns ``False`` if already open."""
        if self._open is optimizer:
            return False
        if self._open is not None:
            self.close_step()
        self._open = optimizer
        self.steps += 1
        self.record = {}
        self._skip = {}
        self._found_inf_set = False
        if self._device is None:
            self._device = self._device_of(optimizer)
            self._window = {k: v.to(self._device) for k, v in self._window.items()}
            if self._counts is not None:
                self._counts = self._counts.to(self._device)
        hooked = self._hooked.get(id(optimizer))
        if hooked is None or hooked[0]() is not optimizer:
            handle = optimizer.register_step_post_hook(self._after_optimizer_step)
            self._hooked[id(optimizer)] = (weakref.ref(optimizer), handle)
        self._stepped = False
        self._scaler_on_host = False
        trainer = self.trainer
        scaler = loss_scaler(trainer) if trainer is not None else None
        if scaler is not None:
            _unscale_if_deferred(scaler, optimizer)
            if getattr(optimizer, "_step_supports_amp_scaling", False):
                found_inf = _scaler_found_inf(scaler, optimizer)
                if found_inf is not None:
                    self._skip[Outcome.SKIPPED_SCALER] = found_inf
            else:
                # The scaler reads its overflow flag on the host itself and calls `optimizer.step()` only when
                # it found none: whether the step post-hook ran is the outcome, known without another sync.
                self._scaler_on_host = True
        return True

    @property
    def is_open(self) -> bool:
        return self._open is not None

    def is_logging_step(self, every_n_steps: int) -> bool:
        """Whether the current (1-based) optimizer step is one that logs every ``every_n_steps``."""
        return self.steps % every_n_steps == 0

    def put(self, key: str, value: Tensor) -> None:
        """Record a value of the current step."""
        self.record[key] = value

    def mark_skip(self, reason: Outcome, flag: Flag) -> None:
        """Skip the current update when ``flag`` is true, and say why.

        The decision must be identical on every rank; pass a flag computed from globally reduced
        values (e.g. the global gradient norm).
        """
        if self._open is None:
            raise RuntimeError("mark_skip() called outside an optimizer step; call open_step() first")
        if reason is Outcome.APPLIED:
            raise ValueError("Outcome.APPLIED is not a skip reason")
        if reason is not Outcome.SKIPPED_SCALER:
            flag = self._enforce(self._open, flag)
        previous = self._skip.get(reason, False)
        self._skip[reason] = _or(previous, flag)

    def _enforce(self, optimizer: Optimizer, flag: Flag) -> Flag:
        """Make the optimizer skip this update when ``flag`` is true; return the flag as it is now known
        (a host ``bool`` once it had to be read on the host, so the outcome stays host-known)."""
        trainer = self.trainer
        scaler = loss_scaler(trainer) if trainer is not None else None
        if (
            isinstance(flag, Tensor)
            and scaler is None
            and getattr(optimizer, "_step_supports_amp_scaling", False)
            and _found_inf_is_safe(optimizer)
        ):
            # Fused optimizers read `found_inf` in their kernel and leave params, moments and step counts
            # untouched when it is 1: the decision stays on the device.
            found = flag.to(device=self.device, dtype=torch.float32)
            if self._found_inf_set:
                found = torch.maximum(found, optimizer.found_inf)  # type: ignore[attr-defined]
            optimizer.found_inf = found  # type: ignore[attr-defined]
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            self._found_inf_set = True
            return flag
        # HOST SYNC: any other optimizer can only be told on the host. Without gradients, every torch
        # optimizer leaves the parameter and its state alone for this step.
        skip = bool(flag)
        if skip:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
        return skip

    def _after_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if self._open is optimizer:
            self._stepped = True
            self.close_step()

    def on_close(self, hook: Callable[[StepLedger], None]) -> None:
        """Run ``hook(ledger)`` once when the current step closes (after the optimizer step)."""
        self._close_hooks.append(hook)

    def close_step(self) -> None:
        """Turn the step's skip flags into one :class:`Outcome` and count it. Idempotent."""
        optimizer = self._open
        if optimizer is None:
            return
        if self._found_inf_set:
            del optimizer.found_inf  # type: ignore[attr-defined]
            del optimizer.grad_scale  # type: ignore[attr-defined]
            self._found_inf_set = False
        if self._scaler_on_host:
            self._skip[Outcome.SKIPPED_SCALER] = _or(self._skip.get(Outcome.SKIPPED_SCALER, False), not self._stepped)
            self._scaler_on_host = False
        counts = self._device_counts()
        outcome: Outcome | Tensor = Outcome.APPLIED
        for reason in sorted(self._skip, reverse=True):  # the lowest reason that applies wins
            flag = self._skip[reason]
            if isinstance(flag, Tensor):
                # scalars, not host-made tensors: on a GPU those would be blocking host-to-device copies
                other = outcome if isinstance(outcome, Tensor) else int(outcome)
                outcome = torch.where(flag.to(self.device, non_blocking=True).bool(), int(reason), other)
            elif flag:
                outcome = reason
        if isinstance(outcome, Tensor):
            counts.index_add_(0, outcome.view(1), torch.ones(1, dtype=counts.dtype, device=counts.device))
            self._host_counts = None
        else:
            counts[int(outcome)] += 1
            if self._host_counts is not None:
                self._host_counts[int(outcome)] += 1
        self.outcome = outcome
        self._open = None
        hooks, self._close_hooks = self._close_hooks, []
        for hook in hooks:
            hook(self)

    # ------------------------------------------------------------------ counters
    def _device_of(self, optimizer: Optimizer) -> torch.device:
        for group in optimizer.param_groups:
            for p in group["params"]:
                local = p.to_local() if hasattr(p, "to_local") else p
                return local.device
        return torch.device("cpu")

    def _device_counts(self) -> Tensor:
        if self._counts is None:
            self._counts = torch.tensor(self._loaded_counts, dtype=torch.int64, device=self.device)
        return self._counts

    @property
    def counts(self) -> Tensor:
        """Steps per :class:`Outcome` since the start of training (int64 tensor on the device)."""
        return self._device_counts()

    @property
    def applied_steps(self) -> Tensor:
        """Optimizer updates actually applied (0-dim int64 tensor on the device)."""
        return self._device_counts()[Outcome.APPLIED]

    @property
    def skipped_steps(self) -> Tensor:
        """Optimizer steps skipped for any reason (0-dim int64 tensor on the device)."""
        counts = self._device_counts()
        return counts.sum() - counts[Outcome.APPLIED]

    @property
    def applied_steps_host(self) -> int | None:
        """Applied updates as a host integer, when every outcome so far was decided on the host."""
        return None if self._host_counts is None else self._host_counts[Outcome.APPLIED]

    def applied_steps_now(self) -> int:
        """Applied updates as a host integer; reads the device counter when needed (a HOST SYNC: use it
        for checkpoints and setup, not in the step)."""
        host = self.applied_steps_host
        return host if host is not None else int(self.applied_steps)

    def accumulate(self, key: str, value: Tensor | float) -> None:
        """Add ``value`` to the window sum ``key`` (kept on the device, saved in checkpoints)."""
        current = self._window.get(key)
        if isinstance(value, Tensor):
            value = value.to(torch.float32)
        if current is None:
            # a fill plus a scalar, never torch.tensor(value, device=...): on a GPU that is a blocking copy
            zero = torch.zeros((), dtype=torch.float32, device=self.device)
            self._window[key] = zero + value
        else:
            self._window[key] = current + value

    def pop_window(self, key: str) -> Tensor:
        """Return the window sum ``key`` and reset it to zero."""
        value = self._window.pop(key, None)
        return value if value is not None else torch.zeros((), dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------------ logging
    def log(self, key: str, value: Tensor | float) -> None:
        """Queue a metric for the next :meth:`flush`. Keys starting with ``_`` reach flush hooks only."""
        self._pending[key] = value

    def on_flush(self, hook: FlushHook) -> None:
        """Run ``hook(values)`` once at the next flush, with every queued value on the host.

        Scalars arrive as floats and vectors as lists of floats. The hook may return extra metrics to
        log (e.g. per-layer norms under names resolved from transferred indices).
        """
        self._flush_hooks.append(hook)

    def flush(self) -> dict[str, float]:
        """Move every queued tensor to the host in one transfer and log the metrics. Returns them.

        Scalar tensor metrics also land in ``trainer.callback_metrics`` (as CPU tensors), where
        ``ModelCheckpoint`` and ``EarlyStopping`` can monitor them.
        """
        if not self._pending and not self._flush_hooks:
            return {}
        pending, self._pending = self._pending, {}
        hooks, self._flush_hooks = self._flush_hooks, []
        values: FlushValues = {}
        monitored: dict[str, Tensor] = {}  # 0-dim views of the host copy, for trainer.callback_metrics
        tensor_keys = [k for k, v in pending.items() if isinstance(v, Tensor)]
        if tensor_keys:
            flat = [pending[k].detach().reshape(-1).to(torch.float64) for k in tensor_keys]  # type: ignore[union-attr]
            flat = [t if t.device == self.device else t.to(self.device, non_blocking=True) for t in flat]
            sizes = [t.numel() for t in flat]
            # HOST SYNC: the one batched device-to-host transfer of a logging step.
            host_tensor = torch.cat(flat).to("cpu", copy=True)
            host = host_tensor.tolist()
            offset = 0
            for key, size in zip(tensor_keys, sizes, strict=True):
                if pending[key].dim() == 0:  # type: ignore[union-attr]
                    values[key] = host[offset]
                    if not key.startswith("_"):
                        monitored[key] = host_tensor[offset].float()
                else:
                    values[key] = host[offset : offset + size]
                offset += size
        values.update({k: float(v) for k, v in pending.items() if not isinstance(v, Tensor)})
        for hook in hooks:
            extra = hook(values)
            if extra:
                values.update(extra)
        metrics: dict[str, float] = {k: v for k, v in values.items() if not k.startswith("_") and isinstance(v, float)}
        trainer = self.trainer
        if monitored and trainer is not None:
            # So that ModelCheckpoint / EarlyStopping can `monitor="stability/..."` (tensor-valued keys).
            trainer.callback_metrics.update(monitored)
        if metrics and trainer is not None:
            for logger in trainer.loggers:
                # Lightning labels the k-th optimizer step k - 1 (its `self.log` and LearningRateMonitor):
                # the same label puts `stability/` metrics on the same rows as the module's own.
                logger.log_metrics(metrics, step=max(self.steps - 1, 0))
        return metrics

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "steps": self.steps,
            "counts": self._device_counts().tolist(),
            "host_counts_exact": self._host_counts is not None,
            "window": {k: v.detach().cpu() for k, v in self._window.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))
        counts = [int(c) for c in state.get("counts", [0] * len(Outcome))]
        counts += [0] * (len(Outcome) - len(counts))
        self._loaded_counts = counts
        self._counts = None
        self._host_counts = list(counts) if state.get("host_counts_exact", True) else None
        self._window = {k: v.to(self.device) for k, v in state.get("window", {}).items()}

    def save_into(self, checkpoint: dict[str, Any]) -> None:
        """Write the ledger into a Lightning checkpoint dict (idempotent: every callback may call it)."""
        checkpoint.setdefault(CHECKPOINT_KEY, {})["ledger"] = self.state_dict()

    def load_from(self, checkpoint: dict[str, Any]) -> None:
        """Restore from a Lightning checkpoint dict; a checkpoint without a ledger leaves it as is."""
        state = checkpoint.get(CHECKPOINT_KEY, {}).get("ledger")
        if state is not None:
            self.load_state_dict(state)
