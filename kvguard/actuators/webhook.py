"""Webhooks: POST a JSON event to each configured URL, off the daemon's loop.

:meth:`Webhooks.notify` is synchronous and never blocks or raises: it renders the
event once and appends it to one queue per URL. One sender task per URL posts its
queue in order, so a slow or dead receiver delays only its own events. A queue
holds at most ``queue_size`` events; past that the oldest is dropped (counted in
``counters["dropped"]``) so that memory stays bounded while a receiver is down.

The body is a compact JSON object with sorted keys, in UTF-8::

    {"at":"2026-11-30T18:29:31.123Z","event":"level_changed",
     "event_id":"0b8e…","kvguard_version":"0.1.0",...}

(on one line), with the event's fields beside ``event``, ``event_id`` (a random
UUID, the same in every attempt and for every URL, so a receiver can tell a retry or
a replay from a new event), ``at`` (RFC 3339, UTC, when ``notify`` was called) and
``kvguard_version``. Headers: ``Content-Type: application/json``,
``User-Agent: kvguard/<version>``, ``X-Kvguard-Event: <event>`` and, when a secret
is configured, ``X-Kvguard-Signature: t=<unix seconds>,v1=<hex>``: ``t`` is when
this attempt was sent, and ``v1`` the HMAC-SHA256, under the secret (its UTF-8
bytes), of ``t``, a ``.`` and the exact body bytes. A receiver verifies the
signature over the raw body before parsing it, refuses a ``t`` further than a
tolerance (5 minutes) from its clock, and acts on each ``event_id`` once: that stops
a captured delivery from being replayed. ``docs/examples/webhook_receiver.py`` does
all three (docs/integrations.md, "Webhooks"). Each attempt is signed afresh, so a
delivery retried after a long backoff is not stale.

A 2xx answer is a delivery. A 5xx or 429 answer, a timeout (``timeout_s`` per
attempt) or a connection error is retried up to ``retries`` more times, waiting
``backoff_s``, then twice that, and so on. Any other answer (a 4xx, or a 3xx:
redirects are not followed, so events go only to the configured host) fails at
once, since sending the same body again cannot change it. An event that fails is
counted in ``counters["failed"]`` and logged as ``webhook_failed`` with the URL
stripped of its userinfo and query string (either may hold a token); the secret
and the body are never logged.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import hashlib
import hmac
import json
import math
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import aiohttp
import structlog
from yarl import URL

from kvguard import __version__
from kvguard.actuators.retry import retry
from kvguard.config.secrets import WEBHOOK_SECRET_MIN_BYTES
from kvguard.errors import InvalidInputError
from kvguard.http_client import client_session

log = structlog.get_logger("kvguard.webhook")

USER_AGENT = f"kvguard/{__version__}"
SIGNATURE_HEADER = "X-Kvguard-Signature"
EVENT_HEADER = "X-Kvguard-Event"
# A receiver's answer is read (so the pooled connection can be reused) only when it
# says it is this small; anything else is left unread and its connection closed.
_DRAIN_BYTES = 64 * 1024
# Errors one attempt can end in: aiohttp's own tree, timeouts, OS-level socket errors.
_HTTP_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


@dataclass(frozen=True, repr=False)
class WebhookSettings:
    """``[webhook]``: where events go and how hard kvguard tries.

    ``retries`` counts attempts *after* the first, so an event gets at most
    ``1 + retries`` attempts per URL (0 means one try, no retry); the waits between
    attempts are ``backoff_s``, ``2 * backoff_s``, ``4 * backoff_s`` ... ``secret``
    is the HMAC key (at least ``WEBHOOK_SECRET_MIN_BYTES`` bytes), already read from
    its file; it never appears in the repr, in a log or in an error. ``queue_size``
    bounds the events waiting for each URL. One event can hold its URL's queue for at
    most ``(1 + retries) * timeout_s`` plus ``backoff_s * (2**retries - 1)`` seconds;
    events behind it wait (other URLs do not), so keep that product modest. A URL
    listed twice is posted to once.
    """

    urls: tuple[str, ...]
    timeout_s: float = 5.0
    retries: int = 3
    backoff_s: float = 1.0
    secret: str | None = None
    queue_size: int = 1000

    def __post_init__(self) -> None:
        for url in self.urls:
            try:
                parsed = URL(url)
            except (ValueError, TypeError):
                parsed = URL()
            if parsed.scheme not in ("http", "https") or not parsed.host:
                raise InvalidInputError(
                    "webhook url", redact_url(url), "must be an http:// or https:// URL"
                )
        if not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise InvalidInputError("webhook timeout_s", self.timeout_s, "must be > 0")
        if self.retries < 0:
            raise InvalidInputError("webhook retries", self.retries, "must be >= 0")
        if not math.isfinite(self.backoff_s) or self.backoff_s < 0:
            raise InvalidInputError("webhook backoff_s", self.backoff_s, "must be >= 0")
        if self.queue_size < 1:
            raise InvalidInputError("webhook queue_size", self.queue_size, "must be >= 1")
        secret_bytes = None if self.secret is None else len(self.secret.encode("utf-8"))
        if secret_bytes is not None and secret_bytes < WEBHOOK_SECRET_MIN_BYTES:
            # An HMAC key is only as strong as it is long: a short one can be guessed
            # offline from one captured delivery. Only its length is shown, never it.
            raise InvalidInputError(
                "webhook secret",
                f"({secret_bytes} bytes)",
                f"must hold at least {WEBHOOK_SECRET_MIN_BYTES} bytes",
            )

    def __repr__(self) -> str:
        # Hand-written so neither the secret nor a token in a URL reaches a log or traceback.
        urls = tuple(redact_url(url) for url in self.urls)
        return (
            f"WebhookSettings(urls={urls!r}, timeout_s={self.timeout_s!r},"
            f" retries={self.retries!r}, backoff_s={self.backoff_s!r},"
            f" secret={'<set>' if self.secret else None}, queue_size={self.queue_size!r})"
        )


def redact_url(url: str) -> str:
    """Only ``scheme://host[:port]`` of ``url``: safe to log.

    Slack, Teams and Discord webhooks carry their secret in the path, others in the
    query or the userinfo: none of it is kept.
    """
    try:
        return str(URL(url).origin())
    except (ValueError, TypeError):
        return "<unparseable url>"


def sign(secret: str, body: bytes, timestamp: int) -> str:
    """The ``X-Kvguard-Signature`` value for ``body`` sent at ``timestamp`` (Unix seconds).

    ``t=<timestamp>,v1=<hex>``, where ``v1`` is the HMAC-SHA256 under ``secret`` of
    ``b"<timestamp>." + body``: the time is signed with the body, so neither can be
    swapped for another's.
    """
    signed = f"{timestamp}.".encode("ascii") + body
    digest = hmac.new(secret.encode("utf-8"), signed, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


@dataclass(frozen=True)
class _Event:
    """One rendered event: the same body to every URL and every attempt.

    ``headers`` lack the signature, which each attempt adds with its own timestamp.
    """

    name: str
    body: bytes
    headers: Mapping[str, str]


@dataclass
class _Target:
    """One URL's queue and sender state."""

    url: str
    shown: str  # redacted, for logs
    queue: deque[_Event]
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: bool = False
    dropping: bool = False  # a drop was logged; quiet until the queue has room again


class Webhooks:
    """Sends events to every configured URL in the background.

    Call :meth:`start` inside the running loop, :meth:`notify` from anywhere on that
    loop, and :meth:`close` at shutdown. ``sleep`` waits between attempts and
    ``wall_clock`` stamps ``at``; tests inject both so nothing really sleeps.
    ``counters`` holds ``sent`` and ``failed`` (per event and URL: delivered, or
    given up after its last attempt) and ``dropped`` (per event and URL: pushed out
    of a full queue, left queued when :meth:`close` ran out of time, notified after
    :meth:`close`, or not encodable as JSON).
    """

    def __init__(
        self,
        settings: WebhookSettings,
        *,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.counters: Counter[str] = Counter({"sent": 0, "failed": 0, "dropped": 0})
        self._sleep = sleep
        self._wall_clock = wall_clock
        self._timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
        self._targets = [
            _Target(url=url, shown=redact_url(url), queue=deque())
            for url in dict.fromkeys(settings.urls)  # the same URL twice would double-send
        ]
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._closed = False

    # ------------------------------------------------------------------ the caller's side
    def notify(self, event: str, **fields: object) -> None:
        """Queue ``event`` with ``fields`` for every URL; returns at once, never raises.

        Fields are made JSON-safe on the way (enums by value, datetimes as ISO 8601,
        NaN and infinities as null, anything else unknown as its ``str``). The
        envelope keys ``event``, ``event_id``, ``at`` and ``kvguard_version`` win
        over fields of the same name, so receivers can rely on them.
        """
        if not self._targets:
            return
        if self._closed:
            self.counters["dropped"] += len(self._targets)
            return
        try:
            rendered = self._render(event, fields)
        except (TypeError, ValueError, RecursionError, OverflowError, OSError) as exc:
            # A caller's bug must not take the daemon's loop down with it.
            self.counters["dropped"] += len(self._targets)
            log.error(  # noqa: TRY400 - a traceback could show the fields, which may be private
                "webhook_event_invalid", event_name=str(event), error=type(exc).__name__
            )
            return
        for target in self._targets:
            if len(target.queue) >= self.settings.queue_size:
                target.queue.popleft()
                self.counters["dropped"] += 1
                if not target.dropping:
                    target.dropping = True
                    log.warning(
                        "webhook_queue_full",
                        url=target.shown,
                        queue_size=self.settings.queue_size,
                    )
            else:
                target.dropping = False
            target.queue.append(rendered)
            target.wakeup.set()

    def _render(self, event: str, fields: Mapping[str, object]) -> _Event:
        at = dt.datetime.fromtimestamp(self._wall_clock(), tz=dt.timezone.utc)
        payload = {str(key): _jsonable(value) for key, value in fields.items()}
        payload.update(
            event=str(event),
            # Random, not a counter: ids stay unique across kvguard restarts and replicas.
            event_id=str(uuid.uuid4()),
            at=at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            kvguard_version=__version__,
        )
        body = json.dumps(
            payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
        headers = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            EVENT_HEADER: str(event),
        }
        return _Event(name=str(event), body=body, headers=headers)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start one sender task per URL (idempotent)."""
        if self._tasks or self._closed:
            return
        # Created here, not in __init__: a ClientSession belongs to the running loop.
        self._session = client_session()  # never an HTTP_PROXY from env
        self._tasks = [
            asyncio.create_task(self._run(target), name=f"kvguard-webhook-{index}")
            for index, target in enumerate(self._targets)
        ]

    async def close(self, *, flush_timeout_s: float = 5.0) -> None:
        """Deliver what is queued within ``flush_timeout_s``, then stop.

        Retries and their waits go on during the flush; whatever is still queued
        or in flight when the bound runs out is counted as dropped.
        """
        if self._closed:
            return
        if not self._tasks and any(target.queue for target in self._targets):
            await self.start()
        self._closing = True
        for target in self._targets:
            target.wakeup.set()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=max(flush_timeout_s, 0.0))
            for task in pending:
                task.cancel()
            # Suppress: a cancelled sender ends in CancelledError, which is expected here.
            await asyncio.gather(*pending, return_exceptions=True)
        self._closed = True
        for target in self._targets:
            left = len(target.queue) + (1 if target.in_flight else 0)
            if left:
                self.counters["dropped"] += left
                log.warning("webhook_flush_incomplete", url=target.shown, dropped=left)
            target.queue.clear()
            target.in_flight = False
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ the sender
    async def _run(self, target: _Target) -> None:
        """Post ``target``'s queue in order until :meth:`close` finds it empty."""
        while True:
            if not target.queue:
                if self._closing:
                    return
                target.wakeup.clear()
                await target.wakeup.wait()
                continue
            event = target.queue.popleft()
            target.in_flight = True
            try:
                delivered = await self._deliver(target, event)
            except Exception as exc:  # noqa: BLE001 - a dead sender would silently stop delivery
                delivered = False
                log.error(  # noqa: TRY400 - a traceback's locals would show the body
                    "webhook_failed", url=target.shown, error=_describe(exc, target), attempts=0
                )
            target.in_flight = False
            self.counters["sent" if delivered else "failed"] += 1

    async def _deliver(self, target: _Target, event: _Event) -> bool:
        """Post one event with retries; True when delivered, False (logged) when not."""
        ran = await retry(
            lambda: self._attempt(target, event),
            attempts=1 + self.settings.retries,
            backoff_s=self.settings.backoff_s,
            retryable=_worth_retrying,
            sleep=self._sleep,
        )
        status, error = ran.outcome
        if status is not None and 200 <= status < 300:
            return True
        log.warning(
            "webhook_failed",
            url=target.shown,
            event_name=event.name,
            status=status,
            error=error,
            attempts=ran.attempts,
        )
        return False

    async def _attempt(self, target: _Target, event: _Event) -> tuple[int | None, str | None]:
        """One POST: its status, or None and a loggable reason when it got no answer."""
        if self._session is None:  # pragma: no cover -- senders run only between start and close
            return None, "not started"
        headers = dict(event.headers)
        if self.settings.secret is not None:
            # Signed per attempt, not per event: the timestamp says when this attempt
            # left, so receivers can hold a tight tolerance however long retries took.
            headers[SIGNATURE_HEADER] = sign(
                self.settings.secret, event.body, int(self._wall_clock())
            )
        try:
            async with self._session.post(
                target.url,
                data=event.body,
                headers=headers,
                timeout=self._timeout,
                allow_redirects=False,
            ) as response:
                length = response.content_length
                if length is not None and length <= _DRAIN_BYTES:
                    await response.read()
                return response.status, None
        except asyncio.TimeoutError:
            return None, f"no answer within {self.settings.timeout_s:g} s"
        except _HTTP_ERRORS as exc:
            return None, _describe(exc, target)


def _worth_retrying(outcome: tuple[int | None, str | None]) -> bool:
    """No answer, 429 or 5xx: another attempt may go through (2xx and other codes are final)."""
    status = outcome[0]
    return status is None or status == 429 or status >= 500


def _describe(exc: BaseException, target: _Target) -> str:
    """``exc`` in one line, without the URL's userinfo or query string."""
    # aiohttp names only host and port in its messages; scrub the full URL anyway in
    # case one ever quotes it with its token.
    return f"{type(exc).__name__}: {exc}".replace(target.url, target.shown)


def _jsonable(value: object) -> object:
    """``value`` as something ``json.dumps(allow_nan=False)`` accepts."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, (set, frozenset)):
        # Sorted so the same event always renders (and signs) the same.
        return sorted((_jsonable(item) for item in value), key=repr)
    return str(value)
