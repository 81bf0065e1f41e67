"""RouterHealthMonitor used as users use it: two optimizers (manual optimization), ``Tuner.lr_find`` with the monitor
attached, a LightningCLI YAML config naming it, the keys in file-based loggers (MLflow's store, TensorBoard)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import Logger
from lightning.pytorch.tuner import Tuner
from torch import Tensor, nn

from lightning_stability import StabilityConfigError, StableTrainer
from lightning_stability.ledger import StepLedger
from lightning_stability.moe import RouterHealthMonitor
from tests.helpers import quiet_trainer
from tests.moe.moe_lm import EXPERTS, MoELM, gates
from tests.moe.test_router_health import Capture, Logged, _assert_figures, _expected

warnings.filterwarnings("ignore", ".*eos_token_id.*")
warnings.filterwarnings("ignore", ".*does not have many workers.*")


def _bias_by_hand(capture: Capture, name: str, rate: float) -> list[float]:
    """The balancing bias after every captured batch: ``sum over batches of rate * sign(mean - counts)``, the
    counts those of the biased choice the router made (every step applied)."""
    bias = torch.zeros(EXPERTS)
    for batch in sorted({b for b, _, _ in capture.calls[name]}):
        chosen = torch.cat([ex.reshape(-1) for b, _, ex in capture.calls[name] if b == batch])
        counts = nn.functional.one_hot(chosen, EXPERTS).sum(dim=0).float()
        bias += rate * torch.sign(counts.mean() - counts)
    return bias.tolist()


# ------------------------------------------------------------------------------------------------ two optimizers
class TwoOptimizers(MoELM):
    """Manual optimization with two AdamW: the routers' weights in the second (``routers_first=False``) or the
    first, every other parameter in the other; both step on every batch."""

    def __init__(self, routers_first: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.routers_first = routers_first

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        first, second = self.optimizers()  # type: ignore[misc]
        loss = self.model(input_ids=batch, labels=batch).loss
        self.manual_backward(loss)
        for optimizer in (first, second):
            optimizer.step()
            optimizer.zero_grad()
        return loss

    def configure_optimizers(self) -> Any:
        routers = {id(p) for gate in gates(self).values() for p in gate.parameters()}
        mine = [p for p in self.parameters() if id(p) in routers]
        rest = [p for p in self.parameters() if id(p) not in routers]
        groups = (mine, rest) if self.routers_first else (rest, mine)
        return tuple(torch.optim.AdamW(params, lr=self.lr) for params in groups)


class ActsAfter(Logged):
    """The monitor, noting after which optimizer's update (its index) its actions ran, by batch."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.acted: list[tuple[int, int]] = []

    def _after_update(self, ledger: StepLedger) -> None:
        before = [r.module.balance_bias.clone() for r in self._biased]  # type: ignore[operator]
        super()._after_update(ledger)
        if any(not torch.equal(b, r.module.balance_bias) for b, r in zip(before, self._biased, strict=True)):
            trainer = ledger.trainer
            assert trainer is not None
            index = next(i for i, o in enumerate(trainer.optimizers) if o is ledger.step.optimizer)
            self.acted.append((self._batch, index))


@pytest.mark.parametrize("routers_first", [False, True])
def test_two_optimizers_log_each_window_once_and_act_once_a_batch_after_the_routers_update(
    routers_first: bool,
) -> None:
    """Both optimizers step on every batch: the window's figures are recorded on the first one's logging step
    (under its name), equal to those by hand; the bias moves once a batch, after the update of the optimizer that
    holds the routers."""
    module = TwoOptimizers(routers_first=routers_first, batches=6)
    capture, monitor = Capture(module), ActsAfter(log_every_n_steps=2, balance_bias=0.05)
    trainer = quiet_trainer(max_steps=12, callbacks=[capture, monitor])  # 2 optimizer steps a batch
    trainer.fit(module)
    layers = list(gates(module))
    assert sorted(monitor.logged) == [1, 3, 5]
    for last in (1, 3, 5):
        _assert_figures(monitor.logged[last], _expected(capture, range(last - 1, last + 1), layers))
    # two AdamW are named "AdamW" and "AdamW-1": the keys carry the first one's name, whichever holds the routers
    assert "stability/router/max_vio/AdamW" in trainer.callback_metrics
    assert not any(k.endswith("/AdamW-1") for k in trainer.callback_metrics if k.startswith("stability/router/"))
    holder = 0 if routers_first else 1
    moved = [batch for batch, _ in monitor.acted]
    assert len(moved) == len(set(moved)) and all(index == holder for _, index in monitor.acted)
    for name in layers:
        assert monitor.bias_values()[name] == pytest.approx(_bias_by_hand(capture, name, 0.05))


# ------------------------------------------------------------------------------------------------------ lr_find
class Tunable(MoELM):
    def __init__(self) -> None:
        super().__init__(batches=20)
        self.learning_rate = self.lr

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


def test_lr_find_with_the_monitor_attached_counts_and_moves_nothing(tmp_path: Path) -> None:
    """``Tuner.lr_find`` runs its steps with its own callback alone: the monitor counts none of them, its bias does
    not move, and the fit after it logs the figures of its own steps (equal to those by hand), each router hooked
    once."""
    module = Tunable()
    capture, monitor = Capture(module), Logged(log_every_n_steps=2, balance_bias=0.05, z_loss=1e-3)
    trainer = quiet_trainer(max_steps=4, callbacks=[capture, monitor], default_root_dir=tmp_path)
    tuned = Tuner(trainer).lr_find(module, min_lr=1e-4, max_lr=1e-1, num_training=8, update_attr=False)
    assert tuned is not None and len(tuned.results["lr"]) == 8  # it did run its steps
    assert monitor.logged == {} and not monitor.window.seen
    assert all(b == [0.0] * EXPERTS for b in monitor.bias_values().values())
    for calls in capture.calls.values():
        calls.clear()
    trainer.fit(module)
    assert all(len(gate._forward_hooks) == 2 for gate in gates(module).values())  # the capture's, the bias's
    layers = list(gates(module))
    assert sorted(monitor.logged) == [1, 3]
    for last in (1, 3):
        _assert_figures(monitor.logged[last], _expected(capture, range(last - 1, last + 1), layers))
    for name in layers:
        assert monitor.bias_values()[name] == pytest.approx(_bias_by_hand(capture, name, 0.05))


# --------------------------------------------------------------------------------------------------- LightningCLI
CONFIG = """
model:
  family: olmoe
  batches: 4
trainer:
  max_steps: 4
  log_every_n_steps: 2
  callbacks:
    - class_path: lightning_stability.RouterHealthMonitor
      init_args: {expert_shares: false, z_loss: 0.001, logit_clip: 30.0, balance_bias: 0.01}
"""
QUIET = ["--trainer.accelerator=cpu", "--trainer.logger=false", "--trainer.enable_progress_bar=false"]


def test_the_monitor_and_its_actions_from_a_yaml_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    cli = LightningCLI(MoELM, run=False, save_config_callback=None, args=[f"--config={config}", *QUIET])
    (monitor,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, RouterHealthMonitor)]  # type: ignore[attr-defined]
    assert (monitor.z_loss, monitor.logit_clip, monitor.balance_bias) == (0.001, 30.0, 0.01)
    assert monitor.expert_shares is False
    cli.trainer.fit(cli.model)
    assert cli.trainer.global_step == 4
    assert "stability/router/max_vio" in cli.trainer.callback_metrics
    assert not any("load_share" in k for k in cli.trainer.callback_metrics)
    assert any(any(v != 0 for v in b) for b in monitor.bias_values().values())


def test_the_moe_preset_s_router_actions_from_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["--trainer.preset=moe", "--trainer.preset_overrides={router_z_loss: null}", "--trainer.max_steps=2"]
    cli = LightningCLI(MoELM, trainer_class=StableTrainer, run=False, save_config_callback=None, args=[*args, *QUIET])
    (monitor,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, RouterHealthMonitor)]  # type: ignore[attr-defined]
    assert (monitor.balance_bias, monitor.z_loss) == (1e-3, None)


def test_the_moe_preset_on_a_router_it_cannot_bias_says_which_field_turns_the_bias_off(tmp_path: Path) -> None:
    trainer = StableTrainer.from_preset(
        "moe", accelerator="cpu", max_steps=1, default_root_dir=tmp_path, logger=False, enable_progress_bar=False
    )
    with pytest.raises(StabilityConfigError, match=r"DeepseekV3TopkRouter.*router_balance_bias=None"):
        trainer.fit(MoELM("deepseek_v3"))
    trainer = StableTrainer.from_preset(
        "moe",
        router_balance_bias=None,
        accelerator="cpu",
        max_steps=2,
        default_root_dir=tmp_path,
        logger=False,
        enable_progress_bar=False,
    )
    trainer.fit(MoELM("deepseek_v3"))  # the z-loss alone reaches a DeepSeek-V3 router
    assert trainer.global_step == 2


# -------------------------------------------------------------------------------------------------------- loggers
class FileStore(Logger):
    """A logger that stores each metric as a file at its key's path under ``root``, as MLflow's file store does:
    a key that is also the folder of another (``x`` and ``x/y``) fails there, and so here."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.steps: dict[str, list[int]] = {}

    @property
    def name(self) -> str:
        return "files"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            path = self.root / "metrics" / key
            path.parent.mkdir(parents=True, exist_ok=True)  # fails where a part of the key is already a file
            with path.open("a") as f:  # fails where the key is already a folder
                f.write(f"{step} {value}\n")
            self.steps.setdefault(key, []).append(int(step or 0))


def _logged_fit(logger: Logger, tmp_path: Path) -> tuple[Logged, list[str]]:
    module = MoELM("qwen2_moe", batches=4)
    monitor = Logged(log_every_n_steps=2, balance_bias=1e-2)
    quiet_trainer(max_steps=4, callbacks=[monitor], logger=logger, default_root_dir=tmp_path).fit(module)
    return monitor, list(gates(module))


def test_every_key_reaches_a_file_based_store(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    monitor, layers = _logged_fit(store, tmp_path)
    keys = {k for k in store.steps if k.startswith("stability/router/")}
    assert keys == set(monitor.logged[1]) == set(monitor.logged[3])
    assert len(keys) == 5 + len(layers) * (5 + EXPERTS)
    assert all(store.steps[k] == [1, 3] for k in keys)  # Lightning's step labels of the logging steps


def test_tensorboard_gets_every_key(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    monitor, _ = _logged_fit(logger, tmp_path)
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {k for k in scalars if k.startswith("stability/router/")} == set(monitor.logged[1])
    for key, value in monitor.logged[3].items():
        assert events.Scalars(key)[-1].value == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_mlflow_gets_every_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's file store, where a key that is also another's folder fails."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses the file store without it
    from lightning.pytorch.loggers import MLFlowLogger

    logger = MLFlowLogger(experiment_name="router", tracking_uri=f"file:{tmp_path / 'mlruns'}")
    monitor, _ = _logged_fit(logger, tmp_path)
    run = logger.experiment.get_run(logger.run_id)
    assert {k for k in run.data.metrics if k.startswith("stability/router/")} == set(monitor.logged[1])
