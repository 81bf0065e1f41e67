"""lightning_stability: keep large-model training with PyTorch Lightning stable."""

from lightning_stability.callbacks.grad_norm import GradientNormMonitor
from lightning_stability.errors import StabilityConfigError
from lightning_stability.ledger import Outcome, StepLedger

__all__ = [
    "GradientNormMonitor",
    "Outcome",
    "StabilityConfigError",
    "StepLedger",
]
__version__ = "0.1.0"
