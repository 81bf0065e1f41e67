"""Tensor parallelism on 4 CPU processes (gloo) against one process: our callbacks under Lightning's own
``ModelParallelStrategy``, and our ``StableFSDPStrategy(tensor_parallel=2)``.

Data parallel x tensor parallel 2 x 2 (FSDP2 on the data dim: a column-parallel weight is ``_StridedShard`` on
it) and tensor parallel alone, 1 x 4 (plain parameters beside DTensors). Every hazard of
``tensor_parallel_script.py`` is in the model; the gradient norms (2 and inf), the per-module norms, the update
ratio and the clipped training itself must equal the one-process run on the same global batches.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import REPO, torchrun

SCRIPT = Path(__file__).with_name("tensor_parallel_script.py")
TOL = dict(rel=2e-5, abs=1e-6)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("reference")
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(SCRIPT), str(out), "1", "1"], env=env, check=True, capture_output=True)
    result: dict[str, Any] = json.loads((out / "rank0.json").read_text())
    result["final"] = torch.load(out / "final.pt")
    return result


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("dp", "tp", "strategy"),
    [(2, 2, "lightning"), (1, 4, "lightning"), (2, 2, "stable")],
    ids=["ModelParallelStrategy-dp2xtp2", "ModelParallelStrategy-tp4", "StableFSDPStrategy-dp2xtp2"],
)
def test_norms_clipping_and_update_ratio_equal_one_process_under_tensor_parallel(
    tmp_path: Path, reference: dict[str, Any], dp: int, tp: int, strategy: str
) -> None:
    results = torchrun(SCRIPT, dp * tp, tmp_path, str(dp), str(tp), strategy, timeout=400)
    placements = results[0]["placements"]
    if dp > 1:  # FSDP2 over ColwiseParallel, both on dim 0: the hazard torch 2.13 does not make a Shard
        assert "_StridedShard" in placements["fc1.weight"], placements
    else:  # tensor parallel alone: the replicated LayerNorm and the gate stay plain tensors
        assert placements["ln.weight"] == [] and placements["gate"] == [], placements
        assert placements["fc1.weight"] == ["Shard"], placements
    for rank, result in enumerate(results):
        for step, (ours, ref) in enumerate(zip(result["norms"], reference["norms"], strict=True)):
            assert ours["2"] == pytest.approx(ref["2"], **TOL), (rank, step)
            assert ours["inf"] == pytest.approx(ref["inf"], **TOL), (rank, step)
        for step, (ours, ref) in enumerate(zip(result["metrics"], reference["metrics"], strict=True)):
            keys = [k for k in ref if k.startswith(("stability/grad_norm", "stability/clip", "stability/update"))]
            assert {k: ours[k] for k in keys} == pytest.approx({k: ref[k] for k in keys}, **TOL), (rank, step)
        assert result["norms"] == results[0]["norms"]  # every rank logged the same global value
    final = torch.load(tmp_path / "final.pt")
    assert final.keys() == reference["final"].keys()
    for name, weight in final.items():
        torch.testing.assert_close(weight, reference["final"][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.distributed
def test_stable_fsdp_with_tensor_parallel_refuses_a_module_without_a_tp_plan_on_every_rank(tmp_path: Path) -> None:
    results = torchrun(SCRIPT, 4, tmp_path, "2", "2", "noplan", timeout=300)
    for result in results:
        assert "tensor_parallel=2" in result["error"] and "applied no tensor-parallel plan" in result["error"]
        assert "parallelize_module" in result["error"]  # the fix


@pytest.mark.distributed
def test_gpt_block_plan_splits_the_demo_model_and_it_trains_like_one_process(tmp_path: Path) -> None:
    """The demo's CharGPT, unchanged but for ``parallelize_blocks`` in configure_model, on 2 x 2 processes under
    StableFSDPStrategy(tensor_parallel=2): every step's global gradient norm (which depends on every update
    before it) equals the one-process run's."""
    demo = Path(__file__).with_name("tp_demo_script.py")
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(demo), str(ref_dir)], env=env, check=True, capture_output=True)
    reference = json.loads((ref_dir / "rank0.json").read_text())
    results = torchrun(demo, 4, tmp_path, timeout=300)
    for result in results:
        assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5)
    assert sorted(results[0]["split"]) == sorted(
        f"blocks.layers.{i}.{lin}.{w}" for i in (0, 1) for lin in ("linear1", "linear2") for w in ("weight", "bias")
    )


@pytest.mark.distributed
def test_stable_fsdp_tensor_parallel_skips_on_every_rank_and_its_checkpoint_reshards(tmp_path: Path) -> None:
    """StableFSDPStrategy(tensor_parallel=2) on 2 x 2: an inf put into one rank's gradient shard after every
    collective skips that update on all four ranks, exactly as the one-process run that skips the same step;
    the sharded checkpoint it writes loads on 1 x 1 and on 4 x 1 (DCP reshards) to the same weights, and the next
    step's global gradient norm is the same on both."""
    ref_dir, run_dir, one_dir, four_dir = (tmp_path / d for d in ("reference", "2x2", "1x1", "4x1"))
    for d in (ref_dir, run_dir, one_dir, four_dir):
        d.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(SCRIPT), str(ref_dir), "1", "1", "faults"], env=env, check=True)
    reference = json.loads((ref_dir / "rank0.json").read_text())
    results = torchrun(SCRIPT, 4, run_dir, "2", "2", "faults", timeout=400)
    for result in results:
        assert result["outcomes"] == reference["outcomes"] == {"applied": 5, "skipped": 1}
        for step, (ours, ref) in enumerate(zip(result["norms"], reference["norms"], strict=True)):
            if step == 2:  # the fault: inf on every rank, though only one rank's shard holds it
                assert math.isinf(ours["2"]) and math.isinf(ref["2"])
            else:
                assert ours["2"] == pytest.approx(ref["2"], **TOL), step
    saved = torch.load(run_dir / "final.pt")
    for name, weight in torch.load(ref_dir / "final.pt").items():
        torch.testing.assert_close(saved[name], weight, rtol=1e-5, atol=1e-6, msg=name)
    ckpt = str(run_dir / "tp.ckpt")
    one = torchrun(SCRIPT, 1, one_dir, "1", "1", "resume", ckpt, timeout=300)
    four = torchrun(SCRIPT, 4, four_dir, "4", "1", "resume", ckpt, timeout=300)
    for restored_dir in (one_dir, four_dir):
        restored = torch.load(restored_dir / "restored.pt")
        assert all(torch.equal(restored[name], saved[name]) for name in saved), restored_dir.name
    assert four[0]["norms"][0]["2"] == pytest.approx(one[0]["norms"][0]["2"], rel=1e-5)


@pytest.mark.distributed
def test_stable_fsdp_tensor_parallel_trains_in_fp16_with_one_loss_scale(tmp_path: Path, reference: dict) -> None:
    """fp16 (what Lightning's ModelParallelStrategy refuses) on 2 x 2 with the LossScaleTuner: the inf in one rank's
    shard skips the update on every rank, every rank keeps the same scale, and the norms follow the fp32 run's."""
    results = torchrun(SCRIPT, 4, tmp_path, "2", "2", "fp16", timeout=400)
    assert all(r["outcomes"] == {"applied": 5, "skipped": 1, "scale": 1024.0} for r in results), results[0]
    for step, (ours, ref) in enumerate(zip(results[0]["norms"], reference["norms"], strict=True)):
        if step == 2:
            assert math.isinf(ours["2"])
        elif step < 2:  # before the skip the fp32 reference took the same updates
            assert ours["2"] == pytest.approx(ref["2"], rel=5e-3), step
    assert all(r["norms"] == results[0]["norms"] for r in results)
