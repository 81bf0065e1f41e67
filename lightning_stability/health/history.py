"""The health monitor's per-step series, and what it records and tells the user from them.

Every optimizer step writes one row of device values (loss, gradient norm, clip threshold, spike flags, LR,
loss scale, update ratio where the step measured the update, outcome) into a small device buffer
(:class:`HealthHistory`), indexed by a host counter: no sync. On a logging step the filled rows and the peak memory
ride the ledger's one batched transfer to the host. There :class:`HealthReporter` appends them to the host series
(which checkpoints keep), names the spikes in a warning, records an event for every step that was not applied as it
came (a spike, a skipped or rolled-back step, a clip by the monitor), warns once when the peak memory nears the
device's capacity, and at the end of ``fit`` writes the stability report (JSON + PNG). The host series stay
bounded whatever the run's length: the newest steps at full resolution, older ones as min/mean/max buckets, exact
whole-run counts, the newest :data:`MAX_EVENTS` events.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_stability.health.report import SKIP_REASONS, clipped, outcome_name
from lightning_stability.health.signals import memory_warning
from lightning_stability.health.spike_stats import NEW_LEVEL_AFTER
from lightning_stability.ledger.metrics import OnHost
from lightning_stability.ledger.update import UpdateSize
from lightning_stability.ledger.verdict import NEW_LEVEL, SPIKE
from lightning_stability.norms import group_norms

#: the device columns of a row, in order (``update_ratio``: NaN on a step that did not measure its update)
COLUMNS = (
    "loss",
    "grad_norm",
    "clip_threshold",
    "loss_spike",
    "grad_spike",
    "lr",
    "loss_scale",
    "update_ratio",
    "outcome",
)
#: the columns of a checkpoint's pending rows written before ``update_ratio`` was a device column
_COLUMNS_V2 = ("loss", "grad_norm", "clip_threshold", "loss_spike", "grad_spike", "lr", "loss_scale", "outcome")
#: series filled on logging steps only (NaN elsewhere): the peak memory, a maximum over ranks
SPARSE = ("memory_gb",)


#: series whose downsampled value is the bucket's largest (a flag or a skip code: any spike or skip stays visible)
PEAK = ("loss_spike", "grad_spike", "outcome")
#: full-resolution rows kept (the newest steps); older ones are downsampled into at most MAX_BUCKETS buckets
WINDOW = 2000
MAX_BUCKETS = 500
#: events kept; beyond it the oldest of the most numerous kind go (so routine clips or an fp16 run's overflows never
#: push out its spikes), and are counted
MAX_EVENTS = 1000


class HealthHistory:
    """Rows of the steps since the last logging step on the device; earlier steps as host series, bounded.

    The newest ``window`` steps are kept at full resolution in :attr:`series`. Older steps are folded into at
    most ``max_buckets`` buckets of consecutive steps holding, per column, the mean, min and max of the finite
    values (for :data:`PEAK` columns the max is what the report draws, so a spike or skip in a bucket shows);
    when the buckets fill, neighbours merge pairwise and the bucket width doubles. :attr:`totals` keeps the exact
    counts over the whole run (steps, skips per outcome, loss spikes, extremes). So memory and checkpoints stay
    the same size whatever the run's length; spikes and rollbacks are kept exactly as events (see
    :class:`HealthReporter`).

    Args:
        window: the newest steps kept at full resolution.
        max_buckets: the most buckets the older steps are downsampled into.
    """

    def __init__(self, window: int = WINDOW, max_buckets: int = MAX_BUCKETS) -> None:
        self.window, self.max_buckets = window, max_buckets
        self.series: dict[str, list[float]] = {"step": [], **{k: [] for k in COLUMNS + SPARSE}}
        self.buckets: dict[str, list[float]] = _empty_buckets()
        self.bucket_width = 1  # steps per bucket (the last one may hold fewer)
        self.totals: dict[str, float] = {}
        self._buf: Tensor | None = None
        self._labels: list[int] = []
        self._host: list[dict[str, float]] = []  # per pending row: values known on the host (a float LR)

    def _buffer(self, device: torch.device) -> Tensor:
        if self._buf is None or self._buf.device != device or len(self._labels) >= self._buf.shape[0]:
            rows = 64 if self._buf is None else 2 * self._buf.shape[0]
            new = torch.full((rows, len(COLUMNS)), math.nan, dtype=torch.float32, device=device)
            if self._buf is not None and self._labels:
                new[: len(self._labels)] = self._buf[: len(self._labels)].to(device)
            self._buf = new
        return self._buf

    def add(self, label: int, parts: list[Tensor], host: dict[str, float], device: torch.device) -> int:
        """Write a row: ``parts`` fill every column but the outcome in order (no ``parts``: a row of NaN); returns
        its index for :meth:`set_outcome`."""
        buf = self._buffer(device)
        index = len(self._labels)
        row = buf[index]  # a host index: no sync
        if parts:
            torch.cat(parts, out=row[: len(COLUMNS) - 1])
        else:
            row.fill_(math.nan)
        self._labels.append(label)
        self._host.append(host)
        return index

    def set_outcome(self, index: int, outcome: Tensor | int) -> None:
        assert self._buf is not None
        cell = self._buf[index, COLUMNS.index("outcome")]
        if isinstance(outcome, Tensor):
            cell.copy_(outcome)
        else:
            cell.fill_(float(outcome))

    def set_host(self, index: int, column: str, value: float) -> None:
        """A value of row ``index`` known on the host (a fixed clip threshold): it takes the place of the column's
        device value when the row reaches the host."""
        self._host[index][column] = value

    def set_value(self, index: int, column: str, value: Tensor | float) -> None:
        """A value of row ``index`` known after the row was written (the LR the update used): a device value is
        copied into the row on the device, a host number kept as :meth:`set_host` keeps it."""
        if not isinstance(value, Tensor):
            self.set_host(index, column, float(value))
            return
        assert self._buf is not None
        self._host[index].pop(column, None)
        self._buf[index, COLUMNS.index(column)].copy_(value.reshape(()))

    def pending(self) -> Tensor | None:
        """The rows since the last :meth:`take`, flattened (a view: queue it for the transfer)."""
        if self._buf is None or not self._labels:
            return None
        return self._buf[: len(self._labels)].reshape(-1)

    def take(self, flat: list[float], sparse: dict[str, float] | None = None) -> list[dict[str, float]]:
        """Append the transferred rows (``flat``) to the host series; ``sparse`` values go to the last row."""
        width = len(COLUMNS)
        rows = []
        for i, label in enumerate(self._labels):
            row = dict(zip(COLUMNS, flat[i * width : (i + 1) * width], strict=True))
            row.update(self._host[i])
            row["step"] = float(label)
            for key in SPARSE:
                row[key] = (sparse or {}).get(key, math.nan) if i == len(self._labels) - 1 else math.nan
            rows.append(row)
        self._labels, self._host = [], []
        self.extend(rows)
        return rows

    def extend(self, rows: list[dict[str, float]]) -> None:
        """Append host rows (``step`` and any columns; a missing one is NaN), counting them in :attr:`totals` and
        downsampling what falls out of the window."""
        columns = {key: [row.get(key, math.nan) for row in rows] for key in self.series}
        for key, values in columns.items():
            self.series[key].extend(values)
        _count(self.totals, columns)
        self._fold()

    def _fold(self) -> None:
        """Move the rows beyond the window into the buckets (in chunks, so each row is moved once)."""
        excess = len(self.series["step"]) - self.window
        if excess <= 0 or (excess < max(self.window // 8, 1) and len(self.series["step"]) < 2 * self.window):
            return
        columns = [k for k in self.series if k != "step"]
        done = 0
        while done < excess:
            last = len(self.buckets["count"]) - 1
            if last < 0 or self.buckets["count"][last] >= self.bucket_width:
                _open_bucket(self.buckets, columns)
                last += 1
            take = min(int(self.bucket_width - self.buckets["count"][last]), excess - done)
            chunk = {k: v[done : done + take] for k, v in self.series.items()}
            _fold_rows(self.buckets, last, chunk, columns)
            done += take
            if len(self.buckets["count"]) > self.max_buckets:
                self.buckets = _merge_pairs(self.buckets, columns)
                self.bucket_width *= 2
        for values in self.series.values():
            del values[:excess]

    def report_series(self) -> dict[str, list[float]]:
        """The whole run for the report: one row per bucket (at its middle step: the mean, or for :data:`PEAK`
        columns the max; ``<column>_min`` / ``<column>_max`` beside), then the full-resolution window."""
        b, n = self.buckets, len(self.buckets["count"])
        out: dict[str, list[float]] = {
            "step": [(first + last) / 2 for first, last in zip(b["step_first"], b["step_last"], strict=True)]
        }
        out["step"] += self.series["step"]
        for key in self.series:
            if key == "step":
                continue
            if not n:
                out[key] = list(self.series[key])
                continue
            out[key] = list(b[f"{key}_max"] if key in PEAK else b[key]) + self.series[key]
            if key not in PEAK:
                out[f"{key}_min"] = b[f"{key}_min"] + [math.nan] * len(self.series[key])
                out[f"{key}_max"] = b[f"{key}_max"] + [math.nan] * len(self.series[key])
        return out

    def pending_on_host(self) -> list[float]:
        """The pending rows, flattened, as host values (HOST SYNC: end of training only)."""
        flat = self.pending()
        return [] if flat is None else flat.cpu().tolist()

    def state_dict(self) -> dict[str, Any]:
        """The host series, buckets and totals, and the rows not yet moved to the host (a sync: checkpoints only).
        Nothing is taken from the pending rows: the next logging step still reads them, as in a run that was never
        saved. Bounded: ``window`` rows and ``max_buckets`` buckets at most."""
        return {
            "version": 2,
            "series": {k: torch.tensor(v, dtype=torch.float64) for k, v in self.series.items()},
            # padded with NaN to max_buckets: a checkpoint's size does not change once the window is full
            "buckets": {
                k: torch.tensor(v + [math.nan] * (self.max_buckets - len(v)), dtype=torch.float64)
                for k, v in self.buckets.items()
            },
            "bucket_count": len(self.buckets["count"]),
            "bucket_width": self.bucket_width,
            "totals": dict(self.totals),
            "pending": {
                "columns": list(COLUMNS),
                "labels": list(self._labels),
                "host": [dict(h) for h in self._host],
                "rows": self.pending_on_host(),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state of either version: a version-1 state (every step's row, written before the history was
        bounded) is counted and downsampled as if its rows had just been appended."""
        series = state.get("series", {})
        rows = len(series.get("step", []))
        self.series = {k: [] for k in self.series}
        self.buckets, self.bucket_width, self.totals = _empty_buckets(), 1, {}
        if state.get("version", 1) >= 2:
            for key in self.series:
                value = series.get(key)
                self.series[key] = value.tolist() if value is not None else [math.nan] * rows
            count = int(state.get("bucket_count", 0))
            self.buckets = {k: v[:count].tolist() for k, v in state.get("buckets", {}).items()} or _empty_buckets()
            self.bucket_width = int(state.get("bucket_width", 1))
            self.totals = {k: float(v) for k, v in state.get("totals", {}).items()}
            if "steps" in self.totals and not any(k in self.totals for k in _SPIKE_TOTALS):
                # saved before these counts: taken from the steps still at full resolution (exact for a run that
                # has no buckets yet)
                recount: dict[str, float] = {}
                _count(recount, self.series)
                self.totals.update({k: recount[k] for k in _SPIKE_TOTALS if k in recount})
        else:
            columns = {k: (v.tolist() if v is not None else None) for k, v in series.items()}
            self.extend(
                [{k: v[i] for k, v in columns.items() if v is not None and k in self.series} for i in range(rows)]
            )
        pending = state.get("pending", {})
        self._labels, self._host = list(pending.get("labels", [])), [dict(h) for h in pending.get("host", [])]
        pending_rows = pending.get("rows", [])
        self._buf = None
        if self._labels:
            # moved to the device by the first `add` (``_buffer`` copies the rows it holds); a column the saved rows
            # lack (an older checkpoint's) stays NaN
            saved = list(pending.get("columns", _COLUMNS_V2))
            rows_saved = torch.tensor(pending_rows, dtype=torch.float32).reshape(len(self._labels), len(saved))
            buf = torch.full((max(64, 2 * len(self._labels)), len(COLUMNS)), math.nan, dtype=torch.float32)
            for j, column in enumerate(COLUMNS):
                if column in saved:
                    buf[: len(self._labels), j] = rows_saved[:, saved.index(column)]
            self._buf = buf


def _empty_buckets() -> dict[str, list[float]]:
    return {"step_first": [], "step_last": [], "count": []}


def _open_bucket(buckets: dict[str, list[float]], columns: list[str]) -> None:
    buckets["step_first"].append(math.nan)
    buckets["step_last"].append(math.nan)
    buckets["count"].append(0.0)
    for key in columns:
        for name in (key, f"{key}_min", f"{key}_max"):
            buckets.setdefault(name, [math.nan] * (len(buckets["count"]) - 1)).append(math.nan)
        buckets.setdefault(f"{key}_n", [0.0] * (len(buckets["count"]) - 1)).append(0.0)


def _fold_rows(buckets: dict[str, list[float]], i: int, rows: dict[str, list[float]], columns: list[str]) -> None:
    """Fold consecutive rows (column lists) into bucket ``i``: the count, mean, min and max of each column's finite
    values."""
    if buckets["count"][i] == 0:
        buckets["step_first"][i] = rows["step"][0]
    buckets["step_last"][i] = rows["step"][-1]
    buckets["count"][i] += len(rows["step"])
    for key in columns:
        finite = [v for v in rows[key] if math.isfinite(v)]
        if not finite:
            continue
        n_old, n_new = buckets[f"{key}_n"][i], len(finite)
        mean_new = math.fsum(finite) / n_new
        low, high = min(finite), max(finite)
        if n_old:
            mean_new = (buckets[key][i] * n_old + mean_new * n_new) / (n_old + n_new)
            low, high = min(low, buckets[f"{key}_min"][i]), max(high, buckets[f"{key}_max"][i])
        buckets[f"{key}_n"][i] = n_old + n_new
        buckets[key][i], buckets[f"{key}_min"][i], buckets[f"{key}_max"][i] = mean_new, low, high


def _merge_pairs(buckets: dict[str, list[float]], columns: list[str]) -> dict[str, list[float]]:
    """Neighbouring buckets merged two by two (an odd last one stays)."""
    merged: dict[str, list[float]] = {k: [] for k in buckets}
    count = len(buckets["count"])
    for a in range(0, count, 2):
        b = min(a + 1, count - 1)
        merged["step_first"].append(buckets["step_first"][a])
        merged["step_last"].append(buckets["step_last"][b])
        merged["count"].append(buckets["count"][a] + (buckets["count"][b] if b != a else 0))
        for key in columns:
            na, nb = buckets[f"{key}_n"][a], buckets[f"{key}_n"][b] if b != a else 0.0
            merged[f"{key}_n"].append(na + nb)
            ma, mb = buckets[key][a], buckets[key][b]
            merged[key].append(ma if nb == 0 else mb if na == 0 else (ma * na + mb * nb) / (na + nb))
            for suffix, pick in (("_min", min), ("_max", max)):
                va, vb = buckets[f"{key}{suffix}"][a], buckets[f"{key}{suffix}"][b]
                merged[f"{key}{suffix}"].append(vb if na == 0 else va if nb == 0 else pick(va, vb))
    return merged


#: whole-run counts added after version-2 checkpoints were first written (absent from theirs)
_SPIKE_TOTALS = ("grad_norm_spikes", "spikes_applied", "clipped_steps")


def _count(totals: dict[str, float], columns: dict[str, list[float]]) -> None:
    """Exact whole-run figures for the report's summary: steps, skips per outcome, spikes (loss, gradient norm,
    applied), steps clipped, extremes. A new level (flag 2) is no spike."""
    totals["steps"] = totals.get("steps", 0.0) + len(columns["step"])
    for outcome in columns["outcome"]:
        if math.isfinite(outcome) and outcome != 0:
            key = f"outcome_{int(outcome)}"
            totals[key] = totals.get(key, 0.0) + 1
    rows = list(zip(columns["loss_spike"], columns["grad_spike"], columns["outcome"], strict=True))
    applied = zip(columns["grad_norm"], columns["clip_threshold"], columns["outcome"], strict=True)
    for key, count in (
        ("loss_spikes", sum(1 for v in columns["loss_spike"] if v == SPIKE)),
        ("grad_norm_spikes", sum(1 for v in columns["grad_spike"] if v == SPIKE)),
        ("spikes_applied", sum(1 for loss, grad, outcome in rows if SPIKE in (loss, grad) and outcome == 0)),
        ("clipped_steps", sum(1 for norm, clip, outcome in applied if outcome == 0 and clipped(norm, clip))),
    ):
        if count:
            totals[key] = totals.get(key, 0.0) + count
    for key, name, pick in (
        ("loss", "min_loss", min),
        ("grad_norm", "max_grad_norm", max),
        ("memory_gb", "peak_memory_gb", max),
    ):
        finite = [v for v in columns[key] if math.isfinite(v)]
        if finite:
            totals[name] = pick(totals.get(name, pick(finite)), pick(finite))


_ACTIONS = {
    "warn": "no action (response='warn')",
    "clip": "gradients clipped to ZClip's adaptive threshold (loss spikes: no action)",
    "skip": "those updates were skipped",
    "rollback": "those updates were skipped (a spike that outlasts its skipped update rolls back)",
}


#: rows without a new-level value after which the next one starts a new level (and gets its own event)
CALM_STEPS = 10
_DATA_SKIP = 4  # ``Outcome.SKIPPED_ROLLBACK``: a batch of the data window after a rollback


def _skip_detail(row: dict[str, float]) -> str:
    """What skipped a step without a spike, from its row."""
    code = int(row["outcome"])
    if code == 1:
        return "the fp16 loss scaler found inf/NaN in the scaled gradients: update skipped, loss scale lowered"
    if code == 2:
        bad = [name for name, key in (("loss", "loss"), ("gradient norm", "grad_norm")) if not math.isfinite(row[key])]
        what = " and ".join(bad) if bad else "loss or gradient norm"
        return f"a non-finite {what}: update skipped"
    label = SKIP_REASONS[code][1] if code in SKIP_REASONS else f"skipped (outcome {code})"
    return f"{label}: update skipped"


def _data_skip_detail(first: int, last: int) -> str:
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    return f"{steps}: batches of the data window skipped after a rollback, their updates dropped"


class HealthSent(NamedTuple):
    """What ``TrainingHealthMonitor`` sends on a logging step (one optimizer's), read in :meth:`HealthReporter.read`."""

    rows: OnHost | None  # the history's rows since the last logging step
    top: tuple[OnHost, OnHost] | None  # the largest per-module update ratios, and their modules
    memory_gb: OnHost | None  # the peak memory


class HealthReporter:
    """The history of every step, the events (spikes, rollbacks), the warnings and the report.

    Args:
        response: the monitor's response to a spike (named in the warnings).
        spike_z: its spike threshold (named in the warnings).
        memory_warn_fraction: warn when the peak memory passes this share of the capacity.
        top_modules: per-module update ratios logged on logging steps (the largest ones).
        skip_on: the spikes that ``"skip"`` skips (``"any"`` or ``"loss"``): under ``"loss"`` a gradient-norm spike
            without a loss spike gets its own event and warning, as applied.
    """

    def __init__(
        self, response: str, spike_z: float, memory_warn_fraction: float, top_modules: int, skip_on: str = "any"
    ) -> None:
        self.response, self.spike_z, self.skip_on = response, spike_z, skip_on
        self.memory_warn_fraction, self.top_modules = memory_warn_fraction, top_modules
        self.history = HealthHistory()
        self.events: list[dict[str, Any]] = []  # the newest MAX_EVENTS
        self.events_dropped = 0  # older events beyond MAX_EVENTS
        self.names: list[str] = []  # module names, for the per-module update ratios
        self.capacity: float | None = None
        self._memory_warned = False
        #: called with each batch of new events (not those a checkpoint loads back): the incident log's sink
        self.on_events: Callable[[list[dict[str, Any]]], None] | None = None

    # ------------------------------------------------------------------ logging steps (device side: send)
    def update_ratios(self, size: UpdateSize, module_index: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """The update-to-weight ratio of the finished update: the total, and the ``top_modules`` largest
        per-module ratios with their module indices (``None`` when none are asked for). ``module_index``: each
        measured tensor's module."""
        assert size.ratio is not None and size.update_norms is not None
        k = min(self.top_modules, len(self.names))
        if not k:
            return size.ratio, None
        n = len(self.names)
        tiny = torch.finfo(torch.float32).tiny
        per_module = group_norms(size.update_norms, module_index, n) / group_norms(
            size.weight_norms, module_index, n
        ).clamp(min=tiny)
        k = min(k, per_module.numel())
        top = torch.topk(torch.nan_to_num(per_module, nan=math.inf), k)
        return size.ratio, (per_module[top.indices], top.indices)

    # ------------------------------------------------------------------ logging steps (host side: read)
    def read(self, sent: HealthSent) -> dict[str, float]:
        """Take a transfer's rows and metrics; returns the extra metrics to log (per-module update ratios, the
        skip rate)."""
        extra: dict[str, float] = {}
        if sent.top is not None:
            values, indices = sent.top[0].numbers(), sent.top[1].numbers()
            for i, v in zip(indices, values, strict=True):
                extra[f"stability/update_ratio_by_module/{self.names[int(i)]}"] = v
        sparse = {"memory_gb": sent.memory_gb.number()} if sent.memory_gb is not None else {}
        extra.update(self.take_rows(sent.rows.numbers() if sent.rows is not None else [], sparse))
        self.check_memory(sparse.get("memory_gb"))
        return extra

    def take_rows(self, rows: list[float], sparse: dict[str, float]) -> dict[str, float]:
        """Append the transferred rows to the history, warn about their spikes and record an event for each step
        not applied as it came; returns the skip rate."""
        taken = self.history.take(rows, sparse)
        self._note_new_levels(taken)
        spiked = [row for row in taken if SPIKE in (row["loss_spike"], row["grad_spike"])]
        if self.skip_on == "loss" and self.response == "skip":  # a gradient-norm spike alone was applied
            kept = [row for row in spiked if row["loss_spike"] != SPIKE]
            spiked = [row for row in spiked if row["loss_spike"] == SPIKE]
            if kept:
                self._note_applied(kept)
        if spiked:
            action = _ACTIONS[self.response]
            self.add_events(
                [
                    {
                        "step": int(row["step"]),
                        "kind": "spike",
                        "outcome": outcome_name(row["outcome"]),
                        "detail": action,
                    }
                    for row in spiked
                ]
            )
            rank_zero_warn(
                f"TrainingHealthMonitor: a loss or gradient-norm spike (more than {self.spike_z:g} standard "
                f"deviations above its running mean) at step(s) {[int(row['step']) for row in spiked]}: {action}.",
                category=UserWarning,
            )
        noted = {int(row["step"]) for row in taken if SPIKE in (row["loss_spike"], row["grad_spike"])}
        self._note_other_steps([row for row in taken if int(row["step"]) not in noted])
        return {"stability/skip_rate": sum(row["outcome"] != 0 for row in taken) / len(taken)} if taken else {}

    def _note_applied(self, rows: list[dict[str, float]]) -> None:
        """An event per gradient-norm spike that ``skip_on="loss"`` applied, naming the clip it got, and a warning."""
        events = []
        for row in rows:
            clip, norm = row.get("clip_threshold", math.nan), row["grad_norm"]
            if not math.isfinite(clip):
                how = "not clipped (no fixed clip attached)"
            elif norm > clip:
                how = f"its gradient norm {norm:.4g} clipped to {clip:g}"
            else:
                how = f"its gradient norm {norm:.4g} under the clip ({clip:g})"
            detail = f"a gradient-norm spike without a loss spike: applied, {how} (skip_on='loss')"
            events.append(
                {"step": int(row["step"]), "kind": "spike", "outcome": outcome_name(row["outcome"]), "detail": detail}
            )
        self.add_events(events)
        rank_zero_warn(
            f"TrainingHealthMonitor: a gradient-norm spike (more than {self.spike_z:g} standard deviations above its "
            f"running mean) without a loss spike at step(s) {[e['step'] for e in events]}: applied, as "
            "skip_on='loss' asks (clipped where GradientNormMonitor(max_norm=...) is attached).",
            category=UserWarning,
        )

    def _note_other_steps(self, rows: list[dict[str, float]]) -> None:
        """An event per step without a spike that was skipped (a non-finite loss or gradient norm, an fp16 overflow,
        another callback's vote) and, under ``"clip"``, per step ZClip clipped; one event per stretch of the data
        window skipped after a rollback (the rollback step has its own event)."""
        rolled = {e["step"] for e in self.events if e.get("kind") == "rollback"}
        events: list[dict[str, Any]] = []
        for row in rows:
            step, code = int(row["step"]), row["outcome"]
            if code == _DATA_SKIP:
                if step in rolled:
                    continue
                last = (
                    events[-1]
                    if events
                    else next((e for e in reversed(self.events) if e.get("kind") == "data_skip"), None)
                )
                if last is not None and last.get("kind") == "data_skip" and last.get("last_step") == step - 1:
                    last["last_step"] = step
                    last["detail"] = _data_skip_detail(last["step"], step)
                    continue
                events.append(
                    {
                        "step": step,
                        "kind": "data_skip",
                        "outcome": outcome_name(code),
                        "last_step": step,
                        "detail": _data_skip_detail(step, step),
                    }
                )
            elif math.isfinite(code) and code != 0:
                events.append(
                    {"step": step, "kind": "skip", "outcome": outcome_name(code), "detail": _skip_detail(row)}
                )
            elif self.response == "clip" and clipped(row["grad_norm"], row["clip_threshold"]):
                detail = (
                    f"gradient norm {row['grad_norm']:.4g} clipped to ZClip's adaptive threshold "
                    f"{row['clip_threshold']:.4g} (z-score over clip_z)"
                )
                events.append({"step": step, "kind": "clip", "outcome": outcome_name(code), "detail": detail})
        self.add_events(events)

    def _note_new_levels(self, taken: list[dict[str, float]]) -> None:
        """An event and a warning where a signal's values start to count as a new level (flag 2 in the history):
        at a 2 after at least :data:`CALM_STEPS` rows without one (a level's values may dip under the threshold
        for a few steps: still the same level)."""
        for column, signal in (("loss_spike", "loss"), ("grad_spike", "gradient norm")):
            series = self.history.series[column]  # the taken rows are its tail
            before = series[: len(series) - len(taken)][-CALM_STEPS:]
            calm = CALM_STEPS if NEW_LEVEL not in before else before[::-1].index(NEW_LEVEL)
            for row in taken:
                if row[column] != NEW_LEVEL:
                    calm += 1
                    continue
                if calm >= CALM_STEPS:
                    step = int(row["step"])
                    detail = (
                        f"the {signal} stayed above its spike threshold (more than {NEW_LEVEL_AFTER} steps net): a "
                        "new level, "
                        "taken into the statistics, no longer treated as spikes"
                    )
                    self.add_events([{"step": step, "kind": "new_level", "detail": detail}])
                    rank_zero_warn(f"TrainingHealthMonitor: at step {step}, {detail}.", category=UserWarning)
                calm = 0

    def add_events(self, events: list[dict[str, Any]], new: bool = True) -> None:
        """Record events in step order, keeping :data:`MAX_EVENTS`: beyond it the oldest of the most numerous
        kind go, counted in :attr:`events_dropped`. ``new`` events also go to :attr:`on_events`."""
        if new and events and self.on_events is not None:
            self.on_events(events)
        self.events.extend(events)
        self.events.sort(key=lambda e: e.get("step", 0))  # stable: events of one step keep their order
        excess = len(self.events) - MAX_EVENTS
        if excess <= 0:
            return
        kinds: dict[Any, list[int]] = {}
        for i, event in enumerate(self.events):
            kinds.setdefault(event.get("kind"), []).append(i)
        drop: set[int] = set()
        for _ in range(excess):
            most = max(kinds.values(), key=len)  # the first kind of the largest count
            drop.add(most.pop(0))
        self.events = [e for i, e in enumerate(self.events) if i not in drop]
        self.events_dropped += excess

    def load_events(self, events: list[dict[str, Any]], dropped: int = 0) -> None:
        self.events, self.events_dropped = [], int(dropped)
        self.add_events(list(events), new=False)

    def summary(self) -> dict[str, Any]:
        """The report's whole-run figures that downsampling would blur, exact from the history's totals."""
        totals = self.history.totals
        skipped = {key: int(totals.get(f"outcome_{code}", 0)) for code, (key, *_) in SKIP_REASONS.items()}
        skipped["total"] = int(sum(v for k, v in totals.items() if k.startswith("outcome_")))
        return {
            "steps": int(totals.get("steps", 0)),
            "min_loss": totals.get("min_loss"),
            "loss_spikes": int(totals.get("loss_spikes", 0)),
            "grad_norm_spikes": int(totals.get("grad_norm_spikes", 0)),
            "spikes_applied": int(totals.get("spikes_applied", 0)),
            "clipped_steps": int(totals.get("clipped_steps", 0)),
            "skipped_steps": skipped,
            "max_grad_norm": totals.get("max_grad_norm"),
            "peak_memory_gb": totals.get("peak_memory_gb"),
        }

    def check_memory(self, peak: float | None) -> None:
        if peak is None or self._memory_warned:
            return
        message = memory_warning(peak, self.capacity, self.memory_warn_fraction)
        if message:
            self._memory_warned = True
            rank_zero_warn(message, category=UserWarning)

    # ------------------------------------------------------------------ end of fit
    def write_report(
        self, directory: str | Path, meta: dict[str, Any], incidents: list[dict[str, Any]] | None = None
    ) -> tuple[Path, Path | None]:
        """Write ``stability_report.json`` (and ``.png`` with matplotlib) into ``directory``."""
        from lightning_stability.health.report import write_report

        meta = {**meta, "module_names": self.names, "events_dropped": self.events_dropped}
        meta["history_bucket_width"] = self.history.bucket_width
        json_path, png_path = write_report(
            self.history.report_series(), self.events, directory, meta, summary=self.summary(), incidents=incidents
        )
        rank_zero_info(f"stability report: {json_path}" + (f", {png_path}" if png_path else ""))
        return json_path, png_path
