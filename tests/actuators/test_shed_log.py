"""The ``requests_shed`` log line: the first shed at once, then sums, never a flood."""

from __future__ import annotations

import json

import aiohttp
from structlog.testing import capture_logs

from kvguard.actuators.proxy.settings import ProxyCounters
from kvguard.actuators.proxy.shed_log import SHED_LOG_EVERY_S, ShedLog
from kvguard.api.status import status_document
from kvguard.cli.status import render_status
from kvguard.runtime.inprocess import start_guard
from kvguard.sim.runner import PoolSpec, size_pool, start_sim_server


def test_the_first_shed_is_said_at_once_then_summed_at_most_every_interval():
    """One line for the first shed; then, while a burst sheds, one sum per interval."""
    counters = ProxyCounters()
    shed_log = ShedLog(counters)
    assert shed_log.due(0.0) is None  # nothing shed
    counters.note_shed("sheddable", "kv_pool_full", "projected 12,100 of 11,658")
    first = shed_log.due(0.5)
    assert first is not None
    assert first["shed"] == 1
    assert first["by_priority"] == {"sheddable": 1}
    assert first["by_reason"] == {"kv_pool_full": 1}
    assert first["since_last_line_s"] is None
    assert first["last_detail"] == "projected 12,100 of 11,658"
    # A burst goes on: one tick after another sheds more, and nothing is said...
    at = 0.5
    for _ in range(int(SHED_LOG_EVERY_S / 0.5) - 1):
        at += 0.5
        for _ in range(100):
            counters.note_shed("sheddable", "kv_pool_full", "later figures")
        assert shed_log.due(at) is None
    # ...until the interval has passed: the sum since the last line.
    at += 0.5
    counters.note_shed("standard", "kv_cache_pressure", "the pressure level is critical")
    summed = shed_log.due(at)
    assert summed is not None
    assert summed["shed"] == 100 * (int(SHED_LOG_EVERY_S / 0.5) - 1) + 1
    assert summed["by_priority"] == {"sheddable": summed["shed"] - 1, "standard": 1}
    assert summed["by_reason"] == {"kv_cache_pressure": 1, "kv_pool_full": summed["shed"] - 1}
    assert summed["since_last_line_s"] == SHED_LOG_EVERY_S
    assert summed["last_reason"] == "kv_cache_pressure"
    assert shed_log.due(at + 0.5) is None  # nothing new


def test_the_tail_of_a_burst_is_said_when_shedding_stops():
    """The sheds since the last line are said on the first tick that sheds nothing new."""
    counters = ProxyCounters()
    shed_log = ShedLog(counters)
    counters.note_shed("sheddable", "kv_pool_full", "a")
    assert shed_log.due(0.0) is not None
    counters.note_shed("sheddable", "kv_pool_full", "b")
    counters.note_shed("sheddable", "kv_pool_full", "c")
    assert shed_log.due(0.5) is None  # still shedding, the last line is 0.5 s old
    tail = shed_log.due(1.0)  # this tick shed nothing new: the burst is over
    assert tail is not None
    assert tail["shed"] == 2
    assert tail["last_detail"] == "c"
    assert shed_log.due(1.5) is None


def test_sheds_before_the_log_began_are_not_said_again():
    """A log begun on counters that already counted sheds says only what comes after."""
    counters = ProxyCounters()
    counters.note_shed("sheddable", "draining", "restarting")
    shed_log = ShedLog(counters)
    assert shed_log.due(0.0) is None


def test_what_was_not_said_yet_is_said_when_kvguard_stops():
    """Sheds held back by the interval are said in a last line (``final``), not lost."""
    counters = ProxyCounters()
    shed_log = ShedLog(counters)
    counters.note_shed("sheddable", "kv_pool_full", "a")
    assert shed_log.due(0.0) is not None
    counters.note_shed("sheddable", "kv_pool_full", "b")
    assert shed_log.due(0.5) is None  # mid-burst, the last line 0.5 s old
    counters.note_shed("sheddable", "kv_pool_full", "c")
    last = shed_log.due(0.6, final=True)
    assert last is not None
    assert (last["shed"], last["last_detail"]) == (2, "c")
    assert shed_log.due(0.7, final=True) is None


async def test_a_shed_request_is_seen_in_status_in_kvguard_status_and_in_the_log():
    """Admission sheds with no pressure level: /status, `kvguard status` and the log say why.

    A request larger than the share of the pool admission fills gets its 503 at once
    (no mitigation in force): an operator must find how many, and why, without
    reading metrics or the source.
    """
    server = await start_sim_server(
        size_pool(PoolSpec(kv_capacity_tokens=4096, max_model_len=4000)), seed=1
    )
    guard = await start_guard(server.url, poll={"interval_s": 0.5, "timeout_s": 1.0})
    try:
        daemon, proxy = guard.daemon, guard.daemon.proxy
        assert proxy is not None
        await daemon.tick()  # the pool is known
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{guard.proxy_url}/v1/completions",
                json={"prompt": [7] * 100, "max_tokens": 3850},
                headers={"X-Priority": "sheddable"},
            ) as resp,
        ):
            assert resp.status == 503
            said = (await resp.json())["error"]["message"]
        with capture_logs() as logs:
            await daemon.tick()
        doc = json.loads(json.dumps(status_document(daemon)))  # as /status serves it
    finally:
        await guard.close()
        await server.stop()
    shed = doc["proxy"]["requests_shed"]
    assert shed == {
        "total": 1,
        "by_priority": {"sheddable": 1},
        "by_reason": {"kv_pool_full": 1},
    }
    last = doc["proxy"]["last_shed"]
    assert (last["priority"], last["reason"]) == ("sheddable", "kv_pool_full")
    assert "it alone reserves" in last["detail"]
    assert last["detail"] in said  # what the client was told
    assert doc["proxy"]["held_requests"] == 0
    assert doc["proxy"]["admission_queue_s"] is None  # none waits for room
    (line,) = [e for e in logs if e["event"] == "requests_shed"]
    assert line["log_level"] == "info"
    assert (line["shed"], line["last_reason"]) == (1, "kv_pool_full")
    assert line["last_detail"] == last["detail"]
    text = render_status(doc)
    assert "Shed     1 since start (by reason: kv_pool_full 1; by class: sheddable 1)" in text
    assert f"sheddable (kv_pool_full): {last['detail']}" in text
