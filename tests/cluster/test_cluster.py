"""The cheap checks of a sick cluster, in one process: the pure parts (timer, figures, fingerprint, replica
groups, watchdog table), the callback's arguments, its cost (no host sync off logging steps), pickling and
checkpoints. The multi-process behaviour is in test_cluster_ddp.py."""

from __future__ import annotations

import logging
import math
import pickle
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_stability import (
    ClusterHealthMonitor,
    StabilityConfigError,
    WatchdogSettings,
    watchdog_environment,
    watchdog_settings,
)
from lightning_stability.cluster import (
    ReplicaLayout,
    StepTimer,
    disagreeing_replicas,
    replica_groups,
    replica_layout,
    straggler_figures,
    weight_fingerprint,
)
from tests.helpers import TinyModule, count_host_data_per_step, count_syncs_per_step, quiet_trainer


# ---------------------------------------------------------------------------------------------- step timer
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_timer_measures_up_to_the_last_backward_and_whole_steps() -> None:
    clock = FakeClock()
    timer = StepTimer(clock)
    # step 1, two micro-batches: starts at its first batch start (no earlier step)
    clock.now = 1.0
    timer.batch_start()
    clock.now = 1.5
    timer.backward()
    timer.batch_end()  # a micro-batch that does not end the step
    clock.now = 2.0
    timer.batch_start()
    clock.now = 3.0
    timer.backward()  # the last micro-batch's backward: the gradient sync starts here
    clock.now = 7.0  # waiting in the all-reduce
    assert timer.optimizer_step() is True and timer.optimizer_step() is False  # a second optimizer: no new span
    timer.backward()  # after the first optimizer step: not this step's own time
    clock.now = 8.0
    timer.batch_end()
    # step 2 starts at step 1's end (fetching the batch counts)
    clock.now = 9.0
    timer.batch_start()
    clock.now = 10.0
    timer.backward()
    timer.optimizer_step()
    clock.now = 11.0
    timer.batch_end()
    assert timer.take_own() == pytest.approx(((3.0 - 1.0) + (10.0 - 8.0)) / 2)
    assert timer.take_step() == pytest.approx(11.0 - 8.0)  # only whole intervals between two step ends
    assert timer.take_own() is None and timer.take_step() is None  # a new window
    # validation (or a save, an epoch start) in between: the next step starts at its own batch start
    timer.break_interval()
    clock.now = 20.0
    timer.batch_start()
    clock.now = 20.5
    timer.backward()
    timer.optimizer_step()
    timer.batch_end()
    assert timer.take_own() == pytest.approx(0.5) and timer.take_step() is None


@pytest.mark.parametrize(
    ("times", "expected", "straggles"),
    [
        ([1.0, 1.0], (1.0, 1.0, 1.0, 1), False),  # ties: the last rank holding the maximum
        ([1.0, 1.6], (1.0, 1.0, 1.6, 1), True),  # two ranks: the lower median is the other rank
        ([1.0, 1.4], (1.0, 1.0, 1.4, 1), False),
        ([2.0, 1.0, 1.1, 1.2], (1.0, 1.1, 2.0, 0), True),
        ([1.0, 1.05, 1.0, 1.2, 1.1], (1.0, 1.05, 1.2, 3), False),
        ([0.001, 0.002], (0.001, 0.001, 0.002, 1), False),  # 2x, but under the 10 ms floor
        ([math.nan, 3.0, 1.0], (1.0, 1.0, 3.0, 1), True),  # a rank that timed nothing is left out
    ],
)
def test_straggler_figures(times: list[float], expected: tuple[float, float, float, int], straggles: bool) -> None:
    figures = straggler_figures(times)
    assert (figures.minimum, figures.median, figures.maximum, figures.slowest) == expected
    assert figures.straggles(1.5, 0.01) is straggles


# ---------------------------------------------------------------------------------------------- weight hash
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.complex64])
def test_the_fingerprint_sees_one_flipped_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(7, 5, generator=g).to(dtype), torch.randn(3, generator=g).to(dtype)]
    copy = [p.clone() for p in params]
    base = weight_fingerprint(params, torch.device("cpu"))
    assert base.dtype == torch.int64 and base.shape == (2,)
    assert torch.equal(base, weight_fingerprint(copy, torch.device("cpu")))
    flat = torch.view_as_real(copy[1]).reshape(-1) if dtype.is_complex else copy[1].view(-1)
    if flat.is_floating_point():
        flat = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    flat[1] ^= 1  # the lowest bit of one element
    assert not torch.equal(base, weight_fingerprint(copy, torch.device("cpu")))


@pytest.mark.parametrize(
    ("mesh", "replicate_dims", "groups"),
    [
        ([[0, 1], [2, 3]], [0], (0, 1, 0, 1)),  # hybrid sharding: ("replicate", "shard")
        ([[0, 1], [2, 3]], [1], (0, 0, 1, 1)),  # DP x TP with replicated TP dim: the TP ranks are equal
        ([[0, 1], [2, 3]], [0, 1], (0, 0, 0, 0)),
        ([[0, 2], [1, 3]], [0], (0, 0, 1, 1)),  # ranks laid out column-major
        ([[0, 2], [1, 3]], [1], (0, 1, 0, 1)),
        ([0, 1, 2], [0], (0, 0, 0)),
        ([0, 1, 2], [], (0, 1, 2)),
    ],
)
def test_replica_groups(mesh: list, replicate_dims: list[int], groups: tuple[int, ...]) -> None:
    assert replica_groups(torch.tensor(mesh), replicate_dims) == groups


def test_replica_layout_of_plain_parameters() -> None:
    params = [torch.zeros(2)]
    assert "one process" in replica_layout(params, 1, data_parallel=True)  # type: ignore[operator]
    assert replica_layout(params, 4, data_parallel=True) == ReplicaLayout(
        (0, 0, 0, 0), "DDP: every rank holds the same weights"
    )
    assert "not DDP" in replica_layout(params, 4, data_parallel=False)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("prints", "groups", "expected"),
    [
        ([[1, 2], [1, 2], [1, 2]], (0, 0, 0), {}),
        ([[1, 2], [1, 3], [1, 2]], (0, 0, 0), {1: [0, 1, 2]}),  # the majority is right
        ([[1, 2], [1, 3]], (0, 0), {1: [0, 1]}),  # no majority: the first rank of the group is the reference
        ([[1, 2], [5, 5], [1, 2], [5, 6]], (0, 1, 0, 1), {3: [1, 3]}),  # shards differ between groups: fine
    ],
)
def test_disagreeing_replicas(prints: list[list[float]], groups: tuple[int, ...], expected: dict) -> None:
    assert disagreeing_replicas(prints, ReplicaLayout(groups, "test")) == expected


# ---------------------------------------------------------------------------------------------- watchdog
ALL_SET = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_ENABLE_MONITORING": "1",
}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ALL_SET),
        ({"PATH": "/bin"}, ALL_SET),
        # a setting the user made, under either name torch reads, is left alone
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, {k: v for k, v in ALL_SET.items() if "ASYNC" not in k}),
        ({"NCCL_ASYNC_ERROR_HANDLING": "1"}, {k: v for k, v in ALL_SET.items() if "ASYNC" not in k}),
        ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, {k: v for k, v in ALL_SET.items() if "BUFFER" not in k}),
        ({"TORCH_FR_BUFFER_SIZE": "100"}, {k: v for k, v in ALL_SET.items() if "BUFFER" not in k}),
        (
            {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_ENABLE_MONITORING": "0"},
            {k: ALL_SET[k] for k in list(ALL_SET)[:2]},
        ),
        ({**ALL_SET, "NCCL_ASYNC_ERROR_HANDLING": "1"}, {}),
    ],
)
def test_watchdog_environment_sets_only_what_the_user_did_not(env: dict[str, str], expected: dict[str, str]) -> None:
    before = dict(env)
    assert watchdog_environment(env) == expected
    assert env == before  # pure: the caller's environment is not changed


def test_watchdog_settings_timeout_dump_prefix_and_line() -> None:
    settings = watchdog_settings({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, dump_prefix="logs/nccl_trace_rank_")
    assert settings.timeout == timedelta(minutes=10) < timedelta(minutes=30)  # torch's default_pg_timeout
    assert settings.env["TORCH_FR_DUMP_TEMP_FILE"] == "logs/nccl_trace_rank_"
    assert settings.kept == ("TORCH_NCCL_TRACE_BUFFER_SIZE",)
    line = settings.describe()
    assert line.startswith("process-group watchdog: timeout 10 min; set TORCH_NCCL_ASYNC_ERROR_HANDLING=3")
    assert "kept yours: TORCH_NCCL_TRACE_BUFFER_SIZE" in line and "NCCL process groups only" in line
    assert "TORCH_FR_DUMP_TEMP_FILE" not in watchdog_environment({"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/"}, "/y/")
    assert WatchdogSettings().describe().startswith("process-group watchdog: timeout 10 min (")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"timeout": 600}, r"`timeout=600` is not a positive timedelta"), ({"dump_prefix": ""}, r"`dump_prefix=''`")],
)
def test_watchdog_settings_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        watchdog_settings({}, **kwargs)


# ---------------------------------------------------------------------------------------------- the callback
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"straggler_factor": 1.0}, r"`straggler_factor=1.0` must be a finite number > 1.0.*Fix: pass e\.g\."),
        ({"straggler_factor": "2"}, r"`straggler_factor='2'`"),
        ({"weight_hash_every": 0}, r"`weight_hash_every=0` must be an int >= 1.*weight_hash_every=1000"),
        ({"weight_hash_every": 2.0}, r"`weight_hash_every=2.0`"),
        ({"straggler_min_gap_s": -1.0}, r"`straggler_min_gap_s=-1.0` must be a finite number >= 0"),
        ({"straggler_min_gap_s": None}, r"`straggler_min_gap_s=None` must be a finite number"),
    ],
)
def test_argument_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(StabilityConfigError, match=match):
        ClusterHealthMonitor(**kwargs)


def test_host_syncs_against_a_bare_trainer() -> None:
    """Off logging steps nothing; on a logging step the figures ride the one transfer; no tensor from host data."""
    pl.seed_everything(0)
    bare = count_syncs_per_step(quiet_trainer(max_steps=8, log_every_n_steps=4), TinyModule())
    pl.seed_everything(0)
    monitor = ClusterHealthMonitor(weight_hash_every=1)  # off in one process (nothing to compare): no cost
    ours = count_syncs_per_step(quiet_trainer(max_steps=8, log_every_n_steps=4, callbacks=[monitor]), TinyModule())
    assert len(bare) == len(ours) == 8
    for step, (b, o) in enumerate(zip(bare, ours, strict=True), start=1):
        assert o - b == (1 if step % 4 == 0 else 0), f"step {step}: bare {b}, with the monitor {o}"
    pl.seed_everything(0)
    made = count_host_data_per_step(
        quiet_trainer(max_steps=8, log_every_n_steps=4, callbacks=[ClusterHealthMonitor()]), TinyModule()
    )
    pl.seed_everything(0)
    bare_made = count_host_data_per_step(quiet_trainer(max_steps=8, log_every_n_steps=4), TinyModule())
    assert made[1:] == bare_made[1:]  # the first step builds the ledger's outcome table, once per run


def test_one_process_logs_its_own_figures_and_says_the_hash_check_is_off(caplog: pytest.LogCaptureFixture) -> None:
    trainer = quiet_trainer(max_steps=6, log_every_n_steps=3, callbacks=[ClusterHealthMonitor(weight_hash_every=2)])
    with caplog.at_level(logging.INFO):
        trainer.fit(TinyModule())
    lines = [r.getMessage() for r in caplog.records if "weight-hash check is off" in r.getMessage()]
    assert lines == [
        "ClusterHealthMonitor(weight_hash_every=2): the weight-hash check is off under SingleDeviceStrategy: one "
        "process: there are no replicas to compare."
    ]
    metrics = trainer.callback_metrics
    assert metrics["stability/slowest_rank"] == 0.0
    assert (
        metrics["stability/rank_time_min"]
        == metrics["stability/rank_time_median"]
        == metrics["stability/rank_time_max"]
    )
    # both positive host times; not compared with each other: the own-time window ends with the logging step
    # itself, the step-time window one step earlier, so one slow step on a loaded machine can put either above
    assert 0.0 < float(metrics["stability/rank_time_max"]) < math.inf
    assert 0.0 < float(metrics["stability/step_time"]) < math.inf
    assert "stability/replicas_differing" not in metrics


def test_pickle_state_key_and_checkpoint_round_trip(tmp_path: Path) -> None:
    monitor = ClusterHealthMonitor(straggler_factor=2.0, weight_hash_every=50, straggler_min_gap_s=0.5)
    trainer = quiet_trainer(max_steps=2, callbacks=[monitor])
    trainer.fit(TinyModule())
    clone = pickle.loads(pickle.dumps(monitor))
    assert (clone.straggler_factor, clone.weight_hash_every, clone.straggler_min_gap_s) == (2.0, 50, 0.5)
    assert monitor.state_key == "ClusterHealthMonitor{}"
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    resumed = quiet_trainer(max_steps=4, callbacks=[ClusterHealthMonitor()])
    resumed.fit(TinyModule(), ckpt_path=tmp_path / "a.ckpt")
    assert resumed.global_step == 4


def test_two_monitors_are_refused() -> None:
    trainer = quiet_trainer(max_steps=1, callbacks=[ClusterHealthMonitor(), ClusterHealthMonitor()])
    with pytest.raises(StabilityConfigError, match="2 ClusterHealthMonitor callbacks are attached"):
        trainer.fit(TinyModule())
