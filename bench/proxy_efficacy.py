"""Proxy efficacy: does kvguard in the request path cut preemptions and prevent crashes.

For each pattern and seed, on 127.0.0.1 only, the SAME seeded ``kvguard loadgen``
traffic is sent in each mode, each time at a fresh simulated vLLM engine with a small pool:

* ``direct``: straight at the engine, no kvguard;
* ``kvguard``: through kvguard's admission proxy, with the daemon live (not dry-run)
  watching the engine, deciding every tick and putting its plan in force (shed,
  window caps, cancel the largest request); ``[proxy]`` at its defaults;
* ``kvguard_projected`` (with ``--projected``): the same with ``[proxy] admission =
  "projected"``, where each answer is reserved at its ``max_tokens`` (the default,
  ``observed``, reserves what answers of its kind really used).

Each run is ``WARMUP_S`` seconds of light steady traffic (kvguard runs before trouble
starts and learns the request sizes), then ``pattern_s`` seconds of the pattern at
concurrency 256. The engine's own preemption counter, read in-process, is the ground
truth. Then the crash mode: the same runs with ``oom_on_exhaust`` (the engine crashes
instead of preempting when its pool runs out); a run ends at the crash.

All of it runs in one event loop, so the proxy's CPU time is also time the simulated
engine does not step: on a small machine kvguard's overhead is part of what is measured.

    .venv/bin/python -m bench.proxy_efficacy [--seeds 5] [--pattern-s 16]
        [--crash-pattern-s 15] [--projected] [--out bench/results/proxy_efficacy.json]

At 5 seeds the default (two modes) takes about 10 minutes; ``--projected`` half again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.efficacy import EngineRun, SimProcessHost
from kvguard.api.logs import configure_logging
from kvguard.core.policy import LEVELS
from kvguard.runtime.assembly import Guard
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.inprocess import start_guard
from kvguard.sim.loadgen import LoadConfig, run_load
from kvguard.sim.loadgen_report import LoadReport
from kvguard.sim.runner import PoolSpec

POOL = PoolSpec(
    kv_capacity_tokens=12_288, max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=2048
)
WARMUP_S = 3.0
PATTERN_S = 16.0
CRASH_PATTERN_S = 15.0  # a direct run crashes within 9 s; a guarded one must outlast that
STOP_WAIT_S = 3.0
GRACE_S = 1.0
CONCURRENCY = 256
MAX_REQUESTS = 5000
PATTERNS = ("bursty_short", "long_context")
# direct: no kvguard. kvguard: the default [proxy] (admission = "observed": each
# request admitted against the engine's pool as it arrives, its answer reserved at what
# answers of its kind used). kvguard_projected: [proxy] admission = "projected", each
# answer reserved at its max_tokens.
MODES = ("direct", "kvguard", "kvguard_projected")
DEFAULT_MODES = ("direct", "kvguard")  # what fits the ~10 min budget at 5 seeds
TIMELINE_KEPT = 60  # decision events kept per run: enough to read what fired and when
TICKS_KEPT = 8
POLL = {"interval_s": 0.5, "min_interval_s": 0.1, "timeout_s": 1.0}


@dataclass
class Run:
    """One measured run: the traffic's outcome, the engine's, and what kvguard did."""

    pattern: str
    seed: int
    mode: str  # one of MODES
    oom: bool
    preemptions: int = 0
    crashed_at_s: float | None = None  # seconds after the pattern started
    crash_message: str | None = None
    load: dict[str, Any] = field(default_factory=dict)
    peak_level: str = "ok"
    first_high_at_s: float | None = None
    decisions: dict[str, int] = field(default_factory=dict)
    proxy: dict[str, Any] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    # The last ticks kvguard saw (up to TICKS_KEPT): before a crash, what it knew in time.
    last_ticks: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def guarded(self) -> bool:
        """Whether the traffic went through kvguard."""
        return self.mode != "direct"


def load_summary(report: LoadReport) -> dict[str, Any]:
    """The parts of a loadgen report this benchmark compares."""
    ttft = report.ttft_s
    return {
        "sent": report.sent,
        "succeeded": report.succeeded,
        "shed": report.shed,
        "refused": report.refused,
        "failed": report.failed,
        "unfinished": report.unfinished,
        "goodput": report.goodput,
        "goodput_ratio": report.goodput_ratio,
        "ttft_p50_s": ttft.p50 if ttft else None,
        "ttft_p99_s": ttft.p99 if ttft else None,
        "kv_usage_peak": report.kv_usage_peak,
        "waiting_peak": report.waiting_peak,
        "status_counts": dict(report.status_counts),
        "by_priority": report.as_dict()["by_priority"],
    }


async def measure(
    pattern: str,
    seed: int,
    *,
    mode: str,
    oom: bool = False,
    pattern_s: float = PATTERN_S,
    warmup_s: float = WARMUP_S,
    policy: dict[str, Any] | None = None,
) -> Run:
    """One run of ``pattern``/``seed`` at a fresh engine, directly or through kvguard.

    ``mode`` is one of :data:`MODES`.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    began = time.monotonic()
    # The engine in its own process, as a real one runs: in this event loop kvguard's
    # proxy would take its CPU out of the engine's steps (bench/efficacy.py, SimProcessHost).
    server = await SimProcessHost(POOL).open(
        mode="oom" if oom else "preempt",
        max_num_seqs=POOL.max_num_seqs,
        scheduling_policy="fcfs",
        seed=seed,
    )
    guard = None
    if mode != "direct":
        # kvguard: [proxy] at its defaults (admission "observed"); kvguard_projected:
        # every answer reserved at its max_tokens.
        proxy = {"admission": "projected"} if mode == "kvguard_projected" else {}
        guard = await start_guard(server.url, poll=POLL, proxy=proxy, policy=policy)
    run = Run(pattern, seed, mode, oom)
    pattern_start: float | None = None
    try:
        if guard is not None:
            guard.run_in_background(lambda _: _observe(guard.daemon, run, pattern_start))
        url = (guard.proxy_url or server.url) if guard is not None else server.url
        warmup = LoadConfig(
            url,
            pattern="steady",
            duration_s=warmup_s,
            concurrency=8,
            seed=seed,
            scale=0.2,
            max_context=4096,
            grace_s=0.5,
        )
        await run_load(warmup)
        _, _, before = await server.read()
        if before or server.crashed.is_set():
            raise RuntimeError("the warm-up itself preempted or crashed: lower its load")
        pattern_start = time.monotonic()
        run.peak_level = "ok"  # the warm-up's levels do not count
        report = await _load_until_crash(server, run, url, pattern_s=pattern_s, start=pattern_start)
        if not server.crashed.is_set():
            run.preemptions = (await server.read())[2] - before
        run.load = load_summary(report) if report is not None else {"cut_off_after_crash": True}
    finally:
        if guard is not None:
            _record_guard(guard, run)
            await guard.close()
        await server.close()
    run.wall_s = time.monotonic() - began
    return run


async def _load_until_crash(
    server: EngineRun, run: Run, url: str, *, pattern_s: float, start: float
) -> LoadReport | None:
    """The pattern's load; a crash of the engine ends it (the rest would only fail).

    None when the load did not stop within ``STOP_WAIT_S`` of the crash and was cut off:
    on Python 3.11 ``asyncio.wait_for`` swallows a cancellation that arrives as its
    awaitable completes, and a crash frees every loadgen slot at once, so the loadgen's
    dispatcher (waiting for a slot) can miss ``stop`` and run on against a dead engine.
    """
    stop = asyncio.Event()
    load = asyncio.ensure_future(
        run_load(
            LoadConfig(
                url,
                pattern=run.pattern,
                duration_s=pattern_s,
                max_requests=MAX_REQUESTS,
                concurrency=CONCURRENCY,
                seed=run.seed,
                max_context=4096,
                grace_s=GRACE_S,
            ),
            stop=stop,
        )
    )
    crashed = asyncio.ensure_future(server.crashed.wait())
    try:
        await asyncio.wait({load, crashed}, return_when=asyncio.FIRST_COMPLETED)
        if server.crashed.is_set():
            run.crashed_at_s = time.monotonic() - start
            run.crash_message = server.output()
            stop.set()
            await asyncio.wait({load}, timeout=STOP_WAIT_S)
            if not load.done():
                return None
        return load.result()
    finally:
        for task in (load, crashed):
            task.cancel()
        await asyncio.gather(load, crashed, return_exceptions=True)


def _observe(daemon: Daemon, run: Run, pattern_start: float | None) -> None:
    """After each tick: the peak level, and every level change or plan, timed."""
    decision = daemon.brain.decision
    if decision is None or pattern_start is None:
        return  # the warm-up is not part of the measurement
    t = round(time.monotonic() - pattern_start, 2)
    signals = decision.signals
    tte = signals.time_to_exhaustion_s
    run.last_ticks.append(
        {
            "t_s": t,
            "level": decision.level,
            "pattern": decision.pattern,
            "kv_usage": _round(signals.kv_usage),
            "kv_demand": _round(signals.kv_demand),
            "tte_s": None if tte is None or tte == float("inf") else round(tte, 1),
        }
    )
    del run.last_ticks[:-TICKS_KEPT]
    rank = LEVELS.index(decision.level)
    if rank > LEVELS.index(run.peak_level):
        run.peak_level = decision.level
    if run.first_high_at_s is None and rank >= LEVELS.index("high"):
        run.first_high_at_s = t
    changed = decision.level != decision.previous_level
    if (decision.plan or changed) and len(run.timeline) < TIMELINE_KEPT:
        run.timeline.append(
            {
                "t_s": t,
                "level": decision.level,
                "pattern": decision.pattern,
                "actions": [
                    {k: v for k, v in asdict(a).items() if v is not None and k != "reason"}
                    for a in decision.plan
                ],
                "crossed": list(decision.crossed)[:3],
                "kv_usage": _round(signals.kv_usage),
                "kv_demand": _round(signals.kv_demand),
            }
        )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _record_guard(guard: Guard, run: Run) -> None:
    run.decisions = {f"{kind}/{mode}": n for (kind, mode), n in guard.daemon.brain.counts.items()}
    proxy = guard.daemon.proxy
    if proxy is None:
        return
    counters = proxy.counters
    run.proxy = {
        # priority/reason: kv_cache_pressure (the daemon's shed floor) or kv_pool_full
        # (projected admission waited admission_wait_s for room in vain)
        "shed": {f"{priority}/{reason}": n for (priority, reason), n in counters.shed.items()},
        "clamped": counters.clamped,
        "rejected": dict(counters.rejected),
        "cancelled": dict(counters.cancelled),  # asdict() would mangle a Counter
        "upstream_errors": dict(counters.upstream_errors),
    }


# ------------------------------------------------------------------ summary
def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[Run]) -> dict[str, Any]:
    """Per pattern: preemptions, goodput and shed share without vs with kvguard; crashes."""
    out: dict[str, Any] = {}
    for pattern in PATTERNS:
        mine = [r for r in runs if r.pattern == pattern]
        if not mine:
            continue
        row: dict[str, Any] = {}
        for mode in MODES:
            if not any(r.mode == mode for r in mine):
                continue
            normal = [r for r in mine if r.mode == mode and not r.oom]
            crash = [r for r in mine if r.mode == mode and r.oom]
            sent = sum(r.load["sent"] for r in normal)
            row[mode] = {
                "preemptions": [r.preemptions for r in normal],
                "preemptions_median": _median([r.preemptions for r in normal]),
                "sent_median": _median([r.load["sent"] for r in normal]),
                "goodput_median": _median([r.load["goodput"] for r in normal]),
                "goodput_ratio_median": _median(
                    [r.load["goodput_ratio"] for r in normal if r.load["goodput_ratio"] is not None]
                ),
                "shed_share": sum(r.load["shed"] for r in normal) / sent if sent else None,
                "ttft_p99_s_median": _median(
                    [r.load["ttft_p99_s"] for r in normal if r.load["ttft_p99_s"] is not None]
                ),
                "peak_levels": [r.peak_level for r in normal],
                "oom_crashes": sum(1 for r in crash if r.crashed_at_s is not None),
                "oom_runs": len(crash),
                "oom_crash_at_s": [r.crashed_at_s for r in crash],
            }
        out[pattern] = row
    return out


def render(summary: dict[str, Any]) -> str:
    """The summary as a short table."""
    lines = [
        f"{'pattern':<13} {'mode':<17} {'preempt med':>11} {'sent':>6} {'goodput':>12} {'shed':>6}"
        f" {'ttft p99':>9} {'oom crashes':>11}  preemptions per seed"
    ]
    for pattern, row in summary.items():
        for mode, m in row.items():
            goodput = m["goodput_ratio_median"]
            shed = m["shed_share"]
            ttft = m["ttft_p99_s_median"]
            lines.append(
                f"{pattern:<13} {mode:<17} {m['preemptions_median']!s:>11}"
                f" {m['sent_median']!s:>6} {m['goodput_median']!s:>5}"
                f" {'n/a' if goodput is None else f'({goodput:.0%})':>6}"
                f" {'n/a' if shed is None else f'{shed:.0%}':>6}"
                f" {'n/a' if ttft is None else f'{ttft:.2f}s':>9}"
                f" {m['oom_crashes']:>5}/{m['oom_runs']:<5}  {m['preemptions']}"
            )
    return "\n".join(lines)


async def main_async(
    seeds: int, pattern_s: float, crash_pattern_s: float, modes: tuple[str, ...] = DEFAULT_MODES
) -> dict[str, Any]:
    """Every pattern x seed x mode, normal then crash mode, one after another."""
    runs: list[Run] = []
    for oom in (False, True):
        for pattern in PATTERNS:
            for seed in range(1, seeds + 1):
                for mode in modes:
                    run = await measure(
                        pattern,
                        seed,
                        mode=mode,
                        oom=oom,
                        pattern_s=crash_pattern_s if oom else pattern_s,
                    )
                    runs.append(run)
                    crash = "" if run.crashed_at_s is None else f" CRASH at {run.crashed_at_s:.2f}s"
                    print(  # noqa: T201 - progress of a long benchmark
                        f"{pattern} seed {seed} {run.mode:<17} oom={oom!s:<5}"
                        f" preemptions {run.preemptions:>4} peak {run.peak_level:<8}"
                        f" sent {run.load.get('sent')} shed {run.load.get('shed')}"
                        f" ({run.wall_s:.0f} s){crash}",
                        flush=True,
                    )
    return {
        "pool": {
            "kv_capacity_tokens": POOL.kv_capacity_tokens,
            "max_model_len": POOL.max_model_len,
            "max_num_seqs": POOL.max_num_seqs,
            "max_num_batched_tokens": POOL.max_num_batched_tokens,
        },
        "load": {
            "warmup_s": WARMUP_S,
            "pattern_s": pattern_s,
            "crash_mode_pattern_s": crash_pattern_s,
            "concurrency": CONCURRENCY,
            "grace_s": GRACE_S,
            "max_context": 4096,
        },
        "poll": POLL,
        "modes": list(modes),
        "summary": summarize(runs),
        "runs": [asdict(r) for r in runs],
    }


def main() -> None:
    """Run the benchmark, write its JSON and print the summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--pattern-s", type=float, default=PATTERN_S)
    parser.add_argument("--crash-pattern-s", type=float, default=CRASH_PATTERN_S)
    parser.add_argument(
        "--projected",
        action="store_true",
        help="also run every pair through kvguard with [proxy] admission = projected",
    )
    parser.add_argument("--out", default="bench/results/proxy_efficacy.json")
    args = parser.parse_args()
    modes = MODES if args.projected else DEFAULT_MODES
    # kvguard logs every shed request and decision: thousands of lines that would bury
    # the report. The JSON keeps the decision trail (``timeline``) instead.
    configure_logging("error", "json")
    result = asyncio.run(main_async(args.seeds, args.pattern_s, args.crash_pattern_s, modes))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(render(result["summary"]))  # noqa: T201 - the benchmark's report


if __name__ == "__main__":
    main()
