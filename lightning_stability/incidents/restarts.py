"""Pure: the restart engine a process runs under, read from its environment, and what that engine must be told
for a restart to come back.

torchrun's elastic agent (``torchrun --max-restarts=N``) restarts every worker of the group after one dies and
says which attempt this is (``TORCHELASTIC_RESTART_COUNT``); a SLURM job requeued after a preemption or a node
failure (``sbatch --requeue``, ``scontrol requeue``) runs the batch script again with ``SLURM_RESTART_COUNT``. In
both the training script is the same: ``trainer.fit(model, ckpt_path="last")`` resumes from what was saved.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Attempt:
    """Which run of the job this process belongs to: ``engine`` (``"torchrun"`` or ``"slurm"``), ``count`` (0: the
    first run, n: the n-th restart), ``limit`` (the restarts allowed; ``None``: not told)."""

    engine: str
    count: int
    limit: int | None

    @property
    def is_restart(self) -> bool:
        return self.count > 0

    def describe(self) -> str:
        of = f" of {self.limit}" if self.limit is not None else ""
        return f"restart {self.count}{of} by {self.engine}" if self.is_restart else f"first run under {self.engine}"


def attempt(env: Mapping[str, str]) -> Attempt | None:
    """The attempt ``env`` describes, or ``None`` outside torchrun and SLURM (torchrun's count wins: it restarts
    the workers inside one SLURM run)."""
    if "TORCHELASTIC_RESTART_COUNT" in env:
        limit = env.get("TORCHELASTIC_MAX_RESTARTS")
        return Attempt("torchrun", _int(env["TORCHELASTIC_RESTART_COUNT"]), _int(limit) if limit else None)
    if "SLURM_JOB_ID" in env:
        return Attempt("slurm", _int(env.get("SLURM_RESTART_COUNT", "0")), None)
    return None


def shared_store_problem(env: Mapping[str, str]) -> str | None:
    """Why a torchrun restart of this job may never come back, or ``None``.

    With ``--max-restarts`` above 0 and torch's default of sharing the agent's rendezvous store with the workers'
    process group (``TORCHELASTIC_USE_AGENT_STORE=True``), the restarted group can read the previous attempt's
    addresses and fail to connect ("Gloo connectFullMesh failed ... Connection refused"; NCCL: "Failed to
    connect"), which uses up every restart (pytorch/pytorch#135712; seen with torch 2.13 and gloo). Launching
    torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every attempt a store of its own.
    """
    found = attempt(env)
    if found is None or found.engine != "torchrun" or not found.limit:
        return None
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return (
        f"torchrun may restart this job {found.limit} time(s), and its workers share the agent's rendezvous store: "
        "a restarted group can read the previous attempt's addresses and fail to connect (pytorch/pytorch#135712), "
        "using up every restart. Fix: launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ... (set for "
        "torchrun itself, not inside the training script)."
    )


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0
