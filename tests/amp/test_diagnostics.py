"""Fit-start precision checks and check_training_status."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from lightning_stability.amp.callback import LossScaleTuner
from lightning_stability.amp.diagnostics import (
    PrecisionDiagnostics,
    TrainingStatus,
    check_training_status,
    fp16_modules,
    tensor_core_problem,
)
from lightning_stability.errors import StabilityConfigError
from tests.helpers import SyncCounter, TinyModule, quiet_trainer


def fp16_plugin() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))


class HalfMiddle(TinyModule):
    """TinyModule whose middle Linear was `.half()`'d by hand (the forward casts around it)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net[2].half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.net[0](x))
        h = torch.tanh(self.net[2](h.half())).float()
        return self.net[4](h)


class HalfLoss(TinyModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx).half()


def ours(caught: list[warnings.WarningMessage]) -> list[str]:
    keys = ("are float16", "training loss is float16", "Tensor Cores", "fused=True, momentum")
    return [str(w.message) for w in caught if any(k in str(w.message) for k in keys)]


def fit_recording(module: TinyModule, max_steps: int = 2, **kwargs: Any) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(max_steps=max_steps, **kwargs).fit(module)
    return ours(caught)


# ---------------------------------------------------------------------- Tensor Cores
@pytest.mark.parametrize(
    ("precision", "device", "capability", "warns"),
    [
        ("16-mixed", "cuda", (6, 1), True),  # Pascal
        ("16-true", "cuda", (5, 2), True),
        ("16-mixed", "cuda", (7, 0), False),  # Volta: first Tensor Cores
        ("16-mixed", "cuda", (9, 0), False),
        ("bf16-mixed", "cuda", (6, 1), False),  # not fp16
        ("32-true", "cuda", (6, 1), False),
        ("16-mixed", "cpu", None, False),
    ],
)
def test_tensor_core_problem(precision: str, device: str, capability: tuple[int, int] | None, warns: bool) -> None:
    message = tensor_core_problem(precision, torch.device(device), capability)
    assert (message is not None) == warns
    if message is not None:
        assert f"compute capability {capability[0]}.{capability[1]}" in message  # type: ignore[index]
        assert "Fix: train with precision='32-true'" in message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tensor_core_check_on_this_gpu() -> None:
    capability = torch.cuda.get_device_capability()
    messages = fit_recording(TinyModule(), precision="16-mixed", accelerator="cuda", callbacks=[PrecisionDiagnostics()])
    assert any("Tensor Cores" in m for m in messages) == (capability < (7, 0))


# ---------------------------------------------------------------------- fp16 outside autocast
def test_fp16_modules_names_the_owners() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2).half(), nn.ReLU()), nn.Linear(2, 2))
    assert fp16_modules(model) == ["1.0"]
    assert fp16_modules(nn.Linear(2, 2).half()) == ["Linear"]
    assert fp16_modules(model.float()) == []


def test_half_module_under_fp32_warns_with_its_name() -> None:
    messages = fit_recording(HalfMiddle(), callbacks=[PrecisionDiagnostics()])
    assert len(messages) == 1
    assert messages[0].startswith("Parameters of 'net.2' are float16 under precision='32-true'")
    assert "Fix: remove it and train with precision='16-mixed'" in messages[0]


def test_half_module_under_16_mixed_warns_before_torch_refuses() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            quiet_trainer(max_steps=2, plugins=[fp16_plugin()], callbacks=[PrecisionDiagnostics()]).fit(HalfMiddle())
    messages = ours(caught)
    assert len(messages) == 1 and "GradScaler refuses to unscale float16 gradients" in messages[0]


def test_fp16_loss_warns_once() -> None:
    messages = fit_recording(HalfLoss(), max_steps=3, callbacks=[PrecisionDiagnostics()])
    assert len(messages) == 1 and messages[0].startswith("The training loss is float16 under precision='32-true'")


def test_a_clean_fp16_run_warns_about_nothing() -> None:
    assert fit_recording(TinyModule(), plugins=[fp16_plugin()], callbacks=[PrecisionDiagnostics()]) == []


def test_the_tuner_runs_the_checks_once_even_next_to_precision_diagnostics() -> None:
    assert len(fit_recording(HalfMiddle(), callbacks=[LossScaleTuner()])) == 1
    assert len(fit_recording(HalfMiddle(), callbacks=[LossScaleTuner(), PrecisionDiagnostics()])) == 1
    assert fit_recording(HalfMiddle(), callbacks=[LossScaleTuner(fit_start_checks=False)]) == []


# ---------------------------------------------------------------------- fused optimizers
def test_torch_fused_sgd_corrupts_momentum_when_the_first_step_is_skipped() -> None:
    """The torch behaviour the fused-SGD warning is about; if this starts failing, drop the warning."""

    def two_steps(fused: bool) -> torch.Tensor:
        p = nn.Parameter(torch.ones(64))
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=fused or None)
        for grad, skip in ((torch.full((64,), math.inf), True), (torch.ones(64), False)):
            p.grad = grad
            if fused:  # what GradScaler.step does for a fused optimizer
                opt.grad_scale, opt.found_inf = None, torch.tensor(float(skip))  # type: ignore[attr-defined]
                opt.step()
                del opt.grad_scale, opt.found_inf  # type: ignore[attr-defined]
            elif not skip:
                opt.step()
        return opt.state[p]["momentum_buffer"]

    torch.manual_seed(0)
    assert torch.equal(two_steps(False), torch.ones(64))
    assert not torch.equal(two_steps(True), torch.ones(64))


def test_fused_sgd_under_fp16_warns() -> None:
    messages = fit_recording(
        TinyModule(optimizer="sgd_fused"), plugins=[fp16_plugin()], callbacks=[PrecisionDiagnostics()]
    )
    assert len(messages) == 1 and "Fix: SGD(..., fused=False)" in messages[0]
    assert (
        fit_recording(TinyModule(optimizer="adamw_fused"), plugins=[fp16_plugin()], callbacks=[PrecisionDiagnostics()])
        == []
    )
    assert fit_recording(TinyModule(optimizer="sgd_fused"), callbacks=[PrecisionDiagnostics()]) == []  # no scaler


def test_fused_optimizer_with_gradient_clip_val_is_an_error_at_fit_start() -> None:
    trainer = quiet_trainer(
        max_steps=2, plugins=[fp16_plugin()], gradient_clip_val=1.0, callbacks=[PrecisionDiagnostics()]
    )
    with pytest.raises(
        StabilityConfigError,
        match=r"Trainer\(gradient_clip_val=1.0\) with the fused optimizer AdamW.*Fix: add LossScaleTuner\(\)",
    ):
        trainer.fit(TinyModule(optimizer="adamw_fused"))
    assert trainer.global_step == 0


def test_with_the_tuner_fused_clipping_passes_the_check() -> None:
    callbacks = [PrecisionDiagnostics(), LossScaleTuner(init_scale=256)]
    trainer = quiet_trainer(max_steps=3, plugins=[fp16_plugin()], gradient_clip_val=1.0, callbacks=callbacks)
    trainer.fit(TinyModule(optimizer="adamw_fused"))
    assert trainer.global_step == 3


# ---------------------------------------------------------------------- check_training_status
def test_check_training_status_matches_a_manual_computation() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model[2].bias.requires_grad_(False)
    model(torch.randn(16, 4)).pow(2).mean().backward()
    with SyncCounter() as counter:
        status = check_training_status(model)
    assert counter.count == 1  # one host transfer

    named = dict(model.named_parameters())
    grads = {n: p.grad.norm().item() for n, p in named.items() if p.grad is not None}
    params = {n: p.detach().norm().item() for n, p in named.items()}
    assert status.num_params == 4 and status.num_grads == 3
    assert status.grad_norm_mean == pytest.approx(sum(grads.values()) / 3, rel=1e-6)
    assert status.grad_norm_max == pytest.approx(max(grads.values()), rel=1e-6)
    assert status.grad_norm_max_name == max(grads, key=grads.__getitem__)
    assert status.grad_norm_total == pytest.approx(math.sqrt(sum(v * v for v in grads.values())), rel=1e-6)
    assert status.param_norm_mean == pytest.approx(sum(params.values()) / 4, rel=1e-6)
    assert status.param_norm_max == pytest.approx(max(params.values()), rel=1e-6)
    assert status.param_norm_max_name == max(params, key=params.__getitem__)
    assert status.nonfinite_grads == 0
    assert "grad norm: mean" in str(status) and status.as_dict()["num_grads"] == 3


def test_check_training_status_names_a_nan_gradient_and_handles_no_gradients() -> None:
    second = nn.Linear(2, 2)
    model = nn.Sequential(nn.Linear(2, 2), second)
    fresh = check_training_status(model)
    assert isinstance(fresh, TrainingStatus)
    assert fresh.num_grads == 0 and math.isnan(fresh.grad_norm_mean) and fresh.grad_norm_max_name is None
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    bad = second.weight.grad
    assert bad is not None
    bad[0, 0] = math.nan
    status = check_training_status(model)
    assert status.nonfinite_grads == 1
    assert status.grad_norm_max_name == "1.weight" and math.isnan(status.grad_norm_max)


def test_check_training_status_rejects_a_model_without_parameters() -> None:
    with pytest.raises(StabilityConfigError, match=r"`model='ReLU'` has no parameters"):
        check_training_status(nn.ReLU())


def test_check_training_status_called_as_a_statement_prints_its_two_lines(capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    model(torch.ones(4, 2)).sum().backward()
    status = check_training_status(model)
    out = capsys.readouterr().out.splitlines()
    assert out == status.lines().splitlines()
    assert out[0].startswith(f"Grad norms: mean={status.grad_norm_mean:.4g} max={status.grad_norm_max:.4g} (")
    assert out[1].startswith(f"Param norms: mean={status.param_norm_mean:.4g} max={status.param_norm_max:.4g} (")
    check_training_status(model, verbose=False)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("callback", ["LossScaleTuner", "GradientNormMonitor"])
def test_fp16_under_lightnings_model_parallel_strategy_is_refused_at_setup_naming_our_strategy(
    callback: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's ModelParallelStrategy has no loss scaler and lets precision="16-true" through: both callbacks
    refuse at setup, naming StableFSDPStrategy(tensor_parallel=N, mixed_precision="16-mixed")."""
    import os

    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_stability import GradientNormMonitor

    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):  # the launcher writes them
        monkeypatch.setenv(key, os.environ.get(key, ""))
        monkeypatch.delenv(key)
    made = LossScaleTuner() if callback == "LossScaleTuner" else GradientNormMonitor(max_norm=1.0)
    trainer = quiet_trainer(strategy=ModelParallelStrategy(), precision="16-true", max_steps=1, callbacks=[made])
    try:
        with pytest.raises(StabilityConfigError, match=r"no loss scaler.*StableFSDPStrategy\(tensor_parallel=N"):
            trainer.fit(TinyModule())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
