"""Who caused a flagged step: the data, one rank's device, or nondeterminism. Pure functions of what the step and
its replays left, the same on every rank (they read the evidence every rank gathered).

The evidence of one rank is, per run of the step (the original, the first replay and, when the two differ, a
second replay): did this run give the same losses as the original, bit for bit, and the same gradients. Per rank,
three runs vote:

==================================  =====================================================  ===================
the runs                            what it means                                          the rank's verdict
==================================  =====================================================  ===================
original = replay                   the step reproduces                                    ``REPRODUCED``
original != replay = second replay  the original run went wrong, once                      ``FAULT``
original = second replay != replay  the replay went wrong, once; the original reproduces   ``FAULT_IN_REPLAY``
all three differ                    the step does not reproduce at all                     ``NONDETERMINISTIC``
==================================  =====================================================  ===================

The step's attribution then reads the ranks' verdicts (:func:`attribute`): any ``NONDETERMINISTIC`` rank makes the
step nondeterministic; else any ``FAULT`` rank makes it a transient fault on those ranks (the replay's gradients
are the ones a fault-free run computes), unless the replay is flagged as well (then the data is bad too); else the
step reproduces, and a step that reproduces its flag is the data's doing. The gradients are compared after data
parallelism averaged them: a fault that changed them on every rank of several (it happened before the averaging)
is placed by the losses, or on an unknown rank (``ranks`` empty); one that changed them on some ranks only (after
the averaging) is placed there.

A step that reproduces its flag on a rank, run after run, may still be that rank's device failing the same way every
time; a rank whose runs all differ may be its device failing differently each time. Under data parallelism (every
rank holds the same weights) the suspect rank's micro-batches are then run on a healthy rank, and
:func:`confirm_elsewhere` reads what they did there (:class:`Elsewhere`):

==========================================  ===============================================  ==================
the step's attribution, on the suspect      its micro-batches on a healthy rank              the cause
==========================================  ===============================================  ==================
``DATA`` (its micro-batches flag, alike)    flag there too                                   ``DATA``
``DATA``                                    flag nothing there                               ``DEVICE``
``NONDETERMINISTIC`` (no two runs agree)    two runs there agree, bit for bit                ``DEVICE``
``NONDETERMINISTIC``                        two runs there disagree too                      ``NONDETERMINISTIC``
==========================================  ===============================================  ==================

One process has no other device to run them on: there a device that fails the same way every time is taken for
bad data, and one that fails differently each time for nondeterminism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class RankVerdict(str, Enum):
    """What the runs of one step say about one rank (see the module's table)."""

    REPRODUCED = "reproduced"
    FAULT = "fault"
    FAULT_IN_REPLAY = "fault_in_replay"
    NONDETERMINISTIC = "nondeterministic"


class Cause(str, Enum):
    """The attribution of a flagged step."""

    DATA = "data"  # the step reproduces its flag: the batch is bad
    TRANSIENT = "transient"  # a run went wrong once, on ``ranks``: the replay's step is the step
    NONDETERMINISTIC = "nondeterministic"  # the step does not reproduce: neither run can be trusted
    DEVICE = "device"  # the fault follows a rank's device, not its micro-batches (run on another rank)


@dataclass(frozen=True)
class Evidence:
    """One rank's comparisons of the runs of one step.

    Attributes:
        replay_same: the first replay's losses (this rank's) equal the original's, bit for bit.
        second_same_as_original: a second replay's losses equal the original's (``None``: no second replay).
        second_same_as_replay: a second replay's losses equal the first replay's (``None``: none).
    """

    replay_same: bool
    second_same_as_original: bool | None = None
    second_same_as_replay: bool | None = None


def rank_verdict(evidence: Evidence) -> RankVerdict:
    """One rank's verdict from its evidence (the module's table)."""
    if evidence.replay_same:
        return RankVerdict.REPRODUCED
    if evidence.second_same_as_replay:
        return RankVerdict.FAULT
    if evidence.second_same_as_original:
        return RankVerdict.FAULT_IN_REPLAY
    if evidence.second_same_as_original is None:
        raise ValueError("the original and the replay differ: a second replay must decide (Evidence.second_*)")
    return RankVerdict.NONDETERMINISTIC


@dataclass(frozen=True)
class Attribution:
    """The attribution of one flagged step.

    Attributes:
        cause: :class:`Cause`.
        ranks: the ranks the cause lies on: the faulty ranks (``TRANSIENT``; empty when the fault showed only in the
            gradients of every rank), the ranks that did not reproduce (``NONDETERMINISTIC``), the failing devices'
            ranks (``DEVICE``); empty for ``DATA``.
        replay_faults: ranks whose *replay* went wrong (counted against their device like any fault).
        verdicts: every rank's :class:`RankVerdict`, in rank order.
    """

    cause: Cause
    ranks: tuple[int, ...] = ()
    replay_faults: tuple[int, ...] = ()
    verdicts: tuple[RankVerdict, ...] = field(default=())

    @property
    def faulty_ranks(self) -> tuple[int, ...]:
        """Every rank a run went wrong on: what counts against a device."""
        own = self.ranks if self.cause in (Cause.TRANSIENT, Cause.DEVICE) else ()
        return tuple(sorted({*own, *self.replay_faults}))


def attribute(
    verdicts: list[RankVerdict], grads: list[RankVerdict] | None = None, replay_flagged: bool = True
) -> Attribution:
    """The step's attribution from every rank's verdict on its own losses and on its gradients, and whether the
    replay is still flagged.

    A rank's gradients are compared after data parallelism averaged (or reduce-scattered) them: a fault in any
    rank's forward or backward changes every rank's, so a gradient fault seen on every rank of several names none
    (the losses may); one seen on some ranks only happened there, after the averaging, and names them.

    Args:
        verdicts: each rank's :func:`rank_verdict` on its own losses, in rank order.
        grads: each rank's verdict on its gradients, by the same table (``None``: all reproduced).
        replay_flagged: the replay's step is flagged too (read when the original went wrong: the replay is then
            what a fault-free run computes; a reproduced step is flagged like the original).
    """
    by_rank = tuple(verdicts)
    by_grads = tuple(grads) if grads is not None else (RankVerdict.REPRODUCED,) * len(by_rank)

    def ranks_of(kind: RankVerdict) -> tuple[tuple[int, ...], bool]:
        """The ranks whose runs say ``kind``, by losses or by gradients (the latter only where they locate it), and
        whether the gradients say it anywhere."""
        by_loss = {r for r, v in enumerate(by_rank) if v is kind}
        in_grads = {r for r, v in enumerate(by_grads) if v is kind}
        located = in_grads if len(in_grads) < len(by_grads) or len(by_grads) == 1 else set()
        return tuple(sorted(by_loss | located)), bool(in_grads)

    odd, odd_grads = ranks_of(RankVerdict.NONDETERMINISTIC)
    if odd or odd_grads:
        return Attribution(Cause.NONDETERMINISTIC, odd, verdicts=by_rank)
    in_replay, _ = ranks_of(RankVerdict.FAULT_IN_REPLAY)
    faulty, faulty_grads = ranks_of(RankVerdict.FAULT)
    if faulty or faulty_grads:
        # the replay is what a fault-free run computes; flagged still, the data is bad as well
        if replay_flagged:
            return Attribution(Cause.DATA, (), tuple(sorted({*faulty, *in_replay})), by_rank)
        return Attribution(Cause.TRANSIENT, faulty, in_replay, by_rank)
    # the original reproduces (a fault in the replay aside), flag and all: the batch is bad
    return Attribution(Cause.DATA, (), in_replay, by_rank)


@dataclass(frozen=True)
class Elsewhere:
    """What a suspect rank's micro-batches did when a healthy rank ran them (the same weights, the same RNG states).

    Attributes:
        flagged: one of them reproduced the flag there (a non-finite or spiking loss).
        same: two runs there agreed bit for bit (``None``: run once).
    """

    flagged: bool
    same: bool | None = None


def suspects(found: Attribution, flagged: list[bool]) -> tuple[int, ...]:
    """The ranks whose micro-batches are to be run elsewhere before ``found`` is acted on: under ``DATA``, the ranks
    whose own micro-batches reproduce the flag (``flagged``, in rank order), unless every rank's do (no healthy rank
    is left to run them); under ``NONDETERMINISTIC``, the ranks whose own losses disagree, unless that is every
    rank or none (the gradients alone). Empty: nothing to confirm."""
    if found.cause is Cause.DATA:
        ranks = tuple(r for r, f in enumerate(flagged) if f)
    elif found.cause is Cause.NONDETERMINISTIC:
        ranks = found.ranks
    else:
        return ()
    return ranks if len(ranks) < len(flagged) else ()


def confirm_elsewhere(found: Attribution, runs: dict[int, Elsewhere]) -> Attribution:
    """The step's attribution once the suspect ranks' micro-batches ran on a healthy rank (the module's second
    table). ``runs``: suspect rank -> what its micro-batches did there; empty, or a suspect missing: ``found``
    stands for it. Any rank found failing makes the step's cause ``DEVICE`` on those ranks (the run stops there;
    a suspect whose micro-batches flag elsewhere too is left to that stop)."""
    if found.cause is Cause.DATA:
        failing = tuple(sorted(r for r, e in runs.items() if not e.flagged))
    elif found.cause is Cause.NONDETERMINISTIC:
        failing = tuple(sorted(r for r, e in runs.items() if r in found.ranks and e.same))
    else:
        failing = ()
    if not failing:
        return found
    return Attribution(Cause.DEVICE, failing, found.replay_faults, found.verdicts)
