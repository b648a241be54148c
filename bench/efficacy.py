"""Protection efficacy: kvguard against the strongest policies an operator would otherwise use.

Every run sends the SAME seeded ``kvguard loadgen`` traffic (one workload, one seed) to
a fresh simulated vLLM engine with a small KV pool, on 127.0.0.1 only, under one policy
(bench/efficacy_policies.py: ``none``, the ``static`` sweep of ``max_num_seqs``,
``engine_priority``, ``llmd_rule``, ``kvguard``; observers ``predict_linear`` and
``kvguard_dry_run`` ride on ``none``). The client is the same for all: it over-asks
(``max_tokens`` 2048, capped at the context) while the engine ends each request at its
true length, it retries a 429/503 that carries ``Retry-After`` twice, and latency counts
from each request's scheduled send time.

Workloads: the synthetic patterns, a ``steady_underload`` control (any intervention is
a false positive) and replays of a recorded trace at one or more speeds. Failure modes:
``preempt`` (the engine preempts when the pool runs out, as vLLM does) and ``oom`` (it
allocates KV as sequences grow and dies when an allocation does not fit; once dead it
stays dead for the rest of the run, so everything after the crash fails).

    .venv/bin/python -m bench efficacy [--patterns …] [--traces FILE …] [--speed F …]
        [--modes preempt oom] [--policies …] [--seeds N] [--pattern-s S] [--out-dir DIR]

Writes ``DIR/efficacy.json`` (``meta``: commit, start, machine, load average, every
setting; ``runs``; ``summary``: medians over seeds with 95% bootstrap intervals), the
timelines of seed 1 (``efficacy_timeseries.json``) and, with matplotlib, one PNG per
workload. Results of several runs are never merged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from bench import efficacy_policies as pol
from bench.efficacy_plot import plot
from bench.efficacy_stats import STATIC, summarize
from kvguard.errors import ProbeError
from kvguard.probes.engine import EngineProbe
from kvguard.sim.engine import TimeModel
from kvguard.sim.loadgen import LoadConfig, run_load
from kvguard.sim.loadgen_client import ENGINE_PRIORITIES
from kvguard.sim.loadgen_report import LoadReport
from kvguard.sim.runner import PoolSpec, size_pool, start_sim_server

RESULTS = Path("bench/results")
TRACE_DIR = Path(__file__).resolve().parent / "traces"
AZURE_CODE = TRACE_DIR / "azure-llm-2023-code.csv"
# The engine at vLLM's own defaults for the batch (max_num_seqs 256), with a small pool.
POOL = PoolSpec(
    kv_capacity_tokens=12_288, max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=2048
)
PATTERNS = ("bursty_short", "long_context", "prefill_heavy", "decode_heavy", "ramp", "mixed")
CONTROL = "steady_underload"
# The `steady` pattern with every size x1.3: unguarded, about 40% of this pool in use on
# average, peaks under the pool and no preemption (each run records `kv_usage_mean`).
# Chosen once from `none` runs, before any policy ran on it.
CONTROL_SCALE = 1.3
WORKLOAD_PATTERNS = (*PATTERNS, CONTROL)
FAILURE_MODES = ("preempt", "oom")
POLICIES = (*pol.TRAFFIC_POLICIES, *pol.OBSERVERS)
STATIC_SWEEP = (4, 8, 16, 32, 64, 128)
SPEEDS = (1.0, 4.0)
SEEDS = 5
PATTERN_S = 60.0
WARMUP_S = 3.0
GRACE_S = 10.0  # after the workload: time for what is in flight to finish, so it counts
STOP_WAIT_S = 3.0
CONCURRENCY = 256  # the client's connection limit, the same for every policy
MAX_REQUESTS = 20_000
RETRIES = 2
CLIENT_MAX_TOKENS = 2048
SLO_TTFT_S = 2.0
SLO_TPOT_S = 0.1
TIMESERIES_SEED = 1  # the run per workload whose timeline is kept and plotted


# Where the engine ran when not in its own process (also what a result file written
# before runs said where it ran means: all of those ran in the loop).
ENGINE_IN_LOOP = "the benchmark's own event loop, shared with the load and any proxy"


@dataclass(frozen=True)
class Workload:
    """What the client sends: a pattern (at a size scale) or a trace replay at a speed."""

    pattern: str | None = None
    trace: Path | None = None
    speed: float = 1.0
    scale: float = 1.0

    @property
    def name(self) -> str:
        """The workload's name in the results: the pattern, or ``trace@speed``."""
        if self.trace is not None:
            return f"{self.trace.name}@{self.speed:g}x"
        return CONTROL if self.pattern == "steady" else str(self.pattern)

    def describe(self) -> dict[str, Any]:
        """The workload's settings, as recorded in each run."""
        if self.trace is not None:
            return {"pattern": None, "trace": self.trace.name, "speed": self.speed}
        return {"pattern": self.name, "trace": None, "speed": None, "scale": self.scale}


def pattern_workload(name: str) -> Workload:
    """A synthetic pattern, or the underload control (``steady`` scaled up)."""
    if name == CONTROL:
        return Workload(pattern="steady", scale=CONTROL_SCALE)
    return Workload(pattern=name)


@dataclass(frozen=True)
class Setup:
    """The settings every run of one benchmark shares."""

    pattern_s: float = PATTERN_S
    warmup_s: float = WARMUP_S
    grace_s: float = GRACE_S
    concurrency: int = CONCURRENCY
    retries: int = RETRIES
    client_max_tokens: int = CLIENT_MAX_TOKENS
    slo_ttft_s: float = SLO_TTFT_S
    slo_tpot_s: float = SLO_TPOT_S
    max_context: int = POOL.max_model_len


def load_config(url: str, workload: Workload, seed: int, setup: Setup, policy: str) -> LoadConfig:
    """The client for one run: the same for every policy but ``engine_priority``'s field."""
    common: dict[str, Any] = {
        "duration_s": setup.pattern_s,
        "max_requests": MAX_REQUESTS,
        "concurrency": setup.concurrency,
        "seed": seed,
        "max_context": setup.max_context,
        "slo_ttft_s": setup.slo_ttft_s,
        "slo_tpot_s": setup.slo_tpot_s,
        "grace_s": setup.grace_s,
        "retries": setup.retries,
        "client_max_tokens": setup.client_max_tokens,
        "engine_priority": policy == "engine_priority",
        "scale": workload.scale,
    }
    if workload.trace is not None:
        return LoadConfig(url, trace=str(workload.trace), speed=workload.speed, **common)
    return LoadConfig(url, pattern=str(workload.pattern), **common)


def warmup_config(url: str, seed: int, setup: Setup, policy: str) -> LoadConfig:
    """Light steady traffic first: every guard runs a few ticks before trouble starts."""
    return LoadConfig(
        url,
        pattern="steady",
        duration_s=setup.warmup_s,
        max_requests=200,
        concurrency=8,
        seed=seed + 10_000,
        scale=0.2,
        max_context=setup.max_context,
        grace_s=1.0,
        client_max_tokens=setup.client_max_tokens,
        engine_priority=policy == "engine_priority",
    )


# ------------------------------------------------------------------ engines
@dataclass
class EngineRun:
    """One engine as a run sees it: where to send, how to read it, whether it died."""

    url: str
    read: Callable[[], Awaitable[pol.Reading]]
    crashed: asyncio.Event
    close: Callable[[], Awaitable[None]]
    kill: Callable[[], Awaitable[None]]
    # What the engine last said (a crash's reason), where it can tell.
    output: Callable[[], str] = lambda: ""


class EngineHost(Protocol):
    """Where a run's engine comes from: its pool, and an engine configured as asked."""

    name: str
    pool: PoolSpec

    async def open(
        self, *, mode: str, max_num_seqs: int, scheduling_policy: str, seed: int
    ) -> EngineRun:
        """An engine with this failure mode, batch cap and scheduling policy, ready."""
        ...


class SimHost:
    """A fresh simulated engine for every run, configured as the run asks."""

    name = "sim"
    pool = POOL

    async def open(
        self, *, mode: str, max_num_seqs: int, scheduling_policy: str, seed: int
    ) -> EngineRun:
        """Start an engine with this failure mode, batch cap and scheduling policy."""
        spec = replace(
            self.pool,
            oom_on_exhaust=mode == "oom",
            max_num_seqs=max_num_seqs,
            scheduling_policy=scheduling_policy,
        )
        server = await start_sim_server(size_pool(spec), time_model=TimeModel(), seed=seed)

        async def read() -> pol.Reading:
            sched = server.engine.scheduler
            return sched.usage, len(sched.waiting), int(server.engine.stats.preemptions_total)

        stopped = False

        async def stop() -> None:
            nonlocal stopped
            if not stopped:
                stopped = True
                await server.stop()

        return EngineRun(server.url, read, server.crashed, stop, stop)


class SimProcessHost:
    """A fresh simulated engine for every run, in its own process (``kvguard sim-engine``).

    The engine's steps are timed by its event loop. In the benchmark's own process
    that loop also runs the load generator and, for kvguard and the llm-d rule, their
    proxies: every millisecond a proxy spends on a request then stretches the
    engine's steps (measured: 42% longer than its time model through kvguard on
    ``bursty_short``, 9% without), which a real engine on a GPU never pays. In its
    own process the engine keeps its time model, whatever stands in front of it.
    """

    name = "sim-process"

    def __init__(self, pool: PoolSpec = POOL) -> None:
        self.pool = pool

    async def open(
        self, *, mode: str, max_num_seqs: int, scheduling_policy: str, seed: int
    ) -> EngineRun:
        """Start ``kvguard sim-engine`` with this failure mode, batch cap and policy."""
        pool = self.pool
        argv = [
            sys.executable,
            "-m",
            "kvguard.cli.main",
            "sim-engine",
            *("--host", "127.0.0.1", "--port", "0", "--seed", str(seed)),
            *("--kv-capacity-tokens", str(pool.kv_capacity_tokens)),
            *("--block-size", str(pool.block_size), "--max-model-len", str(pool.max_model_len)),
            *("--max-num-seqs", str(max_num_seqs)),
            *("--max-num-batched-tokens", str(pool.max_num_batched_tokens)),
            *("--scheduling-policy", scheduling_policy, "--on-crash", "exit"),
            *(("--oom-on-exhaust",) if mode == "oom" else ()),
        ]
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        url = await _announced_url(process)
        probe = EngineProbe(url, kind="vllm", timeout_s=5.0)
        crashed = asyncio.Event()
        last_lines: list[str] = []

        async def drain_and_watch() -> None:
            # Its output is read to the end (a full pipe would stall it); it exits on a
            # simulated OOM (--on-crash exit): a dead process, as SimHost's crash is.
            assert process.stdout is not None  # noqa: S101 - piped above
            while line := await process.stdout.readline():
                last_lines.append(line.decode(errors="replace").rstrip())
                del last_lines[:-5]
            if await process.wait() != 0:
                crashed.set()

        watcher = asyncio.ensure_future(drain_and_watch())

        last: pol.Reading = (0.0, 0, 0)
        stopped = False

        async def read() -> pol.Reading:
            # After a crash (the process is gone) or once stopped: the last reading, as
            # SimHost's dead engine keeps its last state.
            nonlocal last
            if stopped or crashed.is_set():
                return last
            try:
                stats = await probe.sample()
            except (ProbeError, RuntimeError):
                return last  # it died between the check and the read
            last = (
                stats.kv_cache_usage_ratio or 0.0,
                int(stats.requests_waiting or 0),
                int(stats.preemptions_total or 0),
            )
            return last

        async def stop() -> None:
            nonlocal stopped
            if stopped:
                return
            stopped = True
            await probe.close()
            if process.returncode is None:
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), 10)
                except (asyncio.TimeoutError, TimeoutError):
                    process.kill()
            await asyncio.gather(watcher, return_exceptions=True)

        return EngineRun(url, read, crashed, stop, stop, lambda: "; ".join(last_lines))


async def _announced_url(process: asyncio.subprocess.Process) -> str:
    """The URL ``kvguard sim-engine`` says it serves on, from its first lines."""
    assert process.stdout is not None  # noqa: S101 - piped by the caller
    seen = []
    while True:
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        if not line:
            raise RuntimeError(f"kvguard sim-engine exited before serving: {b''.join(seen)!r}")
        seen.append(line)
        match = re.search(rb"on (http://127\.0\.0\.1:\d+);", line)
        if match:
            return match.group(1).decode()


async def _load_through_crash(
    engine: EngineRun, config: LoadConfig
) -> tuple[LoadReport, float | None]:
    """The workload's load; a crash stops the engine's server and the load goes on.

    A crashed engine is a dead process: its port refuses connections for the rest of
    the run (kvguard's supervisor would restart it, minutes later on a real GPU), so every
    request after the crash fails and counts against the policy that let it crash.
    """
    start = time.monotonic()
    load = asyncio.ensure_future(run_load(config))
    crashed = asyncio.ensure_future(engine.crashed.wait())
    crashed_at: float | None = None
    try:
        await asyncio.wait({load, crashed}, return_when=asyncio.FIRST_COMPLETED)
        if engine.crashed.is_set():
            crashed_at = round(time.monotonic() - start, 2)
            await engine.kill()
        return await load, crashed_at
    finally:
        crashed.cancel()
        await asyncio.gather(crashed, return_exceptions=True)


REPORT_KEYS = (
    *("sent", "completed", "slo_met", "slo_attainment", "goodput_tokens", "shed", "refused"),
    *("clamped", "failed", "unfinished", "completion_tokens", "requested_max_tokens"),
    *("ttft_p99_s", "tpot_p99_s", "retries", "kv_usage_mean", "kv_usage_peak"),
    *("output_length", "client_max_tokens"),
)
CLASS_KEYS = (
    *("sent", "completed", "slo_met", "slo_attainment", "goodput_tokens", "shed", "refused"),
    *("clamped", "failed", "ttft_p99_s", "tpot_p99_s", "retries"),
)


def run_record(
    report: LoadReport,
    timeline: pol.Timeline,
    *,
    workload: Workload,
    seed: int,
    policy: str,
    mode: str,
    max_num_seqs: int,
) -> dict[str, Any]:
    """One run's figures: the client's report, the engine's preemptions and crash."""
    data = report.as_dict()
    base = next((p for t, _, _, p in timeline.engine if t >= 0), 0)
    last = timeline.engine[-1][3] if timeline.engine else base
    run: dict[str, Any] = {
        "policy": policy,
        **workload.describe(),
        "failure_mode": mode,
        "seed": seed,
        "max_num_seqs": max_num_seqs,
        "crashes": 1 if timeline.crash_at_s is not None else 0,
        "crashed_at_s": timeline.crash_at_s,
        "preemptions": int(last - base),
        **{key: data.get(key) for key in REPORT_KEYS},
        "by_priority": {
            cls: {key: counts.get(key) for key in CLASS_KEYS}
            for cls, counts in data.get("by_priority", {}).items()
        },
        "interventions": None,
        "warned_at_s": None,
        "failed_at_s": timeline.crash_at_s
        if timeline.crash_at_s is not None
        else pol.first_preemption(timeline),
        "lead_time_s": None,
    }
    return run


def _with_lead(run: dict[str, Any], warned_at: float | None) -> dict[str, Any]:
    run["warned_at_s"] = warned_at
    if warned_at is not None and run["failed_at_s"] is not None:
        run["lead_time_s"] = round(run["failed_at_s"] - warned_at, 2)
    return run


async def measure(
    workload: Workload,
    seed: int,
    policy: str,
    *,
    mode: str = "preempt",
    setup: Setup | None = None,
    max_num_seqs: int | None = None,
    host: EngineHost | None = None,
) -> tuple[list[dict[str, Any]], dict[str, pol.Timeline]]:
    """One traffic run of ``policy`` (and, for ``none``, the observers riding on it).

    ``max_num_seqs`` is the engine's batch cap: the sweep value for ``static``, the
    pool's default otherwise. ``host`` gives the engine (a fresh simulator in its own
    process by default).
    """
    setup = setup or Setup()
    host = host or SimProcessHost()
    began = time.monotonic()
    seqs = max_num_seqs if max_num_seqs is not None else host.pool.max_num_seqs
    engine = await host.open(
        mode=mode,
        max_num_seqs=seqs,
        scheduling_policy="priority" if policy == "engine_priority" else "fcfs",
        seed=seed,
    )
    clock = pol.Clock()
    timelines = {policy: pol.Timeline()}
    timeline = timelines[policy]
    stop_sampling = asyncio.Event()
    sampler = asyncio.ensure_future(pol.sample_engine(engine.read, clock, timeline, stop_sampling))
    shaping = pol.Policy(policy, engine.url, clock, timelines)
    try:
        await shaping.start()
        await run_load(warmup_config(shaping.url, seed, setup, policy))
        clock.start = time.monotonic()
        config = load_config(shaping.url, workload, seed, setup, policy)
        report, timeline.crash_at_s = await _load_through_crash(engine, config)
    finally:
        stop_sampling.set()
        await sampler
        await shaping.close()
        await engine.close()
    run = run_record(
        report, timeline, workload=workload, seed=seed, policy=policy, mode=mode, max_num_seqs=seqs
    )
    run["interventions"] = shaping.interventions()
    runs = [_with_lead(run, shaping.warned_at())]
    if policy == "none":
        usage = [(t, u) for t, u, _, _ in timeline.engine]
        alert = pol.predict_linear_alert(usage)
        runs.append(_with_lead({**run, "policy": "predict_linear"}, alert))
        dry = pol.first_high(timelines["kvguard_dry_run"].forecast)
        runs.append(_with_lead({**run, "policy": "kvguard_dry_run"}, dry))
    wall = round(time.monotonic() - began, 1)
    for r in runs:
        r["wall_s"] = wall
    return runs, timelines


# ------------------------------------------------------------------ the matrix
def commit() -> dict[str, Any]:
    """The git commit the benchmark ran on, and whether the tree had changes."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(  # noqa: S603 - a fixed git command, no shell
                ["git", *args],  # noqa: S607 - git from PATH, as a developer runs it
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
                cwd=Path(__file__).resolve().parent.parent,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
    }


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
        "platform": platform.platform(),
    }


def traffic_policies(policies: Sequence[str]) -> list[str]:
    """The policies of ``policies`` that send traffic, ``none`` added for any observer."""
    shaping = [p for p in pol.TRAFFIC_POLICIES if p in policies]
    if any(p in policies for p in pol.OBSERVERS) and "none" not in shaping:
        shaping.insert(0, "none")  # the observers ride on none's traffic
    return shaping


@dataclass(frozen=True)
class Plan:
    """What one benchmark run covers."""

    workloads: tuple[Workload, ...]
    modes: tuple[str, ...] = FAILURE_MODES
    policies: tuple[str, ...] = POLICIES
    seeds: int = SEEDS
    static_sweep: tuple[int, ...] = STATIC_SWEEP
    setup: Setup = Setup()
    # Where the simulated engine runs: "process" (its own, as a real engine is) or
    # "inprocess" (the benchmark's own event loop, the fronts' CPU stretching its steps).
    engine: str = "process"

    def host(self) -> EngineHost:
        """A host for this plan's engines."""
        return SimProcessHost() if self.engine == "process" else SimHost()

    def traffic_runs(self) -> list[tuple[str, Workload, int, str, int | None]]:
        """(mode, workload, seed, policy, max_num_seqs) of every traffic run, in order."""
        shaping = traffic_policies(self.policies)
        out: list[tuple[str, Workload, int, str, int | None]] = []
        for mode in self.modes:
            for workload in self.workloads:
                for seed in range(1, self.seeds + 1):
                    for policy in shaping:
                        values: Sequence[int | None] = (
                            self.static_sweep if policy == STATIC else (None,)
                        )
                        out.extend((mode, workload, seed, policy, n) for n in values)
        return out

    def settings(self) -> dict[str, Any]:
        """Every setting of the run, written beside its results."""
        s = self.setup
        return {
            "engine": "kvguard's simulated vLLM (`kvguard sim-engine`): each request ends at"
            " its true length (the sim-only body field `kvguard_sim_output_tokens`), or at"
            " `max_tokens` when that is shorter",
            "engine_process": "its own process (as a real engine runs)"
            if self.engine == "process"
            else ENGINE_IN_LOOP,
            "pool": {
                "kv_capacity_tokens": POOL.kv_capacity_tokens,
                "block_size": POOL.block_size,
                "max_model_len": POOL.max_model_len,
                "max_num_seqs": POOL.max_num_seqs,
                "max_num_batched_tokens": POOL.max_num_batched_tokens,
            },
            "time_model": asdict(TimeModel()),
            "workloads": [w.name for w in self.workloads],
            "workload_settings": {w.name: w.describe() for w in self.workloads},
            "failure_modes": list(self.modes),
            "policies": list(self.policies),
            "seeds": self.seeds,
            "warmup_s": s.warmup_s,
            "pattern_s": s.pattern_s,
            "grace_s": s.grace_s,
            "client": {
                "concurrency": s.concurrency,
                "max_requests": MAX_REQUESTS,
                "client_max_tokens": s.client_max_tokens,
                "max_context": s.max_context,
                "retries": s.retries,
                "priority_shares": {"critical": 0.1, "standard": 0.6, "sheddable": 0.3},
                "stream": True,
            },
            "connection_limits": {
                "client_to_front": s.concurrency,
                "proxy_to_engine": "unlimited (kvguard's and the llm-d rule's proxy alike)",
            },
            "slo": {"ttft_s": s.slo_ttft_s, "tpot_s": s.slo_tpot_s},
            "static_sweep": list(self.static_sweep),
            "engine_priority": {"body_field": "priority", "values": dict(ENGINE_PRIORITIES)},
            "llmd_rule": {
                "queue_depth": pol.LLMD_QUEUE_DEPTH,
                "kv_util": pol.LLMD_KV_UTIL,
                "comparison": "strict >",
                "staleness_s": pol.LLMD_STALENESS_S,
                "poll_s": pol.LLMD_POLL_S,
            },
            "predict_linear": {
                "scrape_s": pol.PL_SCRAPE_S,
                "window_s": pol.PL_WINDOW_S,
                "horizon_s": pol.PL_HORIZON_S,
                "threshold": pol.PL_THRESHOLD,
            },
            "kvguard": "defaults: nothing set but the engine URL and `[proxy] enabled`",
        }


def progress(run: dict[str, Any]) -> None:
    """One line per traffic run, as it ends."""
    attained = run.get("slo_attainment")
    figure = "n/a" if attained is None else f"{attained:.0%}"
    static = f" max_num_seqs {run['max_num_seqs']}" if run["policy"] == STATIC else ""
    print(  # noqa: T201 - a long run's progress
        f"{run['failure_mode']:<7} {run.get('trace') or run['pattern']:<24}"
        f" seed {run['seed']} {run['policy']:<16}{static} SLO {figure}"
        f" sent {run['sent']} shed {run['shed']} refused {run['refused']}"
        f" crashes {run['crashes']} preemptions {run['preemptions']} ({run['wall_s']:.0f} s)",
        flush=True,
    )


async def run_plan(
    plan: Plan, progress: Callable[[dict[str, Any]], None] | None = None
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Every traffic run of ``plan``, one after another; the kept timelines."""
    runs: list[dict[str, Any]] = []
    series: dict[str, dict[str, Any]] = {}
    for mode, workload, seed, policy, seqs in plan.traffic_runs():
        got, timelines = await measure(
            workload, seed, policy, mode=mode, setup=plan.setup, max_num_seqs=seqs, host=plan.host()
        )
        runs.extend(r for r in got if r["policy"] in plan.policies or r["policy"] == STATIC)
        if seed == TIMESERIES_SEED and mode == "preempt" and policy != STATIC:
            for name, timeline in timelines.items():
                series.setdefault(workload.name, {})[name] = asdict(timeline)
        if progress is not None:
            progress(got[0])
    return runs, series


def run(plan: Plan, out_dir: Path = RESULTS) -> dict[str, Any]:
    """Run ``plan`` and write ``efficacy.json`` (meta, runs, summary) and the timelines."""
    started = datetime.now(timezone.utc)
    meta: dict[str, Any] = {
        **commit(),
        "started": started.strftime("%Y-%m-%d %H:%M:%S UTC"),
        "machine": machine(),
        "loadavg_at_start": list(os.getloadavg()),
        "command": " ".join(["python -m bench efficacy", *sys.argv[2:]])
        if sys.argv[1:2] == ["efficacy"]
        else " ".join(sys.argv),
        "settings": plan.settings(),
    }
    began = time.monotonic()
    runs, series = asyncio.run(run_plan(plan, progress))
    meta["wall_s"] = round(time.monotonic() - began, 1)
    meta["loadavg_at_end"] = list(os.getloadavg())
    doc = {"meta": meta, "runs": runs, "summary": summarize(runs)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "efficacy.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out_dir / "efficacy_timeseries.json").write_text(json.dumps(series) + "\n")
    doc["plots"] = plot(series, out_dir, TIMESERIES_SEED)
    return doc


# ------------------------------------------------------------------ command line
def parser(prog: str = "python -m bench efficacy") -> argparse.ArgumentParser:
    """The benchmark's flags."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument(
        "--patterns",
        nargs="+",
        choices=WORKLOAD_PATTERNS,
        help=f"synthetic workloads (default: all of them, {CONTROL} included, unless"
        " --traces alone is given)",
    )
    p.add_argument(
        "--traces",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="trace files to replay (Azure or BurstGPT CSV; default: the vendored Azure"
        " code trace, unless --patterns alone is given)",
    )
    p.add_argument(
        "--speed",
        nargs="+",
        type=float,
        default=list(SPEEDS),
        metavar="F",
        help=f"replay speeds of each trace (default {' '.join(f'{s:g}' for s in SPEEDS)})",
    )
    p.add_argument("--modes", nargs="+", choices=FAILURE_MODES, default=list(FAILURE_MODES))
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--seeds", type=int, default=SEEDS, help=f"seeds 1..N (default {SEEDS})")
    p.add_argument(
        "--pattern-s",
        type=float,
        default=PATTERN_S,
        metavar="S",
        help=f"seconds of each pattern or trace replay (default {PATTERN_S:g})",
    )
    p.add_argument(
        "--static-sweep",
        nargs="+",
        type=int,
        default=list(STATIC_SWEEP),
        metavar="N",
        help="max_num_seqs values of the static sweep (default"
        f" {' '.join(map(str, STATIC_SWEEP))})",
    )
    p.add_argument(
        "--engine",
        choices=("process", "inprocess"),
        default="process",
        help="where the simulated engine runs: its own process (default, as a real engine"
        " does) or the benchmark's event loop (a front's CPU then slows the engine)",
    )
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    return p


def plan_from(args: argparse.Namespace) -> Plan:
    """The :class:`Plan` the flags describe; a bad value exits 2 naming the flag."""
    problems = []
    if args.seeds < 1:
        problems.append(f"--seeds {args.seeds}: must be >= 1")
    if not args.pattern_s > 0:
        problems.append(f"--pattern-s {args.pattern_s}: must be > 0")
    if any(not s > 0 for s in args.speed):
        problems.append(f"--speed {args.speed}: every speed must be > 0")
    if any(n < 1 for n in args.static_sweep):
        problems.append(f"--static-sweep {args.static_sweep}: every value must be >= 1")
    traces = args.traces
    patterns = args.patterns
    if traces is None and patterns is None:
        patterns, traces = list(WORKLOAD_PATTERNS), [AZURE_CODE]
    problems.extend(f"--traces {t}: no such file" for t in traces or [] if not t.is_file())
    if problems:
        raise SystemExit("bench efficacy: " + "; ".join(problems))
    workloads = [pattern_workload(name) for name in patterns or []]
    workloads += [Workload(trace=t, speed=s) for t in traces or [] for s in args.speed]
    return Plan(
        workloads=tuple(workloads),
        modes=tuple(args.modes),
        policies=tuple(args.policies),
        seeds=args.seeds,
        static_sweep=tuple(args.static_sweep),
        setup=Setup(pattern_s=args.pattern_s),
        engine=args.engine,
    )


def estimate_s(plan: Plan) -> float:
    """Roughly how long ``plan`` takes: each traffic run is its load plus ~1 s of set-up."""
    per_run = plan.setup.warmup_s + plan.setup.pattern_s + plan.setup.grace_s / 2 + 1.5
    return len(plan.traffic_runs()) * per_run
