"""Every script in examples/ runs, as a user would run it, at a tiny size (``EXAMPLE_STEPS``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
STEPS = {"find_why_a_run_spiked.py": "60"}  # its spikes need a warmed-up statistic
#: what an example's output must not say: Lightning's warnings that contradict what the example shows
NEVER_SAYS = {
    "resume_after_a_crash.py": ("dataloader is not resumable", "HINT: Set `ModelCheckpoint(..., save_last=True)`"),
}


def test_every_how_to_has_an_example() -> None:
    pages = sorted((ROOT / "docs" / "how-to").glob("*.md"))
    assert len(pages) == len(EXAMPLES) == 13
    shown = {
        line.rsplit("/", 1)[1] for page in pages for line in page.read_text().splitlines() if "literalinclude" in line
    }
    assert shown == {e.name for e in EXAMPLES}


@pytest.mark.parametrize("script", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_the_example_runs(script: Path, tmp_path: Path) -> None:
    env = {**os.environ, "EXAMPLE_STEPS": STEPS.get(script.name, "20"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for text in NEVER_SAYS.get(script.name, ()):
        assert text not in done.stdout + done.stderr, text
