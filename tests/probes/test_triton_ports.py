"""TensorRT-LLM behind Triton: metrics on one port, health on another.

Two stand-ins on 127.0.0.1, as Triton splits them: a "metrics port" that serves the
exposition written from tensorrtllm_backend 0.19.0's source at ``/metrics`` (and no
health route), and an "HTTP port" that answers ``/v2/health/ready`` (and no
``/metrics``). ``[engine] metrics_url`` and ``health_url`` (``kvguard probe
--metrics-url``, ``--health-url``) point kvguard at each. The stand-ins listen on
free ports, not on Triton's 8000 and 8002: the pairing by port number is tested as
the pure rule (:func:`engine_bases`), and end to end with the probe's idea of
Triton's ports moved to the stand-ins' (``monkeypatch``).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from yarl import URL

import kvguard.probes.engine as engine_module
from kvguard.cli.probe import probe_document
from kvguard.config.settings import parse_config
from kvguard.errors import ConfigError, ProbeError
from kvguard.probes.engine import (
    TRITON_HTTP_PORT,
    TRITON_METRICS_PORT,
    EngineProbe,
    engine_bases,
)
from kvguard.runtime.daemon import Daemon

FIXTURES = Path(__file__).parent.parent / "fixtures/engines"
PAGE = (FIXTURES / "trtllm-triton-0.19.0.txt").read_text()
KVGUARD = str(Path(sys.executable).parent / "kvguard")


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


def test_the_pairing_rule_is_by_port_for_tensorrt_llm_only():
    """engine_bases: Triton's 8000 finds metrics at 8002, 8002 finds health at 8000.

    Only for TensorRT-LLM (set, or detected: ``triton``); a URL set explicitly, or
    any other port, is left as given, and a trailing / is dropped.
    """
    http, metrics = "http://10.0.0.5:8000", "http://10.0.0.5:8002"
    assert engine_bases(http, None, None, triton=True) == (metrics, http)
    assert engine_bases(metrics + "/", None, None, triton=True) == (metrics, http)
    assert engine_bases(http, None, None, triton=False) == (http, http)
    assert engine_bases(metrics, None, None, triton=False) == (metrics, metrics)
    assert engine_bases(http, "http://m:9100/", None, triton=True) == ("http://m:9100", http)
    assert engine_bases(metrics, None, "http://h:9000", triton=True) == (metrics, "http://h:9000")
    other = "http://10.0.0.5:9000"
    assert engine_bases(other, None, None, triton=True) == (other, other)


@pytest.fixture
def as_tritons_ports(monkeypatch) -> Callable[[str, str], None]:
    """Make the probe take the stand-ins' ports for Triton's 8000 (HTTP) and 8002 (metrics)."""

    def move(http: str, metrics: str) -> None:
        monkeypatch.setattr(engine_module, "TRITON_HTTP_PORT", URL(http).port)
        monkeypatch.setattr(engine_module, "TRITON_METRICS_PORT", URL(metrics).port)

    return move


@pytest.mark.parametrize("on", ["http", "metrics"])
async def test_auto_detection_pairs_tritons_ports(triton, as_tritons_ports, on):
    """With kind "auto", one URL on either of Triton's ports: trtllm (triton), figures read, up.

    On the HTTP port /metrics is 404: the metrics port beside it answers TensorRT-LLM's
    exposition, so the probe reads it there and asks health where it was given. On the
    metrics port it detects trtllm and asks health at the HTTP port.
    """
    http, metrics = await triton()
    as_tritons_ports(http, metrics)
    probe = EngineProbe(http if on == "http" else metrics, kind="auto")
    try:
        stats = await probe.sample()
        again = await probe.sample()
    finally:
        await probe.close()
    assert (probe.kind, probe.server) == ("trtllm", "triton")
    assert (stats.up, again.up) == (True, True)
    assert stats.kv_capacity_blocks == again.kv_capacity_blocks == 6912
    assert (probe._metrics_base, probe._health_base) == (metrics, http)


async def test_auto_detection_leaves_another_engine_on_port_8000_alone(
    tiny_vllm, triton, as_tritons_ports
):
    """Another engine on "8000" (vLLM) is read there, not at the port beside it."""
    _, metrics = await triton()
    vllm, asked = await tiny_vllm()
    as_tritons_ports(vllm, metrics)
    probe = EngineProbe(vllm, kind="auto")
    try:
        await probe.sample()
    finally:
        await probe.close()
    assert probe.kind == "vllm"
    assert (probe._metrics_base, probe._health_base) == (vllm, vllm)
    assert "/metrics" in asked


async def test_auto_detection_says_what_failed_when_neither_port_has_metrics(
    triton, as_tritons_ports
):
    """The HTTP port without a metrics port beside it: the HTTP port's 404 is the error."""
    http, _ = await triton()
    as_tritons_ports(http, http.rsplit(":", 1)[0] + ":1")  # nothing listens on port 1
    probe = EngineProbe(http, kind="auto")
    try:
        with pytest.raises(ProbeError, match=r"/metrics: HTTP 404"):
            await probe.sample()
    finally:
        await probe.close()
    assert probe.kind is None


@pytest.fixture
async def tiny_vllm() -> AsyncIterator[Callable[[], Awaitable[tuple[str, list[str]]]]]:
    """A server answering vLLM's exposition (the CPU capture) and /health; logs the paths asked."""
    runners: list[web.AppRunner] = []

    async def start() -> tuple[str, list[str]]:
        asked: list[str] = []
        page = (FIXTURES / "vllm-cpu-idle.txt").read_text()

        async def answer(request: web.Request) -> web.Response:
            asked.append(request.path)
            if request.path == "/metrics":
                return web.Response(text=page, content_type="text/plain")
            return web.Response(status=200 if request.path == "/health" else 404)

        app = web.Application()
        app.router.add_get("/{tail:.*}", answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}", asked

    yield start
    for runner in runners:
        await runner.cleanup()


async def kvguard_probe(*args: str) -> tuple[int, str, str]:
    """``kvguard probe ARGS``: exit code, stdout, stderr."""
    process = await asyncio.create_subprocess_exec(
        KVGUARD,
        "probe",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_probe_takes_metrics_url_and_health_url(triton, tmp_path):
    """The probe's --metrics-url / --health-url, as [engine] metrics_url / health_url.

    --engine-url on the HTTP port with --metrics-url on the metrics port, and the other
    way round with --health-url: trtllm (triton), up, its figures read. Over a config
    the flags win; a bad URL is a usage error naming the flag.
    """
    http, metrics = await triton()
    runs = [
        ("--engine-url", http, "--metrics-url", metrics),
        ("--engine-url", metrics, "--health-url", http + "/"),
    ]
    config = tmp_path / "kvguard.toml"
    config.write_text(f'[engine]\nurl = "{http}"\nmetrics_url = "http://127.0.0.1:1"\n')
    runs.append(("--config", str(config), "--metrics-url", metrics))
    for args in runs:
        code, out, err = await kvguard_probe(*args, "--json")
        assert code == 0, (args, err)
        engine = json.loads(out)["engine"]
        assert (engine["kind"], engine["server"], engine["up"]) == ("trtllm", "triton", True), args
        assert engine["kv_capacity_blocks"] == 6912
    code, out, _ = await kvguard_probe("--engine-url", http, "--metrics-url", metrics)
    assert code == 0
    assert "kind trtllm (triton)  up True" in out
    code, _, err = await kvguard_probe("--engine-url", http, "--health-url", "ftp://x")
    assert code == 2
    assert "--health-url" in err
    code, out, _ = await kvguard_probe("--help")
    assert "--metrics-url" in out
    assert "--health-url" in out
