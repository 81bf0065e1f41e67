"""GradientNormMonitor: measure the global gradient norm once per optimizer step; clip; skip non-finite steps.

Also the replica check (``check_replicas=True``): the norm of each rank's local gradients gathered on logging
steps and compared among the ranks that must hold the same gradients (the data-parallel replicas; under tensor
parallelism the ranks of one tensor-parallel coordinate), and a warning naming a rank that disagrees, a cheap
detector of a faulty device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_stability.amp.diagnostics import fp16_without_scaler_problem
from lightning_stability.cluster.weight_hash import gather_from_ranks, keeps_plain_parameters_equal, replica_layout
from lightning_stability.errors import (
    StabilityConfigError,
    check_bool,
    check_instance,
    check_int,
    check_number,
    config_error,
)
from lightning_stability.ledger import (
    LedgerCallback,
    OnHost,
    OptimizerRecord,
    Outcome,
    StepGradients,
    StepLedger,
    loss_scaler,
)
from lightning_stability.norms import group_norms, local_tensor, module_groups, total_norm

_K_STEPS = "grad_norm_monitor/steps"
_K_CLIPPED = "grad_norm_monitor/clipped"


def _parse_norm_type(norm_type: float | str) -> float:
    check_instance("norm_type", norm_type, (int, float, str), "a norm order", "2.0, 1.0, 'inf' or any p > 0")
    if isinstance(norm_type, str):
        if norm_type.lower() not in ("inf", "+inf"):
            raise config_error("norm_type", norm_type, "is not a norm order", "pass 2.0, 1.0, 'inf' or any p > 0")
        return math.inf
    return check_number(
        "norm_type", norm_type, 0.0, example="2.0 (Euclidean, the usual choice) or 'inf'", high_inclusive=True
    )


class GradientNormMonitor(LedgerCallback):
    """Measure, and optionally clip, the gradient norm of the whole model once per optimizer step.

    The norm is taken in ``on_before_optimizer_step``, after every accumulated micro-batch and fp16 unscaling,
    before the update. It is the whole model's norm: identical on every rank under DDP, reduced across shards for
    sharded (``DTensor``) parameters. Clipping multiplies every gradient by ``min(1, max_norm / (norm + 1e-6))``,
    ``torch.nn.utils.clip_grad_norm_``'s coefficient. A step whose norm is NaN or inf is skipped on every rank
    (weights and optimizer state left exactly as they were), and a warning names the first module with a
    non-finite gradient. All of it stays on the device: a step that does not log adds no host sync. With several
    optimizers each is measured, clipped, skipped and logged on its own (keys end in ``/<optimizer>``).

    Logged keys (to every logger on logging steps; scalars also in ``trainer.callback_metrics`` every step):

    ============================================  ===========================================================
    Key                                           Meaning
    ============================================  ===========================================================
    ``stability/grad_norm``                       global gradient norm before clipping (this step)
    ``stability/grad_norm_clipped``               norm after clipping (only with ``max_norm``)
    ``stability/clip_coef``                       clip coefficient, ``<= 1`` (only with ``max_norm``)
    ``stability/clip_fraction``                   share of steps clipped since the last log (``max_norm``)
    ``stability/skipped_steps``                   optimizer steps skipped since the start, for any reason
    ``stability/grad_norm_by_module/<module>``    per-module norm (with ``per_layer``; top-k with an int)
    ============================================  ===========================================================

    Args:
        max_norm: clip the global norm to this value; ``None`` measures only.
        norm_type: the p of the p-norm: ``2.0``, ``1.0``, ``float('inf')`` (or ``'inf'``), any p > 0.
        log_every_n_steps: log every this many optimizer steps; default: the Trainer's.
        per_layer: ``False`` (off), ``True`` (every module that owns parameters) or an int ``k`` (the
            ``k`` modules with the largest norm at that step).
        skip_nonfinite: skip the update when the gradient norm is NaN/inf (the decision is max-reduced across
            ranks: one 0-dim all-reduce per step).
        warn_top_k: how many of the largest layers the non-finite warning names.
        check_replicas: on logging steps, compare the norms of the ranks that must hold the same gradients (the
            data-parallel replicas) and warn naming a rank that disagrees: a cheap detector of a faulty device.

    Raises:
        StabilityConfigError: for a bad argument, or at ``setup`` when the Trainer also clips with
            ``gradient_clip_val`` or runs a strategy whose gradients this callback cannot see whole (Lightning's
            ``FSDPStrategy``, ``DeepSpeedStrategy``).

    Example::

        trainer = L.Trainer(callbacks=[GradientNormMonitor(max_norm=1.0)])
    """

    one_instance_reason = "each would measure, clip and skip the same step and log the same keys"

    def __init__(
        self,
        max_norm: float | None = None,
        norm_type: float | str = 2.0,
        log_every_n_steps: int | None = None,
        per_layer: bool | int = False,
        skip_nonfinite: bool = True,
        warn_top_k: int = 3,
        check_replicas: bool = False,
    ) -> None:
        super().__init__(log_every_n_steps)
        if max_norm is not None:
            example = "1.0 (BERT-like), 0.5 (GPT-like) or 2.0 (mixture of experts), or None to only measure"
            check_number("max_norm", max_norm, 0.0, example=example)
        if not isinstance(per_layer, bool):
            check_int("per_layer", per_layer, 1, "per_layer=True (every module) or 5 (the 5 largest norms), or False")
        check_bool("skip_nonfinite", skip_nonfinite)
        check_bool("check_replicas", check_replicas)
        check_int("warn_top_k", warn_top_k, 0, "3")
        self.max_norm = None if max_norm is None else float(max_norm)
        self.norm_type = _parse_norm_type(norm_type)
        self.per_layer = per_layer
        self.skip_nonfinite = skip_nonfinite
        self.warn_top_k = warn_top_k
        self.check_replicas = check_replicas
        self._names: dict[int, str] = {}
        self._layers: dict[int, _Layers] = {}  # per optimizer (track index)
        self._reports: dict[int, _Report] = {}  # per optimizer: what a logging step sent, read in on_host
        self._scaler_skips = False
        self._replica_groups: tuple[int, ...] | None = None  # which ranks must hold equal local gradients

    def state_fields(self) -> dict[str, Any]:
        return {"max_norm": self.max_norm, "norm_type": self.norm_type}

    # ------------------------------------------------------------------ setup
    def on_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.max_norm is not None and trainer.gradient_clip_val:
            raise StabilityConfigError(
                f"GradientNormMonitor(max_norm={self.max_norm}) and Trainer(gradient_clip_val="
                f"{trainer.gradient_clip_val}) would clip twice. Fix: remove `gradient_clip_val` from the Trainer, "
                "or pass `max_norm=None` to GradientNormMonitor to only measure."
            )
        problem = fp16_without_scaler_problem(trainer)
        if problem is not None:
            raise StabilityConfigError(problem)
        if getattr(trainer.strategy, "gradients_are_local_shards", False):  # backend="fairscale"
            raise StabilityConfigError(
                f"GradientNormMonitor cannot measure the global norm under {type(trainer.strategy).__name__}: its "
                "gradients are flat local shards. Fix: use StableFSDPStrategy(backend='native') (FSDP2), Lightning's "
                "ModelParallelStrategy or DDP; or drop GradientNormMonitor and clip with "
                "Trainer(gradient_clip_val=...), which the strategy applies with its own clip (FairScale's "
                "clip_grad_norm_)."
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._names = {id(p): name for name, p in pl_module.named_parameters()}
        self._scaler_skips = loss_scaler(trainer) is not None
        self._layers = {}
        self._replica_groups = None
        if self.check_replicas and trainer.world_size > 1:
            layout = replica_layout(
                list(pl_module.parameters()), trainer.world_size, keeps_plain_parameters_equal(trainer.strategy)
            )
            self._replica_groups = None if isinstance(layout, str) else layout.groups

    # ------------------------------------------------------------------ the step
    def _layers_of(self, ledger: StepLedger, gradients: StepGradients, device: torch.device) -> _Layers:
        index = ledger.record_of().index
        layers = self._layers.get(index)
        key = gradients.key
        if layers is None or layers.key != key:
            groups, names = module_groups(gradients.params, self._names)
            layers = self._layers[index] = _Layers(key, torch.tensor(groups, dtype=torch.int64, device=device), names)
        return layers

    def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: Optimizer) -> None:
        gradients = ledger.gradients(self.norm_type)  # computed once per step, shared with other callbacks
        params, norms, total = gradients.params, gradients.norms, gradients.total
        self._gradients = gradients if params else None
        # known finite on every rank (StepReplay's early read, alike on every rank): no all-reduce, a host vote
        known_finite = ledger.step.known_finite
        if not params:
            if self.skip_nonfinite and not known_finite:  # every rank joins the all-reduce, also one without gradients
                ledger.any_rank(torch.zeros((), dtype=torch.bool, device=total.device))
            return
        bad = (total - total) != 0  # NaN or inf
        if self.skip_nonfinite and not known_finite:
            # A gradient can go bad on one rank after the data-parallel all-reduce (a hook that edits it, a
            # faulty device): one 0-dim all-reduce makes every rank see, and skip, the same step.
            bad = ledger.any_rank(bad)
        ledger.step.grad_norm = total
        record = ledger.record_of()
        record.accumulate(_K_STEPS, 1.0)
        self.record_metric("stability/grad_norm", total)
        replica_norm = self._replica_norm(trainer, gradients) if self.is_logging_step else None
        if self.max_norm is not None:
            # relative to another callback's clip, if one came first; the metrics after the step, once every
            # clip is done
            ledger.step.clip_coef = gradients.clip_(self.max_norm)
        layers = self._layers_of(ledger, gradients, norms.device)
        layers.remember_first_bad(bad, norms)
        if self.skip_nonfinite:
            # Under fp16 the vote joins the loss scaler's own overflow decision: no extra sync.
            ledger.mark_skip(Outcome.SKIPPED_NONFINITE, False if known_finite else bad)
        if self.is_logging_step:
            layer_norms = group_norms(norms, layers.index, len(layers.names), self.norm_type)
            every, top = self._send_layers(layer_norms)
            replicas = self.to_host(gather_from_ranks(replica_norm)) if replica_norm is not None else None
            self._reports[record.index] = _Report(every, top, replicas, self._send_bad_report(layers))

    def _replica_norm(self, trainer: pl.Trainer, gradients: StepGradients) -> Tensor | None:
        """What the replica check compares: the norm of this rank's own gradient shards, before this step's clips
        (a clip's coefficient comes from the global norm, which one rank's fault changes on every rank it is
        reduced with), when the ranks that must hold the same shards are known; else the global norm."""
        if not self.check_replicas or trainer.world_size < 2:
            return None
        if self._replica_groups is None:
            return gradients.total
        local = total_norm([local_tensor(g) for g in gradients.grads], self.norm_type)  # a few kernels
        return local / gradients.coefficient

    def after_step(self, trainer: pl.Trainer, ledger: StepLedger) -> None:
        gradients, self._gradients = self._gradients, None
        if gradients is None:
            return
        record = ledger.record_of()
        if self.max_norm is not None:
            # every clip applied to the step: this one's and, e.g., the health monitor's adaptive one
            coef = gradients.coefficient
            record.accumulate(_K_CLIPPED, coef < 1.0)
            self.record_metric("stability/grad_norm_clipped", gradients.current)
            self.record_metric("stability/clip_coef", coef)
            if self.is_logging_step:
                steps = record.pop_window(_K_STEPS)
                self.record_metric("stability/clip_fraction", record.pop_window(_K_CLIPPED) / steps.clamp(min=1.0))
        # counted now that the step closed, so this step's outcome is included
        self.record_metric("stability/skipped_steps", record.skipped_steps)

    def _send_layers(self, layer_norms: Tensor) -> tuple[OnHost | None, tuple[OnHost, OnHost] | None]:
        """Every module's norm (``per_layer=True``), or the k largest with their module indices."""
        if self.per_layer is True:
            return self.to_host(layer_norms), None
        if not self.per_layer:
            return None, None
        k = min(int(self.per_layer), layer_norms.numel())
        top = torch.topk(torch.nan_to_num(layer_norms, nan=math.inf), k)
        return None, (self.to_host(layer_norms[top.indices]), self.to_host(top.indices))

    def _send_bad_report(self, layers: _Layers) -> _BadReport | None:
        if layers.bad_seen is None or layers.bad_snapshot is None:
            return None
        snap = layers.bad_layer_norms(self.norm_type)
        finite = torch.isfinite(snap)
        seen = self.to_host(layers.bad_seen)
        first = self.to_host(torch.argmax((~finite).to(torch.int32)))
        count = self.to_host((~finite).sum())
        k = min(self.warn_top_k, snap.numel())
        largest = None
        if k:
            top = torch.topk(torch.where(finite, snap, -1.0), k)
            largest = (self.to_host(top.values), self.to_host(top.indices))
        layers.bad_seen = torch.zeros_like(layers.bad_seen)
        return _BadReport(seen, first, count, largest)

    def on_host(self, trainer: pl.Trainer, record: OptimizerRecord) -> dict[str, float]:
        report = self._reports.pop(record.index, None)
        if report is None:
            return {}
        names, step = self._layers[record.index].names, record.steps
        extra: dict[str, float] = {}
        if report.layers is not None:
            layers = zip(names, report.layers.numbers(), strict=True)
            extra.update({f"stability/grad_norm_by_module/{n}": v for n, v in layers})
        if report.top is not None:
            values, indices = (sent.numbers() for sent in report.top)
            top = zip(indices, values, strict=True)
            extra.update({f"stability/grad_norm_by_module/{names[int(i)]}": v for i, v in top})
        if report.replicas is not None:
            warn_disagreeing_replicas(report.replicas.numbers(), step, groups=self._replica_groups)
        if report.bad is not None and report.bad.seen.number():
            self._warn_nonfinite(report.bad, names)
        return extra

    def _warn_nonfinite(self, bad: _BadReport, names: list[str]) -> None:
        first = names[int(bad.first.number())]
        values, indices = (bad.top[0].numbers(), bad.top[1].numbers()) if bad.top is not None else ([], [])
        top = ", ".join(f"{names[int(i)]}={v:.3g}" for i, v in zip(indices, values, strict=True) if v >= 0)
        count = int(bad.modules.number())
        if self._scaler_skips:
            action = "skipped by the fp16 loss scaler"
        else:
            action = "skipped" if self.skip_nonfinite else "NOT skipped (skip_nonfinite=False)"
        if count == 0:
            # The flag came from another rank through the all-reduce: this rank's own gradients were finite.
            rank_zero_warn(
                f"Non-finite gradient norm on another rank: the update was {action} on every rank, though this "
                "rank's gradients were finite. A gradient that goes bad on one rank only, after the all-reduce, "
                "points to a faulty device or a hook that edits one rank's gradients; "
                "GradientNormMonitor(check_replicas=True) names the rank.",
                category=RuntimeWarning,
            )
            return
        # Every rank saw the same global norms: warn once, not once per process.
        rank_zero_warn(
            f"Non-finite gradient norm: the update was {action}. First module with a non-finite gradient: "
            f"'{first}' ({count} of {len(names)} modules non-finite). Largest finite gradient norms at that "
            f"step: {top or 'none'}. An explosion usually starts in the first module named; lower the "
            "learning rate or clip harder (max_norm).",
            category=RuntimeWarning,
        )

    # ------------------------------------------------------------------ after the step
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Report a non-finite step that happened after the last logging step.
        ledger = StepLedger.of(trainer)
        for index, layers in self._layers.items():
            if layers.bad_seen is not None and index < len(trainer.optimizers):
                ledger.select(trainer.optimizers[index])
                self._reports[index] = _Report(None, None, None, self._send_bad_report(layers))
        ledger.flush()

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"max_norm": self.max_norm, "norm_type": self.norm_type}

    def transient_state(self) -> dict[str, Any]:
        return {"_layers": {}, "_reports": {}, "_names": {}, "_replica_groups": None}


class _BadReport(NamedTuple):
    """The first non-finite step since the last report, on its way to the host."""

    seen: OnHost  # whether there was one
    first: OnHost  # the first module with a non-finite norm
    modules: OnHost  # how many modules had one
    top: tuple[OnHost, OnHost] | None  # the largest finite module norms at that step, and their modules


class _Report(NamedTuple):
    """What a logging step sends to the host for one optimizer, read back in ``on_host``."""

    layers: OnHost | None  # every module's norm (per_layer=True)
    top: tuple[OnHost, OnHost] | None  # the k largest module norms and their modules (per_layer=k)
    replicas: OnHost | None  # every rank's norm (check_replicas=True)
    bad: _BadReport | None


class _Layers:
    """One optimizer's parameters grouped by module, and its first non-finite step's per-module norms."""

    def __init__(self, key: tuple[int, ...], index: Tensor, names: list[str]) -> None:
        self.key, self.index, self.names = key, index, names
        self.bad_seen: Tensor | None = None
        self.bad_snapshot: Tensor | None = None

    def remember_first_bad(self, bad: Tensor, norms: Tensor) -> None:
        """Keep the per-tensor norms of the first step with ``bad`` set since the last report (two kernels)."""
        if self.bad_seen is None or self.bad_snapshot is None:
            self.bad_seen = torch.zeros((), dtype=torch.bool, device=bad.device)
            self.bad_snapshot = norms
        self.bad_snapshot = torch.where(self.bad_seen, self.bad_snapshot, norms)
        self.bad_seen = self.bad_seen | bad

    def bad_layer_norms(self, norm_type: float) -> Tensor:
        """The per-module norms of the remembered step."""
        assert self.bad_snapshot is not None
        return group_norms(self.bad_snapshot, self.index, len(self.names), norm_type)


def warn_disagreeing_replicas(
    norms: list[float], step: int, rel_tol: float = 1e-5, groups: Sequence[int] | None = None
) -> None:
    """Warn, naming the ranks, when data-parallel replicas measured different gradient norms.

    Replicas hold identical gradients after the all-reduce (and sharded norms are reduced across the mesh),
    so every rank measures the same global norm. A rank that differs computed or received other gradients:
    a faulty device (silent data corruption) or a hook that changed one rank's gradients. Its weights will
    drift from the others'. ``groups``: one group id per rank, the ranks of a group compared with each other
    only (``norms`` then the norms of each rank's local shards); ``None``: all ranks. Within a group the
    reference is the value a strict majority of its ranks agree on, or else its first rank's.
    """

    def same(a: float, b: float) -> bool:
        return a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= rel_tol * max(abs(a), abs(b)))

    ids = list(groups) if groups is not None else [0] * len(norms)
    bad: list[str] = []
    for group in sorted(set(ids)):
        members = [r for r, g in enumerate(ids) if g == group]
        values = [norms[r] for r in members]
        majority = [v for v in values if sum(same(v, w) for w in values) * 2 > len(values)]
        reference, source = (majority[0], "most") if majority else (values[0], f"rank {members[0]} (no majority)")
        for rank in members:
            if not same(norms[rank], reference):
                if groups is None:
                    where = f"{'most ranks' if majority else source} measured {reference:.6g}"
                else:
                    others = ", ".join(str(m) for m in members if m != rank)
                    where = f"its replicas (ranks {others}): {'most' if majority else source} {reference:.6g}"
                bad.append(f"rank {rank}: {norms[rank]:.6g} ({where})")
    if bad:
        what = "the norms of their local gradient shards, " if groups is not None else ""
        rank_zero_warn(
            f"Gradient norms disagree across data-parallel replicas at optimizer step {step} ({what}compared "
            f"among the ranks that must hold the same gradients): {'; '.join(bad)}. Replicas hold the same "
            "all-reduced gradients, so the rank(s) named computed or received different gradients: a faulty "
            "device (silent data corruption) or a hook that edits one rank's gradients. Their weights will drift "
            "apart. Fix: check that device (rerun the step there, run a GPU memory test) or the hook.",
            category=RuntimeWarning,
        )
