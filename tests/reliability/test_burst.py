"""A burst of ten times the engine's concurrency through kvguard's proxy, on 127.0.0.1.

The simulated engine runs ``max_num_seqs`` = 16 requests at once: that is the
proxy's normal concurrency in front of it. After a calm phase at that concurrency,
160 clients send closed-loop traffic for a few seconds (bounded in time and count).
The live daemon escalates and the proxy sheds. Asserted: no crash and no client
left without an answer; critical traffic all served; shed answers fast (held for
room at most ``shed_wait_s``, the rest at once); the requests held for room stay
within their bound while the burst lasts, and everything the proxy tracked is
released after it; the daemon kept ticking; memory and descriptors come back down.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import psutil
import pytest

from kvguard.actuators.proxy import HELD_POOLS, AdmissionProxy
from kvguard.runtime.inprocess import start_guard
from kvguard.sim.engine import TimeModel
from kvguard.sim.runner import PoolSpec, size_pool, start_sim_server
from tests.helpers import until

# Long wall-clock runs (20 s to minutes): the second stage of scripts/test.sh.
pytestmark = pytest.mark.slow

NORMAL = 16  # the engine's max_num_seqs: what it runs at once
BURST = 10 * NORMAL
POOL = PoolSpec(
    kv_capacity_tokens=8_192, max_model_len=4096, max_num_seqs=NORMAL, max_num_batched_tokens=2048
)
CALM_S = 2.0
BURST_S = 5.0
MAX_REQUESTS = 4_000  # per phase: a bound on the count as well as the time
SHED_WAIT_S = 2.0  # the proxy's default: a shed-class request is held this long at most
# CI's two cores run the 160 clients, the proxy and the engine on one loop: an answer
# can sit a while in the clients' queue (seen at most 2.3 s in all, idle).
SLOW_MARGIN_S = 3.0
RSS_GROWTH_LIMIT = 64 * 2**20
PRIORITIES = ("sheddable", "standard", "standard", "sheddable", "critical") * 4


@dataclass
class Answer:
    """One request's end, as its client saw it."""

    priority: str
    status: int | None  # None: no HTTP answer (a connection error or a timeout)
    code: str | None  # the error body's code, for refusals
    seconds: float


async def send(http: aiohttp.ClientSession, url: str, priority: str, n: int) -> Answer:
    """One completion through the proxy; whatever happens becomes an :class:`Answer`."""
    body = {"prompt": f"request {n} " + "word " * 300, "max_tokens": 200}
    began = time.monotonic()
    try:
        async with http.post(
            f"{url}/v1/completions", json=body, headers={"X-Priority": priority}
        ) as resp:
            payload = await resp.json(content_type=None)
            code = None
            if resp.status != 200 and isinstance(payload, dict):
                code = (payload.get("error") or {}).get("code")
            return Answer(priority, resp.status, code, time.monotonic() - began)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return Answer(priority, None, None, time.monotonic() - began)


async def drive(url: str, workers: int, seconds: float, proxy: AdmissionProxy) -> dict[str, Any]:
    """``workers`` closed-loop clients for ``seconds``; answers and the proxy's peaks."""
    answers: list[Answer] = []
    numbers = itertools.count()
    deadline = time.monotonic() + seconds
    peaks = {"waiting": 0, "held_tokens": 0}

    async def client(first: int) -> None:
        while time.monotonic() < deadline:
            n = next(numbers)
            if n >= MAX_REQUESTS:
                return
            answers.append(await send(http, url, PRIORITIES[(first + n) % len(PRIORITIES)], n))

    async def watch() -> None:
        while True:
            peaks["waiting"] = max(peaks["waiting"], proxy.waiting)
            peaks["held_tokens"] = max(peaks["held_tokens"], proxy._admission.held_tokens)
            await asyncio.sleep(0.02)

    connector = aiohttp.TCPConnector(limit=0)  # every client its own connection
    timeout = aiohttp.ClientTimeout(total=30.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.gather(*(client(i) for i in range(workers)))
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    return {"answers": answers, **peaks}


def pooled_upstream(proxy: AdmissionProxy) -> int:
    """Idle keep-alive connections in the proxy's upstream pool (bounded at 100)."""
    connector = proxy._session.connector if proxy._session is not None else None
    return sum(len(idle) for idle in getattr(connector, "_conns", {}).values())


async def test_a_burst_of_ten_times_the_engines_concurrency_is_shed_fast_and_bounded() -> None:  # noqa: PLR0915
    """No crash, no lost request, critical served, sheds fast, held bounded, all released."""
    process = psutil.Process()
    server = await start_sim_server(
        size_pool(POOL), time_model=TimeModel(step_fixed_s=0.004, per_token_s=0.00002)
    )
    guard = await start_guard(
        server.url,
        poll={"interval_s": 0.25, "min_interval_s": 0.1, "timeout_s": 1.0},
        # The ladder's shed and its hold for room, and their bounds, are what this
        # measures: admission (on by default) is off here; its own burst tests are
        # tests/actuators/test_observed_admission.py and tests/test_proxy_efficacy.py.
        proxy={"shed_wait_s": SHED_WAIT_S, "admission": "off"},
    )
    daemon, proxy, url = guard.daemon, guard.proxy, guard.proxy_url
    assert proxy is not None
    assert url is not None
    guard.run_in_background()
    try:
        calm = await drive(url, NORMAL, CALM_S, proxy)
        assert calm["answers"]
        assert all(a.status == 200 for a in calm["answers"])  # the engine has room at 16
        gc.collect()
        rss_before, fds_before = process.memory_info().rss, process.num_fds()
        ticks_before = daemon.state.ticks_total

        burst = await drive(url, BURST, BURST_S, proxy)
        ticks_during = daemon.state.ticks_total - ticks_before
        answers: list[Answer] = burst["answers"]

        # Every client got an HTTP answer; nothing crashed.
        assert len(answers) >= BURST
        assert [a for a in answers if a.status is None] == []
        assert not server.crashed.is_set()
        assert {a.status for a in answers} <= {200, 400, 503}
        refused = [a for a in answers if a.status == 400]
        assert all(a.code == "kv_window_exceeded" for a in refused), refused[:3]
        # Critical traffic is never shed.
        critical = [a for a in answers if a.priority == "critical"]
        assert critical
        assert all(a.status == 200 for a in critical), [a for a in critical if a.status != 200]
        # The burst made kvguard shed, and shed answers came fast: held for room at most
        # shed_wait_s, the excess over the held bound at once.
        shed = [a for a in answers if a.status == 503]
        assert len(shed) >= BURST // 4, f"{len(shed)} shed of {len(answers)}"
        assert all(a.code == "kv_cache_pressure" for a in shed)
        assert max(a.seconds for a in shed) <= SHED_WAIT_S + SLOW_MARGIN_S
        # Most are held their whole shed_wait_s now (the ladder sheds only while the
        # cache binds, so fewer pile past the held bound to be shed at once): the
        # median is at most the hold plus the loaded loop's slack.
        quick = sorted(a.seconds for a in shed)[len(shed) // 2]
        assert quick < SHED_WAIT_S + 0.5, f"median shed answer took {quick:.2f} s"
        # Memory stays bounded: what is held for room never passes its bound (the
        # check comes before a request's own projection is added: one request over).
        pool = daemon.brain.mitigations.pool_tokens
        assert pool is not None
        one_request = 2 * 16 * 32  # prompt + max_tokens rounded up to blocks, generously
        shed_ratio = daemon.config.proxy.shed_ratio
        assert burst["held_tokens"] <= pool * shed_ratio * HELD_POOLS + one_request
        assert 0 < burst["waiting"] < BURST
        # The daemon kept ticking (0.25 s apart, faster while escalating; idle: 130 in
        # 5 s). A quarter of the plain rate allows for scrapes slowed by the loaded loop.
        assert ticks_during >= BURST_S / 0.25 / 4
        assert daemon.state.loop_stalls_total == 0

        # Afterwards everything the proxy tracked is released, the engine drains,
        # and memory and descriptors come back down.
        assert proxy.waiting == 0
        assert proxy._admission.held_tokens == 0
        # Connections close asynchronously: each of these settles within seconds.
        await until(lambda: len(proxy.inflight) == 0, interval_s=0.05)
        await until(lambda: not server.engine.scheduler.has_work, interval_s=0.05)
        gc.collect()
        assert process.memory_info().rss - rss_before < RSS_GROWTH_LIMIT
        await until(
            lambda: process.num_fds() - 2 * pooled_upstream(proxy) <= fds_before + 8,
            interval_s=0.05,
            what=lambda: (
                f"fds {process.num_fds()} ({pooled_upstream(proxy)} pooled), {fds_before} before"
            ),
        )

        # And a request after the burst is served as before.
        async with aiohttp.ClientSession() as http:
            after = await send(http, url, "critical", 0)
        assert after.status == 200
    finally:
        await guard.close()
        await server.stop()
