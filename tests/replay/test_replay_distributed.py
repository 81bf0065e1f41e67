"""StepReplay on two real processes (gloo): DDP and FSDP2. A bit flip on rank 1 is a transient fault on rank 1 and
the run ends bit-exact with the fault-free run; a poisoned sample is the data's, quarantined on every rank alike
and never loaded again; every rank decides alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import torchrun

SCRIPT = Path(__file__).with_name("replay_ddp_script.py")
FLIP, POISONED = 9, 17


def decisions(events: list[dict]) -> list[dict]:
    """The events without their wall times (each rank times its own replay)."""
    return [{k: v for k, v in e.items() if k not in ("seconds", "detail")} for e in events]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_bit_flip_on_rank_1_is_its_transient_fault_and_the_run_ends_bit_exact(tmp_path: Path, strategy: str) -> None:
    (tmp_path / "clean").mkdir()
    (tmp_path / "flip").mkdir()
    clean = torchrun(SCRIPT, 2, tmp_path / "clean", strategy, "none")
    rank0, rank1 = torchrun(SCRIPT, 2, tmp_path / "flip", strategy, "flip")
    assert rank0["flipped"] == [] and rank1["flipped"] == [[FLIP, 0]]
    assert decisions(rank0["events"]) == decisions(rank1["events"])
    (event,) = rank0["events"]
    assert event["cause"] == "transient" and event["ranks"] == [1] and event["step"] == FLIP
    assert rank0["weights"] == rank1["weights"] == clean[0]["weights"]
    assert clean[0]["events"] == []


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_poisoned_sample_is_quarantined_on_every_rank_and_never_loaded_again(tmp_path: Path, strategy: str) -> None:
    rank0, rank1 = torchrun(SCRIPT, 2, tmp_path, strategy, "poison")
    assert decisions(rank0["events"]) == decisions(rank1["events"])
    assert [e["cause"] for e in rank0["events"]] == ["data"]
    assert rank0["quarantined"] == rank1["quarantined"] and POISONED in rank0["quarantined"]
    assert len(rank0["quarantined"]) == 8  # one rank's batch: the other rank's batch reproduces no flag alone
    loaded = rank0["loaded"] + rank1["loaded"]
    assert all(loaded.count(i) == 1 for i in rank0["quarantined"])  # the first epoch only
    assert rank0["counts"] == rank1["counts"] and rank0["weights"] == rank1["weights"]


@pytest.mark.distributed
def test_the_same_fault_three_times_on_rank_1_stops_both_ranks_naming_it(tmp_path: Path) -> None:
    rank0, rank1 = torchrun(SCRIPT, 2, tmp_path, "ddp", "failing")
    assert rank0["stopped"] == rank1["stopped"]
    stopped = rank0["stopped"]
    assert stopped["rank"] == 1 and stopped["steps"] == [FLIP - 2, FLIP - 1, FLIP] and stopped["host"]
    assert stopped["checkpoint"] and Path(stopped["checkpoint"]).exists()
    assert f"step={FLIP + 1}" in stopped["checkpoint"]  # the state after the third fault's step, applied as replayed
