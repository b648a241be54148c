"""Webhooks delivered to real receivers on 127.0.0.1, with sleeps recorded, not slept.

The documented receiver (docs/examples/webhook_receiver.py, shown whole in
docs/integrations.md) is run here too, against kvguard's own deliveries.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import hashlib
import hmac
import importlib.util
import json
import math
import re
import threading
import uuid
from pathlib import Path
from types import ModuleType

import aiohttp
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
SECRET = "s3cret-Value-never-logged-0123456789"  # 36 bytes: the minimum is 32
ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "webhook_receiver.py"


def verified(secret: bytes, body: bytes, header: str) -> bool:
    """The signature check as docs/integrations.md specifies it, written apart from kvguard's."""
    items = dict(item.split("=", 1) for item in header.split(","))
    signed = items["t"].encode("ascii") + b"." + body
    expected = hmac.new(secret, signed, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, items["v1"])


def header_time(header: str) -> int:
    """The ``t=`` of an ``X-Kvguard-Signature`` header."""
    return int(dict(item.split("=", 1) for item in header.split(","))["t"])


class Clock:
    """A wall clock the test moves (and :class:`Sleeps` moves by what it is asked to sleep)."""

    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


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
    """A ``sleep`` that records the delays asked for and moves ``clock`` on, if given."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.delays: list[float] = []
        self.clock = clock

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        if self.clock is not None:
            self.clock.now += delay


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

    def make(*urls: str, clock: Clock | None = None, **settings) -> tuple[Webhooks, Sleeps]:
        sleeps = Sleeps(clock)
        hooks = Webhooks(
            WebhookSettings(urls=urls, **settings), sleep=sleeps, wall_clock=clock or Clock()
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
    event_id = json.loads(rec.bodies[0])["event_id"]
    assert uuid.UUID(event_id).version == 4
    expected = {
        "at": NOW_RFC3339,
        "event": "level_changed",
        "event_id": event_id,
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
    """t=<send time>,v1=HMAC-SHA256 of "<t>.<body>"; another secret, body or t does not verify."""
    rec = await receiver()
    hooks, _ = webhooks(rec.url, secret=SECRET)
    await hooks.start()
    hooks.notify("engine_oom", engine="vllm")
    await hooks.close()

    body, header = rec.bodies[0], rec.headers[0]["X-Kvguard-Signature"]
    assert header == f"t={int(NOW)},v1={header.split(',v1=')[1]}"
    assert len(header.split(",v1=")[1]) == 64  # hex SHA-256
    assert verified(SECRET.encode(), body, header)
    assert not verified(b"another-secret-of-at-least-32-bytes!", body, header)
    assert not verified(SECRET.encode(), body + b" ", header)
    moved = header.replace(f"t={int(NOW)}", f"t={int(NOW) + 600}")  # a replay, re-dated
    assert not verified(SECRET.encode(), body, moved)


async def test_event_ids_are_unique_per_event_and_kept_across_urls_and_retries(receiver, webhooks):
    """Each event has its own event_id; every URL and every retry gets the same one."""
    flaky = await receiver([503])
    steady = await receiver()
    hooks, _ = webhooks(flaky.url, steady.url, retries=1)
    await hooks.start()
    hooks.notify("action", index=0)
    hooks.notify("action", index=1)
    await hooks.close()

    flaky_ids = [event["event_id"] for event in flaky.events()]
    steady_ids = [event["event_id"] for event in steady.events()]
    assert flaky_ids[0] == flaky_ids[1]  # the 503, then its retry
    assert flaky_ids[1:] == steady_ids
    assert len(set(steady_ids)) == 2


async def test_each_attempt_is_signed_when_it_is_sent(receiver, webhooks):
    """A retry after a long backoff carries its own time, so it is not stale on arrival."""
    rec = await receiver([503, 503, 503])
    clock = Clock()
    hooks, sleeps = webhooks(rec.url, secret=SECRET, retries=3, backoff_s=100.0, clock=clock)
    await hooks.start()
    hooks.notify("engine_restarted", reason="crash")
    await hooks.close()

    assert sleeps.delays == [100.0, 200.0, 400.0]
    signatures = [headers["X-Kvguard-Signature"] for headers in rec.headers]
    assert [header_time(h) for h in signatures] == [int(NOW) + d for d in (0, 100, 300, 700)]
    assert len(set(rec.bodies)) == 1  # the same body, the same event_id
    assert all(verified(SECRET.encode(), rec.bodies[0], h) for h in signatures)
    # The last attempt, 700 s after the event, is fresh for the documented receiver.
    verifier = load_example().Verifier(SECRET.encode(), clock=clock)
    assert verifier.verify(rec.bodies[-1], signatures[-1])["event"] == "engine_restarted"


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
        ({"urls": (), "secret": "x" * 31}, "webhook secret"),
        ({"urls": (), "secret": "é" * 15 + "x"}, "webhook secret"),  # 31 bytes, 16 characters
    ],
)
def test_settings_are_validated(settings, field):
    """A bad setting is a clear error naming it; a URL's token is not repeated in it."""
    with pytest.raises(InvalidInputError) as caught:
        WebhookSettings(**settings)
    assert caught.value.field == field
    assert "t0k" not in str(caught.value)


def test_a_secret_of_32_bytes_is_enough():
    """The minimum counts UTF-8 bytes: 32 ASCII characters, or 16 two-byte ones."""
    assert WebhookSettings(urls=(), secret="x" * 32).secret == "x" * 32
    assert WebhookSettings(urls=(), secret="é" * 16).secret == "é" * 16
    with pytest.raises(InvalidInputError) as caught:
        WebhookSettings(urls=(), secret="short-secret")
    assert caught.value.allowed == "must hold at least 32 bytes"
    assert "short-secret" not in str(caught.value)  # its length only, never the value


# ---------------------------------------------------------------- the documented receiver
def load_example() -> ModuleType:
    """docs/examples/webhook_receiver.py, imported from its file."""
    spec = importlib.util.spec_from_file_location("webhook_receiver_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_receiver_is_the_example_file():
    """docs/integrations.md shows the example file whole and unchanged: the two cannot drift."""
    doc = (ROOT / "docs" / "integrations.md").read_text(encoding="utf-8")
    code = EXAMPLE.read_text(encoding="utf-8")
    assert f"```python\n{code}```\n" in doc


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (code blocks skipped)."""
    anchors, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif line.startswith("#") and not fenced:
            heading = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", heading).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", ["configuration.md", "integrations.md"])
def test_links_between_the_configuration_and_integration_pages_resolve(page):
    """Each `(page.md#anchor)` link names a heading there (integrations.md#webhooks did not)."""
    docs = ROOT / "docs"
    text = (docs / page).read_text(encoding="utf-8")
    links = re.findall(r"\]\(([\w-]*\.md)?#([\w-]+)\)", text)
    broken = [
        f"{target}#{anchor}"
        for target, anchor in links
        if anchor not in heading_anchors(docs / (target or page))
    ]
    assert broken == []


@pytest.fixture
def example_receiver():
    """Run the example's server on loopback in a thread; its clock is the test's."""
    example = load_example()
    clock = Clock()
    accepted: list[dict] = []
    verifier = example.Verifier(SECRET.encode(), clock=clock)
    server = example.make_server("127.0.0.1", 0, verifier, accepted.append)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    yield url, clock, accepted
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


async def post(url: str, body: bytes, headers) -> tuple[int, str]:
    """POST ``body`` with ``headers`` (a captured delivery's) and the answer's status and text."""
    keep = {k: v for k, v in headers.items() if k.lower() not in ("host", "content-length")}
    async with aiohttp.ClientSession() as http, http.post(url, data=body, headers=keep) as resp:
        return resp.status, await resp.text()


async def test_example_receiver_accepts_deliveries_and_refuses_replays(
    receiver, webhooks, example_receiver
):
    """Real deliveries pass; the same delivery replayed, now or later, or altered, does not."""
    url, receiver_clock, accepted = example_receiver
    tap = await receiver()  # captures what an eavesdropper would see
    hooks, _ = webhooks(url, tap.url, secret=SECRET)
    await hooks.start()
    hooks.notify("level_changed", previous="ok", level="high")
    hooks.notify("action", action="shed", level="high")
    await hooks.close()
    assert hooks.counters == {"sent": 4, "failed": 0, "dropped": 0}
    assert [event["event"] for event in accepted] == ["level_changed", "action"]
    body, headers = tap.bodies[0], tap.headers[0]

    # Replayed at once: answered 200 (so a retry stops) but not acted on again.
    assert await post(url, body, headers) == (
        200,
        f"event {accepted[0]['event_id']} already received",
    )
    assert len(accepted) == 2

    # Replayed after the 5-minute tolerance: stale. (Its id may be forgotten by then.)
    receiver_clock.now = NOW + 301
    status, text = await post(url, body, headers)
    assert (status, text.split(":")[0]) == (401, "stale")

    # Re-dated to look fresh: the signature no longer matches.
    signature = headers["X-Kvguard-Signature"].replace(f"t={int(NOW)}", f"t={int(NOW) + 301}")
    assert await post(url, body, {**headers, "X-Kvguard-Signature": signature}) == (
        401,
        "bad signature",
    )

    # Altered body, or no signature: refused; nothing more was acted on.
    receiver_clock.now = NOW
    forged = body.replace(b'"level":"high"', b'"level":"ok"')
    assert forged != body
    assert (await post(url, forged, headers))[0] == 401
    unsigned = {k: v for k, v in headers.items() if k != "X-Kvguard-Signature"}
    assert (await post(url, body, unsigned))[0] == 401
    assert len(accepted) == 2


async def test_example_receiver_turns_away_a_kvguard_with_another_secret(
    webhooks, example_receiver
):
    """Deliveries signed with another secret fail at once (401 is final) and are counted."""
    url, _, accepted = example_receiver
    hooks, sleeps = webhooks(url, secret="another-secret-of-at-least-32-bytes!", retries=3)
    await hooks.start()
    with capture_logs() as logs:
        hooks.notify("engine_oom", pid=1)
        await hooks.close()
    assert accepted == []
    assert sleeps.delays == []
    assert hooks.counters == {"sent": 0, "failed": 1, "dropped": 0}
    assert [(e["event"], e["status"]) for e in logs if e["event"] == "webhook_failed"] == [
        ("webhook_failed", 401)
    ]
