"""Scrape cost: fetch and parse a real-size vLLM exposition, as one tick of kvguard does.

The exposition is ``tests/fixtures/bench/vllm-cpu-dp4.txt`` (about 190 KB): a vLLM
serving one model data-parallel over four engines, built from the two real captures
of ``tests/fixtures/engines/`` (vLLM 0.32 on CPU) — engines 0 and 2 are the busy
capture, engines 1 and 3 the idle one, relabelled; families without an ``engine``
label (process, Python, HTTP) appear once, from the busy capture. vLLM exports one
series per engine per family in exactly this way under ``--data-parallel-size``.

    .venv/bin/python -m bench.overhead_scrape --write-fixture   # rebuild the fixture

The measurement (:func:`measure_scrape`) runs kvguard's own
:class:`~kvguard.probes.engine.EngineProbe` against a stub serving the fixture from
another process, tick after tick, and separately times the pure parse.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from pathlib import Path
from typing import Any

from kvguard.probes.engine import EngineProbe
from kvguard.probes.engines import ADAPTERS, EngineScrape

ROOT = Path(__file__).resolve().parent.parent
CAPTURES = ROOT / "tests" / "fixtures" / "engines"
FIXTURE = ROOT / "tests" / "fixtures" / "bench" / "vllm-cpu-dp4.txt"
ENGINES = 4
_ENGINE0 = 'engine="0"'
_TYPE = re.compile(r"^# TYPE (\S+) ")
PARSE_RUNS = 100  # the pure parse varies little: enough for its p99
TICK_GAP_S = 0.01  # ticks are spaced in life; back to back would only measure a hot loop


def _families(text: str) -> list[tuple[str | None, list[str]]]:
    """The exposition cut into (family name, lines) blocks, each starting at its HELP."""
    blocks: list[tuple[str | None, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# HELP ") or not blocks:
            blocks.append((None, []))
        lines = blocks[-1][1]
        match = _TYPE.match(line)
        if match:
            blocks[-1] = (match.group(1), lines)
        lines.append(line)
    return blocks


def build_fixture() -> str:
    """The data-parallel exposition from the busy and idle vLLM captures."""
    busy = _families((CAPTURES / "vllm-cpu-busy.txt").read_text())
    idle = dict(_families((CAPTURES / "vllm-cpu-idle.txt").read_text()))
    out: list[str] = []
    for name, lines in busy:
        samples = [line for line in lines if not line.startswith("#")]
        if not any(_ENGINE0 in line for line in samples):
            out += lines  # one per process, not per engine
            continue
        out += [line for line in lines if line.startswith("#")]
        for engine in range(ENGINES):
            source = lines if engine % 2 == 0 else idle.get(name, lines)
            out += [
                line.replace(_ENGINE0, f'engine="{engine}"')
                for line in source
                if _ENGINE0 in line and not line.startswith("#")
            ]
        out += [line for line in samples if "engine=" not in line]
    return "\n".join(out) + "\n"


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _stats_ms(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    return {
        "p50_ms": round(_percentile(ms, 0.50), 3),
        "p99_ms": round(_percentile(ms, 0.99), 3),
        "max_ms": round(max(ms), 3),
        "mean_ms": round(sum(ms) / len(ms), 3),
    }


async def measure_scrape(url: str, ticks: int) -> dict[str, Any]:
    """``ticks`` probe samples of the engine at ``url`` (one HTTP fetch + parse each)."""
    text = FIXTURE.read_text()
    probe = EngineProbe(url, kind="vllm", timeout_s=2.0)
    tick_s: list[float] = []
    try:
        stats = await probe.sample()  # connection opened, code paths warm: not counted
        for _ in range(ticks):
            started = time.perf_counter()
            stats = await probe.sample()
            tick_s.append(time.perf_counter() - started)
            await asyncio.sleep(TICK_GAP_S)
    finally:
        await probe.close()
    adapter = ADAPTERS["vllm"]
    parse_s: list[float] = []
    for _ in range(min(ticks, PARSE_RUNS)):
        started = time.perf_counter()
        adapter.parse(EngineScrape(metrics_text=text))
        parse_s.append(time.perf_counter() - started)
    families = sum(1 for line in text.splitlines() if line.startswith("# TYPE "))
    series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    return {
        "fixture": str(FIXTURE.relative_to(ROOT)),
        "bytes": len(text.encode()),
        "families": families,
        "series": series,
        "engines": ENGINES,
        "ticks": ticks,
        "parse_runs": len(parse_s),
        "tick": _stats_ms(tick_s),  # what one tick's engine probe costs: fetch + parse
        "parse_only": _stats_ms(parse_s),
        "seen": {
            "kv_cache_usage_ratio": stats.kv_cache_usage_ratio,
            "requests_running": stats.requests_running,
            "requests_waiting": stats.requests_waiting,
        },
    }


def main() -> None:
    """Rebuild the fixture file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-fixture", action="store_true", required=True)
    parser.parse_args()
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(build_fixture())
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size:,} bytes)")  # noqa: T201


if __name__ == "__main__":
    main()
