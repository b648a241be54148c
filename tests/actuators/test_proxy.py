"""The admission proxy between real clients and real servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import re

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from kvguard.actuators.accounting import Inflight, InflightRequest
from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import HELD_POOLS, AdmissionProxy, ProxySettings
from kvguard.actuators.proxy.answers import _error
from kvguard.config.settings import parse_config
from kvguard.core.policy import Action
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.assembly import make_proxy
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.probing import Probes
from tests.helpers import free_port, until


@pytest.fixture
async def proxy_to(serve):
    """A proxy in front of ``upstream``: returns (proxy URL, proxy object)."""

    async def start(upstream: str, mitigations: Mitigations | None = None, **settings):
        proxy = AdmissionProxy(
            ProxySettings(upstream=upstream, **settings), mitigations or Mitigations()
        )
        return await serve(proxy.app(), cancel=True), proxy

    return start


@pytest.fixture
async def echo(serve):
    """An upstream that records each request and answers deterministic bytes."""
    seen: list[dict] = []
    go = asyncio.Event()

    async def record(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        seen.append(
            {
                "method": request.method,
                "path": request.rel_url.raw_path_qs,
                "headers": request.headers.copy(),
                "body": body,
            }
        )
        if request.path == "/stream":
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b'data: {"choices": [{"text": "a"}]}\n\n')
            await asyncio.wait_for(go.wait(), 5)  # the client must see chunk 1 first
            await response.write(b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n')
            await response.write_eof()
            return response
        if request.path == "/gzip":
            return web.Response(body=gzip.compress(b"hello"), headers={"Content-Encoding": "gzip"})
        if request.path == "/slow":
            await asyncio.sleep(5)
        return web.Response(
            status=418,
            body=b"\x00\x01binary\xff" + body,
            headers={"X-Upstream": "yes", "Content-Type": "application/octet-stream"},
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    url = await serve(app)
    return url, seen, go


async def test_requests_pass_through_unchanged(echo, proxy_to):
    """Method, path, query, body, status, headers and bytes pass; hop-by-hop headers do not."""
    upstream, seen, _ = echo
    # No engine route: paths [proxy] allowed_paths adds pass as they are.
    proxy, _ = await proxy_to(upstream, allowed_paths=("/any", "/gzip"))
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        async with http.put(
            f"{proxy}/any/path?x=1&y=%20z",
            data=b"\x10\x20payload",
            headers={
                "X-Custom": "v",
                "Connection": "keep-alive, X-Drop",
                "X-Drop": "gone",
                "Keep-Alive": "timeout=5",
            },
        ) as resp:
            body = await resp.read()
            assert resp.status == 418
            assert resp.headers["X-Upstream"] == "yes"
        async with http.get(f"{proxy}/gzip") as resp:
            assert await resp.read() == gzip.compress(b"hello")  # not decompressed on the way
    assert body == b"\x00\x01binary\xff\x10\x20payload"
    request = seen[0]
    assert (request["method"], request["path"], request["body"]) == (
        "PUT",
        "/any/path?x=1&y=%20z",
        b"\x10\x20payload",
    )
    assert request["headers"]["X-Custom"] == "v"
    assert "X-Drop" not in request["headers"]
    assert "Keep-Alive" not in request["headers"]
    assert len(request["headers"]["X-Request-Id"]) == 32


async def test_request_id_is_kept_when_given(echo, proxy_to):
    """A client's X-Request-Id is forwarded as is."""
    upstream, seen, _ = echo
    proxy, _ = await proxy_to(upstream)
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{proxy}/v1/models", headers={"X-Request-Id": "abc"}),
    ):
        pass
    assert seen[0]["headers"]["X-Request-Id"] == "abc"


async def test_paths_never_change_the_host(echo, proxy_to):
    """A path that looks like another host still goes to the upstream, as a path."""
    upstream, seen, _ = echo
    proxy, _ = await proxy_to(upstream, allowed_paths=("/",))  # "/": every path
    async with aiohttp.ClientSession() as http, http.get(f"{proxy}//127.0.0.2:1/x") as resp:
        assert resp.status == 418
    assert seen[0]["path"] == "//127.0.0.2:1/x"


async def test_streams_pass_chunk_by_chunk(echo, proxy_to):
    """SSE chunks reach the client as they are sent (the upstream waits for the client)."""
    upstream, _, go = echo
    proxy, _ = await proxy_to(upstream, allowed_paths=("/stream",))
    async with aiohttp.ClientSession() as http, http.post(f"{proxy}/stream") as resp:
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 3)
        assert first == b'data: {"choices": [{"text": "a"}]}\n\n'
        go.set()
        rest = await asyncio.wait_for(resp.content.read(), 3)
    assert rest == b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n'


async def test_limits_and_upstream_failures(echo, proxy_to):
    """Body over the limit: 413; upstream refusing: 502; upstream too slow: 504."""
    upstream, _, _ = echo
    proxy, _ = await proxy_to(
        upstream, max_body_bytes=1024, read_timeout_s=0.3, allowed_paths=("/x", "/slow")
    )
    dead, _ = await proxy_to(f"http://127.0.0.1:{free_port()}")
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{proxy}/x", data=b"x" * 2048) as resp:
            assert resp.status == 413
        async with http.get(f"{dead}/v1/models") as resp:
            assert resp.status == 502
            assert (await resp.json())["error"]["type"] == "upstream_unreachable"
        async with http.get(f"{proxy}/slow") as resp:
            assert resp.status == 504


class ClosingIdleEngine:
    """An HTTP/1.1 upstream whose keep-alive timer fires as a request comes in.

    A request arriving on a connection idle for ``idle_close_s`` or more since its last
    answer is read and dropped unanswered, the way uvicorn (vLLM, SGLang) or
    llama-server close an idle connection in the instant a client reuses it. Answers
    are ``{"ok": true}``.
    """

    def __init__(self, idle_close_s: float) -> None:
        self.idle_close_s = idle_close_s
        self.connections = 0
        self.answered = 0
        self.dropped = 0
        self.server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self._writers:  # 3.12+: wait_closed() waits for open connections
            writer.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        loop = asyncio.get_running_loop()
        idle_since: float | None = None  # the timer starts at an answer, as uvicorn's does
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if idle_since is not None and loop.time() - idle_since >= self.idle_close_s:
                    self.dropped += 1
                    return
                body = b'{"ok": true}'
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
                self.answered += 1
                idle_since = loop.time()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


@pytest.mark.parametrize("keepalive_s", [0.2, 0.0])
async def test_idle_upstream_connections_are_not_reused_as_the_engine_closes_them(
    proxy_to, keepalive_s
):
    """A POST after a pause gets its answer, not a 502 for a request the engine never saw.

    The engine drops a request that arrives on a connection idle for 0.5 s; the proxy
    keeps idle connections for 0.2 s (or none at all), so its second POST, 0.7 s after
    the first, goes out on a new connection. (Real time: aiohttp's pool reads its own
    clock.) With aiohttp's default of 15 s the second POST was a 502.
    """
    engine = ClosingIdleEngine(idle_close_s=0.5)
    upstream = await engine.start()
    try:
        proxy, state = await proxy_to(upstream, upstream_keepalive_s=keepalive_s)
        async with aiohttp.ClientSession() as http:
            for pause_s in (0.0, 0.7):
                await asyncio.sleep(pause_s)
                async with http.post(f"{proxy}/v1/completions", json=completion(5, 3)) as resp:
                    assert resp.status == 200, await resp.text()
                    assert await resp.json() == {"ok": True}
    finally:
        await engine.close()
    assert (engine.answered, engine.dropped, engine.connections) == (2, 0, 2)
    assert state.counters.upstream_errors == {}


async def test_a_pooled_connection_kept_past_the_engines_timer_loses_the_request(proxy_to):
    """The control for the test above: kept 5 s, the connection is reused and dropped."""
    engine = ClosingIdleEngine(idle_close_s=0.5)
    upstream = await engine.start()
    try:
        proxy, state = await proxy_to(upstream, upstream_keepalive_s=5.0)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{proxy}/v1/completions", json=completion(5, 3)) as resp:
                assert resp.status == 200
            await asyncio.sleep(0.7)
            async with http.post(f"{proxy}/v1/completions", json=completion(5, 3)) as resp:
                assert resp.status == 502
                assert (await resp.json())["error"]["code"] == "upstream_unreachable"
    finally:
        await engine.close()
    assert (engine.answered, engine.dropped, engine.connections) == (1, 1, 1)
    assert state.counters.upstream_errors == {"502": 1}


async def test_no_cookie_from_the_engine_reaches_another_client(serve, proxy_to):
    """The upstream's Set-Cookie is passed back, never stored and sent for others.

    The upstream is named ``localhost``: aiohttp's default jar refuses cookies from IP
    addresses only, so a hostname upstream (a gateway with sticky sessions) would
    have had its cookie sent on every later client's requests.
    """
    seen: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        return web.json_response({"ok": True}, headers={"Set-Cookie": "route=alice; Path=/"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    upstream = (await serve(app)).replace("127.0.0.1", "localhost")
    proxy, _ = await proxy_to(upstream)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        async with http.get(f"{proxy}/v1/models") as resp:
            assert resp.headers["Set-Cookie"] == "route=alice; Path=/"  # alice gets hers
        async with http.get(f"{proxy}/v1/models") as resp:  # another client, no cookie
            assert resp.status == 200
        async with http.get(f"{proxy}/v1/models", headers={"Cookie": "mine=1"}) as resp:
            assert resp.status == 200
    assert seen == [None, None, "mine=1"]


def test_the_configured_default_keepalive_is_the_clients():
    """[proxy] upstream_keepalive_s defaults to the shared client's figure, under 5 s."""
    from kvguard.config.settings import ProxyConfig  # noqa: PLC0415 - only this test needs it
    from kvguard.http_client import DEFAULT_KEEPALIVE_S  # noqa: PLC0415

    default = ProxySettings(upstream="http://127.0.0.1:1").upstream_keepalive_s
    assert ProxyConfig().upstream_keepalive_s == default == DEFAULT_KEEPALIVE_S < 5.0


def completion(prompt_words: int, max_tokens: int | None = None, **extra) -> dict:
    """A /v1/completions body with a prompt of exactly ``prompt_words`` sim tokens."""
    body = {"prompt": " ".join(["word"] * prompt_words), **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


async def test_shed_by_priority_with_retry_after(sim_engine, proxy_to):
    """With shedding at 'standard': sheddable and standard get 503, critical and /v1/models pass."""
    upstream = await sim_engine(kv_capacity_tokens=8192, max_model_len=2048)
    mitigations = Mitigations(shed_floor="standard", retry_after_s=7, level="critical")
    proxy, state = await proxy_to(upstream, mitigations)
    async with aiohttp.ClientSession() as http:
        for priority, expected in (("sheddable", 503), ("standard", 503), ("critical", 200)):
            async with http.post(
                f"{proxy}/v1/completions", json=completion(5, 3), headers={"X-Priority": priority}
            ) as resp:
                assert resp.status == expected, priority
                if expected == 503:
                    assert resp.headers["Retry-After"] == "7"
                    error = (await resp.json())["error"]
                    assert (error["type"], error["code"]) == (
                        "server_overloaded",
                        "kv_cache_pressure",
                    )
        async with http.get(f"{proxy}/v1/models") as resp:
            assert resp.status == 200
    assert state.counters.shed == {
        ("sheddable", "kv_cache_pressure"): 1,
        ("standard", "kv_cache_pressure"): 1,
    }


async def test_api_key_map_and_default_priority(sim_engine, proxy_to):
    """An API key mapped to sheddable is shed; no header means the default class."""
    upstream = await sim_engine(kv_capacity_tokens=8192, max_model_len=2048)
    proxy, _ = await proxy_to(
        upstream,
        Mitigations(shed_floor="sheddable"),
        api_key_priorities={"batch-key": "sheddable"},
        default_priority="sheddable",
    )
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{proxy}/v1/completions",
            json=completion(5, 3),
            headers={"Authorization": "Bearer batch-key", "X-Priority": "critical"},
        ) as resp:
            assert resp.status == 503
        async with http.post(f"{proxy}/v1/completions", json=completion(5, 3)) as resp:
            assert resp.status == 503


async def test_window_clamps_and_rejects(sim_engine, proxy_to):
    """Caps of 100: max_tokens clamped to the room left or set when missing; too long: 400."""
    upstream = await sim_engine(kv_capacity_tokens=8192, max_model_len=2048)
    mitigations = Mitigations(max_prompt_tokens=100, max_tokens=100)
    proxy, state = await proxy_to(upstream, mitigations)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{proxy}/v1/completions", json=completion(30, 500)) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 70
        async with http.post(
            f"{proxy}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi there"}]},
        ) as resp:
            usage = (await resp.json())["usage"]
            assert usage["prompt_tokens"] + usage["completion_tokens"] == 100
        async with http.post(f"{proxy}/v1/completions", json=completion(150, 10)) as resp:
            assert resp.status == 400
            assert "current limit of 100 tokens" in (await resp.json())["error"]["message"]
        async with http.post(f"{proxy}/v1/completions", json=completion(95, 10)) as resp:
            assert resp.status == 400  # 5 tokens of room is under min_completion_tokens
    assert state.counters.clamped == 2
    assert state.counters.rejected == {"prompt_over_window": 1, "no_room_for_completion": 1}


async def test_window_caps_never_touch_critical_requests(sim_engine, proxy_to):
    """A refusal would lose a critical request as surely as a shed: it passes as sent."""
    upstream = await sim_engine(kv_capacity_tokens=8192, max_model_len=2048)
    mitigations = Mitigations(max_prompt_tokens=100, max_tokens=100)
    proxy, state = await proxy_to(upstream, mitigations)
    critical = {"X-Priority": "critical"}
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{proxy}/v1/completions", json=completion(150, 300), headers=critical
        ) as resp:
            assert resp.status == 200
            assert (await resp.json())["usage"]["completion_tokens"] == 300
        async with http.post(
            f"{proxy}/v1/completions", json=completion(150, 300), headers={"X-Priority": "standard"}
        ) as resp:
            assert resp.status == 400  # the same request, standard: over the window
    assert state.counters.clamped == 0
    assert state.counters.rejected == {"prompt_over_window": 1}


async def test_dry_run_blocks_and_changes_nothing(sim_engine, proxy_to):
    """Not enforcing: the same floor and caps let everything through unchanged."""
    upstream = await sim_engine(kv_capacity_tokens=8192, max_model_len=2048)
    mitigations = Mitigations(
        enforcing=False, shed_floor="critical", max_prompt_tokens=10, max_tokens=10
    )
    proxy, state = await proxy_to(upstream, mitigations)
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{proxy}/v1/completions", json=completion(30, 50), headers={"X-Priority": "sheddable"}
        ) as resp,
    ):
        assert resp.status == 200
        assert (await resp.json())["usage"]["completion_tokens"] == 50
    assert not state.counters.shed
    assert state.counters.clamped == 0


async def test_cancel_largest_frees_the_engines_blocks(sim_server, proxy_to):
    """The largest non-critical stream is cut with an error event; the sim frees its blocks."""
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=4096, per_token_s=0.0005)
    mitigations = Mitigations()
    proxy, state = await proxy_to(server.url, mitigations)
    async with aiohttp.ClientSession() as http:
        big = await http.post(f"{proxy}/v1/completions", json=completion(2000, 2000, stream=True))
        small = await http.post(
            f"{proxy}/v1/completions",
            json=completion(50, 2000, stream=True),
            headers={"X-Priority": "critical"},
        )
        await big.content.readuntil(b"\n\n")
        await small.content.readuntil(b"\n\n")
        used_before = server.engine.scheduler.used_blocks
        assert state.inflight.largest().prompt_tokens == 2000
        assert mitigations.apply([_cancel()], "critical", 5)[0][1] == "applied"
        rest = (await asyncio.wait_for(big.content.read(), 5)).decode()
        assert '"code": "kv_cache_pressure"' in rest
        for _ in range(500):
            if server.engine.scheduler.used_blocks < used_before - 100:
                break
            await asyncio.sleep(0.01)
        assert (
            server.engine.scheduler.used_blocks < used_before - 100
        )  # the 2,000-token prompt's blocks
        assert len(server.engine.scheduler.running) == 1  # the critical one runs on
        big.close()
        small.close()
    assert state.counters.cancelled == {"largest": 1, "overrun": 0, "drain": 0}


async def test_accounting_tracks_inflight_requests(sim_server, proxy_to):
    """Prompt tokens come from the engine's /tokenize; generated tokens from the stream."""
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=4096, per_token_s=0.001)
    proxy, state = await proxy_to(server.url, Mitigations())
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{proxy}/v1/completions", json=completion(300, 500, stream=True))
        for _ in range(10):
            await resp.content.readuntil(b"\n\n")
        (request,) = list(state.inflight)
        assert request.prompt_tokens == 300
        assert request.generated >= 9
        assert request.projected_tokens == 800
        resp.close()
    for _ in range(500):
        if not len(state.inflight):
            break
        await asyncio.sleep(0.01)
    assert len(state.inflight) == 0
    assert state.inflight.kv_tokens.count == 1


@pytest.fixture
async def tokenizing(serve):
    """An engine whose /tokenize counts 500 tokens; (URL, calls, holder, settings).

    With ``settings["after_completion"]`` it answers only once a completion arrived: a
    proxy that waited for the count before forwarding would wait its whole tokenize
    timeout and forward an estimate; one that forwards at once sees the count arrive
    while the completion runs. The completion waits until the proxy has the count.
    Its answers report 480 prompt tokens in ``usage`` (a stream: when asked to), so a
    figure says which count it came from.
    """
    calls: list[str] = []
    arrived = asyncio.Event()
    holder: dict[str, AdmissionProxy] = {}
    settings = {"after_completion": True}

    async def tokenize(_: web.Request) -> web.Response:
        calls.append("tokenize")
        if settings["after_completion"]:
            await asyncio.wait_for(arrived.wait(), 5)
        return web.json_response({"count": 500})

    async def complete(request: web.Request) -> web.StreamResponse:
        calls.append("completion")
        payload = await request.json()
        arrived.set()
        proxy = holder["proxy"]
        await until(lambda: not proxy._counter.pending)  # the background count is in
        usage = {"prompt_tokens": 480, "completion_tokens": 3}
        if not payload.get("stream"):
            return web.json_response({"choices": [{"text": "x"}], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        if (payload.get("stream_options") or {}).get("include_usage"):
            await response.write(
                f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            )
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", complete)
    return await serve(app), calls, holder, settings


async def test_at_ok_a_whole_answers_usage_counts_its_prompt(tokenizing, proxy_to):
    """No cap or hold in force: forwarded at once; the answer's usage replaces the estimate.

    No /tokenize: a second request to the engine's API server per prompt, for a count
    the answer brings anyway. The count is remembered for the same prompt.
    """
    upstream, calls, holder, _ = tokenizing
    proxy, state = await proxy_to(upstream, Mitigations())
    holder["proxy"] = state
    body = {"prompt": "a" * 30, "max_tokens": 3}  # estimated at 10 tokens
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{proxy}/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()
        assert calls == ["completion"]
        assert state.inflight.prompt_tokens.count == 1
        assert state.inflight.prompt_tokens.total == 480  # observed at the end: the usage's
        assert state._counter.known(body, chat=False).count == 480  # remembered
        async with http.post(f"{proxy}/v1/completions", json=body) as resp:
            assert resp.status == 200
    assert calls == ["completion", "completion"]


async def test_at_ok_a_streams_prompt_is_counted_by_tokenize_alongside(tokenizing, proxy_to):
    """A stream without ``include_usage`` brings no count: /tokenize is asked, not waited for."""
    upstream, calls, holder, _ = tokenizing
    proxy, state = await proxy_to(upstream, Mitigations())
    holder["proxy"] = state
    body = {"prompt": "a" * 30, "max_tokens": 3, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{proxy}/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()
        assert sorted(calls) == ["completion", "tokenize"]  # asked, but not waited for
        assert state.inflight.prompt_tokens.total == 500
        async with http.post(f"{proxy}/v1/completions", json=body) as resp:
            await resp.read()
    assert sorted(calls) == ["completion", "completion", "tokenize"]  # the count was cached


async def test_at_ok_a_stream_with_usage_counts_its_prompt_from_it(tokenizing, proxy_to):
    """``stream_options.include_usage``: the last event's usage is the count; no /tokenize."""
    upstream, calls, holder, _ = tokenizing
    proxy, state = await proxy_to(upstream, Mitigations())
    holder["proxy"] = state
    body = {
        "prompt": "a" * 30,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{proxy}/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200
        await resp.read()
    assert calls == ["completion"]
    assert state.inflight.prompt_tokens.total == 480
    remembered = state._counter.known(body, chat=False)
    assert (remembered.count, remembered.exact) == (480, True)


async def test_past_ok_a_whole_answer_is_counted_by_tokenize_while_it_runs(tokenizing, proxy_to):
    """Pressure building (elevated, nothing capped or held yet): /tokenize alongside.

    In-flight sizes must be known while requests run, not at their end.
    """
    upstream, calls, holder, _ = tokenizing
    proxy, state = await proxy_to(upstream, Mitigations(level="elevated"))
    holder["proxy"] = state
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{proxy}/v1/completions", json={"prompt": "a" * 30, "max_tokens": 3}) as resp,
    ):
        assert resp.status == 200
        await resp.read()
    assert sorted(calls) == ["completion", "tokenize"]
    assert state.inflight.prompt_tokens.total == 500  # /tokenize's, in before the answer


async def test_a_remembered_count_is_the_same_prompt_shaped_the_same_way(tokenizing, proxy_to):
    """Tools or a template change what the engine counts: another key, not the cached count."""
    upstream, _, holder, _ = tokenizing
    _, state = await proxy_to(upstream, Mitigations())
    holder["proxy"] = state
    plain = {"messages": [{"role": "user", "content": "hi"}]}
    known = state._counter.known(plain, chat=True)
    state._counter.cache.put(known.key, 480)
    assert state._counter.known(plain, chat=True).exact
    with_tools = {**plain, "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert not state._counter.known(with_tools, chat=True).exact
    templated = {**plain, "chat_template_kwargs": {"enable_thinking": False}}
    assert not state._counter.known(templated, chat=True).exact


async def test_a_window_cap_waits_for_the_engines_count(tokenizing, proxy_to):
    """With a cap in force the count decides: the estimate (10) fits, the engine's (500) not."""
    upstream, calls, holder, settings = tokenizing
    settings["after_completion"] = False
    mitigations = Mitigations(level="high", max_prompt_tokens=100)
    proxy, state = await proxy_to(upstream, mitigations)
    holder["proxy"] = state
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{proxy}/v1/completions", json={"prompt": "a" * 30, "max_tokens": 3}) as resp,
    ):
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "kv_window_exceeded"
    assert calls == ["tokenize"]  # waited for, and never forwarded


async def test_caps_released_while_the_count_is_asked_are_not_applied(serve, proxy_to):
    """The caps in force after the /tokenize wait decide, not those before it."""
    asked, answer = asyncio.Event(), asyncio.Event()

    async def tokenize(_: web.Request) -> web.Response:
        asked.set()
        await asyncio.wait_for(answer.wait(), 5)
        return web.json_response({"count": 500})

    async def complete(_: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "x"}]})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", complete)
    upstream = await serve(app)
    mitigations = Mitigations(level="high", max_prompt_tokens=100)
    proxy, _ = await proxy_to(upstream, mitigations)
    async with aiohttp.ClientSession() as http:
        sent = asyncio.ensure_future(
            http.post(f"{proxy}/v1/completions", json={"prompt": "a" * 30, "max_tokens": 3})
        )
        await asyncio.wait_for(asked.wait(), 5)
        mitigations.max_prompt_tokens = None  # released while the count is out
        answer.set()
        async with await sent as resp:
            assert resp.status == 200  # 500 tokens, but no cap is in force any more


def test_requests_with_the_same_client_id_are_accounted_apart():
    """X-Request-Id comes from clients: two in flight with one id are two requests."""
    inflight = Inflight()
    first = InflightRequest("same", "standard", 100, 10)
    second = InflightRequest("same", "standard", 200, 10)
    inflight.add(first)
    inflight.add(second)
    assert len(inflight) == 2
    inflight.done(first)
    assert list(inflight) == [second]
    assert inflight.prompt_tokens.count == 1


def _cancel() -> Action:
    return Action("cancel_largest", "test")


def test_json_error_bodies_are_openai_shaped():
    """Errors carry message, type and code, as OpenAI clients expect."""
    body = json.loads(_error(503, "m", "server_overloaded", code="kv_cache_pressure").text or "")
    assert body == {
        "error": {"message": "m", "type": "server_overloaded", "code": "kv_cache_pressure"}
    }


async def test_projected_admission_waits_for_room_then_sheds(sim_server, proxy_to):
    """With a 1,000-token pool, a request that does not fit waits for room; past the wait, 503."""
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=2048, per_token_s=0.002)
    mitigations = Mitigations(pool_tokens=1000, block_size=16)
    proxy, state = await proxy_to(
        server.url, mitigations, admission="projected", admission_ratio=1.0, admission_wait_s=0.3
    )
    async with aiohttp.ClientSession() as http:
        first = asyncio.ensure_future(
            http.post(f"{proxy}/v1/completions", json=completion(400, 300))
        )
        for _ in range(500):
            if len(state.inflight):
                break
            await asyncio.sleep(0.01)
        # 704 tokens projected in flight: another 400 + 300 does not fit; it waits 0.3 s, then 503.
        async with http.post(
            f"{proxy}/v1/completions",
            json=completion(400, 300),
            headers={"X-Priority": "sheddable"},
        ) as resp:
            assert resp.status == 503
            # The reason in numbers: the first's projection (its prompt estimated) + this
            # one's 704 (its prompt counted by the engine: it decided), against the pool.
            message = (await resp.json())["error"]["message"]
            projected = re.search(
                r"projected ([\d,]+) of the 1,000 KV tokens admission fills", message
            )
            assert projected is not None, message
            assert int(projected.group(1).replace(",", "")) >= 704 + 704
            assert "reserved at 300 output tokens (max_tokens)" in message
        # Critical requests are never shed: this one waits for the first to finish.
        async with http.post(
            f"{proxy}/v1/completions", json=completion(400, 5), headers={"X-Priority": "critical"}
        ) as resp:
            assert resp.status == 200
        assert first.done()
        (await first).close()
    assert state.counters.shed == {("sheddable", "kv_pool_full"): 1}


async def test_projected_admission_lets_a_waiting_request_in_when_room_frees(sim_engine, proxy_to):
    """A request that waits is admitted as soon as the one in flight finishes."""
    upstream = await sim_engine(kv_capacity_tokens=8192, max_model_len=2048, per_token_s=0.0005)
    mitigations = Mitigations(pool_tokens=1000, block_size=16)
    proxy, state = await proxy_to(
        upstream, mitigations, admission="projected", admission_ratio=1.0, admission_wait_s=20
    )
    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(
            *(http.post(f"{proxy}/v1/completions", json=completion(400, 200)) for _ in range(3))
        )
        statuses = [r.status for r in results]
        for r in results:
            r.close()
    assert statuses == [200, 200, 200]  # one at a time through the 1,000-token pool
    assert not state.counters.shed


async def test_a_critical_request_larger_than_the_pool_goes_in_alone(sim_engine, proxy_to):
    """It can never fit the projection, but the engine takes it alone: it is not held forever."""
    upstream = await sim_engine(kv_capacity_tokens=8192, max_model_len=2048)
    mitigations = Mitigations(pool_tokens=256, block_size=16)
    proxy, state = await proxy_to(upstream, mitigations, admission="projected")
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{proxy}/v1/completions",
            json=completion(300, 100),
            headers={"X-Priority": "critical"},
            timeout=aiohttp.ClientTimeout(total=20),
        ) as resp,
    ):
        assert resp.status == 200
    assert not state.counters.shed


async def test_projected_admission_keeps_an_oom_engine_alive(sim_server, proxy_to):
    """A burst that crashes an oom_on_exhaust engine passes through the proxy without a crash."""
    body = completion(300, 100)
    crashing = await sim_server(kv_capacity_tokens=4096, max_model_len=2048, oom_on_exhaust=True)
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(
            *(http.post(f"{crashing.url}/v1/completions", json=body) for _ in range(30))
        )
    assert crashing.crashed.is_set()  # the premise: 30 x 400 tokens do not fit 4,080

    server = await sim_server(kv_capacity_tokens=4096, max_model_len=2048, oom_on_exhaust=True)
    mitigations = Mitigations(pool_tokens=4080, block_size=16)
    proxy, _ = await proxy_to(server.url, mitigations, admission="projected", admission_wait_s=30)
    async with aiohttp.ClientSession() as http:
        answers = await asyncio.gather(
            *(http.post(f"{proxy}/v1/completions", json=body) for _ in range(30))
        )
        statuses = [a.status for a in answers]
        for a in answers:
            a.close()
    assert not server.crashed.is_set()
    assert statuses == [200] * 30


async def test_shedding_admits_what_fits_and_sheds_only_the_excess(sim_server, proxy_to):
    """Shedding 'standard': a request that fits shed_ratio of the pool passes; the excess waits."""
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=2048, per_token_s=0.005)
    mitigations = Mitigations(shed_floor="standard", level="critical", pool_tokens=1000)
    proxy, state = await proxy_to(server.url, mitigations, shed_ratio=1.0, shed_wait_s=0.3)
    async with aiohttp.ClientSession() as http:
        first = asyncio.ensure_future(
            http.post(f"{proxy}/v1/completions", json=completion(400, 300))
        )
        await until(lambda: len(state.inflight) == 1)
        # 704 tokens projected in flight: another 704 does not fit 1,000; held, then shed.
        second = asyncio.ensure_future(
            http.post(f"{proxy}/v1/completions", json=completion(400, 300))
        )
        await until(lambda: state.waiting == 1)
        async with await second as resp:
            assert resp.status == 503
            error = (await resp.json())["error"]
            assert error["code"] == "kv_cache_pressure"
            # The figures a person checks: both requests' 704 tokens against the 1,000.
            assert (
                "projected 1,408 of the 1,000 KV tokens a shed class may fill (shed_ratio 1 of"
                " the 1,000-token pool) with it, after holding it up to 0.3 s"
            ) in error["message"], error["message"]
        assert state.waiting == 0
        async with await first as resp:
            assert resp.status == 200
    assert state.counters.shed == {("standard", "kv_cache_pressure"): 1}


async def test_a_held_request_is_admitted_when_room_frees(sim_engine, proxy_to):
    """Held requests of a shed class go in one by one as room frees, none shed."""
    upstream = await sim_engine(kv_capacity_tokens=8192, max_model_len=2048, per_token_s=0.0005)
    mitigations = Mitigations(shed_floor="sheddable", level="high", pool_tokens=1000)
    proxy, state = await proxy_to(upstream, mitigations, shed_ratio=1.0, shed_wait_s=20)
    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(
            *(
                http.post(
                    f"{proxy}/v1/completions",
                    json=completion(400, 200),
                    headers={"X-Priority": "sheddable"},
                )
                for _ in range(3)
            )
        )
        statuses = [r.status for r in results]
        for r in results:
            r.close()
    assert statuses == [200, 200, 200]
    assert not state.counters.shed


@pytest.mark.parametrize(
    ("pool_tokens", "shed_ratio"), [(None, 0.8), (100_000, 0.0)], ids=["unknown-pool", "ratio-0"]
)
async def test_the_whole_class_is_shed_at_once(sim_engine, proxy_to, pool_tokens, shed_ratio):
    """With no pool to measure against, or shed_ratio 0, a shed class gets 503 without waiting."""
    upstream = await sim_engine(kv_capacity_tokens=8192, max_model_len=2048)
    mitigations = Mitigations(shed_floor="standard", level="critical", pool_tokens=pool_tokens)
    proxy, state = await proxy_to(upstream, mitigations, shed_ratio=shed_ratio, shed_wait_s=600)
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{proxy}/v1/completions", json=completion(5, 3)) as resp,
    ):
        assert resp.status == 503  # at once: a wait of 600 s would time the test out
        message = (await resp.json())["error"]["message"]
        assert ("not known yet" if pool_tokens is None else "shed_ratio is 0") in message
    assert state.counters.shed == {("standard", "kv_cache_pressure"): 1}


async def test_held_requests_are_bounded(sim_server, proxy_to):
    """Once HELD_POOLS pools' worth of requests is held, more of a shed class get 503 at once."""
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=2048, per_token_s=0.01)
    mitigations = Mitigations(shed_floor="standard", level="critical", pool_tokens=1000)
    proxy, state = await proxy_to(server.url, mitigations, shed_ratio=1.0, shed_wait_s=1.0)
    async with aiohttp.ClientSession() as http:

        def post() -> asyncio.Future:
            return asyncio.ensure_future(
                http.post(f"{proxy}/v1/completions", json=completion(400, 300))
            )

        first = post()
        await until(lambda: len(state.inflight) == 1)
        # Each holds 704 projected tokens: enough of them reach HELD_POOLS x 1,000.
        held = [post() for _ in range(math.ceil(HELD_POOLS * 1000 / 704))]
        await until(lambda: state.waiting == len(held))
        async with await post() as resp:
            assert resp.status == 503
            assert state.waiting == len(held)  # answered while the others were still held
            message = (await resp.json())["error"]["message"]
            assert "are held for room already, the most kvguard holds (4 x shed_ratio 1" in message
            assert "of the 1,000-token pool: 4,000)" in message
        for answer in await asyncio.gather(*held):
            assert answer.status == 503  # the first holds the pool for 3 s; the wait is 1 s
            answer.close()
        (await first).close()
    assert state.counters.shed == {("standard", "kv_cache_pressure"): len(held) + 1}


async def test_a_request_held_when_a_drain_begins_is_refused_not_forwarded(sim_server, proxy_to):
    """Held for room, then the engine is drained for a restart: 503, never to the engine."""
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=2048, per_token_s=0.002)
    mitigations = Mitigations(shed_floor="standard", level="critical", pool_tokens=1000)
    proxy, state = await proxy_to(server.url, mitigations, shed_ratio=1.0, shed_wait_s=20)
    async with aiohttp.ClientSession() as http:
        first = asyncio.ensure_future(
            http.post(f"{proxy}/v1/completions", json=completion(400, 300))
        )
        await until(lambda: len(state.inflight) == 1)
        held = asyncio.ensure_future(
            http.post(f"{proxy}/v1/completions", json=completion(400, 300))
        )
        await until(lambda: state.waiting == 1)
        mitigations.draining = True  # the fp8 switch begins while it waits
        async with await first as resp:
            assert resp.status == 200  # in flight before the drain: it finishes
        async with await held as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "kv_cache_reconfigure"
    assert state.counters.shed == {("standard", "draining"): 1}


@pytest.mark.parametrize(
    ("body", "named"),
    [
        (b"{not json", "JSON object"),
        (b'{"prompt": "x", "temperature": NaN}', "no NaN"),
        (b"[" * 50_000, "JSON object"),  # deep nesting: a RecursionError once, a 500
        (b'["prompt"]', "not list"),
        (b'{"prompt": "x", "max_tokens": "12"}', "max_tokens must be an integer, not str"),
        (b'{"prompt": "x", "max_tokens": 1.5}', "max_tokens must be an integer, not float"),
        (b'{"prompt": "x", "max_tokens": true}', "max_tokens must be an integer, not bool"),
        (b'{"prompt": "x", "max_tokens": -3}', "max_tokens must be from 1"),
        (b'{"prompt": "x", "max_tokens": 99999999999999999999}', "max_tokens must be from 1"),
        (b'{"prompt": 5}', "prompt must be a string or a list"),
    ],
)
async def test_malformed_generation_bodies_are_refused_naming_the_field(
    echo, proxy_to, body, named
):
    """A generation body the engine could misread gets 400 saying what is wrong; none is sent."""
    upstream, seen, _ = echo
    proxy, counted = await proxy_to(upstream)
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{proxy}/v1/completions", data=body) as resp,
    ):
        answer = await resp.json()
    assert resp.status == 400
    assert named in answer["error"]["message"]
    assert answer["error"]["code"] == "invalid_body"
    assert counted.counters.rejected["invalid_body"] == 1
    assert seen == []


async def test_chat_messages_must_be_a_list(echo, proxy_to):
    """max_completion_tokens is checked like max_tokens; messages must be a list."""
    upstream, seen, _ = echo
    proxy, _ = await proxy_to(upstream)
    async with aiohttp.ClientSession() as http:
        for payload in ({"messages": "hi"}, {"messages": [], "max_completion_tokens": 0}):
            async with http.post(f"{proxy}/v1/chat/completions", json=payload) as resp:
                assert resp.status == 400
    assert seen == []


async def test_engine_admin_paths_and_allowed_paths(echo, proxy_to):
    """The engines' admin endpoints get 403 by default; allowed_paths adds paths.

    Without blocked_paths an admin endpoint is still refused (it is no client route);
    an operator who wants one through adds it to allowed_paths too.
    """
    upstream, seen, _ = echo
    proxy, _ = await proxy_to(upstream)
    added, _ = await proxy_to(upstream, allowed_paths=("/custom",))
    unblocked, _ = await proxy_to(upstream, blocked_paths=())
    opened, _ = await proxy_to(upstream, blocked_paths=(), allowed_paths=("/reset_prefix_cache",))
    async with aiohttp.ClientSession() as http:
        for path in ("/reset_prefix_cache", "/pause?mode=abort", "/Flush_Cache", "/slots/0"):
            async with http.post(f"{proxy}{path}") as resp:
                answer = await resp.json()
                assert resp.status == 403, path
                assert "[proxy] blocked_paths" in answer["error"]["message"]
        async with http.get(f"{proxy}/custom/x") as resp:
            assert resp.status == 404
            assert "[proxy] allowed_paths" in (await resp.json())["error"]["message"]
        async with http.post(f"{unblocked}/reset_prefix_cache") as resp:
            assert resp.status == 403
        assert seen == []
        async with http.get(f"{added}/custom/x") as resp:
            assert resp.status == 418  # the echo upstream's answer: forwarded
        async with http.post(f"{opened}/reset_prefix_cache") as resp:
            assert resp.status == 418  # an operator who wants them through says so
    assert [s["path"] for s in seen] == ["/custom/x", "/reset_prefix_cache"]


ADMIN_PATHS_ADDED = [
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/scale_elastic_ep",
    "/update_weights",
    "/update_weights_from_disk",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/init_weights_update_group",
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/start_profile",
    "/stop_profile",
    "/start_expert_distribution_record",
    "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
    "/lora-adapters",
    "/slots/0?action=erase",
]


async def test_weight_lora_profile_and_settings_endpoints_are_blocked_by_default(echo, proxy_to):
    """vLLM, SGLang and llama.cpp endpoints that swap weights or change settings: 403.

    ``POST /props`` changes llama.cpp's settings and is refused; ``GET /props`` (what
    clients read the chat template and context size from) still passes.
    """
    upstream, seen, _ = echo
    proxy, _ = await proxy_to(upstream)
    async with aiohttp.ClientSession() as http:
        for path in ADMIN_PATHS_ADDED:
            async with http.post(f"{proxy}{path}") as resp:
                assert resp.status == 403, path
        async with http.post(f"{proxy}/props", json={"n_ctx": 1}) as resp:
            assert resp.status == 403
            assert "POST '/props'" in (await resp.json())["error"]["message"]
        assert seen == []
        async with http.get(f"{proxy}/props") as resp:
            assert resp.status == 418  # forwarded
    assert [(s["method"], s["path"]) for s in seen] == [("GET", "/props")]


async def test_make_proxy_uses_the_configured_path_rules(echo, serve):
    """[proxy] allowed_paths and blocked_paths from the config file reach the running proxy."""
    upstream, seen, _ = echo
    config = parse_config(
        {
            "engine": {"url": upstream},
            "proxy": {
                "enabled": True,
                "allowed_paths": ["/custom"],
                "blocked_paths": ["/v1/embeddings", "DELETE /v1/models", "/metrics"],
                "trust_priority_header": False,
                "upstream_keepalive_s": 0,
            },
        },
        env={},
    )
    daemon = Daemon(
        config, probes=Probes(engine=EngineProbe(upstream, timeout_s=2.0), nvml=None, host=None)
    )
    proxy = make_proxy(config, daemon.mitigations, daemon.state.budget)
    front = await serve(proxy.app(), cancel=True)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{front}/other") as resp:
            assert resp.status == 404  # no engine route, and not in allowed_paths
        async with http.get(f"{front}/metrics") as resp:
            assert resp.status == 403  # an engine route, but blocked: blocks win
        async with http.post(f"{front}/v1/embeddings", json={}) as resp:
            assert resp.status == 403  # inside blocked_paths
        async with http.delete(f"{front}/v1/models") as resp:
            assert resp.status == 403  # the method-bound entry
        assert seen == []
        async with http.get(f"{front}/v1/models") as resp:
            assert resp.status == 418  # forwarded
        async with http.get(f"{front}/custom/page") as resp:
            assert resp.status == 418  # added by allowed_paths
        async with http.post(f"{front}/reset_prefix_cache") as resp:
            # The configured list replaces the defaults, but no client route is it.
            assert resp.status == 403
    assert proxy.settings.trust_priority_header is False
    assert proxy.settings.upstream_keepalive_s == 0.0
    assert [s["path"] for s in seen] == ["/v1/models", "/custom/page"]
    await daemon.close()


async def test_an_untrusted_priority_header_is_ignored(sim_engine, proxy_to):
    """trust_priority_header = false: X-Priority: critical is shed like the default class."""
    upstream = await sim_engine(kv_capacity_tokens=8192, max_model_len=2048)
    mitigations = Mitigations(shed_floor="standard", level="critical")
    trusting, _ = await proxy_to(upstream, mitigations, shed_ratio=0.0)
    strict, _ = await proxy_to(
        upstream,
        mitigations,
        shed_ratio=0.0,
        trust_priority_header=False,
        api_key_priorities={"ops-key": "critical"},
    )
    critical = {"X-Priority": "critical"}
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{trusting}/v1/completions", json=completion(5, 3), headers=critical
        ) as resp:
            assert resp.status == 200
        async with http.post(
            f"{strict}/v1/completions", json=completion(5, 3), headers=critical
        ) as resp:
            assert resp.status == 503
        async with http.post(
            f"{strict}/v1/completions",
            json=completion(5, 3),
            headers={"Authorization": "Bearer ops-key"},
        ) as resp:
            assert resp.status == 200  # the API-key map still decides


@pytest.mark.parametrize(
    "path",
    ["/V1/completions", "/v1/completions/", "//v1/completions", "/v1//chat/completions/"],
)
async def test_generation_path_variants_are_refused_not_forwarded_unshed(echo, proxy_to, path):
    """A variant of a generation path would skip shedding, capping and accounting: 400."""
    upstream, seen, _ = echo
    mitigations = Mitigations(shed_floor="critical", level="critical", max_tokens=8)
    proxy, state = await proxy_to(upstream, mitigations, shed_ratio=0.0)
    async with aiohttp.ClientSession() as http:
        async with http.post(
            URL(f"{proxy}{path}", encoded=True), json={"prompt": "hi", "max_tokens": 500}
        ) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert error["code"] == "bad_path"
            assert "write it as /v1/" in error["message"]
        async with http.post(f"{proxy}/v1/completions", json={"prompt": "hi"}) as resp:
            assert resp.status == 503  # the canonical path is shed
    assert seen == []
    assert state.counters.rejected["bad_path"] == 1


async def test_forwarding_headers_come_from_the_connection(echo, proxy_to):
    """The client's X-Forwarded-* and Forwarded are dropped; the proxy sets its own."""
    upstream, seen, _ = echo
    proxy, _ = await proxy_to(upstream)
    spoofed = {
        "X-Forwarded-For": "10.9.8.7",
        "X-Forwarded-Proto": "https",
        "X-Forwarded-Host": "admin.internal",
        "Forwarded": "for=10.9.8.7;proto=https",
        "X-Real-IP": "10.9.8.7",
    }
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{proxy}/v1/models", headers=spoofed) as resp,
    ):
        assert resp.status == 418
    headers = seen[0]["headers"]
    assert headers.getall("X-Forwarded-For") == ["127.0.0.1"]
    assert headers.getall("X-Forwarded-Proto") == ["http"]
    for gone in ("Forwarded", "X-Forwarded-Host", "X-Real-IP"):
        assert gone not in headers, gone


async def test_the_engine_gets_the_clients_headers_and_nothing_added(echo, proxy_to):
    """No Content-Type, Accept, Accept-Encoding or User-Agent the client did not send."""
    upstream, seen, _ = echo
    proxy, _ = await proxy_to(upstream)
    reader, writer = await asyncio.open_connection("127.0.0.1", int(proxy.rsplit(":", 1)[1]))
    body = b'{"prompt": "hi"}'
    writer.write(
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await writer.drain()
    assert (await reader.read()).startswith(b"HTTP/1.1 418")
    writer.close()
    (got,) = seen
    for name in ("Content-Type", "Accept", "Accept-Encoding", "User-Agent"):
        assert name not in got["headers"], name
    assert got["body"] == body
    seen.clear()
    async with aiohttp.ClientSession() as http:
        sent = {"Content-Type": "text/x-mine", "User-Agent": "client/1", "Accept": "x/y"}
        async with http.post(f"{proxy}/v1/embeddings", data=body, headers=sent) as resp:
            assert resp.status == 418
    (got,) = seen
    for name, value in sent.items():
        assert got["headers"][name] == value  # the client's own pass as sent


@pytest.mark.parametrize(
    "encoded",
    [gzip.compress(b'{"prompt": "hi"}'), b"\x1f\x8bnot gzip"],
    ids=["gzip", "corrupt-gzip"],
)
async def test_a_compressed_request_body_is_refused_not_forwarded(echo, proxy_to, encoded):
    """Gzip (or a corrupt one): 415 content_encoding, and the engine sees nothing."""
    upstream, seen, _ = echo
    proxy, _ = await proxy_to(upstream)
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{proxy}/v1/completions",
            data=encoded,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        ) as resp,
    ):
        assert resp.status == 415
        assert (await resp.json())["error"]["code"] == "content_encoding"
    assert seen == []
