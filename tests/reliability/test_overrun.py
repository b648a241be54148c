"""Answers outrunning their learned reservation, before an engine that dies when its pool runs out.

Admission reserves each answer at what answers of its kind really use, a high
quantile: a few run past it, and long ones running together can fill the pool on
their own. The simulated engine here allocates per sequence (``oom_on_exhaust``):
one step that needs a block it does not have kills it, with every request in it.
Twenty short answers teach kvguard their length; then four long ones of the same
kind are admitted at that length and grow far past it. The live daemon, ticking,
re-reserves them and — when the engine's count plus its growth would pass the pool
before the next reading — cancels the newest of them: the engine must not die,
and the ones left finish whole.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvguard.runtime.inprocess import start_guard
from kvguard.sim.engine import TimeModel
from kvguard.sim.openai_api import SIM_OUTPUT_TOKENS_FIELD
from kvguard.sim.runner import PoolSpec, size_pool, start_sim_server

# Wall-clock seconds of streaming: the second stage of scripts/test.sh.
pytestmark = pytest.mark.slow

POOL = PoolSpec(
    kv_capacity_tokens=2048,
    max_model_len=1536,
    max_num_seqs=32,
    max_num_batched_tokens=2048,
    oom_on_exhaust=True,
)
POLL = {"interval_s": 0.5, "min_interval_s": 0.1, "timeout_s": 1.0}
SHORT, LONG, ASKED = 40, 1000, 1500
# Slow steps (10 ms, about 100 tokens a second per answer): the four long answers
# need about five seconds to outgrow the pool, ten ticks of the daemon.
SLOW = TimeModel(step_fixed_s=0.01, per_token_s=0.0, jitter=0.0)


async def _complete(
    http: aiohttp.ClientSession, url: str, n: int, output: int, asked: int = ASKED
) -> dict:
    body = {
        "model": "sim",
        "prompt": f"question {n}: " + "word " * 20,
        "max_tokens": asked,
        "stream": True,
        "stream_options": {"include_usage": True},
        SIM_OUTPUT_TOKENS_FIELD: output,
    }
    tokens, error = 0, None
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        status = resp.status
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"error"' in line:
                error = line.decode()
            elif line.startswith(b"data: {") and b'"text"' in line:
                tokens += 1
    return {"status": status, "tokens": tokens, "error": error}


async def test_long_answers_past_their_reservation_are_cancelled_before_the_pool_runs_out():
    """Four long answers admitted at a short one's length: the newest go, the engine lives."""
    server = await start_sim_server(size_pool(POOL), time_model=SLOW, seed=3)
    guard = await start_guard(server.url, poll=POLL)
    loop = guard.run_in_background(None)
    try:
        proxy = guard.daemon.proxy
        assert proxy is not None
        url = guard.proxy_url
        async with aiohttp.ClientSession() as http:
            # Twenty short answers teach their kind's length (asked at that length,
            # so they need not wait for one another while nothing is learned).
            for batch in range(2):
                done = await asyncio.gather(
                    *(_complete(http, url, batch * 10 + i, SHORT, SHORT) for i in range(10))
                )
                assert [d["status"] for d in done] == [200] * 10, done
            longs = await asyncio.gather(*(_complete(http, url, 100 + i, LONG) for i in range(4)))
        assert not server.crashed.is_set(), server.crash_messages
        cancelled = proxy.counters.cancelled.get("overrun", 0)
        assert cancelled >= 1, longs
        ended_whole = [d for d in longs if d["error"] is None]
        assert len(ended_whole) == 4 - cancelled, longs
        assert all(d["tokens"] == LONG for d in ended_whole), longs
        assert all("cancelled" in d["error"] for d in longs if d["error"] is not None), longs
        assert not loop.done()
    finally:
        await guard.close()
        await server.stop()
