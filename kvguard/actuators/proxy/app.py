"""The admission proxy's application: :class:`AdmissionProxy`, its state and its handler.

It wires the parts together: every request is screened (:mod:`.screen`) before its
body is read, generation requests go through the admission (:mod:`.admit`), and what
passes is forwarded and relayed (:mod:`.forward`), prompt counts coming from
:mod:`.counting`. It owns what they share: the pooled session to the engine, the
in-flight accounting and the counters, and the public surface other layers use
(the daemon, the drain, the exporter and ``/status``). Kept apart from
``__init__`` so importing the package's names does not mean reading the class.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Mapping

import aiohttp
import structlog
from aiohttp import web

from kvguard.actuators.accounting import Inflight, InflightRequest
from kvguard.actuators.mitigations import Mitigations
from kvguard.actuators.proxy.admit import Admission
from kvguard.actuators.proxy.answers import _error
from kvguard.actuators.proxy.bodies import BodyGate, BodyRefused, BodyShare, read_body
from kvguard.actuators.proxy.counting import PromptCounter
from kvguard.actuators.proxy.forward import Forwarder, _upstream_headers
from kvguard.actuators.proxy.screen import ALLOWED_METHODS, ROUTE_KEY, screen_request
from kvguard.actuators.proxy.settings import ProxyCounters, ProxySettings
from kvguard.config.fields import is_loopback
from kvguard.core.lengths import LengthTerms, ObservedLengths
from kvguard.http_client import client_session

log = structlog.get_logger("kvguard.proxy")


class AdmissionProxy:
    """The proxy's state and handlers; ``app()`` is the aiohttp application."""

    def __init__(
        self,
        settings: ProxySettings,
        mitigations: Mitigations,
        *,
        bytes_per_token: float | None = None,
        engine_kind: Callable[[], str | None] | None = None,
    ) -> None:
        self.settings = settings
        # The engine's kind picks the routes forwarded (routes.py); None: not known yet.
        self._engine_kind = engine_kind
        self.mitigations = mitigations
        self.inflight = Inflight()
        self.counters = ProxyCounters()
        self.bytes_per_token = bytes_per_token
        self._session: aiohttp.ClientSession | None = None
        self._bodies = BodyGate(settings.max_body_memory)
        upstream = settings.upstream.rstrip("/")
        # Counting and forwarding share one pooled session: session() is passed, not
        # the session, so a closed one is replaced for both.
        self._counter = PromptCounter(self.session, upstream)
        # Recent answer lengths per kind of request: kept in kvguard, so they outlive
        # an engine restart (not a kvguard restart).
        self.lengths = ObservedLengths(
            LengthTerms(
                quantile=settings.reserve_quantile,
                min_samples=settings.reserve_min_samples,
                window=settings.reserve_window,
            )
        )
        self._admission = Admission(
            settings, mitigations, self.inflight, self.counters, self._counter, lengths=self.lengths
        )
        self._counter.corrected = self._admission.wake
        self._forwarder = Forwarder(
            upstream,
            self.session,
            mitigations=mitigations,
            inflight=self.inflight,
            counters=self.counters,
            counter=self._counter,
            finished=self._admission.wake,
            lengths=self.lengths,
        )
        mitigations.cancel_largest = self.cancel_largest
        mitigations.typical_request_tokens = self.lengths.typical_request_tokens
        mitigations.admission_waiting = lambda: self.waiting
        mitigations.admission_guards = self._admission.admission_enforced

    @property
    def engine_kind(self) -> str | None:
        """The engine's kind, as ``[engine] kind`` or the probe says; None while unknown."""
        return self._engine_kind() if self._engine_kind is not None else None

    @property
    def waiting(self) -> int:
        """Requests waiting for room in the pool now (held or projected admission)."""
        return self._admission.waiting

    @property
    def admission_queue_s(self) -> float | None:
        """How long requests have waited for room without a break; None while none waits.

        Older than ``admission_wait_s``, the queue is overload: a request waits
        ``overload_wait_s`` at most (:func:`kvguard.core.admission.admission_deadline`).
        """
        return self._admission.queue_age_s()

    def app(self) -> web.Application:
        """The application: every allowed path and method, screened, then forwarded."""
        listen = self.settings.listen
        if not is_loopback(listen.rpartition(":")[0]):
            log.warning(
                "listen_not_loopback",
                server="proxy",
                listen=listen,
                hint="reachable from other machines: restrict it with a firewall or network"
                " policy (docs/security.md)",
            )
        # The screen is a middleware so it also sees what no route matches (CONNECT's
        # authority target, OPTIONS *) and answers it clearly.
        app = web.Application(
            client_max_size=self.settings.max_body_bytes, middlewares=[self._screen]
        )
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_cleanup.append(self._close)
        return app

    def wake(self) -> None:
        """Make requests waiting for room re-check now (the mitigations in force changed)."""
        self._admission.wake()

    @property
    def reserved_tokens(self) -> int:
        """KV tokens admission reserves for the requests in flight now (before the engine's floor).

        Under ``admission = "observed"``, a ``reserve_quantile`` of the in-flight
        answers' total where their expected lengths are known; else the sum of each
        one's projection.
        """
        return self._admission.reserved()

    def review_reservations(self, now: float | None = None, ahead_s: float | None = None) -> int:
        """Each tick: re-read each answer's expected end, re-reserve outrunners, cancel overruns.

        Requests waiting for room re-check then too.

        Outrunners are answers past their learned length. ``now`` is when the
        engine's count was read (monotonic seconds; None: now) and ``ahead_s`` how
        long the pool must last before kvguard can act again (None: two intervals
        like the last).

        Returns how many were cancelled (``kvguard_requests_cancelled_total{reason=
        "overrun"}``) because, at the rate the answers write, the engine's pool would
        not last until kvguard can act again (:meth:`.Admission.overrunning`).
        """
        admission = self._admission
        admission.review_outrunners()
        victims = admission.overrunning(time.monotonic() if now is None else now, ahead_s)
        for victim in victims:
            self._cancel(victim, "overrun")
        if admission.waiting:
            # Room grows between ends too: the answers in flight came closer to theirs,
            # so their peak step by step is lower (kvguard.core.admission.Envelope).
            admission.wake()
        return len(victims)

    @web.middleware
    async def _screen(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """Refuse what must not reach the engine, before its body is read."""
        refusal = screen_request(request, self.settings, self.engine_kind)
        if refusal is None:
            return await handler(request)
        status, reason, message = refusal
        self.counters.rejected[reason] += 1
        # Debug: a flood of junk must not flood the log; the counter tells the story.
        log.debug("request_refused", reason=reason, method=request.method, status=status)
        headers = {"Allow": ", ".join(sorted(ALLOWED_METHODS))} if status == 405 else None
        return _error(status, message, "invalid_request_error", code=reason, headers=headers)

    async def _close(self, _: web.Application) -> None:
        await self._counter.close()
        if self._session is not None:
            await self._session.close()

    def session(self) -> aiohttp.ClientSession:
        """The pooled keep-alive session to the upstream (created on first use)."""
        if self._session is None or self._session.closed:
            # No HTTP_PROXY from the environment; idle connections dropped before the
            # engine's own keep-alive timer can close one under a request (http_client).
            self._session = client_session(
                keepalive_s=self.settings.upstream_keepalive_s,
                timeout=aiohttp.ClientTimeout(
                    sock_connect=self.settings.connect_timeout_s,
                    sock_read=self.settings.read_timeout_s,
                ),
                auto_decompress=False,  # bytes pass through as the engine sent them
            )
        return self._session

    # ------------------------------------------------------------------ the request path
    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Forward one request, applying the mitigations to generation requests.

        Its body counts against ``max_body_memory`` from its first byte until it is
        parsed and checked, before admission waits for room in the engine's pool (or
        until it is refused, or forwarded unparsed): :class:`.bodies.BodyGate`.
        """
        async with self._bodies.share() as share:
            return await self._handle(request, share)

    async def _handle(self, request: web.Request, share: BodyShare) -> web.StreamResponse:
        try:
            body = await read_body(request, self.settings, share)
        except BodyRefused as refused:
            return await self._refuse_body(request, refused)
        headers = _upstream_headers(request)
        request_id = headers.get("X-Request-Id") or uuid.uuid4().hex
        headers["X-Request-Id"] = request_id
        tracked: InflightRequest | None = None
        route = request.get(ROUTE_KEY)  # set by the screen; OPTIONS generates nothing
        if route is not None and route.shape is not None and request.method in route.methods:
            decided = await self._admission.admit(
                request, body, request_id, route.shape, parsed=share.release
            )
            if isinstance(decided, web.StreamResponse):
                # kvguard's own answer (a shed, a refusal): the id ties it to the log.
                decided.headers["X-Request-Id"] = request_id
                return decided
            body, tracked = decided
        share.release()  # admitted (or not a generation): its bytes go to the engine
        return await self._forwarder.forward(request, headers, body, tracked)

    async def _refuse_body(self, request: web.Request, refused: BodyRefused) -> web.StreamResponse:
        """The answer to a body not read: 413, 408 (then the connection is closed) or 503."""
        self.counters.upstream_errors[str(refused.status)] += 1
        kind = {413: "request_too_large", 503: "server_overloaded"}
        answer = _error(
            refused.status,
            refused.message,
            kind.get(refused.status, "invalid_request_error"),
            code=refused.code,
            headers=refused.headers,
        )
        if refused.status != 408:
            return answer
        # A client that stalled its body would otherwise hold the connection while
        # aiohttp reads the rest for its lingering time: answer, then close.
        answer.force_close()
        await answer.prepare(request)
        await answer.write_eof()
        if request.transport is not None:
            request.transport.close()
        return answer

    def priority_of(self, headers: Mapping[str, str]) -> str:
        """The request's class: from the API-key map, else the header, else the default."""
        return self._admission.priority_of(headers)

    # ------------------------------------------------------------------ actions
    def cancel_largest(self) -> bool:
        """Cut the upstream connection of the largest non-critical request.

        Engines abort a request whose client went away, which frees its blocks.
        """
        victim = self.inflight.largest()
        if victim is None or victim.cancel is None:
            return False
        self._cancel(victim, "largest")
        return True

    def cancel_all(self, reason: str = "drain") -> int:
        """Cut every in-flight request, critical ones too (the engine is about to restart)."""
        victims = [r for r in self.inflight if r.cancel is not None and not r.cancelled]
        for victim in victims:
            self._cancel(victim, reason)
        return len(victims)

    def _cancel(self, victim: InflightRequest, reason: str) -> None:
        assert victim.cancel is not None  # noqa: S101 - callers pick cancellable requests
        victim.cancelled = True
        victim.cancel_reason = reason
        victim.cancel()
        self.counters.cancelled[reason] += 1
        log.warning(
            "request_cancelled",
            request_id=victim.request_id,
            priority=victim.priority,
            kv_tokens=victim.footprint_tokens,
            reason=reason,
        )
