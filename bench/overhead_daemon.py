"""Daemon cost: CPU and memory of a real ``kvguard run`` watching an idle simulated engine.

Four ``kvguard run --config F`` processes watch one ``kvguard sim-engine`` process
at once: polling at 2 Hz and at 20 Hz (``[poll] interval_s`` 0.5 and 0.05), each
with the admission proxy off and on (listening, no traffic). After a warm-up, the
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
    start_sim_engine,
    wait_kvguard,
)

CONFIGS = (  # (name, poll interval, proxy enabled)
    ("2hz", 0.5, False),
    ("2hz_proxy", 0.5, True),
    ("20hz", 0.05, False),
    ("20hz_proxy", 0.05, True),
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
        engine = start_sim_engine(tmp)
        procs.append(engine)
        runs: dict[str, KvguardRun] = {}
        for name, interval, proxy in CONFIGS:  # started together: start-up is mostly imports
            runs[name] = spawn_kvguard(
                tmp, f"kvguard-{name}", engine.url, interval_s=interval, proxy=proxy
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
            "engine": "kvguard sim-engine (vllm flavor, idle), its own process",
            "nvml": "unavailable (no GPU on this machine)",
            "configs": out,
            "sim_engine": engine_meter.stop(),
        }
    finally:
        for proc in reversed(procs):
            proc.stop()
