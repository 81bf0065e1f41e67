"""Shared test utilities: a tiny model, a host-sync counter, a torchrun launcher."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[1]

#: a test Trainer's keyword arguments: no logger, progress bar or model summary
QUIET: dict[str, Any] = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)


class SyncCounter(TorchDispatchMode):
    """Counts host-device synchronisations: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ...)
    and copies to the CPU (``.cpu()``/``.tolist()`` of a device tensor; on a CPU-only run, explicit
    ``.to('cpu', copy=True)``, which is how the package moves logged values to the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        elif func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            src = args[0]
            # a move to the host: from another device, or a same-dtype copy (no mere dtype conversion)
            if src.device.type != "cpu" or kwargs.get("dtype", src.dtype) == src.dtype:
                self.count += 1
        return func(*args, **kwargs)


class StepSyncCounter(pl.Callback):
    """Attributes the syncs counted by a :class:`SyncCounter` (entered around ``trainer.fit``) to steps.

    ``per_step[i]`` is everything between the start of batch ``i`` and the start of batch ``i + 1``
    (the last one ends at ``on_train_end``): forward, backward, optimizer step, every callback's
    batch-end work and Lightning's own logging.
    """

    def __init__(self, counter: SyncCounter | HostDataCounter | OpCounter) -> None:
        self.counter = counter
        self.marks: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.marks.append(self.counter.count)

    def on_train_end(self, trainer, pl_module):  # type: ignore[no-untyped-def]
        self.marks.append(self.counter.count)

    @property
    def per_step(self) -> list[int]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def count_syncs_per_step(trainer: pl.Trainer, module: pl.LightningModule) -> list[int]:
    """Fit ``module`` with ``trainer`` under a :class:`SyncCounter`; return the syncs of each step."""
    counter = SyncCounter()
    boundaries = StepSyncCounter(counter)
    trainer.callbacks.insert(0, boundaries)
    with counter:
        trainer.fit(module)
    return boundaries.per_step


class HostDataCounter(TorchDispatchMode):
    """Counts tensors built from host data (``torch.tensor(x)``, ``torch.as_tensor(x)``: ``aten.lift_fresh``).

    On a GPU each such tensor made for the device is a blocking host-to-device copy (torch synchronises
    the stream for a pageable copy), a host sync that :class:`~tests.helpers.SyncCounter` cannot see on
    a CPU-only machine. Compared against a bare Trainer, the step must add none.
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.lift_fresh.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class OpCounter(TorchDispatchMode):
    """Counts every tensor op dispatched (on a GPU each is a kernel launch, or a view with none)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_host_data_per_step(trainer: pl.Trainer, module: pl.LightningModule) -> list[int]:
    """Fit under a :class:`HostDataCounter`; return the host-made tensors of each optimizer step."""
    counter = HostDataCounter()
    boundaries = StepSyncCounter(counter)
    trainer.callbacks.insert(0, boundaries)  # type: ignore[attr-defined]
    with counter:
        trainer.fit(module)
    return boundaries.per_step


def make_data(n: int = 64, dim: int = 8, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class TinyModule(pl.LightningModule):
    """A small MLP regression model with hooks to inject a bad gradient.

    Args:
        optimizer: "adamw", "adamw_fused", "sgd", "sgd_fused".
        inf_at_step: multiply the loss by inf at this global step (optionally on one rank only).
        inf_rank: the rank that injects (None: all ranks).
    """

    def __init__(
        self,
        dim: int = 8,
        hidden: int = 16,
        lr: float = 0.05,
        optimizer: str = "adamw",
        weight_decay: float = 0.01,
        inf_at_step: int | Sequence[int] | None = None,
        inf_rank: int | None = None,
        batch_size: int = 8,
        n: int = 64,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1)
        )
        self.lr = lr
        self.optimizer_name = optimizer
        self.weight_decay = weight_decay
        self.inf_steps = {inf_at_step} if isinstance(inf_at_step, int) else set(inf_at_step or ())
        self.inf_rank = inf_rank
        self.batch_size = batch_size
        self.n = n
        self.dim = dim
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        if self.global_step in self.inf_steps and (self.inf_rank is None or self.inf_rank == self.global_rank):
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        fused = self.optimizer_name.endswith("_fused")
        if self.optimizer_name.startswith("adamw"):
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay, fused=fused or None)
        return torch.optim.SGD(
            self.parameters(), lr=self.lr, momentum=0.9, weight_decay=self.weight_decay, fused=fused or None
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(self.n, self.dim), batch_size=self.batch_size, shuffle=False)


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    """A CPU Trainer without progress bars, summaries or checkpoints unless asked for."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        enable_checkpointing=False,
        **QUIET,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


class SendSignal(pl.Callback):
    """Sends ``signum`` to this process at the start of the step that begins at ``at_step``."""

    def __init__(self, signum: int, at_step: int) -> None:
        self.signum, self.at_step = signum, at_step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), self.signum)


def exit_worker() -> NoReturn:
    """End a torchrun worker once its results are written, skipping the interpreter's teardown: there gloo's
    threads sometimes abort the process ("terminate called without an active exception", exit code -6), which
    fails a run whose work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def finish_worker(out_dir: Path) -> NoReturn:
    """End a torchrun worker whose results are written: mark this rank done for :func:`torchrun` (an empty
    ``rank{RANK}.json`` in ``out_dir``), wait for every rank of the process group there is, and
    :func:`exit_worker`."""
    (out_dir / f"rank{os.environ.get('RANK', '0')}.json").write_text("{}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    exit_worker()


def _children() -> dict[int, list[int]]:
    """``{parent pid: [child pids]}`` of every process on the machine, from ``/proc`` (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name, in parentheses, may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def kill_process_tree(pid: int) -> None:
    """SIGKILL the process ``pid`` started in a session of its own, and every process it started.

    torchrun's agent starts each worker in a session (and process group) of its own, so killing the agent's group
    leaves the workers running, orphaned, holding the agent's pipes. The agent's group is stopped first (it starts
    no new worker meanwhile), then every descendant's process group is killed (a worker's own, with what the
    worker started: DataLoader workers), then the agent's.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGSTOP)
    children, found, todo = _children(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    for child in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(os.getpgid(child), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def torchrun(
    script: Path, nproc: int, out_dir: Path, *args: str, timeout: int = 300, flags: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Run ``script`` under ``torchrun --standalone`` (one node, a free port, more torchrun ``flags``) with
    ``nproc`` CPU processes.

    The script must write ``{out_dir}/rank{RANK}.json``; the parsed files are returned in rank order. After
    ``timeout`` seconds every process it started, the workers included, is killed and ``TimeoutExpired`` raised.
    """
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *flags,
        str(script),
        str(out_dir),
        *args,
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=out_dir, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_process_tree(proc.pid)
        proc.communicate(timeout=60)  # the pipes close once every process holding them is gone
        raise
    if proc.returncode != 0:
        # the workers' warnings (repeated on every rank) would push the error itself out of the message
        noise = re.compile(r"Warning:|warnings\.warn|warn\(|(^|\]:)W\d{4} ")
        errors = "\n".join(line for line in stderr.splitlines() if not noise.search(line))
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{stdout[-4000:]}\n{errors[-8000:]}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]
