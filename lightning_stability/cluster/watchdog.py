"""Pure: the process-group watchdog settings a long run wants, where the user has not set them.

A collective that never completes (a dead node, a rank stuck in a different collective) blocks every other rank.
torch's watchdog (a thread of each NCCL process group) ends it after the group's timeout; what it leaves behind
depends on environment variables that ``ProcessGroupNCCL`` reads when a group is created. The names and aliases
below are those of the installed torch (``torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp`` and
``FlightRecorder.hpp``; docs: https://docs.pytorch.org/docs/stable/torch_nccl_environment_variables.html).

Effective on GPU machines (NCCL) only, and only for groups created after the variables are set: set them before
``init_process_group`` (before ``Trainer.fit`` sets up the strategy), in the launching process or in each worker.
The timeout is the strategy's (``DDPStrategy(timeout=...)``, ``StableFSDPStrategy(timeout=...)``) and applies to
gloo too; the variables do nothing on a CPU-only (gloo) run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from lightning_stability.errors import check_instance, config_error

#: The process-group timeout for a long run: Megatron-LM's default (``--distributed-timeout-minutes 10``). torch's
#: default is 30 minutes (``torch.distributed.constants.default_pg_timeout``, which Lightning's strategies pass
#: even for NCCL), i.e. half an hour of a whole cluster waiting for a dead rank before the job restarts.
WATCHDOG_TIMEOUT = timedelta(minutes=10)

# (variable set, value, the names torch reads for the same setting (the first wins in torch), why)
_SETTINGS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    (
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "3",
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"),
        "on a timeout or NCCL error the watchdog tears the process down (torch's default; torchrun's agent sets 1 "
        "when unset), so the launcher can restart the job instead of every rank hanging",
    ),
    (
        "TORCH_FR_BUFFER_SIZE",
        "2000",
        ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
        "the flight recorder keeps the last 2000 collectives of each rank (0 turns it off)",
    ),
    (
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "1",
        ("TORCH_NCCL_DUMP_ON_TIMEOUT",),
        "on a timeout each rank writes its flight record: which rank stopped at which collective "
        "(torch's `torchfrtrace <dump dir>` merges them)",
    ),
    (
        "TORCH_NCCL_ENABLE_MONITORING",
        "1",
        ("TORCH_NCCL_ENABLE_MONITORING",),
        "a second thread aborts the process when the watchdog itself hangs (the dump needs it)",
    ),
)
_DUMP_FILE = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


@dataclass(frozen=True)
class WatchdogSettings:
    """What :func:`watchdog_settings` decided: the variables to set, the ones left as the user set them, the
    process-group timeout.

    Attributes:
        env: variable -> value to set (``os.environ.update(settings.env)`` before the process group exists).
        kept: the settings the user made already (the variable names found), left alone.
        timeout: the process-group timeout to pass to the strategy (``DDPStrategy(timeout=...)``).
    """

    env: dict[str, str] = field(default_factory=dict)
    kept: tuple[str, ...] = ()
    timeout: timedelta = WATCHDOG_TIMEOUT

    def describe(self, timeout_applied: bool = True) -> str:
        """One line for a preset's info line, e.g. ``process-group watchdog: timeout 10 min; set
        TORCH_NCCL_ASYNC_ERROR_HANDLING=3, ...; kept yours: TORCH_FR_BUFFER_SIZE (NCCL only)``.

        ``timeout_applied=False``: the strategy keeps its own timeout (one of Lightning's, or the user's), and the
        line says how to pass the shorter one instead of claiming it."""
        minutes = self.timeout.total_seconds() / 60
        timeout = (
            f"timeout {minutes:g} min"
            if timeout_applied
            else f"timeout: your strategy's (DDPStrategy(timeout=timedelta(minutes={minutes:g})) for a shorter one)"
        )
        parts = [f"process-group watchdog: {timeout}"]
        if self.env:
            parts.append("set " + ", ".join(f"{k}={v}" for k, v in self.env.items()))
        if self.kept:
            parts.append("kept yours: " + ", ".join(self.kept))
        return "; ".join(parts) + " (the variables act on NCCL process groups only)"


def watchdog_settings(
    existing_env: Mapping[str, str], timeout: timedelta = WATCHDOG_TIMEOUT, dump_prefix: str | None = None
) -> WatchdogSettings:
    """The watchdog variables to set for a long run, leaving every one the user set (under any name torch reads
    for it) as it is. Pure: reads ``existing_env`` (pass ``os.environ``), changes nothing.

    ==================================  =======  ===========================================================
    Variable (torch also reads)         Value    Effect
    ==================================  =======  ===========================================================
    TORCH_NCCL_ASYNC_ERROR_HANDLING     3        on a timeout/NCCL error the process is torn down (restartable)
    (NCCL_ASYNC_ERROR_HANDLING)
    TORCH_FR_BUFFER_SIZE                2000     the flight recorder keeps each rank's last 2000 collectives
    (TORCH_NCCL_TRACE_BUFFER_SIZE)
    TORCH_NCCL_DUMP_ON_TIMEOUT          1        on a timeout each rank dumps its flight record
    TORCH_NCCL_ENABLE_MONITORING        1        a hung watchdog aborts the process (the dump needs it)
    TORCH_FR_DUMP_TEMP_FILE             prefix   where the dumps go (only with ``dump_prefix``; torch's default
    (TORCH_NCCL_DEBUG_INFO_TEMP_FILE)            is ``/tmp/nccl_trace_rank_``, lost with a node's ``/tmp``)
    ==================================  =======  ===========================================================

    Args:
        existing_env: the environment the job runs with (``os.environ``).
        timeout: the process-group timeout to use (default :data:`WATCHDOG_TIMEOUT`, 10 minutes).
        dump_prefix: path prefix of the flight-record dumps, one file per rank (``<prefix><rank>``), e.g.
            ``"logs/nccl_trace_rank_"``; ``None`` leaves torch's default.

    Raises:
        StabilityConfigError: for a timeout that is not a positive ``timedelta``, or an empty ``dump_prefix``.

    Example::

        settings = watchdog_settings(os.environ)
        os.environ.update(settings.env)
        trainer = L.Trainer(strategy=DDPStrategy(timeout=settings.timeout))
        print(settings.describe())
    """
    check_instance("existing_env", existing_env, Mapping, "a mapping of variable names to values", "os.environ")
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        raise config_error("timeout", timeout, "is not a positive timedelta", "pass e.g. timedelta(minutes=10)")
    if dump_prefix is not None and (not isinstance(dump_prefix, str) or not dump_prefix):
        raise config_error(
            "dump_prefix", dump_prefix, "is not a path prefix", "pass e.g. 'logs/nccl_trace_rank_', or None"
        )
    wanted = [(name, value, names) for name, value, names, _ in _SETTINGS]
    if dump_prefix is not None:
        wanted.append((_DUMP_FILE[0], dump_prefix, _DUMP_FILE))
    env: dict[str, str] = {}
    kept: list[str] = []
    for name, value, names in wanted:
        found = [n for n in names if n in existing_env]
        if found:
            kept.append(found[0])
        else:
            env[name] = value
    return WatchdogSettings(env=env, kept=tuple(kept), timeout=timeout)


def watchdog_environment(existing_env: Mapping[str, str], dump_prefix: str | None = None) -> dict[str, str]:
    """The variables :func:`watchdog_settings` would set: ``{name: value}`` for those the user has not set."""
    check_instance("existing_env", existing_env, Mapping, "a mapping of variable names to values", "os.environ")
    return watchdog_settings(existing_env, dump_prefix=dump_prefix).env
