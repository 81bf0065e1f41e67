"""Precision plugin of :class:`~lightning_stability.strategies.fsdp.StableFSDPStrategy`.

FSDP2 applies mixed precision per module (``MixedPrecisionPolicy``): the sharded fp32 parameters are
the master weights, each unit all-gathers them cast to the compute dtype, and gradients are reduced in
``reduce_dtype`` (fp32 by default) before they land on the fp32 shards. No ``autocast`` is involved.
This plugin holds that policy, the loss scaler for fp16 and the Trainer's gradient clipping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.optim import LBFGS, Optimizer

from lightning_stability import _compat
from lightning_stability.errors import StabilityConfigError, config_error
from lightning_stability.ledger.skips import unscale_if_deferred
from lightning_stability.norms import clip_by_global_norm_

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.fsdp import MixedPrecisionPolicy

PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
_DTYPES = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_DTYPES.update({"bf16-true": torch.bfloat16, "16-true": torch.float16})


def rank_consistent_scaler(device_type: str, **kwargs: Any) -> torch.amp.GradScaler:
    """A loss scaler whose overflow flag is the same on every rank.

    ``ShardedGradScaler`` all-reduces ``found_inf`` across the process group in ``unscale_``, so an
    inf in one rank's shard skips the step, and backs the scale off, on every rank. (For DTensor
    gradients, torch's DTensor dispatch also max-reduces the flag over the shard dimensions.)
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device_type, **kwargs)


@contextmanager
def default_dtype_context(dtype: torch.dtype) -> Iterator[None]:
    """Make ``dtype`` the default floating dtype inside the block (``*-true`` precisions)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _defers_unscaling(optimizer: Any) -> bool:
    """Fused optimizers unscale inside ``step()``; Lightning leaves their gradients scaled."""
    return _compat.step_supports_amp_scaling(optimizer)


class StableFSDPPrecision(Precision):
    """FSDP2 mixed precision with fp32 master weights and fp32 gradient reduction by default.

    ===============  ==============  ==============  ===================  ==========
    ``precision``    compute dtype   master weights  reduction (default)  loss scale
    ===============  ==============  ==============  ===================  ==========
    ``"32-true"``    fp32            fp32            fp32                 no
    ``"bf16-mixed"`` bf16            fp32            fp32                 no
    ``"16-mixed"``   fp16            fp32            fp32                 yes
    ``"bf16-true"``  bf16            bf16            fp32                 no
    ``"16-true"``    fp16            fp16            fp32                 no
    ===============  ==============  ==============  ===================  ==========

    Clipping with ``Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")`` uses the norm of
    the whole gradient across every shard (:mod:`lightning_stability.norms`), on the device.

    Args:
        precision: one of the rows above.
        reduce_dtype: dtype of the gradient reduce-scatter/all-reduce; ``None`` reduces in the
            compute dtype (less traffic, less accuracy).
        scaler: the loss scaler for ``"16-mixed"``; default: :func:`rank_consistent_scaler`.
            Lives in ``.scaler``, which a loss-scale tuner may replace.
        device_type: device type of the default scaler (``"cuda"``, ``"cpu"``).
        policy: an explicit ``MixedPrecisionPolicy`` for the wrapped blocks (overrides the dtypes).

    Raises:
        StabilityConfigError: for an unknown ``precision`` or a scaler with a precision that has none.

    Example::

        plugin = StableFSDPPrecision("bf16-mixed")  # usually built by StableFSDPStrategy
    """

    def __init__(
        self,
        precision: str = "32-true",
        reduce_dtype: torch.dtype | None = torch.float32,
        scaler: torch.amp.GradScaler | None = None,
        device_type: str | None = None,
        policy: MixedPrecisionPolicy | None = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise config_error(
                "precision", precision, "is not supported by StableFSDPStrategy", f"use one of {PRECISIONS}"
            )
        if scaler is not None and precision != "16-mixed" and not (policy and policy.param_dtype == torch.float16):
            raise config_error("scaler", scaler, f"is only used with '16-mixed', not {precision!r}", "drop it")
        self.precision = cast(Any, precision)
        self.reduce_dtype = reduce_dtype
        self.policy = policy
        self.param_dtype: torch.dtype | None = policy.param_dtype if policy is not None else _DTYPES[precision]
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        if scaler is None and self.param_dtype == torch.float16 and not precision.endswith("-true"):
            scaler = rank_consistent_scaler(device_type)
        self.scaler = scaler
        #: set by the strategy for backends whose gradients are not DTensors (FairScale's flat shards)
        self.clip_norm_fn: Callable[[float], Any] | None = None

    # ------------------------------------------------------------------ FSDP2 policies
    def mp_policy(self, *, cast_forward_inputs: bool = True, output_dtype: torch.dtype | None = None) -> Any:
        """The ``MixedPrecisionPolicy`` of one kind of unit (blocks, top-level units, root)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.policy is not None:
            return MixedPrecisionPolicy(
                param_dtype=self.policy.param_dtype,
                reduce_dtype=self.policy.reduce_dtype,
                output_dtype=output_dtype or self.policy.output_dtype,
                cast_forward_inputs=cast_forward_inputs and self.policy.cast_forward_inputs,
            )
        if self.param_dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            output_dtype=output_dtype,
            cast_forward_inputs=cast_forward_inputs,
        )

    @property
    def is_true_half(self) -> bool:
        return self.precision in ("bf16-true", "16-true")

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.is_true_half:
            return module.to(dtype=self.param_dtype)
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        return default_dtype_context(self.param_dtype) if self.is_true_half and self.param_dtype else nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    # ------------------------------------------------------------------ loss scaling
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        scaler = self.scaler
        if scaler is None or not scaler.is_enabled():
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise StabilityConfigError("LBFGS cannot step under a loss scaler. Fix: use precision 'bf16-mixed'.")
        closure_result = closure()
        skipped_backward = closure_result is None and getattr(model, "automatic_optimization", True)
        if not skipped_backward and not _defers_unscaling(optimizer):
            # unscale now so callbacks and clipping see true gradients; the rank-consistent scaler
            # all-reduces its overflow flag here
            scaler.unscale_(optimizer)
        _compat.after_closure(self, model, optimizer)
        if skipped_backward:
            return closure_result
        # the scaler skips the update when any rank found inf/NaN
        step_output = scaler.step(optimizer, **kwargs)
        scaler.update()
        return step_output

    def _unscale_deferred(self, optimizer: Optimizer) -> None:
        scaler = self.scaler
        if scaler is not None and scaler.is_enabled():
            unscale_if_deferred(scaler, optimizer)  # only fused optimizers, and only once per step

    # ------------------------------------------------------------------ clipping
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val > 0:
            self._unscale_deferred(optimizer)  # never clip gradients that are still scaled
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip by the norm of the whole gradient across all shards (no host sync)."""
        if self.clip_norm_fn is not None:
            self.clip_norm_fn(float(clip_val))
            return
        grads = [p.grad for p in self.main_params(optimizer) if p.grad is not None]
        if grads:
            clip_by_global_norm_(grads, float(clip_val))

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)
