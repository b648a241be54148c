"""Limits on what clients send, and how slowly: bodies, their JSON values, memory, timeouts.

Real servers on 127.0.0.1 (kvguard's proxy and API, a recording upstream), raw
sockets where an HTTP client would not misbehave on purpose, and `kvguard run` for
what only the whole process shows (its exit on SIGTERM, its peak memory and loop lag
in a flood). Every request goes to 127.0.0.1, every wait is bounded, and the flood
sends a fixed number of bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import math
import signal
import sys
import time
import tracemalloc
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvguard.actuators.accounting import (
    InflightRequest,
    digest,
    estimate_chat_tokens,
    estimate_tokens,
    utf8_length,
)
from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
from kvguard.actuators.proxy.bodies import BodyGate, BodyRefused, body_memory
from kvguard.actuators.proxy.counting import PromptCounter
from kvguard.actuators.proxy.screen import count_values, parse_json
from kvguard.api.app import build_app
from kvguard.config.settings import parse_config
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.assembly import ClientLimits, listen
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.probing import Probes
from tests.helpers import free_port, json_log_events, until

KVGUARD = str(Path(sys.executable).parent / "kvguard")
MiB = 1024 * 1024
# Short limits so the tests take a second, not the defaults' minutes.
QUICK = ClientLimits(header_timeout_s=0.5, keepalive_s=0.5, shutdown_grace_s=1.0)


# ---------------------------------------------------------------------- servers
@pytest.fixture
async def upstream() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A recording engine on 127.0.0.1: every generation body it receives, in order."""
    seen: list[bytes] = []

    async def record(request: web.Request) -> web.Response:
        if request.method != "POST" or not request.path.endswith("completions"):
            # /tokenize (estimate from now on) and the probe's /metrics (no engine to see)
            return web.json_response({"error": "none"}, status=404)
        seen.append(await request.read())
        return web.json_response({"usage": {"completion_tokens": 1, "prompt_tokens": 5}})

    app = web.Application(client_max_size=64 * MiB)
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    await runner.cleanup()


Front = Callable[..., Awaitable[tuple[str, AdmissionProxy]]]


@pytest.fixture
async def front(upstream) -> AsyncIterator[Front]:
    """Start kvguard's proxy (through ``listen``, as `kvguard run` does) before ``upstream``."""
    runners: list[web.AppRunner] = []

    async def start(
        limits: ClientLimits = QUICK, mitigations: Mitigations | None = None, **settings: Any
    ) -> tuple[str, AdmissionProxy]:
        proxy = AdmissionProxy(
            ProxySettings(upstream=upstream[0], **settings), mitigations or Mitigations()
        )
        runner = await listen(proxy.app(), "127.0.0.1:0", cancel=True, limits=limits)
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}", proxy

    yield start
    for runner in runners:
        await runner.cleanup()


async def post(base: str, path: str, body: bytes) -> tuple[int, Any]:
    """POST ``body`` as it is (no client re-encodes it); the status and the JSON answer."""
    # As a stream: aiohttp warns (an error under pytest) on raw bytes over 1 MiB.
    data = io.BytesIO(body)
    async with (
        aiohttp.ClientSession() as http,
        http.post(base + path, data=data, headers={"Content-Type": "application/json"}) as resp,
    ):
        text = await resp.text()
        return resp.status, json.loads(text) if text.startswith("{") else text


def strict(body: bytes) -> Any:
    """``body`` as strict JSON and UTF-8 text: what kvguard may forward."""

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} forwarded")

    payload = json.loads(body.decode("utf-8"), parse_constant=refuse)
    json.dumps(payload, ensure_ascii=False).encode("utf-8")  # every string encodes
    return payload


# ---------------------------------------------------------------------- unencodable text
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b'{"prompt": "a\\udfff", "max_tokens": 5}'),
        ("/v1/completions", b'{"prompt": ["ok", "\\ud800"], "max_tokens": 5}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\udc00"}]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "\\udfff": 1}'),
        ("/v1/completions", b'{"prompt": "\xed\xbf\xbf", "max_tokens": 5}'),  # UTF-8 of U+DFFF
        ("/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 5}'),
    ],
)
async def test_unencodable_text_is_a_400_never_a_500(front, upstream, path, body):
    """A lone surrogate (escaped or as raw bytes), or bytes that are no UTF-8: 400.

    Before, the escaped surrogate reached the accounting's UTF-8 count and failed it
    (500 and a logged traceback); now nothing of it reaches the engine.
    """
    base, proxy = await front()
    status, answer = await post(base, path, body)
    assert status == 400, answer
    assert answer["error"]["code"] == "invalid_body"
    assert "UTF-8" in answer["error"]["message"] or "surrogate" in answer["error"]["message"]
    assert upstream[1] == []
    assert proxy.counters.rejected["invalid_body"] == 1


async def test_paired_surrogates_and_other_text_pass(front, upstream):
    """An escaped pair is one character (an emoji), not a lone surrogate: forwarded."""
    base, _ = await front()
    body = b'{"prompt": "smile \\ud83d\\ude00 \\u00e9\\u4e2d", "max_tokens": 5}'
    status, _ = await post(base, "/v1/completions", body)
    assert status == 200
    assert strict(upstream[1][0])["prompt"] == "smile \U0001f600 é中"


# ---------------------------------------------------------------------- odd numbers
@pytest.mark.parametrize("number", ["1e999", "-1e400", "1" + "0" * 400 + ".0", "NaN", "-Infinity"])
async def test_numbers_no_double_holds_are_refused(front, upstream, number):
    """1e999 would be parsed as inf and forwarded as ``Infinity`` once a cap rewrote the body."""
    base, _ = await front(mitigations=Mitigations(max_tokens=16))
    body = f'{{"prompt": "x", "max_tokens": 500, "temperature": {number}}}'.encode()
    status, answer = await post(base, "/v1/completions", body)
    assert status == 400, answer
    assert answer["error"]["code"] == "invalid_body"
    assert upstream[1] == []


@pytest.mark.parametrize("number", ["1e308", "-0.0", "5e-324", "-1.7976931348623157e308", "0"])
async def test_extreme_doubles_pass_as_strict_json(front, upstream, number):
    """Every double, the largest, the smallest and -0.0 included, is forwarded (a cap too)."""
    base, _ = await front(mitigations=Mitigations(max_tokens=16))
    body = f'{{"prompt": "x", "max_tokens": 500, "temperature": {number}}}'.encode()
    status, answer = await post(base, "/v1/completions", body)
    assert status == 200, answer
    sent = strict(upstream[1][0])
    assert sent["max_tokens"] == 16  # rewritten: the body was written out again
    assert math.isfinite(sent["temperature"])


# ---------------------------------------------------------------------- JSON values
def test_count_values_skips_what_strings_hold():
    """Braces, brackets and commas in text are no values; escaped quotes end no string."""
    assert count_values(b'{"a": [1, 2, 3], "b": {"c": null}}', 100) == 6
    prose = json.dumps({"prompt": 'say "{[,]}" and \\", {x}, ' * 1000}).encode()
    assert count_values(prose, 10) == 1  # the raw count is over 10: walked exactly
    tricky = b'{"a": "\\\\", "b": "\\\\\\"{,", "c": [1,2]}'  # backslashes before quotes
    assert json.loads(tricky) == {"a": "\\", "b": '\\"{,', "c": [1, 2]}
    assert count_values(tricky, 6) == 5  # 7 raw: walked
    assert count_values(b"[" + b"1," * 5000 + b"1]", 100) == 5001
    assert count_values(b"[" + b'"a",' * 5000 + b'"a"]', 100) == 101  # stops past the limit


async def test_a_body_of_too_many_values_is_refused_before_it_is_parsed(front, upstream):
    """The reviewer's body, {"messages": [{}, {}, ...]}, at the byte cap: 400 naming the key."""
    base, proxy = await front(max_body_bytes=4 * MiB)
    body = b'{"messages": [' + b",".join([b"{}"] * (4 * MiB // 3 - 10)) + b"]}"
    assert len(body) <= 4 * MiB
    status, answer = await post(base, "/v1/chat/completions", body)
    assert status == 400
    assert "max_body_values" in answer["error"]["message"]
    assert upstream[1] == []
    # Text full of commas and braces is one value: such a prompt passes. (Under 1 MiB:
    # the proxy forwards it as bytes, over which aiohttp warns, an error under pytest.)
    text = json.dumps({"prompt": "a, {b}, [c], " * (MiB // 14), "max_tokens": 5})
    assert (await post(base, "/v1/completions", text.encode()))[0] == 200
    # Token ids up to the limit pass; more are refused, naming the setting.
    ids = {"prompt": list(range(1000, 1000 + proxy.settings.max_body_values - 10))}
    assert (await post(base, "/v1/completions", json.dumps(ids).encode()))[0] == 200
    ids["prompt"] += list(range(20))
    status, answer = await post(base, "/v1/completions", json.dumps(ids).encode())
    assert status == 400
    assert "max_body_values" in answer["error"]["message"]


def test_parse_json_refuses_what_it_names():
    """Each refusal says why: values, encoding, surrogates, numbers, JSON syntax."""
    reasons = {
        b"[1, 2, 3, 4]": "more than 2 JSON values",
        b'"\xc3\x28"': "not UTF-8",
        b"\xff\xfe{\x00}\x00": "not UTF-8",  # UTF-16 with a BOM: RFC 8259 wants UTF-8
        b'["\\udfff"]': "lone surrogate",
        b"[1e999]": "too large for a double",
        b"[NaN]": "NaN",
        b'{"a": ': "Expecting value",
        b"[" * 100_000: "nested too deeply",
    }
    for body, reason in reasons.items():
        parsed = parse_json(body, 2 if body.startswith(b"[1,") else 10**6)
        assert isinstance(parsed, ValueError), body[:20]
        assert reason in str(parsed), (body[:20], str(parsed))
    assert parse_json('\ufeff{"a": "é"}'.encode(), 10) == {"a": "é"}  # a UTF-8 BOM is fine


# ---------------------------------------------------------------------- estimates
def test_estimates_never_raise_and_match_the_text():
    """UTF-8 lengths without encoding; lone surrogates count 3 bytes instead of raising."""
    for text in ("", "plain", "é中\U0001f600" * 50_000, "a\udfff", "\ud800" * 3):
        assert utf8_length(text) == len(text.encode("utf-8", "surrogatepass"))
    assert estimate_tokens("a\udfff") == 2
    assert estimate_chat_tokens([{"role": "user", "content": "x\udc00"}]) == 8 + 2 + 8
    parts = [{"type": "text", "text": "abc"}, {"type": "image_url"}, {"text": "def"}]
    # As before: the parts' texts joined by spaces ("abc  def": 8 bytes, 3 tokens).
    assert estimate_chat_tokens([{"content": parts}]) == 8 + 3 + 8


def test_prompt_counts_and_keys_build_no_copy_of_the_prompt():
    """A 4 MiB prompt is measured and keyed in well under a megabyte of memory.

    Before, the key and the estimate serialised the prompt again (json.dumps of a
    batch: a copy of it, and more), and a non-ASCII text was encoded whole.
    """
    counter = PromptCounter(lambda: None, "http://127.0.0.1:1")  # type: ignore[arg-type,return-value]
    batch = {"prompt": ["some words, " * 20] * (4 * MiB // 260), "model": "m"}
    wide = {"prompt": "é中" * (2 * MiB)}
    chat = {"messages": [{"role": "user", "content": "hello there"}] * 30_000}
    for payload, is_chat in ((batch, False), (wide, False), (chat, True)):
        tracemalloc.start()
        try:
            known = counter.known(payload, chat=is_chat)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < MiB // 2, (list(payload), peak)
        assert known.count > 1000
        assert not known.exact


def test_digest_keys_equal_values_alike_and_others_apart():
    """Key order does not matter; strings, numbers, arrays and objects are told apart."""
    assert digest({"a": 1, "b": [1, {"c": "x"}]}) == digest({"b": [1, {"c": "x"}], "a": 1})
    distinct = ["1", 1, [1], {"1": 1}, ["a", "b"], ["ab"], [["a"], "b"], {"a": "b"}, {"b": "a"}]
    assert len({digest(v) for v in distinct}) == len(distinct)
    deep: list[Any] = []
    for _ in range(100_000):  # no recursion, however deep
        deep = [deep]
    assert isinstance(digest(deep), int)


# ---------------------------------------------------------------------- the memory gate
async def test_the_gate_waits_then_refuses_and_lets_one_large_body_alone():
    """Room is waited for, then 503; a share alone may pass the budget; release wakes."""
    gate = BodyGate(1000, wait_s=0.2)
    async with gate.share() as first:
        await first.grow(5000)  # alone: over the budget, still allowed
        second = gate.share()
        started = time.monotonic()
        with pytest.raises(BodyRefused) as refused:
            await second.grow(10)
        assert 0.15 < time.monotonic() - started < 2
        assert refused.value.status == 503
        assert refused.value.headers == {"Retry-After": "1"}
        waiter = asyncio.ensure_future(second.grow(600))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        first.shrink_to(300)  # a body counted smaller than reserved gives back the rest
        await asyncio.wait_for(waiter, 1)
        assert gate.held == 900
        second.release()
    assert gate.held == 0


async def test_the_oldest_share_always_grows_so_partial_bodies_never_wait_on_each_other():
    """Shares grown chunk by chunk cannot deadlock: the oldest holder grows past the budget.

    The others wait for it (up to wait_s, then 503), and go on as soon as it ends.
    """
    gate = BodyGate(1000, wait_s=1.0)
    first, second = gate.share(), gate.share()
    await first.grow(600)
    await second.grow(300)
    waiter = asyncio.ensure_future(second.grow(300))  # no room, and it is not the oldest
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await asyncio.wait_for(first.grow(300), 0.1)  # the oldest: over the budget, at once
    assert gate.held == 1200
    first.release()
    await asyncio.wait_for(waiter, 0.5)  # now the oldest, and there is room
    assert gate.held == 600
    second.release()
    assert gate.held == 0


async def test_bodies_over_the_memory_budget_wait_then_get_503(front, upstream):
    """While one body holds the budget (its client stalls), another waits, then 503."""
    base, proxy = await front(max_body_memory=64 * 1024, client_body_timeout_s=30)
    host, port = base.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    try:
        # What it has sent holds the budget (3 bytes a byte: 75 kB), not what it declares.
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 60000\r\n\r\n{" + b" " * 25_000
        )
        await writer.drain()
        await until(lambda: proxy._bodies.held > 0)
        started = time.monotonic()
        async with (
            aiohttp.ClientSession() as http,
            http.post(base + "/v1/completions", data=b'{"prompt": "x"}') as resp,
        ):
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["code"] == "body_memory_full"
        assert 1.5 < time.monotonic() - started < 5
        assert proxy.counters.upstream_errors["503"] == 1
    finally:
        writer.close()
    await until(lambda: proxy._bodies.held == 0, timeout_s=5)
    assert (await post(base, "/v1/completions", b'{"prompt": "x"}'))[0] == 200


def _declaring(size: int) -> bytes:
    """A request head declaring a ``size``-byte generation body (none of it sent)."""
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % size
    )


async def test_declared_lengths_reserve_nothing_until_their_bytes_arrive(front, upstream):
    """Connections declaring 4 MiB and sending nothing hold no body memory.

    Before, each reserved what 4 MiB could hold parsed (~15 MiB of the 48 MiB budget)
    from its head alone, for client_body_timeout_s: three or four such connections,
    reconnecting as they were cut, got every other body 503 after a 2 s wait.
    """
    base, proxy = await front(client_body_timeout_s=30)  # the default 48 MiB budget
    host, port = base.removeprefix("http://").split(":")
    writers: list[asyncio.StreamWriter] = []
    try:
        for _ in range(8):
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(_declaring(4 * MiB))
            await writer.drain()
            writers.append(writer)
        await asyncio.sleep(0.3)  # their heads are read, their bodies awaited
        assert proxy._bodies.held == 0
        # A 64 KiB prompt: ~3 MiB reserved before, more than the idle ones left.
        body = json.dumps({"prompt": "word " * (64 * 1024 // 5), "max_tokens": 5}).encode()
        started = time.monotonic()
        status, answer = await asyncio.wait_for(post(base, "/v1/completions", body), 1.5)
        assert status == 200, answer
        assert time.monotonic() - started < 1
        assert proxy.counters.upstream_errors["503"] == 0
    finally:
        for writer in writers:
            writer.close()
    await until(lambda: proxy._bodies.held == 0, timeout_s=5)


async def test_a_request_waiting_for_room_holds_no_body_memory(front, upstream):
    """A critical request waiting in projected admission gives its body share back first."""
    mitigations = Mitigations()
    mitigations.pool_tokens = 16  # one block: no request fits, a critical one waits
    base, proxy = await front(mitigations=mitigations, admission="projected", read_timeout_s=3.0)
    proxy.inflight.add(InflightRequest("running", "standard", 8, 8))  # the pool is taken
    body = json.dumps({"prompt": "x " * 20_000, "max_tokens": 100}).encode()

    async def critical() -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                base + "/v1/completions",
                data=body,
                headers={"Content-Type": "application/json", "X-Priority": "critical"},
            ) as resp,
        ):
            return resp.status, await resp.json()

    waiting = asyncio.ensure_future(critical())
    try:
        await until(lambda: proxy._admission.waiting == 1, timeout_s=2)
        assert proxy._bodies.held == 0  # it is parsed: its wait pins no body memory
    finally:
        status, answer = await asyncio.wait_for(waiting, 10)
    assert status == 503, answer  # no room came within read_timeout_s
    assert answer["error"]["code"] == "kv_pool_full"  # admission's own code


# ---------------------------------------------------------------------- slow clients
async def _open(base: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = base.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _closed_after(reader: asyncio.StreamReader, limit_s: float) -> tuple[float, bytes]:
    """Seconds until the server closes the connection (at most ``limit_s``); what it sent."""
    started = time.monotonic()
    data = await asyncio.wait_for(reader.read(), limit_s)  # reads to EOF
    return time.monotonic() - started, data


async def test_a_silent_connection_is_closed_within_the_header_timeout(front):
    """A connection that sends nothing: closed after ``client_header_timeout_s`` (0.5 s)."""
    base, _ = await front()
    reader, writer = await _open(base)
    try:
        took, data = await _closed_after(reader, 5)
    finally:
        writer.close()
    assert 0.4 < took < 1.5
    assert data == b""


async def test_a_trickled_head_is_cut(front):
    """One header byte every 0.1 s never completes a head: cut at the header timeout."""
    base, _ = await front()
    reader, writer = await _open(base)
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    started = time.monotonic()
    try:
        for byte in head:
            if reader.at_eof():
                break
            writer.write(bytes([byte]))
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.1)
        took = time.monotonic() - started
    finally:
        writer.close()
    assert reader.at_eof()
    assert took < 1.5


async def test_a_stalled_body_gets_408_and_the_connection_is_closed(front, upstream):
    """Half a body, then nothing: 408 after ``client_body_timeout_s``, and the socket closes."""
    base, proxy = await front(client_body_timeout_s=0.5)
    reader, writer = await _open(base)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": "'
        )
        await writer.drain()
        took, data = await _closed_after(reader, 5)
    finally:
        writer.close()
    assert data.startswith(b"HTTP/1.1 408 "), data[:100]
    assert b'"body_timeout"' in data
    assert 0.4 < took < 2
    assert upstream[1] == []
    assert proxy.counters.upstream_errors["408"] == 1


async def test_a_slow_body_that_keeps_the_minimum_rate_passes(front, upstream):
    """A body arriving at 4x ``client_body_min_rate`` is read, however long it takes."""
    base, _ = await front(client_body_timeout_s=0.3, client_body_min_rate=1000)
    body = json.dumps({"prompt": "x" * 1900, "max_tokens": 5}).encode()
    reader, writer = await _open(base)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        for start in range(0, len(body), 100):  # 100 bytes every 25 ms: 4000 B/s
            writer.write(body[start : start + 100])
            await writer.drain()
            await asyncio.sleep(0.025)
        _, data = await _closed_after(reader, 5)
    finally:
        writer.close()
    assert data.startswith(b"HTTP/1.1 200 "), data[:200]
    assert upstream[1] == [body]


async def test_an_idle_kept_alive_connection_is_closed(front):
    """After an answer, a connection idle for ``client_keepalive_s`` (0.5 s) is closed."""
    base, _ = await front(limits=ClientLimits(header_timeout_s=5, keepalive_s=0.5))
    reader, writer = await _open(base)
    try:
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 404 ")  # the engine's answer: it has no models
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        await asyncio.wait_for(reader.readexactly(length), 5)
        took, _ = await _closed_after(reader, 5)
    finally:
        writer.close()
    assert 0.3 < took < 2


async def test_kvguards_api_closes_silent_connections_too():
    """The header timeout holds for kvguard's own API (``listen`` applies it to both)."""
    config = parse_config({"engine": {"url": f"http://127.0.0.1:{free_port()}"}}, env={})
    daemon = Daemon(
        config, probes=Probes(engine=EngineProbe(config.engine.url), nvml=None, host=None)
    )
    runner = await listen(build_app(daemon), "127.0.0.1:0", limits=QUICK)
    try:
        reader, writer = await _open(f"http://127.0.0.1:{runner.addresses[0][1]}")
        try:
            took, _ = await _closed_after(reader, 5)
        finally:
            writer.close()
        assert took < 1.5
    finally:
        await runner.cleanup()
        await daemon.close()


async def test_sigterm_exits_within_the_grace_with_an_unfinished_body(sim_engine, tmp_path):
    """`kvguard run`: a request whose body never ends delays the exit by the grace (1 s) only.

    Before, aiohttp waited 60 s for that handler: SIGTERM took 62 s.
    """
    engine_url = await sim_engine()
    api, proxy_port = free_port(), free_port()
    config = tmp_path / "kvguard.toml"
    config.write_text(
        f'[engine]\nurl = "{engine_url}"\n[server]\nlisten = "127.0.0.1:{api}"\n'
        f'[proxy]\nenabled = true\nlisten = "127.0.0.1:{proxy_port}"\n'
        "shutdown_grace_s = 1\nclient_body_timeout_s = 120\n"
        '[log]\nformat = "json"\n'
    )
    log_path = tmp_path / "kvguard.log"
    with log_path.open("wb") as log_file:  # its log, every line checked strictly at the end
        proc = await asyncio.create_subprocess_exec(
            KVGUARD, "run", "--config", str(config), stderr=log_file
        )
    try:
        await until(lambda: _listening(proxy_port), timeout_s=20)
        _, writer = await asyncio.open_connection("127.0.0.1", proxy_port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        await writer.drain()
        await asyncio.sleep(0.5)  # the handler waits for the rest of the body
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 30)
        took = time.monotonic() - started
        writer.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 0
    logging.getLogger(__name__).info("exit after SIGTERM: %.2f s", took)
    assert took < 1 + 4  # the grace, and the rest of a clean stop
    said = [event["event"] for event in json_log_events(log_path)]
    assert said[-1] == "stopped", said
    assert "started" in said, said


async def _listening(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


# ---------------------------------------------------------------------- a flood
def flood_bodies(max_bytes: int, max_values: int) -> dict[str, tuple[str, bytes]]:
    """The largest bodies of each kind the limits let through, and the reviewer's one."""
    messages = [{"role": "user", "content": "hi"}] * (max_values // 3 - 10)
    return {
        "text": (
            "/v1/completions",
            json.dumps({"prompt": "word, " * ((max_bytes - 40) // 6), "max_tokens": 8}).encode(),
        ),
        "values": (  # the reviewer's: refused before it is parsed
            "/v1/chat/completions",
            b'{"messages":[' + b",".join([b"{}"] * ((max_bytes - 20) // 3)) + b"]}",
        ),
        "chat": ("/v1/chat/completions", json.dumps({"messages": messages}).encode()),
        "ids": (
            "/v1/completions",
            json.dumps({"prompt": list(range(10_000, 10_000 + max_values - 10))}).encode(),
        ),
        "floats": (
            "/v1/completions",
            b'{"prompt": "x", "logit_bias": [' + b",".join([b"1.5"] * (max_values - 10)) + b"]}",
        ),
    }


# What a flood of 32 connections holds that the body gate does not count: the bytes
# aiohttp has read from each socket but not handed over yet (~10 MiB measured) and
# what the allocator keeps from freed bodies (~10-15 MiB over the traced total).
FLOOD_UNCOUNTED = 32 * MiB


def _status_of(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` field in bytes (VmHWM: the peak resident set)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/PID/status")
async def test_a_flood_of_maximal_bodies_stays_in_memory_and_keeps_the_loop(upstream, tmp_path):
    """32 at once, 160 in all, each the largest of its kind, through `kvguard run`'s proxy.

    What the flood adds to kvguard's resting RSS stays within what the body gate lets
    bodies hold (max_body_memory, plus the one body that may pass it) and a fixed
    allowance for what the gate does not count (bytes aiohttp has buffered but not
    handed over, up to ~0.3 MiB a connection; the allocator's fragmentation); the peak
    stays under three quarters of the systemd unit's MemoryMax=256M; and its loop is
    never late by more than 100 ms (kvguard_event_loop_lag_max_seconds). Before, one
    10.5 MB body of empty objects took the RSS from 48 to 334 MB and stalled the loop
    1.66 s. (An absolute 128 MiB bound failed CI at 130.6 MiB once kvguard at rest had
    grown to ~55 MiB: the gate's own bound, 63 MiB over rest, left it no room.) Every
    answer is the engine's 200, a 400 for the body of too many values, or a 503 +
    Retry-After while the memory budget is full: never another 5xx.
    """
    url, seen = upstream
    api, proxy_port = free_port(), free_port()
    config = tmp_path / "kvguard.toml"
    config.write_text(
        f'[engine]\nurl = "{url}"\n[server]\nlisten = "127.0.0.1:{api}"\n'
        f'[proxy]\nenabled = true\nlisten = "127.0.0.1:{proxy_port}"\n[log]\nformat = "json"\n'
    )
    defaults = ProxySettings(upstream=url)
    bodies = flood_bodies(defaults.max_body_bytes, defaults.max_body_values)
    log_path = tmp_path / "kvguard.log"
    with log_path.open("wb") as log_file:  # its log, every line checked strictly at the end
        proc = await asyncio.create_subprocess_exec(
            KVGUARD, "run", "--config", str(config), stderr=log_file
        )
    answers: Counter[tuple[str, int]] = Counter()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:

            async def metrics() -> str:
                async with http.get(f"http://127.0.0.1:{api}/metrics") as resp:
                    return await resp.text()

            await until(lambda: _listening(api), timeout_s=20)
            await until(lambda: _listening(proxy_port), timeout_s=20)
            assert _sample(await metrics(), "kvguard_event_loop_lag_max_seconds") < 0.1
            resting = _status_of(proc.pid, "VmRSS")
            at_once = asyncio.Semaphore(32)

            async def send(kind: str) -> None:
                path, body = bodies[kind]
                async with (
                    at_once,
                    http.post(
                        f"http://127.0.0.1:{proxy_port}{path}",
                        data=io.BytesIO(body),
                        headers={"Content-Type": "application/json"},
                    ) as resp,
                ):
                    await resp.read()
                    answers[(kind, resp.status)] += 1
                    if resp.status == 503:
                        assert resp.headers["Retry-After"] == "1"

            await asyncio.wait_for(
                asyncio.gather(*(send(kind) for _ in range(32) for kind in bodies)), 120
            )
            lag = _sample(await metrics(), "kvguard_event_loop_lag_max_seconds")
            peak = _status_of(proc.pid, "VmHWM")
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
    assert "started" in [event["event"] for event in json_log_events(log_path)]
    measured = (
        f"peak RSS {peak / MiB:.1f} MiB ({resting / MiB:.1f} at rest),"
        f" loop lag max {lag * 1000:.0f} ms, {dict(answers)}"
    )
    logging.getLogger(__name__).info("flood: %s", measured)  # shown with -o log_cli=true
    assert sum(answers.values()) == 32 * len(bodies)
    assert {status for _, status in answers} <= {200, 400, 503}
    assert {kind for kind, status in answers if status == 400} <= {"values"}
    assert answers[("values", 200)] == 0
    for kind in ("text", "chat", "ids", "floats"):
        assert answers[(kind, 200)] > 0, (kind, dict(answers))
    assert len(seen) == sum(n for (_, status), n in answers.items() if status == 200)
    gate = defaults.max_body_memory + body_memory(
        defaults.max_body_bytes, defaults.max_body_values, defaults
    )
    assert peak - resting < gate + FLOOD_UNCOUNTED, measured
    assert peak < 192 * MiB, measured
    assert lag <= 0.1, measured
