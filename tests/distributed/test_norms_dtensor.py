"""Sharded (DTensor) gradient norms across real processes: the global norm, never one shard's, also for the
placements tensor parallelism makes (``_StridedShard`` under FSDP2, ``Partial`` from sequence parallelism)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import torchrun

SCRIPT = Path(__file__).with_name("norms_dtensor_script.py")


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_norms_equal_full_norms(tmp_path: Path, world: int) -> None:
    results = torchrun(SCRIPT, world, tmp_path)
    for p, r in results[0].items():
        assert r["ours"] == pytest.approx(r["expected"], rel=1e-5), p
        assert r["mixed_total"] == pytest.approx(r["expected_total"], rel=1e-5), p
        assert r["hsdp"] == pytest.approx(r["expected"], rel=1e-5), p
        assert r["strided"] == pytest.approx(r["expected"], rel=1e-5), p  # _StridedShard is a shard dim too
        assert r["partial"] == pytest.approx(r["partial_expected"], rel=1e-5), p  # the pending sum, reduced
        assert r["host_data"] == 0, p  # no index tensor from host data (a blocking copy on a GPU)
    # every rank got the same (global) answer
    assert all(res == results[0] for res in results)
