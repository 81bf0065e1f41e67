"""StepReplay: replay a flagged step before its update, tell a bad batch from a bad chip, and act on each.

When ``TrainingHealthMonitor`` would flag the step about to be applied (a non-finite loss or gradient norm, a loss
spike; a gradient-norm spike alone is left to the monitor), the step's forward and backward run again from what it
started from (``replay/rerun.py``), and every rank compares the runs bit for bit (``replay/attribute.py``):

==================  ==================================================  ==========================================
attribution         what the runs show                                  what happens
==================  ==================================================  ==========================================
transient fault     the step went wrong once, on one rank (a second     the replay's gradients are the step's: it
                    replay agrees with the first, not with the          goes on as in a fault-free run, to the bit;
                    original)                                           the rank is counted
data                the step reproduces, flag and all                   the samples of the micro-batches that
                                                                        reproduce the flag are quarantined: never
                                                                        trained on again; the step is applied
                                                                        without those micro-batches when they are
                                                                        told apart, else skipped
nondeterministic    no two runs agree                                   the update is skipped; a warning says which
                                                                        ranks
device              under DDP, the suspect rank's micro-batches run on  the update is skipped, nothing
                    a healthy rank: they flag nothing there (data), or  quarantined; a checkpoint, then
                    two runs there agree (nondeterminism)               :class:`FailingDeviceError` at once
failing device      a rank counted ``max_faults`` times within          a checkpoint of the state after this
                    ``fault_window`` steps                              (healthy) step, then
                                                                        :class:`FailingDeviceError` on every rank,
                                                                        naming the rank and its host
==================  ==================================================  ==========================================

Under DDP (2+ processes, every rank holds the same weights) a step attributed to the data or to nondeterminism is
checked on another device before it is acted on (``_confirm``): each suspect rank swaps micro-batches with a healthy
one and every rank runs what it was given, the gradient sync held back. On one process, and under FSDP (a rank
holds only shards of the weights), there is no such check: a device that fails the same way every time is taken for
bad data, one that fails differently each time for nondeterminism, and the verdict's detail says so.

A batch whose samples are all quarantined (met again in a later epoch, in a sequential order) keeps its position in
the epoch, so that every rank yields as many batches and a resume counts them alike: the sampler yields a stand-in
there (another batch's samples, loaded again) and the step that holds it is skipped on every rank
(``Outcome.SKIPPED_QUARANTINED``: no update, the buffers its forward changed put back), so no sample is trained on
twice in an epoch. With accumulation the step's other micro-batches are skipped with it. Under data parallelism,
once a sample is quarantined, whether any rank holds a stand-in is reduced over ranks at each step (one 0-dim
all-reduce, read with the step's flags as it opens).

Cost: on a healthy step, one host read of the step's flags as it opens (the decision to replay is the host's), which
the votes on the step and the update's factors then use, so that a non-fused optimizer's step makes no read of its
own at row 8 (a fused one reads nothing without ``StepReplay``: one read more there); the RNG states of each
micro-batch (a few kB on the host); the batches stay alive until the update; the buffers a forward changes
(BatchNorm's statistics, an MoE layer's token counts, persistent or not: ``ledger/forward_state.py``) are copied
once per step. A flagged step pays one or two more forward and backward passes
and a copy of its gradients; one attributed to the data or to nondeterminism under DDP, one more (two for
nondeterminism), the gather of the suspects' micro-batches and another copy of the gradients. Each replay's time is
in its event (``elsewhere_seconds``: the run on another rank)."""

from __future__ import annotations

import socket
import time
from collections import deque
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_stability import incidents
from lightning_stability.checkpoint import rng
from lightning_stability.checkpoint.loader_state import ReplayableSampler, training_sampler
from lightning_stability.checkpoint.save_now import save_now
from lightning_stability.errors import StabilityConfigError, check_int, check_path, config_error
from lightning_stability.health.callback import TrainingHealthMonitor
from lightning_stability.ledger import LedgerCallback, Outcome, Stage, StepLedger, loss_scaler
from lightning_stability.ledger.step_ledger import StepLoss
from lightning_stability.ranks import gather_objects
from lightning_stability.replay.attribute import (
    Attribution,
    Cause,
    Elsewhere,
    Evidence,
    attribute,
    confirm_elsewhere,
    rank_verdict,
    suspects,
)
from lightning_stability.replay.quarantine import Quarantine
from lightning_stability.replay.rerun import StepInputs, copies, gradients, received, rerun, same_bits, shipped

#: how a device that looks like the attribution's cause fails, on one process
_HOW = {Cause.DATA: "the same way every time", Cause.NONDETERMINISTIC: "differently each time"}


class FailingDeviceError(RuntimeError):
    """A device kept computing wrong values: ``StepReplay`` stopped the run after a checkpoint, on every rank.

    Attributes:
        rank: the failing rank.
        host: its host name.
        steps: the steps its faults were seen at.
        checkpoint: the checkpoint saved before the stop (``None`` when none could be).
    """

    def __init__(self, message: str, rank: int, host: str, steps: list[int], checkpoint: str | None) -> None:
        super().__init__(message)
        self.rank, self.host, self.steps, self.checkpoint = rank, host, steps, checkpoint


class StepReplay(LedgerCallback):
    """Replay each step ``TrainingHealthMonitor`` flags, before its update, and attribute it: a transient fault on
    one rank (applied as replayed, bit-exact), bad data (skipped, its samples quarantined), nondeterminism, or a
    failing device (checkpoint, then :class:`FailingDeviceError` naming it). See the module's table.

    Needs a ``TrainingHealthMonitor`` (its rule flags the steps), automatic optimization, one optimizer and no fp16
    loss scaler (bf16 and fp32 are fine); refused at ``setup`` otherwise.

    Args:
        max_faults: faults on one rank, within ``fault_window`` steps, that make it a failing device.
        fault_window: the window, in optimizer steps.
        quarantine_file: where rank 0 writes the quarantine manifest (JSON), relative to the Trainer's
            ``default_root_dir`` unless absolute; ``None``: not written (it is in every checkpoint either way).
        rng_states: the random generators replayed as each micro-batch started: ``"torch"`` (the CPU generator and
            every CUDA device's: dropout, ``torch.rand*``), or ``"all"``, also NumPy's global one and Python's
            ``random`` (about 50 us more a micro-batch), for a ``training_step`` that draws from those; without it
            such a step's runs disagree and a flagged step is judged nondeterministic and skipped.
        log_every_n_steps: as for every callback of the package (default: the Trainer's).

    Metrics (every step, so ``ModelCheckpoint``/``EarlyStopping`` can monitor them; to the loggers on logging
    steps): ``stability/replays`` (steps replayed so far), ``stability/faults`` (transient faults attributed),
    ``stability/nondeterministic`` (steps no two runs of which agreed), ``stability/quarantined`` (samples
    quarantined).

    Example::

        trainer = L.Trainer(callbacks=[TrainingHealthMonitor(response="skip"), StepReplay()])
    """

    one_instance_reason = "each would replay the same steps"

    def __init__(
        self,
        max_faults: int = 3,
        fault_window: int = 1000,
        quarantine_file: str | Path | None = "quarantine.json",
        rng_states: str = "torch",
        log_every_n_steps: int | None = None,
    ) -> None:
        super().__init__(log_every_n_steps)
        check_int("max_faults", max_faults, 1, "3")
        check_int("fault_window", fault_window, 1, "1000")
        if quarantine_file is not None:
            check_path("quarantine_file", quarantine_file, "'quarantine.json'")
        if rng_states not in ("torch", "all"):
            raise config_error(
                "rng_states",
                rng_states,
                "is not one of 'torch', 'all'",
                "rng_states='all' when training_step draws from NumPy or Python's random, else 'torch'",
            )
        self.max_faults, self.fault_window = max_faults, fault_window
        self.quarantine_file = quarantine_file
        self.rng_states = rng_states
        self.quarantine = Quarantine()
        self.inputs = StepInputs(every_generator=rng_states == "all")
        #: ``quarantined_batches``: steps skipped because a batch of theirs had no sample left
        #: ``devices``: steps whose fault followed a rank's device when its micro-batches ran on another rank
        self.counts = {
            "replays": 0,
            "faults": 0,
            "data": 0,
            "nondeterministic": 0,
            "devices": 0,
            "quarantined_batches": 0,
        }
        self._faults: dict[int, deque[int]] = {}  # rank -> steps of its faults within the window
        self._failing: tuple[int, str, list[int], str] | None = None  # rank, host, steps, why
        self._monitor: TrainingHealthMonitor | None = None
        self._sampler: ReplayableSampler | None = None
        self._hosts: list[str] = []
        self._world = 1
        self._elsewhere = False  # a suspect rank's micro-batches can be run on another rank (DDP, 2+ processes)
        self._stand_in: bool | None = False  # the open step holds a stand-in on some rank (None: not read yet)
        self._flags: tuple[Tensor, Tensor] | None = None  # False and True on the device, made once

    # ------------------------------------------------------------------ setup
    def on_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        monitors = [cb for cb in trainer.callbacks if isinstance(cb, TrainingHealthMonitor)]  # type: ignore[attr-defined]
        if not monitors:
            raise StabilityConfigError(
                "StepReplay replays the steps TrainingHealthMonitor flags, and there is none. Fix: add "
                "TrainingHealthMonitor(response='skip') to the callbacks (a preset has one)."
            )
        if not pl_module.automatic_optimization:
            raise StabilityConfigError(
                "StepReplay replays a step as Lightning's automatic optimization runs it; this module sets "
                "automatic_optimization=False. Fix: remove StepReplay, or use automatic optimization."
            )
        if loss_scaler(trainer) is not None:
            raise StabilityConfigError(
                f"StepReplay does not replay under fp16 loss scaling (precision={trainer.precision!r}): the scaler "
                "has unscaled and judged the original gradients by then. Fix: precision='bf16-mixed' or 32, or "
                "remove StepReplay."
            )
        self._monitor = monitors[0]
        ledger = StepLedger.of(trainer)
        ledger.at(Stage.OPEN, "StepReplay", self._vote_stand_ins)  # before TrainingHealthMonitor's rollback
        ledger.at(Stage.REPLAY, "StepReplay", self._look)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise StabilityConfigError(
                f"StepReplay replays one optimizer's steps; this module has {len(trainer.optimizers)}. Fix: remove "
                "StepReplay, or train with one optimizer."
            )
        self._hosts = [str(h) for h in gather_objects(socket.gethostname())]  # every rank's, in rank order
        self._world = trainer.world_size
        self._elsewhere = self._world > 1 and isinstance(trainer.strategy, DDPStrategy)
        if self._world > 1 and not self._elsewhere:
            rank_zero_info(
                f"StepReplay: under {type(trainer.strategy).__name__} a rank holds only part of the weights, so a "
                "suspect rank's micro-batches are not run on another rank: a device that fails the same way every "
                "time is taken for bad data (quarantined), one that fails differently each time for nondeterminism, "
                "and a device is named after max_faults transient faults only. Under DDP they are told apart."
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.inputs.forget_module(pl_module)
        self._use_sampler(trainer, training_sampler(trainer))
        if self._sampler is None:
            rank_zero_warn(
                "StepReplay: the training loader has no index sampler this package can wrap (an iterable stream, "
                "several loaders, or a loader with state_dict): a bad batch is skipped, but its samples can be "
                "neither named nor left out later. Fix: a map-style Dataset in one DataLoader."
            )

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a loader built anew for this epoch (reload_dataloaders_every_n_epochs) leaves the quarantine out too
        self._use_sampler(trainer, training_sampler(trainer, fresh_epoch=True))
        self.inputs.clear()

    def _use_sampler(self, trainer: pl.Trainer, sampler: ReplayableSampler | None) -> None:
        self._sampler = sampler
        if sampler is not None:
            sampler.exclude = self.quarantine.indices

    # ------------------------------------------------------------------ each micro-batch
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        item = self._sampler.item_at(batch_idx) if self._sampler is not None else None
        indices = None if item is None else [int(item)] if isinstance(item, int) else [int(i) for i in item]
        stand_in = self._sampler is not None and self._sampler.stand_in_at(batch_idx)
        self.inputs.add_micro_batch(pl_module, batch, batch_idx, indices, stand_in)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        super().on_before_backward(trainer, pl_module, loss)
        self.inputs.add_loss(loss)

    def after_step(self, trainer: pl.Trainer, ledger: StepLedger) -> None:
        self.inputs.clear()
        # host counts, every step (ModelCheckpoint and EarlyStopping can monitor them); to the loggers on logging steps
        self.record_metric("stability/replays", float(self.counts["replays"]))
        self.record_metric("stability/faults", float(self.counts["faults"]))
        self.record_metric("stability/nondeterministic", float(self.counts["nondeterministic"]))
        self.record_metric("stability/quarantined", float(len(self.quarantine.indices)))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._failing is not None:
            self._stop(trainer)

    # ------------------------------------------------------------------ a batch with no sample left
    def _vote_stand_ins(self, ledger: StepLedger) -> None:
        """As the step opens, before the replay's look: skip the step on every rank when a micro-batch of it, on any
        rank, stands in for a batch whose samples are all quarantined."""
        self._stand_in = False
        mine = any(m.stand_in for m in self.inputs.micro)
        if self._world < 2:
            if mine:
                ledger.mark_skip(Outcome.SKIPPED_QUARANTINED, True)
                self._skip_stand_in(ledger)
            return
        if self._sampler is None or not self.quarantine.indices:
            return  # no rank yields a stand-in (the quarantine is the same on every rank)
        device = ledger.step.device
        if self._flags is None or self._flags[0].device != device:
            self._flags = (
                torch.zeros((), dtype=torch.bool, device=device),
                torch.ones((), dtype=torch.bool, device=device),
            )
        # ONE 0-dim ALL-REDUCE, no sync: the vote is read with the step's flags as it opens (OptimizerStep.read_on_host)
        ledger.mark_skip(Outcome.SKIPPED_QUARANTINED, ledger.any_rank(self._flags[int(mine)]))
        self._stand_in = None

    def _skip_stand_in(self, ledger: StepLedger) -> None:
        """The step holds a stand-in on some rank and is skipped: the buffers its forward changed go back."""
        self._stand_in = True
        self.counts["quarantined_batches"] += 1
        self.inputs.restore_buffers()
        rank_zero_info(
            f"StepReplay: step {ledger.step_label}: every sample of one of its batches is quarantined (another "
            "batch was loaded in its place): the step is skipped, on every rank, with no update"
        )

    # ------------------------------------------------------------------ the replay (row 3b)
    def _look(self, ledger: StepLedger) -> None:
        """As the step opens: replay it if the monitor would flag it (not a step skipped for a stand-in)."""
        trainer, monitor = ledger.trainer, self._monitor
        if trainer is None or monitor is None or not self.inputs.micro or not monitor.scores_step() or self._stand_in:
            return
        # the step's early read (a HOST SYNC on a GPU), alike on every rank; the votes on the step use it (no read at
        # row 8): with a non-fused optimizer it is the step's one read, as without StepReplay
        nonfinite, loss_spike, _ = monitor.flags_on_host(ledger)
        if self._stand_in is None and ledger.step.voted(Outcome.SKIPPED_QUARANTINED) is True:
            self._skip_stand_in(ledger)
            return
        if nonfinite or loss_spike:
            self._replay(trainer, ledger, monitor, nonfinite)

    def _replay(self, trainer: pl.Trainer, ledger: StepLedger, monitor: TrainingHealthMonitor, nonfinite: bool) -> None:
        start = time.perf_counter()
        step, optimizer = ledger.step, ledger.step.optimizer
        original = [m.loss for m in self.inputs.micro]
        original_grads = copies(gradients(optimizer))
        first = rerun(trainer, optimizer, self.inputs)
        first_grads = gradients(optimizer)
        same = (same_bits(original, first), same_bits(original_grads, first_grads))
        runs = 2
        gathered: list[Any] = gather_objects(same)
        if all(loss and grads for loss, grads in gathered):
            losses = grads = [Evidence(True) for _ in gathered]
            final = first
        else:  # the runs differ somewhere: a third run decides, on every rank
            kept = copies(first_grads)
            second = rerun(trainer, optimizer, self.inputs)
            second_grads = gradients(optimizer)
            runs = 3
            local = (
                same,
                (same_bits(original, second), same_bits(first, second)),
                (same_bits(original_grads, second_grads), same_bits(kept, second_grads)),
            )
            gathered = gather_objects(local)
            losses = [Evidence(s[0], *o) for s, o, _ in gathered]
            grads = [Evidence(s[1], *g) for s, _, g in gathered]
            final = second
        step.regrad(_update_loss(final, trainer.accumulate_grad_batches))
        replay_nonfinite, replay_spike, _ = monitor.flags_on_host(ledger)  # HOST READ, on a replayed step only
        replay_flagged = replay_nonfinite or replay_spike
        found = attribute([rank_verdict(e) for e in losses], [rank_verdict(e) for e in grads], replay_flagged)
        found, note, elsewhere = self._confirm(trainer, optimizer, monitor, found, final)
        runs += elsewhere.get("runs", 0)
        seconds = time.perf_counter() - start
        self._act(
            trainer,
            ledger,
            monitor,
            found,
            final,
            replay_nonfinite if replay_flagged else nonfinite,
            runs,
            seconds,
            note,
            elsewhere,
        )

    def _confirm(
        self,
        trainer: pl.Trainer,
        optimizer: Any,
        monitor: TrainingHealthMonitor,
        found: Attribution,
        losses: list[Tensor | None],
    ) -> tuple[Attribution, str, dict[str, Any]]:
        """Before a step attributed to the data or to nondeterminism is acted on, under DDP: run each suspect rank's
        micro-batches on a healthy rank, which holds the same weights (attribute.py's second table). Every rank
        joins: a suspect and its healthy partner swap micro-batches (the partner's, run on the suspect's device, say
        more in the detail), the other ranks run their own; the gradient sync is held back, so each rank's
        gradients are its own. Returns the attribution, a note for the verdict's detail and the event's fields.

        Costs, on such a step only: one ``all_gather_object`` of the suspects' and partners' micro-batches (on the
        CPU), one more forward and backward (two for nondeterminism), a copy of the gradients, two host reads."""
        if found.cause not in (Cause.DATA, Cause.NONDETERMINISTIC):
            return found, "", {}
        looks_like = "bad data" if found.cause is Cause.DATA else "nondeterminism"
        if self._world < 2:
            return found, f" (one process: a device that fails {_HOW[found.cause]} looks like {looks_like})", {}
        if not self._elsewhere:
            return found, f" (not run on another rank under {type(trainer.strategy).__name__}: DDP only)", {}
        if found.cause is Cause.DATA:
            flagged = [any(f) for f in gather_objects(self._flagged(trainer, monitor, losses))]  # HOST READ
        else:
            flagged = [False] * self._world
        ranks = suspects(found, flagged)
        if not ranks:
            return found, " (every rank's micro-batches flag: no healthy rank is left to run them elsewhere)", {}
        start = time.perf_counter()
        me = trainer.global_rank
        healthy = [r for r in range(self._world) if r not in ranks]
        pairs = list(zip(ranks, healthy, strict=False))  # a suspect past the last healthy rank keeps its verdict
        source = list(range(self._world))
        for suspect, partner in pairs:
            source[suspect], source[partner] = partner, suspect
        micro: list[Any] = gather_objects(shipped(self.inputs) if source[me] != me else None)
        inputs = (
            self.inputs if source[me] == me else received(self.inputs, micro[source[me]], trainer.strategy.root_device)
        )
        kept_grads = copies(gradients(optimizer))
        kept_rng = rng.capture() if self.inputs.every_generator else rng.capture_torch()
        twice = found.cause is Cause.NONDETERMINISTIC
        runs = [rerun(trainer, optimizer, inputs, sync=False) for _ in range(2 if twice else 1)]
        local = (any(self._flagged(trainer, monitor, runs[0])), same_bits(runs[0], runs[1]) if twice else None)
        seen: list[Any] = gather_objects(local)  # HOST READ above, on a replayed step only
        # the replay's gradients and RNG states back (the buffers: every outcome from here skips or runs again)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for param, grad in zip(params, kept_grads, strict=True):
            param.grad = grad
        rng.restore(kept_rng)
        confirmed = confirm_elsewhere(found, {s: Elsewhere(*seen[p]) for s, p in pairs})
        fields = {
            "runs": len(runs),
            "elsewhere": [
                {"rank": s, "on": p, "flagged": seen[p][0], "same": seen[p][1], "partner_flagged": seen[s][0]}
                for s, p in pairs
            ],
            "elsewhere_seconds": round(time.perf_counter() - start, 4),
        }
        parts = []
        for s, p in pairs:
            there = "flag there too" if seen[p][0] else "flag nothing there"
            if twice:
                there = "agree there, run twice" if seen[p][1] else "disagree there too"
            mirror = f"; rank {p}'s micro-batches flag on rank {s}" if seen[s][0] else ""
            parts.append(f"rank {s}'s micro-batches, run on rank {p} ({self._host(p)}), {there}{mirror}")
        return confirmed, " (" + "; ".join(parts) + ")", fields

    def _flagged(self, trainer: pl.Trainer, monitor: TrainingHealthMonitor, losses: list[Tensor | None]) -> list[bool]:
        """Which of this rank's micro-batch losses (as passed to backward) the monitor flags alone. A HOST READ."""
        values = (
            torch.stack(
                [
                    (loss.float() * trainer.accumulate_grad_batches) if loss is not None else torch.zeros(())
                    for loss in losses
                ]
            )
            if losses
            else torch.zeros(0)
        )
        return [bool(b) for b in monitor.loss_flags(values).tolist()] if len(values) else []

    def _act(
        self,
        trainer: pl.Trainer,
        ledger: StepLedger,
        monitor: TrainingHealthMonitor,
        found: Attribution,
        losses: list[Tensor | None],
        nonfinite: bool,
        runs: int,
        seconds: float,
        note: str = "",
        elsewhere: dict[str, Any] | None = None,
    ) -> None:
        label = ledger.step_label
        step = trainer.global_step
        self.counts["replays"] += 1
        hosts = [self._host(r) for r in found.ranks]
        event: dict[str, Any] = {
            "step": label,
            "kind": "replay",
            "cause": found.cause.value,
            "ranks": list(found.ranks),
            "hosts": hosts,
            "runs": runs,
            "seconds": round(seconds, 4),
            "replay_faults": list(found.replay_faults),
            **{k: v for k, v in (elsewhere or {}).items() if k != "runs"},
        }
        where = ", ".join(f"rank {r} ({h})" for r, h in zip(found.ranks, hosts, strict=True))
        if found.cause is Cause.TRANSIENT:
            self.counts["faults"] += 1
            event["detail"] = (
                f"a transient fault on {where or 'a rank the gradients of every rank cannot name'}: the step was "
                f"replayed and applied as replayed ({seconds:.2f} s)"
            )
        elif found.cause is Cause.DATA:
            self.counts["data"] += 1
            count, bad = self._quarantine_bad(trainer, monitor, losses, step)
            event["quarantined"] = count
            dropped = self._apply_without(trainer, ledger, monitor, bad)
            if dropped is None:
                self._skip(ledger, nonfinite)
                done = "skipped"
            else:
                event["dropped_micro_batches"] = dropped
                done = f"applied without its bad micro-batch(es) {dropped} (rank, position)"
            seen = f"; a run also went wrong once on rank(s) {list(found.replay_faults)}" if found.replay_faults else ""
            event["detail"] = (
                f"the data: the step reproduces its flag{note}{seen}; {done}, {count} sample(s) quarantined "
                f"({seconds:.2f} s)"
            )
        elif found.cause is Cause.DEVICE:
            self.counts["devices"] += 1
            self._skip(ledger, nonfinite)
            event["detail"] = (
                f"a failing device: {where}{note}; the step is skipped, nothing quarantined, and the run stops after "
                f"a checkpoint ({seconds:.2f} s)"
            )
        else:
            self.counts["nondeterministic"] += 1
            self._skip(ledger, nonfinite)
            event["detail"] = (
                f"nondeterminism: no two of {runs} runs agree on rank(s) {list(found.ranks) or 'all (gradients)'}"
                f"{note}; skipped. Fix: torch.use_deterministic_algorithms(True), and draw random numbers in the "
                "training step from torch's generators, or StepReplay(rng_states='all') to replay NumPy's and "
                "Python's too"
            )
        monitor.record_event(ledger, event)  # in the stability report's events too
        rank_zero_warn(f"StepReplay: step {label}: {event['detail']}")
        for rank in found.faulty_ranks:
            self._count_fault(rank, step)
        if found.cause is Cause.DEVICE and self._failing is None:  # named at once: a repeat would fail alike
            rank = found.ranks[0]
            why = f"its micro-batches of step {label} flag on it, not on another rank with the same weights"
            self._failing = (rank, self._host(rank), list(self._faults[rank]), why)

    def _skip(self, ledger: StepLedger, nonfinite: bool) -> None:
        """Skip the step: no update, and the buffers its forwards changed put back (a NaN batch's BatchNorm
        statistics do not stay)."""
        ledger.mark_skip(Outcome.SKIPPED_NONFINITE if nonfinite else Outcome.SKIPPED_SPIKE, True)
        self.inputs.restore_buffers()

    def _apply_without(
        self, trainer: pl.Trainer, ledger: StepLedger, monitor: TrainingHealthMonitor, bad: list[list[bool]]
    ) -> list[tuple[int, int]] | None:
        """With accumulation, when the bad micro-batches are told apart and every rank keeps at least one: run the
        step again without them (its gradient the mean over the kept micro-batches) and keep it if it is no longer
        flagged. Returns the dropped ``(rank, position)`` pairs, or ``None``: the step is to be skipped."""
        if len(self.inputs.micro) < 2 or not any(any(r) for r in bad) or any(all(r) for r in bad):
            return None
        keep = [not b for b in bad[trainer.global_rank]]
        losses = rerun(trainer, ledger.step.optimizer, self.inputs, keep)
        ledger.step.regrad(_update_loss(losses, sum(keep)))
        nonfinite, loss_spike, _ = monitor.flags_on_host(ledger)  # HOST READ, on a replayed step only
        if nonfinite or loss_spike:
            return None
        return [(r, i) for r, flags in enumerate(bad) for i, b in enumerate(flags) if b]

    def _quarantine_bad(
        self, trainer: pl.Trainer, monitor: TrainingHealthMonitor, losses: list[Tensor | None], step: int
    ) -> tuple[int, list[list[bool]]]:
        """Quarantine the samples of the micro-batches whose own loss reproduces the flag, every rank's (all the
        step's micro-batches when none does alone: a gradient spike). Returns how many samples were new, and each
        rank's bad micro-batches (in rank order)."""
        micro = self.inputs.micro
        bad = self._flagged(trainer, monitor, losses)  # HOST READ, on a replayed step only
        mine = [
            (m.batch_idx, m.indices or [], bool(b)) for m, b in zip(micro, bad or [False] * len(micro), strict=True)
        ]
        everyone: list[Any] = gather_objects(mine)
        located = any(b for rank in everyone for _, _, b in rank)
        new = 0
        for rank, batches in enumerate(everyone):
            for batch_idx, indices, flagged in batches:
                if indices and (flagged or not located):
                    new += self.quarantine.add(
                        indices,
                        step=step,
                        epoch=trainer.current_epoch,
                        rank=rank,
                        batch_idx=batch_idx,
                        cause="non-finite or spiking loss" if flagged else "the step's gradients",
                    )
        if self.quarantine_file is not None and trainer.is_global_zero:
            self.quarantine.write(self._manifest_path(trainer))
        return new, [[flagged for _, _, flagged in batches] for batches in everyone]

    def _manifest_path(self, trainer: pl.Trainer) -> Path:
        path = Path(self.quarantine_file)  # type: ignore[arg-type]
        return path if path.is_absolute() else Path(trainer.default_root_dir) / path

    def _host(self, rank: int) -> str:
        return self._hosts[rank] if 0 <= rank < len(self._hosts) else "unknown host"

    # ------------------------------------------------------------------ failing devices
    def _count_fault(self, rank: int, step: int) -> None:
        seen = self._faults.setdefault(rank, deque())
        seen.append(step)
        while seen and seen[0] <= step - self.fault_window:
            seen.popleft()
        if len(seen) >= self.max_faults and self._failing is None:
            why = f"{len(seen)} faults within {self.fault_window} steps, max_faults={self.max_faults}"
            self._failing = (rank, self._host(rank), list(seen), why)

    def _stop(self, trainer: pl.Trainer) -> None:
        """Every rank, after the step of the last fault: save the state (healthy: the step was applied as
        replayed), then raise :class:`FailingDeviceError`."""
        assert self._failing is not None
        rank, host, steps, why = self._failing
        saved = save_now(trainer)  # where ckpt_path="last" finds it (StableCheckpoint: listed healthy)
        where = f"saved {saved}" if saved else "no checkpoint could be saved (no checkpoint callback)"
        incidents.record(
            trainer,
            "failing_device",
            f"rank {rank} on {host} computed wrong values at steps {steps}: {where}; stopped",
            lost="" if saved else "the steps since the newest checkpoint",
            detail=f"move the job off {host} and resume with ckpt_path='last'",
        )
        raise FailingDeviceError(
            f"StepReplay: rank {rank} on {host} computed wrong values at steps {steps} ({why}): a failing device. "
            f"{where}. Fix: move the "
            f"job off {host} (or that rank's GPU) and resume with trainer.fit(model, ckpt_path='last').",
            rank,
            host,
            steps,
            saved,
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "quarantine": self.quarantine.state_dict(),
            "counts": dict(self.counts),
            "faults": {str(r): list(s) for r, s in self._faults.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.quarantine.load_state_dict(state_dict.get("quarantine", {}))
        self.counts.update({k: int(v) for k, v in state_dict.get("counts", {}).items()})
        self._faults = {int(r): deque(int(s) for s in steps) for r, steps in state_dict.get("faults", {}).items()}

    def transient_state(self) -> dict[str, Any]:
        return {"inputs": StepInputs(self.rng_states == "all"), "_monitor": None, "_sampler": None, "_flags": None}


def _update_loss(losses: list[Tensor | None], normalize: int) -> Tensor | None:
    """The update's loss as ``ledger.step.loss`` holds it (the ledger's own ``StepLoss``): the mean of the
    micro-batches' losses, each times ``normalize``, the factor it was divided by."""
    total = StepLoss()
    for loss in losses:
        if loss is not None:
            total.add(loss, None, normalize)
    return total.take()
