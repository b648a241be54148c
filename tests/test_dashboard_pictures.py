"""Pictures of the dashboards: every row drawn, every panel in it, and the docs show them.

dashboards/grafana/render.py draws a dashboard JSON from Prometheus: one figure per
row, one axes per panel. Its unit tests ask a stub Prometheus on 127.0.0.1 (made-up
series, and nothing for a few metrics); one test asks a real Prometheus scraping a
live kvguard (it skips, saying why, without ``prometheus``). The docs tests check that
docs/monitoring.md shows the picture of every row under that row's section, that the
pictures (made by dashboards/grafana/pictures.py) exist, are modest PNGs and show the
dashboards' current rows and panels, and that the page says how they were made.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import re
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.text import Text
from matplotlib.transforms import Bbox
from PIL import Image

from kvguard.config.settings import parse_config
from kvguard.runtime.daemon import Daemon
from tests.test_prometheus import prometheus  # noqa: F401 - the fixture: a real Prometheus
from tests.test_run import start_api

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "dashboards" / "grafana"
DOC = ROOT / "docs" / "monitoring.md"
IMAGES = ROOT / "docs" / "images" / "dashboards"
RECORD = IMAGES / "pictures.json"
REGENERATE = "regenerate them: .venv/bin/python dashboards/grafana/pictures.py"
MAX_PNG_BYTES = 250_000
MIN_FONT_PT = 8.0
# The docs' section of each dashboard.
SECTIONS = {"overview": "## 4. kvguard / Overview", "fleet": "## 5. kvguard / Fleet"}
# Metrics the stub answers nothing for: panels querying only these must say so.
EMPTY = ("kvguard_engine_kv_cache_usage_ratio", "kvguard_webhook_deliveries_total",
         "kvguard_requests_shed_total")  # fmt: skip
LABELS = ("component", "gpu", "pid", "horizon", "resource", "dp_rank", "pattern", "action",
          "mode", "priority", "reason", "result", "code", "dtype", "probe", "state",
          "version")  # fmt: skip
INSTANCES = ["10.0.0.1:9108", "10.0.0.2:9108"]


def _load(name: str) -> ModuleType:
    """A module of dashboards/grafana/ (a script directory, not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"dashboards_grafana_{name}", GRAFANA / f"{name}.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


render = _load("render")
DASHBOARDS = {render.dashboard_name(path): path for path in render.DASHBOARDS}


def load(name: str) -> dict[str, Any]:
    """One dashboard's JSON model."""
    return json.loads(DASHBOARDS[name].read_text(encoding="utf-8"))


# ------------------------------------------------------------------ a stub Prometheus
class Stub:
    """Prometheus's query_range and label values on 127.0.0.1: made-up series, or none."""

    def __init__(self) -> None:
        self.queries: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                params = urllib.parse.parse_qs(url.query)
                if url.path == "/api/v1/query_range":
                    data: Any = {"resultType": "matrix", "result": stub.matrix(params)}
                elif url.path.startswith("/api/v1/label/"):
                    data = INSTANCES
                else:
                    self.send_error(404)
                    return
                body = json.dumps({"status": "success", "data": data}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def matrix(self, params: dict[str, list[str]]) -> list[dict[str, Any]]:
        """Two series per query (three buckets each for histograms), none for EMPTY."""
        expr = params["query"][0]
        self.queries.append(expr)
        if any(name in expr for name in EMPTY):
            return []
        start, end, step = (float(params[key][0]) for key in ("start", "end", "step"))
        times = [start + i * step for i in range(int((end - start) / step) + 1)]
        name = (re.findall(r"kvguard_\w+|\bup\b", expr) or ["value"])[0]
        bounds = ("10", "100", "+Inf") if "_bucket" in expr else (None,)
        # An aggregation keeps only its "by" labels, as Prometheus's would.
        kept = re.search(r"\bby \(([^)]*)\)", expr)
        result = []
        for i, (b, le) in enumerate(itertools.product(range(2), bounds)):
            labels = {label: f"{label}-{b}" for label in LABELS}
            labels |= {"__name__": name, "job": "kvguard", "instance": INSTANCES[b]}
            if le is not None:
                labels["le"] = le
            if kept is not None:
                wanted = {label.strip() for label in kept.group(1).split(",")}
                labels = {k: v for k, v in labels.items() if k in wanted}
            values = [[t, str((k + i) % 4)] for k, t in enumerate(times)]
            result.append({"metric": labels, "values": values})
        return result


@pytest.fixture(scope="module")
def stub() -> Iterator[Stub]:
    """A stub Prometheus, serving until the module's tests end."""
    server = Stub()
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


@pytest.fixture(scope="module")
def stubbed(stub) -> dict[str, tuple[list[Any], list[str]]]:
    """Each dashboard drawn once from the stub over two minutes: its pictures and queries."""
    rng = render.TimeRange(1_000.0, 1_120.0, 1.0)
    drawings = {}
    for name in DASHBOARDS:
        stub.queries.clear()
        drawings[name] = (drawn(name, render.Prometheus(stub.url), rng), list(stub.queries))
    return drawings


def drawn(name: str, source: Any, rng: Any, **variables: str) -> list[Any]:
    """The dashboard's pictures, scraped every second."""
    return render.render_dashboard(
        load(name), name, source, rng, scrape_interval_s=1.0, variables=variables
    )


def texts(ax: Any) -> list[str]:
    """Every text drawn in the axes (the legend's too)."""
    found = [t.get_text() for t in ax.texts]
    legend = ax.get_legend()
    if legend is not None:
        found += [t.get_text() for t in legend.get_texts()]
    return found


def clashes(figure: Any) -> list[str]:
    """Readability problems: text under 8 pt, panels' labels overlapping, text cut off."""
    renderer = FigureCanvasAgg(figure).get_renderer()
    problems = [
        f"{t.get_text()!r} at {t.get_fontsize()} pt"
        for t in figure.findobj(Text)
        if t.get_visible() and t.get_text().strip() and t.get_fontsize() < MIN_FONT_PT
    ]
    page = Bbox.from_bounds(0, 0, renderer.width, renderer.height)
    boxes = [(ax.get_title(loc="left"), ax.get_tightbbox(renderer)) for ax in figure.axes]
    for title, box in boxes:
        if not page.padded(1).contains(box.x0, box.y0) or not page.padded(1).contains(
            box.x1, box.y1
        ):
            problems.append(f"{title!r} reaches out of the picture")
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        both = Bbox.intersection(box_a, box_b)
        if both is not None and both.width > 2 and both.height > 2:
            problems.append(f"{a!r} overlaps {b!r}")
    return problems


# ------------------------------------------------------------------ the renderer
@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_one_figure_per_row_one_axes_per_panel_titled(name, stubbed):
    """Each row is one figure; each of its panels one axes, in order, with its title."""
    pictures, queries = stubbed[name]
    rows = render.rows_of(load(name))
    assert [p.row for p in pictures] == [title for title, _ in rows]
    assert len({p.filename for p in pictures}) == len(pictures)
    for picture, (_, panels) in zip(pictures, rows, strict=True):
        axes = picture.figure.axes
        assert [ax.get_gid() for ax in axes] == [f"panel-{p['id']}" for p in panels]
        titles = [ax.get_title(loc="left").replace("\n", " ") for ax in axes]
        assert titles == [p["title"] for p in panels]
        for ax, panel in zip(axes, panels, strict=True):
            empty = all(any(m in t["expr"] for m in EMPTY) for t in panel["targets"])
            assert (render.NO_DATA in texts(ax)) == empty, (panel["title"], texts(ax))
    # Grafana's variables are filled in: $__rate_interval as max(step + scrape, 4 x scrape).
    assert queries
    assert not [q for q in queries if "$" in q]
    assert all("[4s]" in q for q in queries if "rate(" in q or "increase(" in q)


def test_variables_take_what_grafana_would_pick(stub):
    """Single-value instance: the first found; multi-value: all of them, regex-escaped."""
    rng = render.TimeRange(1_000.0, 1_060.0, 1.0)
    source = render.Prometheus(stub.url)
    overview = render.grafana_variables(load("overview"), source, rng, scrape_interval_s=5.0)
    assert overview["instance"] == INSTANCES[0]
    assert overview["__rate_interval"] == "20s"
    fleet = render.grafana_variables(load("fleet"), source, rng, scrape_interval_s=1.0)
    assert fleet["instance"] == r"(10\\.0\\.0\\.1:9108|10\\.0\\.0\\.2:9108)"
    given = render.grafana_variables(
        load("fleet"), source, rng, scrape_interval_s=1.0, given={"instance": "x:1"}
    )
    assert given["instance"] == "x:1"
    with pytest.raises(ValueError, match="no variable"):
        render.grafana_variables(load("fleet"), source, rng, scrape_interval_s=1, given={"a": "b"})


def test_units_legends_and_values_as_the_panels_set_them(stubbed):
    """Unit labels on y, legends from legendFormat, stats as formatted last values."""
    axes = {}
    for picture in stubbed["overview"][0]:
        for ax in picture.figure.axes:
            axes[ax.get_title(loc="left").replace("\n", " ")] = ax
    assert axes["KV cache usage and forecast"].get_ylabel() == "percent"
    assert axes["Time to exhaustion"].get_ylabel() == "seconds"
    assert axes["Proxy errors"].get_ylabel() == "requests / s"
    assert axes["VRAM budget per GPU"].get_ylabel() == "bytes"  # values of 0-3 bytes
    assert {"code-0", "code-1"} <= set(texts(axes["Proxy errors"]))
    assert {"tick", "probe probe-0"} <= set(texts(axes["Tick and probe duration"]))
    # Stats: the last value in the unit, or the value mapping's text.
    assert any(t.endswith("%") for t in texts(axes["KV cache usage"]))
    assert set(texts(axes["Pressure level"])) & {"ok", "elevated", "high", "critical"}


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_labels_are_readable(name, stubbed):
    """No text under 8 pt; no panel's title, ticks or legend runs into another panel."""
    for picture in stubbed[name][0]:
        assert clashes(picture.figure) == [], picture.row


def test_formats_follow_grafana_units():
    """The value texts stats, tables and bar gauges show."""
    fmt = render.format_value
    assert fmt(0.873, {"unit": "percentunit"}) == "87.3%"
    assert fmt(1.5 * 1024**3, {"unit": "bytes"}) == "1.5 GiB"
    assert fmt(0.25, {"unit": "s"}) == "250 ms"
    assert fmt(float("inf"), {"unit": "s"}) == "∞"
    mapped = {"mappings": [{"type": "value", "options": {"Infinity": {"text": "not rising"}}}]}
    assert fmt(float("inf"), mapped) == "not rising"
    assert fmt(12_345, {"unit": "short"}) == "12.3 K"
    assert render.slug("Engine: preemptions, restarts, OOMs") == "engine-preemptions-restarts-ooms"


@pytest.mark.prometheus
async def test_every_query_runs_on_a_real_prometheus_and_live_panels_have_data(
    sim_server,
    prometheus,  # noqa: F811 - the fixture imported above
):
    """A kvguard watching a sim engine, scraped by Prometheus: both dashboards drawn."""
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=4096)
    daemon = Daemon(
        parse_config({"engine": {"url": server.url}, "poll": {"interval_s": 0.2}}, env={})
    )
    runner, api = await start_api(daemon)
    stop = asyncio.Event()
    loop_task = asyncio.ensure_future(daemon.run(stop))
    try:
        source = render.Prometheus(prometheus(api.removeprefix("http://")))
        began = time.time()
        for _ in range(300):  # Prometheus starts in ~1-2 s, then scrapes every second
            try:
                samples = source.query("count_over_time(kvguard_build_info[1m])")
            except render.QueryError:
                samples = []
            if samples and float(samples[0]["value"][1]) >= 5:
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("Prometheus did not store 5 scrapes of kvguard in 30 s")
        rng = render.TimeRange(began, time.time(), 1.0)
        instance = api.removeprefix("http://")
        overview = await asyncio.to_thread(drawn, "overview", source, rng, instance=instance)
        fleet = await asyncio.to_thread(drawn, "fleet", source, rng)
    finally:
        stop.set()
        await loop_task
        await runner.cleanup()
        await daemon.close()
    results = {(p.dashboard, r.title): r for p in overview + fleet for r in p.panels}
    assert [e for r in results.values() for e in r.errors] == []
    for panel in ("KV cache usage and forecast", "Pressure level", "Probes", "Poll rate"):
        assert results["overview", panel].has_data, panel
    for panel in ("kvguard instances", "KV cache usage by instance", "Probes by instance"):
        assert results["fleet", panel].has_data, panel
    for picture in overview + fleet:
        assert clashes(picture.figure) == [], picture.row


# ------------------------------------------------------------------ the docs
def doc_section(name: str, row: str) -> str:
    """The text of ``### row`` within the dashboard's ``## `` section of monitoring.md."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(SECTIONS[name])
    end = text.find("\n## ", start + 1)
    dashboard = text[start : end if end > 0 else None]
    match = re.search(rf"^### {re.escape(row)}\n(.*?)(?=^##)", dashboard + "\n##", re.M | re.S)
    assert match is not None, f"docs/monitoring.md has no '### {row}' under {SECTIONS[name]}"
    return match.group(1)


def record() -> dict[str, Any]:
    """docs/images/dashboards/pictures.json."""
    return json.loads(RECORD.read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_every_row_has_its_picture_under_its_section(name):
    """monitoring.md shows each row's PNG in that row's section, and the PNG exists."""
    for row, _ in render.rows_of(load(name)):
        file = render.picture_name(name, row)
        section = doc_section(name, row)
        assert re.search(rf"!\[[^\]]+\]\(images/dashboards/{re.escape(file)}\)", section), (
            f"no ![…](images/dashboards/{file}) under '### {row}' in docs/monitoring.md"
        )
        assert (IMAGES / file).is_file(), f"{file} missing: {REGENERATE}"


def test_pictures_show_the_dashboards_as_they_are():
    """Each picture's recorded row and panels are the JSON's now; none is left over."""
    pictures = {p["file"]: p for p in record()["pictures"]}
    expected = {}
    for name in DASHBOARDS:
        for row, panels in render.rows_of(load(name)):
            expected[render.picture_name(name, row)] = [p["title"] for p in panels]
    assert {f: p["panels"] for f, p in pictures.items()} == expected, REGENERATE
    assert {p.name for p in IMAGES.glob("*.png")} == set(expected), REGENERATE
    assert all(not p["query_errors"] for p in pictures.values())


def test_pictures_are_modest_pngs_stamped_with_the_commit():
    """PNGs of at most 250 KB and 1,600 px wide, their commit in their metadata."""
    commit = record()["kvguard_commit"]
    for path in sorted(IMAGES.glob("*.png")):
        assert path.stat().st_size <= MAX_PNG_BYTES, path.name
        with Image.open(path) as image:
            assert image.format == "PNG"
            assert image.width <= 1600, path.name
            assert commit in image.info.get("Source", ""), path.name


def test_the_page_says_how_the_pictures_were_made():
    """The command, the method and the commit, as recorded; no machine paths committed."""
    made = record()
    assert made["made_by"] == "python dashboards/grafana/pictures.py"
    assert re.fullmatch(r"[0-9a-f]{40}", made["kvguard_commit"])
    text = DOC.read_text(encoding="utf-8")
    assert "dashboards/grafana/pictures.py" in text
    assert "matplotlib" in text
    assert "not a Grafana screenshot" in text
    assert made["kvguard_commit"][:12] in text, "quote the pictures' commit in monitoring.md"
    raw = RECORD.read_text(encoding="utf-8")
    assert not re.search(r"/(home|root|tmp|work|Users)/", raw), "a machine path in pictures.json"
