"""benchmarks.moe_collapse: its quick run end to end; the plain arm collapses, the monitor alone changes nothing."""

from __future__ import annotations

import pytest
import torch

from benchmarks import moe_collapse


@pytest.mark.usefixtures("restore_process_settings")
def test_the_plain_arm_collapses_and_the_monitor_changes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    runs = moe_collapse.main(["--quick", "--arms", "plain", "monitor"])
    out = capsys.readouterr().out
    assert "bit-equal to plain's at every step: yes" in out
    (plain,), (monitor,) = runs["plain"], runs["monitor"]
    assert torch.equal(plain.losses, monitor.losses)
    # most tokens to one or two experts of eight: the busiest takes over 3x its share, the two busiest over half
    assert plain.held_vio > 2.0 and plain.top2 > 0.5
    assert monitor.max_vio is not None and monitor.max_vio > 2.0


@pytest.mark.usefixtures("restore_process_settings")
def test_without_the_skew_the_disjoint_case_stays_near_balanced() -> None:
    """The earlier case (4 disjoint clusters, experts of 64): unskewed it stays near balance, skewed it does not."""
    earlier = ["--quick", "--arms", "plain", "--data", "disjoint", "--clusters", "4", "--expert-size", "64"]
    (unskewed,) = moe_collapse.main([*earlier, "--skew", "0"])["plain"]
    (skewed,) = moe_collapse.main(earlier)["plain"]
    assert unskewed.held_vio < 1.5 < skewed.held_vio


def test_each_cluster_keeps_to_its_own_tokens() -> None:
    data = moe_collapse.clustered(4, 8, seed=0)
    per = moe_collapse.VOCAB // 4
    assert torch.equal(data // per, (torch.arange(8) % 4)[:, None].expand(8, moe_collapse.LENGTH))
