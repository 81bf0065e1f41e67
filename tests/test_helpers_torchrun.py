"""tests/helpers.torchrun ends every process it started when its timeout passes: the agent, the workers (each in a
session of its own) and what a worker started, so a hanging multi-process test fails at its limit."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import torchrun

pytestmark = pytest.mark.distributed

HANG = """
import os, subprocess, sys, time
out = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
with open(os.path.join(out, f"pids.{os.environ['RANK']}"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
time.sleep(300)
"""
TIMEOUT = 20  # torchrun's start on a busy 2-core machine takes ~10 s; its workers here import no torch


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended (its parent has not reaped it yet)


def test_a_timeout_ends_every_worker(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    raised: list[BaseException] = []

    def call() -> None:
        try:
            torchrun(script, 2, tmp_path, timeout=TIMEOUT)
        except BaseException as err:
            raised.append(err)

    started = time.monotonic()
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(TIMEOUT + 60)
    pids = [int(p) for f in tmp_path.glob("pids.*") for p in f.read_text().split()]
    try:
        assert len(pids) == 4, f"the workers did not start within {TIMEOUT} s"
        assert not thread.is_alive(), f"torchrun() still waits {time.monotonic() - started:.0f} s after its start"
        assert len(raised) == 1 and isinstance(raised[0], subprocess.TimeoutExpired), raised
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in pids if alive(pid)], "processes of the run outlived its timeout"
    finally:
        for pid in pids:  # whatever a failing helper left
            if alive(pid):
                os.kill(pid, 9)
