"""``kvguard status``: a running kvguard's /status, one or a fleet, once or live."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from kvguard.cli import probe
from kvguard.cli.probe import (
    DefaultConfigError,
    config_path,
    fmt_value,
    gpu_line,
    normalize_url,
    read_chosen,
    source_state,
)
from kvguard.config.fields import listen
from kvguard.config.settings import CONFIG_ENV, ServerConfig, read_tables
from kvguard.core.bars import text_bar
from kvguard.core.units import format_bytes
from kvguard.errors import ConfigError, InvalidInputError, KvguardError
from kvguard.http_client import describe_client_error

DEFAULT_STATUS_URL = "http://127.0.0.1:9108"


def register(commands: argparse._SubParsersAction[Any]) -> None:
    """Add ``kvguard status``."""
    status = commands.add_parser(
        "status",
        help="show a running kvguard's /status (live with --watch)",
        description="Read /status from a running kvguard and show it; from several, one line"
        " per engine, worst first, each followed by its binding resource, pattern, active"
        " mitigations and last decision. Exit 0: read; 1: a kvguard could not be read, or"
        f" the config (--config, $KVGUARD_CONFIG, else {probe.DEFAULT_CONFIG_PATH}) is"
        " unreadable or invalid; 2: usage.",
    )
    status.add_argument(
        "--url",
        dest="urls",
        nargs="+",
        action="extend",
        metavar="URL",
        help="kvguard's address: http(s)://HOST:PORT, or HOST:PORT (http assumed); another"
        " scheme, or a host without scheme and port, is a usage error (default: [server]"
        f" listen of the config, else {DEFAULT_STATUS_URL}); several (--url A B, or --url"
        " repeated): one line per engine, worst first",
    )
    status.add_argument(
        "--config",
        metavar="FILE",
        help="read kvguard's address from this config's [server] listen (default:"
        f" $KVGUARD_CONFIG when set, else {probe.DEFAULT_CONFIG_PATH} when it exists;"
        " not read with --url)",
    )
    status.add_argument("--watch", action="store_true", help="refresh until interrupted")
    status.add_argument(
        "--interval",
        type=refresh_period,
        default=1.0,
        metavar="S",
        help=f"refresh period with --watch, over 0 and at most {MAX_INTERVAL_S:g} s (default 1 s)",
    )
    status.add_argument(
        "--json",
        action="store_true",
        help="print the raw /status JSON (several URLs: a list of rows, one per engine)",
    )
    status.set_defaults(handler=run_status)


STATUS_TIMEOUT_S = 5.0
MAX_INTERVAL_S = 3600.0


def refresh_period(text: str) -> float:
    """``--interval``: seconds over 0 (0 would redraw as fast as /status answers)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_INTERVAL_S:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds over 0 and at most {MAX_INTERVAL_S:g}, not {text!r}"
        )
    return seconds


LEVEL_RANKS = {"ok": 0, "elevated": 1, "high": 2, "critical": 3}


def run_status(args: argparse.Namespace) -> int:
    """Print /status once, or refresh it until interrupted; several URLs: the fleet view.

    Exit 0 when every kvguard was read, 1 when one could not be (unreachable, or not a
    kvguard), 2 for a usage error. ``--watch`` keeps going through failed reads (a
    kvguard restarting), saying since when it is unreachable.
    """
    try:
        given = args.urls or [_own_url(args)]
    except DefaultConfigError as exc:
        return exc.report("status", f"give --url, --config or ${CONFIG_ENV}")
    urls: list[str] = list(dict.fromkeys(normalize_url(u) for u in given))
    fleet = len(urls) > 1
    code = 0
    unreachable_since: float | None = None
    down_since: dict[str, float] = {}  # fleet rows: URL -> since when unreachable

    async def main() -> None:
        nonlocal code, unreachable_since
        async with aiohttp.ClientSession() as session:
            while True:
                if fleet:
                    rows = await fetch_fleet(session, urls)
                    code = 1 if any(r.error for r in rows) else 0
                    now = time.time()
                    for row in rows:
                        if row.error is None:
                            down_since.pop(row.url, None)
                        else:
                            down_since.setdefault(row.url, now)
                    text = (
                        json.dumps([r.as_dict() for r in rows], indent=2)
                        if args.json
                        else render_fleet(rows, down_since if args.watch else None)
                    )
                else:
                    try:
                        doc = await fetch_status(session, urls[0])
                    except KvguardError as exc:
                        code = 1
                        if not args.watch:
                            print(f"kvguard status: {exc}", file=sys.stderr)
                            return
                        now = time.time()
                        unreachable_since = unreachable_since or now
                        since = time.strftime("%H:%M:%S", time.localtime(unreachable_since))
                        text = f"{urls[0]}: unreachable since {since} ({exc})"
                    else:
                        code, unreachable_since = 0, None
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


def _own_url(args: argparse.Namespace) -> str:
    """Where this host's kvguard listens: the config's [server] listen, else the default.

    The config is --config, else $KVGUARD_CONFIG, else ``DEFAULT_CONFIG_PATH`` when it
    exists (:func:`~kvguard.cli.probe.config_path`); a broken default file is a
    :class:`DefaultConfigError`.
    """
    path, default = config_path(args.config)
    if path is None:
        return DEFAULT_STATUS_URL
    server = read_chosen(path, default, server_of)
    # A wildcard address listens on loopback too; a literal IPv6 needs its brackets.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(server.host, server.host)  # noqa: S104
    return f"http://{f'[{host}]' if ':' in host else host}:{server.port}"


def server_of(path: str) -> ServerConfig:
    """The config file's [server] listen, and nothing else of it.

    Only the address is needed: the rest is not validated and no secret file is read
    (under systemd the engine's token is a credential only the service can read).
    :class:`ConfigError` when the file is unreadable, not TOML, or its listen invalid.
    """
    server = read_tables(path).get("server", {})
    if not isinstance(server, dict):
        raise ConfigError(path, [("server", server, "must be a table ([section])")])
    address = server.get("listen", ServerConfig.listen)
    try:
        listen("server.listen", address)
    except InvalidInputError as exc:
        raise ConfigError(path, [(exc.field, exc.value, exc.allowed)]) from exc
    return ServerConfig(listen=address)


async def fetch_status(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    """GET ``base_url``/status; any failure is one :class:`KvguardError` naming the URL."""
    url = normalize_url(base_url) + "/status"
    try:
        timeout = aiohttp.ClientTimeout(total=STATUS_TIMEOUT_S)
        async with session.get(url, timeout=timeout) as resp:
            resp.raise_for_status()
            data: dict[str, Any] = await resp.json()
            return data
    except aiohttp.ClientConnectorError as exc:
        raise KvguardError(f"cannot read {url}: {describe_client_error(exc)}") from exc
    except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ValueError) as exc:
        raise KvguardError(f"cannot read {url}: {exc or type(exc).__name__}") from exc


@dataclass(frozen=True)
class FleetRow:
    """One kvguard (one engine) of ``kvguard status --url A B …``, as ranked and printed.

    ``time_to_exhaustion_s`` is the sooner of the KV cache's and the GPU memory's
    forecast (``inf``: neither rises; None: no forecast yet); ``headroom_ratio`` the
    smaller of the KV cache's free share and the fullest GPU's free share. ``binding``
    (``pressure.binding_resource``) and ``pattern`` are None while the engine is not
    read; ``active`` holds the mitigations in force and ``last_decision`` the last
    decision with its reasons, as the single view's Active and Last lines say them.
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
    binding: str | None = None  # what limits the engine: kv_cache, compute or none
    pattern: str | None = None  # the traffic pattern
    active: tuple[str, ...] = ()  # the mitigations in force, e.g. "shed priority=sheddable"
    last_decision: str | None = None  # "elevated -> high: <crossed>; <reasons>"

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
    measured = bool(pressure) and engine_unread(doc) is None
    if measured:  # no forecast, binding or pattern without the engine's figures
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
        binding=(pressure.get("binding_resource") or "unknown") if measured else None,
        pattern=pressure.get("pattern", "unknown") if measured else None,
        active=tuple(_action_text(a) for a in pressure.get("active") or []),
        last_decision=last_decision_text(pressure),
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


def exhausts_in(tte: float | None, rising: str) -> str:
    """When a resource runs out, in words: ``rising`` holds ``{}`` for the seconds."""
    if tte is None:
        return "unknown"
    if math.isinf(tte):
        return "not rising"
    return rising.format(math.floor(tte))  # rounded down: read the sooner figure


FLEET_WIDTH = 120  # a detail line longer than this is cut (the whole is in --json)
FLEET_INDENT = "    "


def fleet_details(row: FleetRow) -> list[str]:
    """The indented lines under a reachable engine's row: what binds, why, what is done.

    ``binding B  pattern P  active A``, then ``last <decision>`` when there was one;
    nothing for a kvguard that has not decided yet.
    """
    if row.level is None and not row.active and row.last_decision is None:
        return []
    active = ", ".join(row.active) if row.active else "none"
    lines = [
        f"{FLEET_INDENT}binding {row.binding or 'unknown'}  pattern {row.pattern or 'unknown'}"
        f"  active {active}"
    ]
    if row.last_decision is not None:
        lines.append(f"{FLEET_INDENT}last {row.last_decision}")
    return [
        line if len(line) <= FLEET_WIDTH else line[: FLEET_WIDTH - 1] + "\u2026" for line in lines
    ]


FLEET_ERROR_WIDTH = 60  # an unreachable row's error is cut here (the whole is in --json)


def render_fleet(rows: list[FleetRow], down_since: dict[str, float] | None = None) -> str:
    """One line per engine under a header, in the order given (worst first).

    Under each reachable engine's line, indented: binding resource, traffic pattern,
    active mitigations, and the last decision with its reasons (:func:`fleet_details`).
    An unreachable engine's line says why, cut to :data:`FLEET_ERROR_WIDTH` (a long
    error would widen the column for every row), and with ``down_since`` (URL -> epoch
    seconds, as ``--watch`` keeps it) since when this watch has seen it unreachable.
    """
    table: list[tuple[str, ...]] = [FLEET_HEADER]
    details: list[list[str]] = [[]]
    for row in rows:
        if row.error is not None:
            error = row.error
            if len(error) > FLEET_ERROR_WIDTH:
                error = error[: FLEET_ERROR_WIDTH - 1] + "\u2026"
            since = (down_since or {}).get(row.url)
            if since is not None:  # when this watch first found it down, not when it went
                error = f"seen since {time.strftime('%H:%M:%S', time.localtime(since))}: {error}"
            table.append((row.url, "UNREACHABLE", error, "", "", "", ""))
            details.append([])
            continue
        details.append(fleet_details(row))
        exhausts = exhausts_in(row.time_to_exhaustion_s, f"{{}} s ({row.exhausting})")
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
    out: list[str] = []
    for line, below in zip(table, details, strict=True):
        cells = [*(cell.ljust(w) for cell, w in zip(line, widths, strict=False)), line[-1]]
        out.append("  ".join(cells).rstrip())
        out += below
    return "\n".join(out)


def render_status(doc: dict[str, Any]) -> str:
    """The /status document as a terminal view."""
    engine = doc.get("engine") or {}
    tick = doc["tick"]
    lines = [
        f"kvguard {doc['version']}{'  (dry run)' if doc.get('dry_run') else ''}"
        f"  up {doc['uptime_s']:.0f} s  ticks {tick['count']}"
        f"  next in {tick['next_interval_s']:g} s",
        f"Engine   {doc['config']['engine']['url']}"
        f"  kind {engine.get('kind') or doc['config']['engine'].get('kind') or 'unknown'}"
        f"  up {engine.get('up', False)}",
    ]
    usage = engine.get("kv_cache_usage_ratio")
    if usage is not None:
        bar = text_bar(usage, 30)
        lines.append(
            f"KV cache {usage:6.1%} {bar:<30}  "
            f"{'reserved' if engine.get('kv_used_is_reserved') else 'used'}"
            f" {fmt_value(engine.get('kv_used_tokens'))}"
            f" of {fmt_value(engine.get('kv_capacity_tokens'))} tokens"
        )
    lines.append(
        f"Requests running {fmt_value(engine.get('requests_running'))}"
        f"  waiting {fmt_value(engine.get('requests_waiting'))}"
        f"  preemptions {fmt_value(engine.get('preemptions_total'))}"
    )
    lines += [gpu_line(gpu) for gpu in doc.get("gpus") or []]
    lines += pressure_lines(doc)
    lines += shed_lines(doc.get("proxy"))
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
        state = source_state(source)
        lines.append(f"Source   {name:<7} {state}{'' if age is None else f'  ({age:.1f} s old)'}")
    return "\n".join(lines)


def pressure_lines(doc: dict[str, Any]) -> list[str]:
    """Level, binding resource, what exhausts first, pattern, mitigations, last decision.

    ``binding`` is /status's ``pressure.binding_resource`` (what limits the engine now:
    kv_cache, compute or none); ``exhausts first`` the resource the forecast sees
    running out soonest, and when — a cache can fill while compute binds.
    """
    pressure = doc.get("pressure")
    if not pressure:
        return ["Pressure (no decision yet)"]
    dry = "  (dry run: decides, acts on nothing)" if pressure.get("mode") == "dry_run" else ""
    unread = engine_unread(doc)
    if unread is not None:
        # Without the engine's figures the level is no measurement: say so first, and
        # what kvguard holds meanwhile, rather than "ok … not rising … steady".
        lines = [
            f"Pressure UNKNOWN: {unread}; kvguard's level is {pressure['level']}"
            f" for {pressure.get('level_for_s', 0):.0f} s (with nothing read it steps"
            f" down one level per hold time){dry}"
        ]
    else:
        row = fleet_row("", doc)
        exhausts = exhausts_in(row.time_to_exhaustion_s, f"{row.exhausting} in {{}} s")
        if row.time_to_exhaustion_s is not None and math.isinf(row.time_to_exhaustion_s):
            exhausts = "nothing (not rising)"
        lines = [
            f"Pressure {pressure['level']} for {pressure.get('level_for_s', 0):.0f} s"
            f"  binding {pressure.get('binding_resource') or 'unknown'}"
            f"  exhausts first {exhausts}"
            f"  pattern {pressure.get('pattern', 'unknown')}{dry}",
        ]
    active = pressure.get("active") or []
    lines.append(
        "Active   "
        + (", ".join(_action_text(a) for a in active) if active else "no mitigation in force")
    )
    last = last_decision_text(pressure)
    if last is not None:
        lines.append(f"Last     {last}")
    return lines


def shed_lines(proxy: dict[str, Any] | None) -> list[str]:
    """What the admission proxy refused with 503 since kvguard started, and the last one's why.

    Admission sheds what the pool cannot hold at any level, with no mitigation in
    force: without these lines an operator would see 503s and "no mitigation".
    """
    if not proxy or "requests_shed" not in proxy:
        return []
    shed = proxy["requests_shed"]
    if not shed.get("total"):
        return ["Shed     none since start"]
    reasons = ", ".join(f"{r} {n:,}" for r, n in (shed.get("by_reason") or {}).items())
    classes = ", ".join(f"{c} {n:,}" for c, n in (shed.get("by_priority") or {}).items())
    lines = [f"Shed     {shed['total']:,} since start (by reason: {reasons}; by class: {classes})"]
    last = proxy.get("last_shed")
    if last:
        lines.append(
            f"         last {last['age_s']:.0f} s ago, {last['priority']} ({last['reason']}):"
            f" {last['detail']}"
        )
    return lines


def last_decision_text(pressure: dict[str, Any]) -> str | None:
    """The last decision in words: ``previous -> level: crossed; reasons`` (None: none yet)."""
    decisions = pressure.get("decisions") or []
    if not decisions:
        return None
    last = decisions[0]
    reasons = "; ".join(str(a.get("reason", a.get("kind"))) for a in last.get("actions") or [])
    # Each threshold is named with its level ("elevated: kv_usage …"): where that is the
    # level decided, the line already says it ("ok -> elevated: kv_usage …").
    prefix = f"{last.get('level')}: "
    crossed = (
        ", ".join(c.removeprefix(prefix) for c in last.get("crossed") or []) or "nothing crossed"
    )
    return f"{last.get('previous_level')} -> {last.get('level')}: {crossed}" + (
        f"; {reasons}" if reasons else ""
    )


def engine_unread(doc: dict[str, Any]) -> str | None:
    """Why the engine's figures are missing ("the engine has not answered since …"), or None.

    None when the last read of the engine succeeded (or /status names no engine source).
    """
    source = (doc.get("sources") or {}).get("engine")
    if not source or source.get("ok", True):
        return None
    age = source.get("age_s")
    if age is None:
        return "the engine has not been read since kvguard started"
    return f"the engine's last good read is {age:.0f} s old"


def _action_text(action: dict[str, Any]) -> str:
    text = str(action.get("kind"))
    for key in ("priority", "max_prompt_tokens", "max_tokens", "target"):
        if action.get(key) is not None:
            text += f" {key}={action[key]}"
    return text
