"""GradientAccumulation: a constant or step-keyed accumulation factor, LR scaling, BatchNorm checks."""

from __future__ import annotations

import bisect
import math
import warnings
from collections.abc import Mapping
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_stability.callbacks.base import LedgerCallback
from lightning_stability.errors import StabilityConfigError, check_positive_int, config_error
from lightning_stability.ledger import StepLedger

_LR_SCALINGS = ("linear", "sqrt", "none", "adascale")
_BATCHNORM = ("warn", "ignore", "group_norm", "sync_batchnorm")
_FAIRSCALE_FIX = (
    'install the extra: pip install "lightning-stability[fairscale]" (FairScale 0.4.13 ships as a source '
    "package; `pip install --no-build-isolation fairscale==0.4.13` keeps the torch you already have), "
    "or pick lr_scaling='linear', 'sqrt' or 'none'"
)


def _parse_steps(steps: int | Mapping[int, int]) -> tuple[list[int], list[int]]:
    """(sorted keys, factors) of an accumulation schedule; before the first key the factor is 1."""
    if isinstance(steps, Mapping):
        if not steps:
            raise config_error("steps", dict(steps), "is an empty schedule", "pass e.g. {0: 2, 1000: 4} or an int")
        for key, value in steps.items():
            if isinstance(key, bool) or not isinstance(key, int) or key < 0:
                raise config_error(
                    "steps",
                    dict(steps),
                    f"has key {key!r}; keys are optimizer-update counts (ints >= 0)",
                    "key the schedule by optimizer update, e.g. {0: 2, 1000: 4}",
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise config_error(
                    "steps",
                    dict(steps),
                    f"maps {key} to {value!r}; factors are ints >= 1",
                    "pass e.g. {0: 2, 1000: 4}",
                )
        schedule = dict(steps)  # a copy: the caller's dict is never changed
        schedule.setdefault(0, 1)
        keys = sorted(schedule)
        return keys, [schedule[k] for k in keys]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise config_error("steps", steps, "must be an int >= 1 or a dict {update: factor}", "pass e.g. 4")
    return [0], [steps]


def _store(optimizer: Optimizer) -> dict[Any, Any]:
    """The optimizer's state dict, where FairScale's AdaScale keeps its statistics under "adascale"."""
    return cast("dict[Any, Any]", optimizer.state)


def _groups_for(channels: int, max_groups: int = 32) -> int:
    return max(g for g in range(1, min(max_groups, channels) + 1) if channels % g == 0)


def _batchnorm_modules(module: nn.Module) -> list[str]:
    return [name for name, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _convert_to_group_norm(module: nn.Module) -> None:
    """Replace every BatchNorm{1,2,3}d below ``module`` by a GroupNorm with the same channels and affine."""
    for name, child in module.named_children():
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            gn = nn.GroupNorm(_groups_for(child.num_features), child.num_features, eps=child.eps, affine=child.affine)
            if child.affine:
                gn = gn.to(device=child.weight.device, dtype=child.weight.dtype)
                gn.weight.data.copy_(child.weight.data)
                gn.bias.data.copy_(child.bias.data)
            setattr(module, name, gn)
        else:
            _convert_to_group_norm(child)


class GradientAccumulation(LedgerCallback):
    """Accumulate gradients over several micro-batches per optimizer step; the factor may change by step.

    ``steps`` is a constant or a schedule keyed by the number of applied optimizer updates, e.g.
    ``{0: 2, 1000: 4}``: two micro-batches per update for the first 1000 updates, four after that
    (the same clock as :class:`~lightning_stability.callbacks.lr_schedule.ScheduledLR`; a skipped step
    does not move it). Before the first key the factor is 1. Lightning's own
    ``GradientAccumulationScheduler`` switches only at epoch boundaries; this one switches between any
    two optimizer steps. Each micro-batch's loss is divided by the number of micro-batches of its
    optimizer step (also for the shorter last step of an epoch), so the gradient is always the mean
    over the effective batch: the full-batch gradient of a model without BatchNorm. Under DDP the
    gradients are all-reduced once per optimizer step, on the last micro-batch only.

    LR scaling (``lr_scaling``) for a factor ``k``, relative to the LR set in ``configure_optimizers``
    (tuned for one micro-batch):

    - ``"linear"`` (seed row 17, ``lr = base_lr * k``): right for SGD with momentum when the batch is
      still well below the critical batch size (Goyal et al., 2017); too large for Adam at large ``k``.
    - ``"sqrt"`` (``lr = base_lr * sqrt(k)``): keeps the update's noise scale for Adam-type
      optimizers (Malladi et al., 2022); the usual choice for Adam/AdamW.
    - ``"none"``: the LR was already tuned for the accumulated batch.
    - ``"adascale"`` (needs the ``fairscale`` extra): FairScale's AdaScale gain, measured from the
      spread of the micro-batch gradients: 1 when they agree (no gain from a larger batch), up to
      ``k`` when they are pure noise (linear scaling). It is recomputed every step; FairScale's
      estimator moves its statistics to the host once per parameter per step, so it costs syncs.

    With an LR schedule callback attached, the schedule computes ``base * schedule * scale`` in one
    place; without one, this callback writes ``base * scale`` whenever the factor changes.

    BatchNorm (seed row 18): its statistics see one micro-batch, not the accumulated batch, so under
    accumulation they are noisier than the effective batch suggests. ``batchnorm="warn"`` (default)
    says so at ``setup``; ``"group_norm"`` replaces each BatchNorm by a GroupNorm with the same
    channels and affine weights before the optimizer is built (batch-independent, no running
    statistics, but a different normalisation: retrain, do not load BatchNorm statistics);
    ``"sync_batchnorm"`` converts to ``SyncBatchNorm`` under DDP on GPUs (statistics over the micro-batch of
    every rank: ``world_size`` times more samples, one all-reduce per BatchNorm layer per forward);
    ``"ignore"`` does nothing.

    Logged keys (on logging steps, through the ledger):

    ==================================  =====================================================
    Key                                 Meaning
    ==================================  =====================================================
    ``stability/accumulation_steps``    micro-batches accumulated into this optimizer step
    ``stability/lr_scale``              LR factor from accumulation (``k``, ``sqrt(k)``, 1, gain)
    ==================================  =====================================================

    Args:
        steps: micro-batches per optimizer step: an int, or ``{applied_updates: factor}``.
        lr_scaling: ``"linear"``, ``"sqrt"``, ``"none"`` or ``"adascale"`` (see above).
        batchnorm: ``"warn"``, ``"ignore"``, ``"group_norm"`` or ``"sync_batchnorm"`` (see above).
        log_every_n_steps: log every this many optimizer steps; default: the Trainer's.

    Raises:
        StabilityConfigError: for a bad argument or a missing ``fairscale``; at ``setup`` when the
            Trainer also accumulates (``accumulate_grad_batches``, ``GradientAccumulationScheduler``),
            for manual optimization, for a strategy that accumulates by itself (DeepSpeed), or for
            ``batchnorm="sync_batchnorm"`` without DDP on GPUs; at ``on_fit_start`` when ``lr_scaling``
            ``"linear"``/``"sqrt"`` meets an LR scheduler returned by ``configure_optimizers`` (both would
            write the LR; use :class:`~lightning_stability.callbacks.lr_schedule.ScheduledLR` instead).

    Example::

        trainer = L.Trainer(callbacks=[GradientAccumulation(steps={0: 2, 1000: 8}, lr_scaling="sqrt")])
    """

    def __init__(
        self,
        steps: int | Mapping[int, int] = 1,
        lr_scaling: str = "linear",
        batchnorm: str = "warn",
        log_every_n_steps: int | None = None,
    ) -> None:
        self._keys, self._factors = _parse_steps(steps)
        if lr_scaling not in _LR_SCALINGS:
            raise config_error("lr_scaling", lr_scaling, f"is not one of {_LR_SCALINGS}", "pass e.g. 'sqrt' for AdamW")
        if lr_scaling == "adascale":
            try:
                import fairscale.optim  # noqa: F401
            except ImportError as err:
                raise config_error(
                    "lr_scaling", lr_scaling, "needs FairScale, which is not installed", _FAIRSCALE_FIX
                ) from err
        if batchnorm not in _BATCHNORM:
            raise config_error("batchnorm", batchnorm, f"is not one of {_BATCHNORM}", "pass 'warn' or 'group_norm'")
        if log_every_n_steps is not None:
            check_positive_int("log_every_n_steps", log_every_n_steps, "50, or None for the Trainer's")
        self.steps = dict(zip(self._keys, self._factors, strict=True)) if isinstance(steps, Mapping) else steps
        self.lr_scaling = lr_scaling
        self.batchnorm = batchnorm
        self.log_every_n_steps = log_every_n_steps
        self._every_n = log_every_n_steps or 50
        self._optimizer: Optimizer | None = None
        self._micro = 0  # micro-batches seen in the current window
        self._size = 0  # micro-batches in the current window (the factor, or fewer at the end of an epoch)
        self._factor = self._factors[0]
        self._known_applied = 0  # a lower bound of the applied count, exact after each host read
        self._opened = False
        self._owns_lr = False
        self._base_lrs: list[float] = []
        self._lr_factor: int | None = None
        self._stash: list[tuple[Tensor, Tensor]] = []
        self._gain = 1.0
        self._adascale: Any = None
        self._adascale_size = 0
        self._adascale_state: dict[str, list[float]] | None = None
        self._hooks: list[Any] = []
        self._saved_lrs: list[Any] = []

    @property
    def state_key(self) -> str:
        return self._generate_state_key(steps=repr(self.steps), lr_scaling=self.lr_scaling)

    # ------------------------------------------------------------------ pure schedule
    @property
    def is_constant(self) -> bool:
        return len(set(self._factors)) == 1

    def factor_at(self, applied_steps: int) -> int:
        """Micro-batches per optimizer step after ``applied_steps`` applied updates."""
        return self._factors[bisect.bisect_right(self._keys, applied_steps) - 1]

    def lr_scale_at(self, applied_steps: int) -> float:
        """The LR factor of the update after ``applied_steps`` updates (1 for ``"none"``/``"adascale"``)."""
        k = self.factor_at(applied_steps)
        if self.lr_scaling == "linear":
            return float(k)
        if self.lr_scaling == "sqrt":
            return math.sqrt(k)
        return 1.0

    def estimated_optimizer_steps(self, trainer: pl.Trainer) -> int | None:
        """Optimizer steps of the whole run for a changing factor (``None``: use the Trainer's estimate).

        Assumes no skipped updates; a skip delays every later switch by one step.
        """
        if self.is_constant:
            return None
        batches = trainer.num_training_batches
        if not math.isfinite(batches):
            return None
        per_epoch, max_steps, max_epochs = int(batches), trainer.max_steps, trainer.max_epochs
        if per_epoch == 0:
            return 0
        n, epoch = 0, 0
        while (max_epochs is None or max_epochs < 0 or epoch < max_epochs) and (max_steps < 0 or n < max_steps):
            if n >= self._keys[-1]:  # past the last switch every epoch has the same number of steps
                per = math.ceil(per_epoch / self._factors[-1])
                epochs_left = math.inf if max_epochs is None or max_epochs < 0 else max_epochs - epoch
                total = min(n + per * epochs_left, max_steps if max_steps >= 0 else math.inf)
                return int(total) if math.isfinite(total) else None  # None: an endless run
            done = 0
            while done < per_epoch:
                k = self.factor_at(n)
                i = bisect.bisect_right(self._keys, n)
                until_switch = self._keys[i] - n if i < len(self._keys) else math.inf
                full = min((per_epoch - done) // k, until_switch)
                if full == 0:  # the shorter last window of the epoch
                    done, n = per_epoch, n + 1
                else:
                    done, n = done + int(full) * k, n + int(full)
            epoch += 1
        return min(n, max_steps) if max_steps >= 0 else n

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        me = f"GradientAccumulation(steps={self.steps!r})"
        if trainer.accumulate_grad_batches != 1:
            raise StabilityConfigError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) and {me} would both "
                "accumulate gradients. Fix: remove `accumulate_grad_batches` from the Trainer and give the "
                f"factor to GradientAccumulation(steps={trainer.accumulate_grad_batches})."
            )
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in callbacks):
            raise StabilityConfigError(
                f"Lightning's GradientAccumulationScheduler and {me} would both set the accumulation factor. "
                "Fix: remove GradientAccumulationScheduler; GradientAccumulation(steps={update: factor}) "
                "switches at any optimizer step, epoch boundaries included."
            )
        if sum(isinstance(cb, GradientAccumulation) for cb in callbacks) > 1:
            raise StabilityConfigError("Several GradientAccumulation callbacks are attached. Fix: keep exactly one.")
        if not pl_module.automatic_optimization:
            raise StabilityConfigError(
                f"{me} drives Lightning's automatic optimization, but the module sets "
                "`automatic_optimization = False`. Fix: accumulate in your own training_step, or remove "
                "the callback."
            )
        if trainer.strategy.handles_gradient_accumulation:
            raise StabilityConfigError(
                f"strategy={type(trainer.strategy).__name__} accumulates gradients itself. Fix: configure "
                "accumulation in the strategy (e.g. DeepSpeed's gradient_accumulation_steps) and remove "
                f"{me}."
            )
        if not callable(getattr(trainer.fit_loop.epoch_loop, "_accumulated_batches_reached", None)):
            raise StabilityConfigError(
                f"This Lightning version ({pl.__version__}) has no `_accumulated_batches_reached` in its "
                "training epoch loop, which GradientAccumulation drives. Fix: use lightning>=2.1,<2.7."
            )
        self._every_n = self.log_every_n_steps or trainer.log_every_n_steps or 1  # type: ignore[attr-defined]
        self._base_lrs, self._adascale_state = [], None
        if max(self._factors) > 1:
            self._handle_batchnorm(trainer, pl_module)
        trainer.accumulate_grad_batches = self._factors[0] if self.is_constant else 1

    def _handle_batchnorm(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        names = _batchnorm_modules(pl_module)
        if not names or self.batchnorm == "ignore":
            return
        if self.batchnorm == "warn":
            rank_zero_warn(
                f"BatchNorm layers {names[:5]}{' ...' if len(names) > 5 else ''} under gradient accumulation "
                f"(up to {max(self._factors)} micro-batches per step): their batch statistics and running "
                "averages see one micro-batch at a time, not the accumulated batch, so they are noisier than "
                "the effective batch size suggests. Pass GradientAccumulation(batchnorm='group_norm') to use "
                "GroupNorm (batch-independent), 'sync_batchnorm' under DDP, or 'ignore' to silence this.",
                category=UserWarning,
            )
        elif self.batchnorm == "group_norm":
            _convert_to_group_norm(pl_module)
        else:
            if trainer.world_size < 2:
                raise config_error(
                    "batchnorm",
                    "sync_batchnorm",
                    f"needs DDP with several processes (world_size={trainer.world_size})",
                    "use batchnorm='group_norm', or run with devices >= 2",
                )
            device = trainer.strategy.root_device.type
            if device not in ("cuda", "hpu", "xpu", torch._C._get_privateuse1_backend_name()):
                # torch's SyncBatchNorm raises in its first forward on any other device
                raise config_error(
                    "batchnorm",
                    "sync_batchnorm",
                    f"needs GPUs, but this run trains on {device!r} (torch's SyncBatchNorm runs on GPUs only)",
                    "use batchnorm='group_norm'",
                )
            for name, child in list(pl_module.named_children()):
                setattr(pl_module, name, nn.SyncBatchNorm.convert_sync_batchnorm(child))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_stability.callbacks.lr_schedule import ScheduledLR

        # `configure_optimizers` has run by now (strategy setup), so its schedulers are known.
        has_schedule = any(isinstance(cb, ScheduledLR) for cb in trainer.callbacks)  # type: ignore[attr-defined]
        scales = self.lr_scaling in ("linear", "sqrt") and max(self._factors) > 1
        if scales and trainer.lr_scheduler_configs and not has_schedule:
            names = [type(config.scheduler).__name__ for config in trainer.lr_scheduler_configs]
            raise config_error(
                "lr_scaling",
                self.lr_scaling,
                f"writes the LR, and so do the LR scheduler(s) {names} from `configure_optimizers`: one would "
                "silently undo the other",
                "let ScheduledLR (or WarmupConstantCosineLR) schedule the LR, which folds the accumulation scaling "
                "in, or pass lr_scaling='none' and scale the LR yourself",
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_stability.callbacks.lr_schedule import ScheduledLR

        self._optimizer = trainer.optimizers[0]
        # Lightning decides "is this micro-batch the last of the step?" by `batches_this_epoch % factor`,
        # which is right only for a constant factor. The window count decides instead; everything that
        # depends on that decision (optimizer step, DDP no_sync, LR schedulers, logging) follows it.
        setattr(trainer.fit_loop.epoch_loop, "_accumulated_batches_reached", self._window_full)  # noqa: B010
        # HOST SYNC (once, before the first step) at most: the ledger may hold device-decided counts.
        self._known_applied = StepLedger.of(trainer).applied_steps_now()
        self._opened = False
        has_schedule = any(isinstance(cb, ScheduledLR) for cb in trainer.callbacks)  # type: ignore[attr-defined]
        self._owns_lr = self.lr_scaling in ("linear", "sqrt") and not has_schedule
        if self._owns_lr and not self._base_lrs:
            # HOST SYNC (once): a user-supplied tensor LR is read on the host here.
            self._base_lrs = [float(g["lr"]) for g in self._optimizer.param_groups]
        self._lr_factor = None
        if self.lr_scaling == "adascale":
            self._start_adascale()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning steps on the last batch of every epoch, so an epoch always starts a new window.
        self._micro = self._size = 0

    def _window_full(self) -> bool:
        return self._micro >= self._size

    # ------------------------------------------------------------------ the micro-batches
    def _next_factor(self, ledger: StepLedger) -> int:
        if self.is_constant:
            return self._factors[0]
        applied = ledger.applied_steps_host
        if applied is None:
            i = bisect.bisect_right(self._keys, self._known_applied)
            next_key = self._keys[i] if i < len(self._keys) else None
            # applied <= attempted: no switch can be due before the attempted count reaches the next key.
            if next_key is None or ledger.steps < next_key or not self._opened:
                return self.factor_at(self._known_applied)
            applied = int(ledger.applied_steps)  # HOST SYNC: only near a switch, on device-decided runs
        self._known_applied = applied
        return self.factor_at(applied)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._micro >= self._size:
            self._start_window(trainer, pl_module, batch_idx)
        self._micro += 1

    def _start_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int) -> None:
        k = self._next_factor(StepLedger.of(trainer))
        batches = trainer.num_training_batches
        size = k if not math.isfinite(batches) else max(1, min(k, int(batches) - batch_idx))
        self._factor, self._size, self._micro = k, size, 0
        # The closure divides each micro-batch's loss by this: the gradient is the mean over the window.
        trainer.accumulate_grad_batches = size
        assert self._optimizer is not None
        if batch_idx % size != 0:
            # Lightning zeroes gradients only where `batch_idx % factor == 0`; do it here as it would.
            pl_module.optimizer_zero_grad(trainer.current_epoch, batch_idx, self._optimizer)
        if self._owns_lr and k != self._lr_factor:
            scale = self._scale_of(k)
            for group, base in zip(self._optimizer.param_groups, self._base_lrs, strict=True):
                group["lr"] = base * scale
            self._lr_factor = k
        if self.lr_scaling == "adascale":
            self._configure_adascale(trainer, size)

    def _scale_of(self, k: int) -> float:
        return float(k) if self.lr_scaling == "linear" else math.sqrt(k) if self.lr_scaling == "sqrt" else 1.0

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        if self._micro > 1:
            # Lightning is about to zero in the middle of a window (its `batch_idx % factor` rule); keep the
            # accumulated gradients aside (no copy) and put them back before this micro-batch's backward.
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._stash.append((p, p.grad))
                        p.grad = None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._restore_stash()

    def _restore_stash(self) -> None:
        for p, grad in self._stash:
            p.grad = grad
        self._stash = []

    # ------------------------------------------------------------------ the step
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        ledger = StepLedger.of(trainer)
        ledger.open_step(optimizer)
        self._opened = True
        if self.lr_scaling == "adascale":
            self._gain = self._read_gain()
        if ledger.is_logging_step(self._every_n):
            ledger.log("stability/accumulation_steps", float(self._size))
            scale = self._gain if self.lr_scaling == "adascale" else self._scale_of(self._factor)
            ledger.log("stability/lr_scale", scale)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._restore_stash()  # training_step returned None: no backward ran
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    # ------------------------------------------------------------------ AdaScale
    def _start_adascale(self) -> None:
        import numpy as np

        assert self._optimizer is not None
        if self._adascale_state is not None:
            _store(self._optimizer)["adascale"] = {
                k: np.asarray(v, dtype=np.float64) for k, v in self._adascale_state.items()
            }
        self._adascale, self._adascale_size, self._gain = None, 0, 1.0
        self._hooks = [
            self._optimizer.register_step_pre_hook(self._apply_gain),
            self._optimizer.register_step_post_hook(self._remove_gain),
        ]

    def _configure_adascale(self, trainer: pl.Trainer, size: int) -> None:
        from fairscale.optim import AdaScale

        if self._adascale_size == size:
            return
        assert self._optimizer is not None
        state = _store(self._optimizer).get("adascale")
        saved = {k: v.copy() for k, v in state.items()} if state else None
        if self._adascale is not None:
            self._adascale.unhook()
        self._adascale, self._adascale_size = None, size
        if trainer.world_size * size < 2:
            return  # one gradient per step: nothing to estimate, and the gain is 1 by definition
        # scale=size: the gain is relative to one micro-batch per rank, the batch the base LR was tuned for.
        self._adascale = AdaScale(
            self._optimizer,
            world_size=trainer.world_size,
            scale=float(size),
            num_gradients_to_accumulate=size,
        )
        if saved is not None:
            # AdaScale's constructor rescales the stored variance estimate for a fresh start; keep ours.
            _store(self._optimizer)["adascale"] = saved

    def _read_gain(self) -> float:
        if self._adascale is None:
            return 1.0
        gain = float(self._adascale.gain())
        if not math.isfinite(gain):
            warnings.warn(
                "AdaScale's gain is not finite (non-finite gradients); using 1.", RuntimeWarning, stacklevel=2
            )
            return 1.0
        return gain

    def _apply_gain(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        # Runs inside optimizer.step(), after every on_before_optimizer_step hook set this update's LR.
        self._saved_lrs = [g["lr"] for g in optimizer.param_groups]
        if self._gain != 1.0:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * self._gain

    def _remove_gain(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        for group, lr in zip(optimizer.param_groups, self._saved_lrs, strict=False):
            group["lr"] = lr
        self._saved_lrs = []

    # ------------------------------------------------------------------ teardown and checkpointing
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        loop = trainer.fit_loop.epoch_loop
        if "_accumulated_batches_reached" in vars(loop):
            delattr(loop, "_accumulated_batches_reached")
        trainer.accumulate_grad_batches = 1
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._adascale is not None:
            self._adascale.unhook()
            self._adascale, self._adascale_size = None, 0
        self._restore_stash()

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        # AdaScale keeps numpy arrays in the optimizer state, which `torch.load(weights_only=True)` refuses;
        # they travel as lists in this callback's state instead.
        for opt_state in checkpoint.get("optimizer_states", []):
            opt_state.get("state", {}).pop("adascale", None)

    def state_dict(self) -> dict[str, Any]:
        adascale = None
        if self._optimizer is not None and "adascale" in _store(self._optimizer):
            adascale = {k: [float(x) for x in v] for k, v in _store(self._optimizer)["adascale"].items()}
        return {
            "micro": self._micro,
            "size": self._size,
            "factor": self._factor,
            "base_lrs": list(self._base_lrs),
            "adascale": adascale,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._micro = int(state_dict.get("micro", 0))
        self._size = int(state_dict.get("size", 0))
        self._factor = int(state_dict.get("factor", self._factors[0]))
        self._base_lrs = [float(x) for x in state_dict.get("base_lrs", [])]
        self._adascale_state = state_dict.get("adascale")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_optimizer=None, _stash=[], _adascale=None, _hooks=[], _saved_lrs=[])
        return state
