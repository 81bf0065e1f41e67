"""The attribution of a flagged step, a pure function of the runs' comparisons (replay/attribute.py)."""

from __future__ import annotations

import pytest

from lightning_stability.replay.attribute import (
    Attribution,
    Cause,
    Elsewhere,
    Evidence,
    RankVerdict,
    attribute,
    confirm_elsewhere,
    rank_verdict,
    suspects,
)

R, F, FR, N = RankVerdict.REPRODUCED, RankVerdict.FAULT, RankVerdict.FAULT_IN_REPLAY, RankVerdict.NONDETERMINISTIC


@pytest.mark.parametrize(
    ("evidence", "verdict"),
    [
        (Evidence(True), R),  # original = replay
        (Evidence(False, False, True), F),  # original != replay = second
        (Evidence(False, True, False), FR),  # original = second != replay
        (Evidence(False, False, False), N),  # all three differ
    ],
)
def test_each_rank_s_verdict_is_the_vote_of_its_runs(evidence: Evidence, verdict: RankVerdict) -> None:
    assert rank_verdict(evidence) is verdict


def test_runs_that_differ_need_a_second_replay() -> None:
    with pytest.raises(ValueError, match="second replay"):
        rank_verdict(Evidence(False))


@pytest.mark.parametrize(
    ("verdicts", "grads", "flagged", "cause", "ranks", "replay_faults"),
    [
        ([R, R], [R, R], True, Cause.DATA, (), ()),  # reproduces, flag and all
        ([R, F], [F, F], False, Cause.TRANSIENT, (1,), ()),  # rank 1's forward went wrong: every rank's gradients
        ([R, R], [F, F], False, Cause.TRANSIENT, (), ()),  # every rank's gradients differ, no loss: no rank to name
        ([R, R], [R, F], False, Cause.TRANSIENT, (1,), ()),  # rank 1's gradients alone: after the averaging
        ([F], [F], False, Cause.TRANSIENT, (0,), ()),  # one process: its gradients are its own
        ([R], [F], False, Cause.TRANSIENT, (0,), ()),  # one process, a fault in the backward only
        ([F, R], [F, F], True, Cause.DATA, (), (0,)),  # a fault on rank 0, and the replayed step is flagged too
        ([FR, R], [FR, FR], True, Cause.DATA, (), (0,)),  # rank 0's replay went wrong: the original reproduces
        ([R, N], [N, N], True, Cause.NONDETERMINISTIC, (1,), ()),
        ([F, R], [N, N], False, Cause.NONDETERMINISTIC, (), ()),  # nondeterminism wins over a fault
    ],
)
def test_the_step_s_attribution(
    verdicts: list[RankVerdict],
    grads: list[RankVerdict],
    flagged: bool,
    cause: Cause,
    ranks: tuple[int, ...],
    replay_faults: tuple[int, ...],
) -> None:
    found = attribute(verdicts, grads, flagged)
    assert (found.cause, found.ranks, found.replay_faults) == (cause, ranks, replay_faults)
    assert found.verdicts == tuple(verdicts)


def test_the_ranks_counted_against_their_device() -> None:
    assert attribute([F, FR], [F, F], False).faulty_ranks == (0, 1)  # the original's fault and the replay's
    assert attribute([FR, R], [FR, FR], True).faulty_ranks == (0,)
    assert attribute([R, R], None, True).faulty_ranks == ()


D = Cause.DATA


@pytest.mark.parametrize(
    ("found", "runs", "cause", "ranks"),
    [
        (Attribution(D), {1: Elsewhere(flagged=True)}, Cause.DATA, ()),  # bad wherever it runs: the data
        (Attribution(D), {1: Elsewhere(flagged=False)}, Cause.DEVICE, (1,)),  # bad on rank 1 only: its device
        (Attribution(D), {1: Elsewhere(True), 2: Elsewhere(False)}, Cause.DEVICE, (2,)),  # the device wins
        (Attribution(D), {}, Cause.DATA, ()),  # not run elsewhere (one process, FSDP): as found
        (Attribution(Cause.NONDETERMINISTIC, (1,)), {1: Elsewhere(False, True)}, Cause.DEVICE, (1,)),  # agree there
        (Attribution(Cause.NONDETERMINISTIC, (1,)), {1: Elsewhere(False, False)}, Cause.NONDETERMINISTIC, (1,)),
        (Attribution(Cause.TRANSIENT, (1,)), {1: Elsewhere(False)}, Cause.TRANSIENT, (1,)),  # never confirmed
    ],
)
def test_a_suspect_s_micro_batches_run_on_a_healthy_rank_tell_the_device_from_the_data(
    found: Attribution, runs: dict[int, Elsewhere], cause: Cause, ranks: tuple[int, ...]
) -> None:
    confirmed = confirm_elsewhere(found, runs)
    assert (confirmed.cause, confirmed.ranks) == (cause, ranks)
    if cause is Cause.DEVICE:
        assert confirmed.faulty_ranks == ranks  # counted against the device


@pytest.mark.parametrize(
    ("found", "flagged", "expected"),
    [
        (Attribution(D), [False, True], (1,)),  # rank 1's micro-batches flag: run them elsewhere
        (Attribution(D), [True, True], ()),  # every rank's: no healthy rank left
        (Attribution(D), [False, False], ()),  # none alone (a gradient flag): nothing to run
        (Attribution(Cause.NONDETERMINISTIC, (0,)), [False, False], (0,)),
        (Attribution(Cause.NONDETERMINISTIC, ()), [False, False], ()),  # the gradients alone name no rank
        (Attribution(Cause.NONDETERMINISTIC, (0, 1)), [False, False], ()),
        (Attribution(Cause.TRANSIENT, (1,)), [False, True], ()),  # the replay is applied: nothing to confirm
    ],
)
def test_the_suspects_are_the_ranks_to_run_elsewhere(
    found: Attribution, flagged: list[bool], expected: tuple[int, ...]
) -> None:
    assert suspects(found, flagged) == expected
