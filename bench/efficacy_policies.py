"""The policies the efficacy benchmark compares, and what watches a run while it goes.

Every policy gets the same client (``kvguard loadgen``, same seed, same connection
limit, same retries) and an engine configured the same way except where the policy *is*
the engine's configuration:

* ``none``: straight at the engine, at its defaults.
* ``static`` (one run per value of the sweep; the page reports ``static_best``): the
  engine's own ``max_num_seqs`` lowered to the value. Nothing in front.
* ``engine_priority``: the engine's own priority scheduling (vLLM's
  ``--scheduling-policy priority``): the client also sends each class as the body field
  ``priority`` (critical 0, standard 1, sheddable 2; lower runs first). Nothing in front.
* ``llmd_rule``: llm-d's saturation detector in kvguard's proxy (:class:`LlmdRule`).
* ``kvguard``: kvguard at its defaults, daemon live and proxy in the path.

Observers ride on ``none``'s traffic and change nothing: ``predict_linear`` (a Prometheus
trend alert on the engine's KV usage) and ``kvguard_dry_run`` (kvguard in dry-run);
only their lead time is theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
from kvguard.core.policy import LEVELS
from kvguard.core.snapshot import Snapshot
from kvguard.errors import KvguardError
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.assembly import Guard, bound_url, listen
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.inprocess import start_guard, start_watcher

TRAFFIC_POLICIES = ("none", "static", "engine_priority", "llmd_rule", "kvguard")
OBSERVERS = ("predict_linear", "kvguard_dry_run")
# llm-d's saturation detector as published (Inference Gateway): queue depth 5, KV-cache
# utilization 0.8, both strict (`>`), and metrics older than 200 ms count as saturated.
LLMD_QUEUE_DEPTH = 5.0
LLMD_KV_UTIL = 0.8
LLMD_STALENESS_S = 0.2
LLMD_POLL_S = 0.05
# predict_linear(kv_usage[WINDOW], HORIZON) >= THRESHOLD, evaluated every SCRAPE_S: the
# usual [5m] window and 10 min horizon scaled to runs of a minute.
PL_SCRAPE_S = 0.5
PL_WINDOW_S = 5.0
PL_HORIZON_S = 10.0
PL_THRESHOLD = 0.95
SAMPLE_S = 0.1


class Clock:
    """Seconds since the workload started (None during the warm-up)."""

    def __init__(self) -> None:
        self.start: float | None = None

    def now(self) -> float | None:
        """Seconds into the workload, or None before it started."""
        return None if self.start is None else time.monotonic() - self.start


@dataclass
class Timeline:
    """What happened over one run: the engine's state and a guard's view, for the plots."""

    engine: list[tuple[float, float, int, int]] = field(default_factory=list)  # t, usage, wait, pre
    forecast: list[tuple[float, float | None, float | None, str]] = field(default_factory=list)
    actions: list[tuple[float, str]] = field(default_factory=list)
    crash_at_s: float | None = None


# The engine's (KV usage ratio, waiting requests, preemptions so far), however it is read.
Reading = tuple[float, int, int]


async def sample_engine(
    read: Callable[[], Awaitable[Reading]],
    clock: Clock,
    timeline: Timeline,
    stop: asyncio.Event,
    every_s: float = SAMPLE_S,
) -> None:
    """The engine's usage, queue and preemptions every ``every_s``, and once more at the end.

    Times are seconds from the workload's start, the warm-up's negative: one continuous
    history, as Prometheus would have scraped it.
    """
    rows: list[tuple[float, float, int, int]] = []
    try:
        while True:
            stopping = stop.is_set()
            # A reading that fails (an engine too busy to answer in time, or dead) is a gap.
            with contextlib.suppress(
                KvguardError, aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError
            ):
                usage, waiting, preemptions = await read()
                rows.append((time.monotonic(), round(usage, 4), waiting, preemptions))
            if stopping:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
    finally:
        start = clock.start if clock.start is not None else time.monotonic()
        timeline.engine.extend((round(at - start, 2), u, w, p) for at, u, w, p in rows)


def llmd_saturated(waiting: float | None, kv_usage: float | None, age_s: float) -> bool:
    """llm-d's rule: saturated when the queue or the cache is over its threshold, or stale."""
    if age_s > LLMD_STALENESS_S or waiting is None or kv_usage is None:
        return True
    return waiting > LLMD_QUEUE_DEPTH or kv_usage > LLMD_KV_UTIL


class LlmdRule:
    """llm-d's saturation detector as a policy in kvguard's proxy.

    A loop polls the engine's ``/metrics`` every 50 ms. While :func:`llmd_saturated`
    holds, the proxy's shed floor is ``sheddable`` with no holding (``shed_ratio`` 0):
    every sheddable request is refused at once (503 with ``Retry-After``), as the
    Inference Gateway does. The same proxy code forwards, so only the rule differs from
    kvguard's.
    """

    def __init__(self, engine_url: str, clock: Clock) -> None:
        self.engine_url = engine_url
        self.clock = clock
        self.mitigations = Mitigations(enforcing=True, retry_after_s=1)
        self.probe = EngineProbe(engine_url, kind="vllm", timeout_s=1.0)
        self.first_saturated_at: float | None = None
        self.url = ""
        self.proxy: AdmissionProxy | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._runner: Any = None
        self._fresh_at = time.monotonic()
        self._last: tuple[float | None, float | None] = (None, None)

    async def start(self) -> None:
        """Start the proxy and the polling loop."""
        settings = ProxySettings(upstream=self.engine_url, listen="127.0.0.1:0", shed_ratio=0.0)
        self.proxy = AdmissionProxy(settings, self.mitigations)
        self._runner = await listen(self.proxy.app(), "127.0.0.1:0", cancel=True)
        self.url = bound_url(self._runner)
        self._task = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        # Reading and deciding are apart: a scrape that hangs must age the reading (and
        # so saturate the rule after 200 ms) while it hangs, not only once it returns.
        reader = asyncio.ensure_future(self._read())
        try:
            while not self._stop.is_set():
                now_mono = time.monotonic()
                saturated = llmd_saturated(*self._last, now_mono - self._fresh_at)
                self.mitigations.shed_floor = "sheddable" if saturated else None
                self.mitigations.level = "high" if saturated else "ok"
                now = self.clock.now()
                if saturated and now is not None and self.first_saturated_at is None:
                    self.first_saturated_at = round(now, 2)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), LLMD_POLL_S)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self) -> None:
        while True:
            began = time.monotonic()
            try:
                stats = await self.probe.sample()
            except Exception:  # noqa: BLE001 - a failed poll ages the last reading
                stats = None
            if stats is not None:
                self._fresh_at = time.monotonic()
                self._last = (stats.requests_waiting, stats.kv_cache_usage_ratio)
            await asyncio.sleep(max(0.0, LLMD_POLL_S - (time.monotonic() - began)))

    async def close(self) -> None:
        """Stop polling and serving."""
        self._stop.set()
        if self._task is not None:
            await self._task
        await self.probe.close()
        if self._runner is not None:
            await self._runner.cleanup()


def predict_linear_alert(
    samples: Iterable[tuple[float, float]],
    *,
    scrape_s: float = PL_SCRAPE_S,
    window_s: float = PL_WINDOW_S,
    horizon_s: float = PL_HORIZON_S,
    threshold: float = PL_THRESHOLD,
) -> float | None:
    """The first evaluation time at which ``predict_linear(usage[window], horizon) >= threshold``.

    ``samples`` are (t, usage) pairs; they are thinned to one per ``scrape_s`` (what
    Prometheus would have scraped) and, like Prometheus, the rule is evaluated at each
    scrape over the samples of the last ``window_s`` by least squares, predicting
    ``horizon_s`` ahead of the evaluation time. Times before 0 (the warm-up) count as
    history but never fire.
    """
    scraped: list[tuple[float, float]] = []
    for t, usage in samples:
        if not scraped or t - scraped[-1][0] >= scrape_s - 1e-9:
            scraped.append((t, usage))
    for i, (now, _) in enumerate(scraped):
        window = [(t, u) for t, u in scraped[: i + 1] if t > now - window_s]
        if now < 0 or len(window) < 2:
            continue
        mean_t = statistics.fmean(t for t, _ in window)
        mean_u = statistics.fmean(u for _, u in window)
        var = sum((t - mean_t) ** 2 for t, _ in window)
        if var == 0:
            continue
        slope = sum((t - mean_t) * (u - mean_u) for t, u in window) / var
        predicted = mean_u + slope * (now - mean_t + horizon_s)
        if predicted >= threshold:
            return round(now, 2)
    return None


def first_high(forecast: Iterable[Any]) -> float | None:
    """When kvguard first decided ``high`` or worse, from (t, usage, demand, level) rows."""
    high = LEVELS.index("high")
    return next((row[0] for row in forecast if LEVELS.index(row[3]) >= high), None)


def first_preemption(timeline: Timeline) -> float | None:
    """When the engine's preemption counter first rose after the workload began."""
    base = next((p for t, _, _, p in timeline.engine if t >= 0), None)
    if base is None:
        return None
    return next((t for t, _, _, p in timeline.engine if t >= 0 and p > base), None)


def _watch_decisions(
    daemon: Daemon, clock: Clock, timeline: Timeline
) -> Callable[[Snapshot], None]:
    """After each tick: kvguard's forecast and plan, timed from the workload's start."""

    def after_tick(_: Snapshot) -> None:
        decision = daemon.brain.decision
        now = clock.now()
        if decision is None or now is None:
            return
        signals = decision.signals
        timeline.forecast.append(
            (round(now, 2), signals.kv_usage, signals.kv_demand, decision.level)
        )
        timeline.actions.extend(
            (round(now, 2), action.kind if action.kind != "release" else f"release {action.target}")
            for action in decision.plan
        )

    return after_tick


def interventions(proxy: AdmissionProxy | None) -> dict[str, int] | None:
    """What a policy's proxy did to requests: shed, refused, clamped, cancelled."""
    if proxy is None:
        return None
    counters = proxy.counters
    return {
        "shed": sum(counters.shed.values()),
        "refused": sum(n for reason, n in counters.rejected.items() if reason != "invalid_body"),
        "clamped": counters.clamped,
        "cancelled": sum(counters.cancelled.values()),
    }


class Policy:
    """One traffic policy in front of (or inside) one engine, and its watchers."""

    def __init__(
        self, name: str, engine_url: str, clock: Clock, timelines: dict[str, Timeline]
    ) -> None:
        if name not in TRAFFIC_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(TRAFFIC_POLICIES)}, not {name!r}")
        self.name = name
        self.engine_url = engine_url
        self.clock = clock
        self.timelines = timelines
        self.url = engine_url
        self.guard: Guard | None = None
        self.watcher: Guard | None = None
        self.llmd: LlmdRule | None = None

    async def start(self) -> None:
        """Start what the policy puts in front of (or beside) the engine."""
        if self.name == "kvguard":
            self.guard = await start_guard(self.engine_url, poll={})
            assert self.guard.proxy_url is not None  # noqa: S101 - the proxy is enabled
            self.url = self.guard.proxy_url
            self._watch(self.guard, "kvguard")
        elif self.name == "llmd_rule":
            self.llmd = LlmdRule(self.engine_url, self.clock)
            await self.llmd.start()
            self.url = self.llmd.url
        elif self.name == "none":
            # kvguard in dry-run rides along: same traffic, its warnings timed.
            self.watcher = await start_watcher(self.engine_url, poll={}, policy={"dry_run": True})
            self.timelines["kvguard_dry_run"] = Timeline()
            self._watch(self.watcher, "kvguard_dry_run")

    def _watch(self, guard: Guard, name: str) -> None:
        guard.run_in_background(_watch_decisions(guard.daemon, self.clock, self.timelines[name]))

    async def close(self) -> None:
        """Stop the tick loops, proxies and probes (the engine is the caller's)."""
        if self.guard is not None:
            await self.guard.close()
        if self.watcher is not None:
            await self.watcher.close()
        if self.llmd is not None:
            await self.llmd.close()

    def warned_at(self) -> float | None:
        """When the policy first warned (kvguard's first high, llm-d's first saturation)."""
        if self.guard is not None:
            return first_high(self.timelines["kvguard"].forecast)
        if self.llmd is not None:
            return self.llmd.first_saturated_at
        return None

    def interventions(self) -> dict[str, int] | None:
        """What the policy's proxy did, None for a policy without one."""
        if self.guard is not None:
            return interventions(self.guard.proxy)
        if self.llmd is not None:
            return interventions(self.llmd.proxy)
        return None
