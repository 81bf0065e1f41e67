"""GPU check of StableFSDPStrategy(backend="fairscale") and of the native backend on CUDA (NCCL).

Skipped without CUDA (the CPU suite covers the native backend with gloo); the FairScale one also without
FairScale (the ``fairscale`` extra: ``pip install -e ".[fairscale]"``). Run on a GPU machine with
``python -m pytest -q tests/gpu``; it uses every visible GPU.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _check(results: list[dict[str, Any]], name: str) -> None:
    for rank, result in enumerate(results):
        run = result[name]
        assert run["resumed_exactly"], f"rank {rank}, {name}: weights after loading differ from the saved ones"
        assert all(math.isfinite(loss) for loss in run["losses"]), run["losses"]
        assert run["losses"][-1] < run["losses"][0], run["losses"]  # it learns, across the resume


def test_native_backend_trains_clips_and_resumes_on_every_visible_gpu(tmp_path: Path) -> None:
    """One GPU is enough: NCCL with world size 1 still shards through FSDP2 and writes a sharded checkpoint."""
    world = torch.cuda.device_count()
    results = torchrun(Path(__file__).with_name("fsdp_gpu_run.py"), world, tmp_path, "native", timeout=300)
    _check(results, "native")
    assert all(result["native"]["sharded"] for result in results)


def test_fairscale_backend_trains_clips_and_resumes_on_every_visible_gpu(tmp_path: Path) -> None:
    pytest.importorskip("fairscale")
    world = torch.cuda.device_count()
    results = torchrun(Path(__file__).with_name("fsdp_gpu_run.py"), world, tmp_path, "fairscale", timeout=300)
    _check(results, "fairscale")
    assert all(result["fairscale"]["scaler"] == "ShardedGradScaler" for result in results)
