"""Suite-wide fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

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
