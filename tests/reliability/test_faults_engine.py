"""Engine faults against the watching daemon and the proxy, all on 127.0.0.1.

Killed mid-burst and back on the same port with another cache; truncated, garbage
and 10 MB expositions; an upstream that drops the connection mid-answer. Already
tested elsewhere (docs/reliability.md has the whole matrix): hung / 500 / garbage
metrics with the loop ticking (tests/test_run.py), over-size bodies and timeouts
(tests/probes/test_engine_probe.py), supervisor restarts (tests/test_supervisor.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
from kvguard.api.app import build_app
from kvguard.api.telemetry import daemon_registry
from kvguard.config.settings import parse_config
from kvguard.core.units import GiB
from kvguard.errors import ProbeError
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.probing import Probes
from kvguard.sim.engine import TimeModel
from kvguard.sim.runner import PoolSpec, SimServer, size_pool, start_sim_server
from tests.helpers import free_port

FIXTURES = Path(__file__).parent.parent / "fixtures" / "engines"


async def serve(app: web.Application, runners: list[web.AppRunner]) -> str:
    """Serve ``app`` on a free loopback port; the caller cleans ``runners`` up."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    runners.append(runner)
    return f"http://127.0.0.1:{runner.addresses[0][1]}"


async def sim_on(port: int, gpu_memory_bytes: int) -> SimServer:
    """A simulated vLLM sized for Llama-3.1-8B on a GPU of ``gpu_memory_bytes``, on ``port``."""
    pool = size_pool(
        PoolSpec(model="llama-3.1-8b", gpu_memory_bytes=gpu_memory_bytes, max_model_len=4096)
    )
    return await start_sim_server(
        pool, port=port, time_model=TimeModel(step_fixed_s=0.002, per_token_s=0.0005)
    )


# ---------------------------------------------------------------------- killed and back
async def test_engine_killed_mid_burst_then_back_with_another_cache(tmp_path):  # noqa: PLR0915
    """Watch-only.

    The engine dies under a burst. Every client gets an answer, the daemon says
    engine_up 0 and /readyz 503 and keeps ticking; the engine comes back on the same
    port with a bigger KV pool: up again, and the cache change and the new budget
    mismatch are logged.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = parse_config(
        {
            "engine": {"url": url},
            "model": {
                "config": "llama-3.1-8b",
                "max_model_len": 4096,
                "max_num_seqs": 64,
                "max_num_batched_tokens": 2048,
            },
            "gpu": {"memory": "24GiB"},
            "poll": {"timeout_s": 0.5},
        },
        env={},
    )
    daemon = Daemon(
        config, probes=Probes(engine=EngineProbe(url, timeout_s=0.5), nvml=None, host=None)
    )
    registry = daemon_registry(daemon)
    runners: list[web.AppRunner] = []
    api = await serve(build_app(daemon), runners)
    server = await sim_on(port, 24 * GiB)
    try:
        await daemon.tick()
        assert registry.get_sample_value("kvguard_engine_up") == 1
        first_capacity = registry.get_sample_value("kvguard_engine_kv_capacity_tokens")
        assert registry.get_sample_value("kvguard_budget_kv_capacity_difference_tokens") == 0

        async with aiohttp.ClientSession() as http:

            async def one(i: int) -> int | str:
                body = {"prompt": "word " * 40, "max_tokens": 400, "stream": i % 2 == 0}
                try:
                    async with http.post(f"{url}/v1/completions", json=body) as resp:
                        await resp.read()
                        return resp.status
                except aiohttp.ClientError as exc:
                    return type(exc).__name__

            burst = [asyncio.create_task(one(i)) for i in range(24)]
            await asyncio.sleep(0.2)  # the burst is in flight
            await server.stop()  # killed
            async with asyncio.timeout(10):
                outcomes = await asyncio.gather(*burst)
        assert len(outcomes) == 24  # every client got an answer or a clear error, none hangs

        for _ in range(3):
            await asyncio.wait_for(daemon.tick(), 5)
        assert registry.get_sample_value("kvguard_engine_up") == 0
        assert registry.get_sample_value("kvguard_ticks_total") == 4
        assert registry.get_sample_value("kvguard_probe_errors_total", {"probe": "engine"}) == 3
        async with aiohttp.ClientSession() as http, http.get(f"{api}/readyz") as resp:
            assert resp.status == 503

        server = await sim_on(port, 40 * GiB)  # restarted with a bigger pool
        with capture_logs() as logs:
            await daemon.tick()
        events = {e["event"]: e for e in logs}
        assert set(events) >= {
            "probe_recovered",
            "engine_cache_changed",
            "budget_reconciliation_mismatch",
        }
        changed = events["engine_cache_changed"]
        assert changed["before"]["kv_capacity_tokens"] == first_capacity
        second_capacity = changed["after"]["kv_capacity_tokens"]
        assert second_capacity > first_capacity
        assert (
            events["budget_reconciliation_mismatch"]["reported_kv_capacity_tokens"]
            == second_capacity
        )
        assert registry.get_sample_value("kvguard_engine_up") == 1
        assert registry.get_sample_value("kvguard_engine_kv_capacity_tokens") == second_capacity
        async with aiohttp.ClientSession() as http, http.get(f"{api}/readyz") as resp:
            assert resp.status == 200
    finally:
        await server.stop()
        for runner in runners:
            await runner.cleanup()
        await daemon.close()


# ---------------------------------------------------------------------- bad expositions
class RawServer:
    """A TCP server on 127.0.0.1 that answers each request with given raw bytes, then closes.

    So a response can lie about its length or stop in the middle.
    """

    def __init__(self) -> None:
        self.reply = b""
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if length:
                await reader.readexactly(length)
            writer.write(self.reply)
            await writer.drain()
        writer.close()  # abruptly: no more bytes, whatever the headers promised

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def raw():
    """A :class:`RawServer`, stopped after the test."""
    server = RawServer()
    await server.start()
    yield server
    await server.stop()


def http_reply(body: bytes, *, length: int | None = None, ctype: str = "text/plain") -> bytes:
    """An HTTP/1.1 200 with ``body``, declaring ``length`` bytes (default: the truth)."""
    declared = len(body) if length is None else length
    return (
        f"HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nContent-Length: {declared}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body


VLLM_TEXT = (FIXTURES / "vllm_sim_busy.txt").read_bytes()


async def test_a_body_shorter_than_its_length_is_a_clear_probe_error(raw):
    """The engine dies mid-body: ProbeError naming the payload error, no parse attempted."""
    raw.reply = http_reply(VLLM_TEXT[:200], length=len(VLLM_TEXT))
    probe = EngineProbe(raw.url, kind="vllm", timeout_s=2)
    try:
        with pytest.raises(ProbeError, match=r"/metrics: ClientPayloadError"):
            await probe.sample()
    finally:
        await probe.close()


async def test_an_exposition_cut_mid_line_is_malformed_not_a_crash(raw):
    """A complete HTTP answer whose text stops mid-sample: a clean ProbeError."""
    cut = VLLM_TEXT[: VLLM_TEXT.index(b"vllm:num_requests_running{") + 30]
    raw.reply = http_reply(cut)
    probe = EngineProbe(raw.url, kind="vllm", timeout_s=2)
    try:
        with pytest.raises(ProbeError, match="malformed metrics"):
            await probe.sample()
    finally:
        await probe.close()


def ten_megabytes(size_bytes: int = 10_000_000) -> bytes:
    """A valid vLLM exposition padded to 10 MB (or ``size_bytes``) with many labelled series.

    The padding belongs to a family the adapter reads (each series 0, so the sum stays
    right), placed with that family's own samples: series of families the adapter
    ignores are dropped before parsing, cheaply, and would not make the parse slow.
    """
    anchor = b'vllm:num_preemptions_total{engine="0",model_name="kvguard-sim"} 1.0\n'
    assert anchor in VLLM_TEXT
    rows = []
    size, i = len(VLLM_TEXT), 0
    while size < size_bytes:
        row = f'vllm:num_preemptions_total{{engine="0",model_name="m",lora="a-{i}"}} 0.0\n'
        rows.append(row.encode())
        size += len(row)
        i += 1
    return VLLM_TEXT.replace(anchor, anchor + b"".join(rows))


async def exposition_server(
    body: bytes, runners: list[web.AppRunner], *, delay_s: float = 0.0
) -> tuple[str, list[int]]:
    """An engine serving ``body`` as its /metrics (after ``delay_s``): (URL, [scrapes])."""
    scrapes = [0]

    async def metrics(_: web.Request) -> web.Response:
        scrapes[0] += 1
        await asyncio.sleep(delay_s)
        return web.Response(body=body, content_type="text/plain")

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return await serve(app, runners), scrapes


async def test_a_10_mb_exposition_is_parsed_off_the_loop_and_never_piles_up(tmp_path):
    """10 MB (under the 16 MiB cap).

    The daemon's loop keeps running while it is parsed in a thread; a parse that
    outlives the tick's timeout is not joined by another one (samples fail fast,
    counted) and the figures come back once it ends.
    """
    body = ten_megabytes()
    runners: list[web.AppRunner] = []
    url, scrapes = await exposition_server(body, runners)
    config = parse_config({"engine": {"url": url}, "poll": {"timeout_s": 0.3}}, env={})
    probe = EngineProbe(url, kind="vllm", timeout_s=5)
    daemon = Daemon(config, probes=Probes(engine=probe, nvml=None, host=None))
    beats = 0

    async def heartbeat() -> None:
        nonlocal beats
        while True:
            beats += 1
            await asyncio.sleep(0.01)

    beating = asyncio.create_task(heartbeat())
    try:
        with capture_logs() as logs:
            await asyncio.wait_for(daemon.tick(), 10)  # fetches 10 MB, times out parsing
            started = time.monotonic()
            while probe._parsing_bytes is not None and time.monotonic() - started < 30:
                await asyncio.wait_for(daemon.tick(), 5)  # each fails fast: no new scrape
                await asyncio.sleep(0.1)
        assert probe._parsing_bytes is None, "the 10 MB parse never finished"
        tracker = daemon.state.trackers["engine"]
        ticks = daemon.state.ticks_total
        # The slow parse cost ticks, not the loop: it kept beating, and only one
        # scrape happened while the parse ran.
        assert beats > 10
        assert scrapes == [1]
        assert tracker.errors_total == ticks
        errors = [e["error"] for e in logs if e["event"] == "probe_failed"]
        assert errors[0] == "timed out after 0.3 s"
        assert all("still being parsed" in e for e in errors[1:])
        # Given the time, the same probe reads it whole (parsing is slow, not broken).
        engine = await asyncio.wait_for(probe.sample(), 60)
        assert engine.up
        assert engine.requests_running is not None
    finally:
        beating.cancel()
        await daemon.close()
        await probe.close()
        for runner in runners:
            await runner.cleanup()


async def test_concurrent_samples_of_a_large_exposition_share_one_scrape(tmp_path):
    """The tick and a drain sample at once (1 MB, parsed in a thread): one scrape, both read it.

    The second caller used to fail with "still being parsed" while the first parsed.
    A caller that gives up leaves the scrape to the other.
    """
    body = ten_megabytes(1_000_000)
    runners: list[web.AppRunner] = []
    url, scrapes = await exposition_server(body, runners)
    probe = EngineProbe(url, kind="vllm", timeout_s=10)
    try:
        first, second = await asyncio.gather(probe.sample(), probe.sample())
        assert first is second  # one parse, handed to both
        assert first.up
        assert scrapes == [1]
        # One of two callers gives up at once; the other still gets the figures.
        quitter = asyncio.ensure_future(probe.sample())
        stayer = asyncio.ensure_future(probe.sample())
        await asyncio.sleep(0)
        quitter.cancel()
        assert (await stayer).up
        assert quitter.cancelled()
        assert scrapes == [2]
    finally:
        await probe.close()
        for runner in runners:
            await runner.cleanup()


async def test_a_caller_arriving_as_the_last_one_gives_up_gets_its_own_scrape(tmp_path):
    """The tick gives up; a drain sampling in that same turn gets a scrape of its own.

    It is never handed the scrape being cancelled (a CancelledError it never asked for).
    """
    runners: list[web.AppRunner] = []
    url, _ = await exposition_server(VLLM_TEXT, runners, delay_s=0.3)
    probe = EngineProbe(url, kind="vllm", timeout_s=10)
    try:
        tick = asyncio.ensure_future(probe.sample())
        await asyncio.sleep(0.05)  # its scrape is out
        tick.cancel()
        drain = asyncio.ensure_future(probe.sample())  # the same turn of the loop
        with pytest.raises(asyncio.CancelledError):
            await tick
        assert (await drain).up
    finally:
        await probe.close()
        for runner in runners:
            await runner.cleanup()


# ---------------------------------------------------------------------- proxy, broken upstream
@pytest.fixture
async def proxied(raw):
    """A proxy in front of the raw server: (proxy URL, proxy)."""
    proxy = AdmissionProxy(ProxySettings(upstream=raw.url), Mitigations())
    runners: list[web.AppRunner] = []
    url = await serve(proxy.app(), runners)
    yield url, proxy
    for runner in runners:
        await runner.cleanup()


BODY = {"prompt": "word " * 10, "max_tokens": 20}


async def test_a_stream_cut_by_the_engine_ends_with_an_sse_error_event(raw, proxied):
    """Through the proxy: the client gets the events sent so far, then an SSE error event."""
    url, proxy = proxied
    event = b'data: {"choices": [{"text": "a"}]}\n\n'
    raw.reply = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(event):x}\r\n".encode() + event + b"\r\n"
    )
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/completions", json={**BODY, "stream": True}) as resp,
    ):
        assert resp.status == 200
        text = (await asyncio.wait_for(resp.read(), 10)).decode()
    assert text.startswith(event.decode())
    last = json.loads(text.strip().splitlines()[-1].removeprefix("data: "))
    assert last["error"]["code"] == "upstream_error"
    assert "the engine stream broke" in last["error"]["message"]
    assert len(proxy.inflight) == 0  # nothing leaked in the accounting


async def test_a_connection_closed_before_any_answer_is_a_502(raw, proxied):
    """No status line at all: a 502 with an OpenAI-style error, counted."""
    url, proxy = proxied
    raw.reply = b""
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/completions", json=BODY) as resp,
    ):
        assert resp.status == 502
        error = (await resp.json())["error"]
    assert error["type"] in ("upstream_unreachable", "upstream_error")
    assert proxy.counters.upstream_errors["502"] == 1
    assert len(proxy.inflight) == 0


async def test_a_whole_answer_cut_short_breaks_the_clients_body_at_once(raw, proxied):
    """A non-streamed answer cut mid-body reaches the client as a broken body, at once.

    Never as a silent short 200, and never as a connection left hanging.
    """
    url, _ = proxied
    whole = json.dumps({"choices": [{"text": "x" * 500}]}).encode()
    raw.reply = http_reply(whole[:100], length=len(whole), ctype="application/json")
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientPayloadError):
            async with http.post(f"{url}/v1/completions", json=BODY) as resp:
                await asyncio.wait_for(resp.read(), 3)
