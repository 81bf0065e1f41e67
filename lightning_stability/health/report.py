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


__all__ = ["SKIP_REASONS", "load_report", "summarize", "write_report"]

log = logging.getLogger("lightning_stability")

#: ``outcome`` code of a skipped step (``lightning_stability.ledger.track.Outcome``) -> (summary key, legend label,
#: marker, colour). Kept here so that the report needs neither torch nor Lightning.
SKIP_REASONS: dict[int, tuple[str, str, str, str]] = {
    1: ("scaler_overflow", "skipped: fp16 scaler overflow", "v", "tab:orange"),
    2: ("nonfinite_grad", "skipped: non-finite gradient", "X", "black"),
    3: ("spike", "skipped: spike", "s", "tab:purple"),
    4: ("data_skip", "skipped: data after rollback", "D", "tab:gray"),
}
_DATA_SKIP = 4
_SPIKE = 1  # the monitor's verdict in the history's spike columns (``ledger/verdict.py``: SPIKE); 2 is a new level
_DENSE = ("loss", "grad_norm")  # series with a value on every step: NaN there means a diverged value
_PANELS = ("loss", "grad_norm", "lr", "loss_scale", "update_ratio", "memory_gb")
_ROLLBACK_COLOR = "tab:cyan"


def _float(value: Any) -> float:
    """``value`` as a float; ``None`` (a ``null`` read back from JSON) as NaN."""
    return math.nan if value is None else float(value)


def _floats(values: Sequence[Any] | None) -> list[float]:
    return [_float(v) for v in values or ()]


def _finite(values: Sequence[Any] | None) -> list[float]:
    return [v for v in _floats(values) if math.isfinite(v)]


def summarize(history: dict[str, list[float]], events: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline numbers of a run; ``None`` where a series has no finite value."""
    steps = len(history["step"]) if "step" in history else max((len(v) for v in history.values()), default=0)
    loss, grad, memory, scale = (_finite(history.get(k)) for k in ("loss", "grad_norm", "memory_gb", "loss_scale"))
    outcome = [int(v) for v in _finite(history.get("outcome"))]
    skipped = {key: outcome.count(code) for code, (key, *_) in SKIP_REASONS.items()}
    skipped["total"] = sum(o != 0 for o in outcome)
    return {
        "steps": steps,
        "final_loss": loss[-1] if loss else None,
        "min_loss": min(loss, default=None),
        "loss_spikes": sum(v == _SPIKE for v in _floats(history.get("loss_spike"))),
        "skipped_steps": skipped,
        "rollbacks": sum(e.get("kind") == "rollback" for e in events),
        "max_grad_norm": max(grad, default=None),
        "peak_memory_gb": max(memory, default=None),
        "final_loss_scale": scale[-1] if scale else None,
    }


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

    Returns:
        ``(json_path, png_path)``; ``png_path`` is ``None`` without matplotlib.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {**summarize(history, events), **(summary or {})}
    history_out = {k: _json_safe(_floats(v)) for k, v in history.items()}
    if "step" in history_out:  # steps are recorded as floats; write them as the integers they are
        history_out["step"] = [int(s) if s is not None and s == int(s) else s for s in history_out["step"]]
    report = {"meta": meta or {}, "summary": summary, "history": history_out, "events": events}
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
    return (
        f"Stability report: {summary['steps']} steps, final loss {'n/a' if final is None else f'{final:.4g}'}, "
        f"{summary['loss_spikes']} loss spike(s), {summary['rollbacks']} rollback(s)\n"
        f"{skipped['total']} skipped step(s){f': {reasons}' if reasons else ''}"
    )


def _band(ax: Axes, x: Any, series: Any, key: str, color: str) -> None:
    """The min-max band of a downsampled series (``<key>_min`` / ``<key>_max``, where the history has them)."""
    low, high = series(f"{key}_min"), series(f"{key}_max")
    if (low == low).any():
        ax.fill_between(x, low, high, color=color, alpha=0.25, lw=0, label="min-max of older steps (downsampled)")


def _draw(
    history: dict[str, list[float]], events: list[dict[str, Any]], summary: dict[str, Any], figure_class: Any
) -> Figure:
    """The report figure: one panel per drawable series, sharing the step axis."""
    import numpy as np

    n = summary["steps"]
    x = np.asarray(_floats(history["step"])[:n] if "step" in history else range(n), dtype=float)

    def series(key: str) -> Any:
        y = np.full(len(x), np.nan)
        values = _floats(history.get(key))[: len(x)]
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
    for ax, key in zip(axes, panels, strict=True):
        y = series(key)
        finite = np.isfinite(y)
        if key == "loss":
            ax.plot(x, np.where(finite, y, np.nan), lw=1, color="tab:blue", label="loss")
            _band(ax, x, series, key, "tab:blue")
            if finite.any() and (y[finite] > 0).all() and y[finite].max() > 100 * y[finite].min():
                ax.set_yscale("log")
            spike = (series("loss_spike") == _SPIKE) & finite
            ax.plot(
                x[spike],
                y[spike],
                "o",
                ms=10,
                mfc="none",
                mec="red",
                mew=1.5,
                zorder=3,
                label="loss spike" if spike.any() else None,
            )
            for code, (_, label, marker, color) in SKIP_REASONS.items():
                hit, top = (outcome == code) & finite, (outcome == code) & ~finite
                ax.plot(x[hit], y[hit], marker, ms=5, color=color, ls="none", label=label if hit.any() else None)
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
            if finite.any() and (y[finite] > 0).all():
                ax.set_yscale("log")
            ax.set_ylabel("grad norm")
        elif key in ("update_ratio", "memory_gb"):
            ax.plot(x[finite], y[finite], "o", ms=3, color="tab:brown")
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
            ax.plot(x[bad], np.ones(int(bad.sum())), "x", color="magenta", ms=7, mew=1.5, clip_on=False, transform=top)
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
