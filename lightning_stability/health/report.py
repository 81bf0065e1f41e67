"""The stability report: a run's per-step health series and events as JSON, and drawn as one PNG.

:func:`write_report` takes the host series of :class:`~lightning_stability.health.history.HealthHistory` and the
monitor's events. The JSON is strict (non-finite numbers are written as ``null``), so a diverged run still gives
a file any JSON reader accepts. The PNG needs matplotlib (the ``report`` extra); without it only the JSON is
written. The figure is drawn with matplotlib's object API, not pyplot: no global backend switch, no GUI, and no
figure left registered in a user's session.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


__all__ = ["OUTCOMES", "SKIP_REASONS", "load_report", "outcome_name", "summarize", "write_report"]

log = logging.getLogger("lightning_stability")

#: ``outcome`` code of a skipped step (``lightning_stability.ledger.track.Outcome``) -> (summary key, legend label,
#: marker, colour). Kept here so that the report needs neither torch nor Lightning.
SKIP_REASONS: dict[int, tuple[str, str, str, str]] = {
    1: ("scaler_overflow", "skipped: fp16 scaler overflow", "v", "tab:orange"),
    2: ("nonfinite_grad", "skipped: non-finite gradient", "X", "black"),
    3: ("spike", "skipped: spike", "s", "tab:purple"),
    4: ("data_skip", "skipped: data after rollback", "D", "tab:gray"),
    5: ("quarantined", "skipped: every sample of a batch quarantined", "P", "tab:brown"),
}
#: a step's ``outcome`` in the JSON's history, by code: the name of its ``Outcome`` member, lower-case
OUTCOMES: dict[int, str] = {
    0: "applied",
    1: "skipped_scaler",  # the fp16 loss scaler found inf/NaN in the scaled gradients
    2: "skipped_nonfinite",  # a non-finite loss or gradient norm
    3: "skipped_spike",  # a loss or gradient-norm spike (TrainingHealthMonitor)
    4: "skipped_rollback",  # a rollback step, or a batch of the data window skipped after it
    5: "skipped_quarantined",  # a batch whose samples are all quarantined (StepReplay)
}
_CODES = {name: code for code, name in OUTCOMES.items()}
_DATA_SKIP = 4
_SPIKE = 1  # the monitor's verdict in the history's spike columns (``ledger/verdict.py``: SPIKE); 2 is a new level
_DENSE = ("loss", "grad_norm")  # series with a value on every step: NaN there means a diverged value
_PANELS = ("loss", "grad_norm", "lr", "loss_scale", "update_ratio", "memory_gb")
_ROLLBACK_COLOR = "tab:cyan"
#: a measured series with values on fewer steps than this is drawn as points with a note, not as a curve
_FEW_POINTS = 20
_MEASURED_ON = {
    "update_ratio": "logging steps, and steps whose update a callback measured",
    "memory_gb": "logging steps",
}


def outcome_name(code: float | None) -> str | None:
    """The :data:`OUTCOMES` name of an outcome code (``None`` for NaN or ``None``; an unknown code as
    ``"outcome_<code>"``)."""
    if code is None or not math.isfinite(code):
        return None
    return OUTCOMES.get(int(code), f"outcome_{int(code)}")


def _outcome_codes(values: Sequence[Any] | None) -> list[float]:
    """Outcome codes from names (a report read back) or numbers (the monitor's history); NaN where unknown."""
    codes = []
    for v in values or ():
        if isinstance(v, str):
            code = _CODES.get(v)
            if code is None and v.startswith("outcome_") and v[8:].isdigit():
                code = int(v[8:])
            codes.append(math.nan if code is None else float(code))
        else:
            codes.append(_float(v))
    return codes


def _float(value: Any) -> float:
    """``value`` as a float; ``None`` (a ``null`` read back from JSON) as NaN."""
    return math.nan if value is None else float(value)


def _floats(values: Sequence[Any] | None) -> list[float]:
    return [_float(v) for v in values or ()]


def _finite(values: Sequence[Any] | None) -> list[float]:
    return [v for v in _floats(values) if math.isfinite(v)]


def summarize(history: dict[str, list[Any]], events: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline numbers of a run; ``None`` where a series has no finite value. ``outcome`` may hold codes or
    :data:`OUTCOMES` names."""
    steps = len(history["step"]) if "step" in history else max((len(v) for v in history.values()), default=0)
    loss, grad, memory, scale = (_finite(history.get(k)) for k in ("loss", "grad_norm", "memory_gb", "loss_scale"))
    codes = _outcome_codes(history.get("outcome"))
    outcome = [int(v) for v in codes if math.isfinite(v)]
    skipped = {key: outcome.count(code) for code, (key, *_) in SKIP_REASONS.items()}
    skipped["total"] = sum(o != 0 for o in outcome)
    loss_spike, grad_spike = _floats(history.get("loss_spike")), _floats(history.get("grad_spike"))
    norm, clip = _floats(history.get("grad_norm")), _floats(history.get("clip_threshold"))

    def at(values: list[float], i: int) -> float:
        return values[i] if i < len(values) else math.nan

    applied = [i for i, code in enumerate(codes) if code == 0]
    return {
        "steps": steps,
        "final_loss": loss[-1] if loss else None,
        "min_loss": min(loss, default=None),
        "loss_spikes": sum(v == _SPIKE for v in loss_spike),
        "grad_norm_spikes": sum(v == _SPIKE for v in grad_spike),
        "spikes_applied": sum(_SPIKE in (at(loss_spike, i), at(grad_spike, i)) for i in applied),
        "clipped_steps": sum(clipped(at(norm, i), at(clip, i)) for i in applied),
        "skipped_steps": skipped,
        "rollbacks": sum(e.get("kind") == "rollback" for e in events),
        "max_grad_norm": max(grad, default=None),
        "peak_memory_gb": max(memory, default=None),
        "final_loss_scale": scale[-1] if scale else None,
    }


def clipped(norm: float, clip: float) -> bool:
    """Whether a gradient of norm ``norm`` was clipped by the threshold ``clip`` (NaN or inf: no clip)."""
    return math.isfinite(norm) and math.isfinite(clip) and norm > clip


def _json_safe(obj: Any) -> Any:
    """``obj`` made JSON-safe: non-finite floats as ``None``, tuples as lists, 0-dim tensors as numbers."""
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    if hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:
        return _json_safe(obj.item())  # a 0-dim tensor or a numpy scalar
    return str(obj)


def write_report(
    history: dict[str, list[float]],
    events: list[dict[str, Any]],
    out_dir: str | Path,
    meta: dict[str, Any] | None = None,
    name: str = "stability_report",
    summary: dict[str, Any] | None = None,
    incidents: list[dict[str, Any]] | None = None,
) -> tuple[Path, Path | None]:
    """Write ``<out_dir>/<name>.json`` and, when matplotlib is installed, ``<out_dir>/<name>.png``.

    Args:
        history: per-step series of equal length (see :mod:`lightning_stability.health.history`); any may be
            missing. Values may be NaN or inf.
        events: dicts with at least ``"step"`` and ``"kind"`` (``"rollback"`` events also ``"to_step"``).
        out_dir: created if needed.
        meta: run settings, copied into the JSON under ``"meta"``.
        name: the file stem.
        summary: figures that replace those :func:`summarize` computes from ``history`` (exact whole-run counts
            when ``history`` is downsampled).
        incidents: the run's incident log (every fault handled, across restarts), kept under ``"incidents"``.

    Returns:
        ``(json_path, png_path)``; ``png_path`` is ``None`` without matplotlib.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {**summarize(history, events), **(summary or {})}
    history_out = {k: _json_safe(_floats(v)) if k != "outcome" else v for k, v in history.items()}
    if "outcome" in history_out:  # by name: "applied", "skipped_nonfinite", ... (OUTCOMES)
        history_out["outcome"] = [outcome_name(c) for c in _outcome_codes(history_out["outcome"])]
    if "step" in history_out:  # steps are recorded as floats; write them as the integers they are
        history_out["step"] = [int(s) if s is not None and s == int(s) else s for s in history_out["step"]]
    report = {
        "meta": meta or {},
        "summary": summary,
        "history": history_out,
        "events": events,
        "incidents": incidents or [],
    }
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps(_json_safe(report), allow_nan=False, indent=1) + "\n")

    figure = figure_class()
    if figure is None:
        log.info(
            "stability report: %s; install matplotlib (pip install matplotlib) for the PNG",
            json_path,
        )
        return json_path, None
    png_path = out / f"{name}.png"
    _draw(history, events, summary, figure).savefig(png_path, dpi=110)
    return json_path, png_path


def load_report(path: str | Path) -> dict[str, Any]:
    """Read a report written by :func:`write_report` (``null`` stays ``None``)."""
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return data


def figure_class() -> type[Figure] | None:
    """matplotlib's ``Figure`` class, or ``None`` when matplotlib cannot be imported."""
    try:
        importlib.import_module("matplotlib")  # first: ``sys.modules["matplotlib"] = None`` must read as absent
    except ImportError:
        return None
    from matplotlib.figure import Figure

    return Figure


def _title(summary: dict[str, Any]) -> str:
    final, skipped = summary["final_loss"], summary["skipped_steps"]
    reasons = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in skipped.items() if k != "total" and n)
    grad, applied, clipped_steps = (summary.get(k, 0) for k in ("grad_norm_spikes", "spikes_applied", "clipped_steps"))
    return (
        f"Stability report: {summary['steps']} steps, final loss {'n/a' if final is None else f'{final:.4g}'}, "
        f"{summary['loss_spikes']} loss spike(s), {grad} gradient-norm spike(s), {applied} spike(s) applied, "
        f"{summary['rollbacks']} rollback(s)\n"
        f"{skipped['total']} skipped step(s){f': {reasons}' if reasons else ''}; {clipped_steps} step(s) clipped"
    )


def _band(ax: Axes, x: Any, series: Any, key: str, color: str) -> None:
    """The min-max band of a downsampled series (``<key>_min`` / ``<key>_max``, where the history has them)."""
    low, high = series(f"{key}_min"), series(f"{key}_max")
    if (low == low).any():
        ax.fill_between(x, low, high, color=color, alpha=0.25, lw=0, label="min-max of older steps (downsampled)")


def loss_limits(loss: Any, normal: Any) -> tuple[float, float, bool] | None:
    """The loss panel's y-range ``(low, high, log)``: it fits the loss of every ``normal`` step (applied, not a
    spike), so that a spike does not flatten the curve; log scale when those are positive and span more than two
    decades. ``None`` (matplotlib's own range) without two such steps."""
    import numpy as np

    values = loss[normal & np.isfinite(loss)]
    if values.size < 2:
        return None
    low, high = float(values.min()), float(values.max())
    log = low > 0 and high > 100 * low
    if log:
        pad = (high / low) ** 0.05
        return low / pad, high * pad, True
    pad = 0.05 * (high - low) or 0.05 * abs(high) or 0.05
    return low - pad, high + pad, False


def _draw(
    history: dict[str, list[Any]], events: list[dict[str, Any]], summary: dict[str, Any], figure_class: Any
) -> Figure:
    """The report figure: one panel per drawable series, sharing the step axis. Each marker set has a ``gid``
    (``"loss_spikes"``, ``"grad_norm_spikes"``, ``"spikes_applied_clipped"``, ``"loss_off_scale"``, ...)."""
    import numpy as np

    n = summary["steps"]
    x = np.asarray(_floats(history["step"])[:n] if "step" in history else range(n), dtype=float)

    def series(key: str) -> Any:
        y = np.full(len(x), np.nan)
        values = (_outcome_codes if key == "outcome" else _floats)(history.get(key))[: len(x)]
        y[: len(values)] = values
        return y

    def drawable(key: str) -> bool:
        return key in history and bool((~np.isnan(series(key))).any())

    panels = [p for p in _PANELS if drawable(p) or (p == "grad_norm" and drawable("clip_threshold"))]
    fig: Figure = figure_class(figsize=(10, min(12.0, 2.0 + 1.7 * max(len(panels), 1))), layout="tight")
    fig.suptitle(_title(summary), fontsize=10)
    if not panels:
        fig.add_subplot().text(0.5, 0.5, "no series to draw", ha="center", va="center")
        return fig
    axes: list[Axes] = list(np.atleast_1d(fig.subplots(len(panels), 1, sharex=True)))
    outcome = series("outcome")
    loss_spike, grad_spike = series("loss_spike") == _SPIKE, series("grad_spike") == _SPIKE
    for ax, key in zip(axes, panels, strict=True):
        y = series(key)
        finite = np.isfinite(y)
        if key == "loss":
            ax.plot(x, np.where(finite, y, np.nan), lw=1, color="tab:blue", label="loss", gid="loss")
            _band(ax, x, series, key, "tab:blue")
            limits = loss_limits(y, ~loss_spike & ~(outcome > 0))  # applied, or no outcome recorded
            shown = y  # where a marker goes: off-scale values on the panel's edge
            if limits is not None:
                low, high, log = limits
                if log:
                    ax.set_yscale("log")
                ax.set_ylim(low, high)
                shown = np.clip(y, low, high)
                for off, marker, name in ((finite & (y > high), "^", "above"), (finite & (y < low), "v", "below")):
                    if not off.any():
                        continue
                    label = f"off scale ({name}: value written beside)"
                    ax.plot(
                        x[off],
                        shown[off],
                        marker,
                        color="red",
                        ms=6,
                        clip_on=False,
                        in_layout=False,
                        label=label,
                        gid="loss_off_scale",
                    )
                    for step, value in _apart(x[off], y[off], gap=0.03 * (x.max() - x.min())):
                        va = "bottom" if name == "above" else "top"
                        ax.annotate(
                            f"{value:.3g}",
                            (step, shown[x == step][0]),
                            xytext=(7, 2),
                            textcoords="offset points",
                            fontsize=6,
                            color="red",
                            va=va,
                            annotation_clip=False,
                            in_layout=False,
                        )
            spike = loss_spike & finite
            ax.plot(
                x[spike],
                shown[spike],
                "o",
                ms=10,
                mfc="none",
                mec="red",
                mew=1.5,
                zorder=3,
                clip_on=False,
                in_layout=False,
                label="loss spike" if spike.any() else None,
                gid="loss_spikes",
            )
            for code, (_, label, marker, color) in SKIP_REASONS.items():
                hit, top = (outcome == code) & finite, (outcome == code) & ~finite
                ax.plot(
                    x[hit],
                    shown[hit],
                    marker,
                    ms=5,
                    color=color,
                    ls="none",
                    clip_on=False,
                    in_layout=False,
                    label=label if hit.any() else None,
                    gid=f"skipped_{code}",
                )
                if top.any():  # a skipped step without a finite loss: on the top edge, under the non-finite mark
                    ax.plot(
                        x[top],
                        np.full(int(top.sum()), 0.92),
                        marker,
                        ms=5,
                        color=color,
                        ls="none",
                        transform=ax.get_xaxis_transform(),
                        label=label,
                        gid=f"skipped_{code}_nonfinite",
                    )
            ax.set_ylabel("loss")
        elif key == "grad_norm":
            ax.plot(x, np.where(finite, y, np.nan), lw=1, color="tab:green", label="grad norm (before clipping)")
            _band(ax, x, series, key, "tab:green")
            clip = series("clip_threshold")
            if np.isfinite(clip).any():
                ax.plot(
                    x, np.where(np.isfinite(clip), clip, np.nan), "--", lw=1, color="tab:red", label="clip threshold"
                )
            _grad_spikes(ax, x, y, clip, grad_spike & finite, outcome)
            if finite.any() and (y[finite] > 0).all():
                ax.set_yscale("log")
            ax.set_ylabel("grad norm")
        elif key in _MEASURED_ON:
            few = int(finite.sum()) < _FEW_POINTS
            style: dict[str, Any] = {"ls": "none", "ms": 4} if few else {"ls": "-", "lw": 1, "ms": 2}
            ax.plot(x[finite], y[finite], marker="o", color="tab:brown", gid=key, **style)
            if few:  # a line through a handful of points would invent the steps between them
                note = f"{int(finite.sum())} value(s), measured on {_MEASURED_ON[key]} only: points, not a curve"
                ax.set_title(note, loc="left", fontsize=7, gid=f"{key}_note")
            if key == "update_ratio" and finite.any() and (y[finite] > 0).all():
                ax.set_yscale("log")
            ax.set_ylabel("update / param\nnorm ratio" if key == "update_ratio" else "peak memory (GB)")
        else:
            ax.plot(x, np.where(finite, y, np.nan), lw=1, color="tab:olive" if key == "lr" else "darkgoldenrod")
            if key == "loss_scale" and finite.any() and (y[finite] > 0).all():
                ax.set_yscale("log", base=2)
            ax.set_ylabel("learning rate" if key == "lr" else "loss scale")
        # non-finite values: a marker on the panel's top edge (NaN counts only where a value was expected)
        bad = np.isinf(y) | (np.isnan(y) & (key in _DENSE) & (outcome != _DATA_SKIP))
        if bad.any():
            top = ax.get_xaxis_transform()
            ax.plot(
                x[bad],
                np.ones(int(bad.sum())),
                "x",
                color="magenta",
                ms=7,
                mew=1.5,
                clip_on=False,
                in_layout=False,
                transform=top,
            )
            ax.plot([], [], "x", color="magenta", mew=1.5, label="non-finite value (top edge)")
        ax.grid(True, alpha=0.3)
    for event in (e for e in events if e.get("kind") == "rollback"):
        step, to_step = _float(event.get("step")), _float(event.get("to_step"))
        for i, ax in enumerate(axes):
            ax.axvline(step, color=_ROLLBACK_COLOR, lw=1.5, label="rollback (to the step above)" if i == 0 else None)
            if math.isfinite(to_step):
                ax.axvspan(
                    to_step,
                    step,
                    color=_ROLLBACK_COLOR,
                    alpha=0.12,
                    lw=0,
                    label="steps undone by rollback" if i == 0 else None,
                )
        text = f"to {to_step:g}" if math.isfinite(to_step) else "?"
        axes[0].annotate(
            text,
            (step, 1),
            xycoords=axes[0].get_xaxis_transform(),
            xytext=(0, 6),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=7,
            color="teal",
        )
    for ax in axes:  # outside on the right, so that no legend hides data; tight layout keeps the x axes aligned
        handles, labels = ax.get_legend_handles_labels()
        if labels:
            unique = dict(zip(labels, handles, strict=True))
            ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[-1].set_xlabel("step")
    return fig


def _apart(steps: Any, values: Any, gap: float, most: int = 12) -> list[tuple[float, float]]:
    """The values to write beside their off-scale markers: the farthest first, none within ``gap`` steps of one
    written (so the labels of neighbouring steps do not overlap), at most ``most``."""
    chosen: list[tuple[float, float]] = []
    for i in sorted(range(len(steps)), key=lambda i: -abs(float(values[i]))):
        if len(chosen) < most and all(abs(float(steps[i]) - s) > gap for s, _ in chosen):
            chosen.append((float(steps[i]), float(values[i])))
    return chosen


def _grad_spikes(ax: Axes, x: Any, norm: Any, clip: Any, spike: Any, outcome: Any) -> None:
    """The gradient-norm spikes on their panel: a ring on each; an applied one clipped as a drop from its norm to
    the clip it got, an applied one not clipped as a diamond, a skipped one as the skip's square."""
    import numpy as np

    applied = spike & (outcome == 0)
    cut = applied & np.isfinite(clip) & (norm > clip)
    ax.plot(
        x[spike],
        norm[spike],
        "o",
        ms=10,
        mfc="none",
        mec="red",
        mew=1.5,
        zorder=3,
        label="gradient-norm spike" if spike.any() else None,
        gid="grad_norm_spikes",
    )
    if cut.any():
        ax.vlines(x[cut], clip[cut], norm[cut], colors="tab:orange", lw=1.5, zorder=3)
    ax.plot(
        x[cut],
        clip[cut],
        "v",
        ms=7,
        color="tab:orange",
        ls="none",
        zorder=4,
        label="spike applied, clipped to the threshold" if cut.any() else None,
        gid="spikes_applied_clipped",
    )
    whole = applied & ~cut
    ax.plot(
        x[whole],
        norm[whole],
        "D",
        ms=5,
        color="tab:orange",
        ls="none",
        zorder=4,
        label="spike applied, not clipped" if whole.any() else None,
        gid="spikes_applied",
    )
    skipped = spike & (outcome == 3)
    _, label, marker, color = SKIP_REASONS[3]
    ax.plot(
        x[skipped],
        norm[skipped],
        marker,
        ms=5,
        color=color,
        ls="none",
        label=label if skipped.any() else None,
        gid="grad_norm_spikes_skipped",
    )
