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
another process, tick after tick, and separately times the pure parse. The stub
answers the fixture and its twin in turn (:func:`live_pages`: the same page with the
busy and idle engines swapped), so every family kvguard reads changes from one scrape
to the next, as on a busy engine, and the probe's cache of unchanged families
(:class:`~kvguard.probes.engines.wanted.FamilyCache`) saves only what it saves in life:
the families that do not change (``cache_config_info``). Each tick's cost is given
as wall time and as kvguard's own CPU time (the stub's work is not in it).
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
from kvguard.probes.engines.wanted import FamilyCache

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


def build_fixture(*, busy_even: bool = True) -> str:
    """The data-parallel exposition from the busy and idle vLLM captures.

    Engines 0 and 2 are the busy capture, 1 and 3 the idle one; ``busy_even=False``
    swaps them: the same page, line for line, with every engine's figures changed.
    """
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
            busy_here = (engine % 2 == 0) == busy_even
            source = lines if busy_here else idle.get(name, lines)
            out += [
                line.replace(_ENGINE0, f'engine="{engine}"')
                for line in source
                if _ENGINE0 in line and not line.startswith("#")
            ]
        out += [line for line in samples if "engine=" not in line]
    return "\n".join(out) + "\n"


def live_pages(tmp: Path) -> tuple[Path, Path]:
    """The fixture and its twin (busy and idle engines swapped), the twin written in ``tmp``."""
    twin = tmp / "vllm-cpu-dp4-swapped.txt"
    twin.write_text(build_fixture(busy_even=False))
    return FIXTURE, twin


# The pool of the proxy benchmark's engine: the idle capture is a CPU vLLM with a
# 2,048-token pool, which 32 tiny requests in flight fill past half (where admission
# counts every prompt with /tokenize). A GPU's pool is hundreds of times larger: an
# 8B model on one 80 GB GPU holds a few hundred thousand tokens (docs/budget.md).
GPU_POOL_BLOCKS = 2048  # x the capture's 128-token blocks = 262,144 tokens
_POOL_LABELS = re.compile(
    r'(num_gpu_blocks|kv_cache_size_tokens|kv_cache_max_concurrency)="([0-9.]+)"'
)


def with_pool(text: str, blocks: int) -> str:
    """``text`` (a vLLM page) with each engine's pool ``blocks`` blocks instead of its own.

    The labels of ``cache_config_info`` that size the pool (``num_gpu_blocks``,
    ``kv_cache_size_tokens``, ``kv_cache_max_concurrency``) are scaled alike; nothing
    else changes.
    """

    def scaled(line: str) -> str:
        found = re.search(r'num_gpu_blocks="([0-9]+)"', line)
        if found is None:
            return line
        factor = blocks / int(found.group(1))

        def one(match: re.Match[str]) -> str:
            name, value = match.group(1), float(match.group(2))
            new = value * factor
            return f'{name}="{new:.1f}"' if "." in match.group(2) else f'{name}="{round(new)}"'

        return _POOL_LABELS.sub(one, line)

    return "\n".join(
        scaled(line) if line.startswith("vllm:cache_config_info{") else line
        for line in text.split("\n")
    )


def gpu_pool_page(tmp: Path) -> Path:
    """The idle vLLM capture with a GPU-size pool (:data:`GPU_POOL_BLOCKS`), written in ``tmp``."""
    page = tmp / "vllm-cpu-idle-gpu-pool.txt"
    page.write_text(with_pool((CAPTURES / "vllm-cpu-idle.txt").read_text(), GPU_POOL_BLOCKS))
    return page


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


async def measure_scrape(
    url: str, ticks: int, pages: tuple[Path, ...] = (FIXTURE,)
) -> dict[str, Any]:
    """``ticks`` probe samples of the engine at ``url`` (one HTTP fetch + parse each).

    ``pages`` are what the stub at ``url`` answers in turn; the pure parse is timed
    on them in the same turn, with a cache as the probe's, and without one (cold).
    """
    texts = [page.read_text() for page in pages]
    probe = EngineProbe(url, kind="vllm", timeout_s=2.0)
    tick_s: list[float] = []
    tick_cpu_s: list[float] = []
    try:
        stats = await probe.sample()  # connection opened, code paths warm: not counted
        for _ in range(ticks):
            started, cpu = time.perf_counter(), time.process_time()
            stats = await probe.sample()
            tick_s.append(time.perf_counter() - started)
            tick_cpu_s.append(time.process_time() - cpu)
            await asyncio.sleep(TICK_GAP_S)
    finally:
        await probe.close()
    adapter = ADAPTERS["vllm"]
    runs = min(ticks, PARSE_RUNS)
    cache = FamilyCache()
    parse_s, cold_s = [], []
    for index in range(runs):
        text = texts[index % len(texts)]
        started = time.perf_counter()
        adapter.parse(EngineScrape(metrics_text=text, families=cache))
        parse_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        adapter.parse(EngineScrape(metrics_text=text))
        cold_s.append(time.perf_counter() - started)
    text = texts[0]
    families = sum(1 for line in text.splitlines() if line.startswith("# TYPE "))
    series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    return {
        "fixture": str(FIXTURE.relative_to(ROOT)),
        "pages": len(texts),  # answered in turn: the figures read change every scrape
        "bytes": len(text.encode()),
        "families": families,
        "series": series,
        "engines": ENGINES,
        "ticks": ticks,
        "parse_runs": len(parse_s),
        "tick": _stats_ms(tick_s),  # what one tick's engine probe takes: fetch + parse
        "tick_cpu": _stats_ms(tick_cpu_s),  # kvguard's own CPU for it (not the stub's)
        "parse_only": _stats_ms(parse_s),  # with the probe's cache of unchanged families
        "parse_cold": _stats_ms(cold_s),  # without it: every family read is parsed
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
