"""ClusterHealthMonitor: straggler figures on logging steps, and a weight-hash check across data-parallel replicas
every N steps; the Lightning adapter of :mod:`~lightning_stability.cluster.stragglers` and
:mod:`~lightning_stability.cluster.weight_hash`."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability import incidents
from lightning_stability.cluster.stragglers import StepTimer, straggler_figures, straggler_message
from lightning_stability.cluster.weight_hash import (
    ReplicaLayout,
    disagreeing_replicas,
    gather_fingerprints,
    gather_from_ranks,
    keeps_plain_parameters_equal,
    replica_layout,
    weight_fingerprint,
)
from lightning_stability.errors import check_int, check_number
from lightning_stability.ledger import LedgerCallback, OnHost, OptimizerRecord, StepLedger


class ClusterHealthMonitor(LedgerCallback):
    """The cheap checks of a sick cluster: which rank is slow, and whether replicas still hold the same weights.

    **Straggler figures** (``straggler_factor``), on logging steps. Each rank times, on the host clock only, the
    span of each step before its gradient sync: from the end of the previous step (so fetching the batch counts)
    to the backward of the step's last micro-batch. The whole step cannot name anyone: under synchronous data
    parallelism every rank waits for the slowest inside the all-reduce, so all whole steps last the same. On a
    logging step the mean over the steps since the last log is all-gathered (one all-gather of one float per
    rank, its result riding the step's one transfer), and min / median / max over ranks are logged. The
    slowest rank is named in a warning when it took more than ``straggler_factor`` x the median (lower median:
    with two ranks, the other rank) and at least ``straggler_min_gap_s`` longer.

    What a host timer measures on a GPU: the host runs ahead of the device, enqueueing kernels, until something
    makes it wait (a ``.item()``, a copy to the host, the allocator, a full launch queue). The span holds the
    host's work (data loading, Python, launches) and the waits that fall inside it; a GPU that computes slowly
    shows only once the host waits for it there. No device sync is added to measure it. For device time use CUDA
    events or a profiler (Megatron-LM's ``StragglerDetector``).

    **Weight-hash check** (``weight_hash_every=N``, default off; Megatron-LM's
    ``--check-weight-hash-across-dp-replicas-interval``). Every N optimizer steps, after the update, each rank
    computes an exact fingerprint of its local parameters on the device (their bits as integers, summed and
    summed squared in int64: a few kernels per tensor) and the fingerprints are all-gathered (one all-gather of
    two int64 per rank), on that step only. They reach the host with the next logging step's transfer (no sync
    of their own: make N a multiple of ``log_every_n_steps`` to hear on the check step itself), and ranks that
    must be equal but are not are named in a warning: silent data corruption. Which ranks must be equal: every
    rank under DDP; under ``DTensor`` parameters (FSDP2, tensor parallelism), the ranks that differ only along
    mesh dims where every parameter is ``Replicate`` (hybrid sharding's ``"replicate"`` dim; the data-parallel
    ranks of one tensor-parallel rank when the data-parallel dim replicates). A layout with no such ranks (fully
    sharded: every shard differs) or not covered is said in one info line at fit start, and the check skipped.
    Parameters only (not buffers).

    Logged keys (to every Lightning logger on logging steps; also in ``trainer.callback_metrics``):

    ==================================  ===========================================================
    Key                                 Meaning
    ==================================  ===========================================================
    ``stability/step_time``             this rank's whole step, host seconds, mean since the last log
    ``stability/rank_time_min``         fastest rank's time before its gradient sync (mean per step)
    ``stability/rank_time_median``      the median over ranks of that time
    ``stability/rank_time_max``         the slowest rank's
    ``stability/slowest_rank``          the slowest rank
    ``stability/replicas_differing``    ranks whose weights differ from their replicas' (last check)
    ==================================  ===========================================================

    Args:
        straggler_factor: warn naming the slowest rank when it took more than this times the median; ``None``
            turns the straggler figures off (no all-gather).
        weight_hash_every: check the replicas' weights every this many optimizer steps; ``None``: off.
        straggler_min_gap_s: warn only when the slowest rank is also at least this many seconds per step slower
            than the median (timer noise on very short steps).
        log_every_n_steps: log every this many optimizer steps; default: the Trainer's.

    Raises:
        StabilityConfigError: for a bad argument.

    Example::

        trainer = L.Trainer(strategy="ddp", callbacks=[ClusterHealthMonitor(weight_hash_every=1000)])
    """

    one_instance_reason = "each would gather the same figures and run the same checks"

    def __init__(
        self,
        straggler_factor: float | None = 1.5,
        weight_hash_every: int | None = None,
        straggler_min_gap_s: float = 0.01,
        log_every_n_steps: int | None = None,
    ) -> None:
        super().__init__(log_every_n_steps)
        if straggler_factor is not None:
            check_number("straggler_factor", straggler_factor, 1.0, example="1.5 (or None to turn it off)")
        if weight_hash_every is not None:
            check_int("weight_hash_every", weight_hash_every, 1, "weight_hash_every=1000, or None for off")
        check_number("straggler_min_gap_s", straggler_min_gap_s, 0.0, example="0.01", low_inclusive=True)
        self.straggler_factor = None if straggler_factor is None else float(straggler_factor)
        self.weight_hash_every = weight_hash_every
        self.straggler_min_gap_s = float(straggler_min_gap_s)
        self._timer = StepTimer()
        self._layout: ReplicaLayout | None = None
        self._pending: list[tuple[int, Tensor]] = []  # (optimizer step, gathered fingerprints) not yet sent
        # sent on a logging step, read in on_host, per optimizer (record index): every rank's own time of the
        # step; the checks' (optimizer step, gathered fingerprints)
        self._sent_times: dict[int, OnHost] = {}
        self._sent_hashes: dict[int, list[tuple[int, OnHost]]] = {}
        self._last_clean: int | None = None  # the last checked step at which every replica agreed

    # ------------------------------------------------------------------ setup
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._timer = StepTimer()
        self._pending, self._layout, self._last_clean = [], None, None
        self._sent_times, self._sent_hashes = {}, {}
        if self.weight_hash_every is None:
            return
        strategy = trainer.strategy
        layout = replica_layout(
            list(pl_module.parameters()), trainer.world_size, keeps_plain_parameters_equal(strategy)
        )
        if isinstance(layout, str):
            rank_zero_info(
                f"ClusterHealthMonitor(weight_hash_every={self.weight_hash_every}): the weight-hash check is off "
                f"under {type(strategy).__name__}: {layout}."
            )
            return
        self._layout = layout

    # ------------------------------------------------------------------ step boundaries (host clock only)
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._timer.batch_start()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        super().on_before_backward(trainer, pl_module, loss)
        self._timer.backward()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # closes and flushes the step
        self._timer.batch_end()

    # validation, a checkpoint save or an epoch's start may wait for other ranks: not this rank's own time
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._timer.break_interval()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._timer.break_interval()

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        self._timer.break_interval()

    # ------------------------------------------------------------------ the step
    def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: Optimizer) -> None:
        first = self._timer.optimizer_step()
        if not (first and self.is_logging_step):
            return
        step_time = self._timer.take_step()
        if step_time is not None:
            self.record_metric("stability/step_time", step_time)
        own = self._timer.take_own()
        if self.straggler_factor is None:
            return
        # a fill from a host float (no host-to-device copy), on logging steps only
        value = math.nan if own is None else own
        mine = torch.full((), value, dtype=torch.float32, device=trainer.strategy.root_device)
        times = gather_from_ranks(mine) if trainer.world_size > 1 else mine.reshape(1)
        self._sent_times[ledger.record_of().index] = self.to_host(times)

    def after_step(self, trainer: pl.Trainer, ledger: StepLedger) -> None:
        if self._layout is None or self.weight_hash_every is None:
            return
        record = ledger.record_of()
        if record.index == 0 and record.steps % self.weight_hash_every == 0:  # after the update
            module = trainer.lightning_module
            fingerprint = weight_fingerprint(module.parameters(), trainer.strategy.root_device)
            self._pending.append((record.steps, gather_fingerprints(fingerprint)))
        if self.is_logging_step:
            self._send_pending(ledger.record_of().index)

    def _send_pending(self, index: int) -> None:
        sent = self._sent_hashes.setdefault(index, [])
        sent += [(step, self.to_host(gathered)) for step, gathered in self._pending]
        self._pending = []

    # ------------------------------------------------------------------ on the host
    def on_host(self, trainer: pl.Trainer, record: OptimizerRecord) -> dict[str, float]:
        extra: dict[str, float] = {}
        sent_times = self._sent_times.pop(record.index, None)
        if sent_times is not None:
            times = sent_times.numbers()
            figures = straggler_figures(times)
            if figures.slowest >= 0:
                extra.update(
                    {
                        "stability/rank_time_min": figures.minimum,
                        "stability/rank_time_median": figures.median,
                        "stability/rank_time_max": figures.maximum,
                        "stability/slowest_rank": float(figures.slowest),
                    }
                )
                factor = self.straggler_factor
                if len(times) > 1 and factor is not None and figures.straggles(factor, self.straggler_min_gap_s):
                    message = straggler_message(figures, factor, record.steps, len(times))
                    rank_zero_warn(message, category=RuntimeWarning)
                    incidents.record(
                        trainer,
                        "straggler",
                        f"warned: rank {figures.slowest} was the slowest",
                        lost="step time (every rank waits for the slowest at each gradient sync)",
                        detail=message,
                    )
        checks = self._sent_hashes.pop(record.index, [])
        for step, sent in checks:
            assert self._layout is not None
            flat = sent.numbers()
            prints = [flat[i : i + 2] for i in range(0, len(flat), 2)]
            differing = disagreeing_replicas(prints, self._layout)
            extra["stability/replicas_differing"] = float(len(differing))
            if differing:
                self._warn_differing(step, differing)
                incidents.record(
                    trainer,
                    "replicas_differ",
                    "warned: weights differ across data-parallel replicas",
                    lost="the steps since the last clean check may be corrupted",
                    detail=f"ranks {sorted(differing)} hold weights their replicas do not",
                    step=step,
                )
            else:
                self._last_clean = step
        return extra

    def _warn_differing(self, step: int, differing: dict[int, list[int]]) -> None:
        assert self._layout is not None
        named = "; ".join(
            f"rank {r} (its replicas: ranks {', '.join(str(m) for m in members if m != r)})"
            for r, members in differing.items()
        )
        clean = (
            f"the last check that found them equal was at step {self._last_clean}"
            if self._last_clean is not None
            else "no earlier check found them equal"
        )
        rank_zero_warn(
            f"Weights differ across data-parallel replicas at optimizer step {step} (weight-hash check; "
            f"{self._layout.what}): {named}; {clean}. Replicas start equal and apply the same all-reduced "
            "update, so the rank(s) named hold corrupted weights: silent data corruption (a faulty GPU, its memory "
            "or link) or code that changes one rank's weights (a rank-dependent init or seed, a callback editing "
            "weights on one rank). They will keep drifting apart. Fix: test that device (DCGM diagnostics, rerun "
            "on that node) and resume from a checkpoint saved at or before the last clean check, without that node.",
            category=RuntimeWarning,
        )

    # ------------------------------------------------------------------ after training
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a check run after the last logging step is read now, not lost
        if self._pending and trainer.optimizers:
            ledger = StepLedger.of(trainer)
            ledger.select(trainer.optimizers[0])
            self._send_pending(ledger.record_of().index)
            ledger.flush()

    def transient_state(self) -> dict[str, Any]:
        return {
            "_timer": StepTimer(),
            "_layout": None,
            "_pending": [],
            "_sent_times": {},
            "_sent_hashes": {},
            "_last_clean": None,
        }
