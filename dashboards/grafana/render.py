"""Draw a Grafana dashboard as pictures: one PNG per row, one subplot per panel.

This is not Grafana. matplotlib draws each panel of a dashboard JSON from the panel's
own PromQL, answered by a Prometheus (``/api/v1/query_range`` over one time range),
with the panel's title, its legends (``legendFormat``), its unit on the y axis, its
thresholds, value mappings, colour overrides, stacking and dashed series. Time series,
bars, state timelines and heatmaps are drawn over the range; stat panels as their last
value in big text, bar gauges as bars, tables as a small table. A panel whose queries
return nothing says "no data in this run" rather than disappearing. Annotations are
not drawn. The layout follows each panel's ``gridPos`` on Grafana's 24-column grid.

Grafana's variables are filled in as Grafana would: ``$__rate_interval`` is
max(step + scrape interval, 4 x scrape interval), ``$__interval`` the step, and each
query variable (``job``, ``instance``) takes the values its ``label_values(...)`` finds
in the range (all of them for a multi-value variable, the first for a single-value
one) unless ``--var NAME=VALUE`` sets it.

    .venv/bin/python dashboards/grafana/render.py --prometheus http://127.0.0.1:9090
        --last 15m --scrape-interval 5s --var instance=127.0.0.1:9108 --out pictures/

(one command line). The pictures in docs/images/dashboards/ are made by pictures.py
beside this file (a short simulated run feeding a real Prometheus), which calls
:func:`render_dashboard`. Needs matplotlib (the ``bench`` and ``test`` extras).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import re
import sys
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import matplotlib
import numpy as np
import PIL.Image
import PIL.PngImagePlugin
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import (
    FixedLocator,
    FuncFormatter,
    MaxNLocator,
    MultipleLocator,
    PercentFormatter,
)

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType  # matplotlib >= 3.9; only for the checker

HERE = Path(__file__).resolve().parent
DASHBOARDS = (HERE / "kvguard-overview.json", HERE / "kvguard-fleet.json")
NO_DATA = "no data in this run"
GRID_COLUMNS = 24  # Grafana's grid
WIDTH_IN = 13.0  # 1,300 px at DPI: read at a docs page's width without zooming
UNIT_HEIGHT_IN = 0.42  # one Grafana grid unit (30 px + margin) at this width
HEADER_IN = 0.75  # the figure's title and its note
DPI = 100
MAX_LEGEND = 14  # entries; beyond, the legend says how many more there are
TITLE_PT = 11.5
TICK_PT = 9.0
LEGEND_PT = 9.0
STYLE: dict[RcKeyType, Any] = {
    "font.size": 10,
    "axes.titlesize": TITLE_PT,
    "axes.titleweight": "bold",
    "axes.labelsize": 10,
    "xtick.labelsize": TICK_PT,
    "ytick.labelsize": TICK_PT,
    "legend.fontsize": LEGEND_PT,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
}
# Grafana's named colours (its default theme) and its classic series palette.
COLORS = {
    "green": "#56A64B",
    "dark-green": "#37872D",
    "yellow": "#E0B400",
    "dark-yellow": "#CC9D00",
    "orange": "#FF9830",
    "dark-orange": "#FA6400",
    "red": "#E02F44",
    "dark-red": "#C4162A",
    "blue": "#3274D9",
    "purple": "#A352CC",
    "text": "#333333",
}
PALETTE = (
    "#7EB26D",
    "#EAB839",
    "#6ED0E0",
    "#EF843C",
    "#E24D42",
    "#1F78C1",
    "#BA43A9",
    "#705DA0",
    "#508642",
    "#CCA300",
    "#447EBC",
    "#C15C17",
)
# The y-axis label of each Grafana unit (bytes get their scale: "GiB").
UNIT_LABELS = {
    "percentunit": "percent",
    "percent": "percent",
    "s": "seconds",
    "ms": "milliseconds",
    "reqps": "requests / s",
    "ops": "per second",
    "hertz": "per second (Hz)",
}
BINARY = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")
LEGEND = re.compile(r"\{\{\s*([\w.]+)\s*\}\}")
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
LABEL_VALUES = re.compile(r"^label_values\((?:(.*),\s*)?(\w+)\)$")


# ------------------------------------------------------------------ data
@dataclasses.dataclass(frozen=True)
class TimeRange:
    """The range every query is asked over: Unix seconds and the step between samples."""

    start: float
    end: float
    step: float

    @property
    def points(self) -> int:
        """Samples per series: Prometheus answers at start, start + step, ... <= end."""
        return math.floor((self.end - self.start) / self.step + 1e-9) + 1

    def offsets(self) -> np.ndarray:
        """Each sample's seconds since the start: the x axis."""
        return np.arange(self.points) * self.step


@dataclasses.dataclass(frozen=True)
class Series:
    """One series of a panel: its legend, labels, query and one value per step (NaN: none)."""

    name: str
    labels: Mapping[str, str]
    ref_id: str
    values: np.ndarray

    def last(self) -> float:
        """The value at the range's end (NaN when the series had none there)."""
        return float(self.values[-1])

    def has_data(self) -> bool:
        """Whether any sample is a number (+/-Inf count: a stat maps them to text)."""
        return bool(np.any(~np.isnan(self.values)))


@dataclasses.dataclass
class PanelResult:
    """What one panel showed: its series with data, and the queries that failed."""

    title: str
    kind: str
    series: int
    errors: list[str] = dataclasses.field(default_factory=list)

    @property
    def has_data(self) -> bool:
        """Whether the panel drew anything."""
        return self.series > 0


@dataclasses.dataclass
class RowPicture:
    """One dashboard row drawn: its figure (one axes per panel) and what each panel showed."""

    dashboard: str
    row: str
    figure: Figure
    panels: list[PanelResult]

    @property
    def filename(self) -> str:
        """``<dashboard>-<row slug>.png``."""
        return picture_name(self.dashboard, self.row)


class QueryError(Exception):
    """Prometheus refused a query (or could not be reached); the message says why."""


class Source(Protocol):
    """What the renderer asks of Prometheus (a stub in the unit test)."""

    def query_range(self, expr: str, rng: TimeRange) -> list[dict[str, Any]]:
        """The ``result`` of ``/api/v1/query_range`` (a matrix)."""
        ...

    def label_values(self, label: str, match: str | None, rng: TimeRange) -> list[str]:
        """The values of ``label`` on series matching ``match`` in the range."""
        ...


class Prometheus:
    """A Prometheus HTTP API at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise ValueError(f"--prometheus must be an http(s) URL, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _get(self, path: str, params: Sequence[tuple[str, str]]) -> Any:  # noqa: ANN401 - JSON
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            # The scheme is checked in __init__: http(s) only, never file: or others.
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:  # noqa: S310
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # 400/422: Prometheus says why in the body
            try:
                body = json.loads(exc.read())
            except ValueError:
                raise QueryError(f"HTTP {exc.code} from {path}") from exc
        except (OSError, ValueError) as exc:
            raise QueryError(f"{path}: {exc}") from exc
        if body.get("status") != "success":
            raise QueryError(f"{body.get('errorType', 'error')}: {body.get('error', body)}")
        return body["data"]

    def query_range(self, expr: str, rng: TimeRange) -> list[dict[str, Any]]:
        """The matrix of ``expr`` over the range."""
        params = [
            ("query", expr),
            ("start", f"{rng.start:.3f}"),
            ("end", f"{rng.end:.3f}"),
            ("step", f"{rng.step:g}"),
        ]
        data = self._get("/api/v1/query_range", params)
        return list(data["result"])

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of ``expr`` now."""
        return list(self._get("/api/v1/query", [("query", expr)])["result"])

    def label_values(self, label: str, match: str | None, rng: TimeRange) -> list[str]:
        """Sorted values of ``label``, on series matching ``match`` when given."""
        params = [("start", f"{rng.start:.3f}"), ("end", f"{rng.end:.3f}")]
        if match:
            params.append(("match[]", match))
        return sorted(self._get(f"/api/v1/label/{label}/values", params))


# ------------------------------------------------------------------ the dashboard
def slug(title: str) -> str:
    """A row title as a file name part: "Engine: preemptions, OOMs" -> "engine-preemptions-ooms"."""
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def dashboard_name(path: Path) -> str:
    """The short name of a dashboard file: kvguard-overview.json -> overview."""
    return path.stem.removeprefix("kvguard-")


def picture_name(dashboard: str, row: str) -> str:
    """The PNG file of one row: ``<dashboard>-<row slug>.png``."""
    return f"{dashboard}-{slug(row)}.png"


def rows_of(dashboard: Mapping[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Each row's title and its panels, in order (a collapsed row's nested panels too).

    Panels before the first row (none in kvguard's dashboards) form a row named after
    the dashboard.
    """
    rows: list[tuple[str, list[dict[str, Any]]]] = []
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            rows.append((panel["title"], list(panel.get("panels") or [])))
        elif rows:
            rows[-1][1].append(panel)
        else:
            rows.append((dashboard.get("title", "dashboard"), [panel]))
    return rows


def grafana_variables(
    dashboard: Mapping[str, Any],
    source: Source,
    rng: TimeRange,
    *,
    scrape_interval_s: float,
    given: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Every variable a query may use, with the value Grafana would give it over ``rng``."""
    rate = max(rng.step + scrape_interval_s, 4 * scrape_interval_s)
    values = {
        "__interval": _duration(rng.step),
        "__interval_ms": str(round(rng.step * 1000)),
        "__rate_interval": _duration(rate),
        "__range": _duration(rng.end - rng.start),
        "__range_s": str(round(rng.end - rng.start)),
    }
    given = dict(given or {})
    for variable in dashboard.get("templating", {}).get("list", []):
        name = variable["name"]
        if name in given:
            values[name] = given.pop(name)
        elif variable.get("type") == "query":
            values[name] = _resolve(variable, source, rng, values)
    if given:
        raise ValueError(f"--var names no variable of this dashboard: {sorted(given)}")
    return values


def _resolve(
    variable: Mapping[str, Any], source: Source, rng: TimeRange, known: Mapping[str, str]
) -> str:
    """A query variable's value: its label values found in the range, as Grafana picks them."""
    query = variable.get("query")
    if isinstance(query, dict):
        query = query.get("query", "")
    parsed = LABEL_VALUES.match(str(query or "").strip())
    if parsed is None:
        return ".*"  # a kind of variable query this renderer does not evaluate: match all
    match, label = parsed.groups()
    found = source.label_values(label, substitute(match, known) if match else None, rng)
    if not found:
        return ".*"
    if variable.get("multi") or variable.get("includeAll"):
        # "All" or several values: Grafana sends a regex alternation of the escaped values.
        escaped = (re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\\\1", value) for value in found)
        return "(" + "|".join(escaped) + ")"
    return found[0]  # a single-value variable defaults to the first of its sorted options


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """``expr`` with each ``$name`` / ``${name}`` / ``${name:format}`` replaced."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise ValueError(f"no value for the variable ${name} in {expr!r}")
        return variables[name]

    return VARIABLE.sub(value, expr)


def legend(fmt: str | None, labels: Mapping[str, str]) -> str:
    """A series' name from ``legendFormat``: ``{{label}}`` replaced; Grafana's auto name else."""
    if fmt and fmt != "__auto":
        return LEGEND.sub(lambda m: labels.get(m.group(1), ""), fmt)
    name = labels.get("__name__", "")
    rest = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
    return f"{name}{{{rest}}}" if rest else name or "value"


def fetch(
    panel: Mapping[str, Any], source: Source, variables: Mapping[str, str], rng: TimeRange
) -> tuple[list[Series], list[str]]:
    """Every target's series (with a value somewhere), and the errors of failed queries.

    An instant target (stat, table, bar gauge) keeps only the series with a value at
    the range's end: what Grafana's instant query at "now" would have returned.
    """
    series: list[Series] = []
    errors: list[str] = []
    for target in panel.get("targets", []):
        if target.get("hide") or not target.get("expr"):
            continue
        ref = target.get("refId", "A")
        try:
            matrix = source.query_range(substitute(target["expr"], variables), rng)
        except QueryError as exc:
            errors.append(f"{ref}: {exc}")
            continue
        instant = bool(target.get("instant")) and not target.get("range")
        for result in matrix:
            labels = dict(result.get("metric", {}))
            values = np.full(rng.points, np.nan)
            for t, v in result.get("values", []):
                index = round((float(t) - rng.start) / rng.step)
                if 0 <= index < rng.points:
                    values[index] = float(v)  # "+Inf", "-Inf" and "NaN" parse as floats
            one = Series(legend(target.get("legendFormat"), labels), labels, ref, values)
            if (instant and not math.isnan(one.last())) or (not instant and one.has_data()):
                series.append(one)
    return series, errors


# ------------------------------------------------------------------ field config
def field_config(panel: Mapping[str, Any], name: str, ref_id: str = "") -> dict[str, Any]:
    """The panel's field defaults with the overrides that match a field (by name or query)."""
    config: dict[str, Any] = json.loads(
        json.dumps(panel.get("fieldConfig", {}).get("defaults", {}))
    )
    for override in panel.get("fieldConfig", {}).get("overrides", []):
        matcher = override.get("matcher", {})
        wanted = matcher.get("options")
        if (matcher.get("id") == "byName" and wanted == name) or (
            matcher.get("id") == "byFrameRefID" and wanted == ref_id
        ):
            for prop in override.get("properties", []):
                key = prop["id"]
                if key.startswith("custom."):
                    config.setdefault("custom", {})[key.removeprefix("custom.")] = prop["value"]
                else:
                    config[key] = prop["value"]
    return config


def color(name: str | None) -> str | None:
    """A Grafana colour name as matplotlib's (None for "transparent")."""
    if not name or name == "transparent":
        return None
    if name in COLORS:
        return COLORS[name]
    return name if matplotlib.colors.is_color_like(name) else COLORS["text"]


def threshold_color(value: float, config: Mapping[str, Any]) -> str | None:
    """The colour of the highest threshold step at or below ``value``."""
    steps = config.get("thresholds", {}).get("steps", [])
    chosen = None
    for step in steps:
        if step.get("value") is None or value >= step["value"]:
            chosen = step.get("color")
    return color(chosen)


def mapped(value: float, config: Mapping[str, Any]) -> tuple[str, str | None] | None:
    """A value mapping's (text, colour) for ``value``, if one matches."""
    for mapping in config.get("mappings", []):
        if mapping.get("type") != "value":
            continue
        for key, result in mapping.get("options", {}).items():
            try:
                hit = float(key) == value
            except ValueError:
                hit = False
            if hit:
                return result.get("text", key), color(result.get("color"))
    return None


def field_color(value: float, config: Mapping[str, Any], fallback: str | None) -> str | None:
    """A value's colour: its mapping's, a fixed colour, its threshold's, or ``fallback``."""
    hit = mapped(value, config)
    if hit is not None and hit[1] is not None:
        return hit[1]
    mode = config.get("color", {})
    if mode.get("mode") == "fixed":
        return color(mode.get("fixedColor"))
    # Grafana's colour mode is "thresholds" unless a field says otherwise (a table
    # column's override gives thresholds and a coloured cell, no mode).
    steps = config.get("thresholds", {}).get("steps")
    if mode.get("mode", "thresholds") == "thresholds" and steps and not math.isnan(value):
        return threshold_color(value, config)  # None where the step is "transparent"
    return fallback


def format_value(value: float, config: Mapping[str, Any]) -> str:
    """A value as the panel shows it: mapped text, or the number in the field's unit."""
    hit = mapped(value, config)
    if hit is not None:
        return hit[0]
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    unit = config.get("unit", "short")
    if unit == "percentunit":
        return f"{value * 100:.1f}%"
    if unit == "percent":
        return f"{value:.1f}%"
    if unit == "bytes":
        scale, name = _binary(abs(value))
        return f"{value / scale:.3g} {name}"
    if unit == "s":
        return _seconds(value)
    suffix = {"reqps": " req/s", "ops": " ops/s", "hertz": " Hz"}.get(unit, "")
    return f"{_short(value)}{suffix}"


def _binary(value: float) -> tuple[float, str]:
    """The binary scale (1024^k) and its name that suit ``value`` bytes."""
    power = 0
    while power < len(BINARY) - 1 and value >= 1024 ** (power + 1):
        power += 1
    return float(1024**power), BINARY[power]


def _seconds(value: float) -> str:
    if abs(value) < 1 and value != 0:
        return f"{value * 1000:.3g} ms"
    if abs(value) < 120:
        return f"{value:.3g} s"
    if abs(value) < 7200:
        return f"{value / 60:.3g} min"
    return f"{value / 3600:.3g} h"


def _short(value: float) -> str:
    """Grafana's "short": SI suffixes from a thousand up, else three significant digits."""
    for scale, suffix in ((1e12, " T"), (1e9, " B"), (1e6, " Mil"), (1e3, " K")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def _duration(seconds: float) -> str:
    """A PromQL duration: whole milliseconds, as ``4s`` or ``1500ms``."""
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


# ------------------------------------------------------------------ drawing
def render_dashboard(
    dashboard: Mapping[str, Any],
    name: str,
    source: Source,
    rng: TimeRange,
    *,
    scrape_interval_s: float,
    variables: Mapping[str, str] | None = None,
    note: str = "",
) -> list[RowPicture]:
    """Draw each row of ``dashboard`` over ``rng``; one :class:`RowPicture` per row.

    ``variables`` fixes dashboard variables (``instance``, ``job``); the others take the
    values Grafana would. ``note`` is added under each figure's title.
    """
    values = grafana_variables(
        dashboard, source, rng, scrape_interval_s=scrape_interval_s, given=variables
    )
    pictures = []
    for row, panels in rows_of(dashboard):
        with matplotlib.rc_context(STYLE):
            figure, results = _draw_row(
                dashboard, row, panels, source=source, variables=values, rng=rng, note=note
            )
        pictures.append(RowPicture(name, row, figure, results))
    return pictures


def save(
    pictures: Sequence[RowPicture], out_dir: Path, metadata: Mapping[str, str] | None = None
) -> list[Path]:
    """Write each picture as ``out_dir/<dashboard>-<row slug>.png``; their paths.

    The PNGs hold 256 colours: the drawings use few, and a palette image is half the
    size of a full-colour one, which matters for pictures kept in git. ``metadata``
    (and the row's title) go into the PNG's text chunks.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for picture in pictures:
        path = out_dir / picture.filename
        buffer = io.BytesIO()
        with matplotlib.rc_context(STYLE):
            picture.figure.savefig(buffer, format="png", dpi=DPI)
        buffer.seek(0)
        with PIL.Image.open(buffer) as full:
            image = full.convert("RGB").quantize(
                256, method=PIL.Image.Quantize.FASTOCTREE, dither=PIL.Image.Dither.NONE
            )
        # The octree's cell for white comes out at (254, 254, 254): snap it back, so the
        # background is the page's white.
        palette = image.getpalette() or []
        for i in range(0, len(palette) - 2, 3):
            if min(palette[i : i + 3]) >= 250:
                palette[i : i + 3] = [255, 255, 255]
        image.putpalette(palette)
        info = PIL.PngImagePlugin.PngInfo()
        for key, value in {
            "Title": f"{picture.dashboard}: {picture.row}",
            **(metadata or {}),
        }.items():
            info.add_text(key, value)
        info.add_text(
            "Software", f"matplotlib {matplotlib.__version__}, dashboards/grafana/render.py"
        )
        image.save(path, optimize=True, pnginfo=info, dpi=(DPI, DPI))
        written.append(path)
    return written


@dataclasses.dataclass(frozen=True)
class Cell:
    """A panel's place in the figure, in inches: its whole cell and the axes inside it."""

    width_in: float
    height_in: float
    title: str  # wrapped to the cell's width
    legend_rows: int = 0
    legend_columns: int = 1
    legend_limit: int = MAX_LEGEND  # entries shown, the last saying how many more when cut
    axes_width_in: float = 1.0  # known once the room for labels is taken off
    axes_height_in: float = 1.0

    @property
    def title_in(self) -> float:
        """Height of the title above the axes."""
        return 0.1 + 0.21 * (self.title.count("\n") + 1)


def _draw_row(
    dashboard: Mapping[str, Any],
    row: str,
    panels: Sequence[Mapping[str, Any]],
    *,
    source: Source,
    variables: Mapping[str, str],
    rng: TimeRange,
    note: str,
) -> tuple[Figure, list[PanelResult]]:
    """One figure: each panel at its gridPos, drawn from its queries.

    The layout is computed, not left to a layout engine: each panel's cell is its
    gridPos scaled to the figure, and the room its title, tick labels and legend need
    is measured from their text, so panels never overlap however much they show.
    """
    top = min((_grid(p)[1] for p in panels), default=0)
    rows = max((_grid(p)[1] + _grid(p)[3] - top for p in panels), default=1)
    height_in = rows * UNIT_HEIGHT_IN + HEADER_IN
    figure = Figure(figsize=(WIDTH_IN, height_in), dpi=DPI)
    results = []
    for panel in panels:
        x, y, w, h = _grid(panel)
        series, errors = fetch(panel, source, variables, rng)
        cell = _cell(panel, series, w, h)
        left, right, above, below = _pads(panel, series, cell)
        cell_left = x / GRID_COLUMNS * WIDTH_IN
        cell_top = HEADER_IN + (y - top) * UNIT_HEIGHT_IN
        width = max(0.3, cell.width_in - left - right - CELL_GAP_IN)
        height = max(0.3, cell.height_in - above - below - CELL_GAP_IN)
        cell = dataclasses.replace(cell, axes_width_in=width, axes_height_in=height)
        ax = figure.add_axes((
            (cell_left + left) / WIDTH_IN,
            1 - (cell_top + above + height) / height_in,
            width / WIDTH_IN,
            height / height_in,
        ))  # fmt: skip
        ax.set_gid(f"panel-{panel.get('id', '')}")
        ax.set_title(cell.title, loc="left", pad=5)
        if series:
            DRAW.get(panel.get("type", ""), _draw_unknown)(ax, panel, series, rng, cell)
        else:
            _no_data(ax, errors)
        kind = panel.get("type", "")
        results.append(PanelResult(panel.get("title", ""), kind, len(series), errors))
    title = f"{dashboard.get('title', 'dashboard')} — {row}"
    figure.text(0.008, 1 - 0.12 / height_in, title, fontsize=15, fontweight="bold", va="top")
    if note:
        figure.text(0.008, 1 - 0.45 / height_in, note, fontsize=9, color="#555555", va="top")
    return figure, results


CELL_GAP_IN = 0.12  # between neighbouring panels
TICKS_IN = 0.3  # the x axis's tick labels under a plot
LEGEND_ROW_IN = 0.2
TABLE_PT = 9.0
TABLE_ROW = 2.2  # a table row's height in points per point of font (scaled by 1.35)


def _grid(panel: Mapping[str, Any]) -> tuple[int, int, int, int]:
    pos = panel.get("gridPos", {})
    x = max(0, min(GRID_COLUMNS - 1, int(pos.get("x", 0))))
    w = max(1, min(GRID_COLUMNS - x, int(pos.get("w", 12))))
    return x, int(pos.get("y", 0)), w, max(1, int(pos.get("h", 8)))


def _cell(panel: Mapping[str, Any], series: Sequence[Series], w: int, h: int) -> Cell:
    """The panel's cell: its size, its title wrapped to it, and its legend's rows."""
    width_in = w / GRID_COLUMNS * WIDTH_IN
    chars = max(12, int(width_in * 72 / (TITLE_PT * 0.64)))
    title = "\n".join(textwrap.wrap(panel.get("title", ""), chars)[:3])
    cell = Cell(width_in, h * UNIT_HEIGHT_IN, title)
    shows_legend = panel.get("options", {}).get("legend", {}).get("showLegend", True)
    if panel.get("type") != "timeseries" or not series or not shows_legend:
        return cell
    names = [one.name for one in series]
    item_in = (max(len(name) for name in names) + 4) * LEGEND_PT * 0.6 / 72
    columns = max(1, min(len(names), int((width_in - 0.3) // item_in)))
    # The legend may take up to about 40% of the cell; beyond, it lists what fits and
    # says how many more series there are.
    most = max(1, int(cell.height_in * 0.4 / LEGEND_ROW_IN)) * columns
    limit = min(len(names), MAX_LEGEND, most)
    rows = math.ceil(limit / columns)
    return dataclasses.replace(cell, legend_rows=rows, legend_columns=columns, legend_limit=limit)


def _pads(
    panel: Mapping[str, Any], series: Sequence[Series], cell: Cell
) -> tuple[float, float, float, float]:
    """Room (inches) left, right, above and below the axes for its labels."""
    kind = panel.get("type")
    above = cell.title_in
    if not series or kind in ("stat", "gauge", "table"):
        return 0.08, 0.05, above, 0.08
    names = max((len(one.name) for one in series), default=4)
    if kind in ("state-timeline", "status-history", "bargauge"):
        # The series' names are the y axis's labels.
        left = min(cell.width_in * 0.45, 0.2 + names * TICK_PT * 0.6 / 72)
        return left, 0.15 + (0.45 if kind == "bargauge" else 0.0), above, TICKS_IN + 0.05
    if kind == "heatmap":
        return 0.95, 0.75, above, TICKS_IN + 0.05
    return 0.8, 0.12, above, TICKS_IN + 0.06 + cell.legend_rows * LEGEND_ROW_IN


def _no_data(ax: Axes, errors: Sequence[str]) -> None:
    """An empty panel that says so (and why, when a query failed)."""
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(visible=False)
    for spine in ax.spines.values():
        spine.set_visible(True)
        spine.set_color("#cccccc")
    ax.text(
        0.5, 0.5, NO_DATA, transform=ax.transAxes, ha="center", va="center",
        fontsize=11, color="#777777", style="italic",
    )  # fmt: skip
    if errors:
        text = "\n".join(textwrap.wrap("query failed: " + "; ".join(errors), 60)[:3])
        ax.text(0.5, 0.2, text, transform=ax.transAxes, ha="center", va="center", fontsize=8)


def _time_axis(ax: Axes, rng: TimeRange, width_in: float) -> None:
    """x: minutes:seconds since the range's start, ticks at round intervals that fit."""
    span = rng.end - rng.start
    ax.set_xlim(0, span)
    fits = max(2, min(8, int(width_in / 0.5)))  # a "1:45" label and its gap: ~0.5 in
    for tick in (10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600):
        if span / tick <= fits:
            ax.xaxis.set_major_locator(MultipleLocator(tick))
            break
    else:
        ax.xaxis.set_major_locator(MaxNLocator(8))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{int(x) // 60}:{int(x) % 60:02d}"))


def _value_axis(ax: Axes, unit: str, axis: str, values: Sequence[float]) -> None:
    """Label and tick one value axis in ``unit``: bytes scaled to KiB/MiB/GiB, percent as %."""
    target = ax.yaxis if axis == "y" else ax.xaxis
    label = UNIT_LABELS.get(unit, "")
    if unit == "percentunit":
        target.set_major_formatter(PercentFormatter(1.0, decimals=None))
    elif unit == "percent":
        target.set_major_formatter(PercentFormatter(100.0, decimals=None))
    elif unit == "bytes":
        finite = [abs(v) for v in values if math.isfinite(v)]
        scale, label = _binary(max(finite, default=0.0))
        # Round ticks in the scaled unit (0.25 GiB, not 0.268435456 GB): the limits are
        # set, so the ticks are chosen between them and the limits kept.
        low, high = ax.get_ylim() if axis == "y" else ax.get_xlim()
        steps = MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]).tick_values(
            low / scale, high / scale
        )
        target.set_major_locator(
            FixedLocator([t * scale for t in steps if low <= t * scale <= high])
        )
        target.set_major_formatter(FuncFormatter(lambda v, _: f"{v / scale:g}"))
    else:
        target.set_major_formatter(FuncFormatter(lambda v, _: _short(v)))
    if label:
        (ax.set_ylabel if axis == "y" else ax.set_xlabel)(label)


def _series_colors(panel: Mapping[str, Any], series: Sequence[Series]) -> list[str]:
    colors = []
    for i, one in enumerate(series):
        config = field_config(panel, one.name, one.ref_id)
        fixed = config.get("color", {})
        chosen = color(fixed.get("fixedColor")) if fixed.get("mode") == "fixed" else None
        colors.append(chosen or PALETTE[i % len(PALETTE)])
    return colors


def _draw_timeseries(
    ax: Axes, panel: Mapping[str, Any], series: Sequence[Series], rng: TimeRange, cell: Cell
) -> None:
    """Lines or bars over time, stacked where the panel stacks, thresholds dashed."""
    x = rng.offsets()
    defaults = field_config(panel, "")
    stacks: dict[str, np.ndarray] = {}
    shown: list[float] = []
    for one, tint in zip(series, _series_colors(panel, series), strict=True):
        custom = field_config(panel, one.name, one.ref_id).get("custom", {})
        y = np.where(np.isfinite(one.values), one.values, np.nan)  # Grafana skips +/-Inf
        alpha = float(custom.get("fillOpacity", 0)) / 100
        width = float(custom.get("lineWidth", 1)) * 1.3
        style = "--" if custom.get("lineStyle", {}).get("fill") == "dash" else "-"
        stacking = custom.get("stacking", {})
        if custom.get("drawStyle") == "bars":
            ax.bar(x, np.nan_to_num(y), width=rng.step * 0.9, color=tint, alpha=max(alpha, 0.6),
                   label=one.name)  # fmt: skip
        elif stacking.get("mode") == "normal":
            group = str(stacking.get("group", "A"))
            base = stacks.get(group, np.zeros_like(y))
            y = np.where(np.isnan(y), np.nan, base + np.nan_to_num(y))
            ax.fill_between(x, base, y, color=tint, alpha=alpha, linewidth=0)
            ax.plot(x, y, color=tint, linewidth=width, linestyle=style, label=one.name)
            stacks[group] = np.where(np.isnan(y), base, y)
        else:
            ax.plot(x, y, color=tint, linewidth=width, linestyle=style, label=one.name)
            if alpha > 0:
                ax.fill_between(x, 0, y, color=tint, alpha=alpha, linewidth=0)
        shown.extend(float(v) for v in y[~np.isnan(y)])
    _limits(ax, defaults, shown)
    thresholds = defaults.get("custom", {}).get("thresholdsStyle", {}).get("mode", "off")
    if thresholds != "off":
        for step in defaults.get("thresholds", {}).get("steps", []):
            if step.get("value") is not None:
                ax.axhline(step["value"], color=color(step.get("color")) or "#888888",
                           linestyle="--", linewidth=1.0, alpha=0.8)  # fmt: skip
    _time_axis(ax, rng, cell.axes_width_in)
    _value_axis(ax, defaults.get("unit", "short"), "y", shown)
    if panel.get("options", {}).get("legend", {}).get("showLegend", True):
        _legend(ax, cell)


def _limits(ax: Axes, config: Mapping[str, Any], shown: Sequence[float]) -> None:
    """The y range: the data's, widened to the soft limits, clamped to hard min/max."""
    custom = config.get("custom", {})
    low = min(shown, default=0.0)
    high = max(shown, default=1.0)
    if custom.get("axisSoftMin") is not None:
        low = min(low, custom["axisSoftMin"])
    if custom.get("axisSoftMax") is not None:
        high = max(high, custom["axisSoftMax"])
    if config.get("min") is not None:
        low = config["min"]
    if config.get("max") is not None:
        high = config["max"]
    if high <= low:
        high = low + 1.0
    pad = (high - low) * 0.05
    ax.set_ylim(low if low == 0 else low - pad, high + pad)


def _legend(ax: Axes, cell: Cell) -> None:
    """Grafana's bottom legend: under the x axis's labels, in the columns the cell fits."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    if len(handles) > cell.legend_limit:
        keep = cell.legend_limit - 1
        handles = [*handles[:keep], Rectangle((0, 0), 0, 0, visible=False)]
        labels = [*labels[:keep], f"… {len(labels) - keep} more series"]
    ax.legend(
        handles, labels, loc="upper left", bbox_to_anchor=(-0.01, -TICKS_IN / cell.axes_height_in),
        ncols=cell.legend_columns, frameon=False, handlelength=1.6, columnspacing=1.2,
        borderaxespad=0.0, borderpad=0.0, labelspacing=0.3,
    )  # fmt: skip


def _draw_state_timeline(
    ax: Axes, panel: Mapping[str, Any], series: Sequence[Series], rng: TimeRange, cell: Cell
) -> None:
    """One band per series, coloured by value (mappings, thresholds), mapped text on it.

    When the bands would be too thin for their labels, the series that never show a
    colour in the range (a decision never taken) are left out, and the panel says how
    many: Grafana would squeeze them all into unreadable rows.
    """
    rows = list(series)
    fits = max(1, int(cell.axes_height_in / (TICK_PT * 1.45 / 72)))
    if len(rows) > fits:
        rows = [one for one in series if _ever_drawn(panel, one)]
        hidden = len(series) - len(rows)
        if hidden:
            ax.text(1.0, 1.02, f"{hidden} series never set in this run not drawn",
                    transform=ax.transAxes, ha="right", va="bottom", fontsize=8.5,
                    color="#555555")  # fmt: skip
    x = rng.offsets()
    span = rng.end - rng.start
    chars_per_s = cell.axes_width_in * 72 / (9 * 0.62) / span
    for row, one in enumerate(rows):
        config = field_config(panel, one.name, one.ref_id)
        alpha = float(config.get("custom", {}).get("fillOpacity", 80)) / 100
        for start, end, value in _runs(one.values):
            left = x[start]
            right = x[end] + rng.step if end + 1 < len(x) else span
            tint = field_color(value, config, PALETTE[row % len(PALETTE)])
            if tint is None:
                continue
            ax.broken_barh([(left, right - left)], (row - 0.42, 0.84), facecolors=tint, alpha=alpha)
            hit = mapped(value, config)
            text = hit[0].strip() if hit else ""
            if text and (right - left) * chars_per_s > len(text) + 2:  # the text fits its band
                ax.text((left + right) / 2, row, text, ha="center", va="center", fontsize=9)
    ax.set_yticks(range(len(rows)), [one.name for one in rows])
    ax.set_ylim(max(len(rows), 1) - 0.5, -0.5)
    ax.grid(axis="y", visible=False)
    _time_axis(ax, rng, cell.axes_width_in)


def _ever_drawn(panel: Mapping[str, Any], one: Series) -> bool:
    """Whether any value of the series gets a colour (not "transparent")."""
    config = field_config(panel, one.name, one.ref_id)
    return any(field_color(value, config, "x") is not None for _, _, value in _runs(one.values))


def _runs(values: np.ndarray) -> Iterator[tuple[int, int, float]]:
    """(first index, last index, value) of each run of equal values; NaN runs left out."""
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or not _same(values[i], values[start]):
            if not math.isnan(values[start]):
                yield start, i - 1, float(values[start])
            start = i


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _draw_heatmap(
    ax: Axes, panel: Mapping[str, Any], series: Sequence[Series], rng: TimeRange, cell: Cell
) -> None:
    """Buckets (``le``) over time; cumulative bucket rates de-accumulated as Grafana does."""
    ordered = sorted(series, key=lambda s: float(s.labels.get("le", "inf")))
    cumulative = np.array([np.nan_to_num(s.values) for s in ordered])
    counts = np.diff(cumulative, axis=0, prepend=0.0)
    counts = np.ma.masked_less_equal(counts, 1e-9)  # the panel's filterValues: empty cells blank
    edges = np.append(rng.offsets(), rng.offsets()[-1] + rng.step)
    mesh = ax.pcolormesh(edges, np.arange(len(ordered) + 1), counts, cmap="Oranges", shading="flat")
    bounds = [s.labels.get("le", "?") for s in ordered]
    every = max(1, len(bounds) // 8)
    ax.set_yticks(np.arange(len(bounds))[::every] + 0.5, [_le(b) for b in bounds][::every])
    ax.set_ylabel("bucket upper bound (le)")
    ax.grid(visible=False)
    _time_axis(ax, rng, cell.axes_width_in)
    bar = ax.inset_axes((1.01, 0.0, 0.015, 1.0))
    scale = ax.figure.colorbar(mesh, cax=bar)
    unit = field_config(panel, "").get("unit", "short")
    scale.set_label(UNIT_LABELS.get(unit, unit), fontsize=8)
    scale.ax.tick_params(labelsize=8)


def _le(bound: str) -> str:
    """A bucket's upper bound as a short label: 2048 -> 2.05K, +Inf stays +Inf."""
    try:
        value = float(bound)
    except ValueError:
        return bound
    return "+Inf" if math.isinf(value) else _short(value).replace(" ", "")


def _draw_stat(
    ax: Axes, panel: Mapping[str, Any], series: Sequence[Series], _: TimeRange, cell: Cell
) -> None:
    """The last value of each series in big text, coloured as the panel colours it."""
    options = panel.get("options", {})
    mode = options.get("textMode", "auto")
    show_name = mode in ("name", "value_and_name") or (mode == "auto" and len(series) > 1)
    show_value = mode != "name"
    width_in, height_in = cell.width_in, cell.height_in - cell.title_in
    share = 0.5 if show_name and show_value else 0.75
    texts = [format_value(one.last(), field_config(panel, one.name, one.ref_id)) for one in series]
    shown = texts if show_value else [one.name for one in series]

    def size(across: int) -> float:
        down = math.ceil(len(series) / across)
        box = (width_in / across, height_in / down)
        return min(_fit(text, box, share) for text in shown)  # one size for all: they compare

    # Side by side or stacked, whichever lets the values be biggest.
    across = max(range(1, len(series) + 1), key=size)
    down = math.ceil(len(series) / across)
    big = size(across)
    ax.set_axis_off()
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    for i, (one, text) in enumerate(zip(series, shown, strict=True)):
        config = field_config(panel, one.name, one.ref_id)
        tint = field_color(one.last(), config, COLORS["text"]) or COLORS["text"]
        cx = (i % across + 0.5) / across
        cy = 1 - (i // across + 0.5) / down
        if options.get("colorMode") == "background":
            ax.add_patch(Rectangle((cx - 0.5 / across, cy - 0.5 / down), 1 / across, 1 / down,
                                   facecolor=tint, edgecolor="white", linewidth=2))  # fmt: skip
            tint = _ink(tint)
        if show_name and show_value:
            ax.text(cx, cy + 0.27 / down, one.name, ha="center", va="center",
                    fontsize=max(8.0, min(10.0, big * 0.55)), color=tint)  # fmt: skip
            ax.text(cx, cy - 0.1 / down, text, ha="center", va="center", fontsize=big,
                    color=tint, fontweight="bold")  # fmt: skip
        else:
            ax.text(cx, cy, text, ha="center", va="center", fontsize=big, color=tint,
                    fontweight="bold")  # fmt: skip


def _fit(text: str, cell: tuple[float, float], share: float) -> float:
    """The font size (pt) at which ``text`` fills its cell's width, or ``share`` of its height."""
    by_width = cell[0] * 72 * 0.85 / max(1, len(text)) / 0.6
    by_height = cell[1] * 72 * share * 0.55
    return max(8.0, min(30.0, by_width, by_height))


def _ink(background: str) -> str:
    """Black or white, whichever reads on ``background``."""
    r, g, b = matplotlib.colors.to_rgb(background)
    return "#111111" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def _draw_bargauge(
    ax: Axes, panel: Mapping[str, Any], series: Sequence[Series], _: TimeRange, cell: Cell
) -> None:
    """One horizontal bar per series at its last value, the value written at its end."""
    config = field_config(panel, "")
    values = [one.last() for one in series]
    finite = [v for v in values if math.isfinite(v)]
    top = max(finite, default=1.0) or 1.0
    cmap = matplotlib.colormaps["YlOrRd"]
    rows = range(len(series))
    ax.barh(rows, [v if math.isfinite(v) else 0 for v in values],
            color=[cmap(0.25 + 0.75 * (v / top if math.isfinite(v) else 0)) for v in values],
            height=0.7)  # fmt: skip
    for row, value in zip(rows, values, strict=True):
        ax.text(value if math.isfinite(value) else 0, row, " " + format_value(value, config),
                va="center", ha="left", fontsize=9)  # fmt: skip
    ax.set_yticks(list(rows), [one.name for one in series])
    ax.set_ylim(len(series) - 0.5, -0.5)
    ax.set_xlim(config.get("min", 0), top * 1.35)
    ax.grid(axis="y", visible=False)
    _value_axis(ax, config.get("unit", "short"), "x", finite)


def _draw_table(
    ax: Axes, panel: Mapping[str, Any], series: Sequence[Series], _: TimeRange, cell: Cell
) -> None:
    """The targets' instant values joined on their labels, organised and sorted as set.

    A table wider or longer than its panel (Grafana would scroll) loses its last
    columns or rows, and says how many.
    """
    columns, rows = table(panel, series)
    ax.set_axis_off()
    if not rows:
        return
    text: list[list[str]] = []
    colours: list[list[Any]] = []
    for row in rows:
        text.append([])
        colours.append([])
        for column in columns:
            value = row.get(column)
            config = field_config(panel, column)
            if isinstance(value, float):
                text[-1].append(format_value(value, config))
                filled = config.get("custom", {}).get("cellOptions", {}).get("type")
                tint = field_color(value, config, None) if filled == "color-background" else None
                colours[-1].append(_soft(tint) if tint else "white")
            else:
                text[-1].append("" if value is None else str(value))
                colours[-1].append("white")
    widths = [max(len(c), *(len(r[i]) for r in text)) + 2 for i, c in enumerate(columns)]
    size = TABLE_PT
    kept = len(columns)
    while kept > 1 and sum(widths[:kept]) * size * 0.62 / 72 > cell.axes_width_in:
        kept -= 1
    fits = max(1, int(cell.axes_height_in / (size * TABLE_ROW / 72)) - 1)  # less the header
    cut = []
    if kept < len(columns):
        cut.append(f"{len(columns) - kept} more columns")
    if len(text) > fits:
        cut.append(f"{len(text) - fits + 1} more rows")
        text, colours = text[: fits - 1], colours[: fits - 1]
    if cut:
        ax.text(1.0, 0.0, " and ".join(cut) + " not drawn", transform=ax.transAxes, ha="right",
                va="bottom", fontsize=8.5, color="#555555")  # fmt: skip
    drawn = ax.table(
        cellText=[r[:kept] for r in text], colLabels=columns[:kept],
        cellColours=[c[:kept] for c in colours], loc="upper left", cellLoc="left",
        colLoc="left",
    )  # fmt: skip
    drawn.auto_set_font_size(False)
    drawn.set_fontsize(size)
    drawn.auto_set_column_width(list(range(kept)))
    drawn.scale(1.0, 1.35)
    for (r, _c), box in drawn.get_celld().items():
        box.set_edgecolor("#dddddd")
        if r == 0:
            box.set_text_props(fontweight="bold")
            box.set_facecolor("#f0f0f0")


def table(
    panel: Mapping[str, Any], series: Sequence[Series]
) -> tuple[list[str], list[dict[str, Any]]]:
    """Grafana's table of instant queries: merged on shared labels, then ``organize``-d.

    Each target gives a value column ("Value", or "Value #<refId>" with several
    targets); rows with equal labels merge (Grafana's ``merge`` transformation).
    """
    refs = sorted({one.ref_id for one in series})
    merged: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for one in series:
        labels = {k: v for k, v in one.labels.items() if k != "__name__"}
        key = tuple(sorted(labels.items()))
        column = "Value" if len(refs) == 1 else f"Value #{one.ref_id}"
        merged.setdefault(key, dict(labels))[column] = one.last()
    columns: list[str] = []
    for row in merged.values():
        columns.extend(c for c in row if c not in columns)
    organize: dict[str, Any] = {}
    for step in panel.get("transformations", []):
        if step.get("id") == "organize":
            organize = step.get("options", {})
    excluded = {k for k, v in organize.get("excludeByName", {}).items() if v}
    renames = organize.get("renameByName", {})
    rows = [
        {renames.get(k, k): v for k, v in row.items() if k not in excluded}
        for row in merged.values()
    ]
    named = [renames.get(c, c) for c in columns if c not in excluded]
    order = organize.get("indexByName", {})
    position = {c: order.get(c, len(order) + i) for i, c in enumerate(named)}
    named.sort(key=position.__getitem__)
    for rule in reversed(panel.get("options", {}).get("sortBy", [])):
        key = rule.get("displayName")
        if key in named:
            rows.sort(key=_by(key), reverse=bool(rule.get("desc")))
    return named, rows


def _by(column: str) -> Callable[[Mapping[str, Any]], tuple[int, float, str]]:
    """A sort key on one column: numbers in order, after the rows without one."""
    return lambda row: _sort_key(row.get(column))


def _sort_key(value: Any) -> tuple[int, float, str]:  # noqa: ANN401 - a cell: number or text
    if isinstance(value, float) and not math.isnan(value):
        return (1, value, "")
    return (0, 0.0, str(value or ""))


def _soft(tint: str) -> tuple[float, float, float, float]:
    """A cell background: the colour, light enough for black text."""
    r, g, b = matplotlib.colors.to_rgb(tint)
    return (r, g, b, 0.55)


def _draw_unknown(
    ax: Axes, panel: Mapping[str, Any], series: Sequence[Series], _: TimeRange, __: Cell
) -> None:
    ax.set_axis_off()
    ax.text(0.5, 0.5, f"{panel.get('type')} panels are not drawn here ({len(series)} series)",
            transform=ax.transAxes, ha="center", va="center")  # fmt: skip


DRAW = {
    "timeseries": _draw_timeseries,
    "state-timeline": _draw_state_timeline,
    "status-history": _draw_state_timeline,
    "heatmap": _draw_heatmap,
    "stat": _draw_stat,
    "gauge": _draw_stat,
    "bargauge": _draw_bargauge,
    "table": _draw_table,
}


# ------------------------------------------------------------------ the command
def _seconds_arg(text: str) -> float:
    """``90``, ``90s``, ``15m`` or ``1h`` as seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"a duration such as 90s, 15m or 1h, got {text!r}")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def main(argv: Sequence[str] | None = None) -> int:
    """Draw the given dashboards (default: both of kvguard's) from ``--prometheus``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dashboards", nargs="*", type=Path, default=list(DASHBOARDS),
                        help="dashboard JSON files (default: kvguard-overview.json and"
                        " kvguard-fleet.json beside this script)")  # fmt: skip
    parser.add_argument("--prometheus", required=True, help="Prometheus base URL")
    parser.add_argument("--last", type=_seconds_arg, default=900.0, metavar="DURATION",
                        help="the range: this long up to --end (default 15m)")  # fmt: skip
    parser.add_argument("--end", type=float, default=None, metavar="UNIX_S",
                        help="the range's end (default: now)")  # fmt: skip
    parser.add_argument("--step", type=_seconds_arg, default=None, metavar="DURATION",
                        help="seconds between samples (default: the range / 600,"
                        " at least the scrape interval)")  # fmt: skip
    parser.add_argument("--scrape-interval", type=_seconds_arg, default=15.0,
                        metavar="DURATION", help="Prometheus's scrape interval, for"
                        " $__rate_interval as Grafana computes it (default 15s)")  # fmt: skip
    parser.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                        help="set a dashboard variable (job, instance); repeatable")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("dashboard-pictures"),
                        help="directory for the PNGs (default ./dashboard-pictures)")  # fmt: skip
    args = parser.parse_args(argv)
    if any("=" not in item for item in args.var):
        parser.error("--var takes NAME=VALUE")
    given = dict(item.split("=", 1) for item in args.var)
    end = args.end if args.end is not None else time.time()
    step = args.step or max(args.scrape_interval, args.last / 600)
    rng = TimeRange(end - args.last, end, step)
    source = Prometheus(args.prometheus)
    for path in args.dashboards:
        dashboard = json.loads(path.read_text(encoding="utf-8"))
        pictures = render_dashboard(
            dashboard, dashboard_name(path), source, rng,
            scrape_interval_s=args.scrape_interval, variables=given,
        )  # fmt: skip
        for written in save(pictures, args.out):
            sys.stdout.write(f"{written}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
