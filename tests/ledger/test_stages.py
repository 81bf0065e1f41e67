"""The step table as code: ``Stage`` against the table in ``ledger/step.py``, ``StepLedger.at``, and the debug check
that no row changes the weights where it may not."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.optim import Optimizer

import lightning_stability
from lightning_stability import GradientNormMonitor, LedgerCallback, StabilityConfigError, Stage, StepLedger
from lightning_stability.ledger import step as step_module
from lightning_stability.ledger.stages import CHECK_ENV, WEIGHTS

PACKAGE = Path(lightning_stability.__file__).parent


def _table_rows() -> dict[str, str]:
    """The step table of ``ledger/step.py``'s docstring: row label -> the row's text (its lines joined)."""
    doc = step_module.__doc__ or ""
    rows: dict[str, str] = {}
    label = None
    inside = 0
    for line in doc.splitlines():
        if line.startswith("==="):
            inside += 1
            continue
        if inside != 2:  # between the header's rule and the closing rule
            continue
        match = re.match(r"^\s?(\d+b?)\s{2,}", line)
        if match:
            label = match.group(1)
            rows[label] = line
        elif label is not None:
            rows[label] += " " + line.strip()
    return rows


def test_the_table_in_step_py_is_the_stage_enum() -> None:
    rows = _table_rows()
    assert list(rows) == [stage.row for stage in Stage]
    for stage in Stage:
        assert re.match(rf"^\s?{stage.row}\s+``{stage.name}``", rows[stage.row]), rows[stage.row]
        if stage.registers:
            assert f"Stage.{stage.name}" in rows[stage.row], f"row {stage.row} does not name its registered functions"


def test_the_docs_point_to_the_one_table() -> None:
    """The table lives in one place: the docs name the file, and no page copies a row of it."""
    root = PACKAGE.parent
    concept = (root / "docs" / "concepts" / "step-ledger.md").read_text()
    assert "lightning_stability/ledger/step.py" in concept
    for page in (root / "docs").rglob("*.md"):
        text = page.read_text()
        assert "``AFTER_UPDATE``: **edits after the" not in text, page


def test_the_rows_that_may_change_the_weights() -> None:
    writers = {stage for stage in Stage if WEIGHTS in stage.writes}
    assert writers == {Stage.OPEN, Stage.UPDATE, Stage.AFTER_UPDATE}
    assert [s for s in Stage if s.registers] == [
        Stage.BACKWARD,
        Stage.OPEN,
        Stage.REPLAY,
        Stage.ENFORCE,
        Stage.AFTER_UPDATE,
        Stage.AFTER_STEP,
    ]


def _trainer(callbacks: list[pl.Callback], steps: int = 3) -> pl.Trainer:
    return pl.Trainer(
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )


def test_at_refuses_a_row_that_runs_no_function_and_a_second_replay() -> None:
    ledger = StepLedger()
    refused = r"Stage.CLIP \(row 5\) runs no registered function. Fix: one of Stage.BACKWARD, Stage.OPEN"
    with pytest.raises(ValueError, match=refused):
        ledger.at(Stage.CLIP, "mine", lambda ledger: None)
    with pytest.raises(StabilityConfigError, match="stage"):
        ledger.at("open", "mine", lambda ledger: None)  # type: ignore[arg-type]
    ledger.at(Stage.REPLAY, "StepReplay", lambda ledger: None)
    with pytest.raises(ValueError, match=r"Stage\.REPLAY runs one function"):
        ledger.at(Stage.REPLAY, "other", lambda ledger: None)


class _Order(LedgerCallback):
    """Registers at every row that takes functions, under ``name``; notes the rows in the order they ran."""

    def __init__(self, name: str, seen: list[tuple[str, str]]) -> None:
        super().__init__()
        self.name, self.seen = name, seen

    def on_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ledger = StepLedger.of(trainer)
        for stage in (Stage.OPEN, Stage.ENFORCE, Stage.AFTER_UPDATE, Stage.AFTER_STEP):
            ledger.at(stage, self.name, self._note(stage))

    def _note(self, stage: Stage) -> Callable[[StepLedger], None]:
        return lambda ledger: self.seen.append((stage.row, self.name))

    @classmethod
    def kind(cls) -> type[LedgerCallback]:
        return _Order  # two of them may share a Trainer here: only the template's one-instance check sees kinds

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._alone = True
        self.on_setup(trainer, pl_module)


@pytest.mark.parametrize("names", [("a", "b"), ("b", "a")])
def test_a_rows_functions_run_in_the_order_of_their_names(names: tuple[str, str]) -> None:
    seen: list[tuple[str, str]] = []
    _trainer([_Order(names[0], seen), _Order(names[1], seen)], steps=1).fit(BoringModel())
    assert seen == [(row, name) for row in ("3", "8", "11", "13") for name in ("a", "b")]


class _WritesIn(LedgerCallback):
    """Halves the first layer's weight in ``on_step`` (row 4 to 6: not allowed), or at ``stage`` through ``at``."""

    def __init__(self, stage: Stage | None) -> None:
        super().__init__()
        self.stage = stage
        self.calls = 0

    def on_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stage is not None:
            StepLedger.of(trainer).at(self.stage, "halve", lambda ledger: self._halve(ledger.trainer))

    def on_step(self, trainer: pl.Trainer, ledger: StepLedger, optimizer: Optimizer) -> None:
        if self.stage is None:
            self._halve(trainer)

    def _halve(self, trainer: pl.Trainer | None) -> None:
        assert trainer is not None
        self.calls += 1
        with torch.no_grad():
            trainer.lightning_module.layer.weight.mul_(0.5)


def test_the_debug_check_fails_a_write_outside_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHECK_ENV, "1")
    with pytest.raises(AssertionError, match=r"between row 4 \(MEASURE\) and row 8 \(ENFORCE\) of the step table"):
        _trainer([_WritesIn(None)]).fit(BoringModel())


@pytest.mark.parametrize("stage", [Stage.OPEN, Stage.AFTER_UPDATE])
def test_the_debug_check_takes_a_write_at_a_row_that_may(monkeypatch: pytest.MonkeyPatch, stage: Stage) -> None:
    monkeypatch.setenv(CHECK_ENV, "1")
    torch.manual_seed(0)
    plain = BoringModel()
    _trainer([]).fit(plain)
    torch.manual_seed(0)
    model, writer = BoringModel(), _WritesIn(stage)
    _trainer([writer]).fit(model)
    assert writer.calls == 3  # one write a step, none refused
    assert not torch.equal(model.layer.weight, plain.layer.weight)


def test_the_debug_check_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CHECK_ENV, raising=False)
    _trainer([_WritesIn(None)]).fit(BoringModel())  # no check: the write goes through unnoticed


def test_a_write_after_the_step_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHECK_ENV, "1")

    class AfterStep(_WritesIn):
        def after_step(self, trainer: pl.Trainer, ledger: StepLedger) -> None:
            self._halve(trainer)

    with pytest.raises(AssertionError, match=r"row 13 \(AFTER_STEP\)"):
        _trainer([AfterStep(Stage.ENFORCE), GradientNormMonitor()]).fit(BoringModel())


def test_no_package_calls_a_private_method_of_another() -> None:
    """A package reaches another through its public names only (``_compat`` aside: it is the one home of private
    Lightning and torch names)."""
    trees = {path: ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}

    def package_of(path: Path) -> str:
        parts = path.relative_to(PACKAGE).parts
        return parts[0] if len(parts) > 1 else path.stem

    owners: dict[str, set[str]] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and re.fullmatch(r"_[a-z]\w*", node.name):
                owners.setdefault(node.name, set()).add(package_of(path))
    found = []
    for path, tree in trees.items():
        here = package_of(path)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name, receiver = node.func.attr, node.func.value
            if not re.fullmatch(r"_[a-z]\w*", name):
                continue
            if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls", "_compat"):
                continue
            if isinstance(receiver, ast.Call) and ast.unparse(receiver.func) == "super":
                continue
            where = owners.get(name, set())
            if where and here not in where:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node.func)}")
    assert not found, "private methods called across packages:\n" + "\n".join(found)
