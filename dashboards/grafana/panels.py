"""Builders for Grafana 10 panels, targets and variables (used by generate.py).

Every panel and target queries the ``${datasource}`` variable; every selector carries
the dashboard's ``job`` and ``instance`` filters (:func:`sel`); counters go
through :func:`rate` / :func:`increase` over ``$__rate_interval``. Grafana fills in
every option left out here with its default, which keeps the JSON short.
"""

from __future__ import annotations

from typing import Any

Json = dict[str, Any]

DATASOURCE: Json = {"type": "prometheus", "uid": "${datasource}"}
# Only labels Prometheus attaches to every scraped series: kvguard's own series carry
# no label naming the engine (one sidecar per engine, so an instance is an engine).
FILTERS = 'job=~"$job", instance=~"$instance"'
RATE_WINDOW = "[$__rate_interval]"
TTE_CAP_S = 600  # time-to-exhaustion graphs draw "not rising" (+Inf) at this cap

LEVELS = (("ok", "green"), ("elevated", "yellow"), ("high", "orange"), ("critical", "red"))
LEVEL_MAPPINGS: list[Json] = [
    {
        "type": "value",
        "options": {
            str(i): {"text": name, "color": color, "index": i}
            for i, (name, color) in enumerate(LEVELS)
        },
    }
]
LEVEL_THRESHOLDS = ("green", None), ("yellow", 1), ("orange", 2), ("red", 3)
# kvguard exports +Inf when the series is not rising; Grafana looks a value mapping up by
# the number's string, so "Infinity" matches it (a range mapping cannot: Inf > any "to").
NOT_RISING_MAPPING: Json = {
    "type": "value",
    "options": {"Infinity": {"text": "not rising", "color": "green", "index": 0}},
}


def sel(name: str, extra: str = "") -> str:
    """``name`` with the dashboard's filters (and the ``extra`` matchers)."""
    matchers = f"{FILTERS}, {extra}" if extra else FILTERS
    return f"{name}{{{matchers}}}"


def rate(name: str, extra: str = "") -> str:
    """Per-second rate of a counter over ``$__rate_interval``."""
    return f"rate({sel(name, extra)}{RATE_WINDOW})"


def increase(name: str, extra: str = "") -> str:
    """Increase of a counter over ``$__rate_interval``."""
    return f"increase({sel(name, extra)}{RATE_WINDOW})"


def target(expr: str, legend: str = "", *, instant: bool = False, fmt: str = "") -> Json:
    """One Prometheus query; ``fmt`` is ``table`` or ``heatmap`` (default: time series)."""
    out: Json = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend or "__auto"}
    if fmt:
        out["format"] = fmt
    if instant:
        out["instant"] = True
        out["range"] = False
    else:
        out["range"] = True
    return out


def thresholds(*steps: tuple[str, float | None]) -> Json:
    """Absolute thresholds: the first step's value is None (the base colour)."""
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in steps]}


def by_name(name: str, **properties: object) -> Json:
    """A field override matching a display name."""
    return {
        "matcher": {"id": "byName", "options": name},
        "properties": [{"id": k.replace("__", "."), "value": v} for k, v in properties.items()],
    }


def by_query(ref_id: str, **properties: object) -> Json:
    """A field override matching every series of one query (refId A, B, ...)."""
    return {
        "matcher": {"id": "byFrameRefID", "options": ref_id},
        "properties": [{"id": k.replace("__", "."), "value": v} for k, v in properties.items()],
    }


def _panel(kind: str, title: str, description: str, unit: str, targets: list[Json]) -> Json:
    for ref_id, tgt in zip("ABCDEFGHIJ", targets, strict=False):
        tgt["refId"] = ref_id
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
        "gridPos": {"h": 8, "w": 12, "x": 0, "y": 0},
    }


def sized(panel: Json, w: int, h: int) -> Json:
    """Set a panel's width (of 24) and height; :func:`layout` sets its position."""
    panel["gridPos"].update(w=w, h=h)
    return panel


def timeseries(
    title: str,
    description: str,
    unit: str,
    targets: list[Json],
    *,
    stack: bool = False,
    bars: bool = False,
    lines_at: tuple[tuple[str, float | None], ...] = (),
    overrides: list[Json] | None = None,
    soft_max: float | None = None,
) -> Json:
    """A time series; ``lines_at`` draws thresholds as dashed lines."""
    panel = _panel("timeseries", title, description, unit, targets)
    custom: Json = {
        "drawStyle": "bars" if bars else "line",
        "fillOpacity": 60 if stack or bars else 10,
        "lineWidth": 1,
        "showPoints": "never",
        "spanNulls": False,
        "axisSoftMin": 0,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        "thresholdsStyle": {"mode": "dashed" if lines_at else "off"},
    }
    defaults = panel["fieldConfig"]["defaults"]
    defaults.update(custom=custom, color={"mode": "palette-classic"})
    if soft_max is not None:
        custom["axisSoftMax"] = soft_max
    if lines_at:
        defaults["thresholds"] = thresholds(*lines_at)
    panel["fieldConfig"]["overrides"] = overrides or []
    panel["options"] = {
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return panel


def stat(
    title: str,
    description: str,
    unit: str,
    targets: list[Json],
    *,
    steps: tuple[tuple[str, float | None], ...] = (("green", None),),
    mappings: list[Json] | None = None,
    text_mode: str = "auto",
    overrides: list[Json] | None = None,
) -> Json:
    """A single value (the last one), coloured by ``steps``."""
    panel = _panel("stat", title, description, unit, targets)
    panel["fieldConfig"]["defaults"].update(
        thresholds=thresholds(*steps),
        mappings=mappings or [],
        color={"mode": "thresholds"},
    )
    panel["fieldConfig"]["overrides"] = overrides or []
    panel["options"] = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "colorMode": "background" if mappings else "value",
        "graphMode": "none",
        "textMode": text_mode,
        "justifyMode": "auto",
        "orientation": "auto",
    }
    return panel


def state_timeline(
    title: str,
    description: str,
    targets: list[Json],
    *,
    mappings: list[Json],
    steps: tuple[tuple[str, float | None], ...],
) -> Json:
    """States over time, one row per series; values shown through ``mappings``."""
    panel = _panel("state-timeline", title, description, "none", targets)
    panel["fieldConfig"]["defaults"].update(
        mappings=mappings,
        thresholds=thresholds(*steps),
        color={"mode": "thresholds"},
        custom={"fillOpacity": 80, "lineWidth": 0},
    )
    panel["options"] = {
        "mergeValues": True,
        "showValue": "auto",
        "alignValue": "left",
        "rowHeight": 0.9,
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False},
        "tooltip": {"mode": "single", "sort": "none"},
    }
    return panel


def heatmap(title: str, description: str, y_unit: str, expr: str) -> Json:
    """A heatmap of a Prometheus histogram's bucket rates (one column per step)."""
    panel = _panel("heatmap", title, description, "reqps", [target(expr, "{{le}}", fmt="heatmap")])
    panel["options"] = {
        "calculate": False,
        "cellGap": 1,
        "cellValues": {"unit": "reqps"},
        "color": {
            "mode": "scheme",
            "scheme": "Oranges",
            "scale": "exponential",
            "exponent": 0.5,
            "steps": 64,
            "fill": "dark-orange",
            "reverse": False,
        },
        "filterValues": {"le": 1e-9},
        "legend": {"show": True},
        "rowsFrame": {"layout": "auto"},
        "tooltip": {"show": True, "yHistogram": False},
        "yAxis": {"axisPlacement": "left", "reverse": False, "unit": y_unit},
    }
    return panel


def table(
    title: str,
    description: str,
    unit: str,
    targets: list[Json],
    *,
    columns: dict[str, str],
    sort_by: str,
    descending: bool,
    overrides: list[Json] | None = None,
) -> Json:
    """Instant queries as one table, one row per instance (``merge`` joins the queries).

    ``columns`` renames the value columns (``Value`` for one query, ``Value #A``... for
    several) and fixes their order after ``job`` and ``instance``.
    """
    panel = _panel("table", title, description, unit, targets)
    for tgt in targets:
        tgt.update(format="table", instant=True, range=False)
    order = {"instance": 0, "job": 1} | {new: i + 2 for i, new in enumerate(columns.values())}
    panel["transformations"] = [
        {"id": "merge", "options": {}},
        {
            "id": "organize",
            "options": {
                "excludeByName": {"Time": True},
                "renameByName": columns,
                "indexByName": order,
            },
        },
    ]
    panel["fieldConfig"]["defaults"]["custom"] = {"align": "auto", "cellOptions": {"type": "auto"}}
    panel["fieldConfig"]["overrides"] = [instance_link(), *(overrides or [])]
    panel["options"] = {
        "showHeader": True,
        "cellHeight": "sm",
        "sortBy": [{"displayName": sort_by, "desc": descending}],
        "footer": {"show": False, "reducer": ["sum"], "fields": ""},
    }
    return panel


def bargauge(title: str, description: str, unit: str, targets: list[Json]) -> Json:
    """Horizontal bars, one per series (instant queries: the latest value)."""
    panel = _panel("bargauge", title, description, unit, targets)
    panel["fieldConfig"]["defaults"].update(
        color={"mode": "continuous-YlRd"}, thresholds=thresholds(("green", None)), min=0
    )
    panel["options"] = {
        "displayMode": "gradient",
        "orientation": "horizontal",
        "showUnfilled": True,
        "valueMode": "color",
        "namePlacement": "auto",
        "minVizHeight": 10,
        "minVizWidth": 0,
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
    }
    return panel


def instance_link() -> Json:
    """Link a table's ``instance`` cells to that instance's overview dashboard."""
    url = (
        "/d/kvguard-overview/kvguard-overview?var-instance=${__data.fields.instance}"
        "&var-job=${__data.fields.job}&${datasource:queryparam}&${__url_time_range}"
    )
    return by_name(
        "instance", links=[{"title": "kvguard overview of ${__data.fields.instance}", "url": url}]
    )


def row(title: str) -> Json:
    """A row header (expanded: its panels follow it in the dashboard's panel list)."""
    return {
        "type": "row",
        "title": title,
        "collapsed": False,
        "panels": [],
        "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0},
    }


def layout(sections: list[tuple[str, list[Json]]]) -> list[Json]:
    """Rows and their panels, flowed left to right and wrapped at 24 columns; ids set."""
    out: list[Json] = []
    y = 0
    for title, panels in sections:
        header = row(title)
        header["gridPos"]["y"] = y
        out.append(header)
        y += 1
        x, line_h = 0, 0
        for panel in panels:
            pos = panel["gridPos"]
            if x + pos["w"] > 24:
                x, y, line_h = 0, y + line_h, 0
            pos.update(x=x, y=y)
            x += pos["w"]
            line_h = max(line_h, pos["h"])
            out.append(panel)
        y += line_h
    for number, panel in enumerate(out, start=1):
        panel["id"] = number
    return out


def datasource_variable() -> Json:
    """The Prometheus data source every panel queries."""
    return {
        "type": "datasource",
        "name": "datasource",
        "label": "Data source",
        "description": "The Prometheus that scrapes kvguard (provisioned as kvguard-prometheus).",
        "query": "prometheus",
        "current": {"text": "Prometheus (kvguard)", "value": "kvguard-prometheus"},
        "regex": "",
        "hide": 0,
        "refresh": 1,
        "options": [],
    }


def query_variable(
    name: str,
    label: str,
    description: str,
    query: str,
    *,
    multi: bool = True,
) -> Json:
    """A variable filled from label values (``label_values(selector, label)``)."""
    return {
        "type": "query",
        "name": name,
        "label": label,
        "description": description,
        "datasource": DATASOURCE,
        "definition": query,
        "query": query,
        "refresh": 2,
        "multi": multi,
        "includeAll": multi,
        # 'All' lists the values found, never .*: up{job=~"$job"} stays on kvguard's jobs.
        "allValue": None,
        "current": {},
        "options": [],
        "regex": "",
        "sort": 1,
        "hide": 0,
    }


def variables(*, multi_instance: bool) -> list[Json]:
    """datasource, job, instance: each narrows the next.

    Both read labels every kvguard series has once scraped (``job`` and ``instance``);
    a variable on a label kvguard does not export would offer nothing to pick.
    """
    return [
        datasource_variable(),
        query_variable(
            "job",
            "Job",
            "Prometheus jobs scraping kvguard (those with kvguard_build_info). 'All' lists "
            "the values, so up{} panels never match other jobs. To tell engine kinds "
            "apart, scrape each under its own kvguard-* job (see docs/monitoring.md).",
            "label_values(kvguard_build_info, job)",
        ),
        query_variable(
            "instance",
            "Instance",
            "kvguard sidecars (host:port of their /metrics)"
            + ("." if multi_instance else "; one at a time here, many in kvguard / Fleet."),
            'label_values(kvguard_build_info{job=~"$job"}, instance)',
            multi=multi_instance,
        ),
    ]


def decisions_annotation(extra_labels: tuple[str, ...]) -> Json:
    """Mitigation decisions as annotations: one mark per action and mode when decided."""
    labels = ", ".join((*extra_labels, "action", "mode"))
    return {
        "name": "Mitigations",
        "enable": True,
        "hide": False,
        "iconColor": "orange",
        "datasource": DATASOURCE,
        "expr": f"sum by ({labels}) ({increase('kvguard_decisions_total')}) > 0",
        "step": "",
        "titleFormat": "{{action}}",
        "textFormat": "kvguard decided {{action}} ({{mode}})",
        "tagKeys": labels.replace(" ", ""),
        "useValueForTime": False,
    }


def level_change_annotation() -> Json:
    """Pressure level changes as annotations, titled with the new level."""
    changed = f"changes({sel('kvguard_pressure_level')}{RATE_WINDOW}) > 0"
    return {
        "name": "Pressure level changes",
        "enable": True,
        "hide": False,
        "iconColor": "red",
        "datasource": DATASOURCE,
        "expr": f"{sel('kvguard_pressure_state')} == 1 and ignoring(state) {changed}",
        "step": "",
        "titleFormat": "pressure {{state}}",
        "textFormat": "kvguard's pressure level is now {{state}}",
        "tagKeys": "state",
        "useValueForTime": False,
    }


def dashboard(
    uid: str,
    title: str,
    *,
    description: str,
    panels: list[Json],
    templating: list[Json],
    annotations: list[Json],
) -> Json:
    """A Grafana 10 dashboard model (schemaVersion 39)."""
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["kvguard", "llm", "kv-cache"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "schemaVersion": 39,
        "version": 1,
        "links": [
            {
                "title": "kvguard dashboards",
                "type": "dashboards",
                "tags": ["kvguard"],
                "asDropdown": False,
                "includeVars": True,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "annotations": {"list": annotations},
        "templating": {"list": templating},
        "panels": panels,
    }
