"""Proxy cost: latency kvguard's admission proxy adds, and the throughput it sustains.

One fast stub upstream (bench/overhead_stub.py), each in its own process, and three
ways to reach it, measured in the same run by the same client (its own process too,
bench/overhead_client.py):

* ``direct``: the client talks to the stub;
* ``kvguard``: through a real ``kvguard run`` with ``[proxy] enabled`` (defaults
  otherwise: the daemon also polls the stub's idle vLLM metrics at 2 Hz — a real
  capture whose pool is scaled to a GPU's, 262,144 tokens, so that 32 small requests
  in flight are what they are on a GPU, a sliver of the pool
  (:func:`bench.overhead_scrape.gpu_pool_page`); a new
  prompt is counted from the answer's ``usage`` for whole answers and by the stub's
  ``/tokenize`` for streams without ``include_usage``, as with vLLM);
* ``nginx``: through nginx (the Debian package) as a plain reverse proxy — one worker
  process, upstream keep-alive, ``proxy_buffering off`` — a reference for what a
  reverse proxy costs on this machine;
* ``nginx_admission``: the same nginx set up as docs/integrations.md shows (its
  ``auth_request`` site), asking the ``kvguard`` process's ``/admission`` before each
  completion: the data path that scales past one kvguard process (nginx carries the
  bytes, kvguard answers a header-only check). Its CPU per request is kvguard's
  (``cpu_ms_per_request``) and nginx's (``nginx_cpu_ms_per_request``);
* ``aiohttp_floor`` (a diagnostic, no target): a bare aiohttp pass-through
  (bench/overhead_floor.py), kvguard's HTTP stack with none of kvguard's work: what
  part of kvguard's cost per request is the stack;
* ``kvguard_cached_prompt`` (a diagnostic, no target): the same kvguard, sent one
  prompt over and over, so its token-count cache answers: for streams, the
  difference to ``kvguard`` is what the ``/tokenize`` round trip per new prompt costs;
* ``kvguard_many_in_flight`` (a diagnostic, no target): the same kvguard, its closed
  loop at ``MANY_IN_FLIGHT`` requests at once rather than ``CONCURRENCY``: whether
  what kvguard spends per request grows with what is in flight (its accounting is
  meant to cost the same with 32 or 256 requests in flight).

Each round runs every target once, in a rotating order so none is always first; a
round is, per kind (``json`` whole answers, ``stream`` SSE): a warm-up, an open loop
at ``RATE`` requests/s (latency), a closed loop at ``CONCURRENCY`` (throughput).
Latencies of all rounds are pooled; added latency = proxied - direct at the same
percentile. Throughput is the median over rounds, given as a ratio to ``direct``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.overhead_procs import (
    PYTHON,
    ROOT,
    BenchProcessError,
    KvguardRun,
    Meter,
    Proc,
    event_loop_of,
    start_floor,
    start_kvguard,
    start_nginx,
    start_stub,
    wait_http,
)
from bench.overhead_scrape import gpu_pool_page

RATE = 200.0
CONCURRENCY = 32
MANY_IN_FLIGHT = 256  # the kvguard_many_in_flight diagnostic's closed loop
KINDS = ("json", "stream")
TARGETS = (
    "direct",
    "kvguard",
    "nginx",
    "nginx_admission",
    "kvguard_cached_prompt",
    "kvguard_many_in_flight",
    "kvguard_asyncio",
    "aiohttp_floor",
)


def _percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _client(
    url: str,
    *,
    open_s: float,
    closed_s: float,
    warmup_s: float,
    repeat: bool = False,
    concurrency: int = CONCURRENCY,
) -> dict[str, Any]:
    argv = [PYTHON, "-m", "bench.overhead_client", "--url", url, "--rate", str(RATE)]
    if repeat:
        argv.append("--repeat-prompt")
    argv += ["--open-s", str(open_s), "--closed-s", str(closed_s)]
    argv += ["--concurrency", str(concurrency), "--warmup-s", str(warmup_s)]
    budget = 2 * (warmup_s + open_s + closed_s) + 60  # generous: its requests time out anyway
    done = subprocess.run(  # noqa: S603 - our own client, argv without a shell
        argv, cwd=ROOT, capture_output=True, text=True, timeout=budget, check=False
    )
    if done.returncode != 0:
        raise BenchProcessError(f"client for {url} exited {done.returncode}: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def summarize(rounds: list[dict[str, Any]], targets: list[str]) -> dict[str, Any]:
    """Pooled latency percentiles, median throughput, and each against ``direct``."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        per: dict[str, Any] = {}
        for target in targets:
            latencies = [
                ms for r in rounds if target in r for ms in r[target][kind]["open"]["latencies_ms"]
            ]
            sent = sum(r[target][kind]["open"]["sent"] for r in rounds if target in r)
            rps = [
                r[target][kind]["closed"]["requests_per_s"]
                for r in rounds
                if target in r and r[target][kind]["closed"]["requests_per_s"]
            ]
            per[target] = {
                "sent": sent,
                "ok": len(latencies),
                "p50_ms": _round(_percentile(latencies, 0.50)),
                "p90_ms": _round(_percentile(latencies, 0.90)),
                "p99_ms": _round(_percentile(latencies, 0.99)),
                "max_ms": _round(max(latencies) if latencies else None),
                "throughput_rps": _round(statistics.median(rps), 1) if rps else None,
                "throughput_rps_rounds": rps,
            }
        direct = per["direct"]
        for target in targets:
            if target == "direct":
                continue
            mine = per[target]
            for q in ("p50", "p99"):
                a, b = mine[f"{q}_ms"], direct[f"{q}_ms"]
                mine[f"added_{q}_ms"] = _round(a - b) if a is not None and b is not None else None
            a, b = mine["throughput_rps"], direct["throughput_rps"]
            mine["throughput_vs_direct"] = _round(a / b) if a and b else None
        if "nginx" in per:
            for target, mine in per.items():
                if target in ("direct", "nginx"):
                    continue
                a, b = mine["throughput_rps"], per["nginx"]["throughput_rps"]
                mine["throughput_vs_nginx"] = _round(a / b) if a and b else None
        out[kind] = per
    return out


@dataclass
class Paths:
    """The ways to reach the stub, and what measures each one's cost.

    ``meters``: the process whose CPU per request a path reports (kvguard's, or
    nginx's for the plain proxy); ``side_meters``: a second process a path runs
    through (nginx, where it asks kvguard's /admission).
    """

    procs: list[Proc] = field(default_factory=list)
    urls: dict[str, str] = field(default_factory=dict)
    meters: dict[str, Meter] = field(default_factory=dict)
    side_meters: dict[str, Meter] = field(default_factory=dict)
    loops: dict[str, str | None] = field(default_factory=dict)
    nginx_skipped: str | None = None


def _start_paths(
    tmp: Path,
    paths: Paths,
    *,
    cached_prompt: bool,
    compare_loops: bool,
    floor: bool,
    many_in_flight: bool,
) -> Proc:
    """Start the stub and every path to it (into ``paths``); returns the stub."""
    stub = start_stub(tmp, metrics=[gpu_pool_page(tmp)])
    paths.procs.append(stub)
    kvguard = _start_proxy(tmp, "kvguard-proxy", stub.url, paths.procs)
    assert kvguard.proxy is not None  # noqa: S101 - started with proxy=True
    paths.urls.update({"direct": stub.url, "kvguard": kvguard.proxy})
    paths.meters["kvguard"] = Meter(kvguard.proc)
    paths.loops["kvguard"] = event_loop_of(kvguard)
    if compare_loops and paths.loops["kvguard"] == "uvloop":
        # The same kvguard on asyncio's own loop: what uvloop (the `fast` extra) buys.
        plain = _start_proxy(tmp, "kvguard-proxy-asyncio", stub.url, paths.procs, "asyncio")
        paths.urls["kvguard_asyncio"] = plain.proxy or ""
        paths.meters["kvguard_asyncio"] = Meter(plain.proc)
        paths.loops["kvguard_asyncio"] = event_loop_of(plain)
    try:
        nginx = start_nginx(tmp, stub.url)
        paths.procs.append(nginx)
        paths.urls["nginx"] = nginx.url
        paths.meters["nginx"] = Meter(nginx)
        # The data path kvguard scales with: nginx carries the requests and asks the
        # same kvguard's /admission before each completion (docs/integrations.md).
        gate = start_nginx(tmp, stub.url, kvguard_api=kvguard.api, name="nginx-admission")
        paths.procs.append(gate)
        paths.urls["nginx_admission"] = gate.url
        paths.meters["nginx_admission"] = Meter(kvguard.proc)
        paths.side_meters["nginx_admission"] = Meter(gate)
    except BenchProcessError as exc:
        paths.nginx_skipped = str(exc)
    if cached_prompt:
        paths.urls["kvguard_cached_prompt"] = kvguard.proxy
        paths.meters["kvguard_cached_prompt"] = Meter(kvguard.proc)
    if many_in_flight:
        paths.urls["kvguard_many_in_flight"] = kvguard.proxy
        paths.meters["kvguard_many_in_flight"] = Meter(kvguard.proc)
    if floor:
        bare = start_floor(tmp, stub.url)
        paths.procs.append(bare)
        paths.urls["aiohttp_floor"] = bare.url
        paths.meters["aiohttp_floor"] = Meter(bare)
    return stub


def _one_target(
    paths: Paths, target: str, stub_meter: Meter, cpu: dict[str, dict[str, float]], **client: float
) -> dict[str, Any]:
    """One target's client run, its stub CPU and (added to ``cpu``) the CPU of its meters."""
    meter, side = paths.meters.get(target), paths.side_meters.get(target)
    for started in (meter, side, stub_meter):
        if started is not None:
            started.start()
    done = _client(
        paths.urls[target],
        repeat=target == "kvguard_cached_prompt",
        concurrency=MANY_IN_FLIGHT if target == "kvguard_many_in_flight" else CONCURRENCY,
        **client,
    )
    done["stub_cpu_s"] = stub_meter.stop()["cpu_s"]
    if meter is not None:
        figures = meter.stop()
        cpu[target]["cpu_s"] += figures["cpu_s"]
        cpu[target]["rss_mib"] = figures["rss_mib"]
        cpu[target]["requests"] += sum(
            done[k][loop].get("ok", 0) for k in KINDS for loop in ("open", "closed")
        )
    if side is not None:
        cpu[target]["nginx_cpu_s"] = cpu[target].get("nginx_cpu_s", 0.0) + side.stop()["cpu_s"]
    return done


def measure_proxy(
    tmp: Path,
    *,
    rounds: int,
    open_s: float,
    closed_s: float,
    warmup_s: float,
    cached_prompt: bool = True,
    compare_loops: bool = True,
    floor: bool = True,
    many_in_flight: bool = True,
) -> dict[str, Any]:
    """Every target, ``rounds`` times, with the CPU each proxy used per request.

    ``cached_prompt``: also the ``kvguard_cached_prompt`` diagnostic. ``compare_loops``:
    when kvguard runs on uvloop, also the same kvguard on asyncio's loop. ``floor``:
    also the bare aiohttp pass-through (``aiohttp_floor``). ``many_in_flight``: also
    the same kvguard at ``MANY_IN_FLIGHT`` requests at once (``kvguard_many_in_flight``).
    """
    paths = Paths()
    try:
        stub = _start_paths(
            tmp,
            paths,
            cached_prompt=cached_prompt,
            compare_loops=compare_loops,
            floor=floor,
            many_in_flight=many_in_flight,
        )
        targets = list(paths.urls)
        stub_meter = Meter(stub)
        results: list[dict[str, Any]] = []
        cpu: dict[str, dict[str, float]] = {t: {"cpu_s": 0.0, "requests": 0} for t in paths.meters}
        for index in range(rounds):
            order = targets[index % len(targets) :] + targets[: index % len(targets)]
            one: dict[str, Any] = {"order": order}
            for target in order:
                one[target] = _one_target(
                    paths,
                    target,
                    stub_meter,
                    cpu,
                    open_s=open_s,
                    closed_s=closed_s,
                    warmup_s=warmup_s,
                )
            results.append(one)
        for figures in cpu.values():
            # Warm-up requests are not counted, so this slightly overstates the cost.
            requests = figures["requests"]
            for key in ("cpu", "nginx_cpu"):
                if f"{key}_s" in figures:
                    figures[f"{key}_ms_per_request"] = (
                        round(figures[f"{key}_s"] * 1000 / requests, 4) if requests else None
                    )
        return {
            "rate_per_s": RATE,
            "concurrency": CONCURRENCY,
            "many_in_flight": MANY_IN_FLIGHT,
            "rounds": rounds,
            "open_s": open_s,
            "closed_s": closed_s,
            "warmup_s": warmup_s,
            "targets": targets,
            "event_loops": paths.loops,
            "nginx_skipped": paths.nginx_skipped,
            "nginx_workers": 1,
            "tokenize_per_request": "streams without include_usage",
            "summary": summarize(results, targets),
            "proxy_cpu": cpu,
            "per_round": [_slim(r) for r in results],
        }
    finally:
        for proc in reversed(paths.procs):
            proc.stop()


def _start_proxy(
    tmp: Path, name: str, upstream: str, procs: list[Proc], loop: str | None = None
) -> KvguardRun:
    """``kvguard run`` with its proxy in front of ``upstream``, ready (added to ``procs``).

    ``loop``: its ``KVGUARD_EVENT_LOOP`` (None: as installed, uvloop when it is).
    """
    env = {"KVGUARD_EVENT_LOOP": loop} if loop is not None else None
    run = start_kvguard(tmp, name, upstream, interval_s=0.5, proxy=True, env=env)
    procs.append(run.proc)
    wait_http(run.proc, f"{run.proxy}/v1/models")
    return run


def _slim(one: dict[str, Any]) -> dict[str, Any]:
    """A round without its raw latencies: percentiles and throughput per target and kind."""
    out: dict[str, Any] = {"order": one["order"]}
    for target, data in one.items():
        if target == "order":
            continue
        out[target] = {"stub_cpu_s": data["stub_cpu_s"]}
        for kind in KINDS:
            lat = data[kind]["open"]["latencies_ms"]
            out[target][kind] = {
                "p50_ms": _round(_percentile(lat, 0.5)),
                "p99_ms": _round(_percentile(lat, 0.99)),
                "open_statuses": data[kind]["open"]["statuses"],
                "sender_late_ms_max": data[kind]["open"]["sender_late_ms_max"],
                "throughput_rps": data[kind]["closed"]["requests_per_s"],
                "closed_statuses": data[kind]["closed"]["statuses"],
            }
    return out
