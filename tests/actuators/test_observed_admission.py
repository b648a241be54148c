"""Admission "observed" (the default): answers reserved at what their kind really uses.

Against the simulated engine on 127.0.0.1, whose answers end at the body's
``kvguard_sim_output_tokens`` (a true length under ``max_tokens``, as real answers
stop before the client's over-ask).
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Awaitable
from typing import Any

import aiohttp
import pytest

from kvguard.actuators.accounting import InflightRequest
from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
from kvguard.sim.openai_api import SIM_OUTPUT_TOKENS_FIELD
from tests.helpers import until


@pytest.fixture
async def proxy_to(serve):
    """A proxy in front of an upstream, served on 127.0.0.1: (URL, proxy)."""

    async def start(upstream: str, mitigations: Mitigations, **settings):
        proxy = AdmissionProxy(ProxySettings(upstream=upstream, **settings), mitigations)
        return await serve(proxy.app(), cancel=True), proxy

    return start


_prompts = itertools.count()


def body(prompt_words: int, max_tokens: int | None, output: int, **extra) -> dict:
    """A /v1/completions body whose answer really is ``output`` tokens long.

    Each prompt differs (its first word), so none is found in the proxy's count cache.
    """
    words = [f"w{next(_prompts)}"] + ["word"] * (prompt_words - 1)
    out = {"prompt": " ".join(words), SIM_OUTPUT_TOKENS_FIELD: output, **extra}
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    return out


async def _learn(http: aiohttp.ClientSession, url: str, answers: int) -> None:
    """``answers`` whole answers of 40 tokens, asked with max_tokens 1,500."""
    for _ in range(answers):
        async with http.post(f"{url}/v1/completions", json=body(100, 1500, 40)) as resp:
            assert resp.status == 200
            assert (await resp.json())["usage"]["completion_tokens"] == 40


async def test_an_over_asking_client_is_reserved_what_its_answers_use(sim_server, proxy_to):
    """Five answers of 40 tokens seen: the sixth request reserves 40, not its max_tokens 1,500."""
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=2048, per_token_s=0.002)
    mitigations = Mitigations(pool_tokens=4000, block_size=16)
    url, proxy = await proxy_to(
        server.url, mitigations, reserve_min_samples=5, reserve_quantile=1.0, admission_wait_s=2
    )
    assert proxy.settings.admission == "observed"  # the default
    async with aiohttp.ClientSession() as http:
        # The prior: nothing seen yet, so the first reserves its whole max_tokens.
        first = asyncio.ensure_future(http.post(f"{url}/v1/completions", json=body(100, 1500, 40)))
        running = await _one_in_flight(proxy)
        # The prompt is the proxy's estimate (it errs high; the engine's count comes
        # with the answer): admission waits for the engine's count only when it decides.
        assert running.prompt_tokens >= 100
        assert running.reserved_output == 1500
        assert running.projected_tokens == running.prompt_tokens + 1500
        (await first).close()
        await _learn(http, url, 4)
        later = asyncio.ensure_future(http.post(f"{url}/v1/completions", json=body(100, 1500, 40)))
        running = await _one_in_flight(proxy)
        assert running.reserved_output == 40
        # The prompt's estimate, scaled by what the engine counted for the last five
        # (100 each, from their answers' usage), is what it really holds.
        assert running.prompt_estimate is not None
        assert running.prompt_estimate > 100
        assert 100 <= running.prompt_tokens <= 102
        assert running.projected_tokens == running.prompt_tokens + 40
        assert running.reserved_from == "p100 output 40 tokens (of 5 answers)"
        (await later).close()
        # Ten such requests at once fit the 4,000-token pool (10 x ~210 in whole
        # blocks); reserved at max_tokens, two would, and the rest would wait or be shed.
        ten = asyncio.gather(*(_complete(http, url, body(100, 1500, 40)) for _ in range(10)))
        most = await _most_in_flight(proxy, ten)
    assert most >= 5, most  # at max_tokens, at most 2 at a time
    assert proxy.counters.shed == {}


async def test_answers_stopped_by_a_small_max_tokens_do_not_shrink_a_large_request(
    sim_server, proxy_to
):
    """One-token probes on a route do not make its 600-token answers reserved at one token.

    Each probe's answer ran to its max_tokens of 1: all it says is that it would have
    run longer. Learned as a length, a burst on the same route was reserved one token
    an answer and admitted twice over the pool (found by the overhead benchmark's
    reaction trial: the engine's pool filled, with nothing waiting).
    """
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=2048, per_token_s=0.002)
    mitigations = Mitigations(pool_tokens=4000, block_size=16)
    url, proxy = await proxy_to(
        server.url, mitigations, reserve_min_samples=5, reserve_quantile=0.95, admission_wait_s=2
    )
    async with aiohttp.ClientSession() as http:
        for _ in range(8):
            probe = body(2, 1, 1)
            async with http.post(f"{url}/v1/completions", json=probe) as resp:
                assert resp.status == 200
                assert (await resp.json())["usage"]["completion_tokens"] == 1
        large = asyncio.ensure_future(http.post(f"{url}/v1/completions", json=body(100, 600, 40)))
        running = await _one_in_flight(proxy)
        assert running.reserved_output == 600
        assert running.reserved_from == "600 output tokens (max_tokens)"
        (await large).close()
        # Answers that ended on their own, under their max_tokens, are lengths again.
        await _learn(http, url, 5)
        later = asyncio.ensure_future(http.post(f"{url}/v1/completions", json=body(100, 600, 40)))
        running = await _one_in_flight(proxy)
        assert running.reserved_output == 40
        (await later).close()


async def test_prompts_dense_in_tokens_are_counted_before_they_fill_the_pool(sim_server, proxy_to):
    """Three 1,400-byte CSVs of digits (1,400 tokens, estimated at 467) into a 4,000-token pool.

    Admitted at their estimates, all three went in together and the engine (one that
    dies when its pool runs out) died in their prefill. A prompt that may hold more
    than an eighth of the pool at one token a byte is counted first: two run, the
    third waits for room, none is lost.
    """
    server = await sim_server(
        kv_capacity_tokens=4096, max_model_len=2048, per_token_s=0.0005, oom_on_exhaust=True
    )
    mitigations = Mitigations(pool_tokens=4000, block_size=16)
    url, proxy = await proxy_to(server.url, mitigations, admission_wait_s=10)

    def dense(salt: int) -> dict:
        digits = ",".join(str((i * 7 + salt) % 10) for i in range(700))[:1400]
        return {"prompt": digits, "max_tokens": 50, SIM_OUTPUT_TOKENS_FIELD: 50}

    async with aiohttp.ClientSession() as http:
        work = asyncio.gather(*(_complete(http, url, dense(salt)) for salt in range(3)))
        most = await _most_in_flight(proxy, work)
    assert not server.crashed.is_set(), server.crash_messages
    assert most == 2, most
    assert proxy.counters.shed == {}


async def test_many_sequences_reserve_each_and_a_request_that_cannot_fit_is_told_why(
    sim_server, proxy_to
):
    """``n`` = 200 reserves 200 answers; more than the pool holds: 503 at once, with the figures."""
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=2048)
    mitigations = Mitigations(pool_tokens=4000, block_size=16)
    url, proxy = await proxy_to(
        server.url, mitigations, reserve_min_samples=5, reserve_quantile=1.0, admission_wait_s=0.2
    )
    async with aiohttp.ClientSession() as http:
        await _learn(http, url, 5)
        async with http.post(
            f"{url}/v1/completions",
            json=body(10, 1500, 40, n=200),
            headers={"X-Priority": "standard", "X-Request-Id": "ticket-4711"},
        ) as resp:
            assert resp.status == 503
            assert resp.headers["Retry-After"]
            assert resp.headers["X-Request-Id"] == "ticket-4711"  # the id the log names
            error = (await resp.json())["error"]
            # Its own code, not the ladder's kv_cache_pressure: the level may well be ok.
            assert error["code"] == "kv_pool_full"
            message = error["message"]
    # 200 sequences x (the prompt's estimate + 40 answer): at least 10,000 tokens, more
    # than the pool can ever give it: refused at once, not after the wait.
    projected = re.search(
        r"it alone reserves ([\d,]+) tokens, more than the 3,800 KV tokens admission fills"
        r" \(0.95 of the 4,000-token pool\)",
        message,
    )
    assert projected is not None, message
    assert int(projected.group(1).replace(",", "")) >= 200 * (10 + 40)
    assert "reserved at p100 output 40 tokens (of 5 answers)" in message
    assert proxy.counters.shed[("standard", "kv_pool_full")] == 1


async def test_no_max_tokens_reserves_the_room_the_context_leaves(sim_server, proxy_to):
    """Without max_tokens or anything learned, the answer may fill the engine's context."""
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=2048, per_token_s=0.01)
    mitigations = Mitigations(pool_tokens=4000, block_size=16, context_tokens=2048)
    url, proxy = await proxy_to(server.url, mitigations)
    async with aiohttp.ClientSession() as http:
        request = asyncio.ensure_future(http.post(f"{url}/v1/completions", json=body(48, None, 20)))
        running = await _one_in_flight(proxy)
        assert running.reserved_output == 2048 - running.prompt_tokens
        assert running.reserved_from == f"{running.reserved_output} output tokens (context)"
        (await request).close()


async def _one_in_flight(proxy: AdmissionProxy):
    for _ in range(500):
        requests = list(proxy.inflight)
        if requests:
            return requests[0]
        await asyncio.sleep(0.005)
    raise AssertionError("no request reached the engine")


async def _complete(http: aiohttp.ClientSession, url: str, payload: dict) -> None:
    """POST one completion through the proxy at ``url``: it must be answered 200, in whole."""
    async with http.post(f"{url}/v1/completions", json=payload) as resp:
        assert resp.status == 200
        await resp.read()


async def _most_in_flight(proxy: AdmissionProxy, work: Awaitable[object]) -> int:
    """Await ``work`` while watching ``proxy``: the most requests it had in flight at once."""
    most = 0

    async def watch() -> None:
        nonlocal most
        while True:
            most = max(most, len(proxy.inflight))
            await asyncio.sleep(0.002)

    watcher = asyncio.ensure_future(watch())
    try:
        await work
    finally:
        watcher.cancel()
    return most


def test_an_answer_past_its_learned_length_is_reserved_ahead_of_it():
    """The traffic changed: an answer outran its peers' p95; reserved ahead of it, to max_tokens."""
    tracked = InflightRequest("r", "standard", prompt_tokens=100, max_tokens=2000)
    tracked.reserved_output, tracked.output_ceiling = 50, 2000
    assert tracked.projected_tokens == 150
    tracked.generated = 50
    assert tracked.projected_tokens == 150
    tracked.generated = 51
    assert tracked.projected_tokens == 100 + 102  # twice what it holds
    tracked.generated = 1500
    assert tracked.projected_tokens == 2100  # at most its ceiling
    # Reserved at max_tokens from the start (no estimate): it only grows with what it holds.
    plain = InflightRequest("p", "standard", prompt_tokens=100, max_tokens=2000)
    plain.generated = 51
    assert plain.projected_tokens == 2100


def test_each_tick_an_answer_past_its_learned_length_is_reserved_at_what_longer_ones_reach():
    """Past its learned length, an answer is reserved at the quantile of those longer than it.

    Of 520 answers of its kind, 500 ended at 40 tokens and 20 at 900-1,280: p95 is 40
    at admission, so a long one is admitted at 40. Each tick, one that ran past that
    is reserved again at the p95 of the answers longer than what it has written; one
    longer than all but a handful (fewer than 1 / (1 - p95) = 20), at its ceiling.
    """
    mitigations = Mitigations(pool_tokens=8000, block_size=16)
    settings = ProxySettings(
        upstream="http://127.0.0.1:9", reserve_min_samples=20, reserve_window=1000
    )
    proxy = AdmissionProxy(settings, mitigations)
    kind = ("m", "/v1/completions", "standard")
    long_ones = list(range(900, 1300, 20))
    for tokens in [40] * 500 + long_ones:
        proxy.lengths.observe(kind, tokens, tokens + 100)
    assert proxy.lengths.estimate(kind).tokens == 40  # type: ignore[union-attr]

    def admitted(generated: int) -> InflightRequest:
        tracked = InflightRequest("r", "standard", prompt_tokens=100, max_tokens=2000)
        tracked.kind, tracked.reserved_output, tracked.output_ceiling = kind, 40, 2000
        tracked.generated = generated
        proxy.inflight.add(tracked)
        return tracked

    within = admitted(30)
    past = admitted(300)
    beyond_all = admitted(1300)
    # The tick's review; nothing is cancelled (the engine's count is not known here).
    assert proxy.review_reservations() == 0
    assert within.reserved_output == 40  # not past its reservation: unchanged
    # Longer than 300: the 20 long ones ended and the one running at 1,300. Kaplan-
    # Meier over those 21: p95 is the last long one to end, 1,280.
    assert past.reserved_output == 1280
    assert past.reserved_from == "p95 output 1280 tokens of the answers of its kind longer than 300"
    assert past.projected_tokens == 100 + 1280
    # Past every answer seen to end: nothing to learn its end from, its ceiling.
    assert beyond_all.reserved_output == 2000
    assert "its ceiling" in beyond_all.reserved_from
    proxy.inflight.done(beyond_all)
    past.reserved_output = 40
    proxy.review_reservations()
    # Without it: 20 ended and `past` itself at risk, p95 the 19th to end.
    assert past.reserved_output == 1260


def _streaming(name: str, priority: str, prompt: int, written: int) -> InflightRequest:
    """A streamed answer in flight within its reservation (1,000 of a 2,000 ceiling)."""
    tracked = InflightRequest(name, priority, prompt_tokens=prompt, max_tokens=2000)
    tracked.reserved_output, tracked.output_ceiling = 1000, 2000
    tracked.streamed, tracked.generated = True, written
    tracked.cancel = lambda: None
    return tracked


def test_when_the_set_runs_past_its_quantile_the_largest_holding_the_pool_goes():
    """None past its own reservation, but together they would fill the pool before kvguard acts.

    Three streamed answers hold 6,600 of an 8,000-token pool, read every 0.5 s, and
    each writes 100 tokens between readings: 300 per 0.5 s. The pool must last 1 s
    (two readings). At 7,400 held it does (8,000); at 7,500 it does not (8,100): the
    largest of the lowest class goes — not the critical one, and not one past its
    reservation (there is none). A jump of the engine's count that the answers did
    not write (prompts just admitted) is not growth to come, and where kvguard can
    look again sooner (0.2 s) the same count waits for that reading.
    """
    mitigations = Mitigations(pool_tokens=8000, block_size=16)
    proxy = AdmissionProxy(ProxySettings(upstream="http://127.0.0.1:9"), mitigations)
    small = _streaming("small", "standard", prompt=1000, written=500)
    large = _streaming("large", "standard", prompt=2000, written=300)
    critical = _streaming("critical", "critical", prompt=2000, written=800)
    for tracked in (small, large, critical):
        proxy.inflight.add(tracked)
    assert proxy.inflight.projected_tokens(16) > 8000  # each at its reservation: no fit
    clock = iter(range(100))

    def tick(used: int, wrote: int, ahead_s: float = 1.0) -> int:
        for tracked in (small, large, critical):
            if not tracked.cancelled:
                tracked.generated += wrote
        mitigations.engine_used_tokens = used
        return proxy.review_reservations(next(clock) * 0.5, ahead_s)

    assert tick(6600, 0) == 0  # the first reading: no growth known yet
    # The engine jumped 1,100 (a prompt came in) but the answers wrote nothing: no growth.
    assert tick(7700, 0) == 0
    assert tick(7400, 100) == 0  # 7,400 + 2 x 300 = 8,000: it lasts two readings
    assert tick(7500, 100, ahead_s=0.2) == 0  # 7,500 + 300 x 0.4: it lasts to 0.2 s
    assert tick(7500, 100) == 1  # 7,500 + 600 > 8,000
    assert large.cancelled
    assert large.cancel_reason == "overrun"
    assert not small.cancelled
    assert not critical.cancelled
    assert proxy.counters.cancelled["overrun"] == 1


def _guarded(*requests: InflightRequest) -> tuple[AdmissionProxy, Mitigations]:
    """A proxy before an 8,000-token pool with ``requests`` in flight."""
    mitigations = Mitigations(pool_tokens=8000, block_size=16)
    proxy = AdmissionProxy(ProxySettings(upstream="http://127.0.0.1:9"), mitigations)
    for tracked in requests:
        proxy.inflight.add(tracked)
    return proxy, mitigations


def _readings(
    proxy: AdmissionProxy, mitigations: Mitigations, *steps: tuple[int, int]
) -> list[int]:
    """Ticks 0.5 s apart: each (engine's count, tokens each answer wrote since); cancels."""
    cancels = []
    for index, (used, wrote) in enumerate(steps):
        for tracked in proxy.inflight:
            if not tracked.cancelled:
                tracked.generated += wrote
        mitigations.engine_used_tokens = used
        cancels.append(proxy.review_reservations(index * 0.5, 1.0))
    return cancels


def test_a_critical_answer_goes_only_when_nothing_else_would_keep_the_engine_alive():
    """All in flight critical and the pool about to run out: the largest critical answer goes.

    An engine that fails on exhaustion loses every answer in flight, the critical ones
    too: cutting one keeps the others. Beside a standard answer large enough to free
    the room, that one goes and no critical answer does.
    """
    small = _streaming("small", "critical", prompt=1000, written=500)
    large = _streaming("large", "critical", prompt=2000, written=300)
    other = _streaming("other", "critical", prompt=2000, written=800)
    proxy, mitigations = _guarded(small, large, other)
    # 7,400 + 2 x 300 lasts two readings: nothing is cut; at 7,500 it would not.
    assert _readings(proxy, mitigations, (6600, 0), (7400, 100), (7500, 100)) == [0, 0, 1]
    assert [r.request_id for r in (small, large, other) if r.cancelled] == ["other"]

    # With a standard answer that frees enough, it goes instead.
    standard = _streaming("standard", "standard", prompt=1000, written=500)
    critical = [_streaming(f"c{i}", "critical", prompt=2000, written=800) for i in range(2)]
    proxy, mitigations = _guarded(standard, *critical)
    assert _readings(proxy, mitigations, (6600, 0), (7500, 100)) == [0, 1]
    assert standard.cancelled
    assert not any(r.cancelled for r in critical)

    # Where the answers in flight end at their caps before the pool runs out (the
    # growth ahead read as linear says it would not last), no critical one is cut.
    ending = []
    for name, prompt, written, cap in (("a", 2000, 900, 1050), ("b", 1800, 900, 1100)):
        tracked = _streaming(name, "critical", prompt=prompt, written=written)
        tracked.output_ceiling = tracked.max_tokens = cap
        ending.append(tracked)
    longer = _streaming("c", "critical", prompt=1300, written=400)
    longer.output_ceiling = longer.max_tokens = 1000
    proxy, mitigations = _guarded(*ending, longer)
    # 7,600 held and 300 written a reading: 8,200 within two readings, past the pool;
    # but a and b end within 50 and 100 steps, and at most 7,800 is ever held.
    assert _readings(proxy, mitigations, (7300, 0), (7600, 100)) == [0, 0]
    assert not any(r.cancelled for r in (*ending, longer))

    # Where even cutting every answer would not make the pool last (the engine holds
    # far more than kvguard's requests: traffic that bypasses it), no critical one goes.
    critical = [_streaming(f"c{i}", "critical", prompt=500, written=100) for i in range(2)]
    proxy, mitigations = _guarded(*critical)
    assert _readings(proxy, mitigations, (9000, 0), (9500, 100)) == [0, 0]
    assert not any(r.cancelled for r in critical)


def test_answers_that_do_not_stream_are_cancelled_when_the_engine_holds_more_than_reserved():
    """Whole answers admitted at a short learned length grow unseen: the engine's count shows it.

    Three answers that do not stream, reserved at 50 tokens each, while the engine's
    count climbs to 3,700 of a 4,000-token pool: kvguard sees none of them write, but
    the engine holds far more than everything reserved. What it holds beyond the
    prompts is shared among them (about 1,200 each), so cancelling one is known to free
    that much: one goes, not all three, and never while the count stays within the
    reservations (prompts just admitted into room reserved for them).
    """
    mitigations = Mitigations(pool_tokens=4000, block_size=16)
    proxy = AdmissionProxy(ProxySettings(upstream="http://127.0.0.1:9"), mitigations)
    answers = []
    for name in ("first", "second", "third"):
        tracked = InflightRequest(name, "standard", prompt_tokens=32, max_tokens=1900)
        tracked.reserved_output, tracked.output_ceiling = 50, 1900
        tracked.cancel = lambda: None
        proxy.inflight.add(tracked)
        answers.append(tracked)
    assert proxy.inflight.projected_tokens(16) < 4000  # the reservations fit
    clock = iter(range(100))

    def tick(used: int) -> int:
        mitigations.engine_used_tokens = used
        return proxy.review_reservations(next(clock) * 0.5, 1.0)

    assert tick(96) == 0  # the prompts
    assert tick(240) == 0  # within what is reserved: prompts and the first tokens
    # Past the reservations, 400 more each half second, but the pool lasts the next
    # second (two readings): nothing goes.
    for used in (600, 1000, 1400, 1800, 2200, 2600, 3000):
        assert tick(used) == 0, used
    assert not any(t.cancelled for t in answers)
    assert tick(3300) == 0  # 3,300 + 2 x 300 = 3,900: it lasts
    assert tick(3700) == 1  # 3,700 + 2 x 400 > 4,000: one goes, freeing about 1,200
    assert sum(t.cancelled for t in answers) == 1
    assert proxy.counters.cancelled["overrun"] == 1


def test_answers_unseen_beside_streams_reserved_at_their_ceiling_still_count():
    """Whole answers beside streams reserved at their ceiling may be anywhere up to theirs.

    Two streams re-reserved at 1,700 and three whole answers at a learned 50: together
    3,700 of a 4,000-token pool, and the engine holds 3,600 — within what is reserved,
    so it looked like prompts admitted into reserved room and nothing was cancelled;
    the whole answers had grown unseen and the engine died (an adversarial client run,
    3 of 3). What an unseen answer may reach is its ceiling: at this rate (five
    answers, 100 steps a reading) the pool does not last two readings, and one goes.
    """
    mitigations = Mitigations(pool_tokens=4000, block_size=16)
    proxy = AdmissionProxy(ProxySettings(upstream="http://127.0.0.1:9"), mitigations)
    streams = [_streaming(f"s{i}", "standard", prompt=30, written=1000) for i in range(2)]
    for tracked in streams:
        tracked.reserved_output, tracked.outran = 1700, True
    whole = []
    for i in range(3):
        tracked = InflightRequest(f"w{i}", "standard", prompt_tokens=30, max_tokens=1900)
        tracked.reserved_output, tracked.output_ceiling = 50, 1900
        tracked.cancel = lambda: None
        whole.append(tracked)
    for tracked in (*streams, *whole):
        proxy.inflight.add(tracked)
    # The reservations (in whole blocks) fit the pool and cover the engine's 3,600.
    assert 3600 <= proxy.inflight.projected_tokens(16) <= 4000
    clock = iter(range(100))

    def tick(used: int) -> int:
        for tracked in streams:
            if not tracked.cancelled:
                tracked.generated += 100
        mitigations.engine_used_tokens = used
        return proxy.review_reservations(next(clock) * 0.5, 1.0)

    assert tick(3100) == 0  # the first reading: no growth known yet
    assert tick(3600) >= 1  # 3,600 + 2 x 500 > 4,000
    assert proxy.counters.cancelled["overrun"] >= 1


def test_an_engine_that_preempts_is_left_to_preempt():
    """The same overrun on an engine that preempts: nothing is cancelled.

    The engine preempts the newest answer and resumes it once room frees (a stall for
    one client); a cancel would lose that answer. The reading goes on (the growth
    since the last reading is known) so that, told the engine fails, kvguard cancels
    on the next reading.
    """
    mitigations = Mitigations(pool_tokens=8000, block_size=16, kv_exhaustion="preempt")
    proxy = AdmissionProxy(ProxySettings(upstream="http://127.0.0.1:9"), mitigations)
    answers = [_streaming(f"a{i}", "standard", prompt=2000, written=300) for i in range(3)]
    for tracked in answers:
        proxy.inflight.add(tracked)

    def tick(at: float, used: int) -> int:
        for tracked in answers:
            tracked.generated += 100
        mitigations.engine_used_tokens = used
        return proxy.review_reservations(at, 1.0)

    assert tick(0.0, 7000) == 0
    assert tick(0.5, 7500) == 0  # 7,500 + 2 x 300 > 8,000: it would preempt
    assert tick(1.0, 7600) == 0
    assert not any(tracked.cancelled for tracked in answers)
    mitigations.kv_exhaustion = "fail"
    assert tick(1.5, 7700) == 1


async def test_room_goes_to_the_highest_class_then_the_newest(sim_server, proxy_to):
    """One request fills the pool; when it ends, critical goes first, then the newest standard.

    Nothing is learned yet (each reserves its max_tokens): a sheddable request that came
    while a standard one waited waits too (a 503 at once would be a false alarm of the
    prior, see the next test), and goes last.
    """
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=2048, per_token_s=0.002)
    mitigations = Mitigations(pool_tokens=1000, block_size=16)
    url, proxy = await proxy_to(server.url, mitigations, admission_ratio=1.0, admission_wait_s=10)
    order: list[str] = []

    async def send(http: aiohttp.ClientSession, name: str, priority: str) -> None:
        # Nothing learned yet: each reserves its max_tokens (700), so one at a time.
        async with http.post(
            f"{url}/v1/completions", json=body(10, 700, 30), headers={"X-Priority": priority}
        ) as resp:
            assert resp.status == 200
            await resp.read()
            order.append(name)

    async with aiohttp.ClientSession() as http:
        first = asyncio.ensure_future(send(http, "first", "standard"))
        await _one_in_flight(proxy)
        waiting = []
        for name, priority in (
            ("older", "standard"),
            ("sheddable", "sheddable"),
            ("newer", "standard"),
            ("critical", "critical"),
        ):
            waiting.append(asyncio.ensure_future(send(http, name, priority)))
            for _ in range(200):  # each waits before the next comes
                if proxy.waiting == len(waiting):
                    break
                await asyncio.sleep(0.005)
        await asyncio.gather(first, *waiting)
    assert order == ["first", "critical", "newer", "older", "sheddable"]


async def test_a_queue_older_than_the_wait_is_overload_and_a_request_waits_less(
    sim_server, proxy_to
):
    """In a burst a request waits admission_wait_s; once the queue outlives it, overload_wait_s.

    One answer fills the pool for seconds and a critical request waits behind it (it is
    never shed: the queue stands). A standard request that comes into the young queue
    waits its whole admission_wait_s; one that comes once the queue is older than that
    gets its 503 after overload_wait_s, and the 503 says why. The critical one is still
    answered.
    """
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=2048, per_token_s=0.004)
    mitigations = Mitigations(pool_tokens=1000, block_size=16)
    url, proxy = await proxy_to(
        server.url, mitigations, admission_ratio=1.0, admission_wait_s=1.0, overload_wait_s=0.1
    )
    loop = asyncio.get_running_loop()

    async def shed_after(http: aiohttp.ClientSession) -> tuple[float, str]:
        began = loop.time()
        async with http.post(
            f"{url}/v1/completions", json=body(10, 700, 30), headers={"X-Priority": "standard"}
        ) as resp:
            assert resp.status == 503
            message = (await resp.json())["error"]["message"]
        return loop.time() - began, message

    async with aiohttp.ClientSession() as http:
        # Nothing learned yet: each reserves its max_tokens (700), so one at a time.
        first = asyncio.ensure_future(_complete(http, url, body(10, 700, 700)))
        await _one_in_flight(proxy)
        critical = asyncio.ensure_future(
            http.post(
                f"{url}/v1/completions", json=body(10, 700, 30), headers={"X-Priority": "critical"}
            )
        )
        await until(lambda: proxy.waiting == 1)
        queued_at = loop.time()
        await asyncio.sleep(0.1)
        in_burst, _ = await shed_after(http)
        await asyncio.sleep(max(0.0, queued_at + 1.3 - loop.time()))
        assert proxy.waiting == 1  # the critical request still waits: the queue stands
        queue_s = proxy.admission_queue_s
        assert queue_s is not None
        assert queue_s > 1.0, queue_s
        in_overload, message = await shed_after(http)
        async with await critical as resp:
            assert resp.status == 200
        await first
    assert in_burst >= 0.9, in_burst
    assert in_overload < 0.6, in_overload
    assert "overload, so a request waits overload_wait_s 0.1 s at most" in message, message
    assert "without a break for 1." in message, message
    assert proxy.counters.shed[("standard", "kv_pool_full")] == 2
    assert proxy.admission_queue_s is None  # none waits now


async def test_a_lower_class_is_not_held_behind_a_higher_class_waiting(sim_server, proxy_to):
    """While a higher class waits for room, a lower one that does not fit gets its 503 at once.

    The room that frees goes to the higher class first: held, the lower one would get
    its 503 only at its wait's end, or go in that late, after the queue ahead of it.
    Once the answers' lengths are learned (the pool's fullness is measured, not the
    prior's guess). One the room left now would hold waits for the order like any
    other (the pool is not what holds it). Critical requests always wait (never
    refused for room they can have).
    """
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=2048, per_token_s=0.002)
    mitigations = Mitigations(pool_tokens=1000, block_size=16)
    url, proxy = await proxy_to(
        server.url, mitigations, admission_ratio=1.0, admission_wait_s=10, reserve_min_samples=5
    )

    async def send(
        http: aiohttp.ClientSession, priority: str, prompt: int
    ) -> tuple[int, dict[str, Any]]:
        payload = {"prompt": [7] * prompt, "max_tokens": 100, SIM_OUTPUT_TOKENS_FIELD: 20}
        async with http.post(
            f"{url}/v1/completions", json=payload, headers={"X-Priority": priority}
        ) as resp:
            return resp.status, await resp.json()

    async with aiohttp.ClientSession() as http:
        # Five answers of 20 tokens: the route's lengths are learned (every class's).
        learned = await asyncio.gather(*(send(http, "standard", 50) for _ in range(5)))
        assert [status for status, _ in learned] == [200] * 5
        first = asyncio.ensure_future(send(http, "standard", 850))  # ~880 of the 1,000
        await _one_in_flight(proxy)
        critical = asyncio.ensure_future(send(http, "critical", 500))
        await until(lambda: proxy.waiting == 1, what="the critical request waits for room")
        started = asyncio.get_running_loop().time()
        small = asyncio.ensure_future(send(http, "standard", 30))  # ~64: fits the ~120 left
        standard, shed = await asyncio.gather(
            send(http, "standard", 200), send(http, "sheddable", 200)
        )
        assert asyncio.get_running_loop().time() - started < 1.0  # not after its 10 s wait
        for status, answer in (standard, shed):
            assert status == 503
            assert answer["error"]["code"] == "kv_pool_full"
            message = answer["error"]["message"]
            assert "critical requests are waiting for room ahead of it" in message
        assert (await first)[0] == 200
        assert (await critical)[0] == 200  # it waited, and went in once the first ended
        assert (await small)[0] == 200  # held behind the critical one, not shed
    assert proxy.counters.shed[("standard", "kv_pool_full")] == 1
    assert proxy.counters.shed[("sheddable", "kv_pool_full")] == 1


async def test_room_that_fits_several_waiting_requests_lets_them_all_in(sim_server, proxy_to):
    """One request fills the pool; when it ends, the three waiting, which fit together, all go.

    In one wake-up only the newest of a class goes (the older re-wait behind it): the
    others must be woken again while room is left, not wait for the next request to
    end (or their wait's end, with room to spare).
    """
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=2048, per_token_s=0.002)
    mitigations = Mitigations(pool_tokens=1000, block_size=16)
    url, proxy = await proxy_to(server.url, mitigations, admission_ratio=1.0, admission_wait_s=10)

    async with aiohttp.ClientSession() as http:
        # A prompt of 850 token ids (counted exactly) and an answer of at most 100:
        # it reserves 960 of 1,000, most of it from its first step on.
        long_prompt = {"prompt": [7] * 850, "max_tokens": 100, SIM_OUTPUT_TOKENS_FIELD: 20}
        first = asyncio.ensure_future(_complete(http, url, long_prompt))
        await _one_in_flight(proxy)
        waiting = []
        for _ in range(3):  # ~250 each, still growing when the first would end: none fits
            # beside it (not even step by step); all three together do once it is gone
            waiting.append(asyncio.ensure_future(_complete(http, url, body(10, 220, 200))))
            for _ in range(200):
                if proxy.waiting == len(waiting):
                    break
                await asyncio.sleep(0.005)
        assert proxy.waiting == 3
        most_at_once = await _most_in_flight(proxy, asyncio.gather(first, *waiting))
    assert most_at_once == 3


async def test_answers_reserved_together_let_more_in_than_each_at_its_quantile(
    sim_server, proxy_to
):
    """Half the answers of a route are short, half long: p95 reserves every one as a long one.

    Reserved together at the p95 of their total (their expected lengths plus 1.645
    standard deviations of the sum), more short answers run at once than reserving
    each at its own p95 would let in, and none is shed.
    """
    server = await sim_server(kv_capacity_tokens=16384, max_model_len=4096, per_token_s=0.0002)
    mitigations = Mitigations(pool_tokens=8000, block_size=16)
    url, proxy = await proxy_to(server.url, mitigations, admission_wait_s=10)
    assert proxy.settings.reserve_quantile == 0.95  # the default
    async with aiohttp.ClientSession() as http:
        # Ten answers of 40 and ten of 400, each asked one token more than it writes (so
        # all fit at once; one that ran to its max_tokens would tell only a lower bound).
        learned = await asyncio.gather(
            *(
                http.post(f"{url}/v1/completions", json=body(100, n + 1, n))
                for n in [40] * 10 + [400] * 10
            )
        )
        assert [r.status for r in learned] == [200] * 20
        for answer in learned:
            answer.close()
        most, pooled_below_each = 0, False
        sizes: list[int] = []

        async def watch() -> None:
            nonlocal most, pooled_below_each
            while True:
                requests = list(proxy.inflight)
                most = max(most, len(requests))
                sizes.extend(-(-r.projected_tokens // 16) * 16 for r in requests)
                each = sum(-(-r.projected_tokens // 16) * 16 for r in requests)
                pooled_below_each |= 0 < proxy.reserved_tokens < each
                await asyncio.sleep(0.002)

        watcher = asyncio.ensure_future(watch())
        answers = await asyncio.gather(
            *(http.post(f"{url}/v1/completions", json=body(100, 1500, 40)) for _ in range(24))
        )
        watcher.cancel()
        assert [a.status for a in answers] == [200] * 24
        for answer in answers:
            answer.close()
    # Each at its own p95 (400 output tokens): no more than this many at once.
    each_alone = int(8000 * 0.95) // max(sizes)
    assert max(sizes) >= 500, max(sizes)
    assert most > each_alone, (most, each_alone)
    assert pooled_below_each
    assert proxy.counters.shed == {}


@pytest.mark.parametrize("streamed", [True, False])
async def test_an_answer_far_along_leaves_room_for_one_that_starts_now(
    sim_server, proxy_to, streamed
):
    """Reserved in full, two answers of up to 600 tokens never fit a 1,000-token pool at once.

    Step by step they do once the first has written enough: it ends, and frees all it
    holds, before the second has grown much (kvguard.core.admission.Envelope). The
    second waits while the first is young, and goes in at a tick's re-check while the
    first is still being written — not when it ends. Unless the first does not
    stream: what it has written is then unseen, and it is reserved whole to its end.
    """
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=2048, per_token_s=0.002)
    mitigations = Mitigations(pool_tokens=1000, block_size=16)
    url, proxy = await proxy_to(server.url, mitigations, admission_ratio=1.0, admission_wait_s=30)

    async with aiohttp.ClientSession() as http:
        # Streamed: the proxy sees each answer's tokens as they are written (a whole-JSON
        # answer's length is known only at its end, so it counts as just begun).
        first = asyncio.ensure_future(_complete(http, url, body(10, 600, 600, stream=streamed)))
        older = await _one_in_flight(proxy)
        second = asyncio.ensure_future(_complete(http, url, body(10, 600, 20, stream=True)))
        for _ in range(200):
            if proxy.waiting:
                break
            await asyncio.sleep(0.005)
        assert proxy.waiting == 1  # the first is young: both would be near 600 at once
        young_at = older.generated
        written_when_admitted = None
        while not second.done():
            proxy.review_reservations()  # what the daemon does every tick
            if written_when_admitted is None and len(proxy.inflight) == 2:
                written_when_admitted = older.generated
            await asyncio.sleep(0.02)
        await second
        if not streamed:
            assert first.done()  # only once the first had ended
            assert written_when_admitted is None
            return
        assert not first.done()  # in while the first was still being written
        await first
    assert young_at < 200
    assert written_when_admitted is not None
    assert 200 <= written_when_admitted < 600


async def test_answers_that_will_likely_have_ended_free_their_room_ahead(sim_server, proxy_to):
    """Learned lengths spread from 100 to 1,000 tokens: p95 is near the ceiling for each.

    Reserved each at p95 (about 1,000), four fit a 4,000-token pool; pooled at the p95
    of their total, five. Step by step, each fresh answer holds its prompt plus what
    it has written, and by the time it could be long most of its peers will have ended
    (a third of them by step 400): the mean plus z deviations of what they hold at
    each step ahead peaks far lower, and eight go in at once
    (kvguard.core.admission.SpreadProfile).
    """
    server = await sim_server(
        kv_capacity_tokens=65536, max_model_len=2048, step_fixed_s=0.0005, per_token_s=0.00001
    )
    mitigations = Mitigations(pool_tokens=100_000, block_size=16)
    url, proxy = await proxy_to(server.url, mitigations, admission_ratio=1.0, admission_wait_s=10)

    def answer(output: int) -> dict:
        return body(10, 1000, output, stream=True)

    async with aiohttp.ClientSession() as http:
        # 24 answers, 100 to 1,000 tokens, learned with room for all of them.
        await asyncio.gather(
            *(_complete(http, url, answer(100 + 900 * i // 23)) for i in range(24))
        )
        mitigations.pool_tokens = 4000
        eight = asyncio.gather(*(_complete(http, url, answer(600)) for _ in range(8)))
        most_at_once = await _most_in_flight(proxy, eight)
    assert most_at_once == 8


async def test_an_answer_that_does_not_stream_is_reserved_whole_to_its_end(sim_server, proxy_to):
    """A whole-JSON answer is seen only at its end: it may be nearly written already.

    Step by step, a newcomer of at most 200 tokens beside an answer of at most 900
    that had just begun would fit a 1,000-token pool (450 at most, at the newcomer's
    end). But nothing of the first is seen before it ends: had it written 800, the two
    would hold 1,050. So it counts whole until the latest it can end, and the
    newcomer waits for it.
    """
    server = await sim_server(kv_capacity_tokens=8192, max_model_len=2048, per_token_s=0.002)
    mitigations = Mitigations(pool_tokens=1000, block_size=16)
    url, proxy = await proxy_to(server.url, mitigations, admission_ratio=1.0, admission_wait_s=30)

    async with aiohttp.ClientSession() as http:
        first = asyncio.ensure_future(_complete(http, url, body(10, 900, 300)))
        await _one_in_flight(proxy)
        second = asyncio.ensure_future(_complete(http, url, body(10, 200, 20, stream=True)))
        for _ in range(200):
            if proxy.waiting:
                break
            await asyncio.sleep(0.005)
        assert proxy.waiting == 1
        while not second.done():
            proxy.review_reservations()
            # Never both at once (between the first's end and the second's wake-up,
            # neither may be in flight while the first's client still reads its body).
            assert len(proxy.inflight) <= 1
            await asyncio.sleep(0.02)
        await second
        assert first.done()
