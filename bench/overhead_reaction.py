"""Reaction: from the tick that sees ``high`` to the first request the proxy sheds.

In one process (:func:`kvguard.runtime.inprocess.start_guard` in front of
:func:`kvguard.sim.runner.start_sim_server`, as ``kvguard run`` with ``[proxy]
enabled``): a prober sends a tiny ``X-Priority: sheddable`` request through the proxy
every ``PROBE_EVERY_S``; after ``CALM_S`` of calm (the daemon has ticked at ``ok``), a
burst of long requests fills the engine's small KV pool. The burst goes to the engine
directly, as another client of the engine would: sent through the proxy, admission
would hold what the pool cannot take at the door, and the level would never reach
``high`` — the ladder's reaction, measured here, is for what admission cannot hold. The daemon's
``after_tick`` callback records the first tick whose decision is ``high`` or worse
(its snapshot's time: when the probes had read the engine); the prober records when
the first 503 of the ladder's shed came back (code ``kv_cache_pressure``; a 503 of
admission's own, ``kv_pool_full`` after ``admission_wait_s`` without room, is another
mechanism: recorded as ``other_503_before_shed``, not timed). Reaction = first shed 503
- that tick.

``tighten_window`` is disabled in ``[policy]`` so the first response at ``high`` is a
shed whatever pattern the brief burst is classified as (the ladder falls through to
``shed:sheddable``). Two proxy settings:

* ``immediate`` (``[proxy] shed_ratio = 0``): the whole sheddable class is shed as
  soon as the plan is in force: the control path itself;
* ``default`` (``shed_ratio`` 0.8, ``shed_wait_s`` 2): a sheddable request is first
  held for room in the pool and answered 503 only after ``shed_wait_s`` in vain — a
  deliberate wait, so this figure is the default's behaviour, not its latency.

Also recorded: the first tick whose snapshot was past a ``high`` threshold (the
decision then waits ``confirm_ticks`` ticks before it says ``high``, unless the demand
is past the pool) to the first 503 — the reaction with the confirmation included — and
when the engine's own KV usage first reached the ``high`` threshold (read in-process
every ``PROBE_EVERY_S``), to show the detection delay before the tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from typing import Any

import aiohttp

from kvguard.core.policy import LEVELS
from kvguard.core.snapshot import Snapshot
from kvguard.runtime.inprocess import start_guard
from kvguard.sim.engine import TimeModel
from kvguard.sim.runner import PoolSpec, SimServer, size_pool, start_sim_server

POOL = PoolSpec(
    kv_capacity_tokens=4096, max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=2048
)
POLL = {"interval_s": 0.5, "min_interval_s": 0.1, "timeout_s": 1.0}
HIGH_KV_USAGE = 0.90  # [policy.high] kv_usage, the default
PROBE_EVERY_S = 0.005
CALM_S = 1.0  # two ticks at ok before the burst
BURST = 8  # x (600-word prompt + 600 tokens): about twice the pool
TRIAL_LIMIT_S = 10.0
VARIANTS = {"immediate": {"shed_ratio": 0.0}, "default": {}}
PROBE_BODY = {"model": "kvguard-sim", "prompt": "hi", "max_tokens": 1}
BURST_BODY = {"model": "kvguard-sim", "prompt": "word " * 600, "max_tokens": 600}
# The code of the ladder's shed 503 (admission's own, after waiting for room, is
# kv_pool_full): only the ladder's is the reaction measured.
LADDER_SHED_CODE = "kv_cache_pressure"


async def trial(variant: str, seed: int) -> dict[str, Any]:
    """One run: calm, burst, until the first shed response (or ``TRIAL_LIMIT_S``)."""
    server = await start_sim_server(size_pool(POOL), time_model=TimeModel(), seed=seed)
    guard = await start_guard(
        server.url,
        poll=POLL,
        proxy=VARIANTS[variant],
        policy={"disabled_actions": ["tighten_window"]},
    )
    daemon = guard.daemon
    assert guard.proxy_url is not None  # noqa: S101 - the proxy is enabled
    proxy_url = guard.proxy_url
    marks: dict[str, Any] = {}

    def after_tick(snapshot: Snapshot) -> None:
        decision = daemon.brain.decision
        if decision is None or "high_tick_at" in marks:
            return
        pending = decision.state.pending
        crossed = max(LEVELS.index(decision.level), LEVELS.index(pending) if pending else 0)
        if "crossing_tick_at" not in marks and crossed >= LEVELS.index("high"):
            # The first snapshot past a high threshold: the level waits confirm_ticks.
            marks["crossing_tick_at"] = snapshot.taken_at
        if LEVELS.index(decision.level) >= LEVELS.index("high"):
            marks["high_tick_at"] = snapshot.taken_at
            marks["after_tick_at"] = time.monotonic()
            marks["level"] = decision.level
            marks["pattern"] = decision.pattern
            marks["plan"] = [
                a.kind + (f":{a.priority}" if a.priority else "") for a in decision.plan
            ]
            marks["ticks_at_ok_before"] = daemon.state.ticks_total - 1

    guard.run_in_background(after_tick)
    try:
        await _drive(proxy_url, server, marks)
    finally:
        await guard.close()
        await server.stop()
    return _trial_result(variant, seed, marks)


async def _drive(proxy_url: str, server: SimServer, marks: dict[str, Any]) -> None:
    """Probes every PROBE_EVERY_S, the burst after CALM_S; until the first 503 or the limit."""
    shed = asyncio.Event()
    tasks: list[asyncio.Future[Any]] = []
    headers = {"X-Priority": "sheddable"}
    timeout = aiohttp.ClientTimeout(total=TRIAL_LIMIT_S)
    # No connection limit: probes sent before the shed wait in the full engine, and a
    # capped pool would queue the later probes behind them, hiding the first 503.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as http:

        async def probe() -> None:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, TimeoutError):
                async with http.post(
                    f"{proxy_url}/v1/completions", json=PROBE_BODY, headers=headers
                ) as resp:
                    body = await resp.read()
                    if resp.status != 503 or shed.is_set():
                        return
                    if _error_code(body) == LADDER_SHED_CODE:
                        marks["first_503_at"] = time.monotonic()
                        shed.set()
                    else:
                        # Admission's own 503 (no room after admission_wait_s, code
                        # kv_pool_full) is not the ladder's reaction: noted, not timed.
                        marks.setdefault("first_other_503_at", time.monotonic())

        async def burst_one() -> None:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, TimeoutError):
                # Straight to the engine: through the proxy, admission would hold the
                # burst at the door and the pool would never reach high (the ladder's
                # reaction is what is measured here).
                async with http.post(f"{server.url}/v1/completions", json=BURST_BODY) as resp:
                    await resp.read()

        burst_at = time.monotonic() + CALM_S
        deadline = burst_at + TRIAL_LIMIT_S
        try:
            while not shed.is_set() and time.monotonic() < deadline:
                now = time.monotonic()
                if "burst_at" not in marks and now >= burst_at:
                    marks["burst_at"] = now
                    tasks += [asyncio.ensure_future(burst_one()) for _ in range(BURST)]
                if "usage_high_at" not in marks and server.engine.scheduler.usage >= HIGH_KV_USAGE:
                    marks["usage_high_at"] = now
                tasks.append(asyncio.ensure_future(probe()))
                await asyncio.sleep(PROBE_EVERY_S)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _error_code(body: bytes) -> str | None:
    """The ``error.code`` of an OpenAI-style error body, None when there is none."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    error = doc.get("error") if isinstance(doc, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def _ms(later: float | None, earlier: float | None) -> float | None:
    if later is None or earlier is None:
        return None
    return round((later - earlier) * 1000.0, 2)


def _trial_result(variant: str, seed: int, marks: dict[str, Any]) -> dict[str, Any]:
    high, shed = marks.get("high_tick_at"), marks.get("first_503_at")
    burst, usage = marks.get("burst_at"), marks.get("usage_high_at")
    return {
        "variant": variant,
        "seed": seed,
        "level": marks.get("level"),
        "pattern": marks.get("pattern"),
        "plan": marks.get("plan"),
        "reaction_ms": _ms(shed, high),  # the figure: tick at high -> first 503
        # From the first tick whose snapshot was past a high threshold (the decision
        # waits confirm_ticks before it says high, unless demand is past the pool).
        "from_crossing_tick_ms": _ms(shed, marks.get("crossing_tick_at")),
        "tick_to_callback_ms": _ms(marks.get("after_tick_at"), high),
        # The reaction in its parts, end to end (PARTS).
        "parts_ms": {
            "engine_at_high_usage_to_tick_past_high": _ms(marks.get("crossing_tick_at"), usage),
            "confirm_ticks": _ms(high, marks.get("crossing_tick_at")),
            "tick_to_decision_in_force": _ms(marks.get("after_tick_at"), high),
            "in_force_to_client_503": _ms(shed, marks.get("after_tick_at")),
        },
        "burst_to_high_tick_ms": _ms(high, burst),
        "usage_high_to_high_tick_ms": _ms(high, usage),
        "usage_high_to_first_503_ms": _ms(shed, usage),
        "shed": shed is not None,
        # A 503 of admission's own (kv_pool_full) before the ladder's, if any.
        "other_503_before_shed": "first_other_503_at" in marks
        and (shed is None or marks["first_other_503_at"] < shed),
    }


# The reaction's parts, in order: the engine's KV usage reaches the high threshold ->
# the first tick past a high threshold (KV usage counts there only while the KV cache
# binds: while nothing waits in the engine, admission holds the door and the usage is
# a pool in use, kvguard.core.policy.crossed) -> the level waits confirm_ticks -> that
# tick's decision is made and its plan is in force in the proxy (one synchronous step,
# no await between them) -> the proxy answers a client 503.
PARTS = (
    "engine_at_high_usage_to_tick_past_high",
    "confirm_ticks",
    "tick_to_decision_in_force",
    "in_force_to_client_503",
)


def _parts_median(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each part's median over ``runs`` (None where no run measured it)."""
    out: dict[str, float | None] = {}
    for part in PARTS:
        values = [r["parts_ms"][part] for r in runs if r["parts_ms"][part] is not None]
        out[part] = round(statistics.median(values), 2) if values else None
    return out


async def measure_reaction_async(trials: int, default_trials: int) -> dict[str, Any]:
    """``trials`` immediate runs and ``default_trials`` runs at the proxy's defaults."""
    runs = [await trial("immediate", seed) for seed in range(1, trials + 1)]
    runs += [await trial("default", seed) for seed in range(1, default_trials + 1)]
    out: dict[str, Any] = {
        "poll_interval_s": POLL["interval_s"],
        "min_interval_s": POLL["min_interval_s"],
        "probe_every_ms": PROBE_EVERY_S * 1000,
        "target_ms": POLL["interval_s"] * 1000 + 50,
        "pool_tokens": POOL.kv_capacity_tokens,
        "runs": runs,
    }
    for variant in VARIANTS:
        values = [r["reaction_ms"] for r in runs if r["variant"] == variant]
        done = [v for v in values if v is not None]
        crossing = [
            r["from_crossing_tick_ms"]
            for r in runs
            if r["variant"] == variant and r["from_crossing_tick_ms"] is not None
        ]
        out[variant] = {
            "from_crossing_tick_ms_median": round(statistics.median(crossing), 2)
            if crossing
            else None,
            "from_crossing_tick_ms_max": max(crossing) if crossing else None,
            "trials": len(values),
            "shed_in_every_trial": len(done) == len(values),
            "reaction_ms_median": round(statistics.median(done), 2) if done else None,
            "reaction_ms_max": max(done) if done else None,
            "reaction_ms_min": min(done) if done else None,
            "parts_median_ms": _parts_median([r for r in runs if r["variant"] == variant]),
        }
    return out


def measure_reaction(trials: int, default_trials: int) -> dict[str, Any]:
    """:func:`measure_reaction_async` in a fresh event loop, with kvguard's logs quiet."""
    return asyncio.run(measure_reaction_async(trials, default_trials))
