"""Webhooks delivered to real receivers on 127.0.0.1, with sleeps recorded, not slept."""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import hashlib
import hmac
import json
import math

import pytest
from aiohttp import web
from multidict import CIMultiDictProxy
from structlog.testing import capture_logs

from kvguard import __version__
from kvguard.actuators.webhook import Webhooks, WebhookSettings
from kvguard.errors import InvalidInputError
from tests.helpers import free_port, until

NOW = 1_700_000_000.5  # 2023-11-14T22:13:20.500Z
NOW_RFC3339 = "2023-11-14T22:13:20.500Z"
SECRET = "s3cret-Value-never-logged"


def verified(secret: bytes, body: bytes, header: str) -> bool:
    """The receiver's check, as the module docstring shows it."""
    expected = "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, header)


class Receiver:
    """A webhook receiver that records each request and answers from a script.

    ``answers`` are given in order: an HTTP status, or ``"hang"`` for never
    answering (until the test ends); once they run out every request gets 200.
    """

    def __init__(self, answers: list[int | str]) -> None:
        self.answers = answers
        self.paths: list[str] = []
        self.headers: list[CIMultiDictProxy[str]] = []
        self.bodies: list[bytes] = []
        self.release = asyncio.Event()
        self.url = ""
        self._arrived = asyncio.Condition()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.paths.append(request.path)
        self.headers.append(CIMultiDictProxy(request.headers.copy()))
        self.bodies.append(body)
        async with self._arrived:
            self._arrived.notify_all()
        answer = self.answers.pop(0) if self.answers else 200
        if answer == "hang":
            await self.release.wait()
            return web.Response(status=200)
        assert isinstance(answer, int)
        if 300 <= answer < 400:
            return web.Response(status=answer, headers={"Location": "/elsewhere"})
        return web.Response(status=answer, text="ok")

    async def received(self, count: int = 1) -> None:
        """Wait until ``count`` requests have arrived; fail after 5 s."""

        async def arrived() -> None:
            async with self._arrived:
                await self._arrived.wait_for(lambda: len(self.bodies) >= count)

        await asyncio.wait_for(arrived(), 5.0)

    def events(self) -> list[dict]:
        """The JSON bodies received, parsed."""
        return [json.loads(body) for body in self.bodies]


class Sleeps:
    """A no-op ``sleep`` that records the delays it was asked for."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


@pytest.fixture
async def receiver():
    """Start :class:`Receiver` servers on loopback; each call takes its answers."""
    runners: list[web.AppRunner] = []
    receivers: list[Receiver] = []

    async def start(answers: list[int | str] | None = None) -> Receiver:
        rec = Receiver(list(answers or []))
        app = web.Application()
        app.router.add_post("/hook", rec.handle)
        app.router.add_post("/elsewhere", rec.handle)
        # handler_cancellation: a client that gave up cancels the hanging handler.
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        receivers.append(rec)
        rec.url = f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
        return rec

    yield start
    for rec in receivers:
        rec.release.set()
    for runner in reversed(runners):
        await runner.cleanup()


@pytest.fixture
async def webhooks():
    """Make :class:`Webhooks` with a recording sleep and a fixed clock; closed after."""
    made: list[Webhooks] = []

    def make(*urls: str, **settings) -> tuple[Webhooks, Sleeps]:
        sleeps = Sleeps()
        hooks = Webhooks(
            WebhookSettings(urls=urls, **settings), sleep=sleeps, wall_clock=lambda: NOW
        )
        made.append(hooks)
        return hooks, sleeps

    yield make
    for hooks in made:
        await hooks.close(flush_timeout_s=0.1)


async def test_body_and_headers(receiver, webhooks):
    """One POST per event: compact sorted UTF-8 JSON, the envelope, and the headers."""
    rec = await receiver()
    hooks, _ = webhooks(rec.url)
    await hooks.start()
    hooks.notify("level_changed", previous="ok", level="warn", headroom_bytes=1024, why="dépassé")
    await hooks.close()

    assert len(rec.bodies) == 1
    expected = {
        "at": NOW_RFC3339,
        "event": "level_changed",
        "headroom_bytes": 1024,
        "kvguard_version": __version__,
        "level": "warn",
        "previous": "ok",
        "why": "dépassé",
    }
    assert rec.bodies[0] == json.dumps(
        expected, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")
    headers = rec.headers[0]
    assert headers["Content-Type"] == "application/json"
    assert headers["User-Agent"] == f"kvguard/{__version__}"
    assert headers["X-Kvguard-Event"] == "level_changed"
    assert "X-Kvguard-Signature" not in headers
    assert hooks.counters == {"sent": 1, "failed": 0, "dropped": 0}


async def test_signature_verifies_with_the_secret_only(receiver, webhooks):
    """The signature is HMAC-SHA256 over the exact body; another secret does not verify."""
    rec = await receiver()
    hooks, _ = webhooks(rec.url, secret=SECRET)
    await hooks.start()
    hooks.notify("engine_oom", engine="vllm")
    await hooks.close()

    body, header = rec.bodies[0], rec.headers[0]["X-Kvguard-Signature"]
    assert header.startswith("sha256=")
    assert verified(SECRET.encode(), body, header)
    assert not verified(b"another-secret", body, header)
    assert not verified(SECRET.encode(), body + b" ", header)


@pytest.mark.parametrize("status", [503, 429, 500])
async def test_retries_server_errors_with_doubling_backoff(receiver, webhooks, status):
    """5xx and 429 are retried, waiting backoff_s then twice it; the body never changes."""
    rec = await receiver([status, status, 200])
    hooks, sleeps = webhooks(rec.url, retries=3, backoff_s=1.0)
    await hooks.start()
    hooks.notify("action", action="shed")
    await hooks.close()

    assert len(rec.bodies) == 3
    assert len(set(rec.bodies)) == 1
    assert sleeps.delays == [1.0, 2.0]
    assert hooks.counters == {"sent": 1, "failed": 0, "dropped": 0}


async def test_timeout_is_retried(receiver, webhooks):
    """An attempt that gets no answer within timeout_s is retried like a 503."""
    rec = await receiver(["hang", 204])
    hooks, sleeps = webhooks(rec.url, timeout_s=1.0, retries=1, backoff_s=0.5)
    await hooks.start()
    hooks.notify("action_result", ok=True)
    await hooks.close()

    assert len(rec.bodies) == 2
    assert sleeps.delays == [0.5]
    assert hooks.counters == {"sent": 1, "failed": 0, "dropped": 0}


@pytest.mark.parametrize("status", [400, 404, 302])
async def test_other_answers_fail_at_once(receiver, webhooks, status):
    """A 4xx (but 429) or a redirect fails without a retry; redirects are not followed."""
    rec = await receiver([status])
    hooks, sleeps = webhooks(rec.url, retries=3)
    await hooks.start()
    with capture_logs() as logs:
        hooks.notify("action", action="cancel_largest")
        await hooks.close()

    assert rec.paths == ["/hook"]
    assert sleeps.delays == []
    assert hooks.counters == {"sent": 0, "failed": 1, "dropped": 0}
    failed = [e for e in logs if e["event"] == "webhook_failed"]
    assert len(failed) == 1
    assert failed[0]["log_level"] == "warning"
    assert failed[0]["status"] == status
    assert failed[0]["attempts"] == 1


async def test_connection_refused_fails_after_bounded_attempts(webhooks):
    """Nothing listening: 1 + retries attempts, then failed; the URL is logged redacted."""
    port = free_port()
    # Slack, Teams and Discord put the secret in the path: no part of it may be logged.
    url = f"http://user:pa55word@127.0.0.1:{port}/hook/T0/B0/path-secret?token=tok-in-query#frag"
    hooks, sleeps = webhooks(url, retries=2, backoff_s=0.25)
    await hooks.start()
    with capture_logs() as logs:
        hooks.notify("engine_restarted", reason="fp8")
        await hooks.close()

    assert sleeps.delays == [0.25, 0.5]
    assert hooks.counters == {"sent": 0, "failed": 1, "dropped": 0}
    (failed,) = [e for e in logs if e["event"] == "webhook_failed"]
    assert failed["url"] == f"http://127.0.0.1:{port}"
    assert failed["attempts"] == 3
    assert failed["status"] is None
    assert "Connect" in failed["error"]
    assert "tok-in-query" not in repr(logs)
    assert "pa55word" not in repr(logs)
    assert "path-secret" not in repr(logs)


async def test_a_hanging_receiver_blocks_neither_notify_nor_other_urls(receiver, webhooks):
    """notify() only queues; the second URL is served while the first still hangs."""
    hanging = await receiver(["hang"])
    healthy = await receiver()
    hooks, _ = webhooks(hanging.url, healthy.url, timeout_s=5.0, retries=0)
    await hooks.start()

    hooks.notify("level_changed", level="critical")
    # notify() did no I/O itself: nothing has reached either receiver yet.
    assert hanging.bodies == []
    assert healthy.bodies == []

    await hanging.received()
    # Delivered to the healthy URL well before the hanging one could time out (5 s).
    await until(lambda: hooks.counters["sent"] == 1, timeout_s=3.0)
    assert healthy.events()[0]["level"] == "critical"
    assert hooks.counters == {"sent": 1, "failed": 0, "dropped": 0}
    await hooks.close(flush_timeout_s=0.1)
    assert hooks.counters == {"sent": 1, "failed": 0, "dropped": 1}  # still in flight at close


async def test_queue_overflow_drops_the_oldest(receiver, webhooks):
    """Past queue_size the oldest waiting event goes, is counted, and the newest is kept."""
    rec = await receiver()
    hooks, _ = webhooks(rec.url, queue_size=3)
    with capture_logs() as logs:
        for index in range(5):
            hooks.notify("action", index=index)
    assert hooks.counters["dropped"] == 2
    assert [e["event"] for e in logs] == ["webhook_queue_full"]  # once, not per drop

    await hooks.start()
    await hooks.close()
    assert [event["index"] for event in rec.events()] == [2, 3, 4]
    assert hooks.counters == {"sent": 3, "failed": 0, "dropped": 2}


async def test_events_are_sent_as_they_come_while_running(receiver, webhooks):
    """An idle sender wakes for each new event; close() is not needed to send."""
    rec = await receiver()
    hooks, _ = webhooks(rec.url)
    await hooks.start()
    hooks.notify("action", index=0)
    await rec.received(1)
    await until(lambda: hooks.counters["sent"] == 1)  # the sender is idle again
    hooks.notify("action", index=1)
    await rec.received(2)
    assert [event["index"] for event in rec.events()] == [0, 1]


async def test_close_flushes_queued_events_in_order(receiver, webhooks):
    """Events queued when close() is called are all delivered, in order, before it returns."""
    rec = await receiver()
    hooks, _ = webhooks(rec.url)
    await hooks.start()
    for index in range(5):
        hooks.notify("action", index=index)
    await hooks.close(flush_timeout_s=5.0)

    assert [event["index"] for event in rec.events()] == [0, 1, 2, 3, 4]
    assert hooks.counters == {"sent": 5, "failed": 0, "dropped": 0}


async def test_close_is_bounded_and_counts_what_it_left(receiver, webhooks):
    """A receiver that never answers cannot hold close() past its bound."""
    rec = await receiver(["hang"])
    hooks, _ = webhooks(rec.url, timeout_s=30.0)
    await hooks.start()
    hooks.notify("action", index=0)
    hooks.notify("action", index=1)
    await rec.received()

    await asyncio.wait_for(hooks.close(flush_timeout_s=0.1), timeout=5.0)
    # One in flight and one still queued: neither delivered, neither "failed".
    assert hooks.counters == {"sent": 0, "failed": 0, "dropped": 2}
    hooks.notify("action", index=2)  # after close: counted, not raised
    assert hooks.counters["dropped"] == 3


async def test_secret_never_appears_in_logs(receiver, webhooks):
    """Failures and bad events are logged without the secret (or the body)."""
    rejecting = await receiver([400])
    refused = f"http://127.0.0.1:{free_port()}/hook"
    hooks, _ = webhooks(rejecting.url, refused, secret=SECRET, retries=1)
    await hooks.start()
    circular: dict = {}
    circular["self"] = circular
    with capture_logs() as logs:
        hooks.notify("action", action="shed", note="body-marker")
        hooks.notify("action", bad=circular)
        await hooks.close()

    events = [e["event"] for e in logs]
    assert events.count("webhook_failed") == 2
    assert "webhook_event_invalid" in events
    assert SECRET not in repr(logs)
    assert "body-marker" not in repr(logs)
    assert SECRET not in repr(hooks.settings)


class Level(enum.Enum):
    """A stand-in for the daemon's level enum."""

    WARN = "warn"


async def test_odd_fields_are_made_json_safe_and_envelope_wins(receiver, webhooks):
    """Enums, datetimes, NaN, sets and unknown objects render; reserved keys stay kvguard's."""
    rec = await receiver()
    hooks, _ = webhooks(rec.url)
    await hooks.start()
    hooks.notify(
        "level_changed",
        level=Level.WARN,
        since=dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc),
        forecast_s=math.nan,
        gpus={2, 1},
        thing=object(),
        at="not-a-time",
        kvguard_version="forged",
    )
    await hooks.close()

    (event,) = rec.events()
    assert event["level"] == "warn"
    assert event["since"] == "2026-01-02T03:04:05+00:00"
    assert event["forecast_s"] is None
    assert event["gpus"] == [1, 2]
    assert event["thing"].startswith("<object object")
    assert event["at"] == NOW_RFC3339
    assert event["kvguard_version"] == __version__


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"urls": ("ftp://127.0.0.1/hook?token=t0k",)}, "webhook url"),
        ({"urls": ("http://127.0.0.1/",), "timeout_s": 0}, "webhook timeout_s"),
        ({"urls": (), "retries": -1}, "webhook retries"),
        ({"urls": (), "backoff_s": -1.0}, "webhook backoff_s"),
        ({"urls": (), "queue_size": 0}, "webhook queue_size"),
        ({"urls": (), "secret": ""}, "webhook secret"),
    ],
)
def test_settings_are_validated(settings, field):
    """A bad setting is a clear error naming it; a URL's token is not repeated in it."""
    with pytest.raises(InvalidInputError) as caught:
        WebhookSettings(**settings)
    assert caught.value.field == field
    assert "t0k" not in str(caught.value)
