"""GPU check of StableFSDPStrategy(backend="fairscale") and of the native backend on CUDA (NCCL).

Skipped without CUDA (the CPU suite covers the native backend with gloo) and without FairScale
(``pip install 'lightning-stability[fairscale]'``). Run on a GPU machine with
``python -m pytest -q tests/gpu``; it uses every visible GPU.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers import torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_fairscale_backend_and_native_backend_train_clip_and_resume_on_gpus(tmp_path: Path) -> None:
    pytest.importorskip("fairscale")
    world = torch.cuda.device_count()
    results = torchrun(Path(__file__).with_name("fsdp_gpu_run.py"), world, tmp_path, timeout=600)
    for rank in range(world):
        for name in ("fairscale", "native"):
            run = results[rank][name]
            assert run["resumed_exactly"], f"{name}: weights after loading differ from the saved ones"
            assert all(math.isfinite(loss) for loss in run["losses"])
            assert run["losses"][-1] < run["losses"][0]  # it learns, across the resume
        assert results[rank]["fairscale"]["scaler"] == "ShardedGradScaler"
        assert results[rank]["native"]["sharded"]
