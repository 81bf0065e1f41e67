"""The health history stays bounded: full resolution for the newest steps, min/mean/max buckets before them, exact
whole-run totals, capped events; the checkpoint's size does not grow with the run; a checkpoint written before the
history was bounded still loads; the report draws the downsampled run and its exact summary."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch

from lightning_stability import TrainingHealthMonitor
from lightning_stability.health.history import MAX_EVENTS, HealthHistory, HealthReporter
from lightning_stability.health.report import figure_class

SPIKE_AT = 123_457  # a loss spike, long before the window
SKIPS = {5_000: 1, 77_777: 3, 400_001: 2}  # step -> outcome code


def rows(start: int, stop: int) -> list[dict[str, float]]:
    out = []
    for s in range(start, stop):
        spike = s == SPIKE_AT
        out.append(
            {
                "step": float(s),
                "loss": 1e6 if spike else 2.0 + math.sin(s / 100),
                "grad_norm": 1.0 + (s % 7),
                "clip_threshold": 3.0,
                "loss_spike": 1.0 if spike else 0.0,
                "grad_spike": 0.0,
                "lr": 1e-3,
                "loss_scale": 2.0**16,
                "outcome": float(SKIPS.get(s, 0)),
                "memory_gb": 10.0 if s % 1000 == 0 else math.nan,
            }
        )
    return out


def feed(history: HealthHistory, steps: int, chunk: int = 5_000) -> HealthHistory:
    for start in range(0, steps, chunk):
        history.extend(rows(start, min(steps, start + chunk)))
    return history


def same(a: dict[str, list[float]], b: dict[str, list[float]]) -> bool:
    """Equal column by column, NaN equal to NaN, bit for bit otherwise."""
    return a.keys() == b.keys() and all(
        torch.equal(torch.tensor(a[k]).nan_to_num(nan=-7e300), torch.tensor(b[k]).nan_to_num(nan=-7e300)) for k in a
    )


def saved_size(state: object) -> int:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return len(buffer.getvalue())


def monitor_size(steps: int) -> int:
    monitor = TrainingHealthMonitor()
    feed(monitor.history, steps)
    return saved_size(monitor.state_dict())


def test_checkpoint_size_at_1m_steps_equals_10k() -> None:
    at_10k, at_1m = monitor_size(10_000), monitor_size(1_000_000)
    assert abs(at_1m - at_10k) <= 0.01 * at_10k, (at_10k, at_1m)
    assert at_1m < 1_000_000  # ~0.4 MB; every row kept would be ~87 MB


def test_window_full_resolution_buckets_before_and_exact_totals() -> None:
    history = feed(HealthHistory(window=2000, max_buckets=500), 1_000_000)
    assert history.series["step"] == [float(s) for s in range(998_000, 1_000_000)]  # the window, every step
    b = history.buckets
    assert len(b["count"]) <= 500
    assert sum(b["count"]) + 2000 == 1_000_000  # every older step in exactly one bucket
    assert b["step_first"][0] == 0 and b["step_last"][-1] == 997_999
    for i in range(len(b["count"]) - 1):
        assert b["step_first"][i + 1] == b["step_last"][i] + 1  # consecutive, no gap, no overlap
    # the spike's bucket shows it: max loss and the spike flag
    i = next(i for i in range(len(b["count"])) if b["step_first"][i] <= SPIKE_AT <= b["step_last"][i])
    assert b["loss_max"][i] == 1e6 and b["loss_spike_max"][i] == 1
    # a bucket's mean and extremes are those of its steps
    j = len(b["count"]) // 2
    steps = range(int(b["step_first"][j]), int(b["step_last"][j]) + 1)
    norms = [1.0 + (s % 7) for s in steps]
    assert b["grad_norm"][j] == pytest.approx(sum(norms) / len(norms), rel=1e-9)
    assert (b["grad_norm_min"][j], b["grad_norm_max"][j]) == (min(norms), max(norms))
    t = history.totals
    assert (t["steps"], t["loss_spikes"], t["max_grad_norm"]) == (1_000_000, 1, 7.0)
    assert {k: v for k, v in t.items() if k.startswith("outcome_")} == {"outcome_1": 1, "outcome_2": 1, "outcome_3": 1}
    assert t["min_loss"] == pytest.approx(1.0, abs=1e-3) and t["peak_memory_gb"] == 10.0


def test_round_trip_keeps_everything() -> None:
    history = feed(HealthHistory(), 50_000)
    copy = HealthHistory()
    copy.load_state_dict(history.state_dict())
    assert same(copy.series, history.series) and same(copy.buckets, history.buckets)
    assert copy.totals == history.totals and copy.bucket_width == history.bucket_width
    # and both go on alike
    feed(copy, 60_000)
    feed(history, 60_000)
    assert same(copy.series, history.series) and same(copy.buckets, history.buckets)
    assert copy.totals == history.totals


def test_a_checkpoint_from_before_the_bound_loads_bounded() -> None:
    """Version 1 kept every step's row; it loads as if its rows had been appended: bounded, exact totals."""
    old_rows = rows(0, 6_000)
    old = {
        "series": {k: torch.tensor([r.get(k, math.nan) for r in old_rows], dtype=torch.float64) for k in old_rows[0]},
        "pending": {"labels": [], "host": [], "rows": []},
    }
    history = HealthHistory(window=2000, max_buckets=500)
    history.load_state_dict(old)
    straight = feed(HealthHistory(window=2000, max_buckets=500), 6_000, chunk=6_000)
    assert same(history.series, straight.series) and same(history.buckets, straight.buckets)
    assert history.totals == straight.totals and history.totals["steps"] == 6_000
    assert sum(history.buckets["count"]) == 4_000


def test_events_capped_with_a_count_of_dropped() -> None:
    reporter = HealthReporter("warn", 6.0, 0.9, 5)
    reporter.add_events([{"step": s, "kind": "spike", "detail": ""} for s in range(MAX_EVENTS + 250)])
    assert len(reporter.events) == MAX_EVENTS and reporter.events_dropped == 250
    assert reporter.events[0]["step"] == 250 and reporter.events[-1]["step"] == MAX_EVENTS + 249
    monitor = TrainingHealthMonitor()
    monitor._log.add_events(reporter.events)
    monitor._log.events_dropped = 250
    restored = TrainingHealthMonitor()
    restored.load_state_dict(monitor.state_dict())
    assert restored.events == reporter.events and restored._log.events_dropped == 250


def test_report_of_a_long_run_is_bounded_and_its_summary_exact(tmp_path: Path) -> None:
    reporter = HealthReporter("warn", 6.0, 0.9, 5)
    feed(reporter.history, 1_000_000)
    reporter.add_events([{"step": SPIKE_AT, "kind": "spike", "detail": "no action"}])
    json_path, png_path = reporter.write_report(tmp_path, {})
    report = json.loads(json_path.read_text())
    summary = report["summary"]
    assert summary["steps"] == 1_000_000 and summary["loss_spikes"] == 1
    assert summary["skipped_steps"] == {
        "scaler_overflow": 1,
        "nonfinite_grad": 1,
        "spike": 1,
        "data_skip": 0,
        "quarantined": 0,
        "total": 3,
    }
    assert summary["max_grad_norm"] == 7.0
    history = report["history"]
    assert len(history["step"]) <= 2000 + 500
    assert max(v for v in history["loss_max"] if v is not None) == 1e6  # the old spike is visible
    assert report["events"] == [{"step": SPIKE_AT, "kind": "spike", "detail": "no action"}]
    assert json_path.stat().st_size < 2_000_000
    if figure_class() is not None:
        assert png_path is not None and png_path.stat().st_size > 0


def varied_rows(start: int, stop: int) -> list[dict[str, float]]:
    """Rows whose ``loss`` is finite on every step of some stretches and on one step in 16 of others, so that the
    buckets that merge hold different counts of finite values; a new level every 97 steps, a loss spike every 1000."""
    out = []
    for s in range(start, stop):
        dense = (s // 300) % 2 == 0
        level = 2.0 if s % 97 == 0 else 1.0 if s % 1000 == 500 else 0.0  # NEW_LEVEL, SPIKE, none
        out.append(
            {
                "step": float(s),
                "loss": float(s % 50) if dense or s % 16 == 0 else math.nan,
                "grad_norm": 1.0,
                "loss_spike": level,
                "outcome": 0.0,
            }
        )
    return out


def test_a_merged_buckets_mean_weighs_each_half_by_its_count_of_values() -> None:
    """Every bucket's mean, min and max are those of the finite values of its steps, also where the two buckets a
    merge joins held different numbers of values (an unweighted mean of the two means fails here)."""
    history = HealthHistory(window=64, max_buckets=8)
    raw: list[dict[str, float]] = []
    for start in range(0, 6_000, 250):
        chunk = varied_rows(start, start + 250)
        raw += chunk
        history.extend(chunk)
    b = history.buckets
    assert history.bucket_width >= 256  # many rounds of merges
    checked = 0
    for i in range(len(b["count"])):
        first, last = int(b["step_first"][i]), int(b["step_last"][i])
        losses = [r["loss"] for r in raw[first : last + 1] if math.isfinite(r["loss"])]
        assert b["loss_n"][i] == len(losses)
        assert b["loss"][i] == pytest.approx(math.fsum(losses) / len(losses), rel=1e-12), (i, first, last)
        assert (b["loss_min"][i], b["loss_max"][i]) == (min(losses), max(losses))
        checked += 1
    assert checked == len(b["count"]) >= 4


def test_new_levels_are_not_counted_as_loss_spikes() -> None:
    """A loss that settled at a new level (``loss_spike`` == NEW_LEVEL) is no spike: the whole-run count and the
    report's summary hold the spikes alone, also once the rows were folded into buckets."""
    from lightning_stability.ledger.verdict import NEW_LEVEL, SPIKE

    raw = varied_rows(0, 6_000)
    spikes = sum(r["loss_spike"] == SPIKE for r in raw)
    levels = sum(r["loss_spike"] == NEW_LEVEL for r in raw)
    assert (spikes, levels) == (6, 62)
    reporter = HealthReporter("warn", 6.0, 0.9, 5)
    reporter.history.window, reporter.history.max_buckets = 64, 8
    for start in range(0, 6_000, 250):
        reporter.history.extend(raw[start : start + 250])
    assert reporter.history.totals["loss_spikes"] == spikes
    assert reporter.summary()["loss_spikes"] == spikes


def record(reporter: HealthReporter, rows: list[dict[str, float]]) -> None:
    """``rows`` (columns by name, NaN where missing) recorded in the history as the monitor does, then taken to the
    host as on a logging step."""
    from lightning_stability.health.history import COLUMNS

    for row in rows:
        values = torch.tensor([row.get(c, math.nan) for c in COLUMNS[:-1]], dtype=torch.float32)
        index = reporter.history.add(int(row["step"]), [values], {}, torch.device("cpu"))
        reporter.history.set_outcome(index, int(row.get("outcome", 0)))
    reporter.take_rows(reporter.history.pending_on_host(), {})


def test_every_step_not_applied_as_it_came_is_an_event() -> None:
    """A non-finite step, an fp16 overflow, the data window after a rollback (one event per stretch, also across two
    logging steps) and, under "clip", each step ZClip clipped: each an event with the step's outcome by name."""
    base = {"loss": 1.0, "grad_norm": 1.0, "clip_threshold": math.inf, "loss_spike": 0.0, "grad_spike": 0.0}
    rows = [{**base, "step": float(s)} for s in range(12)]
    rows[2].update(loss=math.nan, grad_norm=math.nan, outcome=2)
    rows[3].update(outcome=1)
    rows[5].update(grad_norm=3.0, clip_threshold=2.0)  # clipped by ZClip, no spike
    for s in (7, 8, 9, 10):  # the rollback step, then the data window
        rows[s].update(outcome=4)
    reporter = HealthReporter("clip", 6.0, 0.9, 5)
    reporter.add_events([{"step": 7, "kind": "rollback", "to_step": 4, "detail": "restored"}])
    record(reporter, rows[:10])
    record(reporter, rows[10:])  # the next logging step
    kinds = [(e["step"], e["kind"], e.get("outcome")) for e in reporter.events]
    assert kinds == [
        (2, "skip", "skipped_nonfinite"),
        (3, "skip", "skipped_scaler"),
        (5, "clip", "applied"),
        (7, "rollback", None),
        (8, "data_skip", "skipped_rollback"),
    ]
    assert reporter.events[0]["detail"] == "a non-finite loss and gradient norm: update skipped"
    assert reporter.events[2]["detail"].startswith("gradient norm 3 clipped to ZClip's adaptive threshold 2")
    assert reporter.events[4]["last_step"] == 10 and reporter.events[4]["detail"].startswith("steps 8-10: ")
    assert reporter.summary()["clipped_steps"] == 1
    # under "warn" nothing clips: a step over an inf threshold is no event
    calm = HealthReporter("warn", 6.0, 0.9, 5)
    record(calm, [{**base, "step": 0.0}, {**base, "step": 1.0, "grad_norm": 3.0}])
    assert calm.events == []


def test_the_event_cap_drops_the_most_numerous_kind_first() -> None:
    """Routine events (ZClip's clips, an fp16 run's overflows) never push the run's spikes out of the report."""
    reporter = HealthReporter("clip", 6.0, 0.9, 5)
    reporter.add_events([{"step": s, "kind": "spike", "detail": ""} for s in (3, 5)])
    reporter.add_events([{"step": s, "kind": "clip", "detail": ""} for s in range(10, 10 + MAX_EVENTS + 50)])
    assert len(reporter.events) == MAX_EVENTS and reporter.events_dropped == 52
    assert [e["step"] for e in reporter.events[:3]] == [3, 5, 62]  # the spikes, then the newest clips
    assert reporter.events[-1]["step"] == 10 + MAX_EVENTS + 49


def test_pending_rows_of_a_checkpoint_without_the_update_ratio_column_load() -> None:
    """A checkpoint written before the update ratio was a device column holds pending rows of eight columns: they
    load by name, the update ratio NaN."""
    from lightning_stability.health.history import _COLUMNS_V2, COLUMNS

    old = [float(10 * r + c) for r in range(2) for c in range(len(_COLUMNS_V2))]
    history = HealthHistory()
    history.load_state_dict({"version": 2, "pending": {"labels": [5, 6], "host": [{}, {}], "rows": old}})
    flat = history.pending_on_host()
    rows = [dict(zip(COLUMNS, flat[i * len(COLUMNS) : (i + 1) * len(COLUMNS)], strict=True)) for i in range(2)]
    assert [r["outcome"] for r in rows] == [7.0, 17.0] and [r["loss_scale"] for r in rows] == [6.0, 16.0]
    assert all(math.isnan(r["update_ratio"]) for r in rows)


def test_a_checkpoint_saved_before_the_spike_counts_gets_them_from_its_rows() -> None:
    """A version-2 history saved before the gradient-norm spike, applied-spike and clipped-step counts: a run short
    enough to have no buckets gets them exact from its rows."""
    rows_ = [
        {"step": float(s), "loss": 1.0, "grad_norm": 3.0 if s in (4, 9) else 1.0, "clip_threshold": 2.0}
        | {"loss_spike": 0.0, "grad_spike": 1.0 if s == 9 else 0.0, "outcome": 0.0}
        for s in range(12)
    ]
    history = HealthHistory()
    history.extend(rows_)
    state = history.state_dict()
    for key in ("grad_norm_spikes", "spikes_applied", "clipped_steps"):
        state["totals"].pop(key)
    restored = HealthHistory()
    restored.load_state_dict(state)
    assert restored.totals == history.totals
    assert (restored.totals["grad_norm_spikes"], restored.totals["spikes_applied"]) == (1, 1)
    assert restored.totals["clipped_steps"] == 2
