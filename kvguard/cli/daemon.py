"""``kvguard run``, ``kvguard probe``, ``kvguard status`` and ``kvguard check-config``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import sys
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from kvguard.actuators.proxy import AdmissionProxy, ProxySettings
from kvguard.actuators.supervisor import Supervisor
from kvguard.actuators.webhook import Webhooks, WebhookSettings
from kvguard.api.server import build_app, status_document
from kvguard.api.telemetry import configure_logging
from kvguard.config.settings import Config, config_for_engine, load_config
from kvguard.core.snapshot import ENGINE_KINDS, EngineStats, Snapshot
from kvguard.core.units import format_bytes
from kvguard.errors import ConfigError, KvguardError
from kvguard.runtime.daemon import Daemon, budget_for
from kvguard.runtime.systemd import SystemdNotifier
from kvguard.runtime.wiring import attach_actuators, restart_mode

log = structlog.get_logger("kvguard.run")
DEFAULT_STATUS_URL = "http://127.0.0.1:9108"
# What `kvguard probe --json` always reports about the engine, null when unknown.
PROBE_ENGINE_KEYS = tuple(EngineStats.__dataclass_fields__)


def register(commands: argparse._SubParsersAction[Any]) -> None:
    """Add run, probe, status and check-config."""
    run = commands.add_parser(
        "run",
        help="watch an engine and its GPUs: snapshot per tick, budget, /metrics, /status",
        description="Run the kvguard daemon with the config from --config or $KVGUARD_CONFIG.",
    )
    run.add_argument("--config", metavar="FILE", help="TOML config (default: $KVGUARD_CONFIG)")
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="decide, count and report every action; block or change nothing",
    )
    run.add_argument(
        "engine_command",
        nargs=argparse.REMAINDER,
        metavar="-- ENGINE COMMAND",
        help="supervisor mode: start this engine command (after --), restart it on a crash"
        " and for the fp8 switch, stop it with kvguard",
    )
    run.set_defaults(handler=run_daemon)

    probe = commands.add_parser(
        "probe",
        help="read an engine, the GPUs and the host once and print what kvguard sees",
        description="Read every probe once against --engine-url (exit 1: engine unreachable).",
    )
    probe.add_argument("--engine-url", required=True, metavar="URL", help="the engine's base URL")
    probe.add_argument("--engine-kind", default="auto", choices=("auto", *ENGINE_KINDS))
    probe.add_argument("--json", action="store_true", help="print one JSON object")
    probe.set_defaults(handler=run_probe)

    status = commands.add_parser(
        "status",
        help="show a running kvguard's /status (live with --watch)",
        description="Read /status from a running kvguard and show it; from several, one line"
        " per engine, worst first (exit 1 when one cannot be read).",
    )
    status.add_argument(
        "--url",
        dest="urls",
        nargs="+",
        action="extend",
        metavar="URL",
        help=f"kvguard's address (default {DEFAULT_STATUS_URL}); several (--url A B, or"
        " --url repeated): one line per engine, worst first",
    )
    status.add_argument("--watch", action="store_true", help="refresh until interrupted")
    status.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="refresh period (default 1 s)"
    )
    status.add_argument("--json", action="store_true", help="print the raw /status JSON")
    status.set_defaults(handler=run_status)

    check = commands.add_parser(
        "check-config",
        help="validate a config file: every problem at once, or the resolved config",
        description="Validate FILE (and the model config it names); exit 2 listing every problem.",
    )
    check.add_argument("file", metavar="FILE")
    check.set_defaults(handler=run_check_config)


# ------------------------------------------------------------------ run
def run_daemon(args: argparse.Namespace) -> int:
    """Load the config and serve until SIGTERM/SIGINT."""
    config = load_config(args.config)
    configure_logging(config.log.level, config.log.format)
    command = list(args.engine_command or ())
    if command[:1] == ["--"]:
        command = command[1:]
    return asyncio.run(
        serve(
            config,
            config_path=config.source,
            dry_run=args.dry_run,
            engine_command=command or None,
        )
    )


async def serve(
    config: Config,
    *,
    config_path: str | None,
    dry_run: bool = False,
    engine_command: list[str] | None = None,
) -> int:
    """The daemon, its HTTP API and actuators (and the engine, given its command).

    SIGHUP reloads ``config_path``; SIGTERM/SIGINT stop everything, the engine last.
    """
    notifier = SystemdNotifier.from_environment()
    daemon = Daemon(config, dry_run=dry_run or config.dry_run)
    runners = []
    supervisor = None
    try:
        restart_mode(config, supervised=bool(engine_command))  # a bad mode fails first
        runners.append(await listen(build_app(daemon), config.server.listen))
        if config.proxy.enabled:
            daemon.proxy = make_proxy(config, daemon)
            # handler_cancellation: a client that leaves cancels its handler, which
            # closes the upstream connection, which makes the engine abort the request.
            runners.append(await listen(daemon.proxy.app(), config.proxy.listen, cancel=True))
        if config.webhook.urls:
            daemon.webhooks = make_webhooks(config)
            await daemon.webhooks.start()
        if engine_command:
            supervisor = Supervisor(
                engine_command,
                stop_timeout_s=config.reconfigure.stop_timeout_s,
                backoff_s=config.reconfigure.crash_backoff_s,
                on_event=daemon.notify,
            )
            await supervisor.start()
        attach_actuators(daemon, supervisor=supervisor)
    except KvguardError:
        await _shut_down(daemon, runners, supervisor)
        raise
    watchdog = notifier.watchdog_interval_s
    slowest_tick = config.poll.interval_s + config.poll.timeout_s
    if watchdog is not None and slowest_tick >= watchdog:
        # Pings ride on ticks; a tick slower than the ping interval gets kvguard killed.
        log.warning(
            "watchdog_interval_too_short",
            ping_interval_s=watchdog,
            slowest_tick_s=slowest_tick,
            hint="raise WatchdogSec= or lower poll.interval_s + poll.timeout_s",
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if config_path:
        loop.add_signal_handler(signal.SIGHUP, lambda: _reload(daemon, config_path, notifier))
    started = False

    def after_tick(_: Snapshot) -> None:
        nonlocal started
        if not started:
            started = True
            notifier.ready(f"watching {daemon.config.engine.url}")
            log.info(
                "started",
                listen=config.server.listen,
                proxy=config.proxy.listen if config.proxy.enabled else None,
                engine=config.engine.url,
                dry_run=daemon.dry_run,
            )
        notifier.watchdog()

    try:
        await daemon.run(stop, after_tick=after_tick)
    finally:
        notifier.stopping()
        await _shut_down(daemon, runners, supervisor)
        log.info("stopped")
    return 0


async def _shut_down(
    daemon: Daemon, runners: list[web.AppRunner], supervisor: Supervisor | None
) -> None:
    """Stop in the order that loses nothing: actions (the engine resumed), servers, engine.

    The engine is stopped last and whatever failed before: it must never outlive kvguard.
    """
    try:
        try:
            if daemon.actuators is not None:
                await daemon.actuators.close()
        finally:
            for runner in reversed(runners):
                await runner.cleanup()
            await daemon.close()
            if daemon.webhooks is not None:
                await daemon.webhooks.close()
    finally:
        if supervisor is not None:
            await supervisor.stop()


def make_webhooks(config: Config) -> Webhooks:
    """The webhook sender for ``[webhook]``."""
    hook = config.webhook
    return Webhooks(
        WebhookSettings(
            urls=hook.urls,
            timeout_s=hook.timeout_s,
            retries=hook.retries,
            secret=hook.secret.reveal() if hook.secret is not None else None,
        )
    )


async def listen(app: web.Application, address: str, *, cancel: bool = False) -> web.AppRunner:
    """Serve ``app`` on ``HOST:PORT``; a busy port is one clear error."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=cancel)
    await runner.setup()
    host, _, port = address.rpartition(":")
    try:
        await web.TCPSite(runner, host.strip("[]"), int(port)).start()
    except OSError as exc:
        await runner.cleanup()
        raise KvguardError(f"cannot listen on {address}: {exc.strerror}") from exc
    return runner


def make_proxy(config: Config, daemon: Daemon) -> AdmissionProxy:
    """The admission proxy for ``config``, acting on the daemon's mitigations."""
    proxy = config.proxy
    budget = daemon.state.budget
    settings = ProxySettings(
        upstream=proxy.upstream or config.engine.url,
        listen=proxy.listen,
        priority_header=proxy.priority_header,
        trust_priority_header=proxy.trust_priority_header,
        default_priority=proxy.default_priority,
        api_key_priorities=proxy.api_key_priorities,
        max_body_bytes=proxy.max_body_bytes,
        connect_timeout_s=proxy.connect_timeout_s,
        read_timeout_s=proxy.read_timeout_s,
        upstream_keepalive_s=proxy.upstream_keepalive_s,
        min_completion_tokens=proxy.min_completion_tokens,
        admission=proxy.admission,
        admission_ratio=proxy.admission_ratio,
        admission_wait_s=proxy.admission_wait_s,
        shed_ratio=proxy.shed_ratio,
        shed_wait_s=proxy.shed_wait_s,
        allowed_paths=proxy.allowed_paths,
        blocked_paths=proxy.blocked_paths,
    )
    per_token = budget.budget.kv_bytes_per_token_per_gpu if budget is not None else None
    return AdmissionProxy(settings, daemon.mitigations, bytes_per_token=per_token)


def _reload(daemon: Daemon, path: str, notifier: SystemdNotifier) -> None:
    notifier.reloading()
    try:
        new = load_config(path)
        daemon.reload(new)
        configure_logging(new.log.level, new.log.format)  # [log] applies on reload too
    except KvguardError as exc:
        problems = exc.lines() if isinstance(exc, ConfigError) else [str(exc)]
        log.error(  # noqa: TRY400 - the problems are the message; a traceback would bury them
            "config_reload_rejected", source=path, problems=problems, kept=daemon.config.source
        )
    finally:
        notifier.ready()


# ------------------------------------------------------------------ probe
def run_probe(args: argparse.Namespace) -> int:
    """One tick against --engine-url, printed."""
    configure_logging("error", "auto")
    config = config_for_engine(args.engine_url, args.engine_kind)

    async def once() -> dict[str, Any]:
        daemon = Daemon(config)
        try:
            await daemon.tick()
            return probe_document(daemon)
        finally:
            await daemon.close()

    document = asyncio.run(once())
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(render_probe(document))
    return 0 if document["sources"]["engine"]["ok"] else 1


def probe_document(daemon: Daemon) -> dict[str, Any]:
    """What ``kvguard probe`` reports: the normalized snapshot of one tick."""
    snapshot = daemon.state.snapshot
    assert snapshot is not None  # noqa: S101 - called after a tick
    engine: dict[str, Any] = dict.fromkeys(PROBE_ENGINE_KEYS)
    engine["kind"] = daemon.config.engine.kind if daemon.config.engine.kind != "auto" else None
    engine["up"] = False
    if snapshot.engine is not None:
        engine.update(asdict(snapshot.engine))
    engine["url"] = daemon.config.engine.url
    nvml = daemon.probes.nvml
    return {
        "engine": engine,
        "gpus": [asdict(g) for g in snapshot.gpus] if snapshot.gpus else None,
        "nvml": getattr(nvml, "driver_info", lambda: None)() if nvml is not None else None,
        "host": asdict(snapshot.host) if snapshot.host else None,
        "sources": {name: asdict(r) for name, r in snapshot.sources.items()},
    }


def render_probe(doc: dict[str, Any]) -> str:
    """The probe document as a short table."""
    engine = doc["engine"]
    lines = [f"Engine   {engine['url']}  kind {engine['kind'] or 'unknown'}  up {engine['up']}"]
    lines += [
        f"  {key:<26} {_fmt(engine[key])}" for key in PROBE_ENGINE_KEYS if key not in ("kind", "up")
    ]
    lines += [_gpu_line(gpu) for gpu in doc["gpus"] or []]
    host = doc["host"]
    if host:
        available, total = host["memory_available_bytes"], host["memory_total_bytes"]
        lines.append(f"Host     available {format_bytes(available)} of {format_bytes(total)}")
    lines += [f"Source   {name:<7} {_source_state(s)}" for name, s in doc["sources"].items()]
    return "\n".join(lines)


def _source_state(source: dict[str, Any]) -> str:
    if source["ok"]:
        return "ok"
    if not source.get("available", True):
        return f"unavailable ({source['error']})"
    return f"FAILED: {source['error']}"


def _gpu_line(gpu: dict[str, Any]) -> str:
    used, total = format_bytes(gpu["used_bytes"]), format_bytes(gpu["total_bytes"])
    return f"GPU {gpu['index']}    {gpu['name']}  used {used} of {total}"


def _fmt(value: object) -> str:
    if value is None:
        return "unknown"
    if isinstance(value, dict):
        return ", ".join(
            f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items()
        )
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# ------------------------------------------------------------------ status
STATUS_TIMEOUT_S = 5.0
LEVEL_RANKS = {"ok": 0, "elevated": 1, "high": 2, "critical": 3}


def run_status(args: argparse.Namespace) -> int:
    """Print /status once, or refresh it until interrupted; several URLs: the fleet view."""
    urls: list[str] = list(dict.fromkeys(args.urls or [DEFAULT_STATUS_URL]))
    fleet = len(urls) > 1
    code = 0

    async def main() -> None:
        nonlocal code
        async with aiohttp.ClientSession() as session:
            while True:
                if fleet:
                    rows = await fetch_fleet(session, urls)
                    code = 1 if any(r.error for r in rows) else 0
                    text = (
                        json.dumps([r.as_dict() for r in rows], indent=2)
                        if args.json
                        else render_fleet(rows)
                    )
                else:
                    doc = await fetch_status(session, urls[0])
                    text = json.dumps(doc, indent=2) if args.json else render_status(doc)
                if args.watch:
                    sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")  # home + clear: redraw in place
                    sys.stdout.flush()
                    await asyncio.sleep(args.interval)
                else:
                    print(text)
                    return

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
    return code


async def fetch_status(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    """GET ``base_url``/status; any failure is one :class:`KvguardError` naming the URL."""
    url = base_url.rstrip("/") + "/status"
    try:
        timeout = aiohttp.ClientTimeout(total=STATUS_TIMEOUT_S)
        async with session.get(url, timeout=timeout) as resp:
            resp.raise_for_status()
            data: dict[str, Any] = await resp.json()
            return data
    except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ValueError) as exc:
        raise KvguardError(f"cannot read {url}: {exc or type(exc).__name__}") from exc


@dataclass(frozen=True)
class FleetRow:
    """One kvguard (one engine) of ``kvguard status --url A B …``, as ranked and printed.

    ``time_to_exhaustion_s`` is the sooner of the KV cache's and the GPU memory's
    forecast (``inf``: neither rises; None: no forecast yet); ``headroom_ratio`` the
    smaller of the KV cache's free share and the fullest GPU's free share.
    """

    url: str
    error: str | None = None
    level: str | None = None
    engine_kind: str | None = None
    engine_up: bool = False
    time_to_exhaustion_s: float | None = None
    exhausting: str | None = None  # which resource: kv_cache or gpu_memory
    kv_usage_ratio: float | None = None
    kv_free_tokens: int | None = None
    gpu_free_bytes: int | None = None
    gpu_free_ratio: float | None = None
    gpu_fullest: int | None = None  # NVML index of the GPU with the least free memory

    @property
    def headroom_ratio(self) -> float | None:
        """The tighter of KV cache and fullest GPU, as a free share (None: neither known)."""
        kv_free = None if self.kv_usage_ratio is None else max(0.0, 1.0 - self.kv_usage_ratio)
        known = [r for r in (kv_free, self.gpu_free_ratio) if r is not None]
        return min(known) if known else None

    def rank_key(self) -> tuple[int, int, float, float, str]:
        """The sort key, worst first.

        Unreachable kvguard, then engine down, then higher pressure level, sooner
        exhaustion, less headroom; the URL breaks ties so the order is stable.
        """
        if self.error is not None:
            group = 0  # blind: nothing is known about this engine
        elif not self.engine_up:
            group = 1
        else:
            group = 2
        tte = self.time_to_exhaustion_s
        headroom = self.headroom_ratio
        return (
            group,
            -LEVEL_RANKS.get(self.level or "ok", 0),
            math.inf if tte is None else tte,
            math.inf if headroom is None else headroom,
            self.url,
        )

    def as_dict(self) -> dict[str, Any]:
        """The row as JSON (``--json``); infinity (not rising) is null, as in /status."""
        data = asdict(self)
        tte = self.time_to_exhaustion_s
        data["time_to_exhaustion_s"] = None if tte is None or math.isinf(tte) else tte
        data["rising"] = tte is not None and not math.isinf(tte)
        data["headroom_ratio"] = self.headroom_ratio
        return data


def fleet_row(url: str, doc: dict[str, Any]) -> FleetRow:
    """Reduce one kvguard's /status document to its fleet line."""
    engine = doc.get("engine") or {}
    pressure = doc.get("pressure") or {}
    forecast = pressure.get("forecast") or {}
    tte: float | None = None
    exhausting = None
    if pressure:
        # /status writes +Inf (not rising) as null; a forecast that exists and is null
        # is therefore "not rising", not "unknown".
        candidates = [
            (forecast.get(f"{resource}_time_to_exhaustion_s"), resource)
            for resource in ("kv", "gpu")
        ]
        rising = [(float(v), r) for v, r in candidates if v is not None]
        if rising:
            tte, short = min(rising)
            exhausting = "kv_cache" if short == "kv" else "gpu_memory"
        else:
            tte = math.inf
    usage = engine.get("kv_cache_usage_ratio")
    capacity, used = engine.get("kv_capacity_tokens"), engine.get("kv_used_tokens")
    gpus = [g for g in doc.get("gpus") or [] if g.get("total_bytes")]
    fullest = min(gpus, key=lambda g: g["free_bytes"] / g["total_bytes"]) if gpus else None
    return FleetRow(
        url=url,
        level=pressure.get("level"),
        engine_kind=engine.get("kind"),
        engine_up=bool(engine.get("up")),
        time_to_exhaustion_s=tte,
        exhausting=exhausting,
        kv_usage_ratio=usage,
        kv_free_tokens=capacity - used if capacity is not None and used is not None else None,
        gpu_free_bytes=fullest["free_bytes"] if fullest else None,
        gpu_free_ratio=fullest["free_bytes"] / fullest["total_bytes"] if fullest else None,
        gpu_fullest=fullest["index"] if fullest else None,
    )


async def fetch_fleet(session: aiohttp.ClientSession, urls: list[str]) -> list[FleetRow]:
    """Read every kvguard at once (each bounded by its timeout); rows worst first."""

    async def one(url: str) -> FleetRow:
        try:
            return fleet_row(url, await fetch_status(session, url))
        except KvguardError as exc:
            return FleetRow(url=url, error=str(exc))

    rows = await asyncio.gather(*(one(url) for url in urls))
    return sorted(rows, key=FleetRow.rank_key)


FLEET_HEADER = (
    "KVGUARD",
    "LEVEL",
    "EXHAUSTS IN",
    "KV USED",
    "KV FREE",
    "FULLEST GPU FREE",
    "ENGINE",
)


def render_fleet(rows: list[FleetRow]) -> str:
    """One line per engine under a header, in the order given (worst first)."""
    table = [FLEET_HEADER]
    for row in rows:
        if row.error is not None:
            table.append((row.url, "UNREACHABLE", row.error, "", "", "", ""))
            continue
        tte = row.time_to_exhaustion_s
        if tte is None:
            exhausts = "unknown"
        elif math.isinf(tte):
            exhausts = "not rising"
        else:
            # Rounded down: the operator should read the sooner figure.
            exhausts = f"{math.floor(tte)} s ({row.exhausting})"
        gpu = "no GPU data"
        if row.gpu_free_bytes is not None and row.gpu_free_ratio is not None:
            gpu = (
                f"{format_bytes(row.gpu_free_bytes)} {row.gpu_free_ratio:.1%}"
                f" (GPU {row.gpu_fullest})"
            )
        table.append(
            (
                row.url,
                row.level or "starting",
                exhausts,
                "unknown" if row.kv_usage_ratio is None else f"{row.kv_usage_ratio:.1%}",
                "unknown" if row.kv_free_tokens is None else f"{row.kv_free_tokens:,} tok",
                gpu,
                f"{row.engine_kind or 'unknown'} {'up' if row.engine_up else 'DOWN'}",
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(FLEET_HEADER) - 1)]
    return "\n".join(
        "  ".join(
            [*(cell.ljust(w) for cell, w in zip(line, widths, strict=False)), line[-1]]
        ).rstrip()
        for line in table
    )


def render_status(doc: dict[str, Any]) -> str:
    """The /status document as a terminal view."""
    engine = doc.get("engine") or {}
    tick = doc["tick"]
    lines = [
        f"kvguard {doc['version']}{'  (dry run)' if doc.get('dry_run') else ''}"
        f"  up {doc['uptime_s']:.0f} s  ticks {tick['count']}"
        f"  next in {tick['next_interval_s']:g} s",
        f"Engine   {doc['config']['engine']['url']}  kind {engine.get('kind', 'unknown')}"
        f"  up {engine.get('up', False)}",
    ]
    usage = engine.get("kv_cache_usage_ratio")
    if usage is not None:
        bar = "█" * round(usage * 30)
        lines.append(
            f"KV cache {usage:6.1%} {bar:<30}  used {_fmt(engine.get('kv_used_tokens'))}"
            f" of {_fmt(engine.get('kv_capacity_tokens'))} tokens"
        )
    lines.append(
        f"Requests running {_fmt(engine.get('requests_running'))}"
        f"  waiting {_fmt(engine.get('requests_waiting'))}"
        f"  preemptions {_fmt(engine.get('preemptions_total'))}"
    )
    lines += [_gpu_line(gpu) for gpu in doc.get("gpus") or []]
    budget = doc.get("budget")
    if budget:
        verdict = "fits" if budget["fits"] else "DOES NOT FIT"
        lines.append(
            f"Budget   {budget['kv_capacity_tokens']:,} KV tokens predicted, headroom"
            f" {format_bytes(budget['headroom_bytes_per_gpu'])} per GPU: {verdict}"
        )
    rec = doc.get("reconciliation")
    if rec:
        ratio = rec["difference_ratio"]
        lines.append(
            f"Reconcile engine reports {rec['reported_kv_capacity_tokens']:,} tokens"
            f" ({rec['difference_tokens']:+,}{'' if ratio is None else f', {ratio:+.1%}'})"
        )
    for name, source in (doc.get("sources") or {}).items():
        age = source.get("age_s")
        state = _source_state(source)
        lines.append(f"Source   {name:<7} {state}{'' if age is None else f'  ({age:.1f} s old)'}")
    return "\n".join(lines)


# ------------------------------------------------------------------ check-config
def run_check_config(args: argparse.Namespace) -> int:
    """Validate a config file and the model config it names."""
    config = load_config(args.file)
    try:
        budget_for(config, config.gpu.memory_bytes)
    except KvguardError as exc:
        problem = ("model.config", config.model.config, f"must give a usable budget ({exc})")
        raise ConfigError(config.source, [problem]) from exc
    print(f"{config.source}: OK")
    print(json.dumps(config.redacted(), indent=2))
    return 0


__all__ = [
    "FleetRow",
    "fetch_fleet",
    "fleet_row",
    "register",
    "render_fleet",
    "render_status",
    "serve",
    "status_document",
]
