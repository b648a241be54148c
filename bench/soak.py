"""Soak: kvguard's proxy and daemon under hours-like mixed traffic, squeezed into minutes.

On 127.0.0.1: a simulated vLLM with a small KV pool and ``kvguard loadgen`` traffic in
this process, and kvguard itself as operators run it, ``kvguard run`` with its
admission proxy enabled, in its own process (so the memory, descriptors and tasks
measured are kvguard's, not the engine's or the load's). Traffic goes through the
proxy in cycles of calm (steady, light) and pressure (bursts at 16x the concurrency,
enough to make kvguard shed and clamp). After a warm-up (the first two cycles) it
measures, at the quiet point that ends each cycle, of the kvguard process:

* resident memory (RSS): growth from the end of the warm-up to the end must stay
  under 10 %;
* open file descriptors and asyncio tasks (``kvguard_event_loop_tasks``): no growth,
  kvguard's keep-alive connections to the engine (the proxy's idle pool, bounded by its
  limit of 100, and the probe's) left out of the descriptors;

and over the whole run:

* no lost request: every request the load generator sent ended as a success, a shed
  (429/503), or a clear error (a status or a stream error); none unfinished;
* the only failures are streams kvguard cancelled on purpose (an error event), no
  more of them than its ``kvguard_requests_cancelled_total``;
* counters agree: the load generator's successes are the engine's completed
  requests (a cancel that lands after the engine's last token can make one more),
  its sheds are the proxy's (``kvguard_requests_shed_total``, plus requests the
  proxy cancelled before their answer began), and the engine received no more than
  the proxy forwarded;
* kvguard logged no error and exited 0 on SIGTERM.

    .venv/bin/python -m bench.soak [--duration-s 600] [--out bench/results/soak.json]

``--duration-s 600`` is the full soak; CI runs 120 (tests/reliability/test_soak.py).
Numbers go to the JSON file and a summary to stdout; docs/reliability.md cites them.
The exit status is 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from kvguard.api.logs import configure_logging
from kvguard.probes.engines.base import Samples, parse_exposition
from kvguard.runtime.inprocess import free_port
from kvguard.sim.engine import TimeModel
from kvguard.sim.loadgen import LoadConfig, run_load
from kvguard.sim.loadgen_report import LoadReport
from kvguard.sim.runner import PoolSpec, size_pool, start_sim_server

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
FD_SLACK = 8  # keep-alive sockets of the loadgen come and go
TASK_SLACK = 4
SETTLE_S = 1.0  # after a cycle's load, before sampling: let cancelled handlers end
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0


def kvguard_command() -> list[str]:
    """The installed ``kvguard`` next to this Python, else the module run by this Python."""
    script = Path(sys.executable).parent / "kvguard"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from kvguard.cli.main import main; sys.exit(main())"]


def write_config(directory: Path, engine_url: str, api: str, proxy: str) -> Path:
    """The config of the soak's kvguard: the engine, its API and proxy on loopback, live."""
    poll = "\n".join(f"{key} = {value}" for key, value in POLL.items())
    path = directory / "kvguard.toml"
    path.write_text(
        f'[engine]\nurl = "{engine_url}"\n'
        f"[poll]\n{poll}\n"
        f'[server]\nlisten = "{api}"\n'
        f'[proxy]\nenabled = true\nlisten = "{proxy}"\n'
        '[log]\nlevel = "warning"\nformat = "json"\n',
        encoding="utf-8",
    )
    return path


def total(metrics: Samples, name: str) -> float:
    """The sum of a metric's samples (0 when absent)."""
    return metrics.total(name) or 0.0


def by_label(metrics: Samples, name: str, *labels: str) -> dict[str, int]:
    """A counter's samples keyed by the values of ``labels`` joined with '/'."""
    keyed = {
        "/".join(found.get(label, "") for label in labels): v for found, v in metrics.series(name)
    }
    return {key: int(value) for key, value in sorted(keyed.items())}


class Kvguard:
    """``kvguard run`` in its own process, its log in a file, its API scraped over HTTP."""

    def __init__(self, proc: asyncio.subprocess.Process, api_url: str, log_path: Path) -> None:
        self.proc = proc
        self.process = psutil.Process(proc.pid)
        self.api_url = api_url
        self.log_path = log_path
        self._http: aiohttp.ClientSession | None = None

    async def metrics(self) -> Samples:
        """The /metrics of this kvguard, parsed."""
        if self._http is None:
            self._http = aiohttp.ClientSession()
        async with self._http.get(f"{self.api_url}/metrics") as resp:
            resp.raise_for_status()
            return parse_exposition(await resp.text())

    async def stop(self) -> int:
        """SIGTERM, and its exit status (killed, -9, past ``STOP_TIMEOUT_S``)."""
        if self._http is not None:
            await self._http.close()
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        return int(self.proc.returncode or 0)

    def log_events(self) -> Iterator[dict[str, Any]]:
        """The JSON log lines of this kvguard (any other line as ``{"event": "<text>"}``)."""
        for line in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                event = {"event": line}
            yield event if isinstance(event, dict) else {"event": line}


async def start_kvguard(directory: Path, engine_url: str) -> tuple[Kvguard, str]:
    """Start ``kvguard run`` against the engine; (the process, the proxy's URL) once it serves."""
    api, proxy = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    config = write_config(directory, engine_url, api, proxy)
    log_path = directory / "kvguard.log"
    env = {**os.environ, "KVGUARD_STATE_DIR": str(directory / "state")}
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            *kvguard_command(), "run", "--config", str(config), stderr=log_file, env=env
        )
    kvguard = Kvguard(proc, f"http://{api}", log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"http://{proxy}/v1/models") as resp:
                    if resp.status == 200:
                        return kvguard, f"http://{proxy}"
            if proc.returncode is not None or time.monotonic() > deadline:
                await kvguard.stop()
                tail = log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
                raise RuntimeError(f"kvguard did not start serving its proxy:\n{tail}")
            await asyncio.sleep(0.2)


async def sample(kvguard: Kvguard, engine_port: int) -> dict[str, float]:
    """The RSS, open descriptors and live asyncio tasks of kvguard, now.

    The proxy's upstream pool keeps up to 100 idle keep-alive connections to the
    engine, grown to the peak concurrency seen so far, and the probe keeps its own;
    ``fds`` leaves them out (bounded by design, not a leak), ``fds_raw`` is the plain
    count.
    """
    process = kvguard.process
    metrics = await kvguard.metrics()  # first: its own connection is then idle, not new
    pooled = sum(
        1
        for conn in process.net_connections(kind="tcp")
        if conn.raddr and conn.raddr.port == engine_port and conn.status == psutil.CONN_ESTABLISHED
    )
    fds = process.num_fds()
    return {
        "at_s": round(time.monotonic(), 3),
        "rss_bytes": process.memory_info().rss,
        "pooled_connections": pooled,
        "fds_raw": fds,
        "fds": fds - pooled,
        "tasks": total(metrics, "kvguard_event_loop_tasks"),
        "level": total(metrics, "kvguard_pressure_level"),
    }


def add_report(totals: dict[str, Any], report: LoadReport) -> None:
    """Fold one load run into the totals."""
    for key in ("sent", "succeeded", "failed", "shed", "unfinished"):
        totals[key] += getattr(report, key)
    for status, count in report.status_counts.items():
        totals["status_counts"][status] = totals["status_counts"].get(status, 0) + count
    if report.e2e_s is not None:
        totals["e2e_p99_s"] = max(totals["e2e_p99_s"], report.e2e_s.p99)


LEVELS = ("ok", "elevated", "high", "critical")


async def soak(duration_s: float, seed: int = 0) -> dict[str, Any]:
    """Run the soak for ``duration_s`` seconds; the results document (see the module doc)."""
    cycles = max(WARMUP_CYCLES + 2, round(duration_s / CYCLE_S))
    server = await start_sim_server(
        size_pool(POOL), time_model=TimeModel(step_fixed_s=0.004, per_token_s=0.00002), seed=seed
    )
    engine_port = int(server.url.rsplit(":", 1)[1])
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
    with tempfile.TemporaryDirectory(prefix="kvguard-soak-") as tmp:
        kvguard, proxy_url = await start_kvguard(Path(tmp), server.url)
        exit_code: int | None = None
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
                samples.append({"cycle": cycle, **await sample(kvguard, engine_port)})
                last = samples[-1]
                sys.stdout.write(
                    f"cycle {cycle + 1}/{cycles}: sent {totals['sent']} shed {totals['shed']}"
                    f" kvguard rss {last['rss_bytes'] / 2**20:.1f} MiB fds {last['fds']}"
                    f" tasks {last['tasks']:.0f} level {LEVELS[int(last['level'])]}\n"
                )
                sys.stdout.flush()
            metrics = await kvguard.metrics()
        finally:
            exit_code = await kvguard.stop()
            await server.stop()
        events = list(kvguard.log_events())
    wall_s = time.monotonic() - began
    stats = server.engine.stats
    proxy_doc = {
        "shed": int(total(metrics, "kvguard_requests_shed_total")),
        "shed_by_reason": by_label(metrics, "kvguard_requests_shed_total", "priority", "reason"),
        "clamped": int(total(metrics, "kvguard_requests_clamped_total")),
        "rejected": {
            k: v
            for k, v in by_label(metrics, "kvguard_requests_rejected_total", "reason").items()
            if v
        },
        "cancelled": by_label(metrics, "kvguard_requests_cancelled_total", "reason"),
        "upstream_errors": by_label(metrics, "kvguard_proxy_errors_total", "code"),
    }
    engine_doc = {
        "requests_received": stats.requests_total,
        "finished": dict(stats.finished),
        "preemptions": stats.preemptions_total,
        "crashed": server.crashed.is_set(),
    }
    decisions = by_label(metrics, "kvguard_decisions_total", "action", "mode")
    kvguard_doc = {
        "exit_code": exit_code,
        "errors_logged": [e for e in events if e.get("level") in ("error", "critical")][:10],
        "warnings_logged": sum(1 for e in events if e.get("level") == "warning"),
    }
    return {
        "duration_s": round(wall_s, 1),
        "cycles": cycles,
        "warmup_cycles": WARMUP_CYCLES,
        "load": totals,
        "proxy": proxy_doc,
        "engine": engine_doc,
        "daemon": {
            "ticks": int(total(metrics, "kvguard_ticks_total")),
            "tick_overruns": int(total(metrics, "kvguard_tick_overruns_total")),
            "loop_stalls": int(total(metrics, "kvguard_event_loop_stalls_total")),
            "loop_lag_max_s": round(total(metrics, "kvguard_event_loop_lag_max_seconds"), 4),
            "decisions": {key: n for key, n in decisions.items() if n},
        },
        "kvguard": kvguard_doc,
        "samples": samples,
        "checks": checks(totals, proxy_doc, engine_doc, samples, kvguard_doc),
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
    }


def checks(
    load: dict[str, Any],
    proxy: dict[str, Any],
    engine: dict[str, Any],
    samples: list[dict[str, float]],
    kvguard: dict[str, Any],
) -> dict[str, dict[str, Any]]:
    """Every pass/fail check of the soak, each with the figures it compared."""
    after = samples[WARMUP_CYCLES - 1 :]  # from the quiet point that ends the warm-up
    base, last = after[0], after[-1]
    growth = (last["rss_bytes"] - base["rss_bytes"]) / base["rss_bytes"]
    ended = load["succeeded"] + load["failed"] + load["shed"] + load["unfinished"]
    completed = sum(n for reason, n in engine["finished"].items() if reason != "abort")
    cancelled = sum(proxy["cancelled"].values())
    shed_low, shed_high = proxy["shed"], proxy["shed"] + cancelled
    stream_errors = load["status_counts"].get("stream_error", 0)
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
            # A cancel can land after the engine wrote an answer's last token: the
            # engine completed it, its client got the error event.
            "ok": load["succeeded"] <= completed <= load["succeeded"] + cancelled,
            "loadgen_succeeded": load["succeeded"],
            "engine_completed": completed,
        },
        "sheds_match_the_proxy": {
            "ok": shed_low <= load["shed"] <= shed_high,
            "loadgen_shed": load["shed"],
            "proxy_shed": proxy["shed"],
            "proxy_cancelled": cancelled,
        },
        "failures_are_kvguard_cancels": {
            # A stream kvguard cancelled on purpose (overrun, largest) ends with an error
            # event: the one failure allowed, and no more of them than it cancelled.
            "ok": load["failed"] == stream_errors and load["shed"] + stream_errors <= shed_high,
            "loadgen_failed": load["failed"],
            "stream_errors": stream_errors,
            "proxy_cancelled": cancelled,
        },
        "engine_got_only_what_the_proxy_forwarded": {
            "ok": engine["requests_received"] <= forwarded_max,
            "engine_received": engine["requests_received"],
            "forwarded_at_most": forwarded_max,
        },
        "engine_never_crashed": {"ok": not engine["crashed"]},
        "kvguard_logged_no_error_and_exited_0": {
            "ok": kvguard["exit_code"] == 0 and not kvguard["errors_logged"],
            "exit_code": kvguard["exit_code"],
            "errors": [e.get("event") for e in kvguard["errors_logged"]],
        },
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
