"""Lead time: does the dry-run brain reach ``high`` before the engine's first preemption.

For each pattern and seed, on 127.0.0.1 only: a simulated vLLM engine with a small
pool, kvguard's daemon watching it (0.5 s ticks, 0.1 s when pressure is near), and
``kvguard loadgen`` driving it. First ``WARMUP_S`` seconds of light steady traffic
(kvguard runs before trouble starts, and learns the request sizes), then the
pattern. The engine's own preemption counter is read every 10 ms in-process (the
ground truth); the run stops at the first preemption after the pattern starts, or
after ``max_s`` seconds (a preemption before ``high`` is followed for 1.5 s more: one
poll and its scrape timeout, so a late ``high`` is timed). Lead time = first
preemption - first tick at ``high`` or worse (positive: kvguard saw it coming).

    .venv/bin/python -m bench.lead_time [--seeds 10] [--out bench/results/lead_time.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from kvguard.config.settings import parse_config
from kvguard.core.policy import LEVELS
from kvguard.core.snapshot import Snapshot
from kvguard.probes.engine import EngineProbe
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.probing import Probes
from kvguard.sim.engine import TimeModel
from kvguard.sim.loadgen import LoadConfig, run_load
from kvguard.sim.runner import PoolSpec, size_pool, start_sim_server

POOL = PoolSpec(
    kv_capacity_tokens=12_288, max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=2048
)
WARMUP_S = 6.0
PATTERNS = ("long_context", "bursty_short")
# How long a run goes on after a preemption that came before ``high``: one poll
# (0.5 s) and its scrape timeout (1.0 s).
HIGH_GRACE_S = 1.5


@dataclass
class Run:
    """One measured run."""

    pattern: str
    seed: int
    high_at_s: float | None = None
    first_preemption_at_s: float | None = None
    peak_level: str = "ok"

    @property
    def lead_s(self) -> float | None:
        """Seconds from reaching high to the first preemption (None: no preemption)."""
        if self.first_preemption_at_s is None:
            return None
        if self.high_at_s is None:
            return -float("inf")
        return self.first_preemption_at_s - self.high_at_s


async def measure(pattern: str, seed: int, *, max_s: float = 30.0) -> Run:
    """Run one pattern/seed until the first preemption (or ``max_s``) and time both events."""
    server = await start_sim_server(size_pool(POOL), time_model=TimeModel(), seed=seed)
    config = parse_config(
        {
            "engine": {"url": server.url},
            "poll": {"interval_s": 0.5, "min_interval_s": 0.1, "timeout_s": 1.0},
        },
        env={},
    )
    daemon = Daemon(
        config, probes=Probes(engine=EngineProbe(server.url, timeout_s=1.0), nvml=None, host=None)
    )
    run = Run(pattern, seed)
    start = time.monotonic()
    stop = asyncio.Event()

    def after_tick(_: Snapshot) -> None:
        decision = daemon.brain.decision
        if decision is None:
            return
        if LEVELS.index(decision.level) > LEVELS.index(run.peak_level):
            run.peak_level = decision.level
        if run.high_at_s is None and LEVELS.index(decision.level) >= LEVELS.index("high"):
            run.high_at_s = time.monotonic() - start

    async def watch_preemptions() -> None:
        for _ in range(int((max_s + 5) / 0.01)):  # bounded: the run has a deadline anyway
            if server.engine.stats.preemptions_total:
                run.first_preemption_at_s = time.monotonic() - start
                return
            await asyncio.sleep(0.01)

    loop = asyncio.ensure_future(daemon.run(stop, after_tick=after_tick))
    warmup = LoadConfig(
        server.url,
        pattern="steady",
        duration_s=WARMUP_S,
        concurrency=8,
        seed=seed,
        scale=0.2,
        max_context=4096,
        grace_s=0.5,
    )
    await run_load(warmup)
    if server.engine.stats.preemptions_total:
        raise RuntimeError("the warm-up itself preempted: lower its load")
    run.high_at_s, run.peak_level = None, "ok"
    start = time.monotonic()
    load = asyncio.ensure_future(
        run_load(
            LoadConfig(
                server.url,
                pattern=pattern,
                duration_s=max_s,
                max_requests=5000,
                concurrency=256,
                seed=seed,
                max_context=4096,
                grace_s=0.5,
            )
        )
    )
    watcher = asyncio.ensure_future(watch_preemptions())
    await asyncio.wait([watcher, load], timeout=max_s + 5, return_when=asyncio.FIRST_COMPLETED)
    # A preemption before kvguard's first ``high`` is still followed for one poll (and
    # its timeout), the load running on: a late ``high`` is then timed (a negative
    # lead) instead of lost (-inf, as if kvguard never saw it).
    for _ in range(int(HIGH_GRACE_S / 0.05)):
        if run.first_preemption_at_s is None or run.high_at_s is not None:
            break
        await asyncio.sleep(0.05)
    for task in (watcher, load):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    stop.set()
    await loop
    await daemon.close()
    await server.stop()
    return run


def summarize(runs: list[Run]) -> dict[str, object]:
    """Per pattern: runs with a preemption, how many reached high first, lead times."""
    out: dict[str, object] = {}
    for pattern in sorted({r.pattern for r in runs}):
        mine = [r for r in runs if r.pattern == pattern and r.lead_s is not None]
        leads = [r.lead_s for r in mine if r.lead_s is not None and r.lead_s != -float("inf")]
        ahead = sum(1 for r in mine if r.lead_s is not None and r.lead_s > 0)
        out[pattern] = {
            "runs_with_preemption": len(mine),
            "high_before_first_preemption": ahead,
            "share": ahead / len(mine) if mine else None,
            "lead_s_min": min(leads) if leads else None,
            "lead_s_median": statistics.median(leads) if leads else None,
            "lead_s_max": max(leads) if leads else None,
        }
    return out


async def main_async(seeds: int, max_s: float) -> dict[str, object]:
    """Every pattern x seed, one after another (they share the machine's cores)."""
    runs = [await measure(p, s, max_s=max_s) for p in PATTERNS for s in range(1, seeds + 1)]
    return {
        "pool": {"kv_capacity_tokens": POOL.kv_capacity_tokens, "max_num_seqs": POOL.max_num_seqs},
        "runs": [
            {
                "pattern": r.pattern,
                "seed": r.seed,
                "high_at_s": r.high_at_s,
                "first_preemption_at_s": r.first_preemption_at_s,
                "lead_s": r.lead_s,
                "peak_level": r.peak_level,
            }
            for r in runs
        ],
        "summary": summarize(runs),
    }


def main() -> None:
    """Run the benchmark and write its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--max-s", type=float, default=30.0)
    parser.add_argument("--out", default="bench/results/lead_time.json")
    args = parser.parse_args()
    result = asyncio.run(main_async(args.seeds, args.max_s))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))  # noqa: T201 - the benchmark's report


if __name__ == "__main__":
    main()
