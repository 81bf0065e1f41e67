"""RouterHealthMonitor on tiny Hugging Face MoEs: the routers found by themselves, every figure equal to one computed
by hand from the same forwards, no host sync off logging steps, a replayed step and activation checkpointing
counted once, the open window kept across a checkpoint."""

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

from lightning_stability import GradientNormMonitor, StabilityConfigError, TrainingHealthMonitor
from lightning_stability.moe import (
    RouterHealthMonitor,
    RouterHooks,
    RouterSpec,
    RouterWindow,
    Routing,
    find_routers,
    register_router,
)
from lightning_stability.replay import BitFlip, StepReplay
from tests.helpers import TinyModule, count_host_data_per_step, count_syncs_per_step, quiet_trainer
from tests.metric_runs import keys_below_others
from tests.moe.moe_lm import EXPERTS, FAMILIES, TOP_K, MoELM, build, by_hand, gates

warnings.filterwarnings("ignore", ".*eos_token_id.*")

FIGURES = ("max_vio", "dead_experts", "entropy", "logit_max", "z_loss")
WHOLE = {"max_vio": max, "dead_experts": sum, "logit_max": max}  # entropy and z_loss: the mean over layers


class Logged(RouterHealthMonitor):
    """The monitor, keeping each metric it records by the batch it was recorded at (host reads: tests only)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.logged: dict[int, dict[str, float]] = {}
        self._batch = -1

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._batch = trainer.fit_loop.total_batch_idx

    def record_metric(self, key: str, value: Tensor | float, *, to_loggers: bool | None = None) -> Any:
        self.logged.setdefault(self._batch, {})[key] = float(value)
        return super().record_metric(key, value, to_loggers=to_loggers)


class Capture(pl.Callback):
    """Every forward of every router, as ``(batch, logits, experts)``, from the routers' own outputs."""

    def __init__(self, module: pl.LightningModule) -> None:
        self.calls: dict[str, list[tuple[int, Tensor, Tensor]]] = {}
        self.batch = -1
        for name, gate in gates(module).items():
            self.calls[name] = []
            gate.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if module.training and torch.is_grad_enabled():
                self.calls[name].append((self.batch, output[0].detach().clone(), output[2].detach().clone()))

        return hook

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.batch = trainer.fit_loop.total_batch_idx


def _fit(family: str, steps: int = 4, module: MoELM | None = None, **trainer: Any) -> tuple[Logged, Capture]:
    module = module or MoELM(family)
    capture, monitor = Capture(module), Logged(log_every_n_steps=trainer.pop("every", 1))
    quiet_trainer(max_steps=steps, callbacks=[capture, monitor], **trainer).fit(module)
    return monitor, capture


def _expected(capture: Capture, batches: range, layers: list[str], sigmoid: bool = False) -> dict[str, float]:
    """Every key the monitor records for the window of ``batches``, by hand."""
    per = {name: by_hand([(lg, ex) for b, lg, ex in capture.calls[name] if b in batches], sigmoid) for name in layers}
    out: dict[str, float] = {}
    for figure in FIGURES:
        values = [per[name][figure] for name in layers]
        out[f"stability/router/{figure}"] = WHOLE.get(figure, lambda v: sum(v) / len(v))(values)
        out.update({f"stability/router/{figure}_by_module/{name}": per[name][figure] for name in layers})
    for name in layers:
        for e, share in enumerate(per[name]["load_share"]):
            out[f"stability/router/load_share_by_module/{name}/expert{e}"] = share
    return out


def _assert_figures(got: dict[str, float], expected: dict[str, float]) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        if "dead_experts" in key or "logit_max" in key:
            assert got[key] == value, key  # counts, and a maximum: exact
        else:
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


# ---------------------------------------------------------------------------------------------- found by themselves
@pytest.mark.parametrize("family", FAMILIES)
def test_the_routers_of_each_family_are_found_and_read(family: str) -> None:
    model = build(family)
    routers = find_routers(model)
    assert [r.name for r in routers] == list(gates(model))
    scores = "sigmoid" if family == "deepseek_v3" else "softmax"
    assert all(r.spec == RouterSpec(EXPERTS, TOP_K, scores) for r in routers)
    # one forward, read through the hooks, equals the routers' own output by hand
    window, seen = RouterWindow(), {}
    hooks = RouterHooks(model, window)
    for name, gate in gates(model).items():
        gate.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, (out[0], out[2])))
    hooks.active = True
    model(input_ids=torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(1)))
    for name, figures in window.figures().items():
        expected = by_hand([seen[name]], sigmoid=scores == "sigmoid")
        assert figures.load_share.tolist() == pytest.approx(expected["load_share"])
        assert float(figures.max_vio) == pytest.approx(expected["max_vio"])
        assert float(figures.dead) == expected["dead_experts"]
        assert float(figures.entropy) == pytest.approx(expected["entropy"], rel=1e-6)
        assert float(figures.logit_max) == expected["logit_max"]
        assert float(figures.z_loss) == pytest.approx(expected["z_loss"], rel=1e-6)
        assert float(figures.tokens) == 16
    hooks.remove()


def test_a_model_without_a_router_is_refused() -> None:
    with pytest.raises(StabilityConfigError, match=r"has no router RouterHealthMonitor knows.*register_router"):
        quiet_trainer(max_steps=1, callbacks=[RouterHealthMonitor()]).fit(TinyModule())


class LinearGateSparseMoeBlock(nn.Module):
    """An MoE block whose gate is a plain ``nn.Linear`` (as transformers 4 wrote them): the top-k is taken outside
    any module, so nothing here can be read."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        chosen = self.gate(x).softmax(-1).topk(2).indices
        return sum(
            torch.stack([e(x) for e in self.experts], -2).gather(-2, chosen[..., None].expand(-1, -1, 8)).sum(-2)
        )


def test_a_mixture_of_experts_with_no_readable_router_is_refused() -> None:
    with pytest.raises(
        StabilityConfigError, match=r"block \(LinearGateSparseMoeBlock\) look like a mixture of experts"
    ):
        find_routers(nn.Sequential(nn.Linear(8, 8), nn.ModuleDict({"block": LinearGateSparseMoeBlock()})))


class ChoosingRouter(nn.Module):
    """A router of its own shape: ``forward`` returns ``(weights, experts, logits)``."""

    def __init__(self, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.proj, self.k = nn.Linear(8, experts, bias=False), k

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = self.proj(x)
        weights, chosen = logits.softmax(-1).topk(self.k)
        return weights, chosen, logits


def _register_choosing(top_k: int | None = None) -> None:
    register_router(
        ChoosingRouter,
        routing=lambda module, args, kwargs, out: Routing(logits=out[2], experts=out[1]),
        spec=lambda module: RouterSpec(module.proj.out_features, top_k or module.k),
    )


def test_any_router_through_the_protocol() -> None:
    _register_choosing()
    model = nn.Sequential(nn.Linear(8, 8), ChoosingRouter())
    window, seen = RouterWindow(), []
    hooks = RouterHooks(model, window)
    model[1].register_forward_hook(lambda m, a, out: seen.append((out[2], out[1])))
    hooks.active = True
    for seed in (0, 1):  # two calls in one window
        model(torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(seed)))
    figures = window.figures()["1"]
    expected = by_hand(seen)
    assert figures.load_share.tolist() == pytest.approx(expected["load_share"])
    assert float(figures.z_loss) == pytest.approx(expected["z_loss"], rel=1e-6)
    assert float(figures.tokens) == 30
    hooks.active = False  # not counting: nothing changes
    model(torch.randn(3, 5, 8))
    assert float(window.figures()["1"].tokens) == 30
    window.reset()
    assert float(window.figures()["1"].tokens) == 0 and not window.seen


def test_a_spec_that_makes_no_sense_and_bad_arguments_are_refused() -> None:
    _register_choosing(top_k=5)
    with pytest.raises(StabilityConfigError, match=r"router '1' top_k.*5.*\[1, num_experts=4\]"):
        find_routers(nn.Sequential(nn.Linear(8, 8), ChoosingRouter()))
    _register_choosing()
    with pytest.raises(StabilityConfigError, match=r"cls.*not an nn.Module subclass"):
        register_router(int)  # type: ignore[arg-type]
    with pytest.raises(StabilityConfigError, match=r"routing.*not callable"):
        register_router(ChoosingRouter, routing=3)  # type: ignore[arg-type]
    with pytest.raises(StabilityConfigError, match="expert_shares"):
        RouterHealthMonitor(expert_shares="yes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- in a fit
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_every_figure_equals_one_computed_by_hand_from_the_same_forward(family: str) -> None:
    monitor, capture = _fit(family)
    layers = list(capture.calls)
    assert monitor.routers == layers and len(layers) == 2
    assert sorted(monitor.logged) == [0, 1, 2, 3]
    for batch, got in monitor.logged.items():
        _assert_figures(got, _expected(capture, range(batch, batch + 1), layers))


def test_the_window_is_every_step_since_the_last_logging_step_with_accumulation() -> None:
    """Logging every 2 optimizer steps of 2 micro-batches: each window holds 4 micro-batches' forwards."""
    monitor, capture = _fit("mixtral", steps=4, every=2, accumulate_grad_batches=2, module=MoELM(batches=8))
    assert sorted(monitor.logged) == [3, 7]  # the last micro-batch of optimizer steps 2 and 4
    _assert_figures(monitor.logged[3], _expected(capture, range(0, 4), list(capture.calls)))
    _assert_figures(monitor.logged[7], _expected(capture, range(4, 8), list(capture.calls)))


def test_activation_checkpointing_s_recomputed_forward_is_not_counted() -> None:
    """Every forward is run again in backward: the figures (ratios) would not show it, the window's counts would."""
    plain, _ = _fit("mixtral", steps=2, every=4)
    module = MoELM("mixtral")
    module.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed, capture = _fit("mixtral", steps=2, every=4, module=module)
    assert len(capture.calls[plain.routers[0]]) == 4  # each micro-batch's forward, and again in backward
    expected, got = plain.state_dict()["window"]["layers"], checkpointed.state_dict()["window"]["layers"]
    for name in plain.routers:
        assert got[name]["counts"] == expected[name]["counts"] and sum(got[name]["counts"]) == 2 * 4 * 8 * TOP_K
        assert got[name]["sums"] == pytest.approx(expected[name]["sums"], rel=1e-6)


def test_the_logged_keys_lie_below_no_other() -> None:
    monitor, _ = _fit("olmoe", steps=1)
    keys = set(monitor.logged[0])
    assert not keys_below_others(keys | {"stability/grad_norm"}), keys_below_others(keys)


def test_no_host_sync_and_no_tensor_from_host_data_is_added_to_any_step() -> None:
    """Against the same fit without it (a GradientNormMonitor in both, so that logging steps transfer in both)."""
    runs = {}
    for watched in (False, True):
        for count in (count_syncs_per_step, count_host_data_per_step):
            callbacks: list[pl.Callback] = [GradientNormMonitor()] + ([RouterHealthMonitor()] if watched else [])
            trainer = quiet_trainer(max_steps=8, log_every_n_steps=4, callbacks=callbacks)
            runs[watched, count.__name__] = count(trainer, MoELM("mixtral", batches=8))
    assert runs[True, "count_syncs_per_step"] == runs[False, "count_syncs_per_step"]
    assert runs[True, "count_host_data_per_step"] == runs[False, "count_host_data_per_step"]


# ---------------------------------------------------------------------------------------------- the step's state
def test_a_replayed_step_counts_its_tokens_once(tmp_path: Path) -> None:
    """StepReplay runs a flagged step's forward again (row 3b): the routers see it, the monitor does not count it.
    Logging every 2 steps, the replayed step shares its window with another step, so a count twice would show."""
    module = MoELM("mixtral", batches=8, lr=1e-2)
    flip = BitFlip(module, "model.lm_head", step=6)
    capture, monitor = Capture(module), Logged(log_every_n_steps=2)
    health = TrainingHealthMonitor(response="skip", warmup_steps=3, report=False)
    replay = StepReplay(quarantine_file=None)
    trainer = quiet_trainer(max_steps=8, callbacks=[capture, health, replay, monitor], default_root_dir=tmp_path)
    trainer.fit(module)
    assert flip.flipped and replay.counts["replays"] == 1
    layers = list(capture.calls)
    assert [b for b, _, _ in capture.calls[layers[0]]].count(6) >= 2  # the step's forward and its replay's
    once = Capture.__new__(Capture)  # each batch's first forward only
    once.calls = {
        name: [c for i, c in enumerate(calls) if c[0] not in {d[0] for d in calls[:i]}]
        for name, calls in capture.calls.items()
    }
    assert sorted(monitor.logged) == [1, 3, 5, 7]
    for batch, got in monitor.logged.items():
        _assert_figures(got, _expected(once, range(batch - 1, batch + 1), layers))


def _resumable(tmp_path: Path, ckpt: Path | None, steps: int, save: bool) -> Logged:
    module = MoELM("mixtral", batches=2)  # the checkpoint at step 2 is at an epoch's end: the data go on alike
    monitor = Logged(log_every_n_steps=4)
    callbacks: list[pl.Callback] = [monitor]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=False))
    trainer = quiet_trainer(max_steps=steps, callbacks=callbacks, enable_checkpointing=save)
    trainer.fit(module, ckpt_path=ckpt)
    return monitor


def test_a_resume_mid_window_logs_what_the_straight_run_logs(tmp_path: Path) -> None:
    straight = _resumable(tmp_path, None, steps=8, save=True)
    ckpt = tmp_path / "epoch=0-step=2.ckpt"
    window = torch.load(ckpt, weights_only=False)["callbacks"]
    assert any(state.get("window", {}).get("layers") for state in window.values())  # two steps in its window
    resumed = _resumable(tmp_path / "r", ckpt, steps=8, save=False)
    assert sorted(straight.logged) == sorted(resumed.logged) == [3, 7]
    assert resumed.logged == straight.logged  # bit for bit: the window at step 4 holds steps 1 to 4 in both


def test_its_state_survives_a_state_dict_round_trip_and_a_pickle() -> None:
    monitor = RouterHealthMonitor(log_every_n_steps=4)  # two steps counted, not logged yet
    quiet_trainer(max_steps=2, callbacks=[monitor]).fit(MoELM("mixtral"))
    state = monitor.state_dict()
    assert sum(state["window"]["layers"]["model.model.layers.0.mlp.gate"]["counts"]) == 2 * 4 * 8 * TOP_K
    other = RouterHealthMonitor()
    other.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert other.state_dict() == state
    copied = pickle.loads(pickle.dumps(monitor))
    assert copied.state_dict() == state and copied._hooks is None
