"""PrecursorMonitor: what comes before a loss spike, logged as ``stability/...`` metrics, and opt-in early actions.

Precursors (each on logging steps, in the step's one device-to-host transfer; nothing is computed on other steps
unless an action needs it, and nothing is read on the host there):

* ``stability/attention_logit_max`` and ``.../<module>``: the largest pre-softmax attention logit of the step, over
  all heads, and per attention module (:class:`~lightning_stability.precursors.attention.AttentionLogits`);
* ``stability/log_z`` and ``stability/log_z_drift``: the LM head's mean log-sum-exp and its drift from an EMA of
  the measured values (:class:`~lightning_stability.precursors.logits.LogPartition`);
* ``stability/adam_update_rms_max``: the largest RMS of a tensor's Adam step, and ``stability/adam_eps_share``: the
  share of coordinates (over every tensor) where Adam's epsilon dominates the denominator
  (:func:`~lightning_stability.precursors.adam.adam_updates`);
* ``stability/adam_update_ratio`` and ``.../<layer>``: the applied Adam step's norm over the weights' norm, in
  total and per layer (:mod:`~lightning_stability.precursors.update_ratio`; decoupled weight decay left out).

Early actions (off by default; each runs on every step, on the device, without a host sync):

* ``qk_clip=100.0``: Kimi K2's QK-clip after each optimizer step (:func:`~.actions.apply_qk_clip_`, ``alpha`` 0.5):
  each head whose largest logit of the step passed ``tau`` has its query and key projections scaled so that it
  falls back to ``tau``. The logits are max-reduced over ranks first, so every rank scales alike.
* ``update_clip=1.0``: StableAdamW's per-tensor update clipping (:func:`~.actions.update_clip_coefficients`,
  ``d = 1``) on top of the model's own Adam/AdamW.
* ``lr_backoff=LRBackoff(...)``: while a precursor stays past its threshold, the Adam part of each applied update is
  scaled down by ``factor`` per applied update (to ``floor`` at least); once it is back under, it recovers by
  ``recovery`` per applied update, up to 1. Skipped updates leave it as it is (the applied-update clock). It
  scales the update, not the param groups' ``lr`` (so an LR schedule goes on as it is).
* ``reset_moments=True``: when ``TrainingHealthMonitor`` calls the step a spike and its update was applied anyway
  (``response="warn"`` or ``"clip"``, or under ``"skip"`` with ``skip_on="loss"`` a gradient-norm spike alone), the
  Adam moments of the tensors whose gradient RMS was more than ``reset_ratio`` times the RMS Adam expected
  (``sqrt(v_hat)``) are zeroed, the step counts left alone (SPAM; :func:`~.actions.reset_moments_`). A skipped
  spike's gradient never reaches the moments.

The update clipping and the back-off scale the update torch just applied, copy-free, from the optimizer's state
(:func:`~.actions.rescale_adam_updates_`): Adam and AdamW without ``amsgrad``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import Shard
from torch.optim import Optimizer

from lightning_stability import _compat
from lightning_stability.errors import StabilityConfigError, check_bool, check_number, config_error
from lightning_stability.ledger import LedgerCallback, OnHost, OptimizerRecord, StepLedger
from lightning_stability.ledger.track import Outcome
from lightning_stability.norms import is_dtensor, local_tensor, per_tensor_norms
from lightning_stability.precursors.actions import (
    QK_CLIP_ALPHA,
    QKProjection,
    apply_qk_clip_,
    qk_projection,
    rescale_updates_,
    update_clip_coefficients,
)
from lightning_stability.precursors.adam import AdamUpdates, adam_updates, is_adam_like
from lightning_stability.precursors.attention import AttentionLogits, attention_modules
from lightning_stability.precursors.logits import LogPartition, find_head
from lightning_stability.precursors.update_ratio import layer_groups, update_to_weight_ratios

Signal = Literal["update_ratio", "attention_logit", "log_z_drift", "update_rms_jump"]
SIGNALS: tuple[str, ...] = ("update_ratio", "attention_logit", "log_z_drift", "update_rms_jump")


@dataclass(frozen=True)
class LRBackoff:
    """The LR back-off of :class:`PrecursorMonitor`: which precursor, its threshold, how fast down and back up.

    Attributes:
        signal: ``"update_ratio"``: the applied Adam step's norm over the weights' norm, all tensors together;
            ``"attention_logit"``: the step's largest attention logit; ``"log_z_drift"``: ``|log Z - EMA|`` of the
            LM head; ``"update_rms_jump"``: the Adam step's norm over its EMA (Marin saw it double before spikes).
        threshold: past it, the update backs off (``update_ratio`` 0.02; for the others e.g. 100, 1.0, 2.0).
        factor: the multiplier per applied update while past the threshold (0.5).
        recovery: the multiplier per applied update once back under it, up to 1 (1.02: from 0.5 back to 1 in 35).
        floor: the smallest multiplier (0.01).
    """

    signal: Signal = "update_ratio"
    threshold: float = 0.02
    factor: float = 0.5
    recovery: float = 1.02
    floor: float = 0.01

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise config_error("signal", self.signal, "is not a precursor", f"pass one of {', '.join(SIGNALS)}")
        check_number("threshold", self.threshold, example="0.02")
        check_number("factor", self.factor, example="0.5")
        check_number("floor", self.floor, example="0.01")
        check_number("recovery", self.recovery, example="1.02")
        if not self.floor <= self.factor < 1:
            raise config_error("factor", self.factor, f"must be in [floor={self.floor}, 1)", "pass factor=0.5")
        if self.recovery <= 1:
            raise config_error("recovery", self.recovery, "must be > 1 (else it never recovers)", "pass recovery=1.02")
        if self.floor > 1:
            raise config_error("floor", self.floor, "must be <= 1", "pass floor=0.01")


class PrecursorMonitor(LedgerCallback):
    """Logs the precursors of a loss spike on logging steps and, opt-in, acts on them early (see the module doc).

    Args:
        attention: measure the largest attention logit (``None``: where the model has an attention module
            :class:`~.attention.AttentionLogits` knows; ``True``: required; ``False``: off).
        log_partition: the LM head's module name; ``None``: the first of ``lm_head``, ``head``, ``output``, ...
            found (none: not measured); ``False``: off.
        qk_clip: QK-clip's ``tau`` (Kimi K2: 100.0), or ``None``: off.
        qk_clip_alpha: the share of the clip on the queries (K2: 0.5).
        update_clip: StableAdamW's threshold ``d`` on each tensor's update RMS (1.0), or ``None``: off.
        lr_backoff: an :class:`LRBackoff`, or ``None``: off.
        reset_moments: zero the moments of the tensors a spike hit (see the module doc).
        reset_ratio: how far above Adam's expected RMS a tensor's gradient RMS must be to count as hit (10).
        other_optimizers: with an optimizer the Adam actions cannot act on (not Adam-like, or ``amsgrad``):
            ``"error"`` (at fit start), or ``"warn"``: they are off for that fit, the precursors still logged (what
            a preset uses, not knowing the model's optimizer).
        log_every_n_steps: default: the Trainer's.

    Raises:
        StabilityConfigError: for a bad argument; at setup, for an action the model or optimizer cannot take
            (QK-clip without a known attention module, the Adam actions with another optimizer).

    Example::

        trainer = L.Trainer(callbacks=[PrecursorMonitor(qk_clip=100.0, lr_backoff=LRBackoff())])
    """

    one_instance_reason = "each would act on the same updates and attention weights"

    def __init__(
        self,
        attention: bool | None = None,
        log_partition: str | bool | None = None,
        qk_clip: float | None = None,
        qk_clip_alpha: float = QK_CLIP_ALPHA,
        update_clip: float | None = None,
        lr_backoff: LRBackoff | None = None,
        reset_moments: bool = False,
        reset_ratio: float = 10.0,
        other_optimizers: Literal["error", "warn"] = "error",
        log_every_n_steps: int | None = None,
    ) -> None:
        super().__init__(log_every_n_steps)
        if attention is not None:
            check_bool("attention", attention)
        if log_partition is True:
            log_partition = None
        if log_partition is not None and log_partition is not False and not isinstance(log_partition, str):
            raise config_error(
                "log_partition", log_partition, "is not a module name", "pass e.g. 'lm_head', None or False"
            )
        if qk_clip is not None:
            check_number("qk_clip", qk_clip, example="100.0 (Kimi K2's tau)")
        if (
            isinstance(qk_clip_alpha, bool)
            or not isinstance(qk_clip_alpha, (int, float))
            or not 0 <= qk_clip_alpha <= 1
        ):
            raise config_error("qk_clip_alpha", qk_clip_alpha, "must be in [0, 1]", "pass 0.5 (Kimi K2's)")
        if update_clip is not None:
            check_number("update_clip", update_clip, example="1.0 (StableAdamW's)")
        if lr_backoff is not None and not isinstance(lr_backoff, LRBackoff):
            raise config_error("lr_backoff", lr_backoff, "is not an LRBackoff", "pass LRBackoff() or None")
        check_bool("reset_moments", reset_moments)
        check_number("reset_ratio", reset_ratio, example="10.0")
        if other_optimizers not in ("error", "warn"):
            raise config_error("other_optimizers", other_optimizers, "is not a choice", "pass 'error' or 'warn'")
        self.other_optimizers = other_optimizers
        self._adam_actions = False  # the Adam actions act in this fit (set at fit start)
        self.attention, self.log_partition = attention, log_partition
        self.qk_clip, self.qk_clip_alpha = qk_clip, float(qk_clip_alpha)
        self.update_clip, self.lr_backoff = update_clip, lr_backoff
        self.reset_moments, self.reset_ratio = reset_moments, float(reset_ratio)
        #: the back-off multiplier (a device tensor once training; a float in checkpoints)
        self.backoff: Tensor | float = 1.0
        #: heads QK-clip scaled, and tensors whose moments were reset, since the start
        self.clipped_heads: Tensor | float = 0.0
        self.moment_resets: Tensor | float = 0.0
        self._logits: AttentionLogits | None = None
        self._projections: dict[str, QKProjection] = {}
        self._log_z: LogPartition | None = None
        self._log_z_state: dict[str, Any] = {}
        self._rms_ema: Tensor | float | None = None
        self._layers: tuple[tuple[int, ...], Tensor, Tensor, list[str]] | None = None
        self._open: _OpenStep | None = None
        self._fresh = True  # the next batch starts an optimizer step
        self._told = False  # the back-off's warning was given in this fit
        self._backoff_sent: OnHost | None = None
        self._reads = False  # this step's figures are recorded: it logs, or Lightning reads callback_metrics after it
        self._root_numel: tuple[tuple[int, ...], Tensor] | None = None

    def state_fields(self) -> dict[str, Any]:
        return {
            "qk_clip": self.qk_clip,
            "update_clip": self.update_clip,
            "lr_backoff": None if self.lr_backoff is None else asdict(self.lr_backoff),
            "reset_moments": self.reset_moments,
        }

    # ------------------------------------------------------------------ setup
    def on_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        backoff = self.lr_backoff.signal if self.lr_backoff is not None else None
        needs_attention = self.qk_clip is not None or backoff == "attention_logit"
        if self.attention is False and needs_attention:
            raise config_error(
                "attention", False, "turns off what QK-clip or the attention back-off need", "leave attention=None"
            )
        known = dict(attention_modules(pl_module))
        if self.attention is not False and (known or self.attention or needs_attention):
            self._logits = AttentionLogits(pl_module)  # raises when none is known
        if self.qk_clip is not None:
            assert self._logits is not None
            for module in self._logits.modules.values():
                qk_projection(module)  # refuses a module it cannot rescale, before the strategy wraps anything
        if self.log_partition is not False:
            if self.log_partition is None and backoff != "log_z_drift":
                try:
                    find_head(pl_module)
                except StabilityConfigError:
                    self.log_partition = False  # no LM head by the usual names: not measured
            if self.log_partition is not False:
                self._log_z = LogPartition(pl_module, self.log_partition or None)
                if self._log_z_state:
                    self._log_z.load_state_dict(self._log_z_state)
        elif backoff == "log_z_drift":
            raise config_error("log_partition", False, "turns off the back-off's signal", "leave log_partition=None")
        self._set_active(False)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        split = _tensor_parallel(pl_module)
        if split is not None:
            self._under_tensor_parallel(split)
        if self.qk_clip is not None and self._logits is not None:
            # after the strategy's wrapping: FSDP2 replaces the parameters with sharded ones
            self._projections = {name: qk_projection(m) for name, m in self._logits.modules.items()}
        self._adam_actions = self.update_clip is not None or self.lr_backoff is not None or self.reset_moments
        if len(trainer.optimizers) > 1 and (self._adam_actions or self.qk_clip is not None):
            # one back-off factor and one QK-clip per step of the module: with several optimizers each would act
            # once per optimizer step (QK-clip twice on the same maxima), not once per update of the module
            raise StabilityConfigError(
                f"PrecursorMonitor's early actions (qk_clip, update_clip, lr_backoff, reset_moments) act once per "
                f"update of the whole module; this module has {len(trainer.optimizers)} optimizers. Fix: leave the "
                "actions off for this fit (PrecursorMonitor() still logs the precursors per optimizer; in a preset, "
                "lr_backoff=None removes it), or train with one optimizer."
            )
        for optimizer in trainer.optimizers if self._adam_actions else []:
            why = ""
            if not is_adam_like(optimizer):
                why = f"the optimizer is {type(optimizer).__name__}"
            elif any(g.get("amsgrad", False) for g in optimizer.param_groups):
                why = "the optimizer uses amsgrad=True (its denominator is a running max)"
            if why and self.other_optimizers == "warn":
                rank_zero_warn(f"PrecursorMonitor: the update clipping, LR back-off and moment reset are off: {why}.")
                self._adam_actions = False
            elif why:
                raise StabilityConfigError(
                    f"PrecursorMonitor's update clipping, LR back-off and moment reset act on Adam's state; {why}. "
                    "Fix: use torch.optim.Adam or AdamW (amsgrad=False), leave update_clip, lr_backoff and "
                    "reset_moments off, or pass other_optimizers='warn' to turn them off for such a fit."
                )
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self._names = names
        if len(trainer.optimizers) == 1:  # the per-layer index of every tensor, built here rather than in a step
            params = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
            if params:
                self._layer_index(params, local_tensor(params[0]).device)

    def _under_tensor_parallel(self, split: str) -> None:
        """Under tensor parallelism: the Adam figures and the back-off on them (the optimizer's state is sharded
        like any DTensor: its norms are reduced over the mesh) only. A rank's attention module holds some heads
        and its LM head some of the vocabulary, and some gradients are partial sums: what reads those is refused
        when asked for, and not measured otherwise."""
        signal = self.lr_backoff.signal if self.lr_backoff is not None else None
        asked = [
            name
            for name, on in (
                ("qk_clip", self.qk_clip is not None),
                ("update_clip", self.update_clip is not None),
                ("reset_moments", self.reset_moments),
                ("attention=True", self.attention is True),
                (f"log_partition={self.log_partition!r}", isinstance(self.log_partition, str)),
                (f"LRBackoff({signal!r})", signal in ("attention_logit", "log_z_drift")),
            )
            if on
        ]
        if asked:
            raise StabilityConfigError(
                f"PrecursorMonitor({', '.join(asked)}) cannot run under tensor parallelism ({split}): a rank holds "
                "some attention heads, some of the vocabulary and partial gradients, which these do not follow "
                "yet. Under tensor parallelism it logs the Adam figures and backs off on them: leave these off "
                "(LRBackoff('update_ratio') or 'update_rms_jump'), or run this fit without tensor parallelism."
            )
        if self._logits is not None or self._log_z is not None:
            rank_zero_info(
                "PrecursorMonitor: under tensor parallelism the attention logits and the LM head's log Z are not "
                "measured (a rank holds some heads and some of the vocabulary); the Adam figures are."
            )
        self._remove_hooks()
        self._log_z_state = {}

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_hooks()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        if self._logits is not None:
            self._logits.remove()
            self._logits = None
        if self._log_z is not None:
            self._log_z_state = self._log_z.state_dict()
            self._log_z.remove()
            self._log_z = None

    def _set_active(self, logging: bool) -> None:
        signal = self.lr_backoff.signal if self.lr_backoff is not None else None
        if self._logits is not None:
            self._logits.active = logging or self.qk_clip is not None or signal == "attention_logit"
        if self._log_z is not None:
            self._log_z.active = logging or signal == "log_z_drift"

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        # the first micro-batch of an optimizer step: forget the last step's maxima, measure if this step logs or
        # ends where Lightning reads callback_metrics
        read = _read_after(trainer, batch_idx)
        if self._fresh:
            self._fresh = False
            if self._logits is not None:
                self._logits.reset()
            self._reads = read or StepLedger.of(trainer).is_logging_step(self._every_n)
            self._set_active(self._reads)
        elif read and not self._reads:
            self._reads = True
            self._set_active(True)

    # ------------------------------------------------------------------ the step
    def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: Optimizer) -> None:
        """Before the update: the coefficients of the update clipping and back-off, and the tensors a spike hit."""
        open_step = self._open = _OpenStep(optimizer)
        open_step.lrs = [g["lr"] for g in optimizer.param_groups]  # the step's (a schedule moves them after it)
        # the tensors this step updates: Adam leaves one without a gradient alone (its state still holds a step)
        open_step.stepped = {id(p) for g in optimizer.param_groups for p in g["params"] if p.grad is not None}
        if not self._adam_actions:
            return
        grads = ledger.gradients()
        params = [p for p in grads.params if "exp_avg_sq" in optimizer.state.get(p, {})]
        if not params:
            return
        open_step.params = params
        device = grads.total.device
        if self.update_clip is not None:
            parts = []
            for group in optimizer.param_groups:
                mine = {id(p) for p in group["params"]}
                ps = [p for p in params if id(p) in mine]
                if ps:
                    states = [optimizer.state[p] for p in ps]
                    parts.append(
                        update_clip_coefficients(
                            [p.grad for p in ps if p.grad is not None],
                            [s["exp_avg_sq"] for s in states],
                            [s["step"] for s in states],
                            group["betas"][1],
                            group["eps"],
                            self.update_clip,
                        ).to(device)
                    )
            open_step.clip_coef = torch.cat(parts)
        if self.reset_moments:
            open_step.hit = self._hit_tensors(optimizer, params, device)
        _agree_across_ranks(open_step)  # what each rank derived from its own gradients and state
        if self.lr_backoff is not None:  # alike on every rank already: it moves on signals reduced over ranks
            backoff = self._backoff_tensor(device)  # one factor for every tensor (0-dim) when alone
            open_step.coef = backoff if open_step.clip_coef is None else open_step.clip_coef * backoff
        else:
            open_step.coef = open_step.clip_coef

    def _backoff_tensor(self, device: torch.device) -> Tensor:
        backoff = self.backoff
        if not isinstance(backoff, Tensor):
            backoff = torch.full((), backoff, dtype=torch.float32, device=device)  # once (a fill, no copy)
        elif backoff.device != device:
            backoff = backoff.to(device)
        self.backoff = backoff
        return backoff

    def _roots(self, params: list[Tensor], device: torch.device) -> Tensor:
        """``(n,)``: each tensor's ``sqrt(numel)`` (RMS <-> norm), built once per set of tensors."""
        key = tuple(map(id, params))
        if self._root_numel is None or self._root_numel[0] != key:
            roots = [torch.full((), math.sqrt(p.numel()), device=device) for p in params]  # fills, no copies
            self._root_numel = (key, torch.stack(roots))
        return self._root_numel[1]

    def _hit_tensors(self, optimizer: Optimizer, params: list[Tensor], device: torch.device) -> Tensor:
        """Per tensor: its gradient RMS is more than ``reset_ratio`` times ``sqrt(v_hat)``'s RMS (before the step)."""
        roots = self._roots(params, device)
        grad_rms = per_tensor_norms([p.grad for p in params]) / roots  # type: ignore[misc]
        # mean(v) from its 1-norm (v >= 0), whole tensors also when sharded
        mean_v = per_tensor_norms([optimizer.state[p]["exp_avg_sq"] for p in params], 1.0) / roots.square()
        corrections = []
        for p in params:
            beta2 = next(g["betas"][1] for g in optimizer.param_groups if any(q is p for q in g["params"]))
            step = torch.as_tensor(optimizer.state[p]["step"], dtype=torch.float32)  # where torch keeps it: no copy
            corrections.append(1 - torch.pow(float(beta2), step))
        # divided tensor by tensor: a step count kept on the host is a scalar there, not a copy to the device
        v_hat = torch.stack(_compat.foreach_div(list(mean_v.unbind()), corrections))
        return grad_rms > self.reset_ratio * v_hat.sqrt()

    def after_step(self, trainer: pl.Trainer, ledger: StepLedger) -> None:
        """After the update (applied or skipped): rescale it, QK-clip, reset hit moments, move the back-off."""
        open_step, self._open, self._fresh = self._open, None, True
        if open_step is None:
            return
        optimizer = open_step.optimizer
        applied = _applied(ledger.outcome, self._device(trainer))
        reads, self._reads = self._reads or self.is_logging_step, False
        signal = self.lr_backoff.signal if self.lr_backoff is not None else None
        found = None  # the updates just applied, recomputed once for the rescaling, the signals and the figures
        coef: Tensor | None = None  # each one's rescaling coefficient (0-dim: one for all)
        if (open_step.coef is not None or reads or signal in ("update_ratio", "update_rms_jump")) and is_adam_like(
            optimizer
        ):
            found = adam_updates(optimizer, open_step.lrs, eps_share=reads, only=open_step.stepped)
            coef = self._coef_for(open_step, found.params, found.norms.device)
            if open_step.coef is not None:
                rescale_updates_(found.params, found.updates, torch.where(applied, coef, 1.0))
        if self.reset_moments and open_step.hit is not None and ledger.health is not None:
            hit = open_step.hit & ledger.health.spike.to(open_step.hit.device) & applied
            keep = (~hit).to(torch.float32)
            with torch.no_grad():
                for p, k in zip(open_step.params, keep.unbind(), strict=True):
                    state = optimizer.state[p]
                    for key in ("exp_avg", "exp_avg_sq"):
                        moment = local_tensor(state[key])  # each rank its shard of a DTensor
                        moment.mul_(k.to(moment.dtype))
            self.moment_resets = hit.sum().float() + self.moment_resets
        maxima = self._attention_maxima()
        if self.qk_clip is not None and maxima:
            clipped = []
            for name, projection in self._projections.items():
                if name in maxima:
                    eta = apply_qk_clip_(projection, maxima[name], self.qk_clip, self.qk_clip_alpha)
                    clipped.append((eta < 1).sum())
            if clipped:
                self.clipped_heads = torch.stack(clipped).sum().float() + self.clipped_heads
        log_z = self._log_z.end_step() if self._log_z is not None else None
        signals = self._signals(found, coef, maxima, log_z, applied)
        if self.lr_backoff is not None:
            self._move_backoff(signals.get(self.lr_backoff.signal), applied)
        if reads:  # into callback_metrics at once; to the loggers on logging steps only (no transfer otherwise)
            self._record(open_step, found, maxima, log_z, signals)

    def _device(self, trainer: pl.Trainer) -> torch.device:
        return trainer.lightning_module.device if trainer.lightning_module is not None else torch.device("cpu")

    def _attention_maxima(self) -> dict[str, Tensor]:
        """Each module's ``(heads,)`` maxima of the step, max-reduced over ranks (one all-reduce for all)."""
        if self._logits is None or not self._logits.maxima:
            return {}
        maxima = self._logits.maxima
        if _world_size() > 1:
            names = list(maxima)
            flat = torch.cat([maxima[n] for n in names])
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)
            sizes = [maxima[n].numel() for n in names]
            maxima = dict(zip(names, flat.split(sizes), strict=True))
        return maxima

    def _signals(
        self,
        found: AdamUpdates | None,
        coef: Tensor | None,
        maxima: dict[str, Tensor],
        log_z: tuple[Tensor, Tensor] | None,
        applied_step: Tensor,
    ) -> dict[str, Tensor]:
        """The step's precursor values (device tensors), those measured; each alike on every rank."""
        out: dict[str, Tensor] = {}
        if maxima:
            out["attention_logit"] = torch.stack([m.amax() for m in maxima.values()]).amax()
        if log_z is not None:
            out["log_z_drift"] = log_z[1].abs()
        if found is not None and found.params:
            applied = found.norms if coef is None else found.norms * coef
            weights = per_tensor_norms([p.detach() for p in found.params])
            total = applied.norm()
            ratio = total / weights.norm().clamp(min=torch.finfo(torch.float32).tiny)
            if _world_size() > 1:  # alike on every rank (and in rank 0's checkpoint), also if a rank's state strayed
                both = torch.stack([ratio, total])
                dist.all_reduce(both, op=dist.ReduceOp.MAX)
                ratio, total = both.unbind()
            out["update_ratio"] = ratio
            out["_update_norms"] = applied
            out["_weight_norms"] = weights
            ema = self._rms_ema
            if isinstance(ema, Tensor) and ema.device != total.device:  # resumed: restored on the CPU
                ema = self._rms_ema = ema.to(total.device)
            out["update_rms_jump"] = total / (ema if isinstance(ema, Tensor) else total)
            if not isinstance(ema, Tensor):
                self._rms_ema = total.detach().clone()
            else:  # on the applied-update clock: a skipped step leaves it
                ema.copy_(torch.where(applied_step.to(ema.device), ema * 0.99 + 0.01 * total, ema))
        return out

    def _coef_for(self, open_step: _OpenStep, params: list[Tensor], device: torch.device) -> Tensor:
        """The coefficient each of ``params`` is rescaled by this step (1 where none): 0-dim when one for all."""
        if open_step.coef is None:
            return torch.ones((), device=device)
        if open_step.coef.dim() == 0:
            return open_step.coef  # the back-off alone: one factor for every tensor
        if len(params) == len(open_step.params) and all(p is q for p, q in zip(params, open_step.params, strict=True)):
            return open_step.coef  # the same tensors in the same order: no gather
        index = {id(p): i for i, p in enumerate(open_step.params)}
        # a tensor taking its first step has no update clip yet (no state before it): the back-off alone
        alone = self._backoff_tensor(device) if self.lr_backoff is not None else torch.ones((), device=device)
        return torch.stack([open_step.coef[index[id(p)]] if id(p) in index else alone for p in params])

    def _move_backoff(self, signal: Tensor | None, applied: Tensor) -> None:
        """One tick of the back-off, on applied updates only."""
        config = self.lr_backoff
        if config is None or signal is None:
            return
        factor = self._backoff_tensor(signal.device)  # every signal is alike on every rank (see _signals)
        past = signal > config.threshold
        moved = torch.where(
            past, (factor * config.factor).clamp(min=config.floor), (factor * config.recovery).clamp(max=1.0)
        )
        factor.copy_(torch.where(applied.to(signal.device), moved, factor))

    def _record(
        self,
        open_step: _OpenStep,
        found: AdamUpdates | None,
        maxima: dict[str, Tensor],
        log_z: tuple[Tensor, Tensor] | None,
        signals: dict[str, Tensor],
    ) -> None:
        if maxima:
            self.record_metric("stability/attention_logit_max", signals["attention_logit"])
            for name, heads in maxima.items():
                self.record_metric(f"stability/attention_logit_max/{name}", heads.amax())
        if log_z is not None:
            self.record_metric("stability/log_z", log_z[0])
            self.record_metric("stability/log_z_drift", log_z[1])
        if found is not None and found.params and found.eps_share is not None:
            device = signals["_update_norms"].device
            index, weights, layers = self._layer_index(found.params, device)
            share = (found.eps_share * weights).sum()  # each tensor's share weighted by its size
            rms = found.norms / self._roots(found.params, device)  # the Adam step's RMS, before any rescaling
            self.record_metric("stability/adam_update_rms_max", rms.max())
            self.record_metric("stability/adam_eps_share", share)
            self.record_metric("stability/adam_update_ratio", signals["update_ratio"])
            ratios = update_to_weight_ratios(signals["_update_norms"], signals["_weight_norms"], index, len(layers))
            for name, ratio in zip(layers, ratios.unbind(), strict=True):
                self.record_metric(f"stability/adam_update_ratio/{name}", ratio)
        if self.qk_clip is not None:
            self.record_metric("stability/qk_clipped_heads", self.clipped_heads)
        if open_step.clip_coef is not None:
            self.record_metric("stability/update_clip_min", open_step.clip_coef.min())
        if self.lr_backoff is not None:
            sent = self.record_metric("stability/lr_backoff", self.backoff)
            if self.is_logging_step and not self._told:
                self._backoff_sent = sent  # read in on_host: the first time it is below 1, say so once
        if self.reset_moments:
            self.record_metric("stability/moment_resets", self.moment_resets)

    def on_host(self, trainer: pl.Trainer, record: OptimizerRecord) -> dict[str, float] | None:
        """Once per fit, the first logging step the back-off is found engaged: a warning saying why and how to
        change it (it scales the updates your LR makes; nothing else would tell you)."""
        sent, self._backoff_sent = self._backoff_sent, None
        if sent is None or self._told or self.lr_backoff is None:
            return None
        factor = sent.number()
        if factor < 1:
            self._told = True
            config = self.lr_backoff
            rank_zero_warn(
                f"PrecursorMonitor's LR back-off is on by step {record.steps}: {config.signal!r} passed its threshold "
                f"{config.threshold:g}, and the Adam updates are scaled by {factor:.3g} (stability/lr_backoff logs "
                "the factor). Adam's update-to-weight ratio is at most about lr / RMS(weights), where the gradients "
                "keep their sign. If your LR is meant as it is, raise the threshold (LRBackoff(threshold=...); in a "
                "preset lr_backoff=...) or turn the back-off off (lr_backoff=None)."
            )
        return None

    def _layer_index(self, params: list[Tensor], device: torch.device) -> tuple[Tensor, Tensor, list[str]]:
        """Each tensor's layer (int64), its share of all the tensors' elements (fp32), the layers' names: built
        once per set of tensors, from one tensor of host data."""
        key = tuple(map(id, params))
        if self._layers is None or self._layers[0] != key:
            index, layers = layer_groups([self._names.get(id(p), "?") for p in params])
            total = sum(p.numel() for p in params)
            both = torch.tensor(index + [p.numel() / total for p in params], dtype=torch.float64, device=device)
            self._layers = (key, both[: len(params)].long(), both[len(params) :].float(), layers)  # HOST DATA: per set
        return self._layers[1], self._layers[2], self._layers[3]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        log_z = self._log_z.state_dict() if self._log_z is not None else self._log_z_state
        return {
            "backoff": float(self.backoff),
            "clipped_heads": float(self.clipped_heads),
            "moment_resets": float(self.moment_resets),
            "rms_ema": None if self._rms_ema is None else float(self._rms_ema),
            "log_z": {k: (None if v is None else float(v)) for k, v in log_z.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.backoff = float(state_dict.get("backoff", 1.0))
        self.clipped_heads = float(state_dict.get("clipped_heads", 0.0))
        self.moment_resets = float(state_dict.get("moment_resets", 0.0))
        rms = state_dict.get("rms_ema")
        self._rms_ema = None if rms is None else torch.tensor(float(rms))
        ema = state_dict.get("log_z", {}).get("ema")
        self._log_z_state = {"ema": None if ema is None else torch.tensor(float(ema))}
        if self._log_z is not None:
            self._log_z.load_state_dict(self._log_z_state)

    def transient_state(self) -> dict[str, Any]:
        return {
            "_logits": None,
            "_log_z": None,
            "_open": None,
            "_layers": None,
            "_projections": {},
            "_root_numel": None,
            "_fresh": True,
            "_reads": False,
            "_backoff_sent": None,
        }


class _OpenStep:
    """What :meth:`PrecursorMonitor.on_step` leaves for :meth:`PrecursorMonitor.after_step`."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.params: list[Tensor] = []
        self.lrs: list[Any] = []  # the param groups' LRs as the step used them
        self.coef: Tensor | None = None  # per tensor: the update clip times the back-off (0-dim: the back-off alone)
        self.clip_coef: Tensor | None = None  # per tensor: the update clip alone
        self.hit: Tensor | None = None  # per tensor: its gradient spiked (moment reset)
        self.stepped: set[int] = set()  # ids of the tensors with a gradient: those the step updates


def _read_after(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether Lightning reads ``callback_metrics`` after this batch (``ModelCheckpoint``, ``EarlyStopping``): the
    epoch's last batch, or one after which validation runs."""
    batches = trainer.num_training_batches
    if isinstance(batches, int) and batch_idx + 1 == batches:
        return True
    every = trainer.val_check_batch
    if not (trainer.enable_validation and isinstance(every, int) and every > 0):
        return False
    # validation every N batches of the run when check_val_every_n_epoch=None, else of the epoch (Lightning's rule)
    counted = _compat.epoch_loop(trainer).total_batch_idx if trainer.check_val_every_n_epoch is None else batch_idx
    return (counted + 1) % every == 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _agree_across_ranks(open_step: _OpenStep) -> None:
    """The update-clip coefficients (their minimum) and the hit tensors (any rank's) alike on every rank: one
    all-reduce. Under DDP every rank computes them from the same reduced gradients and the same state, so this
    changes nothing unless one rank's gradients or state went their own way (then no rank acts on its own)."""
    parts = [t for t in (open_step.clip_coef,) if t is not None]
    if open_step.hit is not None:
        parts.append(1.0 - open_step.hit.float())  # min over ranks of "not hit": hit on any rank
    if _world_size() == 1 or not parts:
        return
    flat = torch.cat(parts)
    dist.all_reduce(flat, op=dist.ReduceOp.MIN)
    chunks = list(flat.split([t.numel() for t in parts]))
    if open_step.clip_coef is not None:
        open_step.clip_coef = chunks.pop(0)
    if open_step.hit is not None:
        open_step.hit = chunks.pop(0) < 0.5


def _tensor_parallel(module: pl.LightningModule) -> str | None:
    """How a parameter is split other than by FSDP2 along its first dim (tensor parallelism), or ``None``."""
    for name, p in module.named_parameters():
        if not is_dtensor(p):
            continue
        mesh = p.device_mesh  # type: ignore[attr-defined]
        names = mesh.mesh_dim_names or ()
        for dim, placement in enumerate(p.placements):  # type: ignore[attr-defined]
            if mesh.size(dim) == 1 or placement.is_replicate() or placement.is_partial():
                continue
            tp = dim < len(names) and names[dim] == "tensor_parallel"
            if tp or not (isinstance(placement, Shard) and placement.dim == 0):
                return f"parameter {name!r} is split as {placement} over mesh dim {dim} of {mesh}"
    return None


def _applied(outcome: Outcome | Tensor, device: torch.device) -> Tensor:
    """0-dim bool on ``device``: the step's update was applied."""
    if isinstance(outcome, Tensor):
        return (outcome == int(Outcome.APPLIED)).to(device)
    return torch.full((), outcome == Outcome.APPLIED, dtype=torch.bool, device=device)
