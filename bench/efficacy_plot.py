"""The efficacy benchmark's pictures: one PNG per workload, from the kept timelines.

Two panels sharing the time axis. Above: the engine's KV usage without kvguard (red)
and with it (green), kvguard's forecast of demand (dashed), and when the dry-run
kvguard first said ``high`` (dotted). Below: one lane per kind of action kvguard took,
a tick at each decision, so actions that come close together stay readable (labels on
the lanes, not on the lines).

Needs matplotlib (the ``bench`` extra); without it, no plots.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench import efficacy_policies as pol

DEMAND_CUT = 1.95  # forecasts far past the pool are drawn at the top edge
DPI = 110
LABEL_PT = 8  # the smallest text: lane labels, legend (as the dashboards' pictures)


def plot(series: Mapping[str, Mapping[str, Any]], out_dir: Path, seed: int) -> list[str]:
    """Write one PNG per workload into ``out_dir``; their names (none without matplotlib)."""
    try:
        import matplotlib  # noqa: F401, PLC0415 - optional
    except ImportError:
        return []
    for old in out_dir.glob("efficacy_*.png"):
        old.unlink()  # a plot of an earlier run must not sit beside this one's figures
    written = []
    for workload, timelines in series.items():
        fig = figure(workload, timelines, seed)
        safe = workload.replace("@", "_at_").replace(".csv", "")
        path = out_dir / f"efficacy_{safe}.png"
        fig.savefig(path, dpi=DPI)
        written.append(path.name)
    return written


def figure(workload: str, timelines: Mapping[str, Mapping[str, Any]], seed: int) -> Any:  # noqa: ANN401 - matplotlib
    """One workload's picture, a matplotlib figure drawn on Agg (needs matplotlib).

    No pyplot: nothing global to close, and any caller (:func:`plot`, a test) can draw it.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 - optional
    from matplotlib.figure import Figure  # noqa: PLC0415

    kv = timelines.get("kvguard")
    kinds = sorted({kind for _, kind in kv["actions"]}) if kv else []
    fig = Figure(figsize=(9, 4.2 + 0.18 * len(kinds)))
    FigureCanvasAgg(fig)
    usage, lanes = fig.subplots(
        2,
        1,
        sharex=True,
        gridspec_kw={"height_ratios": [3, max(1, 0.35 * len(kinds))]},
    )
    _usage_panel(usage, timelines)
    _action_lanes(lanes, kv, kinds)
    usage.set_title(f"{workload} (seed {seed}, preempt mode)")
    fig.tight_layout()
    return fig


def _usage_panel(ax: Any, timelines: Mapping[str, Any]) -> None:  # noqa: ANN401 - matplotlib
    for name, color in (("none", "tab:red"), ("kvguard", "tab:green")):
        timeline = timelines.get(name)
        if timeline is None:
            continue
        pts = [(t, u) for t, u, _, _ in timeline["engine"] if t >= 0]
        ax.plot([t for t, _ in pts], [u for _, u in pts], color=color, label=f"KV usage, {name}")
    kv = timelines.get("kvguard")
    if kv is not None:
        demand = [(t, d) for t, _, d, _ in kv["forecast"] if d is not None and t >= 0]
        ax.plot(
            [t for t, _ in demand],
            [min(d, DEMAND_CUT) for _, d in demand],
            color="tab:green",
            linestyle="--",
            linewidth=0.9,
            label=f"kvguard forecast: demand (cut at {DEMAND_CUT})",
        )
    dry = timelines.get("kvguard_dry_run")
    high = pol.first_high(dry["forecast"]) if dry else None
    if high is not None:
        ax.axvline(high, color="tab:orange", linestyle=":", label="dry-run: first high")
    ax.set_ylim(0, 2.0)
    ax.set_ylabel("fraction of the KV pool")
    ax.legend(fontsize=LABEL_PT, loc="upper right")


def _action_lanes(ax: Any, kv: Mapping[str, Any] | None, kinds: list[str]) -> None:  # noqa: ANN401
    if not kinds or kv is None:
        ax.set_yticks([])
        ax.text(0.01, 0.5, "kvguard took no action", transform=ax.transAxes, fontsize=LABEL_PT)
    else:
        lane = {kind: i for i, kind in enumerate(kinds)}
        times = [t for t, _ in kv["actions"]]
        rows = [lane[kind] for _, kind in kv["actions"]]
        ax.scatter(times, rows, marker="|", s=60, color="tab:green")
        ax.set_yticks(range(len(kinds)), kinds, fontsize=LABEL_PT)
        ax.set_ylim(len(kinds) - 0.5, -0.5)  # the first kind in the alphabet on top
    ax.set_xlabel("seconds into the workload")
    ax.grid(axis="x", alpha=0.3)
