"""One optimizer step, from unscale to update: where it is measured, where it is clipped, where it is skipped.

:class:`OptimizerStep` is the open step of one optimizer; its methods are in the order the step runs. In full, one row
per :class:`~lightning_stability.ledger.stages.Stage` (its name opens the row); what changes weights, optimizer state,
buffers or the LR outside the optimizer's own update registers at its row with ``StepLedger.at(stage, name, fn)``:

===  ============================================  ==============================================================
 #   what happens                                  where
===  ============================================  ==============================================================
 1   ``BACKWARD``: forward, backward of each       Lightning's loop; ``LedgerCallback.on_before_backward`` runs the
     micro-batch; the loss kept if a callback      functions at ``Stage.BACKWARD`` (``RouterHealthMonitor``'s
     ``needs_loss``                                router z-loss, a gradient hook; a rerun at 3b runs them too)
                                                   and keeps the loss (``step_ledger.StepLoss``: Lightning's
                                                   divisor, fp16 scale undone)
 2   ``UNSCALE``: fp16: the scaler unscales a      ``MixedPrecision`` / ``StableFSDPPrecision.optimizer_step``;
     non-fused optimizer, one flag per device      ``amp/scaler.py`` max-reduces the flag over the ranks
 3   ``OPEN``: **the step opens**: a fused         :class:`OptimizerStep` ``__init__``, from ``StepLedger.open_step``
     optimizer is unscaled now; the scaler's       (the first ``LedgerCallback.on_before_optimizer_step``), then
     decision kept; **what must come before        the functions at ``Stage.OPEN``: ``TrainingHealthMonitor``'s
     anything measures the step**                  rollback (weights, optimizer state, buffers restored; a disk
                                                   rollback loads its checkpoint here), ``StepReplay``'s stand-in
                                                   batch (its buffers put back, a skip vote), ``PrecursorMonitor``'s
                                                   LR back-off (a factor on the update)
3b   ``REPLAY``: **a flagged step replayed**       ``StepReplay`` at ``Stage.REPLAY``: its look
     (with ``StepReplay``): the flags read on      (``TrainingHealthMonitor.flags_on_host``) is the values row 6
     the host, once; the step's forward and        scores, computed once, read with the factors and votes cast at
     backward run again, buffers and RNG states    open (:meth:`OptimizerStep.read_on_host`); the micro-batches run
     put back around them; the fault attributed    again (``replay/rerun.py``), then :meth:`OptimizerStep.regrad`
 4   ``MEASURE``: **gradients measured**, once     :meth:`OptimizerStep.gradients` -> ``gradients.StepGradients``
     for all (callbacks' ``on_step``)
 5   ``CLIP``: **clips**, each relative to the     ``StepGradients.clip_`` -> ``norms.clip_by_global_norm_``:
     norm the ones before left (the tightest       ``GradientNormMonitor(max_norm)``, ``TrainingHealthMonitor``'s
     wins)                                         adaptive clip (ZClip)
 6   ``VOTE``: **votes** to skip: any callback,    ``StepLedger.mark_skip`` -> :meth:`OptimizerStep.vote`;
     the module's ``on_before_optimizer_step``;    ``StepLedger.scale_update`` -> :meth:`OptimizerStep.scale_update`
     **factors on the update**, any callback       (AdaScale's gain; the LR back-off's is added at row 3)
 7   ``LIGHTNING_CLIP``:                           ``StableFSDPPrecision.clip_grad_by_norm``,
     ``Trainer(gradient_clip_val)``, after every   ``FusedClipMixedPrecision.clip_grad_by_norm`` ->
     ``on_before_optimizer_step``                  ``norms.clip_by_global_norm_``; Lightning's other plugins:
                                                   ``torch.nn.utils.clip_grad_norm_`` (the same coefficient);
                                                   ``backend="fairscale"``: FairScale's ``clip_grad_norm_``
 8   ``ENFORCE``: the gradients the update will    the optimizer's step pre-hook (:func:`enforce_before_update`):
     use, read (functions at ``Stage.ENFORCE``);   the functions at ``Stage.ENFORCE`` (``PrecursorMonitor``'s
     **votes enforced**, together, one host read   update-clip coefficients and moment-reset test), then
     at most (none when 3b read what they vote);   :meth:`OptimizerStep.enforce` (the table there says how);
     **the update's scale**: the factors'          ``update.UpdateScale.apply`` (read with the votes if on the host,
     product times each group's LR                 or at 3b)
 9   ``UPDATE``: ``optimizer.step()``, or not      torch, at ``lr x scale`` (every optimizer that reads
     (the fp16 scaler calls it only without        ``group["lr"]``)
     overflow)
10   ``OUTCOME``: **the outcome**: one             :meth:`OptimizerStep.close`, from the step post-hook (or
     :class:`Outcome`; each group's LR put back    ``on_train_batch_end`` when the scaler skipped the call), via
                                                   ``StepLedger.close_step``
11   ``AFTER_UPDATE``: **edits after the           the functions at ``Stage.AFTER_UPDATE``: ``PrecursorMonitor``'s
     update**, applied or skipped: weights,        update clipping (Adam/AdamW), QK-clip, moment reset;
     optimizer state and buffers                   ``RouterHealthMonitor``'s router-logit clip, balancing bias
12   ``MEASURE_UPDATE``: **the update measured**   :meth:`OptimizerStep.finish_update` -> ``update.UpdateSize``
     (when asked): ``||Δθ||``, ``||θ||`` per       (asked for with :meth:`OptimizerStep.measure_update`; read by
     tensor                                        ``TrainingHealthMonitor`` and ``PrecursorMonitor``)
13   ``AFTER_STEP``: callbacks' ``after_step``:    the functions at ``Stage.AFTER_STEP``, one per
     the LR schedule's next LR, the next           ``LedgerCallback``: ``BatchRamp`` (under its kind's name,
     accumulation window, the monitors             ``CriticalBatchMonitor``: a larger factor, beta2), ``ScheduledLR``
                                                   (on the put-back LR), ``GradientAccumulation`` (the next window's
                                                   factor; its LR with ``lr_scaling`` and no schedule), the
                                                   back-off's factor moved on row 12, the health history's outcome
===  ============================================  ==============================================================

The functions of a row run in the order of their names: what a step does does not depend on the order of the
Trainer's callbacks. What lands in the weights is rows 3 (a rollback), 9 and 11, nothing else; what sets an update's
size is the LR schedule (the base LR), row 8 (every factor on it) and, for Adam only, the update clipping of row 11.

Where is a step skipped? At 8, and only there (under fp16 the scaler's own skip at 9 obeys the votes of 6).
Where is it clipped? At 5 and 7; every clip of this package goes through one function, ``norms.clip_by_global_norm_``.

The enforcement does not depend on where a vote came from: the pre-hook runs once per step after every
``on_before_optimizer_step`` hook (the package's callbacks, yours, the module's) and Lightning's clip. Lightning
runs those hooks inside the closure it passes to ``optimizer.step`` (except under fp16, where the scaler runs the
closure first), and torch runs a step pre-hook before the optimizer calls its closure, so the pre-hook enforces
after that closure returns; torch's optimizers read their gradients and ``found_inf`` only after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability.ledger.gradients import ClipScale, StepGradients
from lightning_stability.ledger.skips import (
    Flag,
    add_to_scaler_decision,
    drop_gradients,
    either,
    found_inf_is_safe,
    read_votes_on_host,
    scaler_found_inf,
    set_found_inf,
    supports_found_inf,
    unscale_if_deferred,
)
from lightning_stability.ledger.track import OptimizerRecord, Outcome
from lightning_stability.ledger.update import UpdateScale, UpdateSize


class OptimizerStep:
    """The open step of one optimizer: its values, its gradients, its skip votes, its outcome.

    Read in ``on_step`` (``ledger.step``): :attr:`loss`, :attr:`grad_norm`, :attr:`clip_coef` (0-dim device
    tensors, or ``None`` when no callback provides them), :meth:`gradients`. The rest is driven by the ledger.

    Args:
        optimizer: the optimizer about to step.
        record: its record in the ledger (where the outcome is counted, and its device).
        scaler: the enabled fp16 ``GradScaler``, or ``None``.
        loss: the update's loss (mean of its micro-batches, unscaled), when a callback asked for it.
        enforce_each_vote: enforce every vote at once (the step pre-hook was registered too late for this step).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        record: OptimizerRecord,
        scaler: Any | None,
        loss: Tensor | None = None,
        enforce_each_vote: bool = False,
    ) -> None:
        self.optimizer, self.record, self.scaler = optimizer, record, scaler
        #: the update's loss, unscaled, the mean over its micro-batches (with a callback that ``needs_loss``)
        self.loss = loss
        #: the global gradient norm before any clip (``GradientNormMonitor``)
        self.grad_norm: Tensor | None = None
        #: ``GradientNormMonitor``'s clip coefficient (with ``max_norm``)
        self.clip_coef: Tensor | None = None
        self.stepped = False  # optimizer.step() ran (its post-hook fired)
        self._grads: dict[float, StepGradients] = {}
        self._clip = ClipScale()  # every clip of this step, shared by all norm types
        self._known: dict[Outcome, Flag] = {}  # reasons decided so far (host bools or device flags)
        self._pending: dict[Outcome, Flag] = {}  # votes not yet enforced
        self._open_votes: set[Outcome] = set()  # votes cast as the step opened, read early (not on its gradients)
        self._folded: dict[Outcome, Flag] = {}  # votes added to the fp16 scaler's decision
        self._enforced = enforce_each_vote  # once enforced, a later vote is enforced at once
        self._found_inf_set = False  # `found_inf` is set on the optimizer (removed at close)
        self._on_host = False  # the scaler decides this step on the host (non-fused optimizer)
        self._host_overflow: Tensor | None = None  # its overflow flag, kept when a vote joined its decision
        #: the factors on the coming update and, once applied, the LRs it used (rows 6, 8, 10)
        self.scale = UpdateScale()
        self._scaled = False  # the factors are in the LRs (put back at close)
        #: the update's size (row 12), when a callback asked for it; finished at close
        self.update: UpdateSize | None = None
        self._update_logged = False  # its ratio goes to the loggers (a callback asked on its logging step)
        #: how many times the step's gradients were computed again (row 3b): a measure of the gradients is valid
        #: for the generation it was taken at
        self.generation = 0
        #: known on the host (an early read, row 3b) that every rank's loss and gradient norm of this generation are
        #: finite: a vote on non-finite values can then be a host ``False`` (no read at row 8)
        self.known_finite = False
        if scaler is None:
            return
        # 3. A fused optimizer would unscale inside step(): unscale now, so that callbacks see true gradients.
        unscale_if_deferred(scaler, optimizer)
        if supports_found_inf(optimizer):
            found_inf = scaler_found_inf(scaler, optimizer)
            if found_inf is not None:
                self._known[Outcome.SKIPPED_SCALER] = found_inf
        else:
            # The scaler reads its overflow flag on the host itself and calls `optimizer.step()` only when it
            # found none: whether the step post-hook ran is the outcome, known without another sync.
            self._on_host = True

    @property
    def device(self) -> torch.device:
        return self.record.device

    # 3b. --------------------------------------------------------------- replay
    def regrad(self, loss: Tensor | None) -> None:
        """The step's gradients were computed again (``StepReplay``, row 3b): forget every measure of the old ones
        and take ``loss``, the new update's loss (as :attr:`loss`). Only before anything clipped, voted or scaled."""
        on_gradients = set(self._pending) - self._open_votes  # a vote on the batch (cast as it opened) stands
        if on_gradients or self._known or self._scaled or self._clip.coef is not None:
            raise RuntimeError("regrad() after the step was clipped, voted on or scaled: replay before row 4")
        self._grads = {}
        self.loss = loss
        self.generation += 1
        self.known_finite = False

    def read_on_host(self, values: Tensor) -> list[float]:
        """``values`` (a device tensor) as host numbers, read now in one transfer (a HOST SYNC on a GPU): a step's
        early read (row 3b, ``StepReplay``). The product of the factors on the update added so far, and the device
        votes cast so far (they become host bools: :meth:`voted`), come with it, so that a step whose votes are then
        host bools needs no read at row 8."""
        parts = [values.detach().float().reshape(-1)]
        factor = self.scale.total if self.scale.needs_host(self.optimizer) else None
        if isinstance(factor, Tensor):
            parts.append(factor.detach().float().reshape(1).to(parts[0].device, non_blocking=True))
        votes = [(reason, flag) for reason, flag in self._pending.items() if isinstance(flag, Tensor)]
        for _, flag in votes:
            parts.append(flag.detach().float().reshape(1).to(parts[0].device, non_blocking=True))
        host = torch.cat(parts).to("cpu", copy=True).tolist()
        for reason, _ in reversed(votes):
            self._pending[reason] = host.pop() > 0
        self._open_votes |= set(self._pending)
        if isinstance(factor, Tensor):
            self.scale.read_as(host.pop())
        return host

    def voted(self, reason: Outcome) -> Flag:
        """The votes cast so far to skip the step for ``reason`` (``False`` when none): a host bool, or a device
        flag not read yet."""
        flags = [d[reason] for d in (self._known, self._pending, self._folded) if reason in d]
        found: Flag = False
        for flag in flags:
            found = either(found, flag)
        return found

    # 4. ---------------------------------------------------------------- measure
    def gradients(self, norm_type: float = 2.0) -> StepGradients:
        """The step's gradients and their norms, computed once per norm type for every callback.

        5. Clip with ``gradients(...).clip_(threshold)``: each clip is relative to the norm the earlier ones left.
        """
        grads = self._grads.get(norm_type)
        if grads is None:
            grads = self._grads[norm_type] = StepGradients(self.optimizer, norm_type, self.device, self._clip)
        return grads

    # 6. ---------------------------------------------------------------- vote
    def vote(self, reason: Outcome, flag: Flag) -> None:
        """Skip the step when ``flag`` (a host bool or a 0-dim device tensor) is true (``StepLedger.mark_skip``)."""
        if reason is Outcome.APPLIED:
            raise ValueError("Outcome.APPLIED is not a skip reason")
        if reason is Outcome.SKIPPED_SCALER:
            self._known[reason] = either(self._known.get(reason, False), flag)
            return
        scaler = self.scaler
        if scaler is not None and isinstance(flag, Tensor):
            overflow = scaler_found_inf(scaler, self.optimizer)
            # Under fp16 a device vote joins the flags the scaler's step obeys (its update ignores them), now.
            if add_to_scaler_decision(scaler, self.optimizer, flag):
                self._folded[reason] = either(self._folded.get(reason, False), flag)
                if self._on_host and self._host_overflow is None:
                    self._host_overflow = overflow  # the gradients' own overflow, told apart from the votes
                return
        self._pending[reason] = either(self._pending.get(reason, False), flag)
        if self._enforced:
            self.enforce()

    def scale_update(self, source: str, factor: Tensor | float) -> None:
        """Multiply the coming update by ``factor`` (a number >= 0 or a 0-dim device tensor), through each param
        group's LR (``StepLedger.scale_update``). Factors of every source multiply; 1 leaves the update alone."""
        if self._scaled:
            raise RuntimeError(
                f"scale_update({source!r}) after the update's LRs were set: call it from on_before_optimizer_step "
                "(a LedgerCallback's on_step)"
            )
        self.scale.add(source, factor)

    def measure_update(self, log: bool = False) -> UpdateSize | None:
        """Measure this update's size (row 12): ``step.update`` holds it from ``after_step`` on, and the ledger records
        its ratio as ``stability/update_ratio`` (in ``callback_metrics``; to the loggers too when a callback asked
        with ``log=True``, on its logging step). Costs one transient copy of this rank's weights; asked for by several
        callbacks, measured once. ``None`` when no tensor has a gradient."""
        self._update_logged = self._update_logged or log
        if self.update is None:
            params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            if params:
                self.update = UpdateSize(params)
        return self.update

    # 8. ---------------------------------------------------------------- enforce
    def enforce(self, before_update: bool = False) -> None:
        """Make the update skip if any vote so far says so, leaving weights and optimizer state exactly as they were.

        Runs right before the update (the step pre-hook, ``before_update=True``: then the update's factors go into
        each group's LR too, read on the host with the votes when they must be), once for every vote of the step; a
        vote cast after it is enforced at once.
        """
        self._enforced = True
        # the update's factors go into the LRs once, right before the update (the step pre-hook)
        scale_now = before_update and not self._scaled
        self._scaled = self._scaled or before_update
        on_host = scale_now and self.scale.needs_host(self.optimizer)
        read_early = self.scale.on_host() if on_host else None  # the product, if an early read carried it
        host_scale = self._enforce_votes(self.scale.total if on_host and read_early is None else None)  # type: ignore[arg-type]
        if scale_now:
            if on_host and host_scale is None:
                # HOST SYNC when no read carried it (the votes', an early one)
                host_scale = read_early if read_early is not None else float(self.scale.total)
            self.scale.apply(self.optimizer, host_scale)

    def _enforce_votes(self, also: Tensor | None) -> float | None:
        """Enforce the pending votes; returns ``also`` as a host number when the votes were read on the host."""
        if not self._pending:
            return None
        votes, self._pending = self._pending, {}
        device_votes = any(isinstance(v, Tensor) for v in votes.values())
        # ===========================================  ======================================================
        # the step                                     how the votes skip it
        # ===========================================  ======================================================
        # fp16 loss scaler                             device votes were added to the scaler's own flags at
        #                                              the vote (6): its step() skips; host votes: dropped
        #                                              gradients (below), no read
        # fused Adam/AdamW/SGD, no scaler              ``optimizer.found_inf``: the kernel leaves params and
        #                                              state alone; no read (a fused SGD with momentum before
        #                                              its buffers exist: as below, ``found_inf_is_safe``)
        # any other optimizer                          one host read of all the votes, then dropped gradients
        #                                              (torch's optimizers leave a gradient-less param alone)
        # ===========================================  ======================================================
        fused = supports_found_inf(self.optimizer) and found_inf_is_safe(self.optimizer)
        if device_votes and self.scaler is None and fused:
            self._found_inf_set = set_found_inf(self.optimizer, votes, self.device, self._found_inf_set)
            self._remember(votes)
            return None
        host_also = None
        if device_votes:  # HOST SYNC, one for all votes (and ``also``)
            votes, host_also = read_votes_on_host(self.optimizer, votes, self.device, also)
        if any(votes.values()):
            drop_gradients(self.optimizer)
        self._remember(votes)
        return host_also

    def _remember(self, votes: dict[Outcome, Flag]) -> None:
        for reason, flag in votes.items():
            self._known[reason] = either(self._known.get(reason, False), flag)

    # 10. --------------------------------------------------------------- outcome
    def close(self) -> Outcome | Tensor:
        """The step's :class:`Outcome` (a tensor when decided on the device), once ``optimizer.step()`` ran or
        the scaler skipped it (:attr:`stepped`). Removes ``found_inf`` from the optimizer and puts each group's LR
        back."""
        if self._found_inf_set:
            del self.optimizer.found_inf  # type: ignore[attr-defined]
            del self.optimizer.grad_scale  # type: ignore[attr-defined]
            self._found_inf_set = False
        self.scale.close(self.optimizer)  # each group's LR put back; ``scale.lrs``: the LRs of this update
        known = dict(self._known)
        for reason, flag in self._pending.items():  # never enforced: the scaler skipped the call to step()
            known[reason] = either(known.get(reason, False), flag)
        if self._on_host:
            # The scaler stepped only without overflow and without a true vote: both known on the host.
            if self.stepped:
                folded: dict[Outcome, Flag] = {}
            else:
                folded = self._folded
                # skipped by the overflow or by a vote: without a vote, surely the overflow
                known[Outcome.SKIPPED_SCALER] = True if self._host_overflow is None else self._host_overflow
        else:
            folded = self._folded
        for reason, flag in folded.items():
            known[reason] = either(known.get(reason, False), flag)
        outcome: Outcome | Tensor = Outcome.APPLIED
        for reason in sorted(known, reverse=True):  # the lowest reason that applies wins
            flag = known[reason]
            if isinstance(flag, Tensor):
                # scalars, not host-made tensors: on a GPU those would be blocking host-to-device copies
                other = outcome if isinstance(outcome, Tensor) else int(outcome)
                outcome = torch.where(flag.to(self.device, non_blocking=True).bool(), int(reason), other)
            elif flag:
                outcome = reason
        return outcome

    # 12. --------------------------------------------------------------- the update measured
    def finish_update(self) -> tuple[Tensor, bool] | None:
        """Measure what rows 9 and 11 left in the weights, when a callback asked (:meth:`measure_update`): the
        update-to-weight ratio, and whether it goes to the loggers."""
        if self.update is None:
            return None
        self.update.finish()
        ratio = self.update.ratio
        return None if ratio is None else (ratio, self._update_logged)


def enforce_before_update(
    args: tuple[Any, ...], kwargs: dict[str, Any], enforce: Callable[[], None]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The body of the optimizer step pre-hook: run ``enforce`` right before the update.

    torch runs a step pre-hook before ``step()`` calls its closure, and Lightning (outside fp16) passes a closure
    that runs backward, every ``on_before_optimizer_step`` hook and its own clip: then ``enforce`` runs when that
    closure returns (the new ``args, kwargs`` carry the wrapped closure). Without a closure (the fp16 scaler ran
    it already, manual calls) it runs now.
    """
    in_args = len(args) > 1 and args[1] is not None
    closure = args[1] if in_args else kwargs.get("closure")
    if closure is None:
        enforce()
        return None

    def closure_then_enforce() -> Any:
        result = closure()
        enforce()
        return result

    if in_args:
        return (args[0], closure_then_enforce, *args[2:]), kwargs
    return args, {**kwargs, "closure": closure_then_enforce}
