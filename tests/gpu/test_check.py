"""``tests/gpu/check.sh``, the one command a session lent a GPU runs, kept working on the CPU.

Its figures mean nothing on a CPU; this checks that every section runs to its own summary line and that the
sections whose answer does not depend on the device (fp16 ``init_scale="auto"``, the CUDA-only tests, which skip
here) pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

SECTIONS = ("syncs", "fp16auto", "gpu-tests", "overhead", "grad-norm", "tp", "precursors", "tp-2x2")


@pytest.mark.skipif("CHECK_DEVICE" in os.environ, reason="inside check.sh itself")
def test_the_gpu_check_runs_every_section_to_a_summary_line_on_the_cpu(tmp_path: Path) -> None:
    env = dict(os.environ, OUT=str(tmp_path), CHECK_DEVICE="cpu", CHECK_QUICK="1", OMP_NUM_THREADS="1")
    env["PYTHON"] = sys.executable  # this test's interpreter, whichever venv it is in
    proc = subprocess.run(
        ["bash", str(REPO / "tests/gpu/check.sh")], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("GPU check of lightning_stability")
    assert "torch" in summary[1] and "lightning" in summary[1]
    verdicts = {line.split(":")[0]: line for line in summary[2:] if not line.startswith(" ")}
    assert tuple(verdicts) == SECTIONS, summary
    for line in verdicts.values():
        assert "TIMEOUT" not in line and "ERROR" not in line, line
    assert verdicts["fp16auto"].startswith("fp16auto: PASS"), verdicts["fp16auto"]
    assert verdicts["gpu-tests"].startswith("gpu-tests: PASS"), verdicts["gpu-tests"]
    assert "kernel launches per step" in verdicts["overhead"]
    tp = verdicts["tp"]  # its norms and host syncs hold on any device
    assert tp.startswith("tp: PASS") and "norms of DTensors on a 1x1 cpu mesh" in tp, tp
    assert "non-logging max 0" in tp and "tensor parallel: " in tp, tp
    precursors = verdicts["precursors"]  # host syncs and keys hold on any device
    assert precursors.startswith("precursors: PASS") and "non-logging max 0" in precursors, precursors
    assert "keys missing: none" in precursors, precursors
    assert verdicts["tp-2x2"].startswith("tp-2x2: INFO not run: 0 CUDA device(s)"), verdicts["tp-2x2"]
    details = (tmp_path / "details.txt").read_text()
    assert all(f"===== {name}" in details for name in SECTIONS[:-1])  # tp-2x2 runs on 4 GPUs only
