"""Protection efficacy: kvguard against the policies an operator would otherwise use.

Every run sends the SAME seeded ``kvguard loadgen`` traffic (one pattern, one seed) to a
fresh simulated vLLM engine with a small KV pool, on 127.0.0.1 only, under one policy:

* ``none``: straight at the engine.
* ``static_limit``: the engine's own static cap, tuned as a user would: ``max_num_seqs``
  lowered so that requests of a typical size fit the pool (``STATIC_MAX_NUM_SEQS``: a
  12,288-token pool over about 1,000 tokens per request). Nothing else changes.
* ``llmd_rule``: llm-d's saturation rule in kvguard's proxy: the engine's metrics polled
  every 50 ms; while ``max(waiting / 5, kv_usage / 0.8) >= 1`` every ``sheddable``
  request is refused at once (503); nothing else is done.
* ``predict_linear``: a Prometheus-style trend alert on the ``none`` run's KV usage
  (``predict_linear(kv_usage[5s], 10) >= 0.95`` evaluated every 0.5 s: the usual
  ``[5m]`` window and 10 min horizon scaled to runs of seconds). It only warns: its
  figures are those of ``none`` apart from the lead time.
* ``kvguard``: kvguard at its defaults (daemon live, admission proxy in the path).
* ``kvguard_dry_run``: kvguard at its defaults in dry-run, watching the ``none`` run: the
  lead time of its first ``high`` decision only.

Two failure modes: ``preempt`` (the engine preempts when the pool runs out, as vLLM
does) and ``oom`` (``oom_on_exhaust``: it crashes instead, as engines that allocate per
sequence do; a run ends at the crash). Each run: ``WARMUP_S`` of light steady traffic,
then ``pattern_s`` of the pattern at concurrency 256.

    .venv/bin/python -m bench.efficacy [--quick] [--seeds 5] [--pattern-s 12]

Writes ``bench/results/efficacy.json`` (the list of runs), ``efficacy_summary.json``
(per pattern and failure mode, each policy's median and spread over seeds),
``efficacy_timeseries.json`` and, with matplotlib (the ``bench`` extra), one PNG per
pattern under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp

from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
from kvguard.api.logs import configure_logging
from kvguard.core.policy import LEVELS
from kvguard.core.snapshot import Snapshot
from kvguard.errors import KvguardError
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.assembly import Guard, bound_url, listen
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.inprocess import start_guard, start_watcher
from kvguard.sim.engine import TimeModel
from kvguard.sim.loadgen import LoadConfig, run_load
from kvguard.sim.loadgen_report import LoadReport
from kvguard.sim.runner import PoolSpec, SimServer, size_pool, start_sim_server
from kvguard.sim.traffic import PRIORITIES

RESULTS = Path("bench/results")
POOL = PoolSpec(
    kv_capacity_tokens=12_288, max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=2048
)
PATTERNS = ("bursty_short", "long_context", "prefill_heavy", "decode_heavy", "ramp", "mixed")
FAILURE_MODES = ("preempt", "oom")
# Policies that shape traffic each get a run of their own; the observers ride on `none`.
TRAFFIC_POLICIES = ("none", "static_limit", "llmd_rule", "kvguard", "kvguard_projected")
OBSERVERS = ("predict_linear", "kvguard_dry_run")
POLICIES = (*TRAFFIC_POLICIES, *OBSERVERS)
STATIC_MAX_NUM_SEQS = 12  # 12,288 pool tokens / ~1,000 tokens a typical request holds
WARMUP_S = 2.0
PATTERN_S = 10.0
QUICK_PATTERN_S = 4.0
QUICK_GRACE_S = 2.0
GRACE_S = 6.0  # after the pattern: time for the backlog to finish, so goodput counts it
STOP_WAIT_S = 3.0
CONCURRENCY = 256
MAX_REQUESTS = 5000
SLO_TTFT_S = 2.0  # goodput: completed with TTFT <= 2 s and end-to-end <= 30 s
SLO_E2E_S = 30.0
SAMPLE_S = 0.1  # the engine's own state, read in-process: ground truth
# llm-d's saturation detector, as published: queue depth 5, KV-cache utilization 0.8.
LLMD_QUEUE_DEPTH = 5.0
LLMD_KV_UTIL = 0.8
LLMD_POLL_S = 0.05
# predict_linear(kv_usage[WINDOW], HORIZON) >= THRESHOLD, evaluated every SCRAPE_S.
PL_SCRAPE_S = 0.5
PL_WINDOW_S = 5.0
PL_HORIZON_S = 10.0
PL_THRESHOLD = 0.95
TIMESERIES_SEED = 1  # the representative run per pattern that is kept and plotted
# ``[proxy]`` for each kvguard policy: the defaults, and projected admission (the setting
# docs/proxy.md recommends for engines that crash when the pool runs out).
KVGUARD_PROXY: dict[str, dict[str, Any]] = {
    "kvguard": {},
    "kvguard_projected": {"admission": "projected"},
}


@dataclass
class Run:
    """One policy on one pattern, seed and failure mode: what the traffic and engine saw."""

    engine: str
    failure_mode: str
    pattern: str
    seed: int
    policy: str
    crashes: int = 0
    preemptions: int = 0
    sent: int = 0
    completed: int = 0
    goodput: int = 0
    shed_fraction: float = 0.0
    shed_by_priority: dict[str, float] = field(default_factory=dict)
    clamped_fraction: float = 0.0
    cancelled_fraction: float = 0.0
    failed: int = 0
    critical_lost: int = 0
    p50_ttft_s: float | None = None
    p99_ttft_s: float | None = None
    p50_e2e_s: float | None = None
    p99_e2e_s: float | None = None
    warned_at_s: float | None = None  # first high decision / alert / saturation
    failed_at_s: float | None = None  # first preemption or the crash
    lead_time_s: float | None = None  # failed_at_s - warned_at_s, when both happened
    wall_s: float = 0.0


@dataclass
class Trace:
    """What happened over one run, for the plot: the engine's state and kvguard's view."""

    engine: list[tuple[float, float, int, int]] = field(default_factory=list)  # t, usage, wait, pre
    forecast: list[tuple[float, float | None, float | None, str]] = field(default_factory=list)
    actions: list[tuple[float, str]] = field(default_factory=list)
    crash_at_s: float | None = None


class Clock:
    """Seconds since the pattern started (None during the warm-up)."""

    def __init__(self) -> None:
        self.start: float | None = None

    def now(self) -> float | None:
        """Seconds into the pattern, or None before it started."""
        return None if self.start is None else time.monotonic() - self.start


# ------------------------------------------------------------------ policies
class LlmdRule:
    """llm-d's saturation rule as a policy in kvguard's proxy.

    A loop polls the engine's ``/metrics`` every 50 ms and, while the engine is
    saturated (``max(waiting / 5, kv_usage / 0.8) >= 1``), sets the proxy's shed floor
    to ``sheddable`` with no holding (``shed_ratio`` 0): every sheddable request is
    refused at once, as the Inference Gateway's saturation detector does. The same
    proxy code forwards, so only the rule differs from kvguard's.
    """

    def __init__(self, engine_url: str, clock: Clock) -> None:
        self.engine_url = engine_url
        self.clock = clock
        self.mitigations = Mitigations(enforcing=True, retry_after_s=1)
        self.probe = EngineProbe(engine_url, kind="vllm", timeout_s=1.0)
        self.first_saturated_at: float | None = None
        self.url = ""
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._runner: Any = None

    async def start(self) -> None:
        """Start the proxy and the polling loop."""
        settings = ProxySettings(upstream=self.engine_url, listen="127.0.0.1:0", shed_ratio=0.0)
        self.proxy = AdmissionProxy(settings, self.mitigations)
        self._runner = await listen(self.proxy.app(), "127.0.0.1:0", cancel=True)
        self.url = bound_url(self._runner)
        self._task = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                stats = await self.probe.sample()
            except Exception:  # noqa: BLE001 - a failed poll keeps the last decision
                stats = None
            if stats is not None:
                saturation = max(
                    (stats.requests_waiting or 0.0) / LLMD_QUEUE_DEPTH,
                    (stats.kv_cache_usage_ratio or 0.0) / LLMD_KV_UTIL,
                )
                saturated = saturation >= 1.0
                self.mitigations.shed_floor = "sheddable" if saturated else None
                self.mitigations.level = "high" if saturated else "ok"
                now = self.clock.now()
                if saturated and now is not None and self.first_saturated_at is None:
                    self.first_saturated_at = round(now, 2)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), LLMD_POLL_S)

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


# ------------------------------------------------------------------ one run
# The engine's (KV usage ratio, waiting requests, preemptions so far), however it is read.
Reading = tuple[float, int, int]


async def sample_engine(
    read: Callable[[], Awaitable[Reading]],
    clock: Clock,
    trace: Trace,
    stop: asyncio.Event,
    every_s: float = SAMPLE_S,
) -> None:
    """The engine's usage, queue and preemptions every ``every_s``, and once more at the end.

    Times are seconds from the pattern's start, the warm-up's negative: one continuous
    history, as Prometheus would have scraped it (the trend alert's window reaches back
    into the warm-up at the pattern's start).
    """
    rows: list[tuple[float, float, int, int]] = []
    try:
        while True:
            stopping = stop.is_set()
            # A reading that fails (an engine too busy to answer in time) is a gap.
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
        trace.engine.extend((round(at - start, 2), u, w, p) for at, u, w, p in rows)


def _sim_reader(server: SimServer) -> Callable[[], Awaitable[Reading]]:
    async def read() -> Reading:
        sched = server.engine.scheduler
        return sched.usage, len(sched.waiting), int(server.engine.stats.preemptions_total)

    return read


def _watch_decisions(daemon: Daemon, clock: Clock, trace: Trace) -> Callable[[Snapshot], None]:
    """After each tick: kvguard's forecast and plan, timed from the pattern's start."""

    def after_tick(_: Snapshot) -> None:
        decision = daemon.brain.decision
        now = clock.now()
        if decision is None or now is None:
            return
        signals = decision.signals
        trace.forecast.append((round(now, 2), signals.kv_usage, signals.kv_demand, decision.level))
        trace.actions.extend(
            (round(now, 2), action.kind if action.kind != "release" else f"release {action.target}")
            for action in decision.plan
        )

    return after_tick


def _first_high(trace: Trace) -> float | None:
    return _first_high_in(trace.forecast)


def _first_high_in(forecast: Iterable[Any]) -> float | None:
    """When kvguard first decided ``high`` or worse, from (t, usage, demand, level) rows."""
    high = LEVELS.index("high")
    return next((row[0] for row in forecast if LEVELS.index(row[3]) >= high), None)


def _first_preemption(trace: Trace) -> float | None:
    base = next((p for t, _, _, p in trace.engine if t >= 0), None)
    if base is None:
        return None
    return next((t for t, _, _, p in trace.engine if t >= 0 and p > base), None)


class Policy:
    """One traffic policy in front of one engine: where the load goes, and its watchers."""

    def __init__(self, name: str, engine_url: str, clock: Clock, traces: dict[str, Trace]) -> None:
        self.name = name
        self.engine_url = engine_url
        self.clock = clock
        self.traces = traces
        self.url = engine_url
        self.guard: Guard | None = None
        self.watcher: Guard | None = None
        self.llmd: LlmdRule | None = None

    async def start(self) -> None:
        """Start what the policy puts in front of (or beside) the engine."""
        engine_url = self.engine_url
        if self.name in KVGUARD_PROXY:
            self.guard = await start_guard(engine_url, poll={}, proxy=KVGUARD_PROXY[self.name])
            assert self.guard.proxy_url is not None  # noqa: S101 - the proxy is enabled
            self.url = self.guard.proxy_url
            self._watch(self.guard, self.name)
        elif self.name == "llmd_rule":
            self.llmd = LlmdRule(engine_url, self.clock)
            await self.llmd.start()
            self.url = self.llmd.url
        elif self.name == "none":
            # kvguard in dry-run rides along: same traffic, its warnings timed.
            self.watcher = await start_watcher(engine_url, poll={}, policy={"dry_run": True})
            self.traces["kvguard_dry_run"] = Trace()
            self._watch(self.watcher, "kvguard_dry_run")

    def _watch(self, guard: Guard, trace: str) -> None:
        guard.run_in_background(_watch_decisions(guard.daemon, self.clock, self.traces[trace]))

    async def close(self) -> None:
        """Stop the tick loops, proxies and probes (the engine is the caller's)."""
        if self.guard is not None:
            await self.guard.close()
        if self.watcher is not None:
            await self.watcher.close()
        if self.llmd is not None:
            await self.llmd.close()

    def record(self, run: Run) -> None:
        """The policy's own figures: when it warned, what its proxy clamped or cancelled."""
        if self.guard is not None:
            run.warned_at_s = _first_high(self.traces[self.name])
            _record_proxy(run, self.guard.proxy)
        elif self.llmd is not None:
            run.warned_at_s = self.llmd.first_saturated_at
            _record_proxy(run, self.llmd.proxy)


async def measure(
    pattern: str,
    seed: int,
    policy: str,
    *,
    failure_mode: str = "preempt",
    pattern_s: float = PATTERN_S,
    grace_s: float = GRACE_S,
) -> tuple[list[Run], dict[str, Trace]]:
    """One traffic run of ``policy`` (and, for ``none``, the observers riding on it)."""
    if policy not in TRAFFIC_POLICIES:
        raise ValueError(f"policy must be one of {', '.join(TRAFFIC_POLICIES)}, not {policy!r}")
    began = time.monotonic()
    spec = replace(POOL, oom_on_exhaust=failure_mode == "oom")
    if policy == "static_limit":
        spec = replace(spec, max_num_seqs=STATIC_MAX_NUM_SEQS)
    server = await start_sim_server(size_pool(spec), time_model=TimeModel(), seed=seed)
    clock = Clock()
    traces = {policy: Trace()}
    trace = traces[policy]
    stop_sampling = asyncio.Event()
    sampler = asyncio.ensure_future(sample_engine(_sim_reader(server), clock, trace, stop_sampling))
    shaping = Policy(policy, server.url, clock, traces)
    report: LoadReport | None = None
    try:
        await shaping.start()
        await run_load(warmup_load(shaping.url, seed, SIM_LOAD))
        clock.start = time.monotonic()
        load = pattern_load(
            shaping.url, pattern, seed, duration_s=pattern_s, grace_s=grace_s, shape=SIM_LOAD
        )
        report, trace.crash_at_s = await _load_until_crash(server, load)
    finally:
        stop_sampling.set()
        await sampler
        await shaping.close()
        await server.stop()
    run = run_from(
        report, trace, engine="sim", pattern=pattern, seed=seed, policy=policy, mode=failure_mode
    )
    return finish(run, shaping, traces, began), traces


def finish(run: Run, shaping: Policy, traces: dict[str, Trace], began: float) -> list[Run]:
    """The policy's own figures, the observers' runs (for ``none``), lead times."""
    shaping.record(run)
    trace = traces[run.policy]
    runs = [run]
    if run.policy == "none":
        usage = [(t, u) for t, u, _, _ in trace.engine]
        runs.append(replace(run, policy="predict_linear", warned_at_s=predict_linear_alert(usage)))
        dry = _first_high(traces["kvguard_dry_run"])
        runs.append(replace(run, policy="kvguard_dry_run", warned_at_s=dry))
    wall = time.monotonic() - began
    for r in runs:
        r.wall_s = round(wall, 1)
        if r.warned_at_s is not None and r.failed_at_s is not None:
            r.lead_time_s = round(r.failed_at_s - r.warned_at_s, 2)
    return runs


@dataclass(frozen=True)
class LoadShape:
    """How hard the load drives an engine: what suits the simulator differs from a CPU vLLM."""

    concurrency: int = CONCURRENCY
    max_context: int = POOL.max_model_len
    scale: float = 1.0
    warmup_scale: float = 0.2
    max_requests: int = MAX_REQUESTS


SIM_LOAD = LoadShape()


def warmup_load(url: str, seed: int, shape: LoadShape) -> LoadConfig:
    """Light steady traffic before the pattern: kvguard runs before trouble starts."""
    return LoadConfig(
        url,
        pattern="steady",
        duration_s=WARMUP_S,
        max_requests=200,
        concurrency=8,
        seed=seed,
        scale=shape.warmup_scale,
        max_context=shape.max_context,
        grace_s=0.5,
    )


def pattern_load(
    url: str, pattern: str, seed: int, *, duration_s: float, grace_s: float, shape: LoadShape
) -> LoadConfig:
    """The pattern itself, with the goodput SLOs."""
    return LoadConfig(
        url,
        pattern=pattern,
        duration_s=duration_s,
        max_requests=shape.max_requests,
        concurrency=shape.concurrency,
        seed=seed,
        scale=shape.scale,
        max_context=shape.max_context,
        slo_ttft_s=SLO_TTFT_S,
        slo_e2e_s=SLO_E2E_S,
        grace_s=grace_s,
    )


async def _load_until_crash(
    server: SimServer, config: LoadConfig
) -> tuple[LoadReport | None, float | None]:
    """The pattern's load, ended early by a crash of the engine: (report, crash time).

    The report is None when the load did not stop within ``STOP_WAIT_S`` of a crash
    (on Python 3.11 a crash freeing every loadgen slot at once can let the dispatcher
    miss ``stop``); the run then counts every request as lost.
    """
    start = time.monotonic()
    stop = asyncio.Event()
    load = asyncio.ensure_future(run_load(config, stop=stop))
    crashed = asyncio.ensure_future(server.crashed.wait())
    crashed_at: float | None = None
    try:
        await asyncio.wait({load, crashed}, return_when=asyncio.FIRST_COMPLETED)
        if server.crashed.is_set():
            crashed_at = round(time.monotonic() - start, 2)
            stop.set()
            await asyncio.wait({load}, timeout=STOP_WAIT_S)
            if not load.done():
                return None, crashed_at
        return load.result(), crashed_at
    finally:
        for task in (load, crashed):
            task.cancel()
        await asyncio.gather(load, crashed, return_exceptions=True)


def run_from(
    report: LoadReport | None,
    trace: Trace,
    *,
    engine: str,
    pattern: str,
    seed: int,
    policy: str,
    mode: str,
) -> Run:
    """A run's figures from the load's report and the engine's sampled trace."""
    base = next((p for t, _, _, p in trace.engine if t >= 0), 0)
    last = trace.engine[-1][3] if trace.engine else base
    run = Run(
        engine=engine,
        failure_mode=mode,
        pattern=pattern,
        seed=seed,
        policy=policy,
        crashes=1 if trace.crash_at_s is not None else 0,
        preemptions=int(last - base),
    )
    run.failed_at_s = trace.crash_at_s if trace.crash_at_s is not None else _first_preemption(trace)
    if report is None:
        run.critical_lost = -1  # unknown: the load was cut off after the crash
        return run
    run.sent, run.completed, run.goodput, run.failed = (
        report.sent,
        report.succeeded,
        report.goodput,
        report.failed + report.unfinished,
    )
    run.shed_fraction = round(report.shed / report.sent, 4) if report.sent else 0.0
    run.shed_by_priority = {
        name: round(counts.shed / counts.sent, 4) if counts.sent else 0.0
        for name, counts in report.by_priority.items()
        if name in PRIORITIES
    }
    # Lost: refused or failed. A request still running when the run's grace ran out
    # is cut off by the benchmark, not lost by the engine (``failed`` counts it).
    critical = report.by_priority.get("critical")
    run.critical_lost = critical.shed + critical.failed if critical is not None else 0
    if report.ttft_s is not None:
        run.p50_ttft_s, run.p99_ttft_s = round(report.ttft_s.p50, 3), round(report.ttft_s.p99, 3)
    if report.e2e_s is not None:
        run.p50_e2e_s, run.p99_e2e_s = round(report.e2e_s.p50, 3), round(report.e2e_s.p99, 3)
    return run


def _record_proxy(run: Run, proxy: AdmissionProxy | None) -> None:
    if proxy is None or not run.sent:
        return
    counters = proxy.counters
    run.clamped_fraction = round(counters.clamped / run.sent, 4)
    run.cancelled_fraction = round(sum(counters.cancelled.values()) / run.sent, 4)


# ------------------------------------------------------------------ summary
def _spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None}
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


METRICS = (
    "crashes",
    "preemptions",
    "completed",
    "goodput",
    "shed_fraction",
    "critical_lost",
    "p99_ttft_s",
    "lead_time_s",
)


def summarize(runs: list[Run]) -> dict[str, Any]:
    """Per failure mode and pattern: each policy's metrics (median, min, max over seeds)."""
    out: dict[str, Any] = {}
    for mode in FAILURE_MODES:
        for pattern in PATTERNS:
            mine = [r for r in runs if r.failure_mode == mode and r.pattern == pattern]
            if not mine:
                continue
            table: dict[str, Any] = {}
            for policy in POLICIES:
                rows = [r for r in mine if r.policy == policy]
                if not rows:
                    continue
                # A run whose load could not be stopped after a crash has no figures
                # (critical_lost -1): it counts as a crash and as cut off, nothing else.
                known = [r for r in rows if r.critical_lost >= 0]
                failed = [r for r in rows if r.failed_at_s is not None]
                table[policy] = {
                    "seeds": len(rows),
                    "crashes_total": sum(r.crashes for r in rows),
                    "cut_off": len(rows) - len(known),
                    # Runs that failed (a preemption or the crash), and how many of them
                    # the policy warned about first: a lead time exists only for those.
                    "failures": len(failed),
                    "warned_first": sum(
                        1 for r in failed if r.warned_at_s is not None and r.lead_time_s >= 0
                    ),
                    **{
                        m: _spread([getattr(r, m) for r in known if getattr(r, m) is not None])
                        for m in METRICS
                    },
                }
            out.setdefault(mode, {})[pattern] = table
    return out


GUARDED = ("kvguard", "kvguard_projected")  # the policies the targets are checked for


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Kvguard's targets on the sim, per failure mode, pattern and kvguard configuration."""
    return [
        {
            "failure_mode": mode,
            "pattern": pattern,
            "policy": policy,
            "target": name,
            "met": met,
            "detail": detail,
        }
        for mode, patterns in summary.items()
        for pattern, table in patterns.items()
        for policy in GUARDED
        if policy in table and "none" in table
        for name, met, detail in _checks(mode, table, policy)
    ]


def _med(table: dict[str, Any], policy: str, metric: str) -> float:
    value = table.get(policy, {}).get(metric, {}).get("median")
    return 0.0 if value is None else float(value)


def _checks(mode: str, table: dict[str, Any], policy: str) -> list[tuple[str, bool, str]]:
    kv = table[policy]
    out = [("zero crashes", kv["crashes_total"] == 0, f"{kv['crashes_total']} crashes")]
    if mode == "preempt":
        base, mine = _med(table, "none", "preemptions"), _med(table, policy, "preemptions")
        out.append(("preemptions <= 10% of none", mine <= 0.1 * base, f"{mine:g} vs {base:g}"))
    goodput = _med(table, policy, "goodput")
    higher = [
        f"{p} {_med(table, p, 'goodput'):g}"
        for p in ("none", "static_limit", "llmd_rule")
        if p in table and _med(table, p, "goodput") > goodput
    ]
    detail = f"{goodput:g}" + (f"; higher: {', '.join(higher)}" if higher else "")
    out.append(("goodput >= every baseline", not higher, detail))
    if "llmd_rule" in table:
        mine, theirs = (
            _med(table, policy, "shed_fraction"),
            _med(table, "llmd_rule", "shed_fraction"),
        )
        detail = f"{mine:.1%} vs {theirs:.1%}"
        crashed = table["llmd_rule"]["crashes_total"]
        if crashed:
            detail += f" (llm-d crashed in {crashed}/{table['llmd_rule']['seeds']} runs: its share"
            detail += " counts only what was sent before the crash)"
        out.append(("shed <= llm-d rule's", mine <= theirs + 1e-9, detail))
    lost = kv["critical_lost"]["max"]
    out.append(("zero critical lost", lost == 0, f"at most {lost:g} in a run"))
    return out


# ------------------------------------------------------------------ driver
def machine() -> dict[str, Any]:
    """What this ran on: the figures only mean something next to it."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


async def run_all(
    *,
    patterns: tuple[str, ...],
    seeds: int,
    pattern_s: float,
    grace_s: float = GRACE_S,
    modes: tuple[str, ...] = FAILURE_MODES,
    policies: tuple[str, ...] = TRAFFIC_POLICIES,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[Run], dict[str, dict[str, Any]]]:
    """Every failure mode x pattern x seed x traffic policy; the kept time series."""
    runs: list[Run] = []
    series: dict[str, dict[str, Any]] = {}
    for mode in modes:
        for pattern in patterns:
            for seed in range(1, seeds + 1):
                for policy in policies:
                    got, traces = await measure(
                        pattern,
                        seed,
                        policy,
                        failure_mode=mode,
                        pattern_s=pattern_s,
                        grace_s=grace_s,
                    )
                    runs.extend(got)
                    if seed == TIMESERIES_SEED and mode == "preempt":
                        for name, trace in traces.items():
                            series.setdefault(pattern, {})[name] = asdict(trace)
                    if progress is not None:
                        r = got[0]
                        progress(
                            f"{mode:<7} {pattern:<13} seed {seed} {policy:<17}"
                            f" crashes {r.crashes} preemptions {r.preemptions:>4}"
                            f" goodput {r.goodput:>4}/{r.sent:<4} shed {r.shed_fraction:.0%}"
                            f" critical lost {r.critical_lost} ({r.wall_s:.0f} s)"
                        )
    return runs, series


def settings(
    pattern_s: float, grace_s: float, seeds: int, patterns: tuple[str, ...]
) -> dict[str, Any]:
    """The run's parameters, written beside the results."""
    return {
        "engine": "kvguard's simulated vLLM (`kvguard sim-engine`; every request generates"
        " exactly its `max_tokens`, so a projection of prompt + `max_tokens` is exact)",
        "pool": {
            "kv_capacity_tokens": POOL.kv_capacity_tokens,
            "max_model_len": POOL.max_model_len,
            "max_num_seqs": POOL.max_num_seqs,
            "max_num_batched_tokens": POOL.max_num_batched_tokens,
        },
        "patterns": list(patterns),
        "seeds": seeds,
        "warmup_s": WARMUP_S,
        "pattern_s": pattern_s,
        "grace_s": grace_s,
        "concurrency": CONCURRENCY,
        "slo": {"ttft_s": SLO_TTFT_S, "e2e_s": SLO_E2E_S},
        "static_limit": {"max_num_seqs": STATIC_MAX_NUM_SEQS},
        "llmd_rule": {
            "queue_depth": LLMD_QUEUE_DEPTH,
            "kv_util": LLMD_KV_UTIL,
            "poll_s": LLMD_POLL_S,
        },
        "predict_linear": {
            "scrape_s": PL_SCRAPE_S,
            "window_s": PL_WINDOW_S,
            "horizon_s": PL_HORIZON_S,
            "threshold": PL_THRESHOLD,
        },
        "kvguard_proxy": KVGUARD_PROXY,
    }


def run(
    *,
    quick: bool,
    out_dir: Path = RESULTS,
    seeds: int | None = None,
    pattern_s: float | None = None,
    patterns: tuple[str, ...] | None = None,
    modes: tuple[str, ...] = FAILURE_MODES,
    policies: tuple[str, ...] = TRAFFIC_POLICIES,
) -> dict[str, Any]:
    """Run the benchmark, write its files under ``out_dir`` and return the summary document.

    ``quick``: two patterns, one seed, short runs (a smoke test of a few minutes).
    """
    patterns = patterns or (("bursty_short", "long_context") if quick else PATTERNS)
    seeds = seeds if seeds is not None else (1 if quick else 5)
    pattern_s = pattern_s if pattern_s is not None else (QUICK_PATTERN_S if quick else PATTERN_S)
    grace_s = QUICK_GRACE_S if quick else GRACE_S
    began = time.monotonic()
    info = machine()
    runs, series = asyncio.run(
        run_all(
            patterns=patterns,
            seeds=seeds,
            pattern_s=pattern_s,
            grace_s=grace_s,
            modes=modes,
            policies=policies,
            progress=lambda line: print(line, flush=True),  # noqa: T201 - a long run's progress
        )
    )
    meta = {
        "machine": info,
        "settings": settings(pattern_s, grace_s, seeds, patterns),
        "quick": quick,
        "wall_s": round(time.monotonic() - began, 1),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "efficacy.json").write_text(json.dumps([asdict(r) for r in runs], indent=1) + "\n")
    (out_dir / "efficacy_timeseries.json").write_text(json.dumps(series) + "\n")
    (out_dir / "efficacy_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return report(out_dir)


def merge(out_dir: Path, parts: list[Path]) -> dict[str, Any]:
    """Join runs written to several directories (e.g. one per failure mode, run side by side).

    A run of a later part replaces a run of an earlier one with the same engine, failure
    mode, pattern, seed and policy: re-running one policy after a change replaces its
    figures and keeps the others.
    """
    runs: dict[tuple[Any, ...], dict[str, Any]] = {}
    series: dict[str, dict[str, Any]] = {}
    meta: dict[str, Any] = {}
    for part in parts:
        for r in json.loads((part / "efficacy.json").read_text()):
            runs[(r["engine"], r["failure_mode"], r["pattern"], r["seed"], r["policy"])] = r
        for pattern, traces in json.loads((part / "efficacy_timeseries.json").read_text()).items():
            series.setdefault(pattern, {}).update(traces)
        got = json.loads((part / "efficacy_meta.json").read_text())
        parts_seen = [*meta.get("parts", []), {"dir": part.name, "date": got["machine"]["date"]}]
        parts_seen[-1]["wall_s"] = got["wall_s"]
        wall = meta.get("wall_s", 0.0) + got["wall_s"]
        meta = {**got, "wall_s": round(wall, 1), "parts": parts_seen}  # the last part's settings
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "efficacy.json").write_text(json.dumps(list(runs.values()), indent=1) + "\n")
    (out_dir / "efficacy_timeseries.json").write_text(json.dumps(series) + "\n")
    (out_dir / "efficacy_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return report(out_dir)


def report(out_dir: Path) -> dict[str, Any]:
    """Summarize the runs in ``out_dir``: ``efficacy_summary.json`` and the plots."""
    runs = [Run(**r) for r in json.loads((out_dir / "efficacy.json").read_text())]
    series = json.loads((out_dir / "efficacy_timeseries.json").read_text())
    doc = json.loads((out_dir / "efficacy_meta.json").read_text())
    summary = summarize(runs)
    doc["summary"] = summary
    doc["targets"] = targets(summary)
    doc["plots"] = plot(series, out_dir)
    (out_dir / "efficacy_summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def plot(series: dict[str, dict[str, Any]], out_dir: Path) -> list[str]:
    """One PNG per pattern: KV usage without and with kvguard, its forecast and actions.

    Needs matplotlib (the ``bench`` extra); without it, no plots and an empty list.
    """
    try:
        import matplotlib  # noqa: PLC0415 - optional

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return []
    written = []
    for pattern, traces in series.items():
        fig, ax = plt.subplots(figsize=(9, 3.6))
        lines = (("none", "tab:red"), ("kvguard", "tab:green"), ("kvguard_projected", "tab:blue"))
        for name, color in lines:
            trace = traces.get(name)
            if trace is None:
                continue
            pts = [(t, u) for t, u, _, _ in trace["engine"] if t >= 0]
            ax.plot(
                [t for t, _ in pts], [u for _, u in pts], color=color, label=f"KV usage, {name}"
            )
        kv = traces.get("kvguard")
        if kv is not None:
            demand = [(t, d) for t, _, d, _ in kv["forecast"] if d is not None]
            ax.plot(
                [t for t, _ in demand],
                [min(d, 1.95) for _, d in demand],
                color="tab:green",
                linestyle="--",
                label="kvguard forecast: demand (cut at 1.95)",
            )
            seen: set[str] = set()
            for t, kind in kv["actions"]:
                ax.axvline(t, color="tab:green", alpha=0.3, linewidth=0.8)
                if kind not in seen:
                    ax.text(t, 1.55, kind, fontsize=6, rotation=90, va="bottom")
                    seen.add(kind)
        dry = traces.get("kvguard_dry_run")
        high = _first_high_in(dry["forecast"]) if dry else None
        if high is not None:
            ax.axvline(high, color="tab:orange", linestyle=":", label="dry-run: first high")
        ax.set_ylim(0, 2.0)
        ax.set_xlabel("seconds into the pattern")
        ax.set_ylabel("fraction of the KV pool")
        ax.set_title(f"{pattern} (seed {TIMESERIES_SEED}, preempt mode)")
        ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        path = out_dir / f"efficacy_{pattern}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path.name)
    return written


def main() -> None:
    """``python -m bench.efficacy``: run it, write the files, print the targets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 patterns, 1 seed, short runs")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--pattern-s", type=float, default=None)
    parser.add_argument("--patterns", nargs="+", choices=PATTERNS, default=None)
    parser.add_argument("--modes", nargs="+", choices=FAILURE_MODES, default=list(FAILURE_MODES))
    parser.add_argument(
        "--policies", nargs="+", choices=TRAFFIC_POLICIES, default=list(TRAFFIC_POLICIES)
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="join runs from DIRs instead of running",
    )
    args = parser.parse_args()
    configure_logging("error", "json")  # thousands of shed lines would bury the report
    if args.merge:
        doc = merge(args.out_dir, args.merge)
    else:
        doc = run(
            quick=args.quick,
            out_dir=args.out_dir,
            seeds=args.seeds,
            pattern_s=args.pattern_s,
            patterns=tuple(args.patterns) if args.patterns else None,
            modes=tuple(args.modes),
            policies=tuple(args.policies),
        )
    for check in doc["targets"]:
        mark = "met " if check["met"] else "MISS"
        print(  # noqa: T201 - the benchmark's report
            f"{mark} {check['failure_mode']:<7} {check['pattern']:<13} {check['policy']:<17}"
            f" {check['target']}: {check['detail']}"
        )


if __name__ == "__main__":
    main()
