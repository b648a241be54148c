"""EngineProbe over real HTTP: the simulated engine in each flavor, and tiny misbehaving servers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvguard.config.settings import parse_config
from kvguard.errors import InvalidInputError, ProbeError
from kvguard.probes.engine import EngineProbe
from kvguard.probes.engines import ADAPTERS
from kvguard.runtime.daemon import Daemon
from tests.helpers import free_port, until
from tests.probes.test_engine_adapters import altered

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
VLLM_TEXT = 'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'


@pytest.fixture
async def tiny_server() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """Serve a few GET routes on 127.0.0.1 and return the base URL.

    Use as ``url = await tiny_server({"/metrics": handler})``.

    Handlers that hang should wait on ``request.app[RELEASE]``; it is set at teardown.
    """
    runners: list[web.AppRunner] = []
    release = asyncio.Event()

    async def start(routes: dict[str, Handler]) -> str:
        app = web.Application()
        app[RELEASE] = release
        for path, handler in routes.items():
            app.router.add_get(path, handler)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    release.set()
    for runner in runners:
        await runner.cleanup()


RELEASE = web.AppKey("release", asyncio.Event)
ROOT = Path(__file__).parent.parent / "fixtures"


def text(body: str, status: int = 200) -> Handler:
    """A handler that answers ``body`` with ``status``."""

    async def handle(_: web.Request) -> web.Response:
        return web.Response(text=body, status=status)

    return handle


@pytest.fixture
async def probes() -> AsyncIterator[Callable[..., EngineProbe]]:
    """Make EngineProbes that are closed after the test."""
    made: list[EngineProbe] = []

    def make(url: str, **kwargs) -> EngineProbe:
        probe = EngineProbe(url, **kwargs)
        made.append(probe)
        return probe

    yield make
    for probe in made:
        await probe.close()


def send(http: aiohttp.ClientSession, url: str, words: int, max_tokens: int) -> asyncio.Task:
    """Start one completion of ``words`` prompt tokens in the background."""

    async def post() -> int:
        body = {"prompt": " ".join(["word"] * words), "max_tokens": max_tokens}
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            await resp.read()
            return resp.status

    return asyncio.ensure_future(post())


async def freeze(server) -> None:
    """Stop the sim stepping so the probe and the scheduler see the same state."""
    server.engine.pause("keep")
    await asyncio.sleep(0.05)  # let a step already in flight land


def busy(server, running: int, waiting: int) -> Callable[[], bool]:
    """True once ``running`` sequences decode and ``waiting`` wait."""
    sched = server.engine.scheduler

    def check() -> bool:
        return (
            len(sched.running) == running
            and len(sched.waiting) == waiting
            and all(seq.generated >= 2 for seq in sched.running)
        )

    return check


async def test_vllm_probe_tracks_the_sim_under_load(sim_server, probes):
    """Idle, loaded and drained again: every field equals the sim's scheduler at that moment."""
    server = await sim_server(kv_capacity_tokens=4096, max_model_len=1024, max_num_seqs=4)
    probe = probes(server.url, kind="vllm")
    idle = await probe.sample()
    assert (idle.up, idle.kv_cache_usage_ratio, idle.kv_used_tokens) == (True, 0.0, 0)
    assert (idle.kv_capacity_blocks, idle.block_size, idle.kv_capacity_tokens) == (256, 16, 4096)
    async with aiohttp.ClientSession() as http:
        tasks = [send(http, server.url, 200, 600) for _ in range(6)]
        await until(busy(server, running=4, waiting=2))
        await freeze(server)
        sched, engine_stats = server.engine.scheduler, server.engine.stats
        loaded = await probe.sample()
        assert loaded.requests_running == 4
        assert loaded.requests_waiting == 2
        assert loaded.kv_cache_usage_ratio == pytest.approx(sched.usage)
        assert loaded.kv_used_tokens == sched.used_blocks * 16
        assert loaded.kv_used_tokens > 4 * 200
        assert loaded.prompt_tokens_total == engine_stats.prompt_tokens_total
        assert loaded.generation_tokens_total == engine_stats.generation_tokens_total
        assert loaded.preemptions_total == engine_stats.preemptions_total
        for task in tasks:
            task.cancel()  # the clients leave; the sim aborts their requests
        await asyncio.gather(*tasks, return_exceptions=True)
        server.engine.resume()
        await until(lambda: not sched.has_work)
    drained = await probe.sample()
    assert (drained.requests_running, drained.requests_waiting, drained.kv_used_tokens) == (0, 0, 0)
    assert drained.requests_finished_total == 6  # all six ended (aborted)


async def test_sglang_probe_tracks_the_sim_under_load(sim_server, probes):
    """SGLang flavor: token pool, pages and queue equal the scheduler's."""
    server = await sim_server(
        kv_capacity_tokens=4096, max_model_len=1024, max_num_seqs=3, flavor="sglang"
    )
    probe = probes(server.url, kind="sglang")
    async with aiohttp.ClientSession() as http:
        tasks = [send(http, server.url, 150, 600) for _ in range(5)]
        await until(busy(server, running=3, waiting=2))
        await freeze(server)
        sched = server.engine.scheduler
        stats = await probe.sample()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert stats.kind == "sglang"
    assert (stats.requests_running, stats.requests_waiting) == (3, 2)
    assert stats.kv_used_tokens == sched.used_blocks * 16
    assert stats.kv_capacity_tokens == server.engine.config.capacity_tokens
    assert stats.kv_capacity_blocks == server.engine.config.capacity_tokens // 16
    assert stats.kv_cache_usage_ratio == pytest.approx(sched.usage)


async def test_llamacpp_probe_counts_slots_of_the_sim(sim_server, probes):
    """llama.cpp flavor: KV use from /slots is prompt + generated of the running requests.

    The simulator's slots split its cache ([engine] kv_unified = false).
    """
    server = await sim_server(
        kv_capacity_tokens=4096, max_model_len=1000, max_num_seqs=4, flavor="llamacpp"
    )
    probe = probes(server.url, kind="llamacpp", kv_unified=False)
    async with aiohttp.ClientSession() as http:
        tasks = [send(http, server.url, 300, 600) for _ in range(6)]
        await until(busy(server, running=4, waiting=2))
        await freeze(server)
        running = server.engine.scheduler.running
        expected_used = sum(seq.prompt_tokens + seq.generated for seq in running)
        stats = await probe.sample()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert (stats.requests_running, stats.requests_waiting) == (4, 2)
    assert stats.kv_capacity_tokens == 4 * (4080 // 4)
    assert stats.kv_used_tokens == expected_used
    assert stats.kv_cache_usage_ratio == pytest.approx(expected_used / 4080)


@pytest.mark.parametrize("flavor", ["vllm", "sglang", "llamacpp"])
async def test_auto_detects_each_sim_flavor_and_keeps_it(sim_server, probes, flavor):
    """kind='auto' learns the engine on the first scrape, then exposes its actions."""
    server = await sim_server(kv_capacity_tokens=2048, max_model_len=512, flavor=flavor)
    probe = probes(server.url)
    assert probe.kind is None
    assert probe.actions == frozenset()
    first = await probe.sample()
    assert (first.kind, probe.kind) == (flavor, flavor)
    assert probe.actions == ADAPTERS[flavor].actions
    assert first.kv_capacity_tokens is not None  # llama.cpp's /slots fetched on the first tick
    second = await probe.sample()
    assert second.kind == flavor


async def test_dead_engine_is_down_but_still_parsed(sim_server, probes):
    """After a simulated CUDA OOM /health answers 503: up is False, metrics still read."""
    server = await sim_server(kv_capacity_tokens=512, max_model_len=400, oom_on_exhaust=True)
    probe = probes(server.url)
    async with aiohttp.ClientSession() as http:
        tasks = [send(http, server.url, 200, 150) for _ in range(3)]
        await asyncio.wait_for(server.crashed.wait(), timeout=3)
        await asyncio.gather(*tasks, return_exceptions=True)
    stats = await probe.sample()
    assert stats.up is False
    assert stats.kind == "vllm"
    assert stats.kv_capacity_blocks == 32


@pytest.mark.parametrize("kind", ["vllm", "trtllm"])
async def test_health_other_than_2xx_means_down(tiny_server, probes, kind):
    """Each adapter's own health path is asked; 503 there gives up=False."""
    body = VLLM_TEXT if kind == "vllm" else 'nv_trt_llm_request_metrics{request_type="active"} 1\n'
    health = ADAPTERS[kind].health_path
    url = await tiny_server({"/metrics": text(body), health: text("loading", status=503)})
    stats = await probes(url, kind=kind).sample()
    assert (stats.kind, stats.up) == (kind, False)
    assert stats.requests_running is not None


async def test_missing_health_endpoint_means_down(tiny_server, probes):
    """A 404 on the health path is not a healthy answer."""
    url = await tiny_server({"/metrics": text(VLLM_TEXT)})
    stats = await probes(url, kind="vllm").sample()
    assert stats.up is False
    assert stats.requests_running == 2.0


async def test_unreachable_port_raises_probe_error(probes):
    """Nothing listening: ProbeError names the URL, no aiohttp error escapes."""
    port = free_port()
    probe = probes(f"http://127.0.0.1:{port}", kind="vllm", timeout_s=1.0)
    with pytest.raises(ProbeError, match=f"127.0.0.1:{port}/metrics") as caught:
        await probe.sample()
    assert caught.value.probe == "engine"


async def test_hung_metrics_endpoint_times_out_as_probe_error(tiny_server, probes):
    """A /metrics that never answers raises ProbeError once the timeout passes, not later."""

    async def hang(request: web.Request) -> web.Response:
        await asyncio.wait_for(request.app[RELEASE].wait(), timeout=30)
        return web.Response(text=VLLM_TEXT)

    url = await tiny_server({"/metrics": hang, "/health": text("")})
    probe = probes(url, kind="vllm", timeout_s=0.3)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ProbeError, match=r"no answer within 0\.3 s"):
        await probe.sample()
    assert loop.time() - started < 2.0  # bounded by the timeout, not by the 30 s hang


@pytest.mark.parametrize("status", [500, 404, 401])
async def test_error_status_raises_probe_error(tiny_server, probes, status):
    """A metrics endpoint answering an error status raises ProbeError with the status."""
    url = await tiny_server({"/metrics": text("oops", status=status), "/health": text("")})
    with pytest.raises(ProbeError, match=f"HTTP {status}"):
        await probes(url, kind="vllm").sample()


async def test_garbage_body_raises_probe_error(tiny_server, probes):
    """An HTML page where exposition text should be raises ProbeError (malformed)."""
    url = await tiny_server({"/metrics": text("<html><body>Welcome to nginx!</body></html>")})
    with pytest.raises(ProbeError, match="malformed metrics"):
        await probes(url).sample()
    with pytest.raises(ProbeError, match="malformed metrics"):
        await probes(url, kind="sglang").sample()


async def test_oversized_body_raises_probe_error(tiny_server, probes):
    """A 20 MB body is refused, whether announced by Content-Length or streamed in chunks."""
    big = b"x" * (20 * 1024 * 1024)

    async def announced(_: web.Request) -> web.Response:
        return web.Response(body=big)

    async def streamed(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        chunk = b"# padding\n" * 100_000  # 1 MB of comments
        for _ in range(20):
            await response.write(chunk)
        await response.write_eof()
        return response

    url = await tiny_server({"/metrics": announced, "/streamed": streamed})
    with pytest.raises(ProbeError, match="over 16777216"):
        await probes(url, kind="vllm").sample()
    with pytest.raises(ProbeError, match="over 16777216"):
        await probes(url, kind="vllm", metrics_path="/streamed").sample()


async def test_non_engine_metrics_cannot_be_auto_detected(tiny_server, probes):
    """Valid exposition from something else: ProbeError asking for the kind; kind stays None."""
    url = await tiny_server({"/metrics": text("process_open_fds 12\n")})
    probe = probes(url)
    with pytest.raises(ProbeError, match="no known engine metrics"):
        await probe.sample()
    assert probe.kind is None


async def test_bearer_token_is_sent_and_kept_out_of_errors(tiny_server, probes):
    """Every request carries Authorization: Bearer <token>; error messages never show it."""
    seen: dict[str, str | None] = {}

    def recording(body: str, status: int = 200) -> Handler:
        async def handle(request: web.Request) -> web.Response:
            seen[request.path] = request.headers.get("Authorization")
            return web.Response(text=body, status=status)

        return handle

    slots_and_props = {"/slots": recording("[]"), "/props": recording("{}")}
    ok = await tiny_server(
        {"/metrics": recording("llamacpp:requests_processing 1\n"), "/health": recording("")}
        | slots_and_props
    )
    await probes(ok, kind="llamacpp", token="s3cret-token").sample()
    assert seen == dict.fromkeys(["/metrics", "/health", "/slots", "/props"], "Bearer s3cret-token")
    failing = await tiny_server({"/metrics": recording("denied", status=500)})
    with pytest.raises(ProbeError) as caught:
        await probes(failing, kind="vllm", token="s3cret-token").sample()
    assert "s3cret" not in str(caught.value)


async def test_no_token_sends_no_authorization(tiny_server, probes):
    """Without a token configured, no Authorization header is sent."""
    seen: list[str | None] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.Response(text=VLLM_TEXT)

    url = await tiny_server({"/metrics": handle})
    await probes(url, kind="vllm").sample()
    assert seen == [None]


async def test_redirects_are_not_followed(tiny_server, probes):
    """A redirect from /metrics is an error; the probe never fetches the other location."""
    fetched: list[str] = []

    async def redirect(_: web.Request) -> web.Response:
        raise web.HTTPFound("/elsewhere")

    async def elsewhere(request: web.Request) -> web.Response:
        fetched.append(request.path)
        return web.Response(text=VLLM_TEXT)

    url = await tiny_server({"/metrics": redirect, "/elsewhere": elsewhere})
    with pytest.raises(ProbeError, match="HTTP 302"):
        await probes(url, kind="vllm").sample()
    assert fetched == []


async def test_failing_slots_leave_kv_fields_unknown(tiny_server, probes):
    """llama.cpp with /slots erroring: the tick succeeds, slot-derived fields are None."""
    url = await tiny_server(
        {
            "/metrics": text("llamacpp:requests_processing 3\n"),
            "/slots": text("slots disabled", status=501),
            "/props": text("not json"),
            "/health": text('{"status": "ok"}'),
        }
    )
    stats = await probes(url, kind="llamacpp").sample()
    assert stats.up is True
    assert stats.requests_running == 3.0
    assert (stats.kv_capacity_tokens, stats.kv_used_tokens, stats.kv_cache_usage_ratio) == (
        None,
        None,
        None,
    )


async def test_close_leaves_a_given_session_open(tiny_server):
    """A session passed in belongs to the caller; close() does not close it."""
    url = await tiny_server({"/metrics": text(VLLM_TEXT)})
    async with aiohttp.ClientSession() as session:
        probe = EngineProbe(url, kind="vllm", session=session)
        await probe.sample()
        await probe.close()
        assert not session.closed


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"url": "ftp://127.0.0.1/"}, "engine url"),
        ({"url": "127.0.0.1:8000"}, "engine url"),
        ({"url": "http://127.0.0.1:8000", "kind": "ollama"}, "engine kind"),
        ({"url": "http://127.0.0.1:8000", "metrics_path": "metrics"}, "metrics_path"),
        ({"url": "http://127.0.0.1:8000", "timeout_s": 0}, "timeout_s"),
    ],
)
def test_bad_settings_are_rejected_at_construction(kwargs, field):
    """A bad URL, kind, path or timeout is an InvalidInputError naming the setting."""
    with pytest.raises(InvalidInputError) as caught:
        EngineProbe(**kwargs)
    assert caught.value.field == field


async def test_garbage_value_is_a_probe_error_not_an_unexpected_one(tiny_server, probes):
    """A real vLLM capture with usage 1e308: ProbeError naming the series, in the daemon too.

    1e308 x blocks x block size overflowed to an OverflowError, which the daemon logged
    as "unexpected"; now the probe fails the way a bad exposition does.
    """
    body = altered("vllm-cpu-busy.txt", 'vllm:kv_cache_usage_perc{engine="0"', "1e308")
    url = await tiny_server({"/metrics": text(body), "/health": text("")})
    with pytest.raises(ProbeError, match=r"vllm:kv_cache_usage_perc\{.*\} is 1e\+308: a ratio"):
        await probes(url, kind="vllm").sample()
    with pytest.raises(ProbeError, match="vllm:kv_cache_usage_perc"):
        await probes(url).sample()  # auto-detected, then parsed: the same error
    daemon = Daemon(parse_config({"engine": {"url": url}, "poll": {"timeout_s": 2.0}}, env={}))
    try:
        await daemon.tick()
        tracker = daemon.state.trackers["engine"]
        assert not tracker.ok
        assert tracker.error is not None
        assert "vllm:kv_cache_usage_perc" in tracker.error
        assert not tracker.error.startswith("unexpected")
    finally:
        await daemon.close()


async def test_the_engine_says_its_context_length_read_once_a_minute(tiny_server, probes):
    """The max_model_len of vLLM's /v1/models is read at the first tick, not at every one.

    Without [model] max_model_len, a request without max_tokens is reserved the room
    this leaves its prompt (not a guess of 512); garbage and failures keep what was known.
    """
    metrics = (ROOT / "engines" / "vllm-cpu-idle.txt").read_text()
    asked: list[int] = []
    cards = [{"data": [{"id": "m", "object": "model", "max_model_len": 2048}]}]

    async def models(_: web.Request) -> web.Response:
        asked.append(1)
        return web.json_response(cards[-1])

    url = await tiny_server({"/metrics": text(metrics), "/health": text(""), "/v1/models": models})
    probe = probes(url, kind="vllm")
    assert (await probe.sample()).context_tokens == 2048
    cards.append(
        {"data": [{"id": "m", "max_model_len": "lots"}, {"id": "n", "max_model_len": True}]}
    )
    assert (await probe.sample()).context_tokens == 2048
    assert len(asked) == 1  # once per CONTEXT_REFRESH_S, not per tick
    probe._context_read_at = -1e9  # a minute later: read again, garbage keeps the last
    assert (await probe.sample()).context_tokens == 2048
    assert len(asked) == 2


async def test_an_engine_without_a_context_in_its_models_leaves_it_unknown(tiny_server, probes):
    """No /v1/models (404) or no max_model_len in it: unknown, and the tick still succeeds."""
    metrics = (ROOT / "engines" / "vllm-cpu-idle.txt").read_text()
    url = await tiny_server({"/metrics": text(metrics), "/health": text("")})
    stats = await probes(url, kind="vllm").sample()
    assert stats.up is True
    assert stats.context_tokens is None
