"""kvguard's own HTTP API: /metrics, /healthz, /readyz, /status, /admission, /control/*.

Listens on 127.0.0.1:9108 by default; another address is the operator's explicit
choice and is logged as a warning (``listen_not_loopback``). Everything here reads
the daemon's latest state; nothing blocks on a probe. ``/control/*`` (dry-run,
live, release) needs the bearer token of ``[server] control_token_file`` or
``KVGUARD_CONTROL_TOKEN``, compared in constant time; without one it is off (404).
"""

from __future__ import annotations

import hmac
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvguard.actuators.mitigations import ASYNC_ACTIONS, request_priority
from kvguard.api.budget_report import budget_to_dict
from kvguard.api.telemetry import daemon_registry
from kvguard.config.fields import is_loopback
from kvguard.core.policy import ACTION_KINDS, LEVELS
from kvguard.runtime.daemon import Daemon
from kvguard.runtime.decision import action_dict

log = structlog.get_logger("kvguard.server")
DAEMON_KEY = web.AppKey("daemon", Daemon)
# /healthz fails when no tick completed for this many poll intervals (plus a timeout).
STALE_TICKS = 3
CONTROL_ACTIONS = ("dry-run", "live", "release")
CONTROL_KEPT = 20  # control actions listed in /status
# The mitigations /control/release lifts from the ladder's memory too, so /status
# does not show them as active and the ladder re-applies them if pressure persists.
RELEASED_KINDS = frozenset({"shed", "tighten_window"})
# A refused /control call logs control_denied at most once per caller per this long
# (the rest are counted into the next line), for at most this many callers at once.
DENIED_LOG_INTERVAL_S = 60.0
DENIED_LOG_CALLERS = 1024


@dataclass(frozen=True)
class ControlRecord:
    """One control action, for /status: what, how it went, when, from where."""

    at: float  # wall-clock seconds
    action: str
    result: str  # changed | unchanged
    dry_run: bool
    released: tuple[str, ...]
    remote: str | None


class ControlLog:
    """The recent control actions, newest last (bounded), and refused calls' log pacing."""

    def __init__(self) -> None:
        self.records: deque[ControlRecord] = deque(maxlen=CONTROL_KEPT)
        # remote -> (when its control_denied was last logged, refusals not logged since)
        self.denied: dict[str | None, tuple[float, int]] = {}

    def denied_to_log(self, remote: str | None, now: float) -> int | None:
        """Refusals from ``remote`` not logged before this one, when this one is to be logged.

        None while ``remote`` was logged less than ``DENIED_LOG_INTERVAL_S`` ago (this
        one is counted instead). The table is bounded: the oldest caller goes first.
        """
        last = self.denied.pop(remote, None)
        if last is not None and now - last[0] < DENIED_LOG_INTERVAL_S:
            self.denied[remote] = (last[0], last[1] + 1)
            return None
        while len(self.denied) >= DENIED_LOG_CALLERS:
            del self.denied[next(iter(self.denied))]
        self.denied[remote] = (now, 0)
        return 0 if last is None else last[1]


CONTROL_LOG_KEY = web.AppKey("control_log", ControlLog)


def build_app(daemon: Daemon) -> web.Application:
    """The aiohttp application of kvguard's API over ``daemon``."""
    app = web.Application()
    app[DAEMON_KEY] = daemon
    app[CONTROL_LOG_KEY] = ControlLog()
    registry = daemon_registry(daemon)
    warn_if_not_loopback("api", daemon.config.server.listen)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)
    # Envoy's ext_authz appends the client's path to the prefix (/admission/v1/...).
    for path in ("/admission", "/admission/{tail:.*}"):
        app.router.add_route("GET", path, admission)
        app.router.add_route("POST", path, admission)
    for path in ("/control", "/control/{action:.*}"):
        app.router.add_route("*", path, control)
    return app


def warn_if_not_loopback(server: str, listen: str) -> None:
    """Log ``listen_not_loopback`` when ``listen`` is reachable from other machines."""
    host = listen.rpartition(":")[0]
    if not is_loopback(host):
        log.warning(
            "listen_not_loopback",
            server=server,
            listen=listen,
            hint="reachable from other machines: restrict it with a firewall or network"
            " policy (docs/security.md)",
        )


def tick_age_s(daemon: Daemon) -> float | None:
    """Seconds since the last completed tick; None before the first."""
    last = daemon.state.last_tick_at
    return None if last is None else daemon.clock() - last


async def healthz(request: web.Request) -> web.Response:
    """200 while the loop is alive and ticking; 503 when it stalled."""
    daemon = request.app[DAEMON_KEY]
    age = tick_age_s(daemon)
    poll = daemon.config.poll
    limit = STALE_TICKS * poll.interval_s + poll.timeout_s
    if age is None or age > limit:
        reason = "no tick yet" if age is None else f"last tick {age:.1f} s ago (limit {limit:g} s)"
        return web.json_response({"status": "stalled", "reason": reason}, status=503)
    return web.json_response({"status": "ok", "last_tick_age_s": round(age, 3)})


async def readyz(request: web.Request) -> web.Response:
    """200 while the engine answers and reports itself healthy; 503 otherwise."""
    daemon = request.app[DAEMON_KEY]
    snapshot = daemon.state.snapshot
    source = snapshot.sources.get("engine") if snapshot else None
    if snapshot is None or source is None:
        return web.json_response({"status": "not ready", "reason": "no tick yet"}, status=503)
    mitigations = daemon.mitigations
    if mitigations.draining and mitigations.enforcing:
        # The proxy refuses every generation request until the restart is done.
        return web.json_response(
            {
                "status": "not ready",
                "reason": "draining for a restart (the fp8 KV switch): route new traffic elsewhere",
            },
            status=503,
        )
    if not source.ok:
        return web.json_response(
            {"status": "not ready", "reason": f"engine unreachable: {source.error}"}, status=503
        )
    if snapshot.engine is None or not snapshot.engine.up:
        return web.json_response(
            {"status": "not ready", "reason": "engine reports unhealthy"}, status=503
        )
    shedding = _shedding_at_readiness_level(daemon)
    if shedding:
        return web.json_response({"status": "not ready", "reason": shedding}, status=503)
    return web.json_response({"status": "ready"})


def _shedding_at_readiness_level(daemon: Daemon) -> str | None:
    """Why readiness fails for load shedding, or None: shedding at the configured level."""
    mitigations, at = daemon.mitigations, daemon.config.proxy.fail_readiness_at
    if at == "never" or not mitigations.enforcing or mitigations.shed_floor is None:
        return None
    if LEVELS.index(mitigations.level) < LEVELS.index(at):
        return None
    return f"shedding at {mitigations.level}: route new traffic elsewhere"


async def admission(request: web.Request) -> web.Response:
    """GET|POST /admission: 200 to admit, 429 + Retry-After to deny, for the request's priority.

    For gateways that enforce kvguard's decisions themselves (Envoy ext_authz,
    nginx auth_request): the priority comes from the same header or API-key map
    as the proxy's.
    """
    daemon = request.app[DAEMON_KEY]
    priority = priority_of(daemon, request.headers)
    mitigations = daemon.mitigations
    headers = {"X-Kvguard-Priority": priority, "X-Kvguard-Level": mitigations.level}
    if mitigations.sheds(priority):
        headers["Retry-After"] = str(mitigations.retry_after_s)
        return web.json_response(
            {"allowed": False, "priority": priority, "level": mitigations.level},
            status=429,
            headers=headers,
        )
    return web.json_response(
        {"allowed": True, "priority": priority, "level": mitigations.level}, headers=headers
    )


def priority_of(daemon: Daemon, headers: Mapping[str, str]) -> str:
    """A request's priority class, by the proxy's rules (API-key map, header, default)."""
    proxy = daemon.config.proxy
    return request_priority(
        headers,
        proxy.priority_header,
        proxy.api_key_priorities,
        proxy.default_priority,
        trust_header=proxy.trust_priority_header,
    )


def status_document(daemon: Daemon) -> dict[str, Any]:
    """The /status JSON: config (redacted), budget, latest snapshot, staleness, reconciliation."""
    state = daemon.state
    snapshot = state.snapshot
    budget = None
    if state.budget is not None:
        model = daemon.config.model.config or ""
        gpu = "configured" if daemon.config.gpu.memory_bytes else "from NVML or default"
        budget = budget_to_dict(state.budget, model, gpu)
    rec = state.reconciliation
    return {
        "version": daemon.version,
        "dry_run": daemon.dry_run,
        "uptime_s": round(daemon.clock() - state.started_at, 3),
        "config": daemon.config.redacted(),
        "tick": {
            "count": state.ticks_total,
            "last_age_s": tick_age_s(daemon),
            "duration_s": state.tick_duration_s,
            "next_interval_s": daemon.next_interval(),
        },
        "sources": {
            name: asdict(reading)
            for name, reading in (snapshot.sources if snapshot else {}).items()
        },
        "engine": _engine(daemon),
        "gpus": [asdict(g) for g in snapshot.gpus] if snapshot and snapshot.gpus else None,
        "host": asdict(snapshot.host) if snapshot and snapshot.host else None,
        "budget": budget,
        "budget_error": state.budget_error,
        "pressure": _pressure(daemon),
        "mitigations": _mitigations(daemon),
        "proxy": _proxy(daemon),
        "actions": _actions(daemon),
        "reconciliation": None
        if rec is None
        else {
            "predicted_kv_capacity_tokens": rec.predicted_tokens,
            "reported_kv_capacity_tokens": rec.reported_tokens,
            "difference_tokens": rec.difference_tokens,
            "difference_ratio": rec.difference_ratio,
        },
    }


def _pressure(daemon: Daemon) -> dict[str, Any] | None:
    brain = daemon.brain
    decision, fc, pattern = brain.decision, brain.forecast, brain.pattern
    if decision is None or fc is None or pattern is None:
        return None
    return {
        "mode": brain.mode,
        "level": decision.level,
        "level_for_s": round(decision.t - decision.state.level_since, 3),
        "crossed": list(decision.crossed),
        "deferred": list(decision.deferred),
        "pattern": pattern.pattern,
        "pattern_confidence": pattern.confidence,
        "pattern_features": dict(pattern.features),
        "forecast": {
            "kv_level_tokens": fc.kv.level,
            "kv_capacity_tokens": fc.kv.capacity,
            "kv_slope_tokens_per_s": fc.kv.slope_per_s,
            "kv_time_to_exhaustion_s": _finite(fc.kv.time_to_exhaustion_s),
            "kv_projected_tokens": {f"{h:g}": v for h, v in fc.kv.projected.items()},
            "gpu_time_to_exhaustion_s": _finite(fc.gpu.time_to_exhaustion_s),
            "queue_demand_tokens": fc.queue_demand_tokens,
            "prompt_fill_per_s": fc.prompt_fill_per_s,
            "generation_fill_per_s": fc.generation_fill_per_s,
            "drain_per_s": fc.drain_per_s,
            "preemptions_per_s": fc.preemptions_per_s,
        },
        "active": [action_dict(a) for a in decision.state.active.values()],
        "decisions": [record.as_dict() for record in reversed(brain.decisions)],
    }


def _actions(daemon: Daemon) -> dict[str, Any] | None:
    """The asynchronous actuators: what this engine can do, and how it went."""
    actuators = daemon.actuators
    if actuators is None:
        return None
    reconfigurer, supervisor = actuators.reconfigurer, daemon.supervisor
    return {
        "engine_kind": actuators.kind,
        "unavailable": dict(daemon.brain.unavailable),
        "engine_paused": actuators.paused,
        "results": [
            {"action": a, "result": r, "count": n}
            for (a, r), n in sorted(actuators.results.items())
        ],
        "reconfigure": None
        if reconfigurer is None
        else {
            "mode": actuators.mode,
            "restarter": reconfigurer.restarter.description,
            "fp8": reconfigurer.fp8,
            "busy": reconfigurer.busy,
            "last_drain_s": reconfigurer.last_drain_s,
        },
        # The engine's argv can hold secrets (--api-key): only the program is shown.
        "supervisor": None
        if supervisor is None
        else {
            "program": supervisor.argv[0],
            "pid": supervisor.pid,
            "restarts": dict(supervisor.restarts),
            "ooms": supervisor.ooms,
            "last_exit_code": supervisor.last_exit_code,
        },
        "webhooks": None if daemon.webhooks is None else dict(daemon.webhooks.counters),
    }


def _proxy(daemon: Daemon) -> dict[str, Any] | None:
    proxy = daemon.proxy
    if proxy is None:
        return None
    # The current budget's (it follows an fp8 switch and reloads), else what the proxy had.
    budget = daemon.state.budget
    per_token = (
        budget.budget.kv_bytes_per_token_per_gpu if budget is not None else proxy.bytes_per_token
    )
    return {
        "listen": proxy.settings.listen,
        "upstream": proxy.settings.upstream,
        "inflight_requests": len(proxy.inflight),
        "waiting_requests": proxy.waiting,
        "inflight_kv_tokens": proxy.inflight.total_tokens,
        # Ids and sizes only: prompt text never leaves the request path.
        "top_inflight": [
            {
                "request_id": r.request_id,
                "priority": r.priority,
                "prompt_tokens": r.prompt_tokens,
                "generated_tokens": r.generated,
                "kv_tokens": r.footprint_tokens,
                "projected_kv_tokens": r.projected_tokens,
                "kv_bytes": r.footprint_tokens * per_token if per_token else None,
            }
            for r in proxy.inflight.top(10)
        ],
    }


def _finite(value: float) -> float | None:
    """JSON has no infinity: +Inf ("not rising") is null."""
    return None if math.isinf(value) else value


def _engine(daemon: Daemon) -> dict[str, Any] | None:
    snapshot = daemon.state.snapshot
    if snapshot is None or snapshot.engine is None:
        return None
    data = asdict(snapshot.engine)
    probe = daemon.probes.engine
    data["actions"] = sorted(getattr(probe, "actions", ()) or ())
    return data


async def status(request: web.Request) -> web.Response:
    """GET /status (with the recent control actions)."""
    daemon = request.app[DAEMON_KEY]
    doc = status_document(daemon)
    # /status needs no token: where the token lies and who acted stay in the log.
    server = doc["config"]["server"]
    if server.get("control_token_file") is not None:
        server["control_token_file"] = "***"  # noqa: S105 - a mask, not a password
    recent = list(request.app[CONTROL_LOG_KEY].records)
    doc["control"] = {
        "enabled": daemon.config.server.control_token is not None,
        "actions": [  # newest first
            {k: v for k, v in asdict(r).items() if k != "remote"} for r in recent[::-1]
        ],
    }
    return web.json_response(doc)


# ---------------------------------------------------------------------- /control/*
def _control_error(
    status: int, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


async def control(request: web.Request) -> web.Response:
    """``POST /control/{dry-run,live,release}``: an operator's override, bearer token required.

    Order matters: without a token configured everything here is 404; then the token
    is checked before anything else is said (which actions exist, which methods), so
    a caller without it learns nothing.
    """
    daemon = request.app[DAEMON_KEY]
    token = daemon.config.server.control_token
    if token is None:
        return _control_error(
            404,
            "control endpoints are off: set [server] control_token_file or"
            " KVGUARD_CONTROL_TOKEN to enable them",
        )
    denied = _check_token(request, token.reveal())
    if denied is not None:
        return denied
    action = request.match_info.get("action", "")
    if action not in CONTROL_ACTIONS:
        return _control_error(
            404, f"unknown control action {action!r}: known are {', '.join(CONTROL_ACTIONS)}"
        )
    if request.method != "POST":
        return _control_error(
            405, f"/control/{action} takes POST, not {request.method}", {"Allow": "POST"}
        )
    return _act(request, daemon, action)


def _check_token(request: web.Request, expected: str) -> web.Response | None:
    """None when the request carries the bearer token; else the 401 or 403 to answer."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    given = given.strip()
    if scheme.lower() != "bearer" or not given:
        _denied(request, "no bearer token")
        return _control_error(
            401,
            "a bearer token is required: Authorization: Bearer <token>",
            {"WWW-Authenticate": 'Bearer realm="kvguard"'},
        )
    # Bytes, so any header text compares (a str with non-ASCII raises TypeError), and
    # compare_digest so the time taken says nothing about how much of it matched.
    if not hmac.compare_digest(
        given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass")
    ):
        _denied(request, "wrong token")
        return _control_error(403, "the bearer token is not the control token")
    return None


def _denied(request: web.Request, reason: str) -> None:
    # Once per caller per DENIED_LOG_INTERVAL_S: anyone who reaches the port could
    # otherwise flood the log. Never the token given: a near miss is most of a secret.
    daemon = request.app[DAEMON_KEY]
    suppressed = request.app[CONTROL_LOG_KEY].denied_to_log(request.remote, daemon.clock())
    if suppressed is not None:
        log.warning(
            "control_denied",
            reason=reason,
            path=request.path,
            remote=request.remote,
            suppressed=suppressed,
        )


def _act(request: web.Request, daemon: Daemon, action: str) -> web.Response:
    reason = f"operator: /control/{action}"
    released: list[str] = []
    if action == "release":
        released = daemon.mitigations.release_all(reason)
        guard = daemon.brain.guard
        daemon.brain.guard = replace(
            guard, active={k: v for k, v in guard.active.items() if k not in RELEASED_KINDS}
        )
        changed = bool(released)
    else:
        busy = _switch_in_progress(daemon)
        if busy is not None:
            log.warning("control_refused", action=action, reason=busy, remote=request.remote)
            return _control_error(409, f"/control/{action} refused, nothing changed: {busy}")
        dry_run = action == "dry-run"
        changed = daemon.dry_run != dry_run
        daemon.mitigations.set_enforcing(not dry_run, reason)
        daemon.dry_run = daemon.brain.dry_run = dry_run
        if changed:
            _forget_unreal_actions(daemon)
            daemon.brain.dry_run_since = daemon.clock() if dry_run else None
        # Every (action, mode) series from 0 for the new mode: one that appears at its
        # first increment is one increase() cannot see.
        modes = ("dry_run",) if dry_run else ("applied", "started", "not_applied")
        for kind in ACTION_KINDS:
            for mode in modes:
                daemon.brain.counts[(kind, mode)] += 0
    if daemon.proxy is not None:
        daemon.proxy.wake()  # requests held for room re-check against what is in force
    record = ControlRecord(
        at=daemon.wall_clock(),
        action=action,
        result="changed" if changed else "unchanged",
        dry_run=daemon.dry_run,
        released=tuple(released),
        remote=request.remote,
    )
    request.app[CONTROL_LOG_KEY].records.append(record)
    fields = {
        "action": action,
        "result": record.result,
        "dry_run": daemon.dry_run,
        "released": list(released),
        "remote": request.remote,
    }
    log.warning("control_action", **fields)
    daemon.notify("control_action", fields)
    return web.json_response({**fields, "mitigations": _mitigations(daemon)})


def _switch_in_progress(daemon: Daemon) -> str | None:
    """Why the mode must not change now (the fp8 switch is under way), or None."""
    actuators = daemon.actuators
    reconfigurer = actuators.reconfigurer if actuators is not None else None
    if daemon.mitigations.draining or (reconfigurer is not None and reconfigurer.busy):
        return (
            "the fp8 KV switch is draining or restarting the engine; retry when it is done"
            " (/status -> actions.reconfigure.busy)"
        )
    return None


def _forget_unreal_actions(daemon: Daemon) -> None:
    """Align the ladder's memory with what the actuators really did, at a mode switch.

    In dry-run the ladder records ``kv_fp8`` (and marks fp8 on) and the other
    asynchronous actions without any of them running; kept, they would make the
    first live ticks revert a switch that never happened. The engine's KV cache is
    what the reconfigurer says (off without one), and no asynchronous action is in
    force: the ladder decides them afresh. Going live, the cooldowns and the restart
    budget those unreal actions used since dry-run began are given back too: a first
    real switch must not wait out the cooldown of one that never ran.
    """
    actuators = daemon.actuators
    reconfigurer = actuators.reconfigurer if actuators is not None else None
    brain = daemon.brain
    brain.fp8_result(fp8_on=reconfigurer is not None and reconfigurer.fp8)
    guard = brain.guard
    active = {k: v for k, v in guard.active.items() if k not in ASYNC_ACTIONS}
    if brain.dry_run:
        brain.guard = replace(guard, active=active)
        return
    since = brain.dry_run_since if brain.dry_run_since is not None else -math.inf
    brain.guard = replace(
        guard,
        active=active,
        last_action_at={
            kind: at
            for kind, at in guard.last_action_at.items()
            if kind not in ASYNC_ACTIONS or at < since
        },
        restarts=tuple(at for at in guard.restarts if at < since),
    )


def _mitigations(daemon: Daemon) -> dict[str, Any]:
    m = daemon.mitigations
    return {
        "enforcing": m.enforcing,
        "shed_floor": m.shed_floor,
        "max_prompt_tokens": m.max_prompt_tokens,
        "max_tokens": m.max_tokens,
        "retry_after_s": m.retry_after_s,
    }
