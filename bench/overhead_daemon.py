"""Daemon cost: CPU and memory of a real ``kvguard run`` watching a real-size engine page.

Four ``kvguard run --config F`` processes watch one stub engine at once: its
``/metrics`` is a 154 KB vLLM page (data-parallel over four engines, built from real
captures: bench/overhead_scrape.py) whose figures change at every scrape (the page and
its twin in turn, busy and idle engines swapped), so the daemon parses what a busy
vLLM's would make it parse. They poll at 2 Hz (``[poll] interval_s`` 0.5, the default)
and at 10 Hz (0.1 s, the default ``min_interval_s``: how fast the daemon polls under
pressure), each with the admission proxy off and on (listening, no traffic). The page
shows two engines with a full pool, at which the daemon would poll at its fastest: each
process is held at its rate (``min_interval_s`` = ``interval_s``) so that each rate is
measured. After a warm-up, the
CPU seconds each used (user + system, psutil) are divided by the wall seconds of the
window, and its resident memory is sampled every ``SAMPLE_S``. They run side by side
to keep the benchmark short: CPU *seconds* are what each process consumed, which
sharing the cores does not inflate. There is no GPU here, so the NVML probe reports
itself unavailable once and costs nothing after; with a driver it adds one NVML
query per GPU per tick.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench.overhead_procs import (
    KvguardRun,
    Meter,
    Proc,
    http_get,
    spawn_kvguard,
    start_stub,
    wait_kvguard,
)
from bench.overhead_scrape import live_pages

CONFIGS = (  # (name, poll interval, proxy enabled)
    ("2hz", 0.5, False),
    ("2hz_proxy", 0.5, True),
    ("10hz", 0.1, False),
    ("10hz_proxy", 0.1, True),
)
SAMPLE_S = 0.5


def _ticks(run: KvguardRun) -> int | None:
    """The daemon's tick count from its /status."""
    status, body = http_get(f"{run.api}/status")
    if status != 200:
        return None
    count = json.loads(body).get("tick", {}).get("count")
    return count if isinstance(count, int) else None


def measure_daemon(tmp: Path, *, seconds: float, warmup_s: float) -> dict[str, Any]:
    """Each configuration's CPU share and RSS over ``seconds``, after ``warmup_s``."""
    procs: list[Proc] = []
    try:
        engine = start_stub(tmp, "engine-stub", metrics=live_pages(tmp))
        procs.append(engine)
        runs: dict[str, KvguardRun] = {}
        for name, interval, proxy in CONFIGS:  # started together: start-up is mostly imports
            runs[name] = spawn_kvguard(
                tmp,
                f"kvguard-{name}",
                engine.url,
                interval_s=interval,
                proxy=proxy,
                fixed_rate=True,
            )
            procs.append(runs[name].proc)
        for run in runs.values():
            wait_kvguard(run)
        time.sleep(warmup_s)
        meters = {name: Meter(run.proc) for name, run in runs.items()}
        engine_meter = Meter(engine)
        ticks_before = {name: _ticks(run) for name, run in runs.items()}
        for meter in [*meters.values(), engine_meter]:
            meter.start()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(min(SAMPLE_S, max(0.0, deadline - time.monotonic())))
            for meter in meters.values():
                meter.sample()
        out: dict[str, Any] = {}
        for name, interval, proxy in CONFIGS:
            figures = meters[name].stop()
            before, after = ticks_before[name], _ticks(runs[name])
            ticks = after - before if before is not None and after is not None else None
            out[name] = {
                "poll_interval_s": interval,
                "poll_hz": round(1 / interval, 2),
                "proxy": proxy,
                **figures,
                "cpu_percent_of_one_core": round(figures["cpu_s_per_wall_s"] * 100, 3),
                "ticks": ticks,
                "ticks_per_s": round(ticks / figures["wall_s"], 2) if ticks else None,
                "cpu_ms_per_tick": round(figures["cpu_s"] * 1000 / ticks, 3) if ticks else None,
            }
        return {
            "seconds": seconds,
            "warmup_s": warmup_s,
            "concurrent": True,
            "engine": "stub serving a 154 KB vLLM page (4 engines) and its twin in turn,"
            " its own process",
            "nvml": "unavailable (no GPU on this machine)",
            "configs": out,
            "engine_stub": engine_meter.stop(),
        }
    finally:
        for proc in reversed(procs):
            proc.stop()
