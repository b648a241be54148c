"""A real Prometheus scrapes kvguard and sees the engine's figures."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess

import aiohttp
import pytest

from kvguard.config.settings import parse_config
from kvguard.runtime.daemon import Daemon
from tests.helpers import free_port, until
from tests.test_run import start_api

pytestmark = pytest.mark.prometheus

PROMETHEUS = shutil.which("prometheus")


@pytest.fixture
def prometheus(tmp_path):
    """Start Prometheus on 127.0.0.1 scraping the given targets every second; stop it after."""
    if PROMETHEUS is None:
        pytest.skip(
            "prometheus not installed: run scripts/install-system.sh (Debian package prometheus)"
        )
    procs = []
    logs = contextlib.ExitStack()

    def start(*targets: str) -> str:
        port = free_port()
        log = logs.enter_context((tmp_path / "prometheus.log").open("wb"))
        config = tmp_path / "prometheus.yml"
        listed = ", ".join(f'"{t}"' for t in targets)
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: kvguard\n    static_configs:\n"
            f"      - targets: [{listed}]\n"
        )
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        procs.append(proc)
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    logs.close()


async def query(http: aiohttp.ClientSession, base: str, promql: str) -> list[dict]:
    """Run an instant query; [] while Prometheus is starting or has no data yet."""
    try:
        async with http.get(f"{base}/api/v1/query", params={"query": promql}) as resp:
            if resp.status != 200:
                return []
            return (await resp.json())["data"]["result"]
    except aiohttp.ClientError:
        return []


async def test_prometheus_sees_the_sims_kv_usage(sim_server, prometheus):
    """Prometheus's kvguard_kv_cache_usage_ratio equals the sim's usage, frozen mid-load."""
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=4096, per_token_s=0.0005)
    config = parse_config({"engine": {"url": server.url}, "poll": {"interval_s": 0.2}}, env={})
    daemon = Daemon(config)
    runner, api = await start_api(daemon)
    stop = asyncio.Event()
    loop_task = asyncio.ensure_future(daemon.run(stop))
    body = {"prompt": "word " * 700, "max_tokens": 3000}
    async with aiohttp.ClientSession() as http:
        inflight = [
            asyncio.ensure_future(http.post(f"{server.url}/v1/completions", json=body))
            for _ in range(3)
        ]
        try:
            await until(lambda: len(server.engine.scheduler.running) == 3)
            server.engine.pause("keep")
            truth = server.engine.scheduler.usage
            base = prometheus(api.removeprefix("http://"))
            result: list[dict] = []
            for _ in range(300):  # Prometheus starts in ~1-2 s, then scrapes every second
                result = await query(http, base, "kvguard_kv_cache_usage_ratio")
                if result:
                    break
                await asyncio.sleep(0.1)
            assert result, "Prometheus never returned kvguard_kv_cache_usage_ratio"
            assert truth > 0
            assert float(result[0]["value"][1]) == pytest.approx(truth)
            up = await query(http, base, 'up{job="kvguard"}')
            assert up[0]["value"][1] == "1"
        finally:
            server.engine.pause("abort")
            for task in inflight:
                (await task).close()
            stop.set()
            await loop_task
            await runner.cleanup()
            await daemon.close()
