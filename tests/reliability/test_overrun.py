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
            # Twenty short answers teach their kind's length (asked one token over it,
            # so they need not wait for one another while nothing is learned; one that
            # ran to its max_tokens would teach only a lower bound).
            for batch in range(2):
                done = await asyncio.gather(
                    *(_complete(http, url, batch * 10 + i, SHORT, SHORT + 1) for i in range(10))
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


async def test_answers_without_max_tokens_are_reserved_what_the_engines_context_allows():
    """No max_tokens, no [model] max_model_len: the engine's own max_model_len is the ceiling.

    Reserved at a guess of 512 tokens, two chat answers of 1,300 were admitted into a
    2,032-token pool and the engine died (found by an adversarial client run). The
    engine says its context in /v1/models: each is reserved the room it leaves the
    prompt, so the second waits for the first instead of running beside it.
    """
    fast = TimeModel(step_fixed_s=0.002, per_token_s=0.0, jitter=0.0)  # 1,300 steps in 2.6 s
    server = await start_sim_server(size_pool(POOL), time_model=fast, seed=3)
    guard = await start_guard(server.url, poll=POLL, proxy={"admission_wait_s": 30})
    loop = guard.run_in_background(None)
    try:
        proxy = guard.daemon.proxy
        assert proxy is not None
        assert guard.daemon.config.model.max_model_len is None  # nothing configured
        for _ in range(100):
            if proxy.mitigations.context_tokens is not None:
                break
            await asyncio.sleep(0.05)
        assert proxy.mitigations.context_tokens == POOL.max_model_len
        body = {
            "model": "sim",
            "messages": [{"role": "user", "content": "word " * 100}],
            SIM_OUTPUT_TOKENS_FIELD: 1300,
        }
        async with aiohttp.ClientSession() as http:

            async def chat() -> int:
                async with http.post(f"{guard.proxy_url}/v1/chat/completions", json=body) as r:
                    await r.read()
                    return r.status

            first = asyncio.ensure_future(chat())
            for _ in range(200):
                if len(proxy.inflight):
                    break
                await asyncio.sleep(0.01)
            running = next(iter(proxy.inflight))
            assert running.reserved_from.endswith("(context)"), running.reserved_from
            statuses = await asyncio.gather(first, chat())
        assert not server.crashed.is_set(), server.crash_messages
        assert statuses == [200, 200]
        assert not loop.done()
    finally:
        await guard.close()
        await server.stop()
