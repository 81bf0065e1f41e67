"""LossScaleTuner under StableFSDPStrategy(mixed_precision=True): 2 gloo processes, an inf in rank 1's shard only.

One torchrun launch runs every case (see ``fsdp_fp16_run.py``). At step ``INF_STEP`` rank 1 alone writes an
inf into its local gradient shard after backward, before unscaling. The runs:

* ``full_tuned``: full sharding. torch's DTensor dispatch of the unscale op max-reduces ``found_inf``
  over the shard dimension by itself, which ``full_torch`` (torch's plain ``GradScaler``) shows: under full
  sharding the tuner's own reduction is not what makes rank 0 skip.
* ``hybrid_tuned`` / ``hybrid_tuned_fused``: ``sharding="hybrid", device_mesh=(2, 1)``: each rank a whole
  replica. The DTensor dispatch reduces over the size-1 shard dimension only; the tuner's cross-rank
  all-reduce is what makes rank 0 skip, as ``hybrid_torch`` (plain ``GradScaler``: the replicas diverge)
  proves. These runs fail if ``TunedGradScaler._reduce_max`` stops reducing. ``hybrid_default``: the
  strategy's default ``ShardedGradScaler`` is rank-consistent there too.
* ``syncs_torch`` / ``syncs_tuned``: host syncs per step against torch's ``GradScaler``.
* ``resume_uninterrupted`` / ``resumed``: the tuner's state through a sharded checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_stability.ledger.step_ledger import Outcome
from lightning_stability.strategies.fsdp_checkpoint import META_FILE
from tests.distributed.fsdp_fp16_run import INF_STEP, RESUME_AT, RESUME_INF_STEPS, RESUME_STEPS, STEPS
from tests.helpers import torchrun

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).with_name("fsdp_fp16_run.py")
TUNED = ("full_tuned", "hybrid_tuned", "hybrid_tuned_fused")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("fsdp_fp16")
    return out, torchrun(SCRIPT, 2, out, timeout=240)


def _weights(out: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.weights.pt")  # type: ignore[no-any-return]


def test_the_inf_lands_in_rank_1s_shard_only(runs) -> None:
    _, (r0, r1) = runs
    for name in (*TUNED, "hybrid_torch", "hybrid_default", "full_torch"):
        assert r0[name]["local_nonfinite"] == [False] * STEPS, name
        assert r1[name]["local_nonfinite"] == [step == INF_STEP for step in range(STEPS)], name
    assert r0["full_tuned"]["placements"] == "(Shard(dim=0),)"
    assert r0["hybrid_tuned"]["placements"] == "(Replicate(), Shard(dim=0))"


@pytest.mark.parametrize("name", TUNED)
def test_both_ranks_skip_and_back_off_alike(runs, name: str) -> None:
    _, (r0, r1) = runs
    for r in (r0, r1):
        assert r[name]["scaler"] == "TunedGradScaler" and r[name]["precision"] == "16-mixed"
        # exactly the injected step is skipped, on both ranks: parameter shards and AdamW state untouched
        assert r[name]["moved"] == [step != INF_STEP for step in range(STEPS)]
        assert r[name]["opt_changed"] == [step != INF_STEP for step in range(STEPS)]
        assert r[name]["ledger_counts"][Outcome.APPLIED] == STEPS - 1
        assert r[name]["ledger_counts"][Outcome.SKIPPED_SCALER] == 1
        # hysteresis=1: the scale halves at once, on both ranks
        assert r[name]["scales"] == [256.0] * INF_STEP + [128.0] * (STEPS - INF_STEP)
        assert r[name]["adam_steps"][-1] == [float(STEPS - 1)]
    assert r0[name]["scaler_state"] == r1[name]["scaler_state"]
    assert r0[name]["adam_steps"] == r1[name]["adam_steps"]


@pytest.mark.parametrize("name", ["hybrid_tuned", "hybrid_tuned_fused"])
def test_replicas_stay_bitwise_identical(runs, name: str) -> None:
    _, (r0, r1) = runs
    assert r0[name]["param_digests"] == r1[name]["param_digests"]
    assert r0[name]["opt_digests"] == r1[name]["opt_digests"]


def test_control_without_a_cross_rank_reduction_the_hybrid_replicas_diverge(runs) -> None:
    # torch's plain GradScaler under hybrid sharding: only rank 1 sees its inf; rank 0 applies the step
    _, (r0, r1) = runs
    c0, c1 = r0["hybrid_torch"], r1["hybrid_torch"]
    assert c0["scaler"] == c1["scaler"] == "GradScaler"
    assert c0["moved"][INF_STEP] and not c1["moved"][INF_STEP]
    assert c0["scales"][INF_STEP] == 256.0 and c1["scales"][INF_STEP] == 128.0
    assert c0["param_digests"][INF_STEP - 1] == c1["param_digests"][INF_STEP - 1]
    assert c0["param_digests"][INF_STEP] != c1["param_digests"][INF_STEP]


def test_the_strategys_default_sharded_grad_scaler_is_rank_consistent_under_hybrid_sharding(runs) -> None:
    _, (r0, r1) = runs
    for r in (r0, r1):
        assert r["hybrid_default"]["scaler"] == "ShardedGradScaler"
        assert r["hybrid_default"]["moved"] == [step != INF_STEP for step in range(STEPS)]
        scales = r["hybrid_default"]["scales"]
        assert scales[INF_STEP] == scales[INF_STEP - 1] / 2  # torch's default 65536, halved once
    assert r0["hybrid_default"]["param_digests"] == r1["hybrid_default"]["param_digests"]


def test_under_full_sharding_torch_dtensor_dispatch_already_reduces_the_flag(runs) -> None:
    # documents torch's behaviour that the full-sharding case rests on (torch/distributed/tensor/_dispatch.py,
    # found_inf_reduce_handler): even the plain GradScaler skips on both ranks
    _, (r0, r1) = runs
    for r in (r0, r1):
        assert r["full_torch"]["moved"] == [step != INF_STEP for step in range(STEPS)]
        assert r["full_torch"]["scales"][INF_STEP] == 128.0


def test_full_and_hybrid_sharding_end_with_the_same_weights(runs) -> None:
    out, _ = runs
    full, hybrid = _weights(out, "full_tuned"), _weights(out, "hybrid_tuned")
    assert full.keys() == hybrid.keys()
    assert max(float((full[k] - hybrid[k]).abs().max()) for k in full) < 1e-6
    assert all(torch.isfinite(w).all() for w in full.values())


def test_the_tuner_adds_no_host_sync_to_a_step_that_does_not_log(runs) -> None:
    _, results = runs
    logging_steps = {1, 3, 5}  # Trainer(log_every_n_steps=2): ledger steps 2, 4, 6 make one batched transfer
    for r in results:
        default, tuned = r["syncs_torch"], r["syncs_tuned"]
        assert default["scaler"] == "GradScaler" and tuned["scaler"] == "TunedGradScaler"
        assert tuned["ledger_counts"][Outcome.SKIPPED_SCALER] == 1
        assert len(default["syncs_per_step"]) == STEPS
        expected = [n + (i in logging_steps) for i, n in enumerate(default["syncs_per_step"])]
        assert tuned["syncs_per_step"] == expected, (default["syncs_per_step"], tuned["syncs_per_step"])


def test_the_tuner_state_resumes_exactly_from_a_sharded_checkpoint(runs) -> None:
    out, (r0, r1) = runs
    full, resumed = r0["resume_uninterrupted"], r0["resumed"]
    skipped = [step in RESUME_INF_STEPS for step in range(RESUME_STEPS)]
    # growth_interval 4, hysteresis 3: the third overflow (step 5) backs off, after the checkpoint
    assert full["scales"] == [256.0] * 5 + [128.0] * 3
    assert full["moved"] == [not s for s in skipped]
    meta = torch.load(Path(resumed["checkpoint"]) / META_FILE, weights_only=False)
    state = meta["StableFSDPPrecision"]
    assert state["_hysteresis_tracker"] == 1 and state["_growth_tracker"] == 2 and state["overflow_steps"] == 2
    for r in (r0, r1):
        assert r["resumed"]["global_step"] == RESUME_STEPS
        assert r["resumed"]["scales"] == full["scales"][RESUME_AT:]
        assert r["resumed"]["moved"] == full["moved"][RESUME_AT:]
        assert r["resumed"]["scaler_state"] == full["scaler_state"]
        assert r["resumed"]["ledger_counts"] == full["ledger_counts"]
    assert r1["resumed"]["param_digests"] == r1["resume_uninterrupted"]["param_digests"][RESUME_AT:]
    a, b = _weights(out, "resumed"), _weights(out, "resume_uninterrupted")
    assert all(torch.equal(a[k], b[k]) for k in b)
