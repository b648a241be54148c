"""TensorRT-LLM behind Triton: metrics on one port, health on another.

Two stand-ins on 127.0.0.1, as Triton splits them: a "metrics port" that serves the
exposition written from tensorrtllm_backend 0.19.0's source at ``/metrics`` (and no
health route), and an "HTTP port" that answers ``/v2/health/ready`` (and no
``/metrics``). ``[engine] metrics_url`` and ``health_url`` point kvguard at each.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from kvguard.cli.probe import probe_document
from kvguard.config.settings import parse_config
from kvguard.errors import ConfigError, ProbeError
from kvguard.probes.engine import TRITON_HTTP_PORT, TRITON_METRICS_PORT, EngineProbe
from kvguard.runtime.daemon import Daemon

PAGE = (Path(__file__).parent.parent / "fixtures/engines/trtllm-triton-0.19.0.txt").read_text()


@pytest.fixture
async def triton() -> AsyncIterator[Callable[[], Awaitable[tuple[str, str]]]]:
    """Start Triton's two ports; returns (HTTP port URL, metrics port URL)."""
    runners: list[web.AppRunner] = []

    async def site(app: web.Application) -> str:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def start() -> tuple[str, str]:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=PAGE, content_type="text/plain")

        async def ready(_: web.Request) -> web.Response:
            return web.Response(status=200)

        metrics_app, http_app = web.Application(), web.Application()
        metrics_app.router.add_get("/metrics", metrics)
        http_app.router.add_get("/v2/health/ready", ready)
        return await site(http_app), await site(metrics_app)

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_metrics_and_health_from_their_own_ports(triton):
    """The url on the HTTP port, metrics_url on the metrics port: figures read, and up."""
    http, metrics = await triton()
    probe = EngineProbe(http, kind="auto", metrics_url=metrics)
    try:
        stats = await probe.sample()
    finally:
        await probe.close()
    assert (probe.kind, probe.server) == ("trtllm", "triton")
    assert stats.up is True
    assert stats.kv_capacity_blocks == 6912
    # Health is asked at the HTTP port too when the url is the metrics port.
    probe = EngineProbe(metrics, kind="trtllm", health_url=http)
    try:
        assert (await probe.sample()).up is True
    finally:
        await probe.close()


async def test_one_url_for_both_is_what_fails(triton):
    """Without the split: the HTTP port has no metrics; the metrics port reads as down."""
    http, metrics = await triton()
    probe = EngineProbe(http, kind="trtllm")
    try:
        with pytest.raises(ProbeError, match=r"/metrics: HTTP 404"):
            await probe.sample()
    finally:
        await probe.close()
    probe = EngineProbe(metrics, kind="trtllm")
    try:
        stats = await probe.sample()
    finally:
        await probe.close()
    assert stats.kv_capacity_blocks == 6912
    assert stats.up is False  # /v2/health/ready on the metrics port: 404


def test_tritons_default_ports_find_each_other():
    """A trtllm url on port 8000 reads metrics at 8002; on 8002 it asks health at 8000."""
    on_http = EngineProbe(f"http://10.0.0.5:{TRITON_HTTP_PORT}", kind="trtllm")
    assert on_http._metrics_base == f"http://10.0.0.5:{TRITON_METRICS_PORT}"
    assert on_http._health_base == f"http://10.0.0.5:{TRITON_HTTP_PORT}"
    on_metrics = EngineProbe(f"http://10.0.0.5:{TRITON_METRICS_PORT}", kind="trtllm")
    assert on_metrics._health_base == f"http://10.0.0.5:{TRITON_HTTP_PORT}"
    # Set explicitly, or another engine on port 8000: left as given.
    told = EngineProbe("http://10.0.0.5:8000", kind="trtllm", metrics_url="http://m:9100")
    assert told._metrics_base == "http://m:9100"
    vllm = EngineProbe("http://10.0.0.5:8000", kind="vllm")
    assert vllm._metrics_base == "http://10.0.0.5:8000"


async def test_the_config_keys_reach_the_probe_and_probe_names_the_server(triton):
    """[engine] metrics_url / health_url from a file; probe says kind trtllm (triton)."""
    http, metrics = await triton()
    config = parse_config({"engine": {"url": http, "metrics_url": metrics + "/"}}, env={})
    assert config.engine.metrics_url == metrics  # a trailing / is dropped
    daemon = Daemon(config)
    try:
        await daemon.tick()
        engine = probe_document(daemon)["engine"]
    finally:
        await daemon.close()
    assert (engine["kind"], engine["server"], engine["up"]) == ("trtllm", "triton", True)


@pytest.mark.parametrize("key", ["metrics_url", "health_url"])
def test_a_bad_url_is_refused_naming_the_key(key):
    """Not an http(s) URL: the error names the key and what is allowed."""
    with pytest.raises(ConfigError, match=rf"engine\.{key}: must be an http\(s\) URL"):
        parse_config({"engine": {"url": "http://127.0.0.1:8000", key: "ftp://x"}}, env={})
