"""``kvguard demo``: one seeded burst against a small simulated engine, without and with kvguard.

No GPU, no config, nothing outside 127.0.0.1. Each run starts a fresh simulated vLLM
engine whose KV pool is small and which crashes (``oom_on_exhaust``) instead of
preempting when the pool runs out, as engines that allocate KV per sequence do. The
first run sends a seeded ``kvguard loadgen`` pattern straight at the engine; the
second sends the same traffic through kvguard: the daemon live (policy acting, not a
dry run) and its admission proxy at its defaults (``[proxy] admission = "observed"``),
which holds each request until its reservation — the prompt plus what recent answers
of its kind used, ``max_tokens`` until it has seen enough — fits the pool. Without it
the first burst lands before any tick and crashes the engine (docs/how-it-works.md,
section 0).

Both runs are bounded (``--duration`` seconds of traffic each, a grace second, a run
ends early at a crash) and everything they start is stopped before the command
returns, also on Ctrl-C. The summary compares engine crashes, preemptions, requests
completed, shed, clamped, cancelled and latency; ``--json`` writes it for scripts.

Exit codes: 0 when both runs finished (whatever they showed: an unguarded crash is the
point); 2 for a bad argument; 1 for an internal failure; 130 when interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from kvguard.actuators.proxy import ProxyCounters
from kvguard.api.logs import configure_logging
from kvguard.cli.demo_view import (
    LiveView,
    StatusSample,
    decision_events,
    quiet_stderr,
    render_header,
    render_summary,
    with_kvguard,
)
from kvguard.core.policy import LEVELS
from kvguard.core.snapshot import Snapshot
from kvguard.errors import InvalidInputError, KvguardError
from kvguard.runtime.assembly import Guard
from kvguard.runtime.inprocess import start_guard
from kvguard.sim.engine import TimeModel
from kvguard.sim.loadgen import LoadConfig, run_load
from kvguard.sim.loadgen_report import LoadReport
from kvguard.sim.runner import PoolSpec, SimServer, size_pool, start_sim_server
from kvguard.sim.traffic import PATTERNS

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # the shell convention for a run ended by SIGINT

# A pool the default `mixed` burst overflows within seconds (see the tests), yet one
# full-length request fits it many times over: admission has room to work with.
POOL = PoolSpec(
    kv_capacity_tokens=8192,
    max_model_len=2048,
    max_num_seqs=64,
    max_num_batched_tokens=2048,
    oom_on_exhaust=True,
)
DEFAULT_PATTERN = "mixed"
DEFAULT_SEED = 1
DEFAULT_DURATION_S = 30.0  # per run: about a minute for both, less when one crashes
MAX_DURATION_S = 600.0
CONCURRENCY = 256
MAX_REQUESTS = 5000
GRACE_S = 1.0
STOP_WAIT_S = 3.0  # how long a load may take to stop after a crash before it is cut off
FIRST_TICK_WAIT_S = 5.0
REFRESH_S = 0.1
POLL = {"interval_s": 0.5, "min_interval_s": 0.1, "timeout_s": 1.0}
SUMMARY_KEYS = (
    "engine_crashes",
    "preemptions",
    "completed",
    "shed",
    "shed_no_room",
    "clamped",
    "cancelled",
    "p50_latency_s",
    "p99_latency_s",
)


@dataclass(frozen=True)
class DemoOptions:
    """The demo's validated arguments."""

    pattern: str = DEFAULT_PATTERN
    seed: int = DEFAULT_SEED
    duration_s: float = DEFAULT_DURATION_S
    json_path: Path | None = None
    quiet: bool = False


@dataclass
class RunOutcome:
    """One run's result, as the summary and ``--json`` report it.

    ``shed``, ``clamped``, ``rejected`` and ``cancelled`` are kvguard's own counts (0
    without it); ``shed_no_room`` are the sheds of admission (no room in the engine's
    pool for the request, whatever the level), the rest were the ladder's. ``failed``
    counts requests that ended in any other error: lost in a crash, cancelled
    mid-stream, an error from the engine. Latencies are end-to-end over
    completed requests; None when none completed or the load had to be cut off.
    """

    guarded: bool
    pattern: str
    seed: int
    duration_s: float
    engine_crashes: int = 0
    crashed_at_s: float | None = None
    crash_message: str | None = None
    preemptions: int = 0
    sent: int | None = None
    completed: int = 0
    failed: int | None = None
    unfinished: int | None = None
    shed: int = 0
    shed_no_room: int = 0
    clamped: int = 0
    rejected: int = 0
    cancelled: int = 0
    p50_latency_s: float | None = None
    p99_latency_s: float | None = None
    peak_level: str | None = None
    actions: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, seconds rounded to milliseconds."""
        data = asdict(self)
        for key, value in data.items():
            if isinstance(value, float):
                data[key] = round(value, 3)
        return data


# ------------------------------------------------------------------ arguments
class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line, as the ``kvguard`` command's are."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pattern",
        choices=tuple(PATTERNS),
        default=DEFAULT_PATTERN,
        help=f"loadgen traffic pattern of the burst (default {DEFAULT_PATTERN})",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=DEFAULT_DURATION_S,
        metavar="S",
        help=f"seconds of traffic in each run, at most {MAX_DURATION_S:g}"
        f" (default {DEFAULT_DURATION_S:g}; a run ends early when the engine crashes)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help=f"seed of the traffic and the engine, the same for both runs (default {DEFAULT_SEED})",
    )
    p.add_argument("--json", metavar="FILE", help="also write the summary as JSON to FILE")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    p.set_defaults(handler=run_demo)


def add_demo_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``demo`` subcommand (its handler is :func:`run_demo`)."""
    p = subparsers.add_parser(
        "demo",
        help="see kvguard save a simulated engine from a KV-cache crash (no GPU, ~1 minute)",
        description=(
            "Start a small simulated engine that crashes when its KV cache runs out, send it"
            " a seeded burst once directly and once through kvguard (policy and admission"
            " proxy live), show both as they happen and compare them. Everything runs on"
            " 127.0.0.1 and stops by itself."
        ),
        epilog=f"Patterns: {', '.join(PATTERNS)}.",
    )
    _configure(p)


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """Check the arguments; a bad one raises :class:`InvalidInputError` naming its flag."""
    duration = args.duration
    if not (math.isfinite(duration) and 0 < duration <= MAX_DURATION_S):
        raise InvalidInputError(
            "--duration", duration, f"must be a number of seconds > 0 and <= {MAX_DURATION_S:g}"
        )
    if args.pattern not in PATTERNS:
        raise InvalidInputError("--pattern", args.pattern, f"must be one of {', '.join(PATTERNS)}")
    json_path = None
    if args.json is not None:
        json_path = Path(args.json)
        # Checked before the runs, so a typo in a path does not cost a minute.
        if json_path.is_dir() or not json_path.parent.is_dir():
            raise InvalidInputError("--json", args.json, "must be a file in an existing directory")
    return DemoOptions(args.pattern, args.seed, duration, json_path, args.quiet)


# ------------------------------------------------------------------ the command
def run_demo(args: argparse.Namespace) -> int:
    """Run both runs, print the summary (and write ``--json``); the process exit code."""
    options = options_from_args(args)
    # Every decision and shed request is a log event: thousands of lines that would bury
    # the view. The view shows the decisions; only errors reach stderr.
    configure_logging("error", "json")
    out = sys.stdout
    view = LiveView(out, terminal=out.isatty(), quiet=options.quiet)
    try:
        with quiet_stderr():
            runs = asyncio.run(_run_both(options, view))
    except KeyboardInterrupt:  # before the loop's own handler was in place
        runs = None
    except KvguardError as exc:
        view.end_run()
        sys.stderr.write(f"kvguard demo: error: {exc}\n")
        return EXIT_FAILED
    if runs is None:
        view.end_run()
        sys.stderr.write("kvguard demo: interrupted; the engine and kvguard are stopped\n")
        return EXIT_INTERRUPTED
    unguarded, guarded = (run.as_dict() for run in runs)
    gap = "" if options.quiet else "\n"  # apart from the live view above it
    header = render_header(options.pattern, options.seed, options.duration_s, POOL)
    out.write(f"{gap}{header}\n\n{render_summary(unguarded, guarded)}\n")
    if options.json_path is not None:
        text = json.dumps({"unguarded": unguarded, "guarded": guarded}, indent=2) + "\n"
        try:
            options.json_path.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise InvalidInputError(
                "--json", str(options.json_path), f"must be writable ({exc.strerror})"
            ) from exc
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """``kvguard demo`` on its own: parse ``argv`` and run (for tests and ``python -m``)."""
    parser = _Parser(prog="kvguard demo", description=__doc__.splitlines()[0])
    _configure(parser)
    args = parser.parse_args(argv)
    try:
        return run_demo(args)
    except InvalidInputError as exc:
        sys.stderr.write(f"kvguard demo: error: {exc.field}: {exc.allowed}, got {exc.value!r}\n")
        return EXIT_BAD_INPUT


# ------------------------------------------------------------------ the runs
async def _run_both(options: DemoOptions, view: LiveView) -> tuple[RunOutcome, RunOutcome] | None:
    """The unguarded run, then the guarded one; None when interrupted."""
    interrupt = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, interrupt.set)
            installed.append(sig)
    try:
        results = []
        for guarded in (False, True):
            results.append(await _run_once(options, guarded=guarded, view=view, stop=interrupt))
            if interrupt.is_set():
                return None
        return results[0], results[1]
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def _run_once(
    options: DemoOptions, *, guarded: bool, view: LiveView, stop: asyncio.Event
) -> RunOutcome:
    """One run at a fresh engine, directly or through kvguard; all it starts is stopped."""
    began = time.monotonic()
    outcome = RunOutcome(guarded, options.pattern, options.seed, options.duration_s)
    server = await start_sim_server(size_pool(POOL), time_model=TimeModel(), seed=options.seed)
    guard: _Guard | None = None
    try:
        if guarded:
            view.line("Run 2 of 2: the same burst through kvguard (policy live, admission proxy)")
            guard = await _Guard.start(server.url)
            await guard.run_until_ready(view)
        else:
            view.line("Run 1 of 2: the burst straight at the engine, without kvguard")
        url = guard.url if guard is not None else server.url
        report = await _drive(
            server, url, options=options, view=view, outcome=outcome, guard=guard, interrupt=stop
        )
        _record(outcome, server, report, guard)
    finally:
        view.end_run()
        if guard is not None:
            await guard.close()
        await server.stop()
    outcome.wall_s = time.monotonic() - began
    return outcome


async def _drive(
    server: SimServer,
    url: str,
    *,
    options: DemoOptions,
    view: LiveView,
    outcome: RunOutcome,
    guard: _Guard | None,
    interrupt: asyncio.Event,
) -> LoadReport | None:
    """The load until its end, a crash of the engine or an interrupt; None when cut off.

    A crash ends the load at once (the rest would only fail). It may not stop in time: on
    Python 3.11 ``asyncio.wait_for`` swallows a cancellation that arrives as its awaitable
    completes, and a crash frees every loadgen slot at once, so the dispatcher can miss
    ``stop``; after :data:`STOP_WAIT_S` it is cut off and its report is lost.
    """
    stop = asyncio.Event()
    config = LoadConfig(
        url,
        pattern=options.pattern,
        duration_s=options.duration_s,
        max_requests=MAX_REQUESTS,
        concurrency=CONCURRENCY,
        seed=options.seed,
        grace_s=GRACE_S,
    )
    start = time.monotonic()
    if guard is not None:
        guard.start_s = start
    load = asyncio.ensure_future(run_load(config, stop=stop))
    crashed = asyncio.ensure_future(server.crashed.wait())
    interrupted = asyncio.ensure_future(interrupt.wait())
    refresh = asyncio.ensure_future(_refresh(view, server, guard, start, options.duration_s))
    try:
        await asyncio.wait({load, crashed, interrupted}, return_when=asyncio.FIRST_COMPLETED)
        if server.crashed.is_set():
            outcome.engine_crashes = 1
            outcome.crashed_at_s = time.monotonic() - start
            outcome.crash_message = "; ".join(server.crash_messages)
            view.event(outcome.crashed_at_s, f"ENGINE CRASHED: {outcome.crash_message}")
        if not load.done():
            stop.set()
            await asyncio.wait({load}, timeout=STOP_WAIT_S)
            if not load.done():
                return None
        return load.result()
    finally:
        for task in (load, crashed, interrupted, refresh):
            task.cancel()
        await asyncio.gather(load, crashed, interrupted, refresh, return_exceptions=True)


async def _refresh(
    view: LiveView, server: SimServer, guard: _Guard | None, start: float, duration_s: float
) -> None:
    """Offer the view a fresh status every :data:`REFRESH_S` (it draws what is due)."""
    while True:
        now = time.monotonic()
        scheduler = server.engine.scheduler
        sample = StatusSample(
            t_s=min(now - start, duration_s),
            duration_s=duration_s,
            kv_usage=scheduler.usage,
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            completed=_completed(server),
        )
        view.status(now, guard.status(sample) if guard is not None else sample)
        await asyncio.sleep(REFRESH_S)


def _completed(server: SimServer) -> int:
    """Requests the engine finished: at their true length or at ``max_tokens``."""
    finished = server.engine.stats.finished
    return finished["length"] + finished["stop"]


def _record(
    outcome: RunOutcome, server: SimServer, report: LoadReport | None, guard: _Guard | None
) -> None:
    """Fill ``outcome`` from the engine, the load's report and kvguard's counters."""
    outcome.preemptions = server.engine.stats.preemptions_total
    if guard is not None:
        counters = guard.counters()
        outcome.shed = sum(counters.shed.values())
        outcome.shed_no_room = sum(
            n for (_, reason), n in counters.shed.items() if reason == "kv_pool_full"
        )
        outcome.clamped = counters.clamped
        outcome.rejected = sum(counters.rejected.values())
        outcome.cancelled = sum(counters.cancelled.values())
        outcome.peak_level = guard.peak_level
        outcome.actions = dict(sorted(guard.actions.items()))
    if report is None:  # cut off after a crash: what the engine itself finished
        outcome.completed = _completed(server)
        return
    outcome.sent = report.sent
    outcome.completed = report.succeeded
    outcome.unfinished = report.unfinished
    # loadgen counts every 429/503 as shed and every other 4xx as refused; those kvguard
    # did not send came from a dead engine. kvguard's 400s (window cap) are rejections.
    lost = report.failed + report.shed + report.refused
    outcome.failed = max(0, lost - outcome.shed - outcome.rejected)
    if report.e2e_s is not None:
        outcome.p50_latency_s = report.e2e_s.p50
        outcome.p99_latency_s = report.e2e_s.p99


# ------------------------------------------------------------------ kvguard
class _Guard:
    """kvguard in front of the engine, as ``kvguard run`` with ``[proxy] enabled``."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.daemon = guard.daemon
        assert guard.proxy_url is not None  # noqa: S101 - the proxy is enabled
        self.url = guard.proxy_url
        self.start_s: float | None = None  # when the load began; events are timed from it
        self.peak_level = "ok"
        self.actions: Counter[str] = Counter()
        self._view: LiveView | None = None
        self._counts: Counter[tuple[str, str]] = Counter()

    @classmethod
    async def start(cls, engine_url: str) -> _Guard:
        """Build the live daemon and its proxy on a free port of 127.0.0.1."""
        return cls(await start_guard(engine_url, poll=POLL))  # kvguard at its defaults

    async def run_until_ready(self, view: LiveView) -> None:
        """Start ticking; return once kvguard knows the engine's pool (admission needs it)."""
        self._view = view
        loop = self.guard.run_in_background(self._after_tick)
        deadline = time.monotonic() + FIRST_TICK_WAIT_S
        while self.daemon.mitigations.pool_tokens is None:
            if time.monotonic() > deadline or loop.done():
                raise KvguardError("kvguard could not read the simulated engine's KV pool")
            await asyncio.sleep(0.05)

    def _after_tick(self, _: Snapshot) -> None:
        """After each tick: the peak level, and one event per level change and action."""
        counts = self.daemon.brain.counts
        new, self._counts = counts - self._counts, Counter(counts)
        decision = self.daemon.brain.decision
        if decision is None or self.start_s is None or self._view is None:
            return  # before the load: not part of the run
        if LEVELS.index(decision.level) > LEVELS.index(self.peak_level):
            self.peak_level = decision.level
        self.actions.update(action.kind for action in decision.plan)
        t = time.monotonic() - self.start_s
        for text in decision_events(decision, new):
            self._view.event(t, text)

    def status(self, sample: StatusSample) -> StatusSample:
        """``sample`` with kvguard's view added: level, pattern, time to exhaustion, shed."""
        shed = sum(self.counters().shed.values())
        return with_kvguard(sample, self.daemon.brain.decision, shed)

    def counters(self) -> ProxyCounters:
        """The proxy's counters (shed, clamped, rejected, cancelled)."""
        proxy = self.daemon.proxy
        assert proxy is not None  # noqa: S101 - set in start()
        return proxy.counters

    async def close(self) -> None:
        """Stop the loop, the proxy and the probes."""
        # A loop that died was reported already (run_until_ready, or the run's outcome).
        with contextlib.suppress(Exception):
            await self.guard.close()


__all__ = ["SUMMARY_KEYS", "RunOutcome", "add_demo_parser", "main", "run_demo"]

if __name__ == "__main__":
    sys.exit(main())
