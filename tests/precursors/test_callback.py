"""PrecursorMonitor in real Lightning fits: its metrics, its host syncs, and each early action's invariant."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_stability import TrainingHealthMonitor
from lightning_stability.errors import StabilityConfigError
from lightning_stability.ledger import Outcome, StepLedger
from lightning_stability.precursors import AttentionLogits
from lightning_stability.precursors.callback import LRBackoff, PrecursorMonitor
from tests.helpers import count_host_data_per_step, count_syncs_per_step, quiet_trainer
from tests.precursors.tiny_lm import VOCAB, WIDTH, TinyLM, fresh


class Snapshots(pl.Callback):
    """The weights and the ledger's outcome after every batch (host copies: tests only)."""

    def __init__(self) -> None:
        self.weights: list[dict[str, Tensor]] = []
        self.outcomes: list[int] = []
        self.module_lr: float | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.weights.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})
        self.outcomes.append(int(StepLedger.of(trainer).outcome))
        self.module_lr = trainer.optimizers[0].param_groups[0]["lr"]


class SkipAt(pl.Callback):
    """Votes to skip the update of the given optimizer steps (as a health monitor would)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step in self.steps:
            StepLedger.of(trainer).mark_skip(Outcome.SKIPPED_SPIKE, True, optimizer)


# ---------------------------------------------------------------------------------------------- metrics, syncs
def test_the_precursors_are_logged_on_logging_steps(tmp_path: Path) -> None:
    trainer = quiet_trainer(
        max_steps=8, log_every_n_steps=4, logger=CSVLogger(tmp_path), callbacks=[PrecursorMonitor()]
    )
    trainer.fit(fresh())
    rows = (Path(trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()  # type: ignore[union-attr]
    header = rows[0].split(",")
    for key in (
        "stability/attention_logit_max",
        "stability/attention_logit_max_by_module/block.self_attn",
        "stability/log_z",
        "stability/log_z_drift",
        "stability/update_rms_max",
        "stability/adam_eps_share",
        "stability/update_ratio",
    ):
        assert key in header, key
    logged = [dict(zip(header, r.split(","), strict=True)) for r in rows[1:]]
    values = [float(r["stability/update_ratio"]) for r in logged if r["stability/update_ratio"]]
    assert len(values) == 2 and all(0 < v < 1 for v in values)  # steps 4 and 8 (labels 3 and 7)


def test_the_logged_max_attention_logit_is_the_one_the_model_computes(tmp_path: Path) -> None:
    """At a logging step the metric equals the largest logit recomputed by AttentionLogits on the same batch."""
    monitor = PrecursorMonitor(log_partition=False)
    trainer = quiet_trainer(max_steps=1, log_every_n_steps=1, callbacks=[monitor])
    module = fresh()
    batch = next(iter(module.train_dataloader()))
    reference = AttentionLogits(module)
    with torch.no_grad():
        module(batch[:, :-1])  # the weights before the step: the forward of step 1 sees these
    expected = float(reference.per_layer().max())
    reference.remove()
    trainer.fit(module)
    assert float(trainer.callback_metrics["stability/attention_logit_max"]) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"qk_clip": 100.0, "update_clip": 1.0, "lr_backoff": LRBackoff(), "reset_moments": True},
    ],
    ids=["monitor", "every-action"],
)
def test_no_host_sync_is_added_to_any_step(options: dict[str, Any]) -> None:
    """Counted against a fit without the monitor, step by step, logging steps (every 4th) included: the one
    transfer of a logging step carries the precursors too."""
    health = {"callbacks": [TrainingHealthMonitor(report=False)]}
    bare = count_syncs_per_step(quiet_trainer(max_steps=8, log_every_n_steps=4, **health), fresh())
    monitor = PrecursorMonitor(**options)
    callbacks = [TrainingHealthMonitor(report=False), monitor]
    watched = count_syncs_per_step(quiet_trainer(max_steps=8, log_every_n_steps=4, callbacks=callbacks), fresh())
    assert watched == bare


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused-adamw"])
def test_the_backoff_reads_its_factor_once_per_step_only_without_a_vote_read_to_ride(fused: bool) -> None:
    """The factor lives on the device. A fused AdamW takes it as a tensor LR: no read. Another optimizer needs a
    host number: with the health monitor's votes it rides their one read (no sync added, above); with no vote to
    ride, it is exactly one read per step (the one HOST SYNC the update scale adds, ``ledger/step.py``)."""
    options = {"fused": True} if fused else {}
    bare = count_syncs_per_step(quiet_trainer(max_steps=8, log_every_n_steps=4), fresh(**options))
    monitor = PrecursorMonitor(attention=False, log_partition=False, lr_backoff=LRBackoff())
    watched = count_syncs_per_step(
        quiet_trainer(max_steps=8, log_every_n_steps=4, callbacks=[monitor]), fresh(**options)
    )
    non_logging = [i for i in range(8) if (i + 1) % 4 != 0]
    assert [watched[i] - bare[i] for i in non_logging] == [0 if fused else 1] * len(non_logging)


def test_no_tensor_is_made_from_host_data_on_non_logging_steps() -> None:
    """On a GPU such a tensor is a blocking copy; after the first step none is made on a step that does not log."""
    bare = count_host_data_per_step(quiet_trainer(max_steps=7, log_every_n_steps=4), fresh())
    monitor = PrecursorMonitor(qk_clip=100.0, update_clip=1.0, lr_backoff=LRBackoff(), reset_moments=True)
    watched = count_host_data_per_step(quiet_trainer(max_steps=7, log_every_n_steps=4, callbacks=[monitor]), fresh())
    non_logging = [i for i in range(1, 7) if (i + 1) % 4 != 0]
    assert [watched[i] for i in non_logging] == [bare[i] for i in non_logging]


# ---------------------------------------------------------------------------------------------- QK-clip
def test_qk_clip_brings_each_heads_largest_logit_back_to_tau() -> None:
    """With lr=0 the step changes nothing but the clip: on the same batch, every head above tau ends at tau."""
    module = fresh(lr=0.0, batches=1)
    batch = next(iter(module.train_dataloader()))[:, :-1]
    logits = AttentionLogits(module)
    with torch.no_grad():
        module(batch)
    before = logits.maxima["block.self_attn"].clone()
    tau = float(before.min() + before.max()) / 2  # one head above, one below
    trainer = quiet_trainer(max_steps=1, log_every_n_steps=1, callbacks=[PrecursorMonitor(qk_clip=tau)])
    trainer.fit(module)
    logits.reset()
    module.train()  # the layer's inference fast path would bypass self_attn
    with torch.no_grad():
        module(batch)
    after = logits.maxima["block.self_attn"]
    above = before > tau
    assert bool(above.any()) and not bool(above.all())
    torch.testing.assert_close(after[above], torch.full_like(after[above], tau), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after[~above], before[~above])
    assert float(trainer.callback_metrics["stability/qk_clipped_heads"]) == float(above.sum())


# ---------------------------------------------------------------------------------------------- update scaling
def test_the_backoff_halves_the_lr_per_applied_update_and_the_skip_keeps_it_where_it_was() -> None:
    """A threshold every update passes, measured every step: the first update is AdamW's own, each later applied
    one uses half the LR of the one before (stability/lr logs it), and a skipped step moves neither the weights nor
    the back-off (the applied-update clock)."""
    backoff = LRBackoff("update_ratio", threshold=1e-12, factor=0.5, floor=0.01, every=1, efficiency=None)
    steps, skipped = 5, {3}
    monitored, lrs = Snapshots(), LoggedLR()
    monitor = PrecursorMonitor(attention=False, log_partition=False, lr_backoff=backoff, log_every_n_steps=1)
    quiet_trainer(max_steps=steps, callbacks=[SkipAt(skipped), monitor, monitored, lrs]).fit(fresh(weight_decay=0.1))
    assert monitored.outcomes == [0, 0, 0, int(Outcome.SKIPPED_SPIKE), 0]
    assert lrs.lrs == pytest.approx([1e-2, 5e-3, 2.5e-3, 1.25e-3, 1.25e-3])  # the skipped step's LR was not moved on
    for name, w in monitored.weights[2].items():  # the skipped step: nothing moved
        torch.testing.assert_close(monitored.weights[3][name], w, rtol=0, atol=0)
    assert float(monitor.backoff) == pytest.approx(0.5**4)  # four applied updates, each past the threshold
    assert monitored.module_lr == 1e-2  # put back after every update: the optimizer's own LR is untouched


class Efficiency(pl.Callback):
    """Each update's ratio and LR as the step measured them, and the share the monitor recorded (tests only)."""

    def __init__(self) -> None:
        self.ratios: list[float] = []
        self.lrs: list[float] = []
        self.shares: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = StepLedger.of(trainer).step
        assert step.update is not None and step.update.ratio is not None
        self.ratios.append(float(step.update.ratio))
        self.lrs.append(float(step.scale.used_lrs(step.optimizer)[0]))
        self.shares.append(float(trainer.callback_metrics["stability/update_efficiency"]))


def test_the_efficiency_is_the_update_per_unit_of_lr_over_the_largest_of_the_run() -> None:
    """By hand from the step's own ratio and applied LR: ``(ratio / lr) / max`` over the applied updates so far, and
    1 for the first update (the largest so far); with a back-off acting, the LR is the one applied."""
    seen = Efficiency()
    backoff = LRBackoff("update_ratio", threshold=1e-12, every=1, efficiency=0.99)
    monitor = PrecursorMonitor(attention=False, log_partition=False, lr_backoff=backoff, log_every_n_steps=1)
    quiet_trainer(max_steps=12, callbacks=[monitor, seen]).fit(fresh(lr=0.1, batches=12))
    per_lr = [r / lr for r, lr in zip(seen.ratios, seen.lrs, strict=True)]
    expected = [p / max(per_lr[: k + 1]) for k, p in enumerate(per_lr)]
    assert seen.shares == pytest.approx(expected, rel=1e-5)
    assert seen.shares[0] == 1.0 and min(seen.shares) < 0.99
    assert len(set(seen.lrs)) > 1  # the back-off acted: the share is per unit of the LR applied


@pytest.mark.parametrize(("lr", "acts"), [(1e-2, False), (1.0, True)])
def test_the_backoff_waits_for_the_runs_own_updates_to_shrink_per_unit_of_lr(lr: float, acts: bool) -> None:
    """A threshold every update passes: at an LR the tiny LM trains at, the update per unit of LR keeps more than
    a fifth of its first size and the back-off leaves every update alone; at an LR far too large it falls under
    that within a few updates and the back-off acts. Without the baseline (``efficiency=None``) it acts on both."""
    for efficiency, expect in ((0.2, acts), (None, True)):
        backoff = LRBackoff("update_ratio", threshold=1e-12, every=1, efficiency=efficiency, ceiling=None)
        monitor = PrecursorMonitor(attention=False, log_partition=False, lr_backoff=backoff)
        quiet_trainer(max_steps=30, callbacks=[monitor]).fit(fresh(lr=lr, batches=30))
        assert (float(monitor.backoff) < 1) is expect, (efficiency, float(monitor.backoff))


def test_the_baseline_moves_on_applied_finite_updates_only() -> None:
    """The run's largest update per unit of LR: a skipped update and a non-finite one leave it where it was."""
    monitor = PrecursorMonitor(attention=False, log_partition=False, lr_backoff=LRBackoff())
    yes, no = torch.tensor(True), torch.tensor(False)
    share = monitor._efficiency(torch.tensor(0.2), [0.1], yes, tick=True)  # per unit of LR: 2
    assert share is not None and float(share) == 1.0
    for ratio, applied in ((torch.tensor(0.5), no), (torch.tensor(float("nan")), yes), (torch.tensor(1e9), no)):
        monitor._efficiency(ratio, [0.1], applied, tick=True)
        assert float(monitor._peak_per_lr) == pytest.approx(2.0)
    share = monitor._efficiency(torch.tensor(0.05), [0.1], yes, tick=True)
    assert share is not None and float(share) == pytest.approx(0.25)


def test_the_share_reads_the_first_group_whose_lr_is_not_zero() -> None:
    """A frozen first param group (LR 0) is passed over: the share is measured on the LR of the group that trains,
    and the back-off acts on it (without a baseline, the share would never be measured and it never would)."""

    class FrozenEmbedding(TinyLM):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            rest = [p for n, p in self.named_parameters() if not n.startswith("embed")]
            return torch.optim.AdamW([{"params": self.embed.parameters(), "lr": 0.0}, {"params": rest, "lr": 1.0}])

    backoff = LRBackoff("update_ratio", threshold=1e-12, every=1, efficiency=0.2, ceiling=None)
    monitor = PrecursorMonitor(attention=False, log_partition=False, lr_backoff=backoff, log_every_n_steps=1)
    trainer = quiet_trainer(max_steps=30, callbacks=[monitor])
    torch.manual_seed(0)
    trainer.fit(FrozenEmbedding(batches=30))
    assert float(trainer.callback_metrics["stability/update_efficiency"]) < 0.2
    assert float(monitor.backoff) < 1


def test_past_the_ceiling_the_backoff_acts_whatever_the_share() -> None:
    """At an LR the tiny LM trains at, the share stays above 0.2: the back-off acts only once the ratio passes a
    ceiling (here one every update passes), and never under a ceiling no update reaches."""
    for ceiling, expect in ((1e-12, True), (1e9, False)):
        backoff = LRBackoff("update_ratio", threshold=1e-12, every=1, efficiency=0.2, ceiling=ceiling)
        monitor = PrecursorMonitor(attention=False, log_partition=False, lr_backoff=backoff)
        quiet_trainer(max_steps=30, callbacks=[monitor]).fit(fresh(lr=1e-2, batches=30))
        assert (float(monitor.backoff) < 1) is expect, (ceiling, float(monitor.backoff))


class LoggedLR(pl.Callback):
    """The LR each update used, as the step recorded it (the ledger's outcome of the update's scale)."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = StepLedger.of(trainer).step
        self.lrs.append(float(step.scale.used_lrs(step.optimizer)[0]))


def test_the_backoff_never_recovers_past_one() -> None:
    """Under the threshold the factor grows by ``recovery`` per applied update up to 1 and no further: an update is
    never made larger than the optimizer's own."""
    monitor = PrecursorMonitor(
        attention=False, log_partition=False, lr_backoff=LRBackoff("update_ratio", 1e9, recovery=1.5, every=1)
    )
    monitor.backoff = 0.9
    lrs = LoggedLR()
    quiet_trainer(max_steps=5, callbacks=[monitor, lrs]).fit(fresh())
    assert float(monitor.backoff) == 1.0
    assert lrs.lrs == pytest.approx([0.9e-2, 1e-2, 1e-2, 1e-2, 1e-2])


def test_update_clipping_scales_each_tensor_by_stableadamws_coefficient() -> None:
    """Against the pure math: the coefficient from the gradients and the state before step 2, applied to the
    update AdamW took from the same weights."""
    from lightning_stability.precursors.actions import update_clip_coefficients

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.coefficients: list[Tensor] = []

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
            params = [p for p in pl_module.parameters() if "exp_avg_sq" in optimizer.state.get(p, {})]
            if params:
                states = [optimizer.state[p] for p in params]
                self.coefficients.append(
                    update_clip_coefficients(
                        [p.grad for p in params],
                        [s["exp_avg_sq"] for s in states],
                        [s["step"] for s in states],
                        0.999,
                        1e-8,
                    )
                )

    record, monitored = Record(), Snapshots()
    monitor = PrecursorMonitor(attention=False, log_partition=False, update_clip=1.0)
    quiet_trainer(max_steps=2, callbacks=[record, monitor, monitored]).fit(fresh(lr=0.05))
    plain = Snapshots()
    quiet_trainer(max_steps=2, callbacks=[plain]).fit(fresh(lr=0.05))
    (coefficients,) = record.coefficients
    assert float(coefficients.min()) < 1  # the second step of Adam is clipped somewhere (RMS > 1)
    for c, (name, w) in zip(coefficients.tolist(), plain.weights[1].items(), strict=True):
        w0 = plain.weights[0][name]
        torch.testing.assert_close(monitored.weights[1][name] - w0, c * (w - w0), rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------------------------------------- moment reset
def test_a_spike_that_got_in_resets_the_hit_tensors_moments_and_leaves_the_step_count() -> None:
    """Under response="warn" a spike's update is applied: right after it, the moments of the tensors its gradient
    hit are zero (the spike's contribution with them), and every step count is still the number of updates."""
    module = fresh(batches=33)
    module.spikes = {32: 1e4}  # the last step
    monitor = PrecursorMonitor(attention=False, log_partition=False, reset_moments=True)
    health = TrainingHealthMonitor(response="warn", report=False)
    with pytest.warns(UserWarning, match="spike"):
        quiet_trainer(max_steps=33, callbacks=[health, monitor]).fit(module)
    assert [e["step"] for e in health.events if e["kind"] == "spike"] == [32]
    optimizer = module.trainer.optimizers[0]
    states = [optimizer.state[p] for p in module.parameters()]
    zeroed = [s for s in states if not s["exp_avg"].any() and not s["exp_avg_sq"].any()]
    assert len(zeroed) == float(monitor.moment_resets) >= 1
    assert {int(s["step"]) for s in states} == {33}


def test_without_a_spike_no_moment_is_reset() -> None:
    monitor = PrecursorMonitor(attention=False, log_partition=False, reset_moments=True)
    quiet_trainer(max_steps=30, callbacks=[TrainingHealthMonitor(response="warn", report=False), monitor]).fit(
        fresh(batches=30)
    )
    assert float(monitor.moment_resets) == 0


# ---------------------------------------------------------------------------------------------- checkpoints
def test_a_resumed_fit_continues_the_backoff_and_the_drift(tmp_path: Path) -> None:
    """Straight through 9 steps, or 6 then a resume from the checkpoint: the same back-off, clip count, log Z
    average and weights."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    backoff = LRBackoff("update_ratio", threshold=0.005, efficiency=0.9)  # acts once the share falls under 0.9

    def monitor() -> PrecursorMonitor:
        return PrecursorMonitor(qk_clip=0.3, lr_backoff=backoff, log_every_n_steps=2)

    straight = monitor()
    module = fresh(batches=3)
    quiet_trainer(max_steps=9, callbacks=[straight]).fit(module)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1)
    quiet_trainer(max_steps=6, callbacks=[monitor(), ckpt], enable_checkpointing=True).fit(fresh(batches=3))
    resumed = monitor()
    again = fresh(batches=3)
    quiet_trainer(max_steps=9, callbacks=[resumed]).fit(again, ckpt_path=tmp_path / "epoch=1-step=6.ckpt")
    assert float(straight.backoff) < 1 and float(straight.clipped_heads) > 0
    assert float(resumed.backoff) == pytest.approx(float(straight.backoff))
    assert float(resumed.clipped_heads) == float(straight.clipped_heads)
    assert resumed.state_dict()["log_z"] == pytest.approx(straight.state_dict()["log_z"])
    assert resumed.state_dict()["peak_per_lr"] == straight.state_dict()["peak_per_lr"] is not None
    for (name, a), b in zip(module.named_parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: PrecursorMonitor(qk_clip=-1.0), "qk_clip"),
        (lambda: PrecursorMonitor(qk_clip_alpha=1.5), "qk_clip_alpha"),
        (lambda: PrecursorMonitor(update_clip=0), "update_clip"),
        (lambda: PrecursorMonitor(lr_backoff="yes"), "lr_backoff"),  # type: ignore[arg-type]
        (lambda: PrecursorMonitor(log_partition=3), "log_partition"),  # type: ignore[arg-type]
        (lambda: PrecursorMonitor(other_optimizers="ignore"), "other_optimizers"),  # type: ignore[arg-type]
        (lambda: LRBackoff("loss"), "signal"),
        (lambda: LRBackoff(factor=1.0), "factor"),
        (lambda: LRBackoff(recovery=0.9), "recovery"),
        (lambda: LRBackoff(efficiency=1.5), "efficiency"),
        (lambda: LRBackoff("attention_logit", 100.0), "efficiency"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(make: Any, match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        make()


def test_the_adam_actions_refuse_another_optimizer() -> None:
    class SGDLM(TinyLM):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class NAdamLM(TinyLM):  # betas and eps like Adam, another update: not Adam's moments to clip or reset
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.NAdam(self.parameters(), lr=0.01)

    for module in (SGDLM, NAdamLM):
        torch.manual_seed(0)
        with pytest.raises(StabilityConfigError, match=f"optimizer is {module.__name__[:-2]}, not torch.optim.Adam"):
            quiet_trainer(max_steps=1, callbacks=[PrecursorMonitor(update_clip=1.0)]).fit(module())
    # what a preset uses: the Adam actions off for this fit, in one line; the back-off and the precursors go on
    monitor = PrecursorMonitor(
        reset_moments=True, lr_backoff=LRBackoff(threshold=1e-12, every=1, efficiency=None), other_optimizers="warn"
    )
    trainer = quiet_trainer(max_steps=4, log_every_n_steps=2, callbacks=[monitor])
    with pytest.warns(UserWarning, match="optimizer is SGD, not torch.optim.Adam or AdamW, so it is off"):
        trainer.fit(SGDLM())
    assert float(monitor.backoff) == 0.5**4
    assert "stability/attention_logit_max" in trainer.callback_metrics


def test_the_backoff_refuses_rprop_whose_lr_is_only_its_first_step_size() -> None:
    class RpropLM(TinyLM):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Rprop(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    with pytest.raises(StabilityConfigError, match=r"Rprop reads its LR only once.*Fix"):
        quiet_trainer(max_steps=1, callbacks=[PrecursorMonitor(lr_backoff=LRBackoff())]).fit(RpropLM())


def test_qk_clip_needs_a_known_attention_module() -> None:
    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(4, 3)

        def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
            return self.lm_head(batch).square().mean()

        def train_dataloader(self) -> DataLoader[Tensor]:
            return DataLoader(torch.randn(8, 4), batch_size=4)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

    quiet_trainer(max_steps=2, callbacks=[PrecursorMonitor()]).fit(MLP())  # measuring: what there is
    with pytest.raises(StabilityConfigError, match="register"):
        quiet_trainer(max_steps=1, callbacks=[PrecursorMonitor(qk_clip=100.0)]).fit(MLP())


class TwoOptimizerLM(TinyLM):
    """The same model trained by two AdamWs (manual optimization): each optimizer steps once per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Tensor, batch_idx: int) -> None:  # type: ignore[override]
        loss = super().training_step(batch, batch_idx)
        first, second = self.optimizers()  # type: ignore[misc]
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:  # type: ignore[override]
        params = list(self.parameters())
        return [torch.optim.AdamW(params[:2]), torch.optim.AdamW(params[2:])]


def test_the_actions_refuse_several_optimizers_and_the_precursors_log_per_optimizer() -> None:
    """Each action acts once per update of the module (QK-clip on the step's maxima, one back-off factor): with
    two optimizers it would act twice per batch, so it is refused at fit start; measuring alone works."""
    torch.manual_seed(0)
    with pytest.raises(StabilityConfigError, match=r"2 optimizers.*Fix"):
        quiet_trainer(max_steps=2, callbacks=[PrecursorMonitor(lr_backoff=LRBackoff())]).fit(TwoOptimizerLM())
    trainer = quiet_trainer(max_steps=8, log_every_n_steps=2, callbacks=[PrecursorMonitor()])
    trainer.fit(TwoOptimizerLM())
    assert {"stability/update_ratio/AdamW", "stability/update_ratio/AdamW-1"} <= set(trainer.callback_metrics)


def test_lr_find_then_fit(tmp_path: Path) -> None:
    """Tuner.lr_find runs its search with Lightning's own callback alone (the Trainer's are set aside): the search
    finds an LR, and the fit after it starts the monitor afresh, which then acts."""
    from lightning.pytorch.tuner import Tuner

    monitor = PrecursorMonitor(qk_clip=1.0, lr_backoff=LRBackoff("update_ratio", 0.02))
    trainer = quiet_trainer(max_steps=3, default_root_dir=tmp_path, callbacks=[monitor])
    module = fresh(batches=40)
    found = Tuner(trainer).lr_find(module, num_training=30)
    assert found is not None and found.suggestion() is not None
    assert float(monitor.backoff) == 1.0 and float(monitor.clipped_heads) == 0.0
    trainer.fit(module)
    assert trainer.global_step == 3 and float(monitor.clipped_heads) > 0


def test_model_checkpoint_and_early_stopping_monitor_precursors_with_the_trainers_defaults(tmp_path: Path) -> None:
    """log_every_n_steps=50 and epochs of 8 batches: no step logs, yet the figures are in callback_metrics at
    every epoch's end, where ModelCheckpoint and EarlyStopping read them."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="stability/update_ratio", save_top_k=1)
    stopping = EarlyStopping(monitor="stability/attention_logit_max", mode="max", patience=10)
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[PrecursorMonitor(), checkpoint, stopping],
    )
    trainer.fit(fresh(batches=8))
    assert trainer.global_step == 24
    assert checkpoint.best_model_score is not None and 0 < float(checkpoint.best_model_score) < 1
    assert float(stopping.best_score) > 0


class SometimesUnused(TinyLM):
    """A second head used on even batches only: on odd ones it gets no gradient, and AdamW leaves it as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.block(
            self.embed(tokens), src_mask=nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        )
        out = self.lm_head(hidden)
        return out + self.extra(hidden) if self.trainer.global_step % 2 == 0 else out


def test_the_backoff_leaves_a_tensor_without_a_gradient_where_adam_left_it() -> None:
    """Its state still holds the step it took last time: rescaling that would move a weight Adam did not move."""
    snapshots = Snapshots()
    monitor = PrecursorMonitor(
        attention=False, log_partition=False, lr_backoff=LRBackoff("update_ratio", 1e-9, efficiency=None)
    )
    torch.manual_seed(0)
    quiet_trainer(max_steps=6, callbacks=[monitor, snapshots]).fit(SometimesUnused())
    assert float(monitor.backoff) < 1  # it acted on the steps in between
    for step in (1, 3, 5):  # odd steps: no gradient for `extra`
        for name in ("extra.weight", "extra.bias"):
            torch.testing.assert_close(snapshots.weights[step][name], snapshots.weights[step - 1][name], rtol=0, atol=0)
    assert not torch.equal(snapshots.weights[2]["extra.weight"], snapshots.weights[1]["extra.weight"])


def test_the_steps_before_validation_are_the_ones_lightning_validates_after() -> None:
    """With check_val_every_n_epoch=None validation runs every N batches of the run, across epochs (Lightning's
    rule): the monitor measures the step right before each, where ModelCheckpoint reads callback_metrics."""
    from lightning_stability._compat import reads_callback_metrics_after

    class Validated(TinyLM):
        def validation_step(self, batch: Tensor, batch_idx: int) -> None:
            self.log("val", 1.0)

        def val_dataloader(self) -> DataLoader[Tensor]:
            return self.train_dataloader()

    read: list[int] = []
    validated: list[int] = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
            if reads_callback_metrics_after(trainer, batch_idx):
                read.append(trainer.global_step + 1)  # the step this batch ends

        def on_validation_start(self, trainer: pl.Trainer, module: Any) -> None:
            validated.append(trainer.global_step)

    trainer = quiet_trainer(
        max_steps=20,
        check_val_every_n_epoch=None,
        val_check_interval=5,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[PrecursorMonitor(), Spy()],
    )
    torch.manual_seed(0)
    trainer.fit(Validated(batches=8))
    assert validated == [5, 10, 15, 20]
    assert set(validated) <= set(read)  # and the epochs' ends: 8, 16
    assert set(read) - set(validated) == {8, 16}


def test_the_backoff_says_once_when_it_first_acts_and_never_when_it_does_not() -> None:
    def fit(threshold: float) -> list[str]:
        monitor = PrecursorMonitor(
            lr_backoff=LRBackoff("update_ratio", threshold, every=1, efficiency=None), log_every_n_steps=2
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_trainer(max_steps=8, callbacks=[monitor]).fit(fresh())
        return [str(w.message) for w in caught if "LR back-off is on" in str(w.message)]

    (told,) = fit(1e-9)
    assert "by step 2" in told and "lr_backoff=None" in told and "LRBackoff(threshold=...)" in told
    assert fit(1e9) == []
