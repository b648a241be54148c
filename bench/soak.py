"""Soak: kvguard's proxy and daemon under hours-like mixed traffic, squeezed into minutes.

On 127.0.0.1, in one process: a simulated vLLM with a small KV pool, kvguard in front
of it (the live daemon and its admission proxy, :func:`kvguard.inprocess.start_guard`)
and ``kvguard loadgen`` traffic through the proxy, in cycles of calm (steady, light)
and pressure (bursts at 16x the concurrency, enough to make kvguard shed and clamp).
After a warm-up (the first two cycles) it measures, at the quiet point that ends
each cycle:

* resident memory (RSS) of the process: growth from the end of the warm-up to the
  end must stay under 10 %;
* open file descriptors and asyncio tasks: no growth, the proxy's pool of idle
  keep-alive upstream connections (bounded by its limit of 100) left out;

and over the whole run:

* no lost request: every request the load generator sent ended as a success, a shed
  (429/503), or a clear error (a status or a stream error); none unfinished;
* counters agree: the load generator's successes are the engine's completed
  requests, its sheds are the proxy's (plus requests the proxy cancelled before
  their answer began), and the engine received no more than the proxy forwarded.

    .venv/bin/python -m bench.soak [--duration-s 600] [--out bench/results/soak.json]

``--duration-s 600`` is the full soak; CI runs 120 (tests/reliability/test_soak.py).
Numbers go to the JSON file and a summary to stdout; docs/reliability.md cites them.
The exit status is 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from kvguard.actuators.proxy import AdmissionProxy
from kvguard.inprocess import start_guard
from kvguard.sim.engine import TimeModel
from kvguard.sim.loadgen import LoadConfig, run_load
from kvguard.sim.loadgen_report import LoadReport
from kvguard.sim.runner import PoolSpec, size_pool, start_sim_server
from kvguard.telemetry import configure_logging

POOL = PoolSpec(
    kv_capacity_tokens=8_192, max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=2048
)
POLL = {"interval_s": 0.5, "min_interval_s": 0.1, "timeout_s": 1.0}
CYCLE_S = 20.0
CALM_S = 8.0  # steady, light: the engine has room
PRESSURE_S = CYCLE_S - CALM_S  # bursts at 16x the calm concurrency: kvguard sheds and clamps
CALM_CONCURRENCY = 8
PRESSURE_CONCURRENCY = 128
WARMUP_CYCLES = 2
RSS_GROWTH_LIMIT = 0.10
FD_SLACK = 8  # keep-alive sockets of the proxy's upstream pool and the loadgen come and go
TASK_SLACK = 4
SETTLE_S = 1.0  # after a cycle's load, before sampling: let cancelled handlers end


def pooled_connections(proxy: AdmissionProxy) -> int:
    """Idle keep-alive connections in the proxy's upstream pool (bounded by its limit)."""
    session = proxy._session  # a benchmark may look inside
    connector = session.connector if session is not None else None
    conns = getattr(connector, "_conns", {})
    return sum(len(idle) for idle in conns.values())


def sample(process: psutil.Process, proxy: AdmissionProxy) -> dict[str, float]:
    """RSS, open descriptors and live asyncio tasks, now.

    The proxy's upstream pool keeps up to 100 idle keep-alive connections, grown to
    the peak concurrency seen so far; in this one process each costs two descriptors
    (the proxy's socket and the engine's) and one task (the engine's connection
    handler). ``fds``/``tasks`` leave them out (bounded by design, not a leak);
    ``fds_raw``/``tasks_raw`` are the plain counts.
    """
    gc.collect()  # garbage that a collection would free is not a leak
    pooled = pooled_connections(proxy)
    fds, tasks = process.num_fds(), len(asyncio.all_tasks())
    return {
        "at_s": round(time.monotonic(), 3),
        "rss_bytes": process.memory_info().rss,
        "pooled_connections": pooled,
        "fds_raw": fds,
        "tasks_raw": tasks,
        "fds": fds - 2 * pooled,
        "tasks": tasks - pooled,
    }


def add_report(totals: dict[str, Any], report: LoadReport) -> None:
    """Fold one load run into the totals."""
    for key in ("sent", "succeeded", "failed", "shed", "unfinished"):
        totals[key] += getattr(report, key)
    for status, count in report.status_counts.items():
        totals["status_counts"][status] = totals["status_counts"].get(status, 0) + count
    if report.e2e_s is not None:
        totals["e2e_p99_s"] = max(totals["e2e_p99_s"], report.e2e_s.p99)


async def soak(duration_s: float, seed: int = 0) -> dict[str, Any]:
    """Run the soak for ``duration_s`` seconds; the results document (see the module doc)."""
    cycles = max(WARMUP_CYCLES + 2, round(duration_s / CYCLE_S))
    process = psutil.Process()
    server = await start_sim_server(
        size_pool(POOL), time_model=TimeModel(step_fixed_s=0.004, per_token_s=0.00002), seed=seed
    )
    daemon, runner, proxy_url = await start_guard(server.url, poll=POLL)
    stop = asyncio.Event()
    loop_task = asyncio.ensure_future(daemon.run(stop))
    proxy = daemon.proxy
    assert proxy is not None  # noqa: S101 - start_guard always builds it
    totals: dict[str, Any] = {
        "sent": 0,
        "succeeded": 0,
        "failed": 0,
        "shed": 0,
        "unfinished": 0,
        "status_counts": {},
        "e2e_p99_s": 0.0,
    }
    samples: list[dict[str, float]] = []
    began = time.monotonic()
    try:
        for cycle in range(cycles):
            for pattern, seconds, concurrency in (
                ("steady", CALM_S, CALM_CONCURRENCY),
                ("bursty_short", PRESSURE_S, PRESSURE_CONCURRENCY),
            ):
                report = await run_load(
                    LoadConfig(
                        proxy_url,
                        pattern=pattern,
                        duration_s=seconds,
                        max_requests=100_000,
                        concurrency=concurrency,
                        seed=seed * 1000 + cycle,
                        max_context=4096,
                        request_timeout_s=30.0,
                        grace_s=10.0,
                    )
                )
                add_report(totals, report)
            await asyncio.sleep(SETTLE_S)
            samples.append({"cycle": cycle, **sample(process, proxy)})
            level = daemon.brain.decision.level if daemon.brain.decision else "ok"
            sys.stdout.write(
                f"cycle {cycle + 1}/{cycles}: sent {totals['sent']} shed {totals['shed']}"
                f" rss {samples[-1]['rss_bytes'] / 2**20:.1f} MiB fds {samples[-1]['fds']}"
                f" tasks {samples[-1]['tasks']} level {level}\n"
            )
            sys.stdout.flush()
    finally:
        stop.set()
        await loop_task
        await runner.cleanup()
        await daemon.close()
        await server.stop()
    wall_s = time.monotonic() - began
    stats = server.engine.stats
    counters = proxy.counters
    proxy_doc = {
        "shed": sum(counters.shed.values()),
        "shed_by_reason": {f"{p}/{r}": n for (p, r), n in sorted(counters.shed.items())},
        "clamped": counters.clamped,
        "rejected": dict(counters.rejected),
        "cancelled": dict(counters.cancelled),
        "upstream_errors": dict(counters.upstream_errors),
    }
    engine_doc = {
        "requests_received": stats.requests_total,
        "finished": dict(stats.finished),
        "preemptions": stats.preemptions_total,
        "crashed": server.crashed.is_set(),
    }
    return {
        "duration_s": round(wall_s, 1),
        "cycles": cycles,
        "warmup_cycles": WARMUP_CYCLES,
        "load": totals,
        "proxy": proxy_doc,
        "engine": engine_doc,
        "daemon": {
            "ticks": daemon.state.ticks_total,
            "tick_overruns": daemon.state.tick_overruns_total,
            "loop_stalls": daemon.state.loop_stalls_total,
            "loop_lag_max_s": round(daemon.state.loop_lag_max_s, 4),
            "decisions": {f"{a}/{m}": n for (a, m), n in sorted(daemon.brain.counts.items()) if n},
        },
        "samples": samples,
        "checks": checks(totals, proxy_doc, engine_doc, samples),
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
    }


def checks(
    load: dict[str, Any],
    proxy: dict[str, Any],
    engine: dict[str, Any],
    samples: list[dict[str, float]],
) -> dict[str, dict[str, Any]]:
    """Every pass/fail check of the soak, each with the figures it compared."""
    after = samples[WARMUP_CYCLES - 1 :]  # from the quiet point that ends the warm-up
    base, last = after[0], after[-1]
    growth = (last["rss_bytes"] - base["rss_bytes"]) / base["rss_bytes"]
    ended = load["succeeded"] + load["failed"] + load["shed"] + load["unfinished"]
    completed = sum(n for reason, n in engine["finished"].items() if reason != "abort")
    cancelled = sum(proxy["cancelled"].values())
    shed_low, shed_high = proxy["shed"], proxy["shed"] + cancelled
    forwarded_max = load["sent"] - proxy["shed"] - sum(proxy["rejected"].values())
    return {
        "rss_growth_under_10_percent": {
            "ok": growth < RSS_GROWTH_LIMIT,
            "growth_ratio": round(growth, 4),
            "after_warmup_bytes": base["rss_bytes"],
            "end_bytes": last["rss_bytes"],
        },
        "no_fd_growth": {
            "ok": last["fds"] <= base["fds"] + FD_SLACK,
            "after_warmup": base["fds"],
            "end": last["fds"],
            "max": max(s["fds"] for s in after),
        },
        "no_task_growth": {
            "ok": last["tasks"] <= base["tasks"] + TASK_SLACK,
            "after_warmup": base["tasks"],
            "end": last["tasks"],
        },
        "no_lost_request": {
            "ok": load["unfinished"] == 0 and ended == load["sent"] and load["sent"] > 0,
            "sent": load["sent"],
            "ended": ended,
            "unfinished": load["unfinished"],
        },
        "successes_match_the_engine": {
            "ok": load["succeeded"] == completed,
            "loadgen_succeeded": load["succeeded"],
            "engine_completed": completed,
        },
        "sheds_match_the_proxy": {
            "ok": shed_low <= load["shed"] <= shed_high,
            "loadgen_shed": load["shed"],
            "proxy_shed": proxy["shed"],
            "proxy_cancelled": cancelled,
        },
        "engine_got_only_what_the_proxy_forwarded": {
            "ok": engine["requests_received"] <= forwarded_max,
            "engine_received": engine["requests_received"],
            "forwarded_at_most": forwarded_max,
        },
        "engine_never_crashed": {"ok": not engine["crashed"]},
    }


def summary(doc: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    load, checks_doc = doc["load"], doc["checks"]
    lines = [
        f"soak {doc['duration_s']:.0f} s, {doc['cycles']} cycles: sent {load['sent']},"
        f" succeeded {load['succeeded']}, shed {load['shed']}, failed {load['failed']},"
        f" unfinished {load['unfinished']}; proxy clamped {doc['proxy']['clamped']};"
        f" ticks {doc['daemon']['ticks']}, loop lag max {doc['daemon']['loop_lag_max_s']} s",
    ]
    for name, check in checks_doc.items():
        figures = ", ".join(f"{k} {v}" for k, v in check.items() if k != "ok")
        lines.append(f"  {'PASS' if check['ok'] else 'FAIL'}  {name}  {figures}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the soak and write its results."""
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--duration-s", type=float, default=600.0, help="default 600")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/soak.json")
    args = parser.parse_args(argv)
    if args.duration_s < CYCLE_S * (WARMUP_CYCLES + 2):
        parser.error(f"--duration-s must be at least {CYCLE_S * (WARMUP_CYCLES + 2):g}")
    configure_logging("error", "json")  # the daemon's decisions would drown the summary
    doc = asyncio.run(soak(args.duration_s, args.seed))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    sys.stdout.write(f"{summary(doc)}\nwrote {out}\n")
    return 0 if all(check["ok"] for check in doc["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
