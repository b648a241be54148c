"""Protection efficacy on a real vLLM (CPU): the same client, policies and report as on the sim.

One vLLM server for CPU with the tiny model that ``scripts/real-engines.sh install vllm``
installs (2,048 KV tokens: 15 usable blocks of 128, ``max_model_len`` 512), on
127.0.0.1, started once per engine configuration the runs need (``max_num_seqs`` of the
static sweep, priority scheduling for ``engine_priority``). Between runs the engine is
left to drain and its prefix cache is reset, so a later run does not find an earlier
run's prompts cached. vLLM preempts (it does not crash) when its pool runs out: only the
``preempt`` failure mode applies. vLLM cannot be told a request's true length, so the
client sends ``max_tokens`` = the true length with ``ignore_eos`` (it does not over-ask
here; the report says so in ``output_length``).

    .venv/bin/python -m bench.efficacy_vllm [--seeds 2] [--pattern-s 20] [--out-dir DIR]

Writes ``DIR/efficacy_vllm.json`` (``meta``, ``runs``, ``summary``, as
``efficacy.json``). Needs ``scripts/real-engines.sh install vllm``; without it, says so
and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench import efficacy
from bench import efficacy_policies as pol
from bench.efficacy_stats import STATIC, summarize
from kvguard.api.logs import configure_logging
from kvguard.errors import KvguardError
from kvguard.http_client import client_session
from kvguard.probes.engine import EngineProbe
from kvguard.sim.runner import PoolSpec

RESULTS = Path("bench/results")
WORKLOADS = (
    efficacy.Workload(pattern="bursty_short"),
    efficacy.Workload(pattern="long_context"),
    # The trace's prompts (about 2,000 tokens) are scaled to this engine's 512-token context.
    efficacy.Workload(trace=efficacy.AZURE_CODE, speed=1.0, scale=0.2),
)
POLICIES = ("none", "static", "engine_priority", "llmd_rule", "kvguard", *pol.OBSERVERS)
STATIC_SWEEP = (4, 8)
PATTERN_S = 20.0
SAMPLE_S = 0.25  # an HTTP scrape of the engine each time: not as often as the simulator
IDLE_WAIT_S = 90.0
# 16 sequences of ~250 tokens want twice the 1,920-token pool: the KV cache, not the
# batch size, is what runs out.
MAX_NUM_SEQS = 16
# Prompts are plain words, about 3% more tokens than words to this model's tokenizer:
# planning within 480 keeps prompt + max_tokens inside its 512-token context.
SETUP = efficacy.Setup(
    pattern_s=PATTERN_S, warmup_s=3.0, grace_s=20.0, concurrency=64, max_context=480
)


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


class VllmHost:
    """Real vLLM servers, one per engine configuration, reused across runs."""

    name = "vllm-cpu"
    pool = PoolSpec(kv_capacity_tokens=1920, max_model_len=512, max_num_seqs=MAX_NUM_SEQS)

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self._stack = contextlib.ExitStack()
        self._key: tuple[int, str] | None = None
        self._url = ""

    def _serve(self, max_num_seqs: int, scheduling_policy: str) -> str:
        from tests.real.vllm_engine import running_vllm  # noqa: PLC0415 - the tests' helper

        key = (max_num_seqs, scheduling_policy)
        if key != self._key:
            self._stack.close()  # one server at a time: two CPU vLLMs on 2 cores distort both
            self._stack = contextlib.ExitStack()
            args = ("--max-num-seqs", str(max_num_seqs), "--scheduling-policy", scheduling_policy)
            scratch = self.scratch / f"{max_num_seqs}-{scheduling_policy}"
            server = self._stack.enter_context(
                running_vllm(scratch, dev_mode=True, extra_args=args)
            )
            self._key, self._url = key, server.url
        return self._url

    async def open(
        self, *, mode: str, max_num_seqs: int, scheduling_policy: str, seed: int
    ) -> efficacy.EngineRun:
        """The running server for this configuration, settled; ``mode`` must be preempt."""
        del seed  # vLLM's own randomness is not seeded per run
        if mode != "preempt":
            raise ValueError("vLLM preempts when its pool runs out: only the preempt mode applies")
        url = await asyncio.to_thread(self._serve, max_num_seqs, scheduling_policy)
        await settle(url)
        probe = EngineProbe(url, kind="vllm", timeout_s=5.0)  # a CPU vLLM under load is slow

        async def read() -> pol.Reading:
            stats = await probe.sample()
            return (
                stats.kv_cache_usage_ratio or 0.0,
                int(stats.requests_waiting or 0),
                int(stats.preemptions_total or 0),
            )

        async def nothing() -> None:
            return None

        return efficacy.EngineRun(url, read, asyncio.Event(), probe.close, nothing)

    def close(self) -> None:
        """Stop the server that is running."""
        self._stack.close()


def traffic_runs(
    seeds: int, policies: tuple[str, ...]
) -> list[tuple[str, efficacy.Workload, int, str, int | None]]:
    """The runs grouped by engine configuration, so each server starts once."""
    shaping = [p for p in efficacy.traffic_policies(policies) if p != STATIC]
    groups: list[list[tuple[str, int | None]]] = [
        [(p, None) for p in shaping if p != "engine_priority"],
        [("engine_priority", None)] if "engine_priority" in shaping else [],
    ]
    if STATIC in policies:
        groups += [[(STATIC, n)] for n in STATIC_SWEEP]
    return [
        ("preempt", workload, seed, policy, n)
        for group in groups
        for workload in WORKLOADS
        for seed in range(1, seeds + 1)
        for policy, n in group
    ]


async def run_all(
    seeds: int, policies: tuple[str, ...], setup: efficacy.Setup, scratch: Path
) -> list[dict[str, Any]]:
    """Every run against real vLLM servers, one configuration at a time."""
    host = VllmHost(scratch)
    runs: list[dict[str, Any]] = []
    try:
        for mode, workload, seed, policy, seqs in traffic_runs(seeds, policies):
            got, _ = await efficacy.measure(
                workload, seed, policy, mode=mode, setup=setup, max_num_seqs=seqs, host=host
            )
            runs.extend(r for r in got if r["policy"] in policies)
            efficacy.progress(got[0])
    finally:
        host.close()
    return runs


def run(
    *,
    seeds: int = 2,
    pattern_s: float = PATTERN_S,
    policies: tuple[str, ...] = POLICIES,
    out_dir: Path = RESULTS,
) -> dict[str, Any]:
    """Run it and write ``efficacy_vllm.json``."""
    setup = replace(SETUP, pattern_s=pattern_s)
    plan = efficacy.Plan(
        workloads=WORKLOADS,
        modes=("preempt",),
        policies=policies,
        seeds=seeds,
        static_sweep=STATIC_SWEEP,
        setup=setup,
    )
    settings = plan.settings()
    settings["engine"] = (
        "vLLM for CPU, tiny random-weight Llama (scripts/real-engines.sh install vllm),"
        " `--kv-cache-memory-bytes` 2 MiB"
    )
    settings["pool"] = {
        "kv_capacity_tokens": 1920,
        "block_size": 128,
        "max_model_len": 512,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": "vLLM's default",
    }
    settings.pop("time_model", None)
    meta: dict[str, Any] = {
        **efficacy.commit(),
        "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "machine": efficacy.machine(),
        "loadavg_at_start": list(os.getloadavg()),
        "command": " ".join(["python -m bench.efficacy_vllm", *sys.argv[1:]]),
        "settings": settings,
    }
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvguard-vllm-bench-") as scratch:
        runs = asyncio.run(run_all(seeds, policies, setup, Path(scratch)))
    meta["wall_s"] = round(time.monotonic() - began, 1)
    meta["loadavg_at_end"] = list(os.getloadavg())
    doc = {"meta": meta, "runs": runs, "summary": summarize(runs)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "efficacy_vllm.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main() -> None:
    """``python -m bench.efficacy_vllm``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--pattern-s", type=float, default=PATTERN_S)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    configure_logging("error", "json")
    from tests.real.vllm_engine import INSTALL_HINT, READY  # noqa: PLC0415

    if not READY.is_file():
        print(f"vLLM (CPU) is not installed: {INSTALL_HINT}", file=sys.stderr)  # noqa: T201
        raise SystemExit(2)
    run(
        seeds=args.seeds,
        pattern_s=args.pattern_s,
        policies=tuple(args.policies),
        out_dir=args.out_dir,
    )


if __name__ == "__main__":
    main()
