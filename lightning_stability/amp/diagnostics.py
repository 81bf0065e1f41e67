"""Fit-start checks for common mixed-precision mistakes, and ``check_training_status(model)``.

The checks (each a plain function returning a message or ``None``, so they are tested without a GPU):

* fp16 on a GPU without Tensor Cores (compute capability < 7.0): fp16 will not be faster.
* fp16 with a fused optimizer and ``Trainer(gradient_clip_val=...)``, which Lightning rejects at the
  first step: a :class:`~lightning_stability.errors.StabilityConfigError` at fit start naming the fixes.
* Parameters, or the loss, left in fp16 outside autocast (e.g. a model ``.half()``'d by hand): a
  warning naming the modules.
* fp16 with torch's fused SGD and momentum: its momentum buffer is left uninitialised when the loss
  scaler skips the first step, which happens whenever the first scale overflows.

:class:`PrecisionDiagnostics` runs them as a callback; :class:`LossScaleTuner
<lightning_stability.amp.callback.LossScaleTuner>` runs them too unless told not to.

:func:`check_training_status` is a quick diagnostic of a model: mean and max of the
per-parameter gradient norms and parameter norms, with one host transfer.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torch import Tensor, nn

from lightning_stability import _compat
from lightning_stability.errors import StabilityConfigError, check_bool, check_instance, config_error
from lightning_stability.ledger.skips import loss_scaler
from lightning_stability.norms import combine_norms, per_tensor_norms

_FP16_PRECISIONS = ("16-mixed", "16-true")
_MAX_NAMES = 5


def _names(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:_MAX_NAMES])
    return shown + (f" and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else "")


def tensor_core_problem(precision: str, device: torch.device, capability: tuple[int, int] | None) -> str | None:
    """A message when fp16 runs on a CUDA GPU without Tensor Cores (compute capability below 7.0).

    Args:
        precision: the Trainer's precision string, e.g. ``"16-mixed"``.
        device: the training device.
        capability: its CUDA compute capability, ``None`` when it is not a CUDA device.
    """
    if precision not in _FP16_PRECISIONS or device.type != "cuda" or capability is None:
        return None
    if tuple(capability) >= (7, 0):
        return None
    return (
        f"precision={precision!r} on a GPU with compute capability {capability[0]}.{capability[1]}, which "
        "has no Tensor Cores (they start at 7.0, Volta): fp16 matmuls will not be faster than fp32 and you "
        "pay for loss scaling. Fix: train with precision='32-true', or move to a GPU with compute "
        "capability >= 7.0."
    )


def fp16_modules(module: nn.Module) -> list[str]:
    """Names of the modules that directly own float16 parameters (the root is named by its class)."""
    found = []
    for name, sub in module.named_modules():
        if any(p.dtype == torch.float16 for p in sub.parameters(recurse=False)):
            found.append(name or type(sub).__name__)
    return found


def fp16_parameter_problem(module: nn.Module, precision: str) -> str | None:
    """A message when parameters are float16 although the precision does not ask for it."""
    if precision == "16-true":
        return None
    names = fp16_modules(module)
    if not names:
        return None
    if precision == "16-mixed":
        why = (
            "mixed precision keeps float32 master weights and runs fp16 only inside autocast (forward and "
            "backward in fp16, the update in fp32); with float16 weights the update itself is fp16, and "
            "GradScaler refuses to unscale float16 gradients"
        )
    else:
        why = f"precision={precision!r} runs them in float16 outside autocast, with no loss scaling"
    return (
        f"Parameters of {_names(names)} are float16 under precision={precision!r}: {why}. This usually "
        "comes from a `.half()` or `.to(torch.float16)` by hand. Fix: remove it and train with "
        "precision='16-mixed' (or 'bf16-mixed' where the hardware has it)."
    )


def loss_dtype_problem(loss: Tensor, precision: str) -> str | None:
    """A message when the training loss is float16 (computed outside autocast or from fp16 outputs)."""
    if precision == "16-true" or loss.dtype != torch.float16:
        return None
    return (
        f"The training loss is float16 under precision={precision!r}: it was computed outside autocast or "
        "from float16 outputs, so it loses precision and overflows above 65504. Fix: compute the loss in "
        "float32, e.g. `loss_fn(logits.float(), target)` (autocast keeps loss functions in fp32)."
    )


def _uses_loss_scaler(trainer: pl.Trainer) -> bool:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler is not None and bool(scaler.is_enabled())


def fused_clipping_problem(trainer: pl.Trainer) -> str | None:
    """A message when Lightning would refuse ``gradient_clip_val`` for a fused optimizer under fp16."""
    plugin = trainer.precision_plugin
    if not trainer.gradient_clip_val or not _uses_loss_scaler(trainer) or not isinstance(plugin, MixedPrecision):
        return None
    if type(plugin).clip_gradients is not MixedPrecision.clip_gradients:
        return None  # a subclass (e.g. FusedClipMixedPrecision) handles it
    fused = [type(o).__name__ for o in trainer.optimizers if _compat.step_supports_amp_scaling(o)]
    if not fused:
        return None
    return (
        f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) with the fused optimizer {fused[0]} under "
        "precision='16-mixed': Lightning refuses to clip gradients that a fused optimizer unscales inside "
        "step(). Fix: add LossScaleTuner() (it unscales before clipping and hands the overflow flag to the "
        "fused step), or clip with GradientNormMonitor(max_norm=...) instead of gradient_clip_val, or build "
        "the optimizer with fused=False."
    )


def fused_sgd_problem(trainer: pl.Trainer) -> str | None:
    """A message for torch's fused SGD with momentum under an fp16 loss scaler."""
    if not _uses_loss_scaler(trainer):
        return None
    for opt in trainer.optimizers:
        if isinstance(opt, torch.optim.SGD) and any(g.get("fused") and g.get("momentum") for g in opt.param_groups):
            return (
                "torch.optim.SGD(fused=True, momentum>0) under an fp16 loss scaler: when the scaler skips "
                "the first step (the first scale often overflows), the fused kernel leaves the momentum "
                "buffer uninitialised and the next update uses garbage. Fix: SGD(..., fused=False), or "
                "LossScaleTuner(init_scale='auto') so the first step rarely overflows."
            )
    return None


def run_fit_start_checks(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[str]:
    """Run every fit-start check: warn (on rank zero) for each problem found, and return the messages.

    Raises:
        StabilityConfigError: fp16 + fused optimizer + ``gradient_clip_val`` that Lightning would refuse.
    """
    error = fused_clipping_problem(trainer)
    if error is not None:
        raise StabilityConfigError(error)
    precision = str(trainer.precision)
    device = trainer.strategy.root_device
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    problems = [
        tensor_core_problem(precision, device, capability),
        fp16_parameter_problem(pl_module, precision),
        fused_sgd_problem(trainer),
    ]
    messages = [p for p in problems if p is not None]
    for message in messages:
        rank_zero_warn(message, category=UserWarning)
    return messages


def _first_loss(outputs: Any) -> Tensor | None:
    if isinstance(outputs, Tensor):
        return outputs
    if isinstance(outputs, dict) and isinstance(outputs.get("loss"), Tensor):
        return outputs["loss"]
    return None


class PrecisionDiagnostics(Callback):
    """Run the fit-start precision checks of this module (no per-step cost).

    At ``on_fit_start``: Tensor Cores, fused optimizer + clipping, float16 parameters, fused SGD.
    After the first training batch: the dtype of the loss (metadata only, no sync). Logs nothing.

    Raises:
        StabilityConfigError: at fit start for fp16 + fused optimizer + ``gradient_clip_val``.

    Example::

        trainer = L.Trainer(precision="16-mixed", callbacks=[PrecisionDiagnostics()])
    """

    def __init__(self) -> None:
        self._loss_checked = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._loss_checked = False
        run_fit_start_checks(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._loss_checked:
            self._loss_checked = True
            check_loss(trainer, outputs)


def check_loss(trainer: pl.Trainer, outputs: Any) -> str | None:
    """Warn (rank zero) when the training-step loss in ``outputs`` is float16; return the message."""
    loss = _first_loss(outputs)
    message = None if loss is None else loss_dtype_problem(loss, str(trainer.precision))
    if message is not None:
        rank_zero_warn(message, category=UserWarning)
    return message


# ---------------------------------------------------------------------- check_training_status
@dataclass(frozen=True)
class TrainingStatus:
    """What :func:`check_training_status` measured. Norms are L2 norms of whole parameter tensors.

    Attributes:
        num_params: parameter tensors measured.
        num_grads: those that have a gradient.
        grad_norm_mean, grad_norm_max: mean and max of the per-parameter gradient norms (NaN when
            there are no gradients; NaN or inf when a gradient is non-finite).
        grad_norm_max_name: the parameter with the largest (or first non-finite) gradient norm.
        grad_norm_total: the norm of the whole gradient.
        nonfinite_grads: parameters whose gradient norm is NaN or inf.
        param_norm_mean, param_norm_max: mean and max of the per-parameter norms.
        param_norm_max_name: the parameter with the largest norm.
    """

    num_params: int
    num_grads: int
    grad_norm_mean: float
    grad_norm_max: float
    grad_norm_max_name: str | None
    grad_norm_total: float
    nonfinite_grads: int
    param_norm_mean: float
    param_norm_max: float
    param_norm_max_name: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> str:
        """The two lines :func:`check_training_status` prints."""
        return (
            f"Grad norms: mean={self.grad_norm_mean:.4g} max={self.grad_norm_max:.4g} ({self.grad_norm_max_name}), "
            f"total {self.grad_norm_total:.4g}, non-finite {self.nonfinite_grads}/{self.num_grads}\n"
            f"Param norms: mean={self.param_norm_mean:.4g} max={self.param_norm_max:.4g} ({self.param_norm_max_name})"
        )

    def __str__(self) -> str:
        return (
            f"grad norm: mean {self.grad_norm_mean:.4g}, max {self.grad_norm_max:.4g} "
            f"({self.grad_norm_max_name}), total {self.grad_norm_total:.4g}, "
            f"non-finite {self.nonfinite_grads}/{self.num_grads} | "
            f"param norm: mean {self.param_norm_mean:.4g}, max {self.param_norm_max:.4g} "
            f"({self.param_norm_max_name})"
        )


def _stats(norms: Tensor) -> list[Tensor]:
    if norms.numel() == 0:
        nan = torch.full((), math.nan, dtype=torch.float32, device=norms.device)
        return [nan, nan, torch.full_like(nan, -1.0)]
    # torch.max/argmax propagate NaN, so a NaN norm is reported as the max and named
    return [norms.mean(), norms.max(), torch.argmax(norms).to(torch.float32)]


def check_training_status(model: nn.Module, verbose: bool = True) -> TrainingStatus:
    """Mean and max of the gradient norms and of the parameter norms of ``model``, printed as two lines.

    Call it after ``backward()`` (e.g. in ``on_before_optimizer_step``, where fp16 gradients are
    already unscaled) or at any time for parameter norms. Every value is computed on the device and
    moved to the host in **one** transfer. Sharded (``DTensor``) parameters are measured whole, which
    runs a collective: call it on every rank.

    Args:
        model: any module.
        verbose: print the two lines (on global rank 0 only); ``False`` only returns the status.

    Returns:
        A :class:`TrainingStatus` (printable; ``.as_dict()`` for loggers).

    Example::

        loss.backward()
        check_training_status(model)
        # Grad norms: mean=0.031 max=0.12 (net.0.weight), total 0.19, non-finite 0/6
        # Param norms: mean=0.81 max=2.3 (net.0.weight)
    """
    check_instance("model", model, nn.Module, "an nn.Module", "pl_module")
    check_bool("verbose", verbose)
    named = [(n, p) for n, p in model.named_parameters()]
    if not named:
        raise config_error("model", type(model).__name__, "has no parameters", "pass the module being trained")
    with_grad = [(n, p) for n, p in named if p.grad is not None]
    param_norms = per_tensor_norms([p.detach() for _, p in named])
    device = param_norms.device
    if with_grad:
        grad_norms = per_tensor_norms([p.grad for _, p in with_grad]).to(device)  # type: ignore[misc]
    else:
        grad_norms = torch.zeros(0, dtype=torch.float32, device=device)
    values = [
        *_stats(grad_norms),
        combine_norms(grad_norms) if with_grad else torch.full((), math.nan, device=device),
        (~torch.isfinite(grad_norms)).sum().to(torch.float32),
        *_stats(param_norms),
    ]
    # HOST SYNC: the one transfer of this function.
    host = torch.stack([v.to(torch.float64) for v in values]).to("cpu", copy=True).tolist()
    g_mean, g_max, g_arg, g_total, nonfinite, p_mean, p_max, p_arg = host
    status = TrainingStatus(
        num_params=len(named),
        num_grads=len(with_grad),
        grad_norm_mean=g_mean,
        grad_norm_max=g_max,
        grad_norm_max_name=with_grad[int(g_arg)][0] if g_arg >= 0 else None,
        grad_norm_total=g_total,
        nonfinite_grads=int(nonfinite),
        param_norm_mean=p_mean,
        param_norm_max=p_max,
        param_norm_max_name=named[int(p_arg)][0],
    )
    if verbose and getattr(rank_zero_only, "rank", 0) == 0:  # the rank Lightning set, 0 outside a run
        print(status.lines())
    return status


def fp16_without_scaler_problem(trainer: pl.Trainer) -> str | None:
    """A message when the run trains in fp16 under Lightning's ``ModelParallelStrategy``, which has no loss scaler
    (Lightning refuses ``"16-mixed"`` there and lets ``"16-true"`` through): fp16 gradients unscaled underflow, and a
    norm, a clip or a skip on them acts on what is left. ``None`` otherwise."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    precision = str(getattr(trainer.precision_plugin, "precision", trainer.precision))
    if not isinstance(trainer.strategy, ModelParallelStrategy) or not precision.startswith("16"):
        return None
    if loss_scaler(trainer) is not None:
        return None
    return (
        f"Trainer(precision={precision!r}) under Lightning's ModelParallelStrategy trains in fp16 with no loss "
        "scaler (the strategy has none): small gradients underflow to zero, and the gradient norm, clipping and "
        "non-finite skips would act on what is left. Fix: strategy=StableFSDPStrategy(tensor_parallel=N, "
        'mixed_precision="16-mixed") (the same data_parallel x tensor_parallel mesh and configure_model, with a '
        "loss scaler every rank agrees on), or precision='bf16-mixed'."
    )
