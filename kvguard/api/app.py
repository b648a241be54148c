"""kvguard's own HTTP API: the application and its routes.

``/metrics``, ``/healthz``, ``/readyz``, ``/status``, ``/admission`` and
``/control/*`` (:mod:`kvguard.api.control`); the /status document itself is
:mod:`kvguard.api.status`. Listens on 127.0.0.1:9108 by default; another address
is the operator's explicit choice and is logged as a warning
(``listen_not_loopback``). Everything here reads the daemon's latest state; nothing
blocks on a probe, and only ``/control/*`` (bearer token required) changes anything,
through the daemon's control methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import structlog
from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from kvguard.actuators.mitigations import request_priority
from kvguard.api.control import Control
from kvguard.api.logs import json_finite, strict_json
from kvguard.api.status import status_document, tick_age_s
from kvguard.api.telemetry import daemon_registry
from kvguard.config.fields import is_loopback
from kvguard.core.policy import LEVELS

if TYPE_CHECKING:
    from kvguard.runtime.daemon import Daemon

log = structlog.get_logger("kvguard.server")
# Typed by annotation: the api layer does not import the loop at run time.
DAEMON_KEY: web.AppKey[Daemon] = web.AppKey("daemon")
CONTROL_KEY = web.AppKey("control", Control)
# /healthz fails when no tick completed for this many poll intervals (plus a timeout).
STALE_TICKS = 3


def build_app(daemon: Daemon) -> web.Application:
    """The aiohttp application of kvguard's API over ``daemon``."""
    app = web.Application()
    app[DAEMON_KEY] = daemon
    control = app[CONTROL_KEY] = Control(daemon)
    warn_if_not_loopback("api", daemon.config.server.listen)
    # prometheus_client's own handler: the text format or OpenMetrics by the Accept
    # header, gzip by Accept-Encoding.
    app.router.add_get("/metrics", make_aiohttp_handler(daemon_registry(daemon)))
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)
    # Envoy's ext_authz appends the client's path to the prefix (/admission/v1/...).
    for path in ("/admission", "/admission/{tail:.*}"):
        app.router.add_route("GET", path, admission)
        app.router.add_route("POST", path, admission)
    for path in ("/control", "/control/{action:.*}"):
        app.router.add_route("*", path, control.handle)
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


async def status(request: web.Request) -> web.Response:
    """GET /status (with the recent control actions)."""
    doc = status_document(request.app[DAEMON_KEY])
    # /status needs no token: where the token lies and who acted stay in the log.
    server = doc["config"]["server"]
    if server.get("control_token_file") is not None:
        server["control_token_file"] = "***"  # noqa: S105 - a mask, not a password
    doc["control"] = json_finite(request.app[CONTROL_KEY].status_section())
    # Strict JSON: a non-finite number that escaped json_finite fails loudly here.
    return web.json_response(doc, dumps=strict_json)


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
