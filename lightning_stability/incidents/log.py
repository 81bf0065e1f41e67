"""Pure: the incident log of a run, one append-only file per rank in ``incidents/`` beside the checkpoints.

Every fault a part of this package handles is one JSON line: when, which fault (``kind``), on which rank and host,
at which optimizer step, what was done about it (``action``), what it cost (``lost``), in which attempt of the job
(a restart by torchrun or SLURM), and the details. A rank appends to its own file, so writers on several nodes of a
shared file system never interleave; each line is flushed and ``fsync``\\ed as it is written, so the log survives
the kill that follows it. :func:`read_incidents` merges every rank's file in time order; :func:`format_incidents`
is the page ``lightning-stability incidents DIR`` prints.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_stability.errors import check_path, config_error

#: the folder of the log inside a checkpoint directory (or the Trainer's root directory)
FOLDER = "incidents"

#: every kind of incident, in the order the summary lists them, with what it is
KINDS = {
    "restart": "the job started again after a death or a preemption, from a saved checkpoint or from step 0",
    "preemption": "a preemption signal: every rank saved at one step and stopped",
    "damaged_checkpoint": "a checkpoint failed verification and was passed over",
    "spike": "a loss or gradient-norm spike (skipped, clipped or applied, as the response says)",
    "skip": "an update skipped (non-finite gradients, an fp16 overflow, a callback's vote)",
    "data_skip": "the data of a rolled-back stretch skipped",
    "rollback": "weights and optimizer state put back to an earlier step",
    "replay": "a flagged step run again and attributed (transient, data, nondeterministic, device)",
    "quarantine": "samples taken out of the data for the rest of the run",
    "failing_device": "a device that computes wrong results: the run saved and stopped",
    "straggler": "a rank slower than the others",
    "replicas_differ": "weights that should be equal on every data-parallel replica differ (a faulty device)",
    "batch_ramp": "the global batch grown to follow the measured critical batch (BatchRamp), with its LR and beta2",
}


@dataclass(frozen=True)
class Incident:
    """One fault handled. ``step`` is the optimizer step (``trainer.global_step``) it concerns; ``lost`` says what
    it cost ("" when nothing: a transient fault applied as replayed, a save at a signal)."""

    kind: str
    step: int
    action: str
    lost: str = ""
    detail: str = ""
    rank: int = 0
    host: str = ""
    attempt: str = ""
    time: float = field(default_factory=time.time)

    @classmethod
    def from_json(cls, line: str) -> Incident:
        data: dict[str, Any] = json.loads(line)
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


def log_dir(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / FOLDER


def append(directory: str | os.PathLike[str], incident: Incident) -> Path:
    """Append ``incident`` to its rank's file in ``directory``'s log (created if need be); returns the file."""
    folder = log_dir(directory)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{incident.rank}.jsonl"
    line = json.dumps(asdict(incident), sort_keys=True) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def this_host() -> str:
    return socket.gethostname()


def logged(directory: str | os.PathLike[str], incident: Incident) -> bool:
    """Whether ``incident``'s rank logged the same fault already (kind, step, action, what was lost, detail)."""
    path = log_dir(directory) / f"rank-{incident.rank}.jsonl"
    same = ("kind", "step", "action", "lost", "detail")
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            found = Incident.from_json(line)
        except (ValueError, TypeError):
            continue
        if all(getattr(found, key) == getattr(incident, key) for key in same):
            return True
    return False


def read_incidents(directory: str | os.PathLike[str]) -> list[Incident]:
    """Every rank's incidents in ``directory``'s log (the checkpoints' directory), oldest first (a line a kill cut
    short is left out); none when it holds no log. Raises ``StabilityConfigError`` when ``directory`` is not one."""
    check_path("directory", directory, "'checkpoints'")
    if not Path(directory).is_dir():
        raise config_error(
            "directory",
            str(directory),
            "is not a directory",
            "pass the directory the checkpoints are saved in (StableCheckpoint's dirpath, or the ModelCheckpoint's)",
        )
    found: list[Incident] = []
    for path in sorted(log_dir(directory).glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                found.append(Incident.from_json(line))
            except (ValueError, TypeError):
                continue  # the last line of a file whose writer was killed mid-write
    return sorted(found, key=lambda i: (i.time, i.rank))


def format_incidents(incidents: Iterable[Incident]) -> str:
    """One page: a count per kind, then one line per incident in time order (as :func:`read_incidents` gives)."""
    if isinstance(incidents, str) or not isinstance(incidents, Iterable):
        raise config_error("incidents", incidents, "is not a list of Incident", "pass read_incidents(directory)")
    incidents = list(incidents)
    if not all(isinstance(i, Incident) for i in incidents):
        raise config_error(
            "incidents", incidents, "holds something else than Incident", "pass read_incidents(directory)"
        )
    if not incidents:
        return "No incidents: no fault was handled in this run."
    counts = Counter(i.kind for i in incidents)
    order = [k for k in KINDS if k in counts] + sorted(k for k in counts if k not in KINDS)
    lines = [f"{len(incidents)} incident(s): " + ", ".join(f"{counts[k]} {k}" for k in order), ""]
    for i in incidents:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(i.time))
        where = f"rank {i.rank}" + (f" on {i.host}" if i.host else "")
        step = f"{i.step:>7}" if i.step >= 0 else f"{'-':>7}"
        head = f"{when}  step {step}  {i.kind:<18} {where}" + (f"  ({i.attempt})" if i.attempt else "")
        lines.append(head)
        lines.append(f"    {i.action}" + (f"; lost: {i.lost}" if i.lost else "; nothing lost"))
        if i.detail:
            lines.append(f"    {i.detail}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- was the previous fit cut short?
_FIT_STATE = "fit.json"


def mark_fit(directory: str | os.PathLike[str], running: bool, step: int) -> None:
    """Record that a fit in ``directory`` started (``running``) or ended cleanly at ``step`` (replaced whole)."""
    folder = log_dir(directory)
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{_FIT_STATE}.{os.getpid()}"
    partial.write_text(json.dumps({"running": running, "step": int(step), "time": time.time()}))
    os.replace(partial, folder / _FIT_STATE)


def cut_short(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The previous fit's record if it started and never ended cleanly (a kill, a crash), else ``None``."""
    try:
        state = json.loads((log_dir(directory) / _FIT_STATE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and state.get("running") else None
