"""The monitoring pack on a live stack: sim engine, kvguard, Prometheus, Alertmanager.

All on 127.0.0.1: a simulated vLLM under a ``long_context`` burst, kvguard watching it
through its proxy (in dry-run, so nothing stops the preemptions), a real Prometheus
scraping kvguard every second with ``dashboards/prometheus/kvguard-rules.yml`` loaded,
and a real Alertmanager routing to a webhook receiver here. It shows the alert fires
before the engine's first preemption and reaches the receiver, and that every
dashboard panel whose metrics kvguard exported in the run has data.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvguard.config.settings import parse_config
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.assembly import build_guard, listen
from kvguard.runtime.probing import Probes
from kvguard.sim.loadgen import LoadConfig, run_load
from tests.helpers import free_port
from tests.test_dashboards import METRIC, all_queries, substituted
from tests.test_run import start_api

# Real Prometheus and Alertmanager, and a 30 s burst: the second stage.
pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "dashboards" / "prometheus" / "kvguard-rules.yml"
PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
ALERT = "KVGuardKVCacheExhaustionPredicted"
RUN_LIMIT_S = 60.0
# The burst fills the 8,192-token pool in about 20 s at this speed: a ramp a scrape-based
# alert can see (1 s scrapes, 1 s evaluations, `for:`). A burst that fills the pool
# within a second is faster than any scrape; kvguard's own ladder and proxy act on it.
PER_TOKEN_S = 0.002
CONCURRENCY = 16


class Processes:
    """Started processes, stopped (TERM, then KILL) at the end, whatever happened."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []
        self.files = contextlib.ExitStack()

    def start(self, name: str, argv: list[str]) -> None:
        log = self.files.enter_context((self.logs / f"{name}.log").open("wb"))
        self.procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log))

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            _reap(proc)
        self.files.close()


def _reap(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def processes(tmp_path):
    """Real Prometheus and Alertmanager, or a skip that says how to install them."""
    if PROMETHEUS is None or ALERTMANAGER is None:
        pytest.skip(
            "prometheus or alertmanager not installed: run scripts/install-system.sh"
            " (Debian packages prometheus, prometheus-alertmanager)"
        )
    procs = Processes(tmp_path)
    yield procs
    procs.stop()


async def _json(http: aiohttp.ClientSession, url: str, **params: str) -> dict | None:
    try:
        async with http.get(url, params=params) as resp:
            return await resp.json() if resp.status == 200 else None
    except aiohttp.ClientError:
        return None


def _result(answer: dict | None) -> list:
    """The series of a Prometheus query answer (empty until a scrape has stored one)."""
    return ((answer or {}).get("data") or {}).get("result") or []


async def _watch(
    http: aiohttp.ClientSession, prom: str, server: Any, received: list[dict]
) -> tuple[float | None, float | None]:
    """(first preemption, alert firing) times, watched until both happened or the limit."""
    first_preemption = fired_at = None
    deadline = time.monotonic() + RUN_LIMIT_S
    while time.monotonic() < deadline and not (first_preemption and _got(received)):
        now = time.monotonic()
        if first_preemption is None and server.engine.stats.preemptions_total > 0:
            first_preemption = now
        if fired_at is None:
            alerts = await _json(http, f"{prom}/api/v1/alerts")
            for alert in (alerts or {}).get("data", {}).get("alerts", []):
                if alert["labels"]["alertname"] == ALERT and alert["state"] == "firing":
                    fired_at = now
        await asyncio.sleep(0.05)
    return first_preemption, fired_at


async def _panels_without_data(
    http: aiohttp.ClientSession, prom: str, exported: set[str]
) -> list[str]:
    """Dashboard queries whose metrics were all exported, yet Prometheus has no data."""
    empty = []
    for where, expr in all_queries():
        names = {m[0] for m in METRIC.findall(expr)}
        if not names <= exported | {"up"}:
            continue  # a metric kvguard did not export in this run (no GPU, ...)
        result = await _json(http, f"{prom}/api/v1/query", query=substituted(expr))
        if not (result or {}).get("data", {}).get("result"):
            empty.append(where)
    return empty


def _got(received: list[dict]) -> bool:
    """Whether the receiver has had the alert."""
    return ALERT in {a["labels"]["alertname"] for message in received for a in message["alerts"]}


def _exported(exposition: str) -> set[str]:
    """Metric names as PromQL sees them (counters with _total, histograms' series)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(sample.name for sample in family.samples)
    return names


def _start_monitoring(processes: Processes, tmp_path: Path, target: str, hook_port: int) -> str:
    """Alertmanager routing to the hook, Prometheus scraping ``target``: its URL."""
    am_port, prom_port = free_port(), free_port()
    (tmp_path / "alertmanager.yml").write_text(
        "route:\n  receiver: hook\n  group_by: [alertname]\n"
        "  group_wait: 0s\n  group_interval: 1s\n  repeat_interval: 1h\n"
        "receivers:\n  - name: hook\n    webhook_configs:\n"
        f"      - url: http://127.0.0.1:{hook_port}/alerts\n        send_resolved: false\n"
    )
    processes.start(
        "alertmanager",
        [
            ALERTMANAGER,
            f"--config.file={tmp_path / 'alertmanager.yml'}",
            f"--storage.path={tmp_path / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{am_port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ],
    )
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: ['{RULES}']\n"
        "alerting:\n  alertmanagers:\n"
        f"    - static_configs: [{{targets: ['127.0.0.1:{am_port}']}}]\n"
        "scrape_configs:\n  - job_name: kvguard\n    static_configs:\n"
        f"      - targets: ['{target}']\n        labels: {{engine: sim}}\n"
    )
    processes.start(
        "prometheus",
        [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'prom-data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ],
    )
    return f"http://127.0.0.1:{prom_port}"


async def test_alert_fires_before_the_first_preemption_and_reaches_the_receiver(
    sim_server, processes, tmp_path
):
    """A long_context burst: the alert fires, then the engine preempts; panels have data."""
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=4096, per_token_s=PER_TOKEN_S)
    received: list[dict] = []

    async def receive(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.Response(status=200)

    hook = web.Application()
    hook.router.add_post("/alerts", receive)
    hook_runner = await listen(hook, "127.0.0.1:0")
    hook_port = hook_runner.addresses[0][1]

    proxy_address = f"127.0.0.1:{free_port()}"
    config = parse_config(
        {
            "engine": {"url": server.url},
            "poll": {"interval_s": 0.5, "min_interval_s": 0.25, "timeout_s": 1.0},
            "proxy": {"enabled": True, "listen": proxy_address},
        },
        env={},
    )
    # Dry-run: kvguard decides and exports everything but stops nothing, so the engine
    # does preempt and the alert's lead can be measured.
    guard = build_guard(
        config,
        probes=Probes(engine=EngineProbe(server.url), nvml=None, host=None),
        dry_run=True,
        serve_api=False,
        engine_actions=False,
    )
    daemon = guard.daemon
    assert daemon.proxy is not None
    proxy_runner = await listen(daemon.proxy.app(), proxy_address, cancel=True)
    api_runner, api = await start_api(daemon)
    stop = asyncio.Event()
    loop_task = asyncio.ensure_future(daemon.run(stop))

    prom = _start_monitoring(processes, tmp_path, api.removeprefix("http://"), hook_port)
    first_preemption: float | None = None
    fired_at: float | None = None
    load = None
    try:
        async with aiohttp.ClientSession() as http:
            began = time.monotonic()
            # Prometheus must be scraping before the burst, or there is nothing to alert on.
            while not _result(
                await _json(http, f"{prom}/api/v1/query", query="kvguard_build_info")
            ):
                assert time.monotonic() - began < 30, "Prometheus never scraped kvguard"
                await asyncio.sleep(0.2)
            load = asyncio.ensure_future(
                run_load(
                    LoadConfig(
                        f"http://{proxy_address}",
                        pattern="long_context",
                        duration_s=40.0,
                        concurrency=CONCURRENCY,
                        seed=1,
                        max_context=4096,
                        grace_s=0.5,
                    )
                )
            )
            first_preemption, fired_at = await _watch(http, prom, server, received)
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
            async with http.get(f"{api}/metrics") as resp:
                exported = _exported(await resp.text())
            empty = await _panels_without_data(http, prom, exported)
    finally:
        if load is not None and not load.done():
            load.cancel()
        stop.set()
        await loop_task
        for runner in (api_runner, proxy_runner, hook_runner):
            await runner.cleanup()
        await daemon.close()
    assert first_preemption is not None, "the burst never preempted: nothing to be early for"
    assert fired_at is not None, f"{ALERT} never fired"
    assert fired_at < first_preemption, (fired_at - first_preemption, "s late")
    assert _got(received), received
    assert not empty, f"panels without data although their metrics were exported: {empty}"
