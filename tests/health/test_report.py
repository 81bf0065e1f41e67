"""The stability report: strict JSON with the right summary, a real PNG, and the path without matplotlib."""

from __future__ import annotations

import json
import logging
import math
import struct
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_stability import StableTrainer
from lightning_stability.health.report import _draw, figure_class, load_report, summarize, write_report
from tests.helpers import QUIET, TinyModule

nan, inf = math.nan, math.inf
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def synthetic_run() -> tuple[dict[str, list[float]], list[dict[str, Any]]]:
    """300 steps: a loss spike at 150, a gradient-norm spike alone at 120 (applied, clipped), a divergence at 200,
    skips of every reason, two rollbacks."""
    n = 300
    h: dict[str, list[float]] = {
        "step": [float(s) for s in range(n)],  # the health history records steps as floats
        "loss": [2.0 * math.exp(-s / 150) + 0.5 + 0.02 * math.sin(s) for s in range(n)],
        "loss_spike": [0.0] * n,
        "grad_spike": [0.0] * n,
        "grad_norm": [1.0 + 0.1 * math.cos(s) for s in range(n)],
        "clip_threshold": [nan] * 20 + [2.0 + 0.001 * s for s in range(20, n)],
        "lr": [1e-3 * min(1.0, (s + 1) / 50) for s in range(n)],
        "loss_scale": [65536.0] * 40 + [32768.0] + [16384.0] * (n - 41),
        "update_ratio": [1e-3 if s % 25 == 0 else nan for s in range(n)],
        "memory_gb": [10.0 + s / 100 if s % 50 == 0 else nan for s in range(n)],
        "outcome": [0.0] * n,
    }
    h["loss"][150], h["loss"][151] = 9.0, 6.0  # a spike over two steps
    h["loss_spike"][150] = h["loss_spike"][151] = 1.0
    h["grad_norm"][150] = 42.0  # the largest finite gradient norm
    h["grad_spike"][150] = 1.0  # skipped with the loss spike
    h["grad_norm"][120], h["grad_spike"][120] = 30.0, 1.0  # alone: applied, clipped to 2.12
    h["loss"][100] = 0.25  # the smallest loss
    h["loss"][200], h["grad_norm"][200] = inf, inf  # diverged
    h["loss"][201], h["grad_norm"][201] = nan, nan
    h["loss"][298], h["loss"][299] = 0.75, nan  # the last finite loss is at 298
    h["memory_gb"][150] = 30.5  # the peak
    h["update_ratio"][275] = inf
    for step, code in ((40, 1), (41, 1), (200, 2), (150, 3), (221, 4), (222, 4), (223, 4)):
        h["outcome"][step] = float(code)
    events = [
        {"step": 150, "kind": "spike", "detail": "those updates were skipped; rolling back"},
        {"step": 220, "kind": "rollback", "to_step": 200, "detail": "restored step 200"},
        {"step": 221, "kind": "data_skip", "detail": "3 batches"},
        {"step": 260, "kind": "rollback", "to_step": 240, "detail": "restored step 240"},
        {"step": 280, "kind": "warning", "detail": "memory near capacity"},
    ]
    return h, events


EXPECTED_SUMMARY = {
    "steps": 300,
    "final_loss": 0.75,
    "min_loss": 0.25,
    "loss_spikes": 2,
    "grad_norm_spikes": 2,
    "spikes_applied": 2,  # the loss spike's second step (151) and the gradient-norm spike alone (120)
    "clipped_steps": 1,  # 120 (150's norm is over the clip too, but its update was skipped)
    "skipped_steps": {
        "scaler_overflow": 2,
        "nonfinite_grad": 1,
        "spike": 1,
        "data_skip": 3,
        "quarantined": 0,
        "total": 7,
    },
    "rollbacks": 2,
    "max_grad_norm": 42.0,
    "peak_memory_gb": 30.5,
    "final_loss_scale": 16384.0,
}


def _reject_constant(name: str) -> None:
    raise AssertionError(f"non-standard JSON constant {name}")


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_json_is_strict_and_round_trips_with_the_summary(tmp_path: Path) -> None:
    history, events = synthetic_run()
    meta = {"response": "rollback", "spike_z": 6.0, "module_names": ["a", "b"]}
    json_path, _ = write_report(history, events, tmp_path / "out", meta)

    assert json_path == tmp_path / "out" / "stability_report.json"
    strict = json.loads(json_path.read_text(), parse_constant=_reject_constant)  # no NaN/Infinity literals
    report = load_report(json_path)
    assert report == strict
    assert list(report) == ["meta", "summary", "history", "events", "incidents"]
    assert report["meta"] == meta
    assert report["summary"] == EXPECTED_SUMMARY
    assert report["events"] == events

    out = report["history"]
    assert set(out) == set(history)
    assert out["step"] == list(range(300)) and all(type(s) is int for s in out["step"])
    assert out["loss"][200] is None and out["loss"][201] is None and out["loss"][299] is None
    assert out["grad_norm"][200] is None and out["update_ratio"][275] is None
    assert out["clip_threshold"][:20] == [None] * 20
    assert out["loss"][150] == 9.0 and out["loss_scale"][40] == 32768.0
    assert out["memory_gb"][1] is None and out["memory_gb"][150] == 30.5
    # every finite value survives exactly; the outcome by name
    for key, values in history.items():
        if key != "outcome":
            assert [v if math.isfinite(v) else None for v in values] == out[key], key
    names = {0: "applied", 1: "skipped_scaler", 2: "skipped_nonfinite", 3: "skipped_spike", 4: "skipped_rollback"}
    assert out["outcome"] == [names[int(v)] for v in history["outcome"]]


def test_summary_of_a_report_read_back_is_the_same() -> None:
    history, events = synthetic_run()
    restored = json.loads(json.dumps({"h": history}).replace("NaN", "null").replace("Infinity", "null"))["h"]
    assert summarize(restored, events) == EXPECTED_SUMMARY


def test_png_is_written_and_has_a_plausible_size(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("matplotlib")
    history, events = synthetic_run()
    with caplog.at_level(logging.INFO, logger="lightning_stability"):
        json_path, png_path = write_report(history, events, tmp_path, name="run1")

    assert json_path == tmp_path / "run1.json" and json_path.exists()
    assert png_path == tmp_path / "run1.png"
    width, height = png_size(png_path)
    assert width > 500 and height > 500
    assert height > width  # a column of panels
    assert png_path.stat().st_size > 20_000  # drawn, not blank
    assert not [r for r in caplog.records if "install matplotlib" in r.getMessage()]


def test_figure_has_one_panel_per_series_and_rollback_lines_on_each() -> None:
    pytest.importorskip("matplotlib")
    import numpy as np

    history, events = synthetic_run()
    fig = _draw(history, events, summarize(history, events), figure_class())
    axes = fig.get_axes()
    assert [ax.get_ylabel() for ax in axes] == [
        "loss",
        "grad norm",
        "learning rate",
        "loss scale",
        "update / param\nnorm ratio",
        "peak memory (GB)",
    ]
    assert axes[1].get_yscale() == "log" and axes[3].get_yscale() == "log" and axes[4].get_yscale() == "log"
    assert axes[0].get_yscale() == "linear" and axes[2].get_yscale() == "linear"
    for ax in axes:  # each rollback is a vertical line (x data [step, step]) on every panel
        xs = [np.asarray(line.get_xdata(), dtype=float) for line in ax.get_lines()]
        assert sorted(float(x[0]) for x in xs if x.size == 2 and x[0] == x[1]) == [220.0, 260.0]
    legend = axes[0].get_legend()
    assert legend is not None
    labels = {t.get_text() for t in legend.get_texts()}
    assert {
        "loss",
        "loss spike",
        "rollback (to the step above)",
        "non-finite value (top edge)",
        "steps undone by rollback",
        "skipped: fp16 scaler overflow",
        "skipped: non-finite gradient",
        "skipped: spike",
        "skipped: data after rollback",
    } <= labels
    assert fig.texts[0].get_text() == (
        "Stability report: 300 steps, final loss 0.75, 2 loss spike(s), 2 gradient-norm spike(s), 2 spike(s) applied, "
        "2 rollback(s)\n7 skipped step(s): 2 scaler overflow, 1 nonfinite grad, 1 spike, 3 data skip; 1 step(s) clipped"
    )


def drawn(ax: Any, gid: str) -> tuple[list[float], list[float]]:
    """The x and y data of the line ``gid`` of a report panel."""
    (line,) = [line for line in ax.get_lines() if line.get_gid() == gid]
    return [float(v) for v in line.get_xdata()], [float(v) for v in line.get_ydata()]


def test_the_figure_marks_gradient_norm_spikes_keeps_the_loss_readable_and_draws_sparse_series_as_points() -> None:
    pytest.importorskip("matplotlib")
    history, events = synthetic_run()
    fig = _draw(history, events, summarize(history, events), figure_class())
    loss, grad, _, _, ratio, memory = fig.get_axes()
    # the gradient-norm spikes: both ringed; the one applied drops to the clip it got; the other was skipped
    assert drawn(grad, "grad_norm_spikes") == ([120.0, 150.0], [30.0, 42.0])
    assert drawn(grad, "spikes_applied_clipped") == ([120.0], [pytest.approx(2.12)])
    assert drawn(grad, "grad_norm_spikes_skipped") == ([150.0], [42.0])
    assert drawn(grad, "spikes_applied") == ([], [])
    labels = {t.get_text() for t in grad.get_legend().get_texts()}
    assert {"gradient-norm spike", "spike applied, clipped to the threshold", "skipped: spike"} <= labels
    # the loss axis fits the steps that are no spike (0.25 to 2.5): the spike's two steps sit on its top edge
    low, high = loss.get_ylim()
    assert 0.1 < low < 0.25 and 2.5 < high < 2.7 and loss.get_yscale() == "linear"
    assert drawn(loss, "loss_off_scale") == ([150.0, 151.0], [high, high])
    assert drawn(loss, "loss_spikes") == ([150.0, 151.0], [high, high])
    # the larger value written beside; its neighbour's would overlap it
    assert [t.get_text() for t in loss.texts if not t.get_text().startswith("to ")] == ["9"]
    # update ratio and memory exist on a few steps only: points with a note, no line between them
    for ax, key, count in ((ratio, "update_ratio", 11), (memory, "memory_gb", 6)):
        (line,) = [line for line in ax.get_lines() if line.get_gid() == key]
        assert line.get_linestyle() == "None" and len(line.get_xdata()) == count
        assert ax.get_title(loc="left").startswith(f"{count} value(s), measured on")


def test_a_dense_update_ratio_is_a_curve_and_a_loss_over_decades_is_on_a_log_axis() -> None:
    pytest.importorskip("matplotlib")
    history, events = synthetic_run()
    history["update_ratio"] = [1e-3 if s % 4 == 0 else nan for s in range(300)]  # measured every 4th step
    history["loss"] = [10.0 * 0.98**s for s in range(300)]  # 10 down to 0.024, and one spike
    history["loss"][150] = 1e4
    fig = _draw(history, events, summarize(history, events), figure_class())
    loss, ratio = fig.get_axes()[0], fig.get_axes()[4]
    (line,) = [line for line in ratio.get_lines() if line.get_gid() == "update_ratio"]
    assert line.get_linestyle() == "-" and len(line.get_xdata()) == 75 and ratio.get_title(loc="left") == ""
    assert loss.get_yscale() == "log"
    low, high = loss.get_ylim()
    assert low < 10.0 * 0.98**299 and 10.0 < high < 20.0  # the whole fall, not the spike


def test_without_matplotlib_only_json_and_one_info_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    history, events = synthetic_run()
    with caplog.at_level(logging.INFO, logger="lightning_stability"):
        json_path, png_path = write_report(history, events, tmp_path)

    assert png_path is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stability_report.json"]
    assert load_report(json_path)["summary"] == EXPECTED_SUMMARY
    records = [r for r in caplog.records if r.name == "lightning_stability"]
    assert len(records) == 1
    assert records[0].levelno == logging.INFO
    assert records[0].getMessage() == (
        f"stability report: {json_path}; install matplotlib (pip install matplotlib) for the PNG"
    )


def test_missing_and_all_nan_series_are_skipped(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    history = {
        "step": [0.0, 1.0, 2.0, 3.0],
        "loss": [3.0, 2.5, nan, 2.0],
        "grad_norm": [nan] * 4,
        "clip_threshold": [nan] * 4,
        "lr": [1e-3] * 4,
        "outcome": [0.0, 0.0, 2.0, 0.0],
    }
    _, png_path = write_report(history, [], tmp_path)
    assert png_path is not None and png_size(png_path)[0] > 500
    report = load_report(tmp_path / "stability_report.json")
    assert report["summary"]["max_grad_norm"] is None and report["summary"]["final_loss_scale"] is None
    assert report["summary"]["skipped_steps"]["nonfinite_grad"] == 1 and report["summary"]["rollbacks"] == 0
    fig = _draw(history, [], report["summary"], figure_class())
    assert [ax.get_ylabel() for ax in fig.get_axes()] == ["loss", "learning rate"]
    legend = fig.get_axes()[0].get_legend()  # no legend entry for what is not there (no spike, no rollback)
    assert legend is not None
    assert [t.get_text() for t in legend.get_texts()] == [
        "loss",
        "skipped: non-finite gradient",
        "non-finite value (top edge)",
    ]


def test_empty_history_still_writes_both_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    json_path, png_path = write_report({}, [], tmp_path, name="empty")
    summary = load_report(json_path)["summary"]
    assert summary["steps"] == 0 and summary["final_loss"] is None and summary["min_loss"] is None
    assert summary["skipped_steps"]["total"] == 0
    assert png_path is not None and png_size(png_path)[0] > 500
    assert load_report(json_path)["history"] == {}


NAN_AT, GRAD_SPIKE_AT, LOSS_SPIKE_AT = 120, 200, 260


class Planted(TinyModule):
    """A NaN loss at NAN_AT, a gradient 1000x as large with the loss's value unchanged at GRAD_SPIKE_AT, a loss 1000x
    as large at LOSS_SPIKE_AT."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_step == NAN_AT:
            return loss * math.nan
        if self.global_step == GRAD_SPIKE_AT:
            return loss + 999 * (loss - loss.detach())
        return loss * 1000 if self.global_step == LOSS_SPIKE_AT else loss


def test_a_preset_run_at_default_logging_reports_every_step_it_did_not_apply_and_draws_full_curves(
    tmp_path: Path,
) -> None:
    """The "gpt" preset (skip_on="loss", clip at 0.5), 300 steps at Lightning's default log_every_n_steps=50, with a
    NaN, a gradient-norm spike alone and a loss spike planted: each is an event, the summary counts the applied spike
    and the picture shows it clipped; the outcome is a name; loss, gradient norm, LR and update ratio are curves."""
    pytest.importorskip("matplotlib")
    pl.seed_everything(0)
    trainer = StableTrainer.from_preset(
        "gpt",
        accelerator="cpu",
        max_steps=300,
        default_root_dir=tmp_path,
        checkpoint=False,
        **QUIET,
    )
    assert trainer.log_every_n_steps == 50
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Planted(lr=0.01))
    report = load_report(tmp_path / "stability_report.json")
    summary, events, history = report["summary"], report["events"], report["history"]

    by_step = {e["step"]: e for e in events}
    assert by_step[NAN_AT]["kind"] == "skip" and by_step[NAN_AT]["outcome"] == "skipped_nonfinite"
    assert by_step[GRAD_SPIKE_AT]["kind"] == "spike" and by_step[GRAD_SPIKE_AT]["outcome"] == "applied"
    assert by_step[GRAD_SPIKE_AT]["detail"].endswith("clipped to 0.5 (skip_on='loss')")
    assert by_step[LOSS_SPIKE_AT]["outcome"] == "skipped_spike"
    # every step not applied is an event, and the outcome is a name
    assert set(history["outcome"]) == {"applied", "skipped_nonfinite", "skipped_spike"}
    not_applied = [s for s, o in zip(history["step"], history["outcome"], strict=True) if o != "applied"]
    assert not_applied == [NAN_AT, LOSS_SPIKE_AT] and set(not_applied) <= set(by_step)
    assert summary["skipped_steps"]["total"] == 2
    assert summary["grad_norm_spikes"] == 2 and summary["spikes_applied"] == 1  # 200 and 260; 200 applied
    assert summary["clipped_steps"] == sum(
        1
        for n, c, o in zip(history["grad_norm"], history["clip_threshold"], history["outcome"], strict=True)
        if o == "applied" and n is not None and n > c
    )

    fig = _draw(history, events, summary, figure_class())
    loss, grad, lr, ratio, memory = fig.get_axes()
    assert "2 gradient-norm spike(s), 1 spike(s) applied" in fig.texts[0].get_text()
    assert drawn(grad, "spikes_applied_clipped") == ([float(GRAD_SPIKE_AT)], [0.5])
    assert drawn(grad, "grad_norm_spikes")[0] == [float(GRAD_SPIKE_AT), float(LOSS_SPIKE_AT)]
    assert drawn(loss, "skipped_2_nonfinite")[0] == [float(NAN_AT)]
    # the loss spike (1000x) is off the loss axis, which fits the steps that are no spike
    (off,) = drawn(loss, "loss_off_scale")[0]
    assert off == LOSS_SPIKE_AT and loss.get_ylim()[1] < history["loss"][LOSS_SPIKE_AT]
    # full curves at default logging: every step's loss, norm and LR, the update ratio where the preset measured it
    for ax in (loss, grad, lr):
        assert len(ax.get_lines()[0].get_xdata()) == 300
    (line,) = [line for line in ratio.get_lines() if line.get_gid() == "update_ratio"]
    assert line.get_linestyle() == "-" and len(line.get_xdata()) >= 75
    # the peak memory is read on logging steps only: points, and a note that says so
    (points,) = [line for line in memory.get_lines() if line.get_gid() == "memory_gb"]
    assert points.get_linestyle() == "None" and len(points.get_xdata()) == 6
    assert memory.get_title(loc="left") == "6 value(s), measured on logging steps only: points, not a curve"
