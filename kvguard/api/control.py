"""The operator's overrides over HTTP: ``POST /control/{dry-run,live,release}``.

Off (404) unless ``[server] control_token_file`` or ``KVGUARD_CONTROL_TOKEN`` gives
a bearer token, which every call must carry (compared in constant time). An action
changes the daemon only through its control methods (:meth:`Daemon.set_dry_run
<kvguard.runtime.daemon.Daemon.set_dry_run>`, :meth:`Daemon.release
<kvguard.runtime.daemon.Daemon.release>`); this module checks the caller, keeps the
recent actions for /status, and logs each one and each refusal (paced).
"""

from __future__ import annotations

import hmac
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from kvguard.api.status import mitigations_dict

if TYPE_CHECKING:
    from kvguard.runtime.daemon import Daemon

log = structlog.get_logger("kvguard.server")
CONTROL_ACTIONS = ("dry-run", "live", "release")
CONTROL_KEPT = 20  # control actions listed in /status
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


def _control_error(
    status: int, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


class Control:
    """The ``/control/*`` route over one daemon, and what it did (for /status)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.control_log = ControlLog()

    def status_section(self) -> dict[str, Any]:
        """The ``control`` section of /status: enabled or not, the recent actions (no callers)."""
        recent = list(self.control_log.records)
        return {
            "enabled": self.daemon.config.server.control_token is not None,
            "actions": [  # newest first
                {k: v for k, v in asdict(r).items() if k != "remote"} for r in recent[::-1]
            ],
        }

    async def handle(self, request: web.Request) -> web.Response:
        """``POST /control/{dry-run,live,release}``: an operator's override, bearer token required.

        Order matters: without a token configured everything here is 404; then the token
        is checked before anything else is said (which actions exist, which methods), so
        a caller without it learns nothing.
        """
        token = self.daemon.config.server.control_token
        if token is None:
            return _control_error(
                404,
                "control endpoints are off: set [server] control_token_file or"
                " KVGUARD_CONTROL_TOKEN to enable them",
            )
        denied = self._check_token(request, token.reveal())
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
        return self._act(request, action)

    def _check_token(self, request: web.Request, expected: str) -> web.Response | None:
        """None when the request carries the bearer token; else the 401 or 403 to answer."""
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            self._denied(request, "no bearer token")
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
            self._denied(request, "wrong token")
            return _control_error(403, "the bearer token is not the control token")
        return None

    def _denied(self, request: web.Request, reason: str) -> None:
        # Once per caller per DENIED_LOG_INTERVAL_S: anyone who reaches the port could
        # otherwise flood the log. Never the token given: a near miss is most of a secret.
        suppressed = self.control_log.denied_to_log(request.remote, self.daemon.clock())
        if suppressed is not None:
            log.warning(
                "control_denied",
                reason=reason,
                path=request.path,
                remote=request.remote,
                suppressed=suppressed,
            )

    def _act(self, request: web.Request, action: str) -> web.Response:
        daemon = self.daemon
        reason = f"operator: /control/{action}"
        if action == "release":
            outcome = daemon.release(reason)
        else:
            outcome = daemon.set_dry_run(action == "dry-run", reason)
            if outcome.refused is not None:
                log.warning(
                    "control_refused", action=action, reason=outcome.refused, remote=request.remote
                )
                return _control_error(
                    409, f"/control/{action} refused, nothing changed: {outcome.refused}"
                )
        record = ControlRecord(
            at=daemon.wall_clock(),
            action=action,
            result="changed" if outcome.changed else "unchanged",
            dry_run=daemon.dry_run,
            released=outcome.released,
            remote=request.remote,
        )
        self.control_log.records.append(record)
        fields = {
            "action": action,
            "result": record.result,
            "dry_run": daemon.dry_run,
            "released": list(outcome.released),
            "remote": request.remote,
        }
        log.warning("control_action", **fields)
        daemon.notify("control_action", fields)
        return web.json_response({**fields, "mitigations": mitigations_dict(daemon)})
