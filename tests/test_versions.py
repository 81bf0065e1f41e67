"""The torch range: declared lower bound, no cap below the next major, one warning past the newest tested."""

from __future__ import annotations

import configparser
import re
import warnings
from pathlib import Path

import pytest
import torch

from lightning_stability import GradientNormMonitor, _compat
from tests.helpers import TinyModule, quiet_trainer

ROOT = Path(__file__).resolve().parents[1]


def _requirement(name: str) -> str:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = [line.strip() for line in cfg["options"]["install_requires"].splitlines() if line.strip()]
    (spec,) = [line for line in lines if re.match(rf"{name}\b", line)]
    return spec


def test_setup_cfg_declares_the_oldest_tested_torch_and_no_cap_below_the_next_major() -> None:
    spec = _requirement("torch")
    oldest = ".".join(map(str, _compat.TORCH_TESTED[0]))
    assert f">={oldest}" in spec, spec
    caps = re.findall(r"<=?\s*([\d.]+)", spec)
    assert all(int(cap.split(".")[0]) >= 3 for cap in caps), f"{spec} caps torch below its next major"


def test_the_tested_range_is_the_torch_versions_ci_installs() -> None:
    """``TORCH_TESTED`` (the warning, the error's supported range) names the oldest and newest torch .ci/run tests."""
    pins = re.findall(r'"torch==(\d+)\.(\d+)\.\d+"', (ROOT / ".ci" / "run").read_text())
    minors = sorted({(int(major), int(minor)) for major, minor in pins})
    assert minors, "no torch pin found in .ci/run"
    assert (minors[0], minors[-1]) == _compat.TORCH_TESTED
    assert _compat.SUPPORTED.endswith(f"(tested: torch {' and '.join(f'{a}.{b}' for a, b in minors)})")


@pytest.mark.parametrize(
    ("version", "expected"),
    [("2.13.0", (2, 13)), ("2.14.1+cu128", (2, 14)), ("2.16.0a0+git1a2b3c", (2, 16)), ("3.0.0", (3, 0))],
)
def test_torch_minor_parses_release_local_and_nightly_versions(version: str, expected: tuple[int, int]) -> None:
    assert _compat.torch_minor(version) == expected


def test_a_newer_torch_warns_once_with_the_tested_range_and_a_tested_one_not_at_all() -> None:
    _compat.warn_if_untested.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _compat.warn_if_untested("2.14.1+cu128") is False
            assert _compat.warn_if_untested("2.13.0+cpu") is False
            assert _compat.warn_if_untested("2.15.0") is True
            assert _compat.warn_if_untested("2.15.0") is True  # cached: the same answer, no second warning
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1, messages
        assert "tested with torch 2.13 to 2.14" in messages[0] and "torch 2.15.0" in messages[0]
    finally:
        _compat.warn_if_untested.cache_clear()


def test_setup_warns_once_on_an_untested_newer_torch_and_still_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a user on a torch released after this package sees: one warning at setup, then training."""
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    _compat.warn_if_untested.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"tested with torch 2\.13 to 2\.14; this is torch 2\.99\.0") as record:
            trainer = quiet_trainer(max_steps=3, callbacks=[GradientNormMonitor()])
            trainer.fit(TinyModule())
        assert sum("tested with torch" in str(w.message) for w in record) == 1
        assert trainer.global_step == 3
    finally:
        _compat.warn_if_untested.cache_clear()


def test_the_installed_torch_is_within_the_tested_range_or_warns() -> None:
    """The CI venvs (2.13 and 2.14) are inside the range: no warning there."""
    inside = _compat.TORCH_TESTED[0] <= _compat.torch_minor(str(torch.__version__)) <= _compat.TORCH_TESTED[1]
    _compat.warn_if_untested.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _compat.warn_if_untested()
        assert (len(caught) == 0) == inside
    finally:
        _compat.warn_if_untested.cache_clear()
