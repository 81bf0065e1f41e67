"""RouterHealthMonitor's actions on tiny Hugging Face MoEs: the router z-loss's gradients equal those of the z-loss
added to the loss by hand (with and without accumulation, and through a replayed step), the router-logit clip
equal to the weights scaled by hand."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_stability import StabilityConfigError
from lightning_stability.moe import RouterHealthMonitor, register_router
from lightning_stability.moe.actions import clip_routers_, z_loss_grad
from tests.helpers import quiet_trainer
from tests.moe.moe_lm import MoELM, build, gates

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*eos_token_id.*")

COEF = 0.5  # large, so that a z-loss missing or counted twice would show far above the rounding


class ZLossByHand(MoELM):
    """The z-loss added to the loss in ``training_step``: ``coef`` times the sum over router calls of the mean over
    their tokens of ``logsumexp(logits)^2``."""

    def __init__(self, coef: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.coef, self.calls = coef, []
        for gate in gates(self).values():
            gate.register_forward_hook(lambda module, args, output: self.calls.append(output[0]))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        self.calls.clear()
        loss = super().training_step(batch, batch_idx)
        z = sum(torch.logsumexp(lg.float(), dim=-1).square().mean() for lg in self.calls)
        return loss + self.coef * z


class Grads(pl.Callback):
    """Every parameter's gradient as each optimizer step begins (after the backward of its micro-batches)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Tensor]] = []

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self.steps.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})


def _grads(module: MoELM, monitor: RouterHealthMonitor, steps: int = 3, **trainer: Any) -> list[dict[str, Tensor]]:
    grads = Grads()
    before = trainer.pop("callbacks_before", [])
    quiet_trainer(max_steps=steps, callbacks=[*before, monitor, grads], **trainer).fit(module)
    return grads.steps


def _assert_same_grads(got: list[dict[str, Tensor]], expected: list[dict[str, Tensor]]) -> None:
    assert len(got) == len(expected) and got
    for step_got, step_expected in zip(got, expected, strict=True):
        assert set(step_got) == set(step_expected)
        for name, grad in step_expected.items():
            scale = float(grad.abs().max())  # the two sum the same terms in other orders
            torch.testing.assert_close(step_got[name], grad, rtol=1e-5, atol=1e-6 * scale, msg=name)


def test_the_z_loss_gradient_formula() -> None:
    logits = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    (0.3 * torch.logsumexp(logits, dim=-1).square().mean()).backward()
    torch.testing.assert_close(z_loss_grad(logits, 0.3).double(), logits.grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_z_loss_gradients_equal_those_of_the_z_loss_added_by_hand(family: str, accumulate: int) -> None:
    """Every parameter's gradient at each step, with the z-loss as a hook and added to the loss by hand (at lr 0: the
    same weights in both at every step, not weights apart by the updates' rounding)."""
    trainer = dict(accumulate_grad_batches=accumulate)
    by_hand = _grads(ZLossByHand(COEF, family=family, batches=6, lr=0.0), RouterHealthMonitor(), **trainer)
    hooked = _grads(MoELM(family, batches=6, lr=0.0), RouterHealthMonitor(z_loss=COEF), **trainer)
    plain = _grads(MoELM(family, batches=6, lr=0.0), RouterHealthMonitor(), steps=1, **trainer)
    _assert_same_grads(hooked, by_hand)
    router = next(n for n in plain[0] if n.endswith("mlp.gate.weight"))
    assert not torch.allclose(plain[0][router], hooked[0][router], rtol=1e-3)  # the z-loss is not nothing here


class WithValidation(MoELM):
    """Validation every 2 steps: forwards no backward follows."""

    def validation_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def val_dataloader(self) -> Any:
        return self.train_dataloader()


def test_a_validation_forward_adds_no_z_loss_and_takes_none_away() -> None:
    by_hand = _grads(ZLossByHand(COEF, batches=6, lr=0.0), RouterHealthMonitor(), steps=4)
    trainer = dict(val_check_interval=2, check_val_every_n_epoch=None, limit_val_batches=1, num_sanity_val_steps=1)
    hooked = _grads(WithValidation(batches=6, lr=0.0), RouterHealthMonitor(z_loss=COEF), steps=4, **trainer)
    _assert_same_grads(hooked, by_hand)


def test_under_activation_checkpointing_the_z_loss_lands_once() -> None:
    """The forward run again in backward is not taken for a second z-loss; reentrant checkpointing, whose first
    forward keeps no graph, is warned about."""
    by_hand = _grads(ZLossByHand(COEF, batches=4, lr=0.0), RouterHealthMonitor(), steps=2)
    module = MoELM(batches=4, lr=0.0)
    module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _assert_same_grads(_grads(module, RouterHealthMonitor(z_loss=COEF), steps=2), by_hand)
    module = MoELM(batches=4, lr=0.0)
    module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.warns(UserWarning, match="carry no gradient.*use_reentrant"):
        _grads(module, RouterHealthMonitor(z_loss=COEF), steps=1)


def test_a_replayed_step_s_gradients_carry_the_z_loss_once(tmp_path: Any) -> None:
    """StepReplay reruns a flagged step's forward and backward (row 3b): the rerun's backward runs row 1 again, so
    the replayed gradients carry the z-loss as the fault-free run's do (a rerun without it, or with it twice, would
    differ there)."""
    from lightning_stability import TrainingHealthMonitor
    from lightning_stability.replay import BitFlip, StepReplay

    def run(fault: bool) -> list[dict[str, Tensor]]:
        module = MoELM(batches=8, lr=1e-2)
        flip = BitFlip(module, "model.lm_head", step=6 if fault else 100)
        health = TrainingHealthMonitor(response="skip", warmup_steps=3, report=False)
        replay = StepReplay(quarantine_file=None)
        monitor = RouterHealthMonitor(z_loss=COEF)
        grads = _grads(module, monitor, steps=8, callbacks_before=[health, replay], default_root_dir=tmp_path)
        assert bool(flip.flipped) == fault and replay.counts["replays"] == int(fault)
        return grads

    _assert_same_grads(run(fault=True), run(fault=False))


def test_the_z_loss_metric_keeps_its_meaning_with_the_z_loss_on() -> None:
    """``stability/router/z_loss`` is still the mean over tokens of ``logsumexp(logits)^2``: the hook changes the
    gradients, not the logits it is measured on."""
    from tests.moe.test_router_health import Capture, Logged, _assert_figures, _expected

    module = MoELM(batches=4)
    capture, monitor = Capture(module), Logged(log_every_n_steps=2, z_loss=COEF)
    quiet_trainer(max_steps=4, callbacks=[capture, monitor]).fit(module)
    layers = list(capture.calls)
    assert sorted(monitor.logged) == [1, 3]
    for batch, got in monitor.logged.items():
        _assert_figures(got, _expected(capture, range(batch - 1, batch + 1), layers))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(z_loss=-1e-3), "z_loss"),
        (dict(z_loss=True), "z_loss"),
        (dict(logit_clip=0.0), "logit_clip"),
        (dict(logit_clip=float("nan")), "logit_clip"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        RouterHealthMonitor(**kwargs)


# ---------------------------------------------------------------------------------------------- router-logit clip
def test_the_clip_brings_a_linear_router_s_logit_max_back_to_tau() -> None:
    torch.manual_seed(0)
    router, x = nn.Linear(8, 4), torch.randn(16, 8) * 10
    maxima = router(x).detach().amax().reshape(1)
    eta = clip_routers_([list(router.parameters())], maxima, tau=1.0)
    assert float(eta) < 1
    torch.testing.assert_close(router(x).detach().amax(), torch.tensor(1.0), rtol=1e-6, atol=0.0)
    assert clip_routers_([list(router.parameters())], torch.tensor([0.5]), tau=1.0).tolist() == [1.0]  # under tau


def test_a_non_finite_logit_max_scales_nothing() -> None:
    """A broken forward's max (+inf, NaN; its step is skipped) leaves the routers as they are: ``tau / inf`` would
    zero them."""
    routers = [[torch.ones(2, 3)] for _ in range(4)]
    maxima = torch.tensor([float("inf"), float("nan"), float("-inf"), 4.0])
    assert clip_routers_(routers, maxima, tau=2.0).tolist() == [1.0, 1.0, 1.0, 0.5]
    assert [float(r[0].max()) for r in routers] == [1.0, 1.0, 1.0, 0.5]


class ClipByHand(pl.Callback):
    """The router-logit clip written out: each router's logit max over the step's forwards, and once the step is
    over its weight scaled by ``tau / max`` where the max passed ``tau``."""

    def __init__(self, module: MoELM, tau: float) -> None:
        self.tau, self.gates, self.maxima = tau, gates(module), {}
        self.clipped = 0
        for name, gate in self.gates.items():
            gate.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if module.training and torch.is_grad_enabled():
                top = output[0].detach().float().amax()
                self.maxima[name] = torch.maximum(self.maxima.get(name, top), top)

        return hook

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        with torch.no_grad():
            for name, gate in self.gates.items():
                top = self.maxima[name]
                if top > self.tau:
                    gate.weight.mul_(self.tau / top)
                    self.clipped += 1
        self.maxima = {}


def test_the_router_logit_clip_equals_the_clip_written_out_by_hand() -> None:
    """A tiny Mixtral at a large LR, clipped at a ``tau`` its routers pass: the weights after every step equal
    those of the same run with the clip done by hand after each step."""
    tau = 0.3

    def run(clip: float | None) -> tuple[dict[str, Tensor], int]:
        module = MoELM("mixtral", batches=6, lr=3e-2)
        callbacks: list[pl.Callback] = [RouterHealthMonitor(logit_clip=clip)]
        by_hand = None if clip is not None else ClipByHand(module, tau)
        quiet_trainer(max_steps=6, callbacks=[*callbacks, *([by_hand] if by_hand else [])]).fit(module)
        return {n: p.detach().clone() for n, p in module.named_parameters()}, by_hand.clipped if by_hand else 0

    clipped, _ = run(tau)
    expected, times = run(None)
    assert times >= 3  # the clip acted, on several steps and routers
    for name, weight in expected.items():
        torch.testing.assert_close(clipped[name], weight, rtol=1e-6, atol=0.0, msg=name)


def test_a_router_with_no_weight_of_its_own_is_refused_for_the_clip() -> None:
    class Scores(nn.Module):  # the logits come in: nothing of its own to scale
        num_experts, top_k = 4, 1

        def forward(self, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            weights, experts = logits.softmax(-1).topk(1)
            return logits, weights, experts

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.router = nn.Linear(8, 4), Scores()

        def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
            _, weights, _ = self.router(self.proj(batch))
            return weights.sum()

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=4)

        def configure_optimizers(self) -> Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    register_router(Scores)
    with pytest.raises(StabilityConfigError, match=r"logit_clip=1\.0.*router.*no parameter of their own"):
        quiet_trainer(max_steps=1, callbacks=[RouterHealthMonitor(logit_clip=1.0)]).fit(Model())


# ---------------------------------------------------------------------------------------------- balancing bias
class BiasSeen(pl.Callback):
    """Each router's balancing bias as each step begins, and every training forward's ``(step, logits, experts)``
    as the router's hooks leave it (after the bias's)."""

    def __init__(self, module: MoELM) -> None:
        self.gates, self.bias, self.calls = gates(module), [], []
        self.step = -1
        for name, gate in self.gates.items():
            gate.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if module.training and torch.is_grad_enabled():
                self.calls.append((self.step, name, output[0].detach().clone(), output[1].detach().clone(), output[2]))

        return hook

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.step = trainer.global_step
        self.bias.append({name: gate.balance_bias.clone() for name, gate in self.gates.items()})


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_the_experts_chosen_are_the_top_k_of_the_scores_plus_the_bias(family: str) -> None:
    """By hand, at every step: the experts chosen equal ``topk(softmax(logits) + bias)``, the weights the chosen
    scores normalized; the bias moves by ``u * sign(mean load - load)`` of the step's choice."""
    rate = 0.05  # large, so that the bias changes the choice within a few steps
    module = MoELM(family, batches=6)
    seen = BiasSeen(module)
    quiet_trainer(max_steps=6, callbacks=[RouterHealthMonitor(balance_bias=rate), seen]).fit(module)
    assert torch.equal(torch.stack(list(seen.bias[0].values())), torch.zeros(2, 4))
    moved = 0
    for step, name, logits, weights, experts in seen.calls:
        bias = seen.bias[step][name]
        scores = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(scores + bias, 2, dim=-1).indices
        assert torch.equal(experts, chosen)
        moved += int(not torch.equal(experts.sort(-1).values, scores.topk(2).indices.sort(-1).values))
        mixed = scores.gather(-1, chosen)
        if family == "mixtral" or gates(module)[name].norm_topk_prob:
            mixed = mixed / mixed.sum(-1, keepdim=True)
        torch.testing.assert_close(weights, mixed.to(weights.dtype), rtol=0, atol=0)
    assert moved > 0  # the bias changed the choice of some tokens
    for step in range(5):
        for name in seen.gates:
            load = torch.cat([e.reshape(-1) for s, n, _, _, e in seen.calls if s == step and n == name]).bincount(
                minlength=4
            )
            expected = seen.bias[step][name] + rate * torch.sign(load.float().mean() - load.float())
            assert torch.equal(seen.bias[step + 1][name], expected)


def test_with_a_zero_bias_the_routing_is_the_router_s_own() -> None:
    torch.manual_seed(0)
    model = build("mixtral")
    x = torch.randint(32, (2, 8))
    plain = model(input_ids=x).logits
    monitor = RouterHealthMonitor(balance_bias=1e-3)
    from lightning_stability.moe.routers import RouterHooks

    monitor._add_bias(RouterHooks(model, monitor.window))
    assert torch.equal(model(input_ids=x).logits, plain)


def _run_with_bias(root: Path, ckpt: Path | None, save: bool) -> tuple[MoELM, RouterHealthMonitor]:
    module = MoELM("mixtral", batches=2)  # the checkpoint at step 2 is at an epoch's end: the data go on alike
    monitor = RouterHealthMonitor(balance_bias=0.05)
    callbacks: list[pl.Callback] = [monitor]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, save_last=False))
    quiet_trainer(max_steps=6, callbacks=callbacks, enable_checkpointing=save).fit(module, ckpt_path=ckpt)
    return module, monitor


def test_a_resume_with_the_bias_on_is_bit_exact(tmp_path: Path) -> None:
    straight, straight_monitor = _run_with_bias(tmp_path, None, save=True)
    ckpt = tmp_path / "epoch=0-step=2.ckpt"
    saved = [s for s in torch.load(ckpt, weights_only=False)["callbacks"].values() if "balance_bias" in s]
    assert len(saved) == 1 and any(any(v) for v in saved[0]["balance_bias"].values())  # moved in two steps
    resumed, resumed_monitor = _run_with_bias(tmp_path / "r", ckpt, save=False)
    assert resumed_monitor.bias_values() == straight_monitor.bias_values()
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_the_bias_is_in_the_callback_s_state_and_survives_a_pickle() -> None:
    monitor = RouterHealthMonitor(balance_bias=0.05)
    quiet_trainer(max_steps=2, callbacks=[monitor]).fit(MoELM("mixtral"))
    state = monitor.state_dict()
    assert set(state["balance_bias"]) == set(monitor.routers) and len(state["balance_bias"][monitor.routers[0]]) == 4
    other = RouterHealthMonitor(balance_bias=0.05)
    other.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert other.state_dict()["balance_bias"] == state["balance_bias"]  # kept until a setup puts it in the routers
    copied = pickle.loads(pickle.dumps(monitor))
    assert copied._bias_handles == [] and copied._hooks is None
    assert copied.state_dict()["balance_bias"] == state["balance_bias"]


def test_a_router_it_cannot_re_choose_for_is_refused_for_the_bias() -> None:
    module = MoELM("deepseek_v3")
    with pytest.raises(StabilityConfigError, match=r"balance_bias=0\.001.*DeepseekV3TopkRouter.*Fix"):
        quiet_trainer(max_steps=1, callbacks=[RouterHealthMonitor(balance_bias=1e-3)]).fit(module)


def test_a_rollback_s_snapshot_holds_the_bias() -> None:
    """The bias is a buffer of each router: ``TrainingHealthMonitor``'s snapshot (parameters and buffers) takes it
    and its rollback puts it back."""
    from lightning_stability.health.rollback import Snapshot
    from lightning_stability.moe.routers import RouterHooks

    model = build("mixtral")
    monitor = RouterHealthMonitor(balance_bias=1e-3)
    monitor._add_bias(RouterHooks(model, monitor.window))
    biases = [gate.balance_bias for gate in gates(model).values()]
    biases[0].fill_(0.25)
    snapshot = Snapshot(model, [], step=0)
    for bias in biases:
        bias.add_(1.0)
    snapshot.restore(model, [])
    assert biases[0].tolist() == [0.25] * 4 and biases[1].tolist() == [0.0] * 4


def test_a_replayed_step_moves_the_bias_once(tmp_path: Path) -> None:
    """A step StepReplay runs again (row 3b) moves the bias once, from its first run's load: the bias and the weights
    equal the fault-free run's."""
    from lightning_stability import TrainingHealthMonitor
    from lightning_stability.replay import BitFlip, StepReplay

    def run(fault: bool) -> tuple[MoELM, RouterHealthMonitor]:
        module = MoELM(batches=8, lr=1e-2)
        flip = BitFlip(module, "model.lm_head", step=6 if fault else 100)
        health = TrainingHealthMonitor(response="skip", warmup_steps=3, report=False)
        replay = StepReplay(quarantine_file=None)
        monitor = RouterHealthMonitor(balance_bias=0.05)
        quiet_trainer(max_steps=8, callbacks=[health, replay, monitor], default_root_dir=tmp_path).fit(module)
        assert bool(flip.flipped) == fault and replay.counts["replays"] == int(fault)
        return module, monitor

    (faulty, faulty_monitor), (clean, clean_monitor) = run(fault=True), run(fault=False)
    assert faulty_monitor.bias_values() == clean_monitor.bias_values()
    for (name, a), (_, b) in zip(faulty.named_parameters(), clean.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_the_actions_add_no_host_sync_and_no_tensor_from_host_data_to_any_step() -> None:
    """Every action on, against the monitor alone (a GradientNormMonitor in both: logging steps transfer in both)."""
    from lightning_stability import GradientNormMonitor
    from tests.helpers import count_host_data_per_step, count_syncs_per_step

    runs = {}
    for actions in ({}, dict(z_loss=1e-2, logit_clip=0.3, balance_bias=1e-2)):
        for count in (count_syncs_per_step, count_host_data_per_step):
            callbacks: list[pl.Callback] = [GradientNormMonitor(), RouterHealthMonitor(**actions)]
            trainer = quiet_trainer(max_steps=8, log_every_n_steps=4, callbacks=callbacks)
            runs[bool(actions), count.__name__] = count(trainer, MoELM("mixtral", batches=8))
    assert runs[True, "count_syncs_per_step"] == runs[False, "count_syncs_per_step"]
    assert runs[True, "count_host_data_per_step"] == runs[False, "count_host_data_per_step"]
