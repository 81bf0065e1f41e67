"""The public API: one table of names, every name importable, every import line of the docs working."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_stability
from lightning_stability.ledger import LedgerCallback

ROOT = Path(__file__).resolve().parents[1]
#: the checkpoint units usable alone: plain Lightning callbacks (not LedgerCallbacks)
CHECKPOINT_UNITS = {"ExactResume", "PreemptionCheckpoint"}
CALLBACKS = {
    *CHECKPOINT_UNITS,
    "BatchRamp",
    "ClusterHealthMonitor",
    "CriticalBatchMonitor",
    "GradientAccumulation",
    "GradientNormMonitor",
    "LossScaleTuner",
    "PrecursorMonitor",
    "RouterHealthMonitor",
    "ScheduledLR",
    "StepReplay",
    "TrainingHealthMonitor",
    "WarmupConstantCosineLR",
}


def test_all_is_the_table_and_every_name_imports_from_its_module() -> None:
    exports = lightning_stability._EXPORTS
    assert lightning_stability.__all__ == sorted(exports)
    for name, module in exports.items():
        value = getattr(lightning_stability, name)
        assert getattr(importlib.import_module(module), name) is value, name
        assert getattr(value, "__module__", module) == module, f"{name} is defined in {value.__module__}"


def test_the_type_checking_imports_are_the_table() -> None:
    """The ``TYPE_CHECKING`` block (for type checkers) names exactly the table's names, from the same modules."""
    tree = ast.parse(Path(lightning_stability.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    imported = {
        alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    assert imported == lightning_stability._EXPORTS


def test_callbacks_holds_every_callback() -> None:
    from lightning_stability import callbacks

    assert set(callbacks.__all__) == CALLBACKS
    exported = {n for n in lightning_stability.__all__ if isinstance(getattr(lightning_stability, n), type)}
    ours = {n for n in exported if issubclass(getattr(lightning_stability, n), LedgerCallback)} - {"LedgerCallback"}
    assert ours == CALLBACKS - CHECKPOINT_UNITS
    for name in CHECKPOINT_UNITS:
        unit = getattr(lightning_stability, name)
        assert issubclass(unit, Callback) and not issubclass(unit, (LedgerCallback, ModelCheckpoint)), name
    for name in CALLBACKS:
        assert getattr(callbacks, name) is getattr(lightning_stability, name)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'GradientClipper'"):
        lightning_stability.GradientClipper  # noqa: B018


def _doc_imports(path: Path) -> list[str]:
    text = path.read_text()
    found = re.findall(r"^\s*(from lightning_stability[\w.]* import (?:\([^)]*\)|[^\n]+))", text, flags=re.M)
    return [re.sub(r"\s*#[^\n]*", "", line) for line in found]


DOCS = ["README.md", "ARCHITECTURE.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
DOCS += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.py"))


def test_the_parse_finds_the_docs_imports() -> None:
    assert len(_doc_imports(ROOT / "README.md")) >= 2
    assert sum(len(_doc_imports(ROOT / doc)) for doc in DOCS) >= 25


@pytest.mark.parametrize("doc", DOCS)
def test_every_import_line_of_the_docs_works(doc: str) -> None:
    for line in _doc_imports(ROOT / doc):
        exec(compile(line, doc, "exec"), {})  # raises ImportError on a name that is not there
