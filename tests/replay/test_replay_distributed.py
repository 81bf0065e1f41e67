"""StepReplay on two real processes (gloo): DDP and FSDP2. A bit flip on rank 1 is a transient fault on rank 1 and
the run ends bit-exact with the fault-free run; a poisoned sample is the data's, quarantined on every rank alike
and never loaded again; every rank decides alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_stability import Outcome, read_incidents
from tests.helpers import REPO, torchrun

SCRIPT = Path(__file__).with_name("replay_ddp_script.py")
FLIP, POISONED = 9, 17
#: the faults each strategy's single torchrun launch fits in turn (the ones that stop the run last)
FAULTS = {
    "ddp": ("none", "flip", "after_allreduce", "poison", "poison_in_order", "failing", "device", "device_random"),
    "fsdp": ("none", "flip", "poison"),
}
Ranks = tuple[dict[str, Any], dict[str, Any]]


class Launches:
    """Every fault of FAULTS[strategy], fit in turn by one torchrun launch per strategy (a launch costs more than its
    fits), made the first time a test asks for that strategy: ``runs(strategy, fault)`` is (rank 0's result, rank
    1's); the launch's folder is ``root / strategy``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.results: dict[str, dict[str, Ranks]] = {}

    def __call__(self, strategy: str, fault: str) -> Ranks:
        if strategy not in self.results:
            (self.root / strategy).mkdir()
            rank0, rank1 = torchrun(SCRIPT, 2, self.root / strategy, strategy, *FAULTS[strategy])
            self.results[strategy] = {f: (rank0[f], rank1[f]) for f in FAULTS[strategy]}
        return self.results[strategy][fault]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory.mktemp("replay"))


def decisions(events: list[dict]) -> list[dict]:
    """The events without their wall times (each rank times its own replay)."""
    return [{k: v for k, v in e.items() if not k.endswith("seconds") and k != "detail"} for e in events]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_bit_flip_on_rank_1_is_its_transient_fault_and_the_run_ends_bit_exact(runs: Launches, strategy: str) -> None:
    clean = runs(strategy, "none")
    rank0, rank1 = runs(strategy, "flip")
    assert rank0["flipped"] == [] and rank1["flipped"] == [[FLIP, 0]]
    assert decisions(rank0["events"]) == decisions(rank1["events"])
    (event,) = rank0["events"]
    assert event["cause"] == "transient" and event["ranks"] == [1] and event["step"] == FLIP
    assert rank0["weights"] == rank1["weights"] == clean[0]["weights"]
    assert clean[0]["events"] == []


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_poisoned_sample_is_quarantined_on_every_rank_and_never_loaded_again(runs: Launches, strategy: str) -> None:
    rank0, rank1 = runs(strategy, "poison")
    assert decisions(rank0["events"]) == decisions(rank1["events"])
    assert [e["cause"] for e in rank0["events"]] == ["data"]
    assert rank0["quarantined"] == rank1["quarantined"] and POISONED in rank0["quarantined"]
    assert len(rank0["quarantined"]) == 8  # one rank's batch: the other rank's batch reproduces no flag alone
    (event,) = rank0["events"]
    if strategy == "ddp":  # the poisoned batch flags on the other rank too: the data, not the device
        (elsewhere,) = event["elsewhere"]
        assert elsewhere["flagged"] and not elsewhere["partner_flagged"] and elsewhere["on"] != elsewhere["rank"]
        assert event["runs"] == 3 and "flag there too" in event["detail"]
    else:  # a rank holds a shard of the weights: not run elsewhere, and the verdict says so
        assert "elsewhere" not in event and "DDP only" in event["detail"]
    loaded = rank0["loaded"] + rank1["loaded"]
    assert all(loaded.count(i) == 1 for i in rank0["quarantined"])  # the first epoch only
    assert rank0["counts"] == rank1["counts"] and rank0["weights"] == rank1["weights"]


@pytest.mark.distributed
def test_the_same_fault_three_times_on_rank_1_stops_both_ranks_naming_it(runs: Launches) -> None:
    rank0, rank1 = runs("ddp", "failing")
    assert rank0["stopped"] == rank1["stopped"]
    stopped = rank0["stopped"]
    assert stopped["rank"] == 1 and stopped["steps"] == [FLIP - 2, FLIP - 1, FLIP] and stopped["host"]
    assert stopped["checkpoint"] and Path(stopped["checkpoint"]).exists()
    assert f"step={FLIP + 1}" in stopped["checkpoint"]  # the state after the third fault's step, applied as replayed


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_quarantine_survives_a_sigkill_of_rank_1_and_the_resumed_ranks_never_load_it(
    tmp_path: Path, strategy: str
) -> None:
    """Rank 1 is SIGKILLed three steps after the quarantine (torchrun then stops rank 0); both ranks resume with
    ckpt_path="last" (DDP: a file; FSDP2: sharded) to the end of the third epoch: the quarantine is back on both,
    no rank loads it again."""
    script = Path(__file__).with_name("quarantine_kill_run.py")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    first = subprocess.run([*launch, str(tmp_path), "first", strategy], env=env, capture_output=True, timeout=300)
    assert first.returncode != 0, first.stderr[-2000:]  # rank 1 was killed
    quarantined = json.loads((tmp_path / "quarantined.0.json").read_text())
    assert POISONED in quarantined and not (tmp_path / "first.0.json").exists()
    resumed = subprocess.run([*launch, str(tmp_path), "resume", strategy], env=env, capture_output=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"resume.{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["quarantined"] == ranks[1]["quarantined"] == quarantined
    loaded = ranks[0]["loaded"] + ranks[1]["loaded"]
    assert loaded and not set(loaded) & set(quarantined)


@pytest.mark.distributed
def test_a_fault_after_the_all_reduce_on_rank_1_only_is_its_transient_fault(runs: Launches) -> None:
    """Rank 1's gradients alone go wrong after DDP averaged them: the losses agree everywhere, the gradients differ
    on rank 1 only, which names it; the run ends bit-exact with the fault-free run, both ranks alike."""
    clean = runs("ddp", "none")
    rank0, rank1 = runs("ddp", "after_allreduce")
    assert decisions(rank0["events"]) == decisions(rank1["events"])
    (event,) = rank0["events"]
    assert event["cause"] == "transient" and event["ranks"] == [1] and event["step"] == FLIP
    assert rank0["weights"] == rank1["weights"] == clean[0]["weights"]


@pytest.mark.distributed
def test_a_batch_with_no_sample_left_on_rank_1_is_skipped_on_both_ranks(runs: Launches) -> None:
    """In order (Lightning's DistributedSampler without shuffling), rank 1's second batch holds poisoned sample 17:
    its 8 samples are quarantined in the first epoch. In the next two, rank 1 has no sample left at that position
    and rank 0 has 8: both ranks skip that step (every rank decides alike), they stay in step and equal, and no
    sample is trained on twice in an epoch."""
    rank0, rank1 = runs("ddp", "poison_in_order")
    bad = set(range(17, 32, 2))
    for result in (rank0, rank1):
        assert set(result["quarantined"]) == bad
        assert result["counts"][Outcome.SKIPPED_QUARANTINED] == 2
    assert rank0["weights"] == rank1["weights"]
    for epoch in (1, 2):
        rows = [[row for row in result["rows"] if row[0] == epoch] for result in (rank0, rank1)]
        assert [row[1] for row in rows[0]] == [row[1] for row in rows[1]] == [0, 1, 2, 3]
        assert [row[3] for row in rows[0]] == [row[3] for row in rows[1]] == [0, Outcome.SKIPPED_QUARANTINED, 0, 0]
        trained = [i for part in rows for row in part if row[3] == Outcome.APPLIED for i in row[2]]
        assert sorted(trained) == sorted(set(range(64)) - bad - set(range(16, 31, 2)))  # each once


@pytest.mark.distributed
def test_a_device_that_fails_the_same_way_every_time_is_named_at_once_and_nothing_is_quarantined(
    runs: Launches,
) -> None:
    """Rank 1's device makes NaN of every forward at step FLIP: the step reproduces there, as bad data would, but
    rank 1's micro-batches run on rank 0 flag nothing (and rank 0's flag on rank 1): the device. Both ranks stop
    with FailingDeviceError naming rank 1 at its first fault, after a checkpoint, and no sample is quarantined."""
    rank0, rank1 = runs("ddp", "device")
    assert rank0["stopped"] == rank1["stopped"] and decisions(rank0["events"]) == decisions(rank1["events"])
    stopped = rank0["stopped"]
    assert stopped["rank"] == 1 and stopped["steps"] == [FLIP] and stopped["host"]
    assert stopped["checkpoint"] and Path(stopped["checkpoint"]).exists()
    assert rank0["quarantined"] == rank1["quarantined"] == []
    (event,) = rank0["events"]
    assert event["cause"] == "device" and event["ranks"] == [1] and event["step"] == FLIP
    assert event["elsewhere"] == [{"rank": 1, "on": 0, "flagged": False, "same": None, "partner_flagged": True}]
    kinds = [i.kind for i in read_incidents(runs.root / "ddp" / "device" / "ckpts")]
    assert "failing_device" in kinds and "quarantine" not in kinds


@pytest.mark.distributed
def test_a_device_that_fails_differently_each_time_is_named_not_called_nondeterminism(runs: Launches) -> None:
    """Rank 1's device adds a different spike at each forward at step FLIP: no two runs agree on rank 1 only;
    rank 1's micro-batches run twice on rank 0 agree bit for bit there: the device, named at once."""
    rank0, rank1 = runs("ddp", "device_random")
    assert rank0["stopped"] == rank1["stopped"] and decisions(rank0["events"]) == decisions(rank1["events"])
    assert rank0["stopped"]["rank"] == 1 and rank0["stopped"]["steps"] == [FLIP]
    (event,) = rank0["events"]
    assert event["cause"] == "device" and event["ranks"] == [1] and event["runs"] == 5
    assert event["elsewhere"] == [{"rank": 1, "on": 0, "flagged": False, "same": True, "partner_flagged": True}]
    assert rank0["quarantined"] == []
