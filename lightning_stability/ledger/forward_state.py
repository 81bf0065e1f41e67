"""What a forward changes besides the parameters, copied before a step and put back by a replay (``StepReplay``)
and a rollback (``TrainingHealthMonitor(response="rollback")``).

A forward may write the module's buffers: BatchNorm's running statistics (in the ``state_dict``), and buffers kept
out of it with ``register_buffer(name, tensor, persistent=False)``, such as the tokens routed to each expert that
torchtitan's and Megatron's MoE layers count for load balancing. A step run twice must find them as the step
found them, or it counts its tokens twice. :class:`ForwardState` finds the buffers that change, with no host sync,
and copies only those:

* at a fit's first step it copies every buffer and notes its version counter (a host integer torch bumps at each
  in-place write from Python) and the tensor the module holds (a buffer assigned anew is a change too);
* as the second step starts, a buffer whose counter or tensor moved is *tracked*; and every buffer is compared
  with its copy on the device (a kernel may write a buffer without bumping its counter: BatchNorm's running
  statistics), also before a write back in the first step (a replay, a skipped step) undoes the change, and that
  comparison is read on the host as the third step starts, long done (no wait);
* from then on the buffers not tracked are looked at as each step starts (host integers): one that changed is
  tracked from then on. Only tracked buffers are copied (on their device, into the same memory each step) before a
  step that may run again or be snapshotted; most models have none or a few small ones;
* :meth:`restore` writes the copies back into the buffers the module holds.

A buffer first written after the first step by a kernel that does not bump its counter is not found. Under DDP
with ``broadcast_buffers=True`` (DDP's default) every forward writes every buffer (rank 0's values are broadcast
into them): every buffer is then tracked and copied.

State kept outside buffers (a plain attribute: a Python number, a tensor not registered as a buffer) cannot be
found in general. As the second step starts, the public number and tensor attributes of the modules that hold
parameters are compared with what they were before the first, and those that changed are named in one warning
with the fix: keep the state in a buffer, which is then put back like the others. A warning, not an error: such an
attribute is as often bookkeeping that no computation reads (a count for logging) as training state, and only
the user can tell which.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_stability import _compat
from lightning_stability.norms import local_tensor

#: attributes named in the warning at most (the rest counted)
_NAMED = 8
#: the steps of a fit: the first (every buffer copied), the second (the values compared), then settled
_FIRST, _SECOND, _SETTLED = 1, 2, 3


@dataclass
class _Buffer:
    owner: nn.Module  # the module that registered it
    name: str  # its attribute name on ``owner``
    path: str  # its name in ``named_buffers()``
    persistent: bool  # in the ``state_dict`` (and so in checkpoints)
    tensor: Tensor  # the tensor ``owner`` held at the last look
    version: int  # its version then

    def current(self) -> Tensor:
        return getattr(self.owner, self.name)

    def changed(self) -> bool:
        now = self.current()
        return now is not self.tensor or _compat.tensor_version(local_tensor(now)) != self.version

    def record(self) -> None:
        self.tensor = self.current()
        self.version = _compat.tensor_version(local_tensor(self.tensor))


class ForwardState:
    """The buffers a module's forward changes: found at a fit's first steps, copied before a step, put back.

    One per module (:meth:`of`), shared by the callbacks that need it. Each calls :meth:`begin` at
    ``on_train_batch_start`` (the first call of a step opens it) and :meth:`end` once the step is over.
    """

    _of: ClassVar[weakref.WeakKeyDictionary[nn.Module, ForwardState]] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, module: nn.Module) -> ForwardState:
        """The module's :class:`ForwardState` (made on first use)."""
        state = cls._of.get(module)
        if state is None:
            state = cls._of[module] = cls(module)
        return state

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)
        self.forget()

    def forget(self) -> None:
        """At a fit's start: find the buffers again from its first step."""
        self._buffers: list[_Buffer] | None = None
        self._phase = 0
        self._tracked: list[int] = []  # indices into ``_buffers``
        self._copies: dict[int, Tensor] = {}  # index -> the buffer as the open step started (memory reused)
        self._fresh: set[int] = set()  # the copies taken in the open step
        self._open = False
        self._plain: dict[str, Any] = {}  # the public attributes before the first step
        #: over the first step: which buffers differ from their copies (a device vector, by index), compared before
        #: each write back and as the second step starts
        self._differing: Tensor | None = None
        #: the second step's findings: the buffers whose counter or tensor moved, the comparison on its way to the host
        self._compared: tuple[list[int], Tensor | None, Any] | None = None

    # ------------------------------------------------------------------ each step
    def begin(self, copy: bool) -> None:
        """Before a micro-batch's forward. The first call of a step notes which buffers changed since the last
        step (no sync); with ``copy``, the tracked buffers are copied, once a step (every buffer at a fit's first
        steps, before they are known)."""
        module = self._module()
        if module is None:
            return
        if not self._open:
            self._open, self._fresh = True, set()
            if self._phase == 0:
                self._buffers = _buffers_of(module)
                self._tracked = list(range(len(self._buffers)))
                self._plain = _plain_state(module)
                copy = True  # every buffer, for the comparison as the next step starts
            elif self._phase == _FIRST:
                self._compare()
                _warn_plain(self._plain, _plain_state(module))
                self._plain = {}
            elif self._phase == _SECOND:
                self._settle()
            else:  # a tracked buffer stays tracked: only the others are looked at
                self._track(self._look(self._untracked()))
            self._phase = min(self._phase + 1, _SETTLED)
        if copy:
            self._copy([i for i in self._tracked if i not in self._fresh])

    def end(self) -> None:
        """Once the step is over (any caller; the later calls do nothing)."""
        self._open = False

    def restore(self) -> None:
        """Write back the tracked buffers as they were when the open step began. A buffer changed for the first
        time since the fit's first steps, in this very step, had no copy: it is named in a warning and tracked
        from now on."""
        if self._buffers is None:
            return
        if self._phase == _FIRST:  # what the step's forward changed, before it is written back
            self._note_differing()
        for i in self._tracked:
            if i in self._fresh:
                buf = self._buffers[i]
                _write(buf, self._copies[i])
                if self._phase < _SETTLED:
                    buf.record()  # this write is not a change a forward made
        missed = [i for i in self._untracked() if self._buffers[i].changed()]
        if missed:
            self._track(missed)
            names = ", ".join(self._buffers[i].path for i in missed)
            rank_zero_warn(
                f"lightning_stability: the buffer(s) {names} changed for the first time since this fit's first "
                "steps, in the step now being run again or rolled back: no copy of them was taken before it, so "
                "they stay as the step left them. They are copied before every step from now on."
            )

    def as_started(self) -> dict[int, Tensor]:
        """``id`` of each buffer the module holds -> its value as the open step began, for the buffers the step
        may have changed (the others hold that value)."""
        if self._buffers is None:
            return {}
        return {id(self._buffers[i].current()): self._copies[i] for i in self._tracked if i in self._fresh}

    @contextlib.contextmanager
    def rewriting(self) -> Iterator[None]:
        """Around a write of the buffers from an earlier state (a rollback): the write is not taken for a change
        a forward makes."""
        if self._buffers is not None and self._phase == _SETTLED:
            self._track(self._look(self._untracked()))
        yield
        for buf in self._buffers or []:
            buf.record()

    # ------------------------------------------------------------------ what it found
    def tracked(self, persistent: bool | None = None) -> list[str]:
        """The names (as in ``named_buffers()``) of the buffers found changing (every buffer during a fit's first
        two steps); only the persistent ones, or only the others, with ``persistent``."""
        found = [self._buffers[i] for i in self._tracked] if self._buffers is not None else []
        return [b.path for b in found if persistent is None or b.persistent == persistent]

    @property
    def nbytes(self) -> int:
        """Device bytes held by the copies."""
        return sum(c.numel() * c.element_size() for c in self._copies.values())

    # ------------------------------------------------------------------ inside
    def _note_differing(self) -> None:
        """Compare every buffer with its copy from the first step's start, on the device (no sync), and keep the
        differences found so far: what the first step's forward changed, also when a write back undid it."""
        assert self._buffers is not None
        if not self._buffers:
            return
        now = [local_tensor(buf.current()) for buf in self._buffers]
        flags = torch.stack([_differ(t, self._copies[i]) for i, t in enumerate(now)])
        self._differing = flags if self._differing is None else self._differing | flags

    def _compare(self) -> None:
        """As the second step starts: the buffers whose counter or tensor moved are changed; the values of all are
        compared with the first step's copies on the device, the result sent to the host without waiting."""
        assert self._buffers is not None
        moved = self._look(range(len(self._buffers)))
        self._note_differing()
        differing, self._differing = self._differing, None
        host, event = _to_host(differing) if differing is not None else (None, None)
        self._compared = (moved, host, event)

    def _settle(self) -> None:
        """As the third step starts: the buffers found changed (by their counters, or by the comparison read now)
        are tracked; the copies of the others are let go."""
        assert self._compared is not None
        moved, host, event = self._compared
        self._compared = None
        changed = set(moved) | set(self._look(range(len(self._buffers or []))))
        if host is not None:
            if event is not None:
                event.synchronize()  # recorded a step ago: long done
            changed |= {i for i, flag in enumerate(host.numpy().tolist()) if flag}
        self._tracked = sorted(changed)
        self._copies = {i: c for i, c in self._copies.items() if i in changed}

    def _look(self, indices: Iterable[int]) -> list[int]:
        """Which of these buffers changed since the last look (host integers and identities, no sync); their
        state noted."""
        assert self._buffers is not None
        changed = []
        for i in indices:
            buf = self._buffers[i]
            if buf.changed():
                changed.append(i)
                buf.record()
        return changed

    def _untracked(self) -> list[int]:
        tracked = set(self._tracked)
        return [i for i in range(len(self._buffers or [])) if i not in tracked]

    def _track(self, indices: list[int]) -> None:
        known = set(self._tracked)
        self._tracked += [i for i in indices if i not in known]

    def _copy(self, indices: list[int]) -> None:
        """Copy these buffers into the memory of their last copies (one fused copy), or into new memory."""
        assert self._buffers is not None
        targets, sources = [], []
        for i in indices:
            src = local_tensor(self._buffers[i].current()).detach()
            old = self._copies.get(i)
            if old is None or old.shape != src.shape or old.dtype != src.dtype or old.device != src.device:
                self._copies[i] = src.clone()
            else:
                targets.append(old)
                sources.append(src)
            self._fresh.add(i)
        if targets:
            _compat.foreach_copy_(targets, sources)


def _buffers_of(module: nn.Module) -> list[_Buffer]:
    persistent = set(module.state_dict(keep_vars=True))
    owners = dict(module.named_modules())
    found = []
    for path, tensor in module.named_buffers():
        prefix, _, name = path.rpartition(".")
        version = _compat.tensor_version(local_tensor(tensor))
        found.append(_Buffer(owners[prefix], name, path, path in persistent, tensor, version))
    return found


def _differ(now: Tensor, before: Tensor) -> Tensor:
    """Whether ``now`` differs from ``before`` in any bit (a 0-dim device bool; another shape or dtype differs)."""
    if now.shape != before.shape or now.dtype != before.dtype:
        return torch.ones((), dtype=torch.bool, device=before.device)
    if now.is_floating_point() and now.element_size() in (1, 2, 4, 8):
        kind = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[now.element_size()]
        now, before = now.detach().view(kind), before.view(kind)  # bits: a NaN kept as it was is no change
    return (now.detach() != before).any()


def _to_host(flags: Tensor) -> tuple[Tensor, Any]:
    """``flags`` copied into host memory without waiting for the device (pinned on a GPU, an event recorded
    after the copy); on a CPU, a plain copy."""
    cuda = flags.device.type == "cuda"
    host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=cuda)
    host.copy_(flags, non_blocking=cuda)
    event = None
    if cuda:
        event = torch.cuda.Event()
        event.record()
    return host, event


def _write(buf: _Buffer, saved: Tensor) -> None:
    target = buf.current()
    local = local_tensor(target)
    with torch.no_grad():
        if local.shape == saved.shape and local.dtype == saved.dtype and local.device == saved.device:
            local.copy_(saved)
        else:  # the forward assigned a buffer of another shape: the earlier one goes back
            setattr(buf.owner, buf.name, saved.clone())


def _plain_state(module: nn.Module) -> dict[str, Any]:
    """The public number and tensor attributes (not buffers, not parameters) of the modules that hold parameters,
    by ``module.attribute`` name: a number as it is, a tensor as ``(tensor, version)``."""
    holders = {""}
    for name, _ in module.named_parameters():
        parts = name.split(".")[:-1]
        holders.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    found: dict[str, Any] = {}
    for path, sub in module.named_modules():
        if path not in holders:
            continue
        for attr, value in vars(sub).items():
            if attr.startswith("_") or attr == "training":
                continue
            key = f"{path}.{attr}" if path else attr
            if isinstance(value, (bool, int, float)):
                found[key] = value
            elif isinstance(value, Tensor) and not isinstance(value, nn.Parameter):
                found[key] = (value, _compat.tensor_version(value))
    return found


def _differs(before: Any, after: Any) -> bool:
    if isinstance(before, tuple) and isinstance(after, tuple):
        return before[0] is not after[0] or before[1] != after[1]
    if isinstance(before, float) and isinstance(after, float) and math.isnan(before) and math.isnan(after):
        return False
    return bool(type(before) is not type(after) or before != after)


def _warn_plain(before: dict[str, Any], after: dict[str, Any]) -> None:
    changed = [key for key, value in before.items() if key in after and _differs(value, after[key])]
    if not changed:
        return
    names = ", ".join(changed[:_NAMED]) + (f" and {len(changed) - _NAMED} more" if len(changed) > _NAMED else "")
    rank_zero_warn(
        f"lightning_stability: the first step changed {names}, kept in plain attribute(s), not buffers: a replayed "
        "step (StepReplay) or a rollback (TrainingHealthMonitor) cannot put them back, so a replay changes them "
        "twice. Fix: keep such state in a buffer, e.g. self.register_buffer('calls', torch.zeros((), "
        "dtype=torch.long), persistent=False) and update it in place; buffers are put back. If nothing the "
        "training computes reads them (a count for logging), ignore this."
    )
