"""Protection efficacy on a real vLLM (CPU): the same policies as bench/efficacy.py.

One vLLM server for CPU with the tiny model that ``scripts/real-engines.sh install vllm``
installs (2,048 KV tokens: 15 usable blocks of 128, ``max_model_len`` 512,
``max_num_seqs`` 8), on 127.0.0.1. The same seeded ``kvguard loadgen`` traffic goes to
it under each policy, one after another; between runs the engine is left to drain and
its prefix cache is reset, so a later run does not find an earlier run's prompts
cached. vLLM preempts (it does not crash) when its pool runs out: only the ``preempt``
failure mode applies. The server runs with ``max_num_seqs`` 16, so the KV pool, not the
batch size, is what runs out; ``static_limit`` is a second server with ``max_num_seqs``
8, the rule of bench/efficacy.py for this pool (1,920 tokens over requests of about
250).

    .venv/bin/python -m bench.efficacy_vllm [--seeds 2] [--pattern-s 12]

Writes ``bench/results/efficacy_vllm.json`` (the list of runs) and
``efficacy_vllm_summary.json``. Needs ``scripts/real-engines.sh install vllm``; without
it, says so and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.efficacy import (
    GRACE_S,
    Clock,
    LoadShape,
    Policy,
    Reading,
    Run,
    Trace,
    finish,
    machine,
    pattern_load,
    run_from,
    sample_engine,
    summarize,
    targets,
    warmup_load,
)
from kvguard.api.logs import configure_logging
from kvguard.errors import KvguardError
from kvguard.http_client import client_session
from kvguard.probes.engine import EngineProbe
from kvguard.sim.loadgen import run_load

RESULTS = Path("bench/results")
PATTERNS = ("bursty_short", "long_context")
POLICIES = ("none", "llmd_rule", "kvguard", "kvguard_projected")
STATIC_MAX_NUM_SEQS = 8  # 1,920 pool tokens / ~250 tokens a typical request holds
PATTERN_S = 12.0
SAMPLE_S = 0.25  # an HTTP scrape of the engine each time: not as often as the simulator
IDLE_WAIT_S = 90.0
# 16 sequences of ~250 tokens want twice the 1,920-token pool: the KV cache, not the
# batch size, is what runs out (with the tests' 8 the pool is never full on bursts).
MAX_NUM_SEQS = 16
VLLM_ARGS = ("--max-num-seqs", str(MAX_NUM_SEQS))
VLLM_LOAD = LoadShape(concurrency=64, max_context=512, scale=1.0, warmup_scale=0.1)


def _reader(probe: EngineProbe) -> Callable[[], Awaitable[Reading]]:
    async def read() -> Reading:
        stats = await probe.sample()
        return (
            stats.kv_cache_usage_ratio or 0.0,
            int(stats.requests_waiting or 0),
            int(stats.preemptions_total or 0),
        )

    return read


async def settle(url: str) -> None:
    """Wait until nothing runs or waits, then empty the prefix cache (dev mode)."""
    probe = EngineProbe(url, kind="vllm", timeout_s=5.0)
    try:
        deadline = time.monotonic() + IDLE_WAIT_S
        while time.monotonic() < deadline:
            try:
                stats = await probe.sample()
            except KvguardError:
                await asyncio.sleep(0.5)  # busy finishing the last run: ask again
                continue
            if not stats.requests_running and not stats.requests_waiting:
                break
            await asyncio.sleep(0.5)
    finally:
        await probe.close()
    async with client_session() as http:  # a POST on a connection vLLM is closing is lost
        for _ in range(20):  # refused while blocks are still held: retry briefly
            async with http.post(f"{url}/reset_prefix_cache") as answer:
                if answer.status == 200:
                    return
            await asyncio.sleep(0.5)


async def measure(
    url: str, pattern: str, seed: int, policy: str, *, pattern_s: float, grace_s: float
) -> list[Run]:
    """One run of ``policy`` against the running vLLM at ``url``."""
    began = time.monotonic()
    await settle(url)
    clock = Clock()
    traces = {policy: Trace()}
    trace = traces[policy]
    probe = EngineProbe(url, kind="vllm", timeout_s=5.0)  # a CPU vLLM under load is slow
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(sample_engine(_reader(probe), clock, trace, stop, SAMPLE_S))
    shaping = Policy(policy, url, clock, traces)
    try:
        await shaping.start()
        await run_load(warmup_load(shaping.url, seed, VLLM_LOAD))
        clock.start = time.monotonic()
        report = await run_load(
            pattern_load(
                shaping.url, pattern, seed, duration_s=pattern_s, grace_s=grace_s, shape=VLLM_LOAD
            )
        )
    finally:
        stop.set()
        await sampler
        await shaping.close()
        await probe.close()
    run = run_from(
        report, trace, engine="vllm-cpu", pattern=pattern, seed=seed, policy=policy, mode="preempt"
    )
    return finish(run, shaping, traces, began)


async def run_all(seeds: int, pattern_s: float, grace_s: float, scratch: Path) -> list[Run]:
    """Every pattern x seed x policy against one vLLM; then the static limit on a second."""
    from tests.real.vllm_engine import running_vllm  # noqa: PLC0415 - the tests' engine helper

    runs: list[Run] = []
    servers = (
        (POLICIES, VLLM_ARGS),
        (("static_limit",), ("--max-num-seqs", str(STATIC_MAX_NUM_SEQS))),
    )
    for policies, args in servers:
        with running_vllm(scratch / args[1], dev_mode=True, extra_args=args) as server:
            for pattern in PATTERNS:
                for seed in range(1, seeds + 1):
                    for policy in policies:
                        got = await measure(
                            server.url,
                            pattern,
                            seed,
                            "none" if policy == "static_limit" else policy,
                            pattern_s=pattern_s,
                            grace_s=grace_s,
                        )
                        if policy == "static_limit":
                            # The engine's own cap is the policy: nothing in front of it.
                            got = [replace(got[0], policy="static_limit")]
                        runs.extend(got)
                        _progress(got[0])
    return runs


def _progress(r: Run) -> None:
    print(  # noqa: T201 - a long run's progress
        f"vllm-cpu {r.pattern:<13} seed {r.seed} {r.policy:<17}"
        f" preemptions {r.preemptions:>4} goodput {r.goodput:>4}/{r.sent:<4}"
        f" shed {r.shed_fraction:.0%} critical lost {r.critical_lost} ({r.wall_s:.0f} s)",
        flush=True,
    )


def run(*, seeds: int = 3, pattern_s: float = PATTERN_S, out_dir: Path = RESULTS) -> dict[str, Any]:
    """Run it and write ``efficacy_vllm.json`` and ``efficacy_vllm_summary.json``."""
    began = time.monotonic()
    info = machine()
    with tempfile.TemporaryDirectory(prefix="kvguard-vllm-bench-") as scratch:
        runs = asyncio.run(run_all(seeds, pattern_s, GRACE_S, Path(scratch)))
    summary = summarize(runs)
    doc = {
        "machine": info,
        "settings": {
            "engine": "vLLM for CPU, tiny random-weight Llama (scripts/real-engines.sh)",
            "pool": {
                "kv_capacity_tokens": 1920,
                "max_model_len": 512,
                "max_num_seqs": MAX_NUM_SEQS,
            },
            "patterns": list(PATTERNS),
            "seeds": seeds,
            "pattern_s": pattern_s,
            "grace_s": GRACE_S,
            "load": asdict(VLLM_LOAD),
        },
        "wall_s": round(time.monotonic() - began, 1),
        "summary": summary,
        "targets": targets(summary),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "efficacy_vllm.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))
    (out_dir / "efficacy_vllm_summary.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main() -> None:
    """``python -m bench.efficacy_vllm``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--pattern-s", type=float, default=PATTERN_S)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    configure_logging("error", "json")
    from tests.real.vllm_engine import INSTALL_HINT, READY  # noqa: PLC0415

    if not READY.is_file():
        print(f"vLLM (CPU) is not installed: {INSTALL_HINT}", file=sys.stderr)  # noqa: T201
        raise SystemExit(2)
    doc = run(seeds=args.seeds, pattern_s=args.pattern_s, out_dir=args.out_dir)
    for check in doc["targets"]:
        print(  # noqa: T201 - the benchmark's report
            f"{'met ' if check['met'] else 'MISS'} {check['pattern']:<13}"
            f" {check['policy']:<17} {check['target']}: {check['detail']}"
        )


if __name__ == "__main__":
    main()
