"""The README and the documentation pages run as written, and the metric-key page lists every key the package logs.

Conventions (also stated on docs/index.md): a page's ```python blocks run top to bottom in one namespace, in a
fresh working directory; a block whose first line starts with ``# needs:`` (GPUs, several nodes) is compiled and
its import lines are run, not executed; a script a page includes (``literalinclude`` of ``examples/...``) is run
by tests/test_examples.py. In ```bash blocks, every ``lightning-stability`` command is run (``demo`` only with
``--help``: the demo itself is tested in tests/test_cli.py).
"""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision

from lightning_stability import (
    ClusterHealthMonitor,
    CriticalBatchMonitor,
    GradientAccumulation,
    GradientNormMonitor,
    LossScaleTuner,
    TrainingHealthMonitor,
    WarmupConstantCosineLR,
)
from tests.helpers import TinyModule, quiet_trainer

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
DOCS = [ROOT / "README.md", *PAGES]
NEEDS = "# needs:"


def _blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), flags=re.M | re.S)


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def test_the_docs_have_code_to_test() -> None:
    assert len(PAGES) >= 27
    assert sum(len(_blocks(p, "python")) for p in DOCS) >= 15
    assert len(_blocks(ROOT / "README.md", "python")) >= 2


@pytest.mark.parametrize("path", DOCS, ids=_ids(DOCS))
def test_every_python_block_runs_as_written(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for number, block in enumerate(_blocks(path, "python"), start=1):
        name = f"{path.name} block {number}"
        code = compile(block, name, "exec")
        if block.startswith(NEEDS):  # compiled above; run its imports only
            tree = ast.parse(block)
            imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
            exec(compile(ast.Module(body=imports, type_ignores=[]), name, "exec"), {})
            continue
        exec(code, namespace)


def _commands(path: Path) -> list[list[str]]:
    found = []
    for block in _blocks(path, "bash"):
        if block.startswith(NEEDS):
            continue
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("lightning-stability "):
                args = shlex.split(line)[1:]
                if args[0] == "demo" and "--help" not in args:
                    continue
                found.append(args)
    return found


COMMANDS = [(p, c) for p in DOCS for c in _commands(p)]


def test_the_docs_have_commands_to_test() -> None:
    assert len(COMMANDS) >= 5


@pytest.mark.parametrize(("path", "args"), COMMANDS, ids=[f"{p.name}: {' '.join(a)}" for p, a in COMMANDS])
def test_every_command_runs(path: Path, args: list[str], tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lightning_stability.cli", *args],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip()


# ---- README: a landing page whose links lead somewhere


def test_the_readme_is_a_landing_page() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("path", [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "CHANGELOG.md"])
def test_every_relative_link_exists(path: Path) -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", path.read_text())
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local or path.name != "README.md"
    for link in local:
        target, _, anchor = link.partition("#")
        file = (path.parent / target) if target else path
        assert file.exists(), link
        if anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
            assert anchor in slugs, f"{link}: no heading #{anchor} in {file.name}"


def test_no_install_line_takes_the_package_from_pypi() -> None:
    """The package is not on PyPI: a page, docstring or message says how to install it from a clone
    (``pip install -e ".[report]"``), never by its name from an index (``pip install`` + the name + an extra)."""
    texts = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *PAGES]
    texts += [p for folder in ("lightning_stability", "examples", "tests") for p in (ROOT / folder).rglob("*.py")]
    texts += list((ROOT / "tests").rglob("*.sh"))
    pypi = re.compile(r"pip install\s+[\"']?lightning[-_]stability\b")
    assert len(texts) > 100
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in texts for m in pypi.finditer(p.read_text())]
    assert not found, found


# ---- the metric-key page


METRICS_PAGE = ROOT / "docs" / "reference" / "metrics.md"


def _page_keys() -> set[str]:
    """The keys in the first column of the page's tables."""
    rows = [line.split("|")[1] for line in METRICS_PAGE.read_text().splitlines() if line.startswith("| `stability/")]
    return {key for row in rows for key in re.findall(r"`(stability/[^`]+)`", row)}


def _pattern(key: str) -> re.Pattern[str]:
    """``stability/grad_norm_by_module/<module>`` matches ``stability/grad_norm_by_module/net.0``."""
    parts = re.split(r"(<\w*>)", key)
    return re.compile("".join("[^/]+" if part.startswith("<") else re.escape(part) for part in parts))


def _shape(key: str) -> str:
    """A key with its variable parts blanked: ``stability/lr_by_group/pg<i>`` and
    ``f"stability/lr_by_group/pg{i}"`` read alike."""
    return re.sub(r"<\w*>", "<>", key)


def _code_keys() -> set[str]:
    """Every metric key written in the package's source: literals, and f-strings with their fields as ``<>``."""
    keys: set[str] = set()
    for file in (ROOT / "lightning_stability").rglob("*.py"):
        tree = ast.parse(file.read_text())
        in_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstrings:
                if re.fullmatch(r"stability/\w[\w/]*\w", node.value):
                    keys.add(node.value)
            elif isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "<>" for v in node.values)
                if re.fullmatch(r"stability/\w[\w/<>]*<>", text):  # a part may sit inside: <module>/expert<e>
                    keys.add(text)
    return keys


def test_the_metric_page_lists_every_key_in_the_code_and_no_other() -> None:
    page = {_shape(k) for k in _page_keys()}
    code = {_shape(k) for k in _code_keys()}
    assert len(code) >= 25, sorted(code)
    assert not code - page, f"logged by the package but not on {METRICS_PAGE.name}: {sorted(code - page)}"
    assert not page - code, f"on {METRICS_PAGE.name} but the package logs no such key: {sorted(page - code)}"


def test_every_key_a_trainer_with_every_callback_logs_is_on_the_page(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="", version="")
    trainer = quiet_trainer(
        default_root_dir=tmp_path,
        max_steps=8,
        log_every_n_steps=2,
        logger=logger,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        callbacks=[
            GradientNormMonitor(max_norm=1.0, per_layer=True),
            WarmupConstantCosineLR(),
            GradientAccumulation(steps=2, lr_scaling="none"),
            LossScaleTuner(),
            TrainingHealthMonitor(response="clip", warmup_steps=2, report=False),
            ClusterHealthMonitor(weight_hash_every=2),
            CriticalBatchMonitor(),
        ],
    )
    trainer.fit(TinyModule(n=64, batch_size=4))
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    logged = {k for k in header if k.startswith("stability/")} | {
        k for k in trainer.callback_metrics if k.startswith("stability/")
    }
    patterns = [_pattern(k) for k in _page_keys()]
    missing = sorted(k for k in logged if not any(p.fullmatch(k) for p in patterns))
    assert not missing, f"logged but not on {METRICS_PAGE.name}: {missing}"
    # every section of the page is exercised by this run (the keys that need CUDA or several ranks aside)
    assert len(logged) >= 20, sorted(logged)


# ---- the API reference


def test_every_public_name_is_on_the_api_page() -> None:
    import lightning_stability

    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    documented = set(re.findall(r"^\.\. auto(?:class|function):: [\w.]+\.(\w+)$", page, flags=re.M))
    assert documented <= set(lightning_stability._EXPORTS)
    assert set(lightning_stability._EXPORTS) == documented
    for target in re.findall(r"^\.\. auto(?:class|function):: ([\w.]+)$", page, flags=re.M):
        module, name = target.rsplit(".", 1)
        assert lightning_stability._EXPORTS[name] == module, target
