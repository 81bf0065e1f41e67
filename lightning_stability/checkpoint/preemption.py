"""Preemption signals: caught at any moment, acted on at a step boundary that every rank agrees on.

A signal handler only records the signal (and runs a user's own earlier handler). Every rank then learns, at the
same optimizer-step boundary, which signals reached any rank, without a device sync and without waiting for the
network in the step:

* one process: the recorded flags are read on the host at each boundary (free);
* several: at each boundary every rank launches one all-reduce of a tiny CPU tensor (one int per signal: how many
  ranks got it) on a gloo process group of its own, ``async_op=True``, and reads the result of the previous
  boundary's all-reduce, which has long finished. Every rank reads the same round at the same boundary, so all
  agree; a signal is acted on one or two boundaries after it arrived. The GPU never waits for it, and the host
  waits only if another rank's host has not yet reached the previous boundary.

A per-boundary exchange cannot be avoided when one rank alone may be signalled (it is the only way for the
others to learn of it); this one costs no device work and no blocking round trip.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable, Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from lightning_stability import _compat, ranks
from lightning_stability.errors import config_error

_UNCATCHABLE = {signal.SIGKILL, signal.SIGSTOP} if hasattr(signal, "SIGKILL") else set()


def default_signals() -> tuple[signal.Signals, ...]:
    """SIGTERM (Kubernetes, torchrun, SLURM at the time limit) and SIGUSR1 (SLURM's warning before it), where the
    platform has them."""
    return tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))


def check_signals(signals: Any) -> tuple[signal.Signals, ...]:
    """The signals as ``signal.Signals``, or a config error naming the one that cannot be caught here."""
    if isinstance(signals, (str, bytes)) or not isinstance(signals, Sequence):
        raise config_error("signals", signals, "must be a sequence of signals", "pass e.g. [signal.SIGTERM]")
    valid = signal.valid_signals() - _UNCATCHABLE
    out: list[signal.Signals] = []
    for value in signals:
        try:
            sig = signal.Signals(value)
        except (ValueError, TypeError):
            sig = None
        if sig is None or sig not in valid or isinstance(value, bool):
            raise config_error(
                "signals",
                value,
                "is not a signal this process can catch (SIGKILL and SIGSTOP never can)",
                "pass signal numbers such as signal.SIGTERM, signal.SIGUSR1, or signals=() to handle none",
            )
        if sig not in out:
            out.append(sig)
    return tuple(out)


class PreemptionSignals:
    """Records the configured signals and makes every rank agree on them at step boundaries (see module doc).

    Args:
        signals: the signals to catch.
    """

    def __init__(self, signals: Sequence[signal.Signals]) -> None:
        self.signals = tuple(signals)
        self.received: list[signal.Signals] = []  # on this rank, in order of arrival
        self._previous: dict[signal.Signals, Any] = {}  # what was installed before us, restored at the end
        self._chained: dict[signal.Signals, list[Callable[..., Any]]] = {}  # run at once from our handler
        self._requeue: dict[signal.Signals, list[Callable[..., Any]]] = {}  # Lightning's SLURM requeue: at the boundary
        self._group: Any = None  # the gloo group of the exchange (several ranks)
        self._buffer = torch.zeros(len(self.signals), dtype=torch.int64)
        self._work: Any = None  # the exchange launched at the last boundary
        self.closed = False  # no further exchange (the ranks agreed to stop, or training ended)

    def __getstate__(self) -> dict[str, Any]:  # handlers and the process group stay with the process
        return {**self.__dict__, "_previous": {}, "_chained": {}, "_requeue": {}, "_group": None, "_work": None}

    # ------------------------------------------------------------------ handlers
    def install(self) -> bool:
        """Put our handler in front of the current one for each signal; ``False`` off the main thread (Python
        delivers signals there only)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self.received = []
        for sig in self.signals:
            previous = signal.getsignal(sig)
            self._previous[sig] = previous
            parts = _compat.split_lightning_signal_handler(previous)
            if parts is not None:
                self._requeue[sig], self._chained[sig] = parts
            else:
                self._requeue[sig] = []
                self._chained[sig] = [previous] if callable(previous) else []
            signal.signal(sig, self._handle)
        return True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if sig not in self.received:
            self.received.append(sig)
        for handler in self._chained.get(sig, []):
            handler(signum, frame)

    def restore(self) -> None:
        """Put back the handlers found at :meth:`install` (where ours is still the one installed)."""
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._handle and previous is not None:
                    signal.signal(sig, previous)
        self._previous = {}

    def run_requeue(self, agreed: Iterable[signal.Signals]) -> None:
        """Run Lightning's SLURM auto-requeue handler for the agreed signals, on every rank at the same boundary
        (it saves ``hpc_ckpt_<n>.ckpt``, a collective, and rank 0 requeues the job)."""
        for sig in agreed:
            for handler in self._requeue.get(sig, []):
                handler(int(sig), None)

    # ------------------------------------------------------------------ agreement across ranks
    def open(self) -> None:
        """Create the exchange's gloo group (every rank calls this at the same point, e.g. setup)."""
        self.closed = False
        self._work = None
        if self._group is None and self.signals and ranks.world_size() > 1:
            self._group = dist.new_group(backend="gloo")

    def poll(self) -> dict[signal.Signals, int]:
        """At a step boundary, on every rank: ``{signal: ranks that received it}`` as every rank sees it now
        (empty: go on). Several ranks: the result of the previous boundary's exchange; the next one starts here."""
        if not self.signals or self.closed:
            return {}
        if self._group is None:
            return {sig: 1 for sig in self.received}
        agreed: dict[signal.Signals, int] = {}
        if self._work is not None:
            self._work.wait()  # launched a boundary ago: finished, unless another rank's host is behind
            self._work = None
            agreed = {sig: int(n) for sig, n in zip(self.signals, self._buffer.tolist(), strict=True) if n}
        if not agreed:
            for i, sig in enumerate(self.signals):
                self._buffer[i] = int(sig in self.received)
            self._work = dist.all_reduce(self._buffer, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
        return agreed

    def finish(self) -> None:
        """Wait for the last exchange (every rank launched it) and stop exchanging."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        self.closed = True

    def close(self) -> None:
        """Release the gloo group (after :meth:`finish`; left alone while an exchange may be in flight)."""
        if self._group is not None and self._work is None:
            dist.destroy_process_group(self._group)
        self._group, self._work = None, None
