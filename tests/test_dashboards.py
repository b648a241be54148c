"""The Grafana dashboards follow the pack's conventions and every query parses in Prometheus.

Conventions (docs/monitoring.md): the datasource is the ``${datasource}`` variable; the
``job`` and ``instance`` variables filter every selector, on labels the series really
carry (the ones Prometheus attaches to every scraped series, or kvguard's own); every
panel has a title, a description and a unit; counters appear only inside ``rate()`` / ``increase()``
/ ``irate()`` over ``$__rate_interval``; every ``kvguard_*`` name is in docs/metrics.md.
The parse check sends each expression, Grafana variables substituted, to a real
Prometheus on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvguard.api.telemetry import REJECT_REASONS, daemon_registry
from kvguard.config.settings import parse_config
from kvguard.runtime.daemon import Daemon
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "dashboards" / "grafana"
DASHBOARDS = {
    "overview": GRAFANA / "kvguard-overview.json",
    "fleet": GRAFANA / "kvguard-fleet.json",
}
UIDS = {"overview": "kvguard-overview", "fleet": "kvguard-fleet"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
PROMETHEUS = shutil.which("prometheus")

METRIC = re.compile(r"(?<![\w.\"])(kvguard_[a-z0-9_]+|up)(?![\w(])(\{[^}]*\})?")
COUNTER = re.compile(r"_(total|bucket|count|sum)$")
RANGE = re.compile(r"\[([^\]]*)\]")
LABEL_VALUES = re.compile(r"^label_values\((?:(.*),\s*)?(\w+)\)$")
GRAFANA_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"")
# The target labels Prometheus attaches to every series it scrapes (its own `up` too).
# A dashboard filter must be one of these: a label set only by hand in some scrape
# configs (an "engine" target label) is on no series of a default install.
SCRAPE_LABELS = frozenset({"job", "instance"})
# Values Grafana would substitute; $job/$instance become "match anything".
SUBSTITUTES = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
    "__range_s": "3600",
    "job": ".*",
    "instance": ".*",
}


def load(name: str) -> dict[str, Any]:
    """One dashboard's JSON model."""
    return json.loads(DASHBOARDS[name].read_text(encoding="utf-8"))


def panels_of(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows and the panels nested in collapsed rows included."""
    for panel in panels:
        yield panel
        yield from panels_of(panel.get("panels", []))


def visible_panels(name: str) -> list[dict[str, Any]]:
    """Every panel that shows data (rows excluded)."""
    return [p for p in panels_of(load(name)["panels"]) if p["type"] != "row"]


def panel_queries(name: str) -> list[tuple[str, str]]:
    """(where, expr) of every panel target and annotation: the filtered queries."""
    model = load(name)
    out = [
        (f"{name}: {panel['title']} / {target['refId']}", target["expr"])
        for panel in visible_panels(name)
        for target in panel["targets"]
    ]
    out += [
        (f"{name}: annotation {a['name']}", a["expr"])
        for a in model["annotations"]["list"]
        if "expr" in a
    ]
    return out


def variable_queries(name: str) -> list[tuple[str, str]]:
    """(where, selector) of every ``label_values(selector, label)`` variable."""
    out = []
    for variable in load(name)["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = LABEL_VALUES.match(variable["query"])
        assert match, f"{name}: variable {variable['name']}: not label_values(selector, label)"
        out.append((f"{name}: variable {variable['name']}", match.group(1) or "up"))
    return out


def all_queries() -> list[tuple[str, str]]:
    """Every PromQL expression of both dashboards."""
    return [q for name in DASHBOARDS for q in panel_queries(name) + variable_queries(name)]


def documented_metrics() -> dict[str, str]:
    """``{name: type}`` from the tables of docs/metrics.md."""
    text = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(kvguard_[a-z0-9_]+)` \| ([^|]+?) \|", text, flags=re.MULTILINE)
    return dict(rows)


def exported_labels() -> dict[str, frozenset[str]]:
    """``{sample name: its label names}`` of what a fresh kvguard's /metrics really serves.

    A daemon that has not ticked yet: enough for the series the variables read
    (kvguard_build_info), which are there from the start.
    """
    daemon = Daemon(parse_config({"engine": {"url": "http://127.0.0.1:9"}}, env={}))
    labels: dict[str, set[str]] = {}
    for family in daemon_registry(daemon).collect():
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(names) for name, names in labels.items()}


def substituted(expr: str) -> str:
    """``expr`` with Grafana's variables replaced as Grafana would (see SUBSTITUTES)."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in SUBSTITUTES, f"unknown Grafana variable ${name} in {expr}"
        return SUBSTITUTES[name]

    return GRAFANA_VARIABLE.sub(value, expr)


@pytest.mark.parametrize("name", DASHBOARDS)
def test_dashboard_is_a_grafana_10_model_with_a_stable_uid(name):
    """Valid JSON, the fixed uid, schemaVersion 38+, unique panel ids, panels inside 24 columns."""
    model = load(name)
    assert model["uid"] == UIDS[name]
    assert model["schemaVersion"] >= 38
    assert model["title"].startswith("kvguard")
    ids = [p["id"] for p in panels_of(model["panels"])]
    assert len(ids) == len(set(ids))
    for panel in panels_of(model["panels"]):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]


@pytest.mark.parametrize("name", DASHBOARDS)
def test_every_panel_has_a_title_a_description_and_a_unit(name):
    """Rows have a title; every other panel, nested ones too, a title, description and unit."""
    for panel in panels_of(load(name)["panels"]):
        assert panel.get("title"), panel
        if panel["type"] == "row":
            continue
        assert panel.get("description"), panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        assert panel["targets"], panel["title"]


@pytest.mark.parametrize("name", DASHBOARDS)
def test_every_panel_target_and_annotation_queries_the_datasource_variable(name):
    """No hard-coded data source anywhere: a user's Prometheus is picked by ${datasource}."""
    model = load(name)
    for panel in visible_panels(name):
        assert panel["datasource"] == DATASOURCE, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
    for annotation in model["annotations"]["list"]:
        assert annotation["datasource"] == DATASOURCE, annotation["name"]
    for variable in model["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE, variable["name"]


@pytest.mark.parametrize("name", DASHBOARDS)
def test_datasource_job_and_instance_variables_exist(name):
    """The variables the conventions name, and no others."""
    variables = {v["name"]: v for v in load(name)["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "instance"]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for var in ("job", "instance"):
        assert variables[var]["type"] == "query"
        assert variables[var]["description"]
    # job's 'All' lists the values, so up{job=~"$job"} never matches other jobs.
    assert variables["job"]["allValue"] is None


@pytest.mark.parametrize("name", DASHBOARDS)
def test_every_variable_reads_a_label_the_series_really_carry(name):
    """``label_values(selector, label)``: the series kvguard exports, on a label it has.

    The label (and every label the selector matches on) is one Prometheus attaches to
    every scraped series, or one kvguard's /metrics serves on that series; a variable
    on a label nobody sets offers nothing to pick.
    """
    exported = exported_labels()
    for variable in load(name)["templating"]["list"]:
        if variable["type"] != "query":
            continue
        where = f"{name}: variable {variable['name']}"
        match = LABEL_VALUES.match(variable["query"])
        assert match, f"{where}: not label_values(selector, label)"
        assert match.group(1), f"{where}: label_values without a selector reads every series"
        selector, label = match.group(1), match.group(2)
        ((metric, matchers),) = METRIC.findall(selector)
        assert metric in exported, f"{where}: kvguard serves no {metric}"
        real = SCRAPE_LABELS | exported[metric]
        assert label in real, f"{where}: {metric} has no label {label!r}; it has {sorted(real)}"
        for matched in MATCHER.findall(matchers):
            assert matched in real, f"{where}: {metric} has no label {matched!r}"


@pytest.mark.parametrize("name", DASHBOARDS)
def test_every_selector_is_filtered_by_job_and_instance(name):
    """Each metric selector in a panel or annotation carries the two variable filters.

    A filter by variable is on a scrape label, the only labels every family has: a
    filter on any other label would need that label on every series it is applied to.
    """
    for where, expr in panel_queries(name):
        selectors = METRIC.findall(expr)
        assert selectors, f"{where}: no metric in {expr}"
        for metric, matchers in selectors:
            for label in SCRAPE_LABELS:
                assert f'{label}=~"${label}"' in matchers, f"{where}: {metric} lacks {label}"
            filtered = set(re.findall(r'(\w+)\s*=~\s*"\$', matchers))
            assert filtered <= SCRAPE_LABELS, f"{where}: {metric} filtered on {filtered}"


@pytest.mark.parametrize("name", DASHBOARDS)
def test_counters_appear_only_in_rate_or_increase_over_the_rate_interval(name):
    """A counter (``_total``, ``_bucket``, ``_count``, ``_sum``) is never graphed raw."""
    for where, expr in panel_queries(name):
        for match in METRIC.finditer(expr):
            if not COUNTER.search(match.group(1)):
                continue
            before, after = expr[: match.start()], expr[match.end() :]
            assert re.search(r"\b(rate|increase|irate)\(\s*$", before), f"{where}: {expr}"
            assert after.startswith("[$__rate_interval])"), f"{where}: {expr}"
        for window in RANGE.findall(expr):
            assert window == "$__rate_interval", f"{where}: range [{window}] in {expr}"


@pytest.mark.parametrize("name", DASHBOARDS)
def test_every_metric_is_documented_in_metrics_md(name):
    """Names as docs/metrics.md gives them: counters with _total, histograms by base name."""
    documented = documented_metrics()
    assert len(documented) > 40
    for where, expr in panel_queries(name) + variable_queries(name):
        for metric, _ in METRIC.findall(expr):
            if metric == "up" or metric in documented:
                continue
            base = re.sub(r"_(bucket|count|sum)$", "", metric)
            assert documented.get(base) == "histogram", f"{where}: {metric} not in metrics.md"


def test_the_overview_shows_every_documented_metric():
    """Adding a metric to docs/metrics.md without a panel fails here (or list it below)."""
    shown = {
        re.sub(r"_(bucket|count|sum)$", "", metric)
        for _, expr in panel_queries("overview")
        for metric, _ in METRIC.findall(expr)
    }
    not_graphed = {
        "kvguard_gpu_memory_free_bytes",  # total - used - reserved: shown by those
        # Deprecated names, exported one more release; the panels use their successors.
        "kvguard_waiting_requests",
        "kvguard_engine_process_cpu_ratio",
    }
    missing = set(documented_metrics()) - shown - not_graphed
    assert not missing


def test_the_json_is_what_the_generator_writes():
    """Edits go through dashboards/grafana/*.py; the committed JSON matches their output."""
    result = subprocess.run(
        [sys.executable, str(GRAFANA / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_provisioning_points_grafana_at_prometheus_and_the_dashboard_folder():
    """The datasource's uid is the dashboards' default; the provider reads JSON from a path."""
    datasources = (GRAFANA / "provisioning" / "datasources" / "kvguard.yml").read_text()
    providers = (GRAFANA / "provisioning" / "dashboards" / "kvguard.yml").read_text()
    assert re.search(r"^apiVersion: 1$", datasources, flags=re.MULTILINE)
    assert re.search(r"^\s+type: prometheus$", datasources, flags=re.MULTILINE)
    uid = re.search(r"^\s+uid: (\S+)$", datasources, flags=re.MULTILINE)
    assert uid
    for name in DASHBOARDS:
        variables = {v["name"]: v for v in load(name)["templating"]["list"]}
        assert variables["datasource"]["current"]["value"] == uid.group(1)
    assert re.search(r"^apiVersion: 1$", providers, flags=re.MULTILINE)
    assert re.search(r"^\s+type: file$", providers, flags=re.MULTILINE)
    assert re.search(r"^\s+path: /\S+$", providers, flags=re.MULTILINE)


def get_json(port: int, path: str) -> tuple[int, dict[str, Any]]:
    """GET ``path`` from Prometheus on 127.0.0.1:``port``: status and JSON body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    return resp.status, (json.loads(body) if body.startswith(b"{") else {})


@pytest.fixture(scope="module")
def prometheus_port(tmp_path_factory):
    """A Prometheus on 127.0.0.1 with an empty TSDB: enough to parse and evaluate queries."""
    if PROMETHEUS is None:
        pytest.skip(
            "prometheus not installed, so the dashboards' PromQL was not checked: run "
            "scripts/install-system.sh (Debian package prometheus)"
        )
    tmp = tmp_path_factory.mktemp("prometheus")
    config = tmp / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\nscrape_configs: []\n")
    port = free_port()
    with (tmp / "prometheus.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and proc.poll() is None:
                with contextlib.suppress(OSError):
                    if get_json(port, "/-/ready")[0] == 200:
                        break
                time.sleep(0.1)
            else:
                pytest.fail(f"Prometheus did not start: {(tmp / 'prometheus.log').read_text()}")
            yield port
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.prometheus
@pytest.mark.parametrize(("where", "expr"), all_queries(), ids=[w for w, _ in all_queries()])
def test_every_expression_parses_in_prometheus(prometheus_port, where, expr):
    """Prometheus accepts the query (a 400 with errorType bad_data would mean it does not parse)."""
    promql = substituted(expr)
    assert "$" not in promql
    status, body = get_json(
        prometheus_port, "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    )
    assert status == 200, f"{where}: {body.get('errorType')}: {body.get('error')}\n{promql}"
    assert body["status"] == "success"


def test_rejected_reasons_are_the_proxys_and_are_documented():
    """kvguard_requests_rejected_total's reasons: each one the proxy counts, each in metrics.md."""
    proxy = "\n".join(  # the package's modules: screen, admit, ...
        path.read_text(encoding="utf-8")
        for path in sorted((ROOT / "kvguard" / "actuators" / "proxy").glob("*.py"))
    )
    counted = set(re.findall(r'rejected\["([a-z_]+)"\]', proxy))  # counted where refused
    # Refused while reading the body (408, 413, 503): counted by status code in
    # kvguard_proxy_errors_total, not as rejections.
    body_refusals = set(re.findall(r'BodyRefused\(\s*\d{3},\s+"([a-z_]+)"', proxy))
    assert body_refusals, "the body reader's refusals not found: update this test's pattern"
    screened = (
        set(re.findall(r'\b4\d\d,\s+"([a-z_]+)"', proxy)) - body_refusals
    )  # screen_request's (status, reason)
    assert screened, "screen_request's refusals not found: update this test's pattern"
    assert set(REJECT_REASONS) == counted | screened
    text = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if "`kvguard_requests_rejected_total`" in line)
    assert all(f"`{reason}`" in row for reason in REJECT_REASONS)
    assert "window cap |" not in row  # the old, narrower meaning
