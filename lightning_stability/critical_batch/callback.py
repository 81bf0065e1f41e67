"""CriticalBatchMonitor: the gradient noise scale from a step's own gradients; BatchRamp: the batch that follows it.

The math is in ``noise_scale.py`` (the estimator) and ``ramp.py`` (the rules); this module wires them to a Trainer.
What a step already has gives the two batch sizes the estimator needs: the first micro-batch's gradient of a window,
read right after its backward (``on_after_backward``: under DDP that backward did not synchronise, so it is the
rank's own), and the step's whole gradient (all-reduced under DDP) as the step opens. Both norms stay on the device;
every rank averages the first norms of all ranks (one 0-dim all-reduce under DDP), so every rank holds the same
averages and decides alike. The figures reach the host on logging steps only, with the ledger's one transfer.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability import incidents, norms, ranks
from lightning_stability.accumulation.callback import GradientAccumulation
from lightning_stability.accumulation.schedule import lr_scale
from lightning_stability.critical_batch.noise_scale import critical_batch, ema_update, new_state, two_batch_estimates
from lightning_stability.critical_batch.ramp import beta2_at, grown_factor
from lightning_stability.errors import StabilityConfigError, check_bool, check_int, check_number, config_error
from lightning_stability.ledger.callback import LedgerCallback
from lightning_stability.ledger.metrics import OnHost
from lightning_stability.ledger.step_ledger import StepLedger
from lightning_stability.ledger.track import Outcome

__all__ = ["BatchRamp", "CriticalBatchMonitor"]


class CriticalBatchMonitor(LedgerCallback):
    """Measure the critical batch (McCandlish et al. 2018's ``B_simple``, the gradient noise scale) at no extra pass.

    Each optimizer step of two or more micro-batches (:class:`~lightning_stability.GradientAccumulation`) gives two
    gradients of the same weights: the first micro-batch's (``b`` samples; under DDP each rank's own, averaged over
    the ranks' squared norms) and the step's (``b x micro-batches x ranks``). From their squared norms, the two-batch
    estimator gives ``|G|^2`` and ``tr(Sigma)``; each is averaged by an EMA over the applied steps, and the ratio of
    the averages is the critical batch, in samples. A step of one micro-batch measures nothing (under DDP too: the
    local gradient is not visible once DDP has all-reduced it in the backward). Concepts and limits:
    ``docs/concepts/critical-batch.md``.

    Logged keys (on logging steps, from the first measured step on):

    =====================================  =============================================================
    Key                                    Meaning
    =====================================  =============================================================
    ``stability/critical_batch``           ``B_simple = tr(Sigma) / |G|^2`` in samples (inf: the averaged
                                           ``|G|^2`` is not positive, noise hides the gradient)
    ``stability/critical_batch_stderr``    its standard error (delta method over the averaged steps,
                                           treated as independent: a lower bound)
    =====================================  =============================================================

    Args:
        micro_batch_size: samples in one micro-batch on one rank; default: the training loader's ``batch_size``.
            For a language model, a sample is a sequence: multiply by its length for tokens.
        ema_decay: the decay of the averages of ``|G|^2`` and ``tr(Sigma)`` (0.95: about 20 steps).
        log_every_n_steps: log every this many optimizer steps; default: the Trainer's.

    Raises:
        StabilityConfigError: for a bad argument; at ``setup`` without a ``GradientAccumulation`` among the callbacks,
            or under a strategy other than a single device or DDP (sharded gradients are not the first
            micro-batch's); at train start when the loader has no ``batch_size`` and none is given.

    Example::

        trainer = L.Trainer(callbacks=[GradientAccumulation(steps=4), CriticalBatchMonitor()])
    """

    one_instance_reason = "each would measure the same figure from the same gradients"

    def __init__(
        self,
        micro_batch_size: int | None = None,
        ema_decay: float = 0.95,
        log_every_n_steps: int | None = None,
    ) -> None:
        super().__init__(log_every_n_steps)
        if micro_batch_size is not None:
            check_int("micro_batch_size", micro_batch_size, 1, "8 (samples per micro-batch on one rank)")
        self.micro_batch_size = micro_batch_size
        self.ema_decay = check_number("ema_decay", ema_decay, 0.0, 1.0, "0.95")
        self.critical_batch = math.nan  #: the last figure read on the host (a logging step), in samples
        self.critical_batch_stderr = math.nan  #: its standard error
        self._accumulation: GradientAccumulation | None = None
        self._samples = 0  # samples of one micro-batch on one rank
        self._ranks = 1
        self._state: Tensor | None = None  # the averages (noise_scale.FIELDS), alike on every rank
        self._saved_state: list[float] | None = None  # from a checkpoint, put on the device at train start
        self._measured = 0  # steps whose two norms were measured
        self._small: Tensor | None = None  # this window's first micro-batch's squared norm (this rank's)
        self._estimate: tuple[Tensor, Tensor] | None = None  # this step's (|G|^2, tr(Sigma))
        self._sent: tuple[OnHost, OnHost] | None = None

    def state_fields(self) -> dict[str, Any]:
        return {"ema_decay": self.ema_decay}

    # ------------------------------------------------------------------ setup
    def on_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

        name = type(self).__name__
        found = [cb for cb in trainer.callbacks if isinstance(cb, GradientAccumulation)]  # type: ignore[attr-defined]
        if not found:
            raise StabilityConfigError(
                f"{name} measures the gradient noise scale from the micro-batches of an accumulated step, but no "
                "GradientAccumulation is among the Trainer's callbacks. Fix: add GradientAccumulation(steps=2) or "
                "more (a step of one micro-batch measures nothing)."
            )
        if not isinstance(trainer.strategy, SingleDeviceStrategy | DDPStrategy):
            raise StabilityConfigError(
                f"{name} runs on one device or under DDP, but strategy={type(trainer.strategy).__name__}: a sharded "
                "strategy's gradients after the first micro-batch are not that micro-batch's. Fix: measure the "
                "critical batch on a DDP run, or remove the callback."
            )
        self._accumulation = found[0]
        self._state, self._saved_state, self._measured = None, None, 0
        self.critical_batch = self.critical_batch_stderr = math.nan

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        size = self.micro_batch_size
        if size is None:
            loader = trainer.train_dataloader
            size = getattr(loader, "batch_size", None) or getattr(
                getattr(loader, "batch_sampler", None), "batch_size", None
            )
        if not isinstance(size, int) or size < 1:
            raise config_error(
                "micro_batch_size",
                self.micro_batch_size,
                "is needed: the training loader has no batch_size to count the samples of a micro-batch",
                f"pass {type(self).__name__}(micro_batch_size=<samples per micro-batch on one rank>)",
            )
        self._samples, self._ranks = size, trainer.world_size
        device = pl_module.device
        if self._saved_state is not None:
            self._state = torch.tensor(self._saved_state, dtype=torch.float32, device=device)  # once, at start
            self._saved_state = None
        elif self._state is None:
            self._state = new_state(device)
        self._small = self._estimate = None

    # ------------------------------------------------------------------ the two norms
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        accumulation = self._accumulation
        if accumulation is None or accumulation.micro_batch != 1 or accumulation.window_size < 2:
            return
        grads = [p.grad for g in trainer.optimizers[0].param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return
        # the gradient of the window's first micro-batch, times the fp16 scale over the window's size
        factor = StepLedger.of(trainer).backward_factor()
        self._small = norms.total_norm(grads) ** 2 / (factor * factor)

    def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: Optimizer) -> None:
        small_sq, self._small, self._estimate = self._small, None, None
        accumulation = self._accumulation
        if small_sq is None or accumulation is None:
            return
        small_sq = ranks.mean(small_sq)  # every rank's first micro-batch: one 0-dim all-reduce under DDP
        big_sq = ledger.gradients().total ** 2  # the step's whole gradient, before any clip
        small = self._samples
        self._estimate = two_batch_estimates(small_sq, big_sq, small, small * accumulation.window_size * self._ranks)
        self._measured += 1

    def after_step(self, trainer: pl.Trainer, ledger: StepLedger) -> None:
        """Row 13: this step's estimates into the averages (applied steps only, decided on the device), then the
        figures recorded on logging steps."""
        self._average(ledger)
        self._record()

    def _average(self, ledger: StepLedger) -> None:
        if self._estimate is not None and self._state is not None:
            g2, trace = self._estimate
            self._state = ema_update(self._state, g2, trace, self.ema_decay, ledger.outcome == Outcome.APPLIED)
        self._estimate = None

    def _record(self) -> None:
        if not (self.is_logging_step and self._measured and self._state is not None):
            return
        value, stderr = critical_batch(self._state)
        self._sent = (
            self.record_metric("stability/critical_batch", value),
            self.record_metric("stability/critical_batch_stderr", stderr),
        )

    def on_host(self, trainer: pl.Trainer, record: Any) -> dict[str, float] | None:
        if self._sent is not None:
            self.critical_batch, self.critical_batch_stderr = (h.number() for h in self._sent)
            self._sent = None
            self._read()
        return None

    def _read(self) -> None:
        """A new figure is on the host (a logging step, after its transfer)."""

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        state = self._state.tolist() if self._state is not None else self._saved_state  # HOST SYNC: checkpoints only
        return {
            "state": state,
            "measured": self._measured,
            "critical_batch": self.critical_batch,
            "critical_batch_stderr": self.critical_batch_stderr,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("state")
        self._saved_state = [float(x) for x in saved] if saved is not None else None
        self._state = None
        self._measured = int(state_dict.get("measured", 0))
        self.critical_batch = float(state_dict.get("critical_batch", math.nan))
        self.critical_batch_stderr = float(state_dict.get("critical_batch_stderr", math.nan))

    def transient_state(self) -> dict[str, Any]:
        return {"_accumulation": None, "_small": None, "_estimate": None, "_sent": None}


class BatchRamp(CriticalBatchMonitor):
    """Grow the global batch while the measured critical batch is well above it: ``GradientAccumulation``'s
    factor, times ``growth`` at a decision, up to ``max_factor``, never less.

    It measures as :class:`CriticalBatchMonitor` does (the same keys). On each logging step the figure reaches the
    host; at row 13 of the next step (``Stage.AFTER_STEP``, before ``GradientAccumulation`` and ``ScheduledLR``
    there) it decides: if ``warmup_steps`` steps were measured and the global batch after the change (``factor x
    growth x micro-batch size x ranks``) is at most ``fraction`` of the critical batch's lower bound (the figure
    less ``confidence`` standard errors), the factor grows from the next update on. By McCandlish et al.'s model a
    batch ``B`` needs ``1 + B / B_crit`` times the samples of a tiny one to reach a loss: a batch at the figure
    itself needs twice as many, which at equal samples is a worse loss; hence the share and the bound. At the
    change:

    * the LR follows ``GradientAccumulation``'s ``lr_scaling`` (``"sqrt"``: ``x sqrt(k'/k)``, the square-root rule
      for Adam; ``"linear"``: ``x k'/k``), written by ``ScheduledLR`` or by ``GradientAccumulation``;
    * Adam's beta2 keeps its half-life in samples: ``beta2' = beta2_0 ** (k'/k_0)``, ``beta2_0`` the configured one
      at the starting factor ``k_0`` (``beta2_half_life=True``);
    * an LR schedule counts samples from then on (in updates of the starting batch), so it ends where it would
      without the ramp (``GradientAccumulation.schedule_position``);
    * an incident of kind ``batch_ramp`` goes into the incident log (and so the stability report) and an event into
      the ledger.

    Each decision is taken from the same host number on every rank; only a change on a run whose skips are decided
    on the device reads the applied count (one host read per change). A checkpoint holds the factors, the averages
    and the base beta2: a resumed run continues at the same batch, LR and beta2. How-to:
    ``docs/how-to/ramp-the-batch.md``.

    Args:
        max_factor: the largest accumulation factor (micro-batches per step and rank).
        growth: the factor is multiplied by this at each change (an int >= 2, so the schedule's sample count stays
            a whole number of starting batches).
        warmup_steps: measured steps before the first decision (the averages need about ``1 / (1 - ema_decay)``).
        fraction: the largest share of the critical batch's lower bound the global batch may grow to (0.5: at
            most 1.5 times the samples of a tiny batch to reach a loss, by McCandlish et al.'s model).
        confidence: standard errors taken off the figure for its lower bound (1.0). The error is a lower bound
            of the real one (``critical_batch_stderr``); 0 decides on the figure alone, which early in a run is
            mostly noise.
        beta2_half_life: keep Adam's beta2 at a fixed half-life in samples; ``False`` leaves ``betas`` alone.
        micro_batch_size, ema_decay, log_every_n_steps: as :class:`CriticalBatchMonitor`; decisions are taken
            every ``log_every_n_steps`` steps.

    Raises:
        StabilityConfigError: for a bad argument; at ``setup`` as :class:`CriticalBatchMonitor`, and when
            ``GradientAccumulation`` has a schedule (``steps`` must be one int), starts at one micro-batch, has
            ``lr_scaling`` other than ``"sqrt"``/``"linear"``, or starts above ``max_factor``; at fit start when
            ``beta2_half_life`` meets an optimizer without ``betas`` (SGD).

    Example::

        callbacks = [GradientAccumulation(steps=2, lr_scaling="sqrt"), BatchRamp(max_factor=32)]
    """

    def __init__(
        self,
        max_factor: int,
        growth: int = 2,
        warmup_steps: int = 20,
        fraction: float = 0.5,
        confidence: float = 1.0,
        beta2_half_life: bool = True,
        micro_batch_size: int | None = None,
        ema_decay: float = 0.95,
        log_every_n_steps: int | None = None,
    ) -> None:
        super().__init__(micro_batch_size, ema_decay, log_every_n_steps)
        self.max_factor = check_int("max_factor", max_factor, 2, "32 (micro-batches per step and rank)")
        self.growth = check_int("growth", growth, 2, "2 (the batch doubles at each change)")
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0, "20")
        self.fraction = check_number("fraction", fraction, 0.0, math.inf, "0.5 (the batch at most half the figure)")
        self.confidence = check_number(
            "confidence", confidence, 0.0, math.inf, "1.0 (one standard error off)", low_inclusive=True
        )
        self.beta2_half_life = check_bool("beta2_half_life", beta2_half_life)
        self._base_factor = 1
        self._base_beta2: list[float] = []  # each param group's configured beta2, at the starting factor
        self._decide = False  # a figure was read on the host: the next row 13 decides

    def state_fields(self) -> dict[str, Any]:
        return {**super().state_fields(), "max_factor": self.max_factor}

    def on_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_setup(trainer, pl_module)
        accumulation = self._accumulation
        assert accumulation is not None
        if not accumulation.is_constant:
            raise config_error(
                "GradientAccumulation(steps)",
                accumulation.steps,
                "is a schedule; BatchRamp grows one starting factor by its measurements",
                "pass GradientAccumulation(steps=<the starting factor>, e.g. 2) and let BatchRamp grow it",
            )
        start = accumulation.factor_at(0)
        if start < 2:
            raise config_error(
                "GradientAccumulation(steps)",
                accumulation.steps,
                "gives one micro-batch per step: there is no smaller batch to measure the noise against",
                "start the ramp at 2 micro-batches or more: GradientAccumulation(steps=2)",
            )
        if accumulation.lr_scaling not in ("sqrt", "linear"):
            raise config_error(
                "GradientAccumulation(lr_scaling)",
                accumulation.lr_scaling,
                "is not a rule the LR can follow when BatchRamp grows the batch",
                "pass lr_scaling='sqrt' (Adam: the square-root rule) or 'linear' (SGD)",
            )
        if start > self.max_factor:
            raise config_error(
                "max_factor",
                self.max_factor,
                f"is below GradientAccumulation's starting factor {start}",
                f"pass max_factor >= {start}",
            )
        self._base_factor = start
        self._base_beta2, self._decide = [], False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.beta2_half_life:
            return
        for optimizer in trainer.optimizers:
            if any("betas" not in group for group in optimizer.param_groups):
                raise config_error(
                    "beta2_half_life",
                    True,
                    f"keeps Adam's beta2 at a fixed half-life in samples, but {type(optimizer).__name__} has no "
                    "`betas` in its param groups",
                    "pass BatchRamp(beta2_half_life=False): its hyperparameters then stay as configured as the "
                    "batch grows, and only the LR follows lr_scaling",
                )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_stability.schedules.callback import ScheduledLR

        super().on_train_start(trainer, pl_module)
        schedules = [cb for cb in trainer.callbacks if isinstance(cb, ScheduledLR)]  # type: ignore[attr-defined]
        if trainer.max_steps > 0 and any(cb.total_steps is None for cb in schedules):
            rank_zero_warn(
                f"BatchRamp with Trainer(max_steps={trainer.max_steps}): once the batch grows the LR schedule counts "
                f"samples, in updates of the starting batch, over the run's {trainer.max_steps} steps; the run's "
                f"{trainer.max_steps} steps then train more samples than that, and the LR stays at the schedule's "
                "final value from there. Fix: bound the run by max_epochs (samples), or pass the schedule "
                "total_steps= counted in updates of the starting batch.",
                category=UserWarning,
            )
        if self.beta2_half_life and not self._base_beta2:
            # HOST SYNC (once) at most: a tensor beta2 is read on the host here.
            self._base_beta2 = [float(g["betas"][1]) for g in trainer.optimizers[0].param_groups]

    def after_step(self, trainer: pl.Trainer, ledger: StepLedger) -> None:
        """Row 13: the step's estimates averaged; the decision on the figure the last logging step read (the
        factor, and beta2, of the next update); the figures recorded on logging steps."""
        self._average(ledger)
        if self._decide:
            self._decide = False
            if self._measured >= self.warmup_steps:
                self._maybe_grow(trainer, ledger)
        self._record()

    def _read(self) -> None:
        self._decide = True

    def _maybe_grow(self, trainer: pl.Trainer, ledger: StepLedger) -> None:
        accumulation = self._accumulation
        assert accumulation is not None
        factor = accumulation.factor
        global_micro = self._samples * self._ranks
        new = grown_factor(
            factor,
            self.critical_batch,
            global_micro,
            self.max_factor,
            self.growth,
            stderr=self.critical_batch_stderr,
            fraction=self.fraction,
            confidence=self.confidence,
        )
        if new == factor:
            return
        applied = int(ledger.record_of().applied_steps)  # HOST SYNC only where skips are decided on the device
        accumulation.grow(applied, new)
        beta2 = self._set_beta2(trainer.optimizers[0], factor, new)
        scaling = accumulation.lr_scaling
        ratio = lr_scale(new, scaling) / lr_scale(factor, scaling)
        action = (
            f"global batch {factor * global_micro} -> {new * global_micro} samples (accumulation {factor} -> {new})"
        )
        detail = (
            f"critical batch {self.critical_batch:.4g} (stderr {self.critical_batch_stderr:.2g}) samples; "
            f"LR x{ratio:.4g} (lr_scaling={scaling!r})" + (f"; beta2 {beta2[0]:.6g} -> {beta2[1]:.6g}" if beta2 else "")
        )
        incidents.record(trainer, "batch_ramp", action, detail=detail)
        ledger.note({"step": trainer.global_step, "kind": "batch_ramp", "detail": f"{action}; {detail}"})
        rank_zero_info(f"BatchRamp: {action}; {detail}.")

    def _set_beta2(self, optimizer: Optimizer, factor: int, new: int) -> tuple[float, float] | None:
        """Write each group's beta2 for ``new`` micro-batches; returns the first group's (before, after)."""
        if not self.beta2_half_life or not self._base_beta2:
            return None
        before = beta2_at(self._base_beta2[0], factor, self._base_factor)
        for group, base in zip(optimizer.param_groups, self._base_beta2, strict=True):
            group["betas"] = (group["betas"][0], beta2_at(base, new, self._base_factor))
        return before, beta2_at(self._base_beta2[0], new, self._base_factor)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "base_beta2": list(self._base_beta2), "decide": self._decide}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._base_beta2 = [float(x) for x in state_dict.get("base_beta2", [])]
        self._decide = bool(state_dict.get("decide", False))
