"""The admission proxy: kvguard in the request path, in front of one engine.

Every request to ``listen`` is forwarded to the one configured upstream — same
method, path, query, body and headers (hop-by-hop ones excepted, and the client's
``X-Forwarded-*``/``Forwarded`` replaced by the connection's own address and scheme),
with an ``X-Request-Id`` added when missing — and the answer comes back unchanged,
streams chunk by chunk. Generation requests (``/v1/completions``,
``/v1/chat/completions``) are also accounted (their KV footprint) and subject to the
mitigations in force: shed by priority (503 + ``Retry-After``), capped
(``max_tokens`` clamped, or 400 when even the minimum does not fit), or cancelled
when the largest. Health, metrics and model-list paths pass untouched. The proxy
never talks to any host but its upstream: the target is always ``upstream + path``,
and redirects are not followed.

It is no open proxy and forwards nothing malformed: absolute-URI, authority
(CONNECT) and asterisk request targets, unusual methods, dot segments and encoded
slashes in paths, control characters in header values, paths outside
``allowed_paths`` or inside ``blocked_paths`` (the engines' admin endpoints by
default), variants of a generation path (``/V1/completions``,
``/v1/completions/``) that would slip past shedding and accounting, and generation
bodies that are not a JSON object or carry a ``max_tokens`` that is not a positive
integer are all answered 4xx, and none of them reaches the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from kvguard.actuators.accounting import (
    Inflight,
    InflightRequest,
    TokenCache,
    estimate_chat_tokens,
    estimate_tokens,
)
from kvguard.actuators.mitigations import Mitigations, request_priority
from kvguard.config.fields import PATH_METHODS, is_loopback
from kvguard.config.settings import ENGINE_ADMIN_PATHS
from kvguard.http_client import DEFAULT_KEEPALIVE_S, client_session

log = structlog.get_logger("kvguard.proxy")
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# What an inference API is called with; TRACE, CONNECT and inventions are refused.
ALLOWED_METHODS = frozenset(PATH_METHODS)
# No engine takes more tokens than this (int32); a bigger max_tokens is malformed.
MAX_TOKENS_LIMIT = 2**31 - 1
# Set by the proxy itself from the connection: a client's own would let it pose as
# another address to an engine that trusts X-Forwarded-* from 127.0.0.1 (uvicorn).
FORWARDING_HEADERS = frozenset(
    {"forwarded", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "x-real-ip"}
)
# RFC 9110 section 7.6.1: these describe one connection and must not be forwarded.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
TOKENIZE_TIMEOUT_S = 0.25
UNKNOWN_MAX_TOKENS = 512  # projection of a request that sets no max_tokens
# Request fields besides the prompt that change the engine's count of it (templates,
# tools, truncation, special tokens, the model): part of the count cache's key.
PROMPT_SHAPING_FIELDS = (
    "model",
    "tools",
    "functions",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "add_special_tokens",
    "truncate_prompt_tokens",
    "suffix",
)
# Prompt counts asked of the engine in the background at once, at most; past it (the
# engine tokenizes slowly) a request keeps its estimate, which errs high.
MAX_BACKGROUND_COUNTS = 16  # each is one more request on the engine's API server
# Requests of a shed class held for room, at most: this many pools' worth (projected).
# One pool's worth sheds bursts the engine would have served within shed_wait_s; four
# kept the simulator's bursty_short goodput within 5% of holding without a bound.
HELD_POOLS = 4
USAGE_SCAN_BYTES = 1024 * 1024  # whole answers are read for `usage` up to this size
CANCEL_MESSAGE = (
    "kvguard cancelled this request to free KV cache for others (the cache is full); retry later"
)
DRAIN_MESSAGE = (
    "kvguard cancelled this request: the engine is restarting to change its KV cache"
    " and the request did not finish within the drain timeout; retry later"
)


@dataclass(frozen=True)
class _PromptCount:
    """A prompt's token count as known without asking the engine."""

    count: int
    exact: bool  # token ids, or the engine's count from the cache; else an estimate
    key: int  # the cache key (a hash of the prompt and PROMPT_SHAPING_FIELDS)


@dataclass(frozen=True)
class ProxySettings:
    """``[proxy]``: where to listen, where to forward, how to classify and limit."""

    upstream: str
    listen: str = "127.0.0.1:9000"
    priority_header: str = "X-Priority"
    trust_priority_header: bool = True  # False: only the API-key map or the default decide
    default_priority: str = "standard"
    api_key_priorities: Mapping[str, str] | None = field(default=None, repr=False)  # secrets
    max_body_bytes: int = 16 * 1024 * 1024
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    upstream_keepalive_s: float = DEFAULT_KEEPALIVE_S  # under the engine's keep-alive timer
    min_completion_tokens: int = 16
    admission: str = "off"  # "projected": admit against the engine's pool (see _make_room)
    admission_ratio: float = 0.95
    admission_wait_s: float = 5.0
    # While shedding, a request of a shed class is held until the in-flight projections
    # plus its own fit within shed_ratio of the pool, for up to shed_wait_s: only the
    # excess is shed. shed_ratio 0 (or an unknown pool) sheds the whole class at once.
    shed_ratio: float = 0.8
    shed_wait_s: float = 2.0
    # Path prefixes (whole segments, case-insensitive) forwarded, and refused among them
    # (a refused entry may name one method: "POST /props").
    allowed_paths: tuple[str, ...] = ("/",)
    blocked_paths: tuple[str, ...] = ENGINE_ADMIN_PATHS


class ProxyCounters:
    """What the proxy did, for the exporter."""

    def __init__(self) -> None:
        self.shed: Counter[tuple[str, str]] = Counter()  # (priority, reason)
        self.clamped = 0
        self.rejected: Counter[str] = Counter()  # reason (window caps, malformed requests)
        # reason: largest, drain (both present from the start: 0 is not absent)
        self.cancelled: Counter[str] = Counter({"largest": 0, "drain": 0})
        self.upstream_errors: Counter[str] = Counter()  # 502/504/413


class AdmissionProxy:
    """The proxy's state and handlers; ``app()`` is the aiohttp application."""

    def __init__(
        self,
        settings: ProxySettings,
        mitigations: Mitigations,
        *,
        bytes_per_token: float | None = None,
    ) -> None:
        self.settings = settings
        self.mitigations = mitigations
        self.inflight = Inflight()
        self.counters = ProxyCounters()
        self.bytes_per_token = bytes_per_token
        self._tokens = TokenCache()
        self._tokenize_ok = True
        self._counting: set[asyncio.Future[None]] = set()  # prompt counts asked in the background
        self._session: aiohttp.ClientSession | None = None
        self._upstream = settings.upstream.rstrip("/")
        # Set (and replaced) whenever a request finishes: waiters re-check for room.
        # No Condition: on 3.11, wait_for() timing out a Condition.wait can leave the
        # lock released under `async with`, which then raises.
        self._room_freed = asyncio.Event()
        self._held_tokens = 0  # projections of shed-class requests held for room
        self.waiting = 0  # requests waiting for room in the pool (held or projected admission)
        mitigations.cancel_largest = self.cancel_largest

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
        self._room_freed.set()
        self._room_freed = asyncio.Event()

    @web.middleware
    async def _screen(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """Refuse what must not reach the engine, before its body is read."""
        refusal = screen_request(request, self.settings)
        if refusal is None:
            return await handler(request)
        status, reason, message = refusal
        self.counters.rejected[reason] += 1
        # Debug: a flood of junk must not flood the log; the counter tells the story.
        log.debug("request_refused", reason=reason, method=request.method, status=status)
        headers = {"Allow": ", ".join(sorted(ALLOWED_METHODS))} if status == 405 else None
        return _error(status, message, "invalid_request_error", code=reason, headers=headers)

    async def _close(self, _: web.Application) -> None:
        for task in list(self._counting):
            task.cancel()
        await asyncio.gather(*self._counting, return_exceptions=True)
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
        """Forward one request, applying the mitigations to generation requests."""
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.counters.upstream_errors["413"] += 1
            return _error(
                413, f"request body over {self.settings.max_body_bytes} bytes", "request_too_large"
            )
        headers = _upstream_headers(request)
        request_id = headers.get("X-Request-Id") or uuid.uuid4().hex
        headers["X-Request-Id"] = request_id
        tracked: InflightRequest | None = None
        if request.method == "POST" and request.path in GENERATION_PATHS:
            decided = await self._admit(request, body, request_id)
            if isinstance(decided, web.StreamResponse):
                return decided
            body, tracked = decided
        return await self._forward(request, headers, body, tracked)

    async def _admit(
        self, request: web.Request, body: bytes, request_id: str
    ) -> web.StreamResponse | tuple[bytes, InflightRequest | None]:
        priority = self.priority_of(request.headers)
        if self._draining():
            return self._refuse_draining(priority)
        shed_class = self.mitigations.sheds(priority)
        # Cheap, before anything is parsed, so a flood of shed requests stays cheap: no
        # pool to measure against, or already HELD_POOLS pools' worth of requests held.
        if shed_class and not self._may_hold():
            return self._shed(priority, request_id)
        payload = _json_or_error(body) if body else None
        chat = request.path == "/v1/chat/completions"
        malformed = _malformed_generation(payload, body, chat=chat)
        if malformed is not None:
            self.counters.rejected["invalid_body"] += 1
            return _error(400, malformed, "invalid_request_error", code="invalid_body")
        if not isinstance(payload, dict):
            return body, None  # an empty body: nothing to project or change
        prompt_cap, completion_cap = self._window_for(priority)
        # The engine's exact count is waited for only when it decides something now (a
        # window cap, a hold for room, projected admission). Otherwise the request goes
        # on with an estimate, corrected when the engine's count comes (see below): the
        # /tokenize round trip was most of the latency the proxy adds.
        known = self._known_prompt_tokens(payload, chat=chat)
        decides = (
            prompt_cap is not None
            or completion_cap is not None
            or shed_class
            or self._admission_enforced()
        )
        prompt = known.count
        if not known.exact and decides:
            prompt = await self._exact_count(payload, known, chat=chat)
            # What is in force now, not before the wait (up to TOKENIZE_TIMEOUT_S).
            prompt_cap, completion_cap = self._window_for(priority)
        key = (
            "max_completion_tokens" if chat and "max_completion_tokens" in payload else "max_tokens"
        )
        requested = payload.get(key)
        max_tokens = (
            requested if isinstance(requested, int) and not isinstance(requested, bool) else None
        )
        if prompt_cap is not None and prompt > prompt_cap:
            self.counters.rejected["prompt_over_window"] += 1
            return _error(
                400,
                f"prompt of {prompt} tokens is over kvguard's current limit of {prompt_cap}"
                " tokens (the KV cache is under pressure); shorten it or retry later",
                "invalid_request_error",
                code="kv_window_exceeded",
            )
        if completion_cap is not None:
            cap = completion_cap
            room = max(cap - prompt, 0) if prompt_cap is not None else cap
            if room < self.settings.min_completion_tokens:
                self.counters.rejected["no_room_for_completion"] += 1
                return _error(
                    400,
                    f"prompt of {prompt} tokens leaves less than"
                    f" {self.settings.min_completion_tokens} tokens under kvguard's current"
                    f" limit of {cap} tokens (the KV cache is under pressure);"
                    " shorten it or retry later",
                    "invalid_request_error",
                    code="kv_window_exceeded",
                )
            if max_tokens is None or max_tokens > room:
                payload[key] = room
                max_tokens = room
                self.counters.clamped += 1
                body = json.dumps(payload).encode()
        tracked = InflightRequest(request_id, priority, prompt, max_tokens)
        if not known.exact and not decides:
            tracked.prompt_key = known.key
            # While calm, a whole answer or a stream asked to end with `usage` brings the
            # engine's own count at its end: no /tokenize (a second request to the
            # engine's API server). Once pressure builds, what is in flight must be
            # known while it runs: /tokenize alongside, the count in milliseconds.
            if self.mitigations.level != "ok" or not _answer_has_usage(payload):
                self._count_later(tracked, payload, known.key, chat=chat)
        if shed_class and not await self._hold_for_room(tracked):
            return (
                self._refuse_draining(priority)
                if self._draining()
                else self._shed(priority, request_id)
            )
        if not await self._make_room(tracked) and not self._draining():
            self.counters.shed[(priority, "kv_pool_full")] += 1
            # One line per shed request would flood the log in a burst: debug level;
            # kvguard_requests_shed_total and the `decision` event tell the story.
            log.debug(
                "request_shed", request_id=request_id, priority=priority, reason="kv_pool_full"
            )
            return _error(
                503,
                "kvguard is holding new requests: the engine's KV pool is full with requests"
                f" in flight; retry after {self.mitigations.retry_after_s} s",
                "server_overloaded",
                code="kv_cache_pressure",
                headers={"Retry-After": str(self.mitigations.retry_after_s)},
            )
        if self._draining():
            # A drain began while this one waited for a token count or for room: the
            # engine is about to restart, so it must not be forwarded now.
            return self._refuse_draining(priority)
        return body, tracked

    def _window_for(self, priority: str) -> tuple[int | None, int | None]:
        """The (prompt, completion) caps in force for ``priority`` now.

        Critical requests are never refused for their size: a refusal loses them as
        surely as a shed would, and critical traffic is never shed.
        """
        return (None, None) if priority == "critical" else self.mitigations.window

    def _draining(self) -> bool:
        return self.mitigations.draining and self.mitigations.enforcing

    def _admission_enforced(self) -> bool:
        """Whether projected admission checks each request against the pool now."""
        mitigations = self.mitigations
        return (
            self.settings.admission == "projected"
            and mitigations.enforcing
            and mitigations.pool_tokens is not None
        )

    def _refuse_draining(self, priority: str) -> web.StreamResponse:
        """The 503 for every class (critical too) while the engine is drained for a restart."""
        self.counters.shed[(priority, "draining")] += 1
        retry_after = self.mitigations.drain_retry_after_s
        return _error(
            503,
            f"kvguard is restarting the engine to change its KV cache; retry after {retry_after} s",
            "server_overloaded",
            code="kv_cache_reconfigure",
            headers={"Retry-After": str(retry_after)},
        )

    def _shed(self, priority: str, request_id: str) -> web.StreamResponse:
        """The 503 for a request of a class the policy sheds now."""
        self.counters.shed[(priority, "kv_cache_pressure")] += 1
        # One line per shed request would flood the log in a burst: debug level;
        # kvguard_requests_shed_total and the `decision` event tell the story.
        log.debug(
            "request_shed", request_id=request_id, priority=priority, level=self.mitigations.level
        )
        return _error(
            503,
            f"kvguard is shedding {priority} traffic: the KV cache is under pressure"
            f" ({self.mitigations.level}); retry after {self.mitigations.retry_after_s} s",
            "server_overloaded",
            code="kv_cache_pressure",
            headers={"Retry-After": str(self.mitigations.retry_after_s)},
        )

    def _own(self, tracked: InflightRequest) -> int:
        """``tracked``'s projection in whole blocks (no ``max_tokens``: assume a long answer)."""
        if tracked.max_tokens is None:
            tracked.max_tokens = UNKNOWN_MAX_TOKENS  # the engine picks; assume a long answer
        block = self.mitigations.block_size
        return -(-tracked.projected_tokens // block) * block

    def _room_under(self, ratio: float, own: int) -> bool:
        """Whether in-flight projections plus ``own`` tokens stay within ``ratio`` of the pool.

        An unknown pool has no room to show: False.
        """
        pool = self.mitigations.pool_tokens
        if pool is None:
            return False
        return self.inflight.projected_tokens(self.mitigations.block_size) + own <= pool * ratio

    def _may_hold(self) -> bool:
        """Whether a request of a shed class may be held for room rather than shed now."""
        pool, ratio = self.mitigations.pool_tokens, self.settings.shed_ratio
        return pool is not None and ratio > 0 and self._held_tokens < pool * ratio * HELD_POOLS

    async def _hold_for_room(self, tracked: InflightRequest) -> bool:
        """Hold a request of a shed class until it fits ``shed_ratio`` of the pool.

        Shedding a whole class empties the pool between bursts (and the level holds
        for ``hold_s``); holding each request for at most ``shed_wait_s`` until the
        in-flight projections plus its own fit ``shed_ratio`` of the pool sheds only
        the excess. The held requests are bounded: at most ``HELD_POOLS`` pools' worth.
        """
        own = self._own(tracked)
        # Checked again here, with nothing awaited between the check and the add: in a
        # burst, many requests pass _admit's early check together while their prompts
        # are tokenized, and would all be held past the bound.
        if not self._room_under(self.settings.shed_ratio, own) and not self._may_hold():
            return False
        self._held_tokens += own
        try:
            return (
                await self._wait_until(
                    # A release (the ladder's or an operator's) lets it in at once.
                    lambda: (
                        not self.mitigations.sheds(tracked.priority)
                        or self._room_under(self.settings.shed_ratio, own)
                    ),
                    self.settings.shed_wait_s,
                )
                and not self._draining()
            )
        finally:
            self._held_tokens -= own

    async def _wait_until(self, fits: Callable[[], bool], wait_s: float) -> bool:
        """Wait up to ``wait_s`` for ``fits()`` (re-checked as requests finish)."""
        if fits():
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        self.waiting += 1
        try:
            while not fits():
                if self._draining():
                    return False  # the caller refuses it: the engine is about to restart
                left = deadline - loop.time()
                if left <= 0:
                    return False
                with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                    await asyncio.wait_for(self._room_freed.wait(), left)
            return True
        finally:
            self.waiting -= 1

    async def _make_room(self, tracked: InflightRequest) -> bool:
        """With ``admission = "projected"``, wait until the request fits the pool.

        A request fits when every in-flight request's projection (prompt +
        ``max_tokens``, in whole blocks) plus its own stays within
        ``admission_ratio`` of the engine's usable pool. It waits up to
        ``admission_wait_s`` for others to finish, then is shed. Critical requests
        are never shed: they may use the whole pool (not just ``admission_ratio``)
        and wait for room as long as ``read_timeout_s`` — letting one in regardless
        is what would crash an engine that allocates per sequence. An unknown pool
        and dry-run admit everything. No poll interval stands between a burst and
        this check: it is what keeps an engine that crashes on exhaustion alive.
        """
        mitigations, settings = self.mitigations, self.settings
        if settings.admission != "projected" or not mitigations.enforcing:
            return True
        if mitigations.pool_tokens is None:
            return True
        critical = tracked.priority == "critical"
        ratio = 1.0 if critical else settings.admission_ratio
        wait_s = settings.read_timeout_s if critical else settings.admission_wait_s
        own = self._own(tracked)

        def fits() -> bool:
            # The pool may become unknown while waiting (the engine went away): admit.
            # A critical request larger than the whole pool would never fit: it goes in
            # once nothing else is in flight, as the engine would take it alone.
            alone = critical and not self.inflight.projected_tokens(mitigations.block_size)
            return mitigations.pool_tokens is None or alone or self._room_under(ratio, own)

        return await self._wait_until(fits, wait_s)

    def priority_of(self, headers: Mapping[str, str]) -> str:
        """The request's class: from the API-key map, else the header, else the default."""
        settings = self.settings
        return request_priority(
            headers,
            settings.priority_header,
            settings.api_key_priorities,
            settings.default_priority,
            trust_header=settings.trust_priority_header,
        )

    async def _exact_count(
        self, payload: dict[str, Any], known: _PromptCount, *, chat: bool
    ) -> int:
        """``known`` when exact, else the engine's /tokenize count (bounded, cached).

        When the engine has no count to give, the estimate (cached too, so the engine
        is not asked again).
        """
        if known.exact:
            return known.count
        count = await self._tokenize(payload, chat=chat)
        if count is None:
            count = known.count  # the estimate, remembered so the engine is not asked again
        self._tokens.put(known.key, count)
        return count

    def _known_prompt_tokens(self, payload: dict[str, Any], *, chat: bool) -> _PromptCount:
        """The prompt's tokens without asking the engine: ids, the cache, else an estimate."""
        subject: object = payload.get("messages") if chat else payload.get("prompt")
        if (
            isinstance(subject, list)
            and not chat
            and subject
            and all(isinstance(t, int) for t in subject)
        ):
            return _PromptCount(len(subject), exact=True, key=0)  # already token ids
        text = json.dumps(subject, sort_keys=True)
        # The fields that change what the engine counts for the same prompt are part of
        # the key, so a count remembered for one request is never another's.
        shaping = {f: payload[f] for f in PROMPT_SHAPING_FIELDS if f in payload}
        key = hash((text, json.dumps(shaping, sort_keys=True))) if shaping else hash(text)
        cached = self._tokens.get(key)
        if cached is not None:
            return _PromptCount(cached, exact=True, key=key)
        if chat and isinstance(subject, list):
            estimate = estimate_chat_tokens(subject)
        else:
            estimate = estimate_tokens(subject if isinstance(subject, str) else text)
        return _PromptCount(estimate, exact=False, key=key)

    def _count_later(
        self, tracked: InflightRequest, payload: dict[str, Any], key: int, *, chat: bool
    ) -> None:
        """Ask the engine for the prompt's count while the request goes on; correct it then."""
        if len(self._counting) >= MAX_BACKGROUND_COUNTS:
            return  # the engine is slow to tokenize: the (high) estimate stands
        task = asyncio.ensure_future(self._count_in_background(tracked, payload, key, chat=chat))
        self._counting.add(task)
        task.add_done_callback(self._count_ended)

    def _count_ended(self, task: asyncio.Future[None]) -> None:
        self._counting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("prompt_count_failed", error=repr(task.exception())[:200])

    async def _count_in_background(
        self, tracked: InflightRequest, payload: dict[str, Any], key: int, *, chat: bool
    ) -> None:
        count = await self._tokenize(payload, chat=chat)
        if count is None:
            return  # the estimate stands; not cached, so a later cap asks the engine again
        self._tokens.put(key, count)
        if tracked.prompt_key is not None and not tracked.prompt_counted:
            tracked.prompt_tokens = count  # the answer's usage, when it came first, stands
            tracked.prompt_key = None

    def _remember_usage(self, tracked: InflightRequest) -> None:
        """Cache the prompt's count its answer's ``usage`` gave (see :func:`_count_usage`)."""
        if tracked.prompt_key is not None and tracked.prompt_counted:
            self._tokens.put(tracked.prompt_key, tracked.prompt_tokens)
            tracked.prompt_key = None

    async def _tokenize(self, payload: dict[str, Any], *, chat: bool) -> int | None:
        if not self._tokenize_ok:
            return None
        query: dict[str, Any] = (
            {"messages": payload.get("messages")} if chat else {"prompt": payload.get("prompt")}
        )
        if "model" in payload:
            query["model"] = payload["model"]
        try:
            async with self.session().post(
                self._upstream + "/tokenize",
                json=query,
                timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S),
                allow_redirects=False,
            ) as resp:
                if resp.status == 404:
                    self._tokenize_ok = False  # this engine has none: estimate from now on
                    return None
                if resp.status != 200:
                    return None
                data = await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ValueError):
            return None
        count = data.get("count") if isinstance(data, dict) else None
        if isinstance(count, int):
            return count
        tokens = data.get("tokens") if isinstance(data, dict) else None
        return len(tokens) if isinstance(tokens, list) else None

    async def _forward(
        self,
        request: web.Request,
        headers: CIMultiDict[str],
        body: bytes,
        tracked: InflightRequest | None,
    ) -> web.StreamResponse:
        url = self._upstream + request.rel_url.raw_path_qs  # only ever the upstream host
        upstream: aiohttp.ClientResponse | None = None
        task = asyncio.current_task()
        if tracked is not None:
            self.inflight.add(tracked)
            # Until the engine's headers arrive (for a whole answer: when it is done),
            # cancelling means cancelling this handler, which drops the connection.
            tracked.cancel = _canceller(task)
        try:
            try:
                upstream = await self.session().request(
                    request.method, url, headers=headers, data=body or None, allow_redirects=False
                )
            except asyncio.CancelledError:
                if tracked is None or not tracked.cancelled or task is None:
                    raise  # our client left (or kvguard stops): not ours to answer
                uncancel = getattr(task, "uncancel", None)  # 3.11+: this cancel is handled
                if uncancel is not None:
                    uncancel()
                return self._cancelled(tracked)
            except (asyncio.TimeoutError, TimeoutError):
                self.counters.upstream_errors["504"] += 1
                return _error(504, "the engine did not answer in time", "upstream_timeout")
            except aiohttp.ClientError as exc:
                self.counters.upstream_errors["502"] += 1
                return _error(
                    502, f"the engine is unreachable: {type(exc).__name__}", "upstream_unreachable"
                )
            if tracked is not None:
                tracked.cancel = upstream.close
            return await self._relay(request, upstream, tracked)
        finally:
            if upstream is not None:
                # A body not read to its end means our client left or we cancelled:
                # closing the connection is what makes the engine abort the request.
                if upstream.content.at_eof():
                    upstream.release()
                else:
                    upstream.close()
            if tracked is not None:
                self._remember_usage(tracked)
                self.inflight.done(tracked)
                # A waiting request may fit now: wake them all, arm a new event.
                self._room_freed.set()
                self._room_freed = asyncio.Event()

    async def _relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        tracked: InflightRequest | None,
    ) -> web.StreamResponse:
        streaming = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        first = b""
        if not streaming:
            # A whole answer arrives at once: wait for it before sending the status, so a
            # cancellation can still answer 503 instead of a truncated 200.
            try:
                first = await upstream.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError):
                if tracked is not None and tracked.cancelled:
                    return self._cancelled(tracked)
                self.counters.upstream_errors["502"] += 1
                return _error(502, "the engine closed the connection", "upstream_error")
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        response.headers.extend(_forward_headers(upstream.headers))
        if "Content-Length" in upstream.headers:
            response.content_length = int(upstream.headers["Content-Length"])
        kept = bytearray(first[:USAGE_SCAN_BYTES])
        tail = b""
        try:
            await response.prepare(request)
            if first:
                await response.write(first)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
                if tracked is not None and streaming:
                    tail = _count_events(tracked, tail + chunk)
                elif len(kept) < USAGE_SCAN_BYTES:
                    kept += chunk[: USAGE_SCAN_BYTES - len(kept)]
        except ConnectionResetError:
            # Our client went away (aiohttp's ClientConnectionResetError is one too, so
            # this comes first): nobody to tell; closing upstream aborts the request.
            return response
        except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError) as exc:
            with contextlib.suppress(ConnectionResetError):
                if streaming and tracked is not None and tracked.cancelled:
                    message, code = _cancel_message(tracked), _cancel_code(tracked)
                    await _stream_error(response, message, code=code)
                elif streaming:
                    await _stream_error(response, f"the engine stream broke: {type(exc).__name__}")
            if not streaming:
                # The status and Content-Length are sent and the body cannot be finished:
                # cut the connection, or the client waits for bytes that never come. A
                # cut kvguard made itself (cancel_largest) is counted as that, not as 502.
                if tracked is None or not tracked.cancelled:
                    self.counters.upstream_errors["502"] += 1
                if request.transport is not None:
                    request.transport.abort()
            return response
        if tracked is not None and not streaming:
            _count_usage(tracked, bytes(kept))
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    # ------------------------------------------------------------------ actions
    def _cancelled(self, tracked: InflightRequest) -> web.StreamResponse:
        """The 503 for a request kvguard cancelled before its answer began."""
        return _error(
            503,
            _cancel_message(tracked),
            "server_overloaded",
            code=_cancel_code(tracked),
            # Without it, SDK clients resubmit the same large request at once.
            headers={"Retry-After": str(self._retry_after(tracked))},
        )

    def _retry_after(self, tracked: InflightRequest) -> int:
        """Seconds a cancelled client should wait: until the restart, or the shed estimate."""
        if tracked.cancel_reason == "drain":
            return self.mitigations.drain_retry_after_s
        return self.mitigations.retry_after_s

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


def _canceller(task: asyncio.Task[Any] | None) -> Callable[[], None] | None:
    if task is None:
        return None

    def cancel() -> None:
        task.cancel()

    return cancel


def _cancel_message(tracked: InflightRequest) -> str:
    return DRAIN_MESSAGE if tracked.cancel_reason == "drain" else CANCEL_MESSAGE


def _cancel_code(tracked: InflightRequest) -> str:
    return "kv_cache_reconfigure" if tracked.cancel_reason == "drain" else "kv_cache_pressure"


def _forward_headers(incoming: CIMultiDictProxy[str] | CIMultiDict[str]) -> CIMultiDict[str]:
    """``incoming`` without hop-by-hop headers.

    RFC 9110's, ``Proxy-*`` and those every ``Connection`` header names, both ways:
    requests to the engine and answers to the client.
    """
    named = {
        h.strip().lower()
        for value in incoming.getall("Connection", [])
        for h in value.split(",")
        if h.strip()
    }
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        lower = name.lower()
        if lower not in HOP_BY_HOP and lower not in named and not lower.startswith("proxy-"):
            out.add(name, value)
    return out


def _upstream_headers(request: web.Request) -> CIMultiDict[str]:
    """The headers sent to the engine: the client's, less hop-by-hop and forwarding ones.

    ``X-Forwarded-For`` and ``X-Forwarded-Proto`` are set from the connection itself.
    """
    headers = _forward_headers(request.headers)
    for name in FORWARDING_HEADERS:
        headers.popall(name, None)
    if request.remote:
        headers["X-Forwarded-For"] = request.remote
    headers["X-Forwarded-Proto"] = request.scheme
    return headers


def screen_request(request: web.Request, settings: ProxySettings) -> tuple[int, str, str] | None:
    """Why ``request`` must not be forwarded, as (status, reason, message); None if it may."""
    if request.method not in ALLOWED_METHODS:
        return (
            405,
            "method_not_allowed",
            (
                f"method {request.method} is not forwarded"
                f" (allowed: {', '.join(sorted(ALLOWED_METHODS))}); kvguard is no forward proxy"
            ),
        )
    raw = request.raw_path
    if not raw.startswith("/"):
        # Absolute-URI ("GET http://other/ HTTP/1.1") and asterisk ("OPTIONS *") targets:
        # the upstream is fixed, so a target naming a host is a client mistake or a probe.
        return (
            400,
            "bad_target",
            (
                "the request target must be a path (origin-form, like /v1/models);"
                " kvguard forwards only to its configured engine and is no forward proxy"
            ),
        )
    for name, value in request.headers.items():
        if not _clean_header(name, value):
            return (
                400,
                "bad_header",
                (f"header {_shown(name)} holds a control character or bytes that are not UTF-8"),
            )
    path_problem = _path_problem(raw, request.path)
    if path_problem is not None:
        return 400, "bad_path", path_problem
    normal = normal_path(request.path)
    if not any(_under(normal, prefix) for prefix in settings.allowed_paths):
        return (
            404,
            "path_not_allowed",
            (f"{_shown(request.path)} is not forwarded to the engine ([proxy] allowed_paths)"),
        )
    if any(_blocks(entry, request.method, normal) for entry in settings.blocked_paths):
        return (
            403,
            "path_blocked",
            (
                f"{request.method} {_shown(request.path)} is an engine admin endpoint and is not"
                " served through the proxy ([proxy] blocked_paths); call it on the engine's"
                " own address"
            ),
        )
    if normal in GENERATION_PATHS and request.path != normal:
        # Shedding, capping and accounting key on the exact path: a variant the engine
        # would redirect or 404 anyway must not slip past them.
        return (
            400,
            "bad_path",
            f"{_shown(request.path)} is not a generation path: write it as {normal}",
        )
    return None


def normal_path(path: str) -> str:
    """``path`` lower-cased, repeated and trailing slashes collapsed: what rules match."""
    return "/" + "/".join(part for part in path.lower().split("/") if part)


def _blocks(entry: str, method: str, path: str) -> bool:
    """Whether a ``blocked_paths`` entry ("/slots" or "POST /props") covers the request."""
    only, _, prefix = entry.rpartition(" ")
    return (not only or only == method) and _under(path, prefix)


def _under(path: str, prefix: str) -> bool:
    """Whether normalised ``path`` is ``prefix`` or below it, in whole segments."""
    prefix = prefix.lower().rstrip("/")
    return not prefix or path == prefix or path.startswith(prefix + "/")


def _path_problem(raw: str, decoded: str) -> str | None:
    """Why a path is malformed, or None: what an engine could read as another path."""
    raw_path = raw.split("?", 1)[0].lower()
    if "%2f" in raw_path or "%5c" in raw_path or "\\" in decoded:
        return "the path holds an encoded slash or a backslash"
    if any(part in (".", "..") for part in decoded.split("/")):
        return 'the path holds a "." or ".." segment'
    if any(ord(ch) < 32 or ord(ch) == 127 or 0xD800 <= ord(ch) <= 0xDFFF for ch in decoded):
        return "the path holds a control character or bytes that are not UTF-8"
    return None


def _clean_header(name: str, value: str) -> bool:
    """No CR, LF, NUL or other control character (tab aside), no undecodable bytes."""
    return all(
        (ord(ch) >= 32 or ch == "\t") and ord(ch) != 127 and not 0xD800 <= ord(ch) <= 0xDFFF
        for ch in name + value
    )


def _shown(text: str, limit: int = 80) -> str:
    """``text`` safe to echo in an error: printable, bounded."""
    cleaned = "".join(ch if ch.isprintable() else "?" for ch in text[:limit])
    return repr(cleaned + ("..." if len(text) > limit else ""))


class _MalformedJSONError(ValueError):
    """A body that is not strict JSON (RFC 8259)."""


def _reject_constant(name: str) -> object:
    raise _MalformedJSONError(f"{name} is not JSON")


def _json_or_error(body: bytes) -> object:
    """``body`` parsed as strict JSON, or a :class:`_MalformedJSONError` instance."""
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        # Deep nesting raises RecursionError: malformed for us, never a 500.
        return _MalformedJSONError(type(exc).__name__)


def _malformed_generation(payload: object, body: bytes, *, chat: bool) -> str | None:
    """Why a generation request's body must not be forwarded, or None."""
    if not body:
        return None  # nothing to parse; the engine says what it needs
    if isinstance(payload, _MalformedJSONError):
        return "the body must be one JSON object (strict JSON: no NaN or Infinity)"
    if not isinstance(payload, dict):
        return f"the body must be a JSON object, not {type(payload).__name__}"
    for key in ("max_tokens", "max_completion_tokens"):
        value = payload.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{key} must be an integer, not {type(value).__name__}"
        if not 1 <= value <= MAX_TOKENS_LIMIT:
            return f"{key} must be from 1 to {MAX_TOKENS_LIMIT}, not {value}"
    field, kinds = ("messages", (list,)) if chat else ("prompt", (str, list))
    value = payload.get(field)
    if value is not None and not isinstance(value, kinds):
        allowed = "a list" if chat else "a string or a list"
        return f"{field} must be {allowed}, not {type(value).__name__}"
    return None


def _count_events(tracked: InflightRequest, data: bytes) -> bytes:
    """Count generated tokens from whole SSE events; return the incomplete tail."""
    *events, tail = data.split(b"\n\n")
    for event in events:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            try:
                chunk = json.loads(line[5:])
            except (ValueError, RecursionError):
                continue
            usage = chunk.get("usage") if isinstance(chunk, dict) else None
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                tracked.generated = usage["completion_tokens"]
                _prompt_from_usage(tracked, usage)
            elif isinstance(chunk, dict) and chunk.get("choices"):
                tracked.generated += 1  # one token per content chunk, as engines stream
    return tail


def _count_usage(tracked: InflightRequest, body: bytes) -> None:
    """Completion tokens from a whole answer's ``usage`` (when the body parses)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # an engine's garbage must not fail the answer
        return
    usage = data.get("usage") if isinstance(data, dict) else None
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        tracked.generated = usage["completion_tokens"]
        _prompt_from_usage(tracked, usage)


def _prompt_from_usage(tracked: InflightRequest, usage: dict[str, Any]) -> None:
    """The engine's prompt count from ``usage``, for a prompt only estimated so far."""
    prompt = usage.get("prompt_tokens")
    if (
        tracked.prompt_key is not None
        and isinstance(prompt, int)
        and not isinstance(prompt, bool)
        and 1 <= prompt <= MAX_TOKENS_LIMIT  # an engine's garbage must not be remembered
    ):
        tracked.prompt_tokens = prompt
        tracked.prompt_counted = True


def _answer_has_usage(payload: dict[str, Any]) -> bool:
    """Whether the engine's answer will carry ``usage``: a whole answer, or a stream asked to.

    Truthiness as the engines read it (``"stream": 1`` streams too).
    """
    if not payload.get("stream"):
        return True
    options = payload.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


async def _stream_error(
    response: web.StreamResponse, message: str, code: str = "upstream_error"
) -> None:
    payload = {"error": {"message": message, "type": "server_overloaded", "code": code}}
    try:
        await response.write(f"data: {json.dumps(payload)}\n\n".encode())
        await response.write_eof()
    except ConnectionResetError:
        return


def _error(
    status: int,
    message: str,
    kind: str,
    *,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """An OpenAI-style error answer."""
    body = {"error": {"message": message, "type": kind, "code": code or kind}}
    return web.json_response(body, status=status, headers=headers)
