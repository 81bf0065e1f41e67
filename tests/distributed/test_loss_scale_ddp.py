"""Rank consistency of LossScaleTuner: 2 gloo processes, an inf in rank 1's gradient (or shard) only."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import torchrun

SCRIPT = Path(__file__).with_name("loss_scale_ddp_script.py")
INF_STEP = 3


@pytest.mark.distributed
def test_an_inf_on_one_rank_makes_every_rank_skip(tmp_path: Path) -> None:
    rank0, rank1 = torchrun(SCRIPT, 2, tmp_path, "ddp")

    # Control, torch's GradScaler: rank 0 applies the step rank 1 skips, and the replicas diverge.
    assert rank0["stock"]["moved"][INF_STEP] and not rank1["stock"]["moved"][INF_STEP]
    assert rank0["stock"]["applied"] == 8 and rank1["stock"]["applied"] == 7
    assert rank0["stock"]["params"] != rank1["stock"]["params"]
    assert rank0["stock"]["scales"] != rank1["stock"]["scales"]

    # LossScaleTuner reduces the overflow flag: both ranks skip, back off alike and stay identical.
    for run in ("tuned", "tuned_fused"):
        expected_moved = [step != INF_STEP for step in range(8)]
        assert rank0[run]["moved"] == expected_moved == rank1[run]["moved"], run
        assert rank0[run]["applied"] == rank1[run]["applied"] == 7, run
        assert rank0[run]["scales"] == rank1[run]["scales"], run
        assert rank0[run]["scales"][INF_STEP] == 128.0, run  # hysteresis=1: backed off at once, on both
        assert rank0[run]["params"] == rank1[run]["params"], run


@pytest.mark.distributed
def test_sharded_fsdp2_gradients_skip_on_every_rank(tmp_path: Path) -> None:
    # Lightning's ModelParallelStrategy + fully_shard: DTensor gradients, empty local shards included.
    # With full sharding torch's DTensor dispatch of the unscale op already max-reduces the overflow flag over
    # the shard dimension, so the fixed-scale run passes even without TunedGradScaler's all-reduce; the "auto"
    # run needs it (the probe's peak is a max over local shards). The flag's own reduction is tested under
    # DDP above and under StableFSDPStrategy's hybrid sharding in test_fsdp_fp16.py.
    rank0, rank1 = torchrun(SCRIPT, 2, tmp_path, "fsdp2")
    for run in ("tuned", "tuned_auto"):
        assert rank0[run]["moved"] == rank1[run]["moved"], run
        assert not rank0[run]["moved"][INF_STEP], run  # skipped on rank 0 too
        assert rank0[run]["applied"] == rank1[run]["applied"] == sum(rank0[run]["moved"]), run
        assert rank0[run]["scales"] == rank1[run]["scales"], run
        assert rank0[run]["params"] == rank1[run]["params"], run
    # the fixed scale never overflows by itself here: exactly the injected step is skipped, and backs off
    assert rank0["tuned"]["moved"] == [step != INF_STEP for step in range(8)]
    assert rank0["tuned"]["scales"][INF_STEP] == 128.0
    # "auto" measured the sharded gradients (empty local shards included) and chose a scale on both ranks
    assert rank0["tuned_auto"]["moved"][0] and rank0["tuned_auto"]["scales"][0] != 1.0
