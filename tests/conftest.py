"""Suite-wide fixtures."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator

import pytest
import torch

# The step table's debug check, on for every test and the processes they start: a stage that changes the weights
# where it may not fails the test (lightning_stability/ledger/stages.py).
os.environ.setdefault("LIGHTNING_STABILITY_CHECK_STAGES", "1")

#: what Lightning's process launcher writes into ``os.environ`` of the process that calls ``fit`` (even with one
#: device, e.g. Lightning's FSDPStrategy); a later test's subprocess that inherits ``LOCAL_RANK`` believes it was
#: launched externally and waits forever for ranks that are never started
_LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def launcher_environment_restored() -> Iterator[None]:
    """Each test leaves the launcher's environment variables as it found them."""
    before = {key: os.environ.get(key) for key in _LAUNCHER_VARIABLES}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def signal_handlers_restored() -> Iterator[None]:
    """Each test leaves the SIGTERM and SIGUSR1 handlers as it found them (a test that signals its own process
    installs handlers through the callbacks it fits)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture
def restore_process_settings() -> Iterator[None]:
    """For a test that runs a benchmark in this process: the benchmark sets torch's thread count and quiets
    Lightning's loggers for the whole process; put both back."""
    names = ("lightning.pytorch", "lightning.fabric", "lightning_stability")
    threads, levels = torch.get_num_threads(), {n: logging.getLogger(n).level for n in names}
    yield
    torch.set_num_threads(threads)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
